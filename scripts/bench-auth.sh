#!/usr/bin/env bash
# The cost of auth, alternated: one broker build, side A with --auth off, side B with auth on
# (standalone: the broker's own key, the load presents its admin token), pinned like every
# campaign (broker on core 0, load on core 1), a fresh broker per run, the side that goes first
# alternating by round. Cases: connect (a fresh connection per sample: handshake, Hello and
# token → the first acked publish, 300 samples), tp-1k-f1 (batch 64, 32 in flight) and
# lat-128-f1 (one message in flight, 20,000 samples). scripts/ab-ratio.py then prints each
# ratio of medians B / A (on / off) with a bootstrap 95% interval.
# Usage: scripts/bench-auth.sh OUT.jsonl [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl [RUNS]}; RUNS=${2:-10}
. scripts/bench-lib.sh
side() { # $1 = side, $2 = case; rest: felix-loadgen args
  local S=$1 C=$2; shift 2
  local broker=()
  [ "$S" = A ] && broker=(--auth off)
  felix_run "$OUT" "$S $C" "${broker[@]}" -- --max-secs 120 "$@"
}
both() { # $1 = round, $2 = case; rest: felix-loadgen args
  local R=$1 C=$2; shift 2
  if [ $((R % 2)) -eq 1 ]; then side A "$C" "$@"; side B "$C" "$@"
  else side B "$C" "$@"; side A "$C" "$@"; fi
}
for i in $(seq 1 "$RUNS"); do
  echo "round $i/$RUNS $(date -u +%T)" >&2
  both "$i" connect --mode connect --payload 128 --count 300
  both "$i" tp-1k-f1 --mode throughput --payload 1024 --fanout 1 --count 500000 --batch 64 --inflight 32
  both "$i" lat-128-f1 --mode latency --payload 128 --fanout 1 --count 20000
done
python3 scripts/ab-ratio.py "$OUT"
