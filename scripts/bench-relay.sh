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
. scripts/bench-lib.sh
cluster_up 2
# events has 4 shards: 0 and 2 on node 1, 1 and 3 on node 2 (the settle window spread them).
owner=$(curl -fsS --cacert "$D/control/tls/ca.pem" -H "Authorization: Bearer $(cat "$D/control/admin.token")" \
  https://127.0.0.1:7409/v1/tenants/default/namespaces/default/streams/events \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["placement"][0]["owner"])')
[ "$owner" = 1 ] || { echo "shard 0 is on node $owner, expected 1" >&2; exit 1; }
LOAD=(--mode ingest --shard 0 --payload 128 --inflight 64 --count 200000)
for i in $(seq "$RUNS"); do
  cluster_run "$OUT" direct --broker 127.0.0.1:7420 "${LOAD[@]}"
  cluster_run "$OUT" relay --broker 127.0.0.1:7430 "${LOAD[@]}"
done
