#!/usr/bin/env bash
# test-aarch64.sh — the kernel tests (tests/kernels.rs: every NEON kernel, with and without
# `sdot`, against the portable reference and candle) built for aarch64 Linux and run under qemu's
# user-mode emulator on an x86-64 host. Installs what it needs when missing: qemu-user, the
# aarch64 cross gcc/g++ and libc (apt), and the Rust target (rustup). Checks correctness only:
# qemu says nothing about speed.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
missing=()
command -v qemu-aarch64 >/dev/null 2>&1 || missing+=(qemu-user)
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || missing+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || missing+=(g++-aarch64-linux-gnu)
if [ ${#missing[@]} -gt 0 ]; then
    echo "[test-aarch64] installing ${missing[*]}" >&2
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
# qemu's default CPU model has FEAT_DotProd, so both NEON variants run.
exec cargo test --release --target "$TARGET" --test suite -- kernels::
