#!/usr/bin/env bash
# Fetches a real model if absent (sha256-checked), builds shoal in release mode if needed,
# and has it answer: a chat turn with the model's own template, streamed to the terminal.
# Usage: scripts/start.sh [model id] [prompt]   (ids: qwen2.5-coder-1.5b, gemma3-270m)
# It does not start the HTTP API or the swarm yet: those arrive with their issues.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-qwen2.5-coder-1.5b}"
prompt="${2:-Write a Python function that reverses a string.}"
dir="$(scripts/fetch-model.sh "$model")"
cargo build --release --bin shoal >&2
chat=(--chat)
# Gemma 3 270M is a base model without a chat template: continue the text instead.
[ "$model" = "gemma3-270m" ] && chat=()
exec target/release/shoal run --model "$dir/model.gguf" --prompt "$prompt" --max-tokens 256 "${chat[@]}"
