#!/usr/bin/env bash
# CI check of the Debian packaging, in seconds and without a release build:
#  1. The package's contents (broker/Cargo.toml [package.metadata.deb] assets and conf-files)
#     match the table in docs/operations.md, "Deploying on a host", both ways; the maintainer
#     scripts parse and create the felix user and /var/lib/felix.
#  2. The assets are installed into a temporary root (built binaries from FELIX_BIN_DIR,
#     default $CARGO_TARGET_DIR/debug, standing in for target/release) beside the host's
#     systemd units, and `systemd-analyze verify --root=` checks felix-broker.service and
#     felix-controlplane.service there. systemd only warns on a bad line, so any message
#     fails the check, as does a binary ExecStart= names that the package lacks. Two broken
#     copies (a bad line; a missing binary) must be reported, so a verify that accepts
#     everything cannot pass unnoticed.
#  3. The units say what the docs promise (User, StateDirectory, EnvironmentFile, Restart,
#     limits, disjoint CPUAffinity=), and the shipped configuration loads: felix-broker
#     --print-config with broker.env and broker.yaml under the unit's CPUAffinity= runs one
#     core per allowed CPU; felix-controlplane --print-config with controlplane.env; each
#     unit's TimeoutStopSec exceeds its process's drain deadline; the broker's control-plane
#     URL, CA and node credential match the control plane's HTTPS and auth (checked against
#     a broken copy too).
# Needs python3 (3.11+, tomllib) and systemd-analyze (installs the systemd package if
# missing). Run after `cargo build --workspace`.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
BIN="${FELIX_BIN_DIR:-$CARGO_TARGET_DIR/debug}"
fail() { echo "check-packaging: $*" >&2; exit 1; }

for b in felix-broker felix-controlplane felixctl felix-loadgen; do
  [ -x "$BIN/$b" ] || fail "$BIN/$b is missing (cargo build --workspace first, or set FELIX_BIN_DIR)"
done
if ! command -v systemd-analyze >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
root="$tmp/root"

# 1 and 3 (static part): package metadata against the docs and the units; prints the assets
# to install as SOURCE<TAB>DEST<TAB>MODE.
python3 - "$BIN" > "$tmp/assets" <<'PY'
import os, re, sys, tomllib

bin_dir = sys.argv[1]
errors = []
meta = tomllib.load(open("broker/Cargo.toml", "rb"))["package"]["metadata"]["deb"]

def expect(cond, msg):
    if not cond:
        errors.append(msg)

expect(meta.get("name") == "felix", "the package is named felix")
installed = {}  # absolute destination -> (source on this machine, mode)
for src, dest, mode in meta["assets"]:
    name = os.path.basename(src)
    full = "/" + (dest + name if dest.endswith("/") else dest)
    if src.startswith("target/release/"):
        local = os.path.join(bin_dir, src[len("target/release/"):])
    else:
        local = os.path.normpath(os.path.join("broker", src))
    expect(os.path.isfile(local), f"asset {src}: {local} does not exist")
    expect(full not in installed, f"{full} installed twice")
    installed[full] = (local, mode)

# The docs' table of installed files, between the package-files markers.
doc = open("docs/operations.md").read()
sec = doc.split("\n## Deploying on a host\n", 1)
expect(len(sec) == 2, 'docs/operations.md has no "## Deploying on a host" section')
sec = sec[1].split("\n## ", 1)[0] if len(sec) == 2 else ""
block = re.search(r"<!-- package-files:begin -->(.*?)<!-- package-files:end -->", sec, re.S)
expect(block is not None, "the Deploying section has no package-files block")
documented = {}
for line in (block.group(1) if block else "").splitlines():
    m = re.match(r"\|\s*`(/[^`]+)`\s*\|(.*)\|\s*$", line)
    if m:
        documented[m.group(1)] = m.group(2)
for p in sorted(set(documented) - set(installed)):
    errors.append(f"the docs list {p}, the package does not install it")
for p in sorted(set(installed) - set(documented)):
    errors.append(f"the package installs {p}, the docs do not list it")
for bin_ in ["felix-broker", "felix-controlplane", "felixctl", "felix-loadgen"]:
    expect(f"/usr/bin/{bin_}" in installed, f"/usr/bin/{bin_} is not in the package")
    expect(installed.get(f"/usr/bin/{bin_}", ("", ""))[1] == "755", f"/usr/bin/{bin_} is not mode 755")
etc = {p for p in installed if p.startswith("/etc/")}
expect(set(meta.get("conf-files", [])) == etc,
       f"conf-files {sorted(meta.get('conf-files', []))} != the /etc assets {sorted(etc)}")
for p in etc:
    expect("conffile" in documented.get(p, ""), f"the docs do not call {p} a conffile")

# Maintainer scripts.
scripts = os.path.normpath(os.path.join("broker", meta["maintainer-scripts"]))
for s in ["postinst", "prerm", "postrm"]:
    path = os.path.join(scripts, s)
    expect(os.access(path, os.X_OK), f"{path} is not an executable file")
    if os.path.isfile(path):
        expect(os.system(f"sh -n '{path}'") == 0, f"{path} does not parse")
postinst = open(os.path.join(scripts, "postinst")).read() if os.path.isfile(os.path.join(scripts, "postinst")) else ""
expect("adduser --system --group" in postinst and " felix\n" in postinst, "postinst does not create the felix system user")
expect("install -d -o felix -g felix -m 0750 /var/lib/felix" in postinst, "postinst does not create /var/lib/felix")
expect("daemon-reload" in postinst, "postinst does not run systemctl daemon-reload")

# The units.
def unit(name):
    path = installed.get(f"/lib/systemd/system/{name}", (None,))[0]
    expect(path is not None, f"{name} is not in the package")
    keys = {}
    for line in open(path).read().splitlines() if path else []:
        if "=" in line and not line.startswith(("#", ";", "[")):
            k, v = line.split("=", 1)
            keys.setdefault(k.strip(), []).append(v.strip())
    return {k: v[-1] for k, v in keys.items()}

def cpus(s):
    out = set()
    for part in s.replace(",", " ").split():
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out

def seconds(v):
    m = re.fullmatch(r"(\d+)\s*(s|sec|min)?", v or "")
    expect(m is not None, f"TimeoutStopSec={v!r} not understood by this check")
    return int(m.group(1)) * (60 if m and m.group(2) == "min" else 1) if m else 0

units = {}
for name, env in [("felix-broker.service", "broker.env"), ("felix-controlplane.service", "controlplane.env")]:
    u = units[name] = unit(name)
    for k, v in [("User", "felix"), ("StateDirectory", "felix"),
                 ("WorkingDirectory", "/var/lib/felix"), ("Restart", "on-failure"), ("RestartSec", "2"),
                 ("RestartPreventExitStatus", "2"), ("KillSignal", "SIGTERM"),
                 ("EnvironmentFile", f"-/etc/felix/{env}")]:
        expect(u.get(k) == v, f"{name}: {k}={u.get(k)} (want {v})")
    for k in ["LimitMEMLOCK", "LimitNOFILE", "CPUAffinity", "TimeoutStopSec"]:
        expect(k in u, f"{name}: no {k}=")
    expect(f"/etc/felix/{env}" in installed, f"{name}'s EnvironmentFile /etc/felix/{env} is not in the package")
b, c = units["felix-broker.service"], units["felix-controlplane.service"]
expect(b.get("LimitMEMLOCK") == "infinity", "felix-broker.service: LimitMEMLOCK is not infinity")
if "CPUAffinity" in b and "CPUAffinity" in c:
    expect(not (cpus(b["CPUAffinity"]) & cpus(c["CPUAffinity"])),
           "the broker's and the control plane's CPUAffinity= overlap")
stop_b, stop_c = seconds(b.get("TimeoutStopSec")), seconds(c.get("TimeoutStopSec"))
if errors:
    for e in errors:
        print("check-packaging:", e, file=sys.stderr)
    sys.exit(1)
for dest, (src, mode) in sorted(installed.items()):
    print(f"{src}\t{dest}\t{mode}")
# Values the shell part needs, as pseudo-assets.
print(f"@cpuaffinity\t{b['CPUAffinity']}\t-")
print(f"@stop_broker\t{stop_b}\t-")
print(f"@stop_controlplane\t{stop_c}\t-")
PY

# 2: install into the temporary root and verify the units there.
mkdir -p "$root/usr/lib/systemd"
cp -a /usr/lib/systemd/system "$root/usr/lib/systemd/"
ln -s usr/lib "$root/lib"
declare -A value
while IFS=$'\t' read -r src dest mode; do
  case "$src" in
    @*) value[${src#@}]="$dest"; continue ;;
  esac
  install -D -m "$mode" "$src" "$root$dest"
done < "$tmp/assets"

verify() { # unit name; prints systemd-analyze's messages and fails on any
  local out rc=0
  out=$(cd "$tmp" && timeout 30 systemd-analyze verify --man=no --root="$root" "$1" 2>&1) || rc=$?
  if [ "$rc" -ne 0 ] || [ -n "$out" ]; then
    printf '%s\n' "${out:-systemd-analyze verify $1 exited $rc}"
    return 1
  fi
}
for u in felix-broker.service felix-controlplane.service; do
  msg=$(verify "$u") || fail "systemd-analyze verify $u: $msg"
done
# The negative twins: a broken line, and a binary the package lacks.
mkdir -p "$root/etc/systemd/system"
sed 's/^Restart=on-failure$/Restart=sometimes/' "$root/lib/systemd/system/felix-broker.service" \
  > "$root/etc/systemd/system/felix-broken-line.service"
sed 's|^ExecStart=/usr/bin/felix-broker|ExecStart=/usr/bin/felix-missing|' \
  "$root/lib/systemd/system/felix-broker.service" > "$root/etc/systemd/system/felix-broken-exec.service"
for u in felix-broken-line.service felix-broken-exec.service; do
  if verify "$u" >/dev/null; then
    fail "systemd-analyze verify accepted the deliberately broken $u; the check cannot be trusted"
  fi
done

# 3: the shipped configuration, as the units would run it.
envfile() { # env file -> KEY=VALUE args, /etc/felix paths mapped into the root
  sed -n 's/^\([A-Z_][A-Z0-9_]*\)=\(.*\)$/\1=\2/p' "$1" | sed "s|=/etc/felix/|=$root/etc/felix/|"
}
mapfile -t benv < <(envfile "$root/etc/felix/broker.env")
mapfile -t cenv < <(envfile "$root/etc/felix/controlplane.env")
aff="${value[cpuaffinity]}"
if n=$(taskset -c "$aff" nproc 2>/dev/null); then
  cfg=$(env -i PATH="$PATH" "${benv[@]}" timeout 30 taskset -c "$aff" "$BIN/felix-broker" --print-config) \
    || fail "felix-broker does not start on the shipped broker.env + broker.yaml"
  cores=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["cores"])' <<<"$cfg")
  [ "$cores" = "$n" ] || fail "under CPUAffinity=$aff the broker runs $cores cores, the allowed set has $n CPUs"
else
  echo "check-packaging: this host has no CPU in the broker's CPUAffinity=$aff; cores-per-CPU part skipped" >&2
  cfg=$(env -i PATH="$PATH" "${benv[@]}" timeout 30 "$BIN/felix-broker" --print-config) \
    || fail "felix-broker does not start on the shipped broker.env + broker.yaml"
fi
ccfg=$(env -i PATH="$PATH" "${cenv[@]}" timeout 30 "$BIN/felix-controlplane" --print-config) \
  || fail "felix-controlplane does not start on the shipped controlplane.env"
# The shipped broker reaches the shipped control plane: the same scheme (HTTPS unless the
# control plane turns it off), the dev CA the control plane writes, and a node credential when
# the control plane checks tokens. A broker config pointed at http:// must be refused, so a
# check that accepts everything cannot pass unnoticed.
reaches() { # broker print-config JSON, control-plane print-config JSON
  python3 - "$1" "$2" <<'PY'
import json, sys
b, c = json.loads(sys.argv[1]), json.loads(sys.argv[2])
url = b.get("controlplane_url") or ""
scheme = "https" if c["tls"] == "on" else "http"
bad = []
if not url.startswith(scheme + "://"):
    bad.append(f"controlplane_url {url!r} is not {scheme}:// (control plane tls = {c['tls']})")
if c["tls"] == "on" and not c.get("tls_cert_file"):
    want = c["raft_data_dir"].rstrip("/") + "/tls/ca.pem"
    if b.get("controlplane_ca") != want:
        bad.append(f"controlplane_ca {b.get('controlplane_ca')!r} is not the dev CA {want}")
if c["auth"] == "on" and not b.get("controlplane_token_file"):
    bad.append("no controlplane_token_file, and the control plane checks tokens")
for m in bad:
    print("check-packaging:", m, file=sys.stderr)
sys.exit(1 if bad else 0)
PY
}
reaches "$cfg" "$ccfg" || fail "the shipped broker.yaml does not reach the shipped control plane"
if reaches "${cfg//https:/http:}" "$ccfg" 2>/dev/null; then
  fail "the broker-to-control-plane check accepted an http:// URL against an HTTPS control plane"
fi
drain() { python3 -c 'import json,sys; print(json.load(sys.stdin)["drain_timeout_ms"])'; }
bdrain=$(drain <<<"$cfg")
cdrain=$(drain <<<"$ccfg")
bstop=${value[stop_broker]}
cstop=${value[stop_controlplane]}
# Each exits by its drain timeout plus a grace second at the latest (docs/operations.md, Shutdown).
[ $((bstop * 1000)) -gt $((bdrain + 1000)) ] \
  || fail "felix-broker.service TimeoutStopSec=${bstop}s does not exceed drain_timeout_ms $bdrain + 1 s"
[ $((cstop * 1000)) -gt $((cdrain + 1000)) ] \
  || fail "felix-controlplane.service TimeoutStopSec=${cstop}s does not exceed drain_timeout_ms $cdrain + 1 s"
echo "check-packaging: ok ($(grep -c $'\t/' "$tmp/assets") package files; units verified; config loads; broker cores=${cores:-?} under CPUAffinity=$aff)"
