#!/usr/bin/env bash
# Fanout at scale: felix-loadgen --mode fanout-scale (S subscriptions on one shard, 1,000 per
# connection, one publisher at a fixed rate of 256-byte records for 5 s), a fresh broker per
# run (broker --cores 1 on core 0, load on core 1), cases alternated round by round. One
# JSON line per run, tagged "case", with git revision and date, appended to OUT.
# Usage: [MUXES="true false"] [CASES="S:R ..."] scripts/bench-fanout-scale.sh OUT.jsonl RUNS
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl RUNS}; RUNS=${2:-3}
# shellcheck source=scripts/bench-lib.sh
. scripts/bench-lib.sh
# MUXES: "true" (the default: the subscription mux), "false" (a stream per subscription), or
# "true false" to alternate both in each round (cases tagged -nomux without it).
MUXES=${MUXES:-true}
CASES=${CASES:-"10000:10 10000:20 10000:50 10000:100 1000:100 1000:200 1000:500 1000:1000"}
one() { # $1 = subscribers, $2 = rate (records/s), $3 = sub mux
  local tag="s$1-r$2"
  [ "$3" = true ] || tag="$tag-nomux"
  felix_run "$OUT" "$tag" -- --max-secs 60 \
    --mode fanout-scale --subscribers "$1" --rate "$2" --secs 5 --payload 256 --broker-pid '{pid}' \
    --sub-mux "$3"
}
for i in $(seq 1 "$RUNS"); do
  for case in $CASES; do
    for mux in $MUXES; do
      one "${case%%:*}" "${case##*:}" "$mux"
    done
  done
done
