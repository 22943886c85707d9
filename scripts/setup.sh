#!/usr/bin/env bash
# Installs the system packages Felix needs to build on Debian 12 (idempotent); with --test,
# also cargo-nextest and nftables, which only the test command needs.
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
dpkg -s libclang-dev >/dev/null 2>&1 || need+=(libclang-dev)
command -v curl >/dev/null || need+=(curl)
# The replication fault tests cut links with nftables (they fail without it, never skip).
[ "${1:-}" = "--test" ] && ! command -v nft >/dev/null && need+=(nftables)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found. Felix needs a Rust toolchain of at least the workspace's rust-version (Cargo.toml); Debian 12's rustc is too old: install one with rustup." >&2
  exit 1
fi
if [ "${1:-}" = "--test" ] && ! cargo nextest --version >/dev/null 2>&1; then
  cargo install cargo-nextest --locked
fi
