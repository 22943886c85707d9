#!/usr/bin/env bash
# A ClusterClient throughput run over three brokers, against one broker's own shard, in one
# cluster: scripts/cluster.sh 3 pinned to core 0 (control plane and three brokers of one core
# each share it), felix-loadgen on core 1, acked publishes of one record with 64 awaiting.
#   cluster: --brokers all three, round robin over the 6 shards of events, each publish
#            sent by the ClusterClient to its shard's owner;
#   single:  --broker node 1, shard 0 (which node 1 owns): one broker does all the work.
# Alternated, RUNS rounds each. Appends one JSON line per run to OUT.
#
#   scripts/bench-cluster.sh bench-results/$(date +%F)-cluster.jsonl 5
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/bench-cluster.sh OUT.jsonl [RUNS]}"
RUNS="${2:-5}"
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
D=$(mktemp -d -p "${BENCH_TMP:-/var/tmp}")
FELIX_DATA_DIR="$D" FELIX_BIN_DIR="$T" FELIX_PLACEMENT_SETTLE_MS=500 \
  taskset -c 0 ./scripts/cluster.sh 3 > "$D/cluster.log" 2>&1 &
CL=$!
trap 'kill -TERM "$CL" 2>/dev/null; wait "$CL" 2>/dev/null; rm -rf "$D"' EXIT
for _ in $(seq 300); do grep -q "Ctrl-C stops" "$D/cluster.log" && break; sleep 0.1; done
grep -q "Ctrl-C stops" "$D/cluster.log" || { cat "$D/cluster.log" >&2; exit 1; }
run() {
  local case=$1 R; shift
  R=$(timeout 200 taskset -c 1 "$T/felix-loadgen" --json --mode ingest --ca "$D/certs/ca.pem" \
      --payload 128 --inflight 64 --count 200000 "$@") \
    && python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]=sys.argv[2]; d["rev"]=sys.argv[3]; d["date"]=sys.argv[4]; print(json.dumps(d))' \
       "$R" "$case" "$(git rev-parse --short HEAD)" "$(date -u +%FT%TZ)" >> "$OUT" \
    || echo "FAILED $case" >&2
}
for i in $(seq "$RUNS"); do
  run cluster --brokers 127.0.0.1:7420,127.0.0.1:7430,127.0.0.1:7440
  run single --broker 127.0.0.1:7420 --shard 0
done
