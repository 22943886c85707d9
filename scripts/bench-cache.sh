#!/usr/bin/env bash
# Cache campaign: felix-loadgen --mode cache (put/get latency, 1 in flight, 10,000 each; then
# W watches on one key over W/100 connections and one writer putting that key at R puts/s for
# 5 s), a fresh broker per run (broker --cores 1 on core 0, load on core 1), cases alternated
# round by round. One JSON line per run, tagged "case", with git revision and date, to OUT.
# Usage: scripts/bench-cache.sh OUT.jsonl RUNS
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-3}
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
one() { # $1 = watchers, $2 = rate (puts/s)
  local D; D=$(mktemp -d -p "${BENCH_TMP:-/var/tmp}")
  taskset -c 0 "$T/felix-broker" --cores 1 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --data-dir "$D/data" > "$D/out" 2>/dev/null &
  local PID=$!
  for _ in $(seq 100); do grep -q ready "$D/out" 2>/dev/null && break; sleep 0.1; done
  local ADDR; ADDR=$(grep -o 'quic=[^ ]*' "$D/out" | cut -d= -f2)
  local R
  R=$(timeout 200 taskset -c 1 "$T/felix-loadgen" --broker "$ADDR" --ca "$D/data/tls/dev-cert.pem" --max-secs 90 \
    --mode cache --count 10000 --subscribers "$1" --rate "$2" --secs 5 --payload 256) \
    && python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]=sys.argv[2]; d["rev"]=sys.argv[3]; d["date"]=sys.argv[4]; print(json.dumps(d))' \
       "$R" "w$1-r$2" "$(git rev-parse --short HEAD)" "$(date -u +%FT%TZ)" >> "$OUT" \
    || echo "FAILED w$1 r$2" >&2
  kill "$PID"; wait "$PID" 2>/dev/null || true; rm -rf "$D"
}
for i in $(seq 1 "$RUNS"); do
  for case in "1000 100" "1000 300" "1000 1000" "10000 10" "10000 50"; do
    # shellcheck disable=SC2086
    one $case
  done
done
