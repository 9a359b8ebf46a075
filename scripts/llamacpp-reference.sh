#!/usr/bin/env bash
# llamacpp-reference.sh — regenerate tests/fixtures/llamacpp/greedy.json with llama.cpp.
#
# Usage: scripts/llamacpp-reference.sh [--no-bench|--bench-only] [--threads N] [--out FILE]
#
# What it does:
#   * installs npm node-llama-cpp@3.22.1 (with its prebuilt CPU binaries) into
#     scripts/.llamacpp/ via `npm install --prefix` (skipped when already installed;
#     install scripts are not run, nothing is compiled; scripts/.llamacpp/ is git-ignored);
#   * fetches both models with scripts/fetch-model.sh (cached, sha256-verified);
#   * runs scripts/llamacpp-reference.mjs: greedy 16-token continuations (token ids) for
#     the reference prompts on CPU with 2 threads, written to
#     tests/fixtures/llamacpp/greedy.json, plus pp256/tg128 throughput printed on stdout.
#
# What it does NOT do: build llama.cpp, use a GPU, or touch anything outside
# scripts/.llamacpp/, the model cache and the fixture file.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"

NLC_VERSION="3.22.1"
PREFIX="$ROOT/scripts/.llamacpp"
OUT="$ROOT/tests/fixtures/llamacpp/greedy.json"

args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --no-bench|--bench-only) args+=("$1"); shift ;;
        --threads) args+=("--threads" "$2"); shift 2 ;;
        *) echo "usage: $0 [--no-bench|--bench-only] [--threads N] [--out FILE]" >&2; exit 2 ;;
    esac
done

command -v node >/dev/null || { echo "node not found" >&2; exit 1; }
command -v npm >/dev/null || { echo "npm not found" >&2; exit 1; }

installed="$(node -p "try { require('$PREFIX/node_modules/node-llama-cpp/package.json').version } catch { '' }" 2>/dev/null || true)"
if [[ "$installed" != "$NLC_VERSION" ]]; then
    echo "[llamacpp-reference] installing node-llama-cpp@$NLC_VERSION into $PREFIX" >&2
    mkdir -p "$PREFIX"
    npm install --prefix "$PREFIX" --no-audit --no-fund --ignore-scripts \
        "node-llama-cpp@$NLC_VERSION" >&2 \
        || { echo "[llamacpp-reference] ERROR: npm install node-llama-cpp@$NLC_VERSION failed" >&2; exit 1; }
fi

GEMMA_DIR="$("$ROOT/scripts/fetch-model.sh" gemma3-270m)"
QWEN_DIR="$("$ROOT/scripts/fetch-model.sh" qwen2.5-coder-1.5b)"

exec node "$ROOT/scripts/llamacpp-reference.mjs" --out "$OUT" "${args[@]}" \
    "gemma3-270m=$GEMMA_DIR/model.gguf" \
    "qwen2.5-coder-1.5b=$QWEN_DIR/model.gguf"
