#!/usr/bin/env bash
# The simulator's scenarios, the cluster simulator, the replica machine's simulator, the watch
# mux's and the peer links' seeded checks, over more seeds than CI runs (CI: 1,000 per scenario,
# 300 for the cluster, 2,000 for the replicas, 500 for the mux check, 1,000 for the peer links,
# the defaults).
# Usage: scripts/sim.sh [SEEDS] [BUDGET_S per scenario]   e.g. scripts/sim.sh 100000 600
# A failure prints its seed and the command that replays it (FELIX_SIM_SEED=N or
# FELIX_MUX_SEED=N, FELIX_PEER_SEED=N, FELIX_CLUSTER_SEED=N, FELIX_REPLICA_SEED=N ...).
set -euo pipefail
cd "$(dirname "$0")/.."
export FELIX_SIM_SEEDS="${1:-20000}" FELIX_SIM_BUDGET_S="${2:-600}" FELIX_MUX_SEEDS="${1:-20000}" \
  FELIX_PEER_SEEDS="${1:-20000}" FELIX_CLUSTER_SEEDS="${1:-20000}" FELIX_REPLICA_SEEDS="${1:-20000}"
exec cargo nextest run -p felix-broker --release --no-fail-fast --no-capture sim:: mux_check:: peer_check::
