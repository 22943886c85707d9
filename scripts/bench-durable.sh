#!/usr/bin/env bash
# Acked durable publishes: Felix ingest (on_commit and periodic streams) vs NATS JetStream
# js-publish (file storage, R1, server-default sync; and sync_always with NATS >= 2.10 when
# $NATS_SYNC_SERVER points at one), alternated, broker/server on core 0, load on core 1.
# TLS: Felix always (QUIC); JetStream with --tls. Appends one JSON line per run to OUT.
# Usage: scripts/bench-durable.sh OUT.jsonl RUNS [PAYLOAD] [INFLIGHT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-3}; PAYLOAD=${3:-1024}; INFLIGHT=${4:-32}
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
PB="${PEER_BENCH:-/var/cache/peer-bench-target/release/peer-bench}"
# Acked publishes per run: COUNT for periodic / server-default sync (long enough to reach a
# steady state: 30,000 ran ~0.5 s and halved both sides' figures), SYNC_COUNT for on_commit /
# sync_always (bounded by fsync speed).
COUNT=${COUNT:-200000}; SYNC_COUNT=${SYNC_COUNT:-20000}
felix() { # $1 = stream, $2 = count; a fresh broker and data dir per run
  local D; D=$(mktemp -d -p "${BENCH_TMP:-/var/tmp}")
  cat > "$D/catalog.yaml" <<YAML
streams:
  - {tenant: default, namespace: default, stream: commit, shards: 1, durable: true, fsync: on_commit}
  - {tenant: default, namespace: default, stream: periodic, shards: 1, durable: true, fsync: periodic}
YAML
  taskset -c 0 "$T/felix-broker" --cores 1 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --data-dir "$D/data" --catalog "$D/catalog.yaml" --durable-storage-dir "$D/durable" > "$D/out" 2>/dev/null &
  local PID=$!
  for _ in $(seq 100); do grep -q ready "$D/out" 2>/dev/null && break; sleep 0.1; done
  local ADDR; ADDR=$(grep -o 'quic=[^ ]*' "$D/out" | cut -d= -f2)
  FELIX_TOKEN="$(cat "$D/data/auth/admin.token" 2>/dev/null)" \
  timeout 200 taskset -c 1 "$T/felix-loadgen" --json --broker "$ADDR" --ca "$D/data/tls/dev-cert.pem" --max-secs 120 \
    --mode ingest --stream "$1" --payload "$PAYLOAD" --inflight "$INFLIGHT" --count "$2" >> "$OUT" || echo "FAILED felix $1" >&2
  kill "$PID"; wait "$PID" 2>/dev/null || true; rm -rf "$D"
}
nats() { # $1 = count; rest: peer-bench flags
  local N=$1; shift
  timeout 200 taskset -c 1 "$PB" --server-cpu 0 --tls --max-secs 120 --json --mode js-publish \
    --payload "$PAYLOAD" --inflight "$INFLIGHT" --count "$N" "$@" >> "$OUT" || echo "FAILED nats $*" >&2
}
for i in $(seq 1 "$RUNS"); do
  felix commit "$SYNC_COUNT"
  if [ -n "${NATS_SYNC_SERVER:-}" ]; then NATS_SERVER="$NATS_SYNC_SERVER" nats "$SYNC_COUNT" --js-sync-always; fi
  felix periodic "$COUNT"
  nats "$COUNT"
done
