#!/usr/bin/env bash
# Consumer-group poll+ack throughput: felix-loadgen --mode group (1 KiB records by default)
# with 1 and 8 consumers, polls of 64 and of 1 record, on a fresh broker per run (broker on
# core 0, load on core 1), cases alternated round by round. Appends one JSON line per run
# (tagged "case") to OUT. No peer: peer-bench has no queue mode.
# Usage: scripts/bench-groups.sh OUT.jsonl RUNS [PAYLOAD]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-3}; PAYLOAD=${3:-1024}
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
CAT=$(mktemp -p "${BENCH_TMP:-/var/tmp}")
trap 'rm -f "$CAT"' EXIT
cat > "$CAT" <<YAML
streams:
  - {tenant: default, namespace: default, stream: jobs, shards: 2, durable: true, fsync: periodic}
YAML
one() { # $1 = case tag, $2 = consumers, $3 = records per poll, $4 = count
  felix_run "$OUT" "$1" --catalog "$CAT" --durable-storage-dir '{dir}/durable' -- --max-secs 120 \
    --mode group --stream jobs --payload "$PAYLOAD" --consumers "$2" --batch "$3" --count "$4"
}
for i in $(seq 1 "$RUNS"); do
  one "c1-b64" 1 64 100000
  one "c8-b64" 8 64 100000
  one "c1-b1" 1 1 10000
  one "c8-b1" 8 1 20000
done
