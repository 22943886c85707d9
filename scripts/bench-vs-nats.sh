#!/usr/bin/env bash
# Alternated Felix vs NATS (TLS) runs on this machine, pinned the same way: server/broker on
# core 0, load generator on core 1. Appends one JSON line per run to OUT, each tagged with the
# case it measures ("case"), then prints the summary (felix-loadgen --mode summarize) and
# writes it to bench-results/SUMMARY.md beside OUT.
# Usage: scripts/bench-vs-nats.sh OUT.jsonl RUNS
# Needs: release felix-broker + felix-loadgen, and peer-bench (../shared/tools/peer-bench)
# built at $PEER_BENCH (default /var/cache/peer-bench-target/release/peer-bench) + nats-server.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-5}
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
PB="${PEER_BENCH:-/var/cache/peer-bench-target/release/peer-bench}"
tag() { # $1 = case name: add it to the JSON line on stdin
  python3 -c 'import sys,json
for l in sys.stdin:
    l=l.strip()
    if l.startswith("{"):
        d=json.loads(l); d["case"]=sys.argv[1]; print(json.dumps(d))' "$1"
}
felix() { # $1 = case; rest: felix-loadgen args; a fresh broker per run
  local C=$1; shift
  local D; D=$(mktemp -d)
  taskset -c 0 "$T/felix-broker" --cores 1 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data-dir "$D/data" > "$D/out" 2>/dev/null &
  local PID=$!
  for _ in $(seq 100); do grep -q ready "$D/out" 2>/dev/null && break; sleep 0.1; done
  local ADDR; ADDR=$(grep -o 'quic=[^ ]*' "$D/out" | cut -d= -f2)
  timeout 200 taskset -c 1 "$T/felix-loadgen" --broker "$ADDR" --ca "$D/data/tls/dev-cert.pem" --max-secs 120 "$@" | tag "felix $C" >> "$OUT" || echo "FAILED felix $C" >&2
  kill "$PID"; wait "$PID" 2>/dev/null || true; rm -rf "$D"
}
nats() { # $1 = case; rest: peer-bench args. NATS with TLS (the figure to beat), then without.
  local C=$1; shift
  timeout 200 taskset -c 1 "$PB" --server-cpu 0 --tls --max-secs 120 --json "$@" | tag "nats-tls $C" >> "$OUT" || echo "FAILED nats-tls $C" >&2
  timeout 200 taskset -c 1 "$PB" --server-cpu 0 --max-secs 120 --json "$@" | tag "nats $C" >> "$OUT" || echo "FAILED nats $C" >&2
}
for i in $(seq 1 "$RUNS"); do
  echo "round $i/$RUNS" >&2
  felix tp-1k-f1 --mode throughput --payload 1024 --fanout 1 --count 500000 --batch 64 --inflight 32
  nats tp-1k-f1 --mode core-throughput --payload 1024 --fanout 1 --count 500000
  felix tp-1k-f1-b1 --mode throughput --payload 1024 --fanout 1 --count 100000 --batch 1 --inflight 32
  nats tp-1k-f1-b1 --mode core-throughput --payload 1024 --fanout 1 --count 100000
  felix tp-256-f1 --mode throughput --payload 256 --fanout 1 --count 500000 --batch 64 --inflight 32
  nats tp-256-f1 --mode core-throughput --payload 256 --fanout 1 --count 500000
  felix tp-4k-f1 --mode throughput --payload 4096 --fanout 1 --count 200000 --batch 16 --inflight 32
  nats tp-4k-f1 --mode core-throughput --payload 4096 --fanout 1 --count 200000
  felix tp-128-f10 --mode throughput --payload 128 --fanout 10 --count 200000 --batch 64 --inflight 32
  nats tp-128-f10 --mode core-throughput --payload 128 --fanout 10 --count 200000
  felix lat-128-f1 --mode latency --payload 128 --fanout 1 --count 5000
  nats lat-128-f1 --mode core-latency --payload 128 --fanout 1 --count 5000
  felix lat-128-f10 --mode latency --payload 128 --fanout 10 --count 5000
  nats lat-128-f10 --mode core-latency --payload 128 --fanout 10 --count 5000
done
# The summary, printed and written to bench-results/SUMMARY.md (source file, date, machine).
SUMMARY="$(dirname "$OUT")/SUMMARY.md"
{
  echo "# Felix vs NATS-with-TLS — latest campaign"
  echo
  echo "Source: \`$OUT\` ($(grep -c '^{' "$OUT") result lines), summarized $(date -u +%FT%TZ) at git $(git rev-parse --short HEAD)"
  echo "on $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), Linux $(uname -r)."
  echo "Medians over the alternated runs; ratio = Felix median / NATS median (higher is better for"
  echo "MB/s, lower for latency). Method: docs/benchmarks.md."
  echo
  "$T/felix-loadgen" --mode summarize --input "$OUT"
} > "$SUMMARY"
cat "$SUMMARY"
