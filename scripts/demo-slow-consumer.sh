#!/usr/bin/env bash
# Starts a private broker (temp data dir, random port), runs the slow-consumer demo for each
# queue policy, stops the broker.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
mkdir -p "$CARGO_TARGET_DIR" 2>/dev/null || export CARGO_TARGET_DIR="$HOME/.cache/felix-target"
cargo build --release --workspace --bins
B="$CARGO_TARGET_DIR/release"
D=$(mktemp -d)
"$B/felix-broker" --cores 2 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data-dir "$D/data" > "$D/out" &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -rf "$D"' EXIT
for _ in $(seq 100); do grep -q ready "$D/out" 2>/dev/null && break; sleep 0.1; done
ADDR=$(grep -o 'quic=[^ ]*' "$D/out" | cut -d= -f2)
"$B/felix-loadgen" --mode demo-slow-consumer --broker "$ADDR" --ca "$D/data/tls/dev-cert.pem" "$@"
