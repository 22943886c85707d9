#!/usr/bin/env bash
# Cache campaign: felix-loadgen --mode cache (put/get latency, 1 in flight, 10,000 each; then
# W watches on one key over W/100 connections and one writer putting that key at R puts/s for
# 5 s), a fresh broker per run (broker --cores 1 on core 0, load on core 1), cases alternated
# round by round. One JSON line per run, tagged "case", with git revision and date, to OUT.
# Usage: scripts/bench-cache.sh OUT.jsonl RUNS
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-3}
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
one() { # $1 = watchers, $2 = rate (puts/s)
  felix_run "$OUT" "w$1-r$2" -- --max-secs 90 \
    --mode cache --count 10000 --subscribers "$1" --rate "$2" --secs 5 --payload 256
}
for i in $(seq 1 "$RUNS"); do
  for case in "1000 100" "1000 300" "1000 1000" "10000 10" "10000 50"; do
    # shellcheck disable=SC2086
    one $case
  done
done
