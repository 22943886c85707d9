#!/usr/bin/env bash
# Starts Felix with embedded defaults: felix-controlplane (single-member Raft under
# ./felix-data/control, REST over HTTPS on 127.0.0.1:7410 with a development CA and
# certificate made once under ./felix-data/control/tls) and felix-broker registered to it (QUIC on
# 127.0.0.1:7400, /metrics /livez /readyz on 127.0.0.1:7401, durable logs under
# ./felix-data/durable, dev TLS certificate generated on first start under ./felix-data/tls).
# Auth is on: the control plane writes its admin token to ./felix-data/control/admin.token
# (mode 0600) at the first start; the broker gets a node credential (felixctl node enroll)
# at every start; felixctl's context "local" holds the admin token.
# The default tenant and namespace, the stream default/default/events (4 shards) and the
# in-memory cache default/default/kv (4 shards) are created if missing. Ctrl-C stops both.
#
#   ./scripts/run.sh                 # control plane + broker
#   ./scripts/run.sh --standalone    # broker alone, built-in catalog (no control plane)
# Other arguments go to felix-broker. FELIX_BIN_DIR: use the binaries there (no build).
# Exit: 130 on Ctrl-C, 143 on SIGTERM, 1 when the control plane dies (the broker is stopped
# with it), the broker's own code when it stops first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${FELIX_BIN_DIR:-}" ]; then
  # Binaries built already (scripts/tour.sh passes the test build's).
  BIN="$FELIX_BIN_DIR"
else
  ./scripts/setup.sh
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
  mkdir -p "$CARGO_TARGET_DIR" 2>/dev/null || export CARGO_TARGET_DIR="$HOME/.cache/felix-target"
  cargo build --release --workspace --bins
  BIN="$CARGO_TARGET_DIR/release"
fi
DATA="${FELIX_DATA_DIR:-felix-data}"

if [ "${1:-}" = "--standalone" ]; then
  shift
  exec "$BIN/felix-broker" --data-dir "$DATA" "$@"
fi

CP_LISTEN="${FELIX_CONTROLPLANE_LISTEN:-127.0.0.1:7410}"
mkdir -p "$DATA/control"
# One broker: no placement settle window (FELIX_PLACEMENT_SETTLE_MS sets one).
"$BIN/felix-controlplane" --listen "$CP_LISTEN" --store raft --raft-data-dir "$DATA/control" \
  --placement-settle-ms "${FELIX_PLACEMENT_SETTLE_MS:-0}" --tls on \
  > "$DATA/controlplane.out" 2> >(sed -u 's/^/[controlplane] /' >&2) &
CP_PID=$!
trap 'kill "$CP_PID" 2>/dev/null || true; wait "$CP_PID" 2>/dev/null || true' EXIT
URL="https://$CP_LISTEN"
# The CA felixctl, curl and the broker trust for the control plane's certificate.
export FELIX_CONTROLPLANE_CA="$(cd "$DATA/control" && pwd)/tls/ca.pem"
for _ in $(seq 1 100); do
  if curl -fsS --cacert "$FELIX_CONTROLPLANE_CA" "$URL/readyz" > /dev/null 2>&1; then break; fi
  kill -0 "$CP_PID" 2>/dev/null || { echo "felix-controlplane exited; see above" >&2; exit 1; }
  sleep 0.1
done
curl -fsS --cacert "$FELIX_CONTROLPLANE_CA" "$URL/readyz" > /dev/null || { echo "felix-controlplane not ready at $URL" >&2; exit 1; }
ADMIN_FILE="$DATA/control/admin.token"
for _ in $(seq 1 100); do [ -s "$ADMIN_FILE" ] && break; sleep 0.1; done
[ -s "$ADMIN_FILE" ] || { echo "felix-controlplane wrote no admin token at $ADMIN_FILE" >&2; exit 1; }
ADMIN="$(cat "$ADMIN_FILE")"

# Create unless it exists already (a restart keeps the Raft store).
ensure() {
  local err
  if ! err=$("$BIN/felixctl" --controlplane "$URL" --token "$ADMIN" "$@" 2>&1 > /dev/null); then
    case "$err" in *already_exists*) ;; *) echo "$err" >&2; exit 1 ;; esac
  fi
}
ensure tenant create default
ensure namespace create default
ensure stream create events --shards 4
ensure cache create kv --shards 4

# The broker's node credential (node id 1, the broker's default), private.
(umask 077 && "$BIN/felixctl" --controlplane "$URL" --token "$ADMIN" node enroll 1 > "$DATA/node.token")

export FELIX_CONTROLPLANE_URL="$URL"
"$BIN/felix-broker" --data-dir "$DATA" --durable-storage-dir "$DATA/durable" \
  --controlplane-token-file "$DATA/node.token" "$@" &
BROKER_PID=$!
stop_all() {
  if [ -n "$BROKER_PID" ]; then kill -TERM "$BROKER_PID" 2>/dev/null || true; wait "$BROKER_PID" 2>/dev/null || true; fi
  if [ -n "$CP_PID" ]; then kill "$CP_PID" 2>/dev/null || true; wait "$CP_PID" 2>/dev/null || true; fi
}
trap stop_all EXIT
# Ctrl-C is 130 and SIGTERM 143, as for any process ended by those signals.
trap 'exit 130' INT
trap 'exit 143' TERM

# felixctl finds this broker and its certificate from anywhere: a context named "local"
# (made current if there is none) holds the addresses and the CA's absolute path, once the
# broker has generated its dev certificate.
BROKER_ADDR="${FELIX_LISTEN:-127.0.0.1:7400}"
prev=""
for a in "$@"; do
  case "$prev:$a" in --listen:*) BROKER_ADDR="$a" ;; esac
  case "$a" in --listen=*) BROKER_ADDR="${a#--listen=}" ;; esac
  prev="$a"
done
for _ in $(seq 1 300); do
  [ -f "$DATA/tls/dev-cert.pem" ] && break
  kill -0 "$BROKER_PID" 2>/dev/null || break
  sleep 0.1
done
if [ -f "$DATA/tls/dev-cert.pem" ]; then
  "$BIN/felixctl" context set local --url "$URL" --broker "$BROKER_ADDR" \
    --ca "$(cd "$DATA" && pwd)/tls/dev-cert.pem" --controlplane-ca "$FELIX_CONTROLPLANE_CA" \
    --token "$ADMIN" > /dev/null ||
    echo "run.sh: could not write felixctl's context (felixctl will look for ./felix-data/tls)" >&2
fi

# Whichever stops first: a dead control plane stops the broker too (rather than leaving it
# retrying against nothing), and says so.
set +e
wait -n "$BROKER_PID" "$CP_PID"
code=$?
set -e
if ! kill -0 "$CP_PID" 2>/dev/null; then
  CP_PID="" # reaped by wait -n
  echo "felix-controlplane exited (code $code); stopping the broker" >&2
  exit 1
fi
BROKER_PID=""
echo "felix-broker exited (code $code); stopping the control plane" >&2
exit "$code"
