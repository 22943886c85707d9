#!/usr/bin/env bash
# Starts a standalone Felix broker with embedded defaults (dev TLS certificate generated on
# first start under ./felix-data/tls). Extra arguments go to felix-broker.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
mkdir -p "$CARGO_TARGET_DIR" 2>/dev/null || export CARGO_TARGET_DIR="$HOME/.cache/felix-target"
cargo build --release -p felix-broker -p felixctl
exec "$CARGO_TARGET_DIR/release/felix-broker" "$@"
