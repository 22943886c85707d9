#!/usr/bin/env bash
# The replication chaos test (broker/tests/replication_chaos.rs) over more rounds than CI runs
# (CI: 3 rounds, one seed from the clock), several runs in a row, each with a fresh seed.
# Usage: scripts/chaos.sh [ROUNDS] [RUNS]   e.g. scripts/chaos.sh 30 5
# A failing run prints FELIX_CHAOS_SEED=N: FELIX_CHAOS_SEED=N FELIX_CHAOS_ROUNDS=R replays its
# choices of broker, signal and wait (not the timing of the processes).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-20}"; RUNS="${2:-3}"
for i in $(seq "$RUNS"); do
  echo "chaos run $i of $RUNS, $ROUNDS rounds"
  FELIX_CHAOS_ROUNDS="$ROUNDS" cargo nextest run -p felix-broker --no-capture \
    --test replication_chaos
done
