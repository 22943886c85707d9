# Recipes mirror scripts/ (Debian 12 has no `just` package: `cargo install just --locked`).

# Start a standalone broker with embedded defaults.
run *ARGS:
    ./scripts/run.sh {{ARGS}}

# A control plane and N brokers on loopback (scripts/cluster.sh).
cluster N="3":
    ./scripts/cluster.sh {{N}}

# The whole test suite (what CI runs).
test:
    ./scripts/test.sh

# Install system packages and tools.
setup:
    ./scripts/setup.sh

# Check the TLA+ models (when tla/check.sh exists).
tla:
    tla/check.sh

# Print what a fast and a stalled subscriber get under each queue policy.
demo-slow-consumer *ARGS:
    ./scripts/demo-slow-consumer.sh {{ARGS}}

# Alternated Felix vs NATS-with-TLS campaign (release build + peer-bench needed); RUNS rounds.
bench RUNS="5":
    ./scripts/bench-vs-nats.sh bench-results/$(date +%F)-vs-nats.jsonl {{RUNS}}
