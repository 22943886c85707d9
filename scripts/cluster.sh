#!/usr/bin/env bash
# A local cluster on loopback: felix-controlplane and N brokers (1..7), each with its own data
# directory, ports and certificate from one cluster CA (scripts/dev-certs.sh). Every broker
# forwards what it does not own to the owner over its peer link. Ctrl-C stops them all.
#
#   scripts/cluster.sh 3
#
# Ports: control plane 127.0.0.1:7409; node i serves clients on 74(i+1)0, metrics on 74(i+1)1
# and its peer listener on 74(i+1)2 (node 1: 7420, 7421, 7422). Data under ./felix-cluster
# (FELIX_DATA_DIR). The stream default/default/events and the cache default/default/kv get 2N
# shards each, spread over the brokers once they registered (the placement settle window).
# The felixctl context "cluster" points at node 1 with the cluster CA.
# Several brokers share this machine's cores: each runs one core, unpinned.
# FELIX_BIN_DIR: use the binaries there (no build).
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-3}"
case "$N" in [1-7]) ;; *) echo "usage: scripts/cluster.sh N   (N brokers, 1..7)" >&2; exit 2 ;; esac
if [ -n "${FELIX_BIN_DIR:-}" ]; then
  BIN="$FELIX_BIN_DIR"
else
  ./scripts/setup.sh
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
  mkdir -p "$CARGO_TARGET_DIR" 2>/dev/null || export CARGO_TARGET_DIR="$HOME/.cache/felix-target"
  cargo build --release --workspace --bins
  BIN="$CARGO_TARGET_DIR/release"
fi
DATA="${FELIX_DATA_DIR:-felix-cluster}"
mkdir -p "$DATA"
DATA="$(cd "$DATA" && pwd)"
FELIX_BIN_DIR="$BIN" ./scripts/dev-certs.sh "$DATA/certs" "$N" > /dev/null

# Each process runs in its own session (setsid) and the log prefixers ignore SIGINT, so a
# Ctrl-C reaches only this script, which sends each process one TERM: a second signal would
# cut a broker's drain short.
PIDS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

CP_LISTEN="${FELIX_CONTROLPLANE_LISTEN:-127.0.0.1:7409}"
URL="https://$CP_LISTEN"
# The CA felixctl, curl and the brokers trust for the control plane's certificate (made once
# under $DATA/control/tls by --tls on).
export FELIX_CONTROLPLANE_CA="$(mkdir -p "$DATA/control" && cd "$DATA/control" && pwd)/tls/ca.pem"
mkdir -p "$DATA/control"
# The brokers start together: shards are placed once they all registered (3 s settle window
# here, FELIX_PLACEMENT_SETTLE_MS; the control plane's default is 10 s).
setsid "$BIN/felix-controlplane" --listen "$CP_LISTEN" --store raft --raft-data-dir "$DATA/control" \
  --placement-settle-ms "${FELIX_PLACEMENT_SETTLE_MS:-3000}" --tls on \
  > "$DATA/controlplane.out" 2> >(trap '' INT; exec sed -u 's/^/[controlplane] /' >&2) &
PIDS+=($!)
for _ in $(seq 1 100); do
  curl -fsS --cacert "$FELIX_CONTROLPLANE_CA" "$URL/readyz" > /dev/null 2>&1 && break
  kill -0 "${PIDS[0]}" 2>/dev/null || { echo "felix-controlplane exited; see above" >&2; exit 1; }
  sleep 0.1
done
curl -fsS --cacert "$FELIX_CONTROLPLANE_CA" "$URL/readyz" > /dev/null || { echo "felix-controlplane not ready at $URL" >&2; exit 1; }
# Auth is on: the admin token the control plane wrote, and one one-time enrolment token per
# broker, which it exchanges at its first start for its node credential (in the same file).
ADMIN_FILE="$DATA/control/admin.token"
for _ in $(seq 1 100); do [ -s "$ADMIN_FILE" ] && break; sleep 0.1; done
[ -s "$ADMIN_FILE" ] || { echo "felix-controlplane wrote no admin token at $ADMIN_FILE" >&2; exit 1; }
ADMIN="$(cat "$ADMIN_FILE")"

for i in $(seq 1 "$N"); do
  base=$((7410 + 10 * i))
  mkdir -p "$DATA/node-$i"
  (umask 077 && "$BIN/felixctl" --controlplane "$URL" --token "$ADMIN" node enroll "$i" --one-time > "$DATA/node-$i/node.token")
  setsid "$BIN/felix-broker" --node-id "$i" --cores 1 --spin-before-park-us 0 \
    --data-dir "$DATA/node-$i" --durable-storage-dir "$DATA/node-$i/durable" \
    --listen "127.0.0.1:$base" --metrics-listen "127.0.0.1:$((base + 1))" \
    --tls-cert "$DATA/certs/node-$i.pem" --tls-key "$DATA/certs/node-$i-key.pem" \
    --peer-listen "127.0.0.1:$((base + 2))" --peer-ca "$DATA/certs/ca.pem" \
    --peer-cert "$DATA/certs/node-$i.pem" --peer-key "$DATA/certs/node-$i-key.pem" \
    --controlplane-url "$URL" --controlplane-token-file "$DATA/node-$i/node.token" \
    > "$DATA/node-$i.out" 2> >(trap '' INT; exec sed -u "s/^/[node-$i] /" >&2) &
  PIDS+=($!)
done
for i in $(seq 1 "$N"); do
  for _ in $(seq 1 300); do
    grep -q "felix-broker ready" "$DATA/node-$i.out" 2>/dev/null && break
    kill -0 "${PIDS[$i]}" 2>/dev/null || { echo "node $i exited; see above" >&2; exit 1; }
    sleep 0.1
  done
done

ensure() {
  local err
  if ! err=$("$BIN/felixctl" --controlplane "$URL" --token "$ADMIN" "$@" 2>&1 > /dev/null); then
    case "$err" in *already_exists*) ;; *) echo "$err" >&2; exit 1 ;; esac
  fi
}
ensure tenant create default
ensure namespace create default
ensure stream create events --shards $((2 * N))
ensure cache create kv --shards $((2 * N))
# Ready once the settle window closed and the shards are placed.
for _ in $(seq 1 600); do
  curl -fsS --cacert "$FELIX_CONTROLPLANE_CA" -H "Authorization: Bearer $ADMIN" "$URL/v1/catalog" | grep -q '"placement_held":false' && break
  sleep 0.1
done
"$BIN/felixctl" context set cluster --url "$URL" --broker 127.0.0.1:7420 \
  --ca "$DATA/certs/ca.pem" --controlplane-ca "$FELIX_CONTROLPLANE_CA" --token "$ADMIN" > /dev/null

echo "control plane  $URL"
for i in $(seq 1 "$N"); do
  base=$((7410 + 10 * i))
  echo "node $i         quic 127.0.0.1:$base  metrics 127.0.0.1:$((base + 1))  peer 127.0.0.1:$((base + 2))"
done
echo
echo "felixctl (context \"cluster\", any broker takes any shard):"
echo "  $BIN/felixctl --context cluster node ls"
echo "  $BIN/felixctl --context cluster publish events hello --broker 127.0.0.1:7430"
echo "Ctrl-C stops them all."
set +e
wait -n "${PIDS[@]}"
code=$?
echo "a process of the cluster exited (code $code); stopping the rest" >&2
exit 1
