#!/usr/bin/env bash
# Alternated Felix vs NATS (TLS) runs on this machine, pinned the same way: server/broker on
# core 0, load generator on core 1. Appends one JSON line per run to OUT.
# Usage: scripts/bench-vs-nats.sh OUT.jsonl RUNS
# Needs: release felix-broker + felix-loadgen, and peer-bench (../shared/tools/peer-bench)
# built at $PEER_BENCH (default /var/cache/peer-bench-target/release/peer-bench) + nats-server.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-3}
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
PB="${PEER_BENCH:-/var/cache/peer-bench-target/release/peer-bench}"
felix() { # args for felix-loadgen; a fresh broker per run
  local D; D=$(mktemp -d)
  taskset -c 0 "$T/felix-broker" --cores 1 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data-dir "$D/data" > "$D/out" 2>/dev/null &
  local PID=$!
  for _ in $(seq 100); do grep -q ready "$D/out" 2>/dev/null && break; sleep 0.1; done
  local ADDR; ADDR=$(grep -o 'quic=[^ ]*' "$D/out" | cut -d= -f2)
  timeout 200 taskset -c 1 "$T/felix-loadgen" --broker "$ADDR" --ca "$D/data/tls/dev-cert.pem" --max-secs 120 "$@" >> "$OUT" || echo "FAILED felix $*" >&2
  kill "$PID"; wait "$PID" 2>/dev/null || true; rm -rf "$D"
}
nats() {
  timeout 200 taskset -c 1 "$PB" --server-cpu 0 --tls --max-secs 120 --json "$@" >> "$OUT" || echo "FAILED nats $*" >&2
}
for i in $(seq 1 "$RUNS"); do
  felix --mode throughput --payload 1024 --fanout 1 --count 200000 --batch 64 --inflight 32
  nats --mode core-throughput --payload 1024 --fanout 1 --count 200000
  felix --mode throughput --payload 1024 --fanout 1 --count 200000 --batch 1 --inflight 256
  felix --mode latency --payload 128 --fanout 1 --count 5000
  nats --mode core-latency --payload 128 --fanout 1 --count 5000
  felix --mode throughput --payload 128 --fanout 10 --count 100000 --batch 64 --inflight 32
  nats --mode core-throughput --payload 128 --fanout 10 --count 100000
done
