# Shared by the Felix-only campaign scripts (source it): one run on a fresh broker, pinned
# like every campaign (broker --cores 1 on core 0, felix-loadgen on core 1).
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
# The broker binary (an A/B run points it at another revision's build).
BROKER_BIN="${FELIX_BROKER_BIN:-$T/felix-broker}"

# felix_run OUT CASE [BROKER ARGS...] -- LOADGEN ARGS...
# Starts felix-broker in a fresh temp dir, runs felix-loadgen against it and appends its
# result line (--json) to OUT with "case", "rev" and "date" added. In either argument list `{dir}`
# stands for the run's temp dir and `{pid}` for the broker's pid.
felix_run() {
  local out=$1 case=$2; shift 2
  local D; D=$(mktemp -d -p "${BENCH_TMP:-/var/tmp}")
  local broker=() load=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do broker+=("${1//\{dir\}/$D}"); shift; done
  shift
  taskset -c 0 "$BROKER_BIN" --cores 1 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --data-dir "$D/data" "${broker[@]}" > "$D/out" 2>/dev/null &
  local PID=$!
  for a in "$@"; do a="${a//\{dir\}/$D}"; load+=("${a//\{pid\}/$PID}"); done
  for _ in $(seq 100); do grep -q ready "$D/out" 2>/dev/null && break; sleep 0.1; done
  local ADDR; ADDR=$(grep -o 'quic=[^ ]*' "$D/out" | cut -d= -f2)
  local R
  # Auth is on (standalone), as users run it: the load presents the admin token.
  R=$(FELIX_TOKEN="$(cat "$D/data/auth/admin.token" 2>/dev/null)" \
      timeout 200 taskset -c 1 "$T/felix-loadgen" --json --broker "$ADDR" --ca "$D/data/tls/dev-cert.pem" "${load[@]}") \
    && python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]=sys.argv[2]; d["rev"]=sys.argv[3]; d["date"]=sys.argv[4]; print(json.dumps(d))' \
       "$R" "$case" "$(git rev-parse --short HEAD)" "$(date -u +%FT%TZ)" >> "$out" \
    || echo "FAILED $case" >&2
  kill "$PID"; wait "$PID" 2>/dev/null || true; rm -rf "$D"
}

# cluster_up N: scripts/cluster.sh N pinned to core 0 in a fresh temp dir $D (settle window
# 500 ms), waiting until it is ready; cluster_down stops it. Sets D and CL.
cluster_up() {
  D=$(mktemp -d -p "${BENCH_TMP:-/var/tmp}")
  FELIX_DATA_DIR="$D" FELIX_BIN_DIR="$T" FELIX_PLACEMENT_SETTLE_MS=500 \
    taskset -c 0 ./scripts/cluster.sh "$1" > "$D/cluster.log" 2>&1 &
  CL=$!
  trap cluster_down EXIT
  for _ in $(seq 300); do grep -q "Ctrl-C stops" "$D/cluster.log" && break; sleep 0.1; done
  grep -q "Ctrl-C stops" "$D/cluster.log" || { cat "$D/cluster.log" >&2; exit 1; }
}
cluster_down() {
  kill -TERM "$CL" 2>/dev/null; wait "$CL" 2>/dev/null; rm -rf "$D"
}

# cluster_run OUT CASE LOADGEN ARGS...: one felix-loadgen --json run on core 1 against the
# cluster (its CA), its result appended to OUT with "case", "rev" and "date".
cluster_run() {
  local out=$1 case=$2 R; shift 2
  R=$(FELIX_TOKEN="$(cat "$D/control/admin.token" 2>/dev/null)" \
      timeout 200 taskset -c 1 "$T/felix-loadgen" --json --ca "$D/certs/ca.pem" "$@") \
    && python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]=sys.argv[2]; d["rev"]=sys.argv[3]; d["date"]=sys.argv[4]; print(json.dumps(d))' \
       "$R" "$case" "$(git rev-parse --short HEAD)" "$(date -u +%FT%TZ)" >> "$out" \
    || echo "FAILED $case" >&2
}

# replicated_run OUT CASE CONSISTENCY PAYLOAD INFLIGHT COUNT: a fresh three-broker cluster
# (scripts/cluster.sh 3 with --replication-preview, on core 0), the stream r3 of one shard
# with three copies (CONSISTENCY quorum or leader; r1: one copy, the same cluster), one
# felix-loadgen ingest run against its leader (its owner) from core 1, its line appended to
# OUT.
replicated_run() {
  local OUT=$1 case=$2 consistency=$3 PAYLOAD=$4 INFLIGHT=$5 COUNT=$6
  FELIX_REPLICATION_PREVIEW=true cluster_up 3
  local url=https://127.0.0.1:7409 token copies=(--replication-factor 3 --consistency "$consistency")
  local path=streams/r3/replication
  # Served once a landed report committed the leader's generation-start record.
  local pick='s=json.load(sys.stdin)["shards"][0]; print(s["leader"] if s.get("commit",0)>=1 else "")'
  if [ "$consistency" = r1 ]; then
    copies=(--replication-factor 1); path=streams/r3
    pick='print(json.load(sys.stdin)["placement"][0].get("owner") or "")'
  fi
  token="$(cat "$D/control/admin.token")"
  export FELIX_CONTROLPLANE_CA="$D/control/tls/ca.pem"
  "$T/felixctl" --controlplane "$url" --token "$token" stream create r3 --durable --shards 1 \
    --fsync periodic "${copies[@]}" > /dev/null
  local leader=""
  for _ in $(seq 300); do
    leader=$(curl -fsS --cacert "$FELIX_CONTROLPLANE_CA" -H "Authorization: Bearer $token" \
      "$url/v1/tenants/default/namespaces/default/$path" 2>/dev/null \
      | python3 -c "import json,sys; $pick" 2>/dev/null || true)
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
