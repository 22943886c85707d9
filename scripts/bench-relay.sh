#!/usr/bin/env bash
# The cost of relaying: acked publishes to one shard straight to its owner (broker 1) against
# the same publishes sent to broker 2, which forwards them to broker 1 over its peer link.
# One cluster (scripts/cluster.sh 2: control plane and both brokers pinned to core 0, one
# core each), felix-loadgen on core 1; the two cases alternate, RUNS rounds of each, same
# shard, same settings. Appends one JSON line per run to OUT ("case": direct | relay).
#
#   scripts/bench-relay.sh bench-results/$(date +%F)-relay.jsonl 5
# Needs the release build (cargo build --release --workspace --bins).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/bench-relay.sh OUT.jsonl [RUNS]}"
RUNS="${2:-5}"
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
D=$(mktemp -d -p "${BENCH_TMP:-/var/tmp}")
FELIX_DATA_DIR="$D" FELIX_BIN_DIR="$T" FELIX_PLACEMENT_SETTLE_MS=500 \
  taskset -c 0 ./scripts/cluster.sh 2 > "$D/cluster.log" 2>&1 &
CL=$!
trap 'kill -TERM "$CL" 2>/dev/null; wait "$CL" 2>/dev/null; rm -rf "$D"' EXIT
for _ in $(seq 300); do grep -q "Ctrl-C stops" "$D/cluster.log" && break; sleep 0.1; done
grep -q "Ctrl-C stops" "$D/cluster.log" || { cat "$D/cluster.log" >&2; exit 1; }
# events has 4 shards: 0 and 2 on node 1, 1 and 3 on node 2 (the settle window spread them).
owner=$(curl -fsS http://127.0.0.1:7409/v1/tenants/default/namespaces/default/streams/events \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["placement"][0]["owner"])')
[ "$owner" = 1 ] || { echo "shard 0 is on node $owner, expected 1" >&2; exit 1; }
run() {
  local case=$1 broker=$2 R
  R=$(timeout 200 taskset -c 1 "$T/felix-loadgen" --json --mode ingest --broker "$broker" \
      --ca "$D/certs/ca.pem" --shard 0 --payload 128 --inflight 64 --count 200000) \
    && python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]=sys.argv[2]; d["rev"]=sys.argv[3]; d["date"]=sys.argv[4]; print(json.dumps(d))' \
       "$R" "$case" "$(git rev-parse --short HEAD)" "$(date -u +%FT%TZ)" >> "$OUT" \
    || echo "FAILED $case" >&2
}
for i in $(seq "$RUNS"); do
  run direct 127.0.0.1:7420
  run relay 127.0.0.1:7430
done
