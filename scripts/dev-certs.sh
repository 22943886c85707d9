#!/usr/bin/env bash
# Certificates for a local cluster: one CA (ca.pem, ca-key.pem 0600) and, per node, a
# certificate naming node-<id>, localhost and the loopback addresses (node-<id>.pem,
# node-<id>-key.pem 0600), signed by the CA. Brokers use them for the peer links (mutual
# TLS, the name bound to the node id) and may use them for the client listener too, so one
# CA verifies every broker. An existing CA in DIR is kept (adding a node to a cluster).
#
#   scripts/dev-certs.sh DIR N          # nodes 1..N
#   scripts/dev-certs.sh DIR 4 7        # nodes 4..7
# FELIX_BIN_DIR: the directory of felix-broker (default: the release build, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  echo "usage: scripts/dev-certs.sh DIR N  |  scripts/dev-certs.sh DIR FIRST LAST" >&2
  exit 2
fi
DIR="$1"
if [ $# -ge 3 ]; then FIRST="$2"; LAST="$3"; else FIRST=1; LAST="$2"; fi
case "$FIRST$LAST" in *[!0-9]*) echo "node ids are numbers" >&2; exit 2 ;; esac
BIN="${FELIX_BIN_DIR:-${CARGO_TARGET_DIR:-/var/cache/felix-target}/release}"
if [ ! -x "$BIN/felix-broker" ]; then
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
  cargo build --release -p felix-broker --bin felix-broker
  BIN="$CARGO_TARGET_DIR/release"
fi
exec "$BIN/felix-broker" dev-certs "$DIR" $(seq "$FIRST" "$LAST")
