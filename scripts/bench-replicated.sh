#!/usr/bin/env bash
# Replicated acked ingest: Felix on three brokers (scripts/cluster.sh 3 with the control plane's
# --replication-preview, all pinned to core 0 with felix-loadgen on core 1), one stream of one
# shard with three copies, against NATS JetStream with three replicas (peer-bench js-publish
# --js-replicas 3, its three servers on core 0, TLS, file storage, server-default sync).
#   felix-r3-quorum: consistency quorum (acknowledged at the commit mark: a majority holds
#                    the batch and the control plane has the leader's report saying so);
#   felix-r3-leader: consistency leader (acknowledged once the leader wrote it);
#   nats-r3:         a PubAck (the stream leader and one follower stored it);
#   felix-r1:        the same cluster, the stream of one copy (acknowledged once written).
# Felix streams use fsync periodic, as JetStream's default sync. A fresh cluster per Felix run;
# the load goes to the shard's leader. Alternated, RUNS rounds. One JSON line per run to OUT.
#
#   scripts/bench-replicated.sh bench-results/$(date +%F)-replicated.jsonl 3
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: scripts/bench-replicated.sh OUT.jsonl [RUNS] [PAYLOAD] [INFLIGHT]}"
RUNS="${2:-3}"; PAYLOAD="${3:-1024}"; INFLIGHT="${4:-32}"
COUNT="${COUNT:-50000}"
PB="${PEER_BENCH:-/var/cache/peer-bench-target/release/peer-bench}"
. scripts/bench-lib.sh

# felix_r3 CASE CONSISTENCY: one run (bench-lib.sh's replicated_run).
felix_r3() {
  replicated_run "$OUT" "$1" "$2" "$PAYLOAD" "$INFLIGHT" "$COUNT"
}

nats_r3() {
  local R
  R=$(timeout 200 taskset -c 1 "$PB" --server-cpu 0 --tls --max-secs 120 --json --mode js-publish \
      --js-replicas 3 --payload "$PAYLOAD" --inflight "$INFLIGHT" --count "$COUNT") \
    && python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]="nats-r3"; d["date"]=sys.argv[2]; print(json.dumps(d))' \
       "$R" "$(date -u +%FT%TZ)" >> "$OUT" \
    || echo "FAILED nats-r3" >&2
}

for i in $(seq "$RUNS"); do
  felix_r3 felix-r3-quorum quorum
  nats_r3
  felix_r3 felix-r3-leader leader
  felix_r3 felix-r1 r1
done
