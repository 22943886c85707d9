#!/usr/bin/env bash
# The tail at fanout 1 and 10: publish → delivered-to-all latency, one 128-byte message in
# flight, 200,000 samples per run (so a p999 is the 200th worst of each run), Felix
# (felix-loadgen --mode latency) against NATS with TLS (peer-bench --mode core-latency --tls),
# alternated, broker or server on core 0 and load on core 1, a fresh one per run. One JSON line
# per run to OUT, tagged "case" = "<system> lat-128-f<F>"; then per case the medians of p50,
# p99 and p999 over the runs and each run's p999 (felix-loadgen --mode summarize reads the same
# file).
# Usage: scripts/bench-tail.sh OUT.jsonl [ROUNDS=3] [SAMPLES=200000]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl [ROUNDS] [SAMPLES]}; ROUNDS=${2:-3}; N=${3:-200000}
PB="${PEER_BENCH:-/var/cache/peer-bench-target/release/peer-bench}"
. scripts/bench-lib.sh
nats() { # $1 fanout
  local R
  if R=$(timeout 300 taskset -c 1 "$PB" --server-cpu 0 --tls --max-secs 200 --json \
      --mode core-latency --payload 128 --fanout "$1" --count "$N" 2>/dev/null); then
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]=sys.argv[2]; print(json.dumps(d))' \
      "$R" "nats-tls lat-128-f$1" >> "$OUT"
  else
    echo "FAILED nats-tls f$1" >&2
  fi
}
for i in $(seq 1 "$ROUNDS"); do
  for f in 1 10; do
    echo "round $i/$ROUNDS fanout $f $(date -u +%T)" >&2
    if [ $((i % 2)) -eq 1 ]; then
      felix_run "$OUT" "felix lat-128-f$f" -- --max-secs 200 --mode latency --payload 128 --fanout "$f" --count "$N"
      nats "$f"
    else
      nats "$f"
      felix_run "$OUT" "felix lat-128-f$f" -- --max-secs 200 --mode latency --payload 128 --fanout "$f" --count "$N"
    fi
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for l in open(sys.argv[1]):
    if not l.startswith("{"): continue
    d = json.loads(l)
    r = d.get("result", d)
    # Felix: delivered-to-all is "all_f" (p50, p99, p999); peer-bench: result.all_subscribers_delivered
    # (p50_us, p99_us, p999_us).
    lat = r.get("all_f")
    if lat is None:
        a = r.get("all_subscribers_delivered") or {}
        lat = {k: a.get(k + "_us") for k in ("p50", "p99", "p999")} if a else {}
    runs[d["case"]].append(lat)
print("| case | runs | p50 µs | p99 µs | p999 µs | each run's p999 |")
print("|---|---|---|---|---|---|")
for case in sorted(runs):
    rs = [x for x in runs[case] if x]
    if not rs: continue
    m = lambda k: statistics.median(x[k] for x in rs)
    print(f"| {case} | {len(rs)} | {m('p50'):.0f} | {m('p99'):.0f} | {m('p999'):.0f} | {', '.join(str(x['p999']) for x in rs)} |")
PY
