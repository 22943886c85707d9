#!/usr/bin/env bash
# Watch fanout on one key, side by side: Felix (felix-loadgen --mode cache), etcd and NATS
# JetStream KV (peer-bench --mode etcd-watch / kv-watch, which copy the same shape). Broker or
# server on core 0, load on core 1, a fresh one per run; every round runs each case once per
# system, the systems' order rotating by round. Cases ("W:R:P" = W watchers on one key, one
# writer at R acked puts/s for 5 s, P watches per connection):
#   10000:50:100   10k watchers at 100 per connection, 500k events/s offered
#   10000:100:100  the same at 1M events/s offered
#   2000:100:1     one watcher per connection: 2,000 connections, 200k events/s offered
# One JSON line per run to OUT, tagged "case" = "<system> <case>" and "system", then the
# summary (scripts/watch-summary.py): medians, each Felix/etcd ratio, client and server CPU,
# memory per watcher, and runs whose load core was saturated marked invalid.
# Usage: scripts/bench-watch-vs-peers.sh OUT.jsonl [ROUNDS=3] [CASES] ; env SYSTEMS="felix etcd nats-kv"
# ("felix-nomux" is Felix with --watch-mux false: a stream per watch; "felix-task" is Felix read
# by a task per watch instead of a WatchSet per connection: each for its lever's share).
# Needs: release felix-broker + felix-loadgen; peer-bench built at $PEER_BENCH (default
# /var/cache/peer-bench-target/release/peer-bench) with etcd and nats-server installed (its
# README lists the packages).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: OUT.jsonl [ROUNDS] [CASES]}; ROUNDS=${2:-3}
CASES=${3:-"10000:50:100 10000:100:100 2000:100:1"}
SYSTEMS=${SYSTEMS:-"felix etcd nats-kv"}
PB="${PEER_BENCH:-/var/cache/peer-bench-target/release/peer-bench}"
. scripts/bench-lib.sh
label() { echo "w$1-r$2-p$3"; }
felix() { # SYSTEM MUX READER W R P
  local S=$1 MUX=$2 READER=$3; shift 3
  local C; C=$(label "$@")
  felix_run "$OUT" "$S $C" -- --max-secs 90 --mode cache --count 10000 --subscribers "$1" \
    --rate "$2" --connections $(( ($1 + $3 - 1) / $3 )) --secs 5 --payload 256 --broker-pid '{pid}' \
    --watch-mux "$MUX" --watch-reader "$READER"
}
peer() { # SYSTEM MODE W R P
  local S=$1 M=$2 C; C=$(label "$3" "$4" "$5")
  local R
  if R=$(timeout 200 taskset -c 1 "$PB" --server-cpu 0 --mode "$M" --watchers "$3" --rate "$4" \
      --watches-per-conn "$5" --secs 5 --count 10000 --payload 256 --max-secs 90 --json 2>/dev/null); then
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["case"]=sys.argv[2]; print(json.dumps(d))' \
      "$R" "$S $C" >> "$OUT"
  else
    echo "FAILED $S $C" >&2
  fi
}
for i in $(seq 1 "$ROUNDS"); do
  # Rotate who goes first, so no system always runs on a machine warmed (or disturbed) by another.
  read -r -a order <<< "$SYSTEMS"
  n=${#order[@]}; k=$(( (i - 1) % n ))
  order=("${order[@]:k}" "${order[@]:0:k}")
  for c in $CASES; do
    IFS=: read -r W R P <<< "$c"
    echo "round $i/$ROUNDS $(label "$W" "$R" "$P") $(date -u +%T)" >&2
    for s in "${order[@]}"; do
      case $s in
        felix) felix felix true set "$W" "$R" "$P" ;;
        felix-nomux) felix felix-nomux false set "$W" "$R" "$P" ;;
        felix-task) felix felix-task true task "$W" "$R" "$P" ;;
        etcd) peer etcd etcd-watch "$W" "$R" "$P" ;;
        nats-kv) peer nats-kv kv-watch "$W" "$R" "$P" ;;
      esac
    done
  done
done
python3 scripts/watch-summary.py "$OUT"
