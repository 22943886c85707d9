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
. scripts/bench-lib.sh
cluster_up 3
LOAD=(--mode ingest --payload 128 --inflight 64 --count 200000)
for i in $(seq "$RUNS"); do
  cluster_run "$OUT" cluster --brokers 127.0.0.1:7420,127.0.0.1:7430,127.0.0.1:7440 "${LOAD[@]}"
  cluster_run "$OUT" single --broker 127.0.0.1:7420 --shard 0 "${LOAD[@]}"
done
