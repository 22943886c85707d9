#!/usr/bin/env bash
# Property-based run of Schemathesis (PyPI) against the control plane's generated
# /v1/openapi.json: every operation gets generated valid and invalid inputs, and no answer may
# be a 5xx (plus status-code and response-schema conformance). One real felix-controlplane on a
# free loopback port per store (memory, then single-member raft in a temp dir). Bounded by
# --max-time per store. The venv is cached outside the clone.
#
# Auth and HTTPS are on (the control plane's defaults): each store is run with the admin token it wrote,
# then without a token, where every operation but health and the document must answer 401
# (checked for each operation of the document, and by a shorter Schemathesis pass whose
# answers must still conform to the document).
#
#   scripts/schemathesis.sh                 # both stores, 60 s each
#   ST_MAX_TIME=20 scripts/schemathesis.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
VENV="${FELIX_VENV_DIR:-/var/cache/felix-venv}/schemathesis"
ST_VERSION="4.32.5"
MAX_TIME="${ST_MAX_TIME:-60}"

if [ ! -x "$VENV/bin/st" ] || [ "$("$VENV/bin/st" --version 2>/dev/null | awk '{print $3}')" != "$ST_VERSION" ]; then
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "schemathesis==$ST_VERSION"
fi

# The same feature set as the test command's workspace build, so it is not rebuilt.
nice -n 10 cargo build --workspace --all-targets
BIN="$CARGO_TARGET_DIR/debug/felix-controlplane"

WORK="$(mktemp -d)"
PID=""
cleanup() {
  if [ -n "$PID" ]; then kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

run_store() {
  # The control plane serves HTTPS (its default) with the development CA it writes beside
  # the admin token: every client here verifies it.
  local name="$1" tokfile="$2"; shift 2
  local ca; ca="$(dirname "$tokfile")/tls/ca.pem"
  : >"$WORK/out"
  FELIX_LOG=error "$BIN" --listen 127.0.0.1:0 --max-wait-ms 200 --write-timeout-ms 2000 "$@" >"$WORK/out" &
  PID=$!
  local addr=""
  for _ in $(seq 1 200); do
    addr="$(sed -n 's/^listening //p' "$WORK/out" | head -1)"
    [ -n "$addr" ] && break
    sleep 0.05
  done
  [ -n "$addr" ] || { echo "felix-controlplane ($name) did not start"; exit 1; }
  for _ in $(seq 1 200); do
    curl -fsS --cacert "$ca" "https://$addr/readyz" >/dev/null 2>&1 && break
    sleep 0.05
  done
  for _ in $(seq 1 200); do [ -s "$tokfile" ] && break; sleep 0.05; done
  [ -s "$tokfile" ] || { echo "felix-controlplane ($name) wrote no admin token at $tokfile"; exit 1; }
  local tok; tok="$(cat "$tokfile")"
  echo "== schemathesis against the $name store at $addr, with the admin token (max ${MAX_TIME}s)"
  # Run from the temp dir: schemathesis leaves a .schemathesis/ cache in its working dir.
  # One worker: with two, hypothesis parses lambda sources from two threads and CPython 3.11.7
  # (this machine's) intermittently dies with "SystemError: AST constructor recursion depth
  # mismatch" (python/cpython#106905) — a tool crash, not a finding.
  (cd "$WORK" && "$VENV/bin/st" run "https://$addr/v1/openapi.json" --tls-verify "$ca" \
    -H "Authorization: Bearer $tok" \
    --checks not_a_server_error,status_code_conformance,response_schema_conformance,content_type_conformance \
    --max-time "$MAX_TIME" --workers 1 --max-failures 20 \
    --suppress-health-check all --warnings off)
  echo "== without a token: every operation but health and the document answers 401"
  python3 - "$addr" "$ca" <<'PY'
import json, ssl, sys, urllib.request, urllib.error
addr, ca = sys.argv[1], sys.argv[2]
tls = ssl.create_default_context(cafile=ca)
doc = json.load(urllib.request.urlopen(f"https://{addr}/v1/openapi.json", context=tls))
public = {"/livez", "/readyz", "/v1/openapi.json"}
bad, n = [], 0
for path, item in doc["paths"].items():
    for method in ("get", "post", "put", "patch", "delete"):
        if method not in item:
            continue
        url = "https://" + addr + path.replace("{", "x").replace("}", "")
        req = urllib.request.Request(url, method=method.upper(), data=b"{}" if method in ("post", "put", "patch") else None,
                                     headers={"Content-Type": "application/json"})
        try:
            code = urllib.request.urlopen(req, context=tls).status
        except urllib.error.HTTPError as e:
            code = e.code
        n += 1
        want = 200 if path in public else 401
        if code != want:
            bad.append(f"{method.upper()} {path}: {code}, expected {want}")
if bad:
    print("\n".join(bad)); sys.exit(1)
print(f"{n} operations: 401 without a token, health and the document open")
PY
  (cd "$WORK" && "$VENV/bin/st" run "https://$addr/v1/openapi.json" --tls-verify "$ca" \
    --checks not_a_server_error,status_code_conformance,response_schema_conformance,content_type_conformance \
    --max-time "$(( (MAX_TIME + 2) / 3 ))" --workers 1 --max-failures 20 \
    --suppress-health-check all --warnings off)
  kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
}

run_store memory "$WORK/admin.token" --store memory --admin-token-file "$WORK/admin.token"
mkdir -p "$WORK/raft"
run_store raft "$WORK/raft/admin.token" --store raft --raft-data-dir "$WORK/raft"
echo "schemathesis: no 5xx and no conformance failure on either store"
