#!/usr/bin/env bash
# Consumer-group poll+ack throughput: felix-loadgen --mode group (1 KiB records by default)
# with 1 and 8 consumers, polls of 64 and of 1 record, on a fresh broker per run (broker on
# core 0, load on core 1), cases alternated round by round. Appends one JSON line per run
# (tagged "case") to OUT. No peer: peer-bench has no queue mode.
# Usage: scripts/bench-groups.sh OUT.jsonl RUNS [PAYLOAD]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-3}; PAYLOAD=${3:-1024}
T="${CARGO_TARGET_DIR:-/var/cache/felix-target}/release"
one() { # $1 = case tag, $2 = consumers, $3 = records per poll, $4 = count
  local D; D=$(mktemp -d -p "${BENCH_TMP:-/var/tmp}")
  cat > "$D/catalog.yaml" <<YAML
streams:
  - {tenant: default, namespace: default, stream: jobs, shards: 2, durable: true, fsync: periodic}
YAML
  taskset -c 0 "$T/felix-broker" --cores 1 --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
    --data-dir "$D/data" --catalog "$D/catalog.yaml" --durable-storage-dir "$D/durable" > "$D/out" 2>/dev/null &
  local PID=$!
  for _ in $(seq 100); do grep -q ready "$D/out" 2>/dev/null && break; sleep 0.1; done
  local ADDR; ADDR=$(grep -o 'quic=[^ ]*' "$D/out" | cut -d= -f2)
  local R
  R=$(timeout 200 taskset -c 1 "$T/felix-loadgen" --broker "$ADDR" --ca "$D/data/tls/dev-cert.pem" --max-secs 120 \
    --mode group --stream jobs --payload "$PAYLOAD" --consumers "$2" --batch "$3" --count "$4") \
    && python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]=sys.argv[2]; d["rev"]=sys.argv[3]; d["date"]=sys.argv[4]; print(json.dumps(d))' \
       "$R" "$1" "$(git rev-parse --short HEAD)" "$(date -u +%FT%TZ)" >> "$OUT" \
    || echo "FAILED $1" >&2
  kill "$PID"; wait "$PID" 2>/dev/null || true; rm -rf "$D"
}
for i in $(seq 1 "$RUNS"); do
  one "c1-b64" 1 64 100000
  one "c8-b64" 8 64 100000
  one "c1-b1" 1 1 10000
  one "c8-b1" 8 1 20000
done
