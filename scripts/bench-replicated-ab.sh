#!/usr/bin/env bash
# A/B of replicated acked ingest: two builds of Felix (directories holding felix-broker,
# felix-controlplane, felixctl and felix-loadgen), alternated run by run, each on a fresh
# three-broker cluster (bench-lib.sh's replicated_run: all on core 0, the load on core 1),
# ROUNDS rounds; one JSON line per run to OUT (case A-<consistency> or B-<consistency>), then
# the medians.
#
#   scripts/bench-replicated-ab.sh /var/tmp/felix-A/release /var/tmp/felix-B/release \
#     bench-results/$(date +%F)-replicated-ab.jsonl 5 quorum
set -euo pipefail
cd "$(dirname "$0")/.."
A="${1:?usage: scripts/bench-replicated-ab.sh A_BIN_DIR B_BIN_DIR OUT.jsonl [ROUNDS] [CONSISTENCY]}"
B="${2:?B_BIN_DIR}"; OUT="${3:?OUT.jsonl}"; ROUNDS="${4:-5}"; CONS="${5:-quorum}"
. scripts/bench-lib.sh
for _ in $(seq "$ROUNDS"); do
  for v in A B; do
    if [ "$v" = A ]; then T="$A"; else T="$B"; fi
    replicated_run "$OUT" "$v-$CONS" "$CONS" 1024 32 "${COUNT:-50000}"
  done
done
python3 - "$OUT" <<'PY'
import json, statistics as st, sys
by = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    by.setdefault(r["case"], []).append(r)
for case, rs in sorted(by.items()):
    a = [r["acks_per_s"] for r in rs]
    p50 = st.median(r["ack"]["p50"] for r in rs) / 1000
    p99 = st.median(r["ack"]["p99"] for r in rs) / 1000
    print(f"{case}: n={len(rs)} acks/s median {st.median(a):.0f} ({min(a):.0f}-{max(a):.0f}), p50 {p50:.2f} ms, p99 {p99:.2f} ms")
PY
