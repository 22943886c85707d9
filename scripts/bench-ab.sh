#!/usr/bin/env bash
# An alternated A/B of two broker builds (same felix-loadgen for both), pinned like every
# campaign (broker on core 0, load on core 1), a fresh broker per run. Each round runs every
# case once per side, the side that goes first alternating by round. Cases: tp-1k-f1 and
# tp-4k-f1 (batch 64, 32 in flight), lat-128-f1 and lat-128-f10 (one message in flight,
# 20,000 samples). Then scripts/ab-ratio.py prints each ratio of medians (B / A) with a
# bootstrap 95% interval.
# Usage: scripts/bench-ab.sh OUT.jsonl RUNS BROKER_A BROKER_B
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS BROKER_A BROKER_B}; RUNS=${2:-10}
A=${3:?broker binary A}; B=${4:?broker binary B}
. scripts/bench-lib.sh
side() { # $1 = side name, $2 = binary, $3 = case; rest: felix-loadgen args
  local S=$1 BIN=$2 C=$3; shift 3
  FELIX_BROKER_BIN="$BIN" BROKER_BIN="$BIN" felix_run "$OUT" "$S $C" -- --max-secs 120 "$@"
}
both() { # $1 = round, $2 = case; rest: felix-loadgen args
  local R=$1 C=$2; shift 2
  if [ $((R % 2)) -eq 1 ]; then
    side A "$A" "$C" "$@"; side B "$B" "$C" "$@"
  else
    side B "$B" "$C" "$@"; side A "$A" "$C" "$@"
  fi
}
for i in $(seq 1 "$RUNS"); do
  echo "round $i/$RUNS $(date -u +%T)" >&2
  both "$i" tp-1k-f1 --mode throughput --payload 1024 --fanout 1 --count 500000 --batch 64 --inflight 32
  both "$i" tp-4k-f1 --mode throughput --payload 4096 --fanout 1 --count 200000 --batch 64 --inflight 32
  both "$i" lat-128-f1 --mode latency --payload 128 --fanout 1 --count 20000
  both "$i" lat-128-f10 --mode latency --payload 128 --fanout 10 --count 20000
done
python3 scripts/ab-ratio.py "$OUT"
