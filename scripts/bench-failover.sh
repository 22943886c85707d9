#!/usr/bin/env bash
# Failover time of a replicated stream (issue 23): broker/tests/replication_failover_bench.rs
# on release binaries. A control plane (heartbeats every 100 ms, the test harness's setting)
# and three brokers pinned to core 0, the measuring client on core 1, a `quorum` stream of
# three copies; KILLS times over, the leader is SIGKILLed right after an acknowledged publish,
# and the run times the control plane naming a new leader (named_ms) and the new leader's
# first acknowledgement (acked_ms), then restarts the killed broker and waits for the shard to
# be whole. Run once per dead-after (the control plane's default 5,000 ms, and 1,500 ms), with
# the brokers' default 2,000 ms lease. One JSON line per kill and a summary line to OUT.
#
#   scripts/bench-failover.sh bench-results/$(date +%F)-failover.jsonl 20
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:?usage: scripts/bench-failover.sh OUT.jsonl [KILLS] [DEAD_AFTER_MS...]}")"
KILLS="${2:-20}"
shift $(( $# >= 2 ? 2 : 1 ))
DEADS=("$@"); [ ${#DEADS[@]} -gt 0 ] || DEADS=(5000 1500)
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target-before}"
cargo build --release --workspace --bins
for dead in "${DEADS[@]}"; do
  FELIX_FAILOVER_KILLS="$KILLS" FELIX_FAILOVER_DEAD_AFTER_MS="$dead" FELIX_FAILOVER_OUT="$OUT" \
    cargo nextest run --release -p felix-broker --test replication_failover_bench \
    --run-ignored only --no-capture
done
