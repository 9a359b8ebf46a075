#!/usr/bin/env bash
# bench-vs-llamacpp.sh — shoal against llama.cpp on the same GGUF, the same CPU and the same
# thread count, alternating runs in one session, then a table of medians and ratios.
#
# Usage: scripts/bench-vs-llamacpp.sh [--threads N] [--rounds N] [--quick] [MODEL_ID ...]
#   MODEL_ID: gemma3-270m, qwen2.5-coder-1.5b (default: both); --threads defaults to 2;
#   --rounds (default 3) is how many times each side runs per model, alternating llama.cpp
#   then shoal; --quick (for CI) does one short round and only checks that both sides run.
#
# What it does: installs npm node-llama-cpp@3.22.1 (prebuilt CPU binaries, nothing compiled)
# into scripts/.llamacpp/ when missing, fetches the models (sha256-checked), builds shoal in
# release mode, and times llama.cpp through scripts/llamacpp-reference.mjs --bench-only
# (prompt processing of 256 tokens, 5 runs; decode of 128 tokens, 3 runs; batch 512) and
# `shoal bench --json` (256-token prompt, 128 decode tokens, 3 runs each).
# It asserts nothing about speed: it prints figures. Medians over every run of the session.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"

THREADS=2
ROUNDS=3
QUICK=0
MODELS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --threads) THREADS="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --quick) QUICK=1; ROUNDS=1; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; exit 2 ;;
        *) MODELS+=("$1"); shift ;;
    esac
done
[[ ${#MODELS[@]} -gt 0 ]] || MODELS=(gemma3-270m qwen2.5-coder-1.5b)

command -v node >/dev/null || { echo "node not found" >&2; exit 1; }
command -v npm >/dev/null || { echo "npm not found" >&2; exit 1; }

NLC_VERSION="3.22.1"
PREFIX="$ROOT/scripts/.llamacpp"
installed="$(node -p "try { require('$PREFIX/node_modules/node-llama-cpp/package.json').version } catch { '' }" 2>/dev/null || true)"
if [[ "$installed" != "$NLC_VERSION" ]]; then
    echo "[bench] installing node-llama-cpp@$NLC_VERSION into $PREFIX" >&2
    mkdir -p "$PREFIX"
    npm install --prefix "$PREFIX" --no-audit --no-fund --ignore-scripts "node-llama-cpp@$NLC_VERSION" >&2
fi

echo "[bench] building shoal (release)" >&2
cargo build --release --bin shoal >&2
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
SHOAL="$TARGET_DIR/release/shoal"

SHOAL_ARGS=(--threads "$THREADS" --json)
if [[ $QUICK == 1 ]]; then SHOAL_ARGS+=(--prompt-tokens 64 --gen-tokens 16 --repetitions 1); fi

LOAD_BEFORE="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
for model in "${MODELS[@]}"; do
    dir="$("$ROOT/scripts/fetch-model.sh" "$model")"
    for ((r = 1; r <= ROUNDS; r++)); do
        echo "[bench] $model round $r/$ROUNDS: llama.cpp" >&2
        node "$ROOT/scripts/llamacpp-reference.mjs" --bench-only --threads "$THREADS" "$model=$dir/model.gguf" 2>/dev/null \
            | grep '^\[bench\]' >> "$WORK/llama-$model.txt"
        echo "[bench] $model round $r/$ROUNDS: shoal" >&2
        "$SHOAL" bench --model "$dir/model.gguf" "${SHOAL_ARGS[@]}" >> "$WORK/shoal-$model.jsonl"
    done
done

LOAD_AFTER="$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo '?')"
echo "load average before: $LOAD_BEFORE, after: $LOAD_AFTER (on a shared machine, other work skews both sides)"
node - "$WORK" "$THREADS" "${MODELS[@]}" <<'JS'
const fs = require("fs");
const [work, threads, ...models] = process.argv.slice(2);
const median = (xs) => { const v = [...xs].sort((a, b) => a - b); const n = v.length; return n % 2 ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2; };
const f1 = (x) => x.toFixed(1).padStart(8);
const f2 = (x) => x.toFixed(2).padStart(6);
console.log(`threads=${threads}; medians over every run; ratio = shoal / llama.cpp; roofline = decode tok/s × weight bytes per token ÷ read bandwidth (shoal's: each run against the probes beside it)`);
console.log("model                phase    shoal tok/s  llama.cpp tok/s   ratio  shoal roofline  llama roofline");
for (const m of models) {
    const llamaLines = fs.readFileSync(`${work}/llama-${m}.txt`, "utf8").trim().split("\n");
    const runs = (re) => llamaLines.flatMap((l) => { const g = l.match(re); return g ? g[1].split(",").map((s) => parseFloat(s)) : []; });
    const lpp = median(runs(/pp ([^;]*);/)), ltg = median(runs(/tg ([^\]]*)\]/));
    const ours = fs.readFileSync(`${work}/shoal-${m}.jsonl`, "utf8").trim().split("\n").map((l) => JSON.parse(l));
    const spp = median(ours.flatMap((o) => o.prefill_runs)), stg = median(ours.flatMap((o) => o.decode_runs));
    // Each decode run's roofline is set against the bandwidth probed beside it (`shoal bench`);
    // llama.cpp's, run minutes apart, against the median of every probe.
    const bw = median(ours.flatMap((o) => o.mem_bw_runs)), bytes = ours[0].bytes_per_token;
    const sroof = median(ours.flatMap((o) => o.roofline_runs));
    console.log(`${m.padEnd(20)} prompt   ${f1(spp)}     ${f1(lpp)}        ${f2(spp / lpp)}`);
    console.log(`${m.padEnd(20)} decode   ${f1(stg)}     ${f1(ltg)}        ${f2(stg / ltg)}          ${f2(sroof)}          ${f2(ltg * bytes / bw)}`);
    console.log(`${"".padEnd(20)} (${(bytes / 1e6).toFixed(0)} MB weights per token, ${(bw / 1e9).toFixed(1)} GB/s read, shoal peak RSS ${(Math.max(...ours.map((o) => o.rss_bytes)) / 1e6).toFixed(0)} MB)`);
}
JS
