#!/usr/bin/env bash
# Trace the tail: one Felix latency run (broker on core 0, felix-loadgen on core 1) under a
# system-wide `perf record -k mono -e cpu-clock`, felix-loadgen listing every message at or
# over OUTLIER_US (--outliers-us) with its CLOCK_MONOTONIC publish time; then
# scripts/tail-trace.py prints, per CPU, which tasks ran while those messages were in flight
# against the whole run. Needs perf (linux-perf) and root (system-wide sampling).
# Usage: scripts/tail-trace.sh [FANOUT=1] [COUNT=100000] [OUTLIER_US=400]
set -euo pipefail
cd "$(dirname "$0")/.."
F=${1:-1}; N=${2:-100000}; MIN=${3:-400}
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
D=$(mktemp -d -p "${BENCH_TMP:-/var/tmp}")
taskset -c 0 "$T/felix-broker" --cores 1 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --data-dir "$D/data" > "$D/out" 2>&1 &
BP=$!
for _ in $(seq 100); do grep -q ready "$D/out" 2>/dev/null && break; sleep 0.1; done
ADDR=$(grep -o 'quic=[^ ]*' "$D/out" | cut -d= -f2)
perf record -k mono -e cpu-clock -F 5000 -a -o "$D/perf.data" > "$D/perf.log" 2>&1 &
PP=$!
sleep 0.5
taskset -c 1 "$T/felix-loadgen" --json --broker "$ADDR" --ca "$D/data/tls/dev-cert.pem" \
  --mode latency --payload 128 --fanout "$F" --count "$N" --max-secs 100 --outliers-us "$MIN" > "$D/result.json"
kill -INT "$PP"; wait "$PP" 2>/dev/null || true
kill "$BP"; wait "$BP" 2>/dev/null || true
perf script -i "$D/perf.data" -F comm,tid,cpu,time,ip,sym 2>/dev/null > "$D/script.txt"
python3 scripts/tail-trace.py "$D/result.json" "$D/script.txt"
rm -rf "$D"
