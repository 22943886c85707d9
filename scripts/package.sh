#!/usr/bin/env bash
# Builds the `felix` Debian package: all four binaries, the systemd units, the default
# configuration under /etc/felix and the maintainer scripts (metadata: broker/Cargo.toml
# [package.metadata.deb]; what it installs: docs/operations.md, "Deploying on a host").
# A release build (~6 min from clean), scripts/check-packaging.sh on its binaries, then
# cargo-deb (installed if missing). Not run by CI, which runs only the check.
#
#   ./scripts/package.sh            # prints the path of the .deb
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/felix-target}"
mkdir -p "$CARGO_TARGET_DIR" 2>/dev/null || export CARGO_TARGET_DIR="$HOME/.cache/felix-target"
cargo build --release --workspace --bins
FELIX_BIN_DIR="$CARGO_TARGET_DIR/release" ./scripts/check-packaging.sh
if ! command -v cargo-deb >/dev/null; then
  cargo install cargo-deb --locked
fi
# --no-build: the release build above made every binary the assets name.
cargo deb -p felix-broker --no-build
ls -1 "$CARGO_TARGET_DIR"/debian/felix_*.deb
