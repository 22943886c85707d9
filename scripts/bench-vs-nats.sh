#!/usr/bin/env bash
# The standard campaign: alternated Felix vs NATS runs on this machine, pinned the same way
# (server/broker on core 0, load generator on core 1), a fresh broker or server per run.
# Every round runs every case once, each case Felix → NATS-TLS → NATS (no TLS) in turn:
#   throughput  payload 8 / 256 / 1024 / 4096 B × fanout 1 and 10, batch 64 (Felix; NATS
#               core publishes are fire-and-forget and have no batch), plus 1 KiB batch 1
#               and 0 B (Felix only: peer-bench payloads carry an 8-byte sequence)
#   latency     128 B, fanout 1 and 10, one message in flight, 20,000 samples (p99 = the
#               200th worst)
#   rtt         Felix only: 128 B acked publishes one at a time (publish → ack); peer-bench's
#               core-rtt is a request/reply through a responder, two hops each way, so no
#               NATS side is run against it
#   ingest      acked durable publishes, 1 KiB, 32 in flight, 200,000 per run: Felix
#               `periodic` (fdatasync every 250 ms) vs JetStream file storage with the
#               server-default sync (every 2 minutes)
# (The PMTUD before/after side `felix-1350` ran in the 2026-12-04 matrix campaigns; felix-loadgen
# --udp-payload-max-bytes 1350 and the broker flag of the same name reproduce it.)
# Appends one JSON line per run to OUT, tagged "case": "SIDE CASE", then writes the summary
# (felix-loadgen --mode summarize) to bench-results/SUMMARY.md beside OUT and, when
# python3-matplotlib is installed, the chart bench-results/SUMMARY.png.
# Usage: scripts/bench-vs-nats.sh OUT.jsonl RUNS
# Needs: release felix-broker + felix-loadgen, and peer-bench (../shared/tools/peer-bench)
# built at $PEER_BENCH (default /var/cache/peer-bench-target/release/peer-bench) + nats-server.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-5}
. scripts/bench-lib.sh
PB="${PEER_BENCH:-/var/cache/peer-bench-target/release/peer-bench}"
tag() { # $1 = case name: add it to the JSON line on stdin
  python3 -c 'import sys,json
for l in sys.stdin:
    l=l.strip()
    if l.startswith("{"):
        d=json.loads(l); d["case"]=sys.argv[1]; print(json.dumps(d))' "$1"
}
felix() { # $1 = case; rest: felix-loadgen args
  local C=$1; shift
  felix_run "$OUT" "felix $C" -- --max-secs 120 "$@"
}
felix_ingest() { # $1 = case; rest: felix-loadgen args; a durable periodic stream
  local C=$1; shift
  local Y; Y=$(mktemp -p "${BENCH_TMP:-/var/tmp}")
  echo 'streams: [{tenant: default, namespace: default, stream: periodic, shards: 1, durable: true, fsync: periodic}]' > "$Y"
  felix_run "$OUT" "felix $C" --catalog "$Y" --durable-storage-dir '{dir}/durable' -- --max-secs 120 "$@"
  rm -f "$Y"
}
nats() { # $1 = case; rest: peer-bench args. NATS with TLS (the figure to beat), then without.
  local C=$1; shift
  timeout 200 taskset -c 1 "$PB" --server-cpu 0 --tls --max-secs 120 --json "$@" | tag "nats-tls $C" >> "$OUT" || echo "FAILED nats-tls $C" >&2
  timeout 200 taskset -c 1 "$PB" --server-cpu 0 --max-secs 120 --json "$@" | tag "nats $C" >> "$OUT" || echo "FAILED nats $C" >&2
}
tp() { # $1 = case, $2 = payload, $3 = fanout, $4 = count
  felix "$1" --mode throughput --payload "$2" --fanout "$3" --count "$4" --batch 64 --inflight 32
  nats "$1" --mode core-throughput --payload "$2" --fanout "$3" --count "$4"
}
for i in $(seq 1 "$RUNS"); do
  echo "round $i/$RUNS $(date -u +%T)" >&2
  tp tp-8-f1 8 1 1000000
  tp tp-256-f1 256 1 500000
  tp tp-1k-f1 1024 1 500000
  tp tp-4k-f1 4096 1 200000
  tp tp-8-f10 8 10 200000
  tp tp-256-f10 256 10 200000
  tp tp-1k-f10 1024 10 100000
  tp tp-4k-f10 4096 10 30000
  felix tp-0-f1 --mode throughput --payload 0 --fanout 1 --count 1000000 --batch 64 --inflight 32
  felix tp-1k-f1-b1 --mode throughput --payload 1024 --fanout 1 --count 100000 --batch 1 --inflight 32
  nats tp-1k-f1-b1 --mode core-throughput --payload 1024 --fanout 1 --count 100000
  felix lat-128-f1 --mode latency --payload 128 --fanout 1 --count 20000
  nats lat-128-f1 --mode core-latency --payload 128 --fanout 1 --count 20000
  felix lat-128-f10 --mode latency --payload 128 --fanout 10 --count 20000
  nats lat-128-f10 --mode core-latency --payload 128 --fanout 10 --count 20000
  felix rtt-128 --mode rtt --payload 128 --count 20000
  felix_ingest ingest-1k-32 --mode ingest --stream periodic --payload 1024 --inflight 32 --count 200000
  nats ingest-1k-32 --mode js-publish --payload 1024 --inflight 32 --count 200000
done
# The summary, printed and written to bench-results/SUMMARY.md (source file, date, machine).
DIR=$(dirname "$OUT")
{
  echo "# Felix vs NATS-with-TLS — latest campaign"
  echo
  echo "Source: \`$OUT\` ($(grep -c '^{' "$OUT") result lines), summarized $(date -u +%FT%TZ) at git $(git rev-parse --short HEAD)"
  echo "on $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), Linux $(uname -r)."
  echo "Medians over the alternated runs; ratio = Felix median / NATS median (higher is better for"
  echo "MB/s and acks/s, lower for latency). Method: docs/benchmarks.md. Chart: SUMMARY.png."
  echo
  "$T/felix-loadgen" --mode summarize --input "$OUT"
} > "$DIR/SUMMARY.md"
cat "$DIR/SUMMARY.md"
if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  /usr/bin/python3 scripts/bench-chart.py "$OUT" "$DIR/SUMMARY.png"
else
  echo "python3-matplotlib not installed: no chart (apt-get install python3-matplotlib)" >&2
fi
