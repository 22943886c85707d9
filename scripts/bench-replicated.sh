#!/usr/bin/env bash
# Replicated acked ingest: Felix on three brokers (scripts/cluster.sh 3 with the control plane's
# --replication-preview, all pinned to core 0 with felix-loadgen on core 1), one stream of one
# shard with three copies, against NATS JetStream with three replicas (peer-bench js-publish
# --js-replicas 3, its three servers on core 0, TLS, file storage, server-default sync).
#   felix-r3-quorum: consistency quorum (acknowledged at the commit mark: a majority holds
#                    the batch and the control plane has the leader's report saying so);
#   felix-r3-leader: consistency leader (acknowledged once the leader wrote it);
#   nats-r3:         a PubAck (the stream leader and one follower stored it).
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

# felix_r3 CASE CONSISTENCY: a fresh three-broker cluster, the stream r3, one ingest run.
felix_r3() {
  local case=$1 consistency=$2
  FELIX_REPLICATION_PREVIEW=true cluster_up 3
  local url=https://127.0.0.1:7409 token
  token="$(cat "$D/control/admin.token")"
  export FELIX_CONTROLPLANE_CA="$D/control/tls/ca.pem"
  "$T/felixctl" --controlplane "$url" --token "$token" stream create r3 --durable --shards 1 \
    --fsync periodic --replication-factor 3 --consistency "$consistency" > /dev/null
  # Served once a landed report committed the leader's generation-start record.
  local leader=""
  for _ in $(seq 300); do
    leader=$(curl -fsS --cacert "$FELIX_CONTROLPLANE_CA" -H "Authorization: Bearer $token" \
      "$url/v1/tenants/default/namespaces/default/streams/r3/replication" 2>/dev/null \
      | python3 -c 'import json,sys; s=json.load(sys.stdin)["shards"][0]; print(s["leader"] if s.get("commit",0)>=1 else "")' \
      2>/dev/null || true)
    [ -n "$leader" ] && break
    sleep 0.1
  done
  [ -n "$leader" ] || { echo "r3 never served" >&2; cluster_down || true; return; }
  # A new leader takes publishes once it waited out any older lease (rule 4): probe with one.
  local ok=""
  for _ in $(seq 100); do
    if "$T/felixctl" --broker "127.0.0.1:$((7410 + 10 * leader))" --ca "$D/certs/ca.pem" \
      --token "$token" --tenant default --namespace default publish r3 probe > /dev/null 2>&1; then
      ok=1; break
    fi
    sleep 0.1
  done
  [ -n "$ok" ] || { echo "r3 never took a publish" >&2; cluster_down || true; return; }
  cluster_run "$OUT" "$case" --broker "127.0.0.1:$((7410 + 10 * leader))" --mode ingest \
    --stream r3 --shard 0 --payload "$PAYLOAD" --inflight "$INFLIGHT" --count "$COUNT" --max-secs 120
  cluster_down || true
  trap - EXIT
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
done
