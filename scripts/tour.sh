#!/usr/bin/env bash
# A new user's walk through the README, as a test: starts Felix with ./scripts/run.sh (fresh
# data dir, default ports), runs every `$F/felixctl ...` command of README.md in order, and
# fails when one does not do what the README says. Then: felixctl from another directory (the
# context run.sh writes), SIGTERM ends run.sh with 143, a restart keeps durable records, and a
# control plane that dies stops run.sh (code 1, saying so).
#
#   FELIX_BIN_DIR=/path/to/target/debug ./scripts/tour.sh
#
# FELIX_BIN_DIR: the binaries to use (default: $CARGO_TARGET_DIR/debug, as built by
# scripts/test.sh, so CI pays for no second build). Every wait is bounded.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
F="${FELIX_BIN_DIR:-$CARGO_TARGET_DIR/debug}"
F=$(cd "$F" && pwd) # the README commands run from another directory
for b in felix-broker felix-controlplane felixctl; do
  [ -x "$F/$b" ] || { echo "tour: $F/$b missing (build first, or set FELIX_BIN_DIR)" >&2; exit 1; }
done
for port in 7400 7401 7410; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "tour: something already listens on 127.0.0.1:$port; stop it first" >&2
    exit 1
  fi
done
T=$(mktemp -d)
export FELIX_DATA_DIR="$T/felix-data"
export FELIX_CONTEXT_FILE="$T/felixctl.json"
export FELIX_BIN_DIR="$F"
unset FELIX_BROKER FELIX_CA FELIX_CONTROLPLANE_URL FELIX_CONTEXT || true
RUN_PID=""
BG=()
cleanup() {
  for p in "${BG[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ -n "$RUN_PID" ]; then kill -TERM "$RUN_PID" 2>/dev/null || true; wait "$RUN_PID" 2>/dev/null || true; fi
  rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "tour: FAIL: $*" >&2; echo "--- run.sh log:" >&2; tail -n 30 "$T/run.log" >&2 || true; exit 1; }

start() {
  (cd "$T" && exec "$ROOT/scripts/run.sh" >> "$T/run.log" 2>&1) &
  RUN_PID=$!
  for _ in $(seq 1 300); do
    "$F/felixctl" --timeout-ms 1000 describe events > /dev/null 2>&1 && return 0
    kill -0 "$RUN_PID" 2>/dev/null || fail "run.sh exited during start"
    sleep 0.1
  done
  fail "Felix did not come up within 30 s"
}

# What a command's output must show, by a fragment of the command (README comment says why).
expect_for() {
  case "$1" in
    *"describe events"*) echo 'default/default/events +4' ;;
    *"publish events hello world"*) echo 'shard [0-9]+ offset [0-9]+ count 1' ;;
    *"--count 2 --json"*) echo '"offset":' ;;
    *"stream create orders --shards 2"*) echo 'orders' ;;
    *"publish orders first"*) echo 'shard 0 offset 0 count 1' ;;
    *"subscribe orders --from earliest"*) echo '\[0:0\] first' ;;
    *"group create"*) echo 'created' ;;
    *"group poll"*) echo '^0:0:1 first' ;;
    *"group ack"*) echo '0:0:1 ok' ;;
    *"kv put"*) echo '^version [0-9]+' ;;
    *"kv get"*) echo '^alice$' ;;
    *"counter add"*) echo '^1$' ;;
    *"tenant create acme"*) echo 'acme' ;;
    *"namespace create prod"*) echo 'prod' ;;
    *"stream create orders --shards 4"*) echo 'orders' ;;
    *"shard ls orders"*) echo '^0 ' ;;
    *) echo '' ;;
  esac
}

start
echo "tour: Felix is up ($(tr -d '\n' < "$T/run.log" | head -c 0))"
n=0
while IFS= read -r line; do
  cmd=${line#    }
  cmd=${cmd%%#*}
  cmd=$(echo "$cmd" | sed 's/[[:space:]]*$//')
  cmd=${cmd//\$F/$F}
  n=$((n + 1))
  if [[ "$cmd" == *"&" ]]; then
    cmd=${cmd%&}
    (cd "$T" && exec timeout 60 bash -c "$cmd" > "$T/bg$n.out" 2>&1) &
    BG+=($!)
    BGOUT+=("$T/bg$n.out:$cmd")
    sleep 0.5
    continue
  fi
  out=$(cd "$T" && timeout 30 bash -c "$cmd" 2>&1) || fail "exit $? from: $cmd
$out"
  want=$(expect_for "$cmd")
  if [ -n "$want" ] && ! grep -Eq "$want" <<< "$out"; then
    fail "$cmd
printed:
$out
expected a line matching: $want"
  fi
  echo "tour: ok: ${cmd#"$F/"}"
done < <(grep -E '^    \$F/felixctl ' README.md)
[ "$n" -ge 10 ] || fail "found only $n README commands"
# The background commands saw what the foreground ones did.
sleep 1
for entry in "${BGOUT[@]}"; do
  file=${entry%%:*}
  case "$entry" in
    *"subscribe events"*) grep -q '] hello' "$file" || fail "the background subscribe saw no 'hello': $(cat "$file")" ;;
    *"kv watch"*) grep -q 'user/1 = alice' "$file" || fail "the background watch saw no user/1: $(cat "$file")" ;;
  esac
  echo "tour: ok (background): ${entry#*:$F/}"
done

# felixctl from another directory finds the broker and its CA through run.sh's context.
(cd / && "$F/felixctl" describe events > /dev/null) || fail "felixctl from / did not find the broker"
echo "tour: ok: felixctl from another directory"

# Wait (bounded) for run.sh to end; its exit code in $code (no subshell: only this shell
# can wait for its child).
run_exit() {
  timeout 30 tail --pid="$RUN_PID" -f /dev/null || fail "run.sh did not exit within 30 s"
  set +e
  wait "$RUN_PID"
  code=$?
  set -e
}

# SIGTERM: run.sh exits 143 and stops both processes.
kill -TERM "$RUN_PID"
run_exit
RUN_PID=""
[ "$code" = 143 ] || fail "run.sh exited $code on SIGTERM, not 143"
"$F/felixctl" --timeout-ms 500 describe events > /dev/null 2>&1 && fail "the broker still answers after SIGTERM"
echo "tour: ok: SIGTERM -> 143"

# A restart keeps durable records.
start
out=$("$F/felixctl" subscribe orders --from earliest --shard 0 --count 1 --idle-exit-ms 5000)
grep -q '\[0:0\] first' <<< "$out" || fail "after a restart, orders shard 0 lost 'first': $out"
echo "tour: ok: restart keeps durable records"

# The control plane dies: run.sh says so, stops the broker, exits 1.
cp=$(pgrep -P "$RUN_PID" -f "/felix-controlplane " || true)
[ -n "$cp" ] || fail "no felix-controlplane child of run.sh"
kill -KILL "$cp"
run_exit
RUN_PID=""
[ "$code" = 1 ] || fail "run.sh exited $code when the control plane died, not 1"
grep -q "felix-controlplane exited" "$T/run.log" || fail "run.sh did not say the control plane exited"
echo "tour: ok: a dead control plane stops run.sh"
echo "tour: passed ($n README commands)"
