#!/usr/bin/env bash
# build-cuda.sh — build `shoal` with the `cuda` feature on a machine that has no CUDA toolkit.
#
# Usage: scripts/build-cuda.sh [--compute-cap 90] [-- extra cargo args]
#   Prints the path of the stripped binary as the only line on stdout, and packs both binaries
#   (shoal, examples/device_check) gzipped into .gpu/ for scripts/gpu-check.sh on a GPU machine,
#   with .gpu/mv_bench (node/cuda/mv_bench.cu: the decode kernels alone, timed per shape),
#   .gpu/pick_check (node/cuda/pick_check.cu: the greedy pick inside the LM head's launch, a check),
#   .gpu/q6k_layout_bench (node/cuda/q6k_layout_bench.cu: Q6_K rows, GGUF's layout against an aligned one),
#   .gpu/attend_bench (node/cuda/attend_bench.cu: long-context attention alone),
#   .gpu/attend_short_bench (node/cuda/attend_short_bench.cu: short-context attention's cycles by phase),
#   .gpu/residual_read_probe (node/cuda/residual_read_probe.cu: every block reading the residual) and
#   .gpu/chain_floor_bench (node/cuda/chain_floor_bench.cu: dependent launches with no weights, and
#   streaming a real model's bytes with nothing computed, as launches and as one persistent
#   kernel: `chain_floor_bench models`).
#
# What it does (the recipe measured in ../shared/GPU.md):
#   * pip-downloads the CUDA 13.0 wheels (nvcc, nvvm, crt, runtime, cccl, nvrtc, cublas, curand)
#     into ${SHOAL_CUDA_ROOT:-$HOME/.cache/shoal/cuda-13.0} and unpacks them into one toolkit tree;
#   * adds the unversioned library links and a stub libcuda.so (the real driver replaces it at
#     run time) so that cudarc links;
#   * builds `cargo build --release --features cuda` for CUDA_COMPUTE_CAP (default 90: H100/H200).
# What it does NOT do: install a driver, or make a binary for other GPU generations (rebuild
# with --compute-cap 80 for A100, 89 for L4/RTX 40xx, 120 for RTX 50xx).
#
# With a normal CUDA install (nvcc on PATH, libcuda from the driver) none of this is needed:
#   CUDA_COMPUTE_CAP=90 cargo build --release --features cuda
# On the GPU machine the binary needs libcuda.so.1 (driver), libcudart.so.13, libcublas.so.13,
# libcublasLt.so.13 and libcurand.so.10 on the library path.
set -euo pipefail
cap=90
while [[ $# -gt 0 ]]; do
  case "$1" in
    --compute-cap) cap="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
here="$(cd "$(dirname "$0")/.." && pwd)"
root="${SHOAL_CUDA_ROOT:-$HOME/.cache/shoal/cuda-13.0}"
tree="$root/nvidia/cu13"

if [[ ! -x "$tree/bin/nvcc" ]]; then
  echo "fetching CUDA 13.0 wheels into $root" >&2
  mkdir -p "$root/wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$root/wheels" \
    'nvidia-cuda-nvcc>=13.0,<13.1' 'nvidia-nvvm>=13.0,<13.1' 'nvidia-cuda-crt>=13.0,<13.1' \
    'nvidia-cuda-runtime>=13.0,<13.1' 'nvidia-cuda-cccl>=13.0,<13.1' 'nvidia-cuda-nvrtc>=13.0,<13.1' \
    'nvidia-cublas>=13.0,<13.1' 'nvidia-curand>=10.4,<10.5' >&2
  for w in "$root"/wheels/*.whl; do
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$root"
  done
  chmod +x "$tree"/bin/* "$tree"/nvvm/bin/* 2>/dev/null || true
fi
[[ -x "$tree/bin/nvcc" ]] || { echo "no nvcc in $tree/bin after unpacking the wheels" >&2; exit 1; }

lib="$tree/lib"
for n in cublas cublasLt cudart nvrtc; do
  [[ -e "$lib/lib$n.so" ]] || ln -sf "lib$n.so.13" "$lib/lib$n.so"
done
[[ -e "$lib/libcurand.so" ]] || ln -sf libcurand.so.10 "$lib/libcurand.so"

# A stub libcuda.so: one empty function for every driver symbol cudarc declares.
if [[ ! -e "$lib/stubs/libcuda.so" ]]; then
  mkdir -p "$lib/stubs"
  (cd "$here" && cargo fetch -q >&2)
  sys="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19*/src/driver/sys | head -1)"
  grep -rhoE '\bpub (unsafe )?fn (cu[A-Za-z0-9_]+)' "$sys" | awk '{print $NF}' | sort -u |
    sed 's/.*/void &(void) {}/' > "$lib/stubs/libcuda.c"
  grep -rhoE '"(cu[A-Za-z0-9_]+)"' "$sys" | tr -d '"' | sort -u | sed 's/.*/void &(void) {}/' >> "$lib/stubs/libcuda.c"
  sort -u -o "$lib/stubs/libcuda.c" "$lib/stubs/libcuda.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib/stubs/libcuda.so" "$lib/stubs/libcuda.c"
fi

export CUDA_ROOT="$tree" CUDA_HOME="$tree" CUDA_PATH="$tree" NVCC="$tree/bin/nvcc" CUDA_COMPUTE_CAP="$cap"
export PATH="$tree/bin:$PATH"
export LIBRARY_PATH="$lib:$lib/stubs:${LIBRARY_PATH:-}"
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$lib -L native=$lib/stubs"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/target-cuda}"
(cd "$here" && cargo build --release --features cuda --bin shoal --example device_check "$@" >&2)
bin="$CARGO_TARGET_DIR/release/shoal"
strip "$bin" "$CARGO_TARGET_DIR/release/examples/device_check"
# .gpu/ (git-ignored) is what travels to a GPU machine: both binaries gzipped, the Qwen tokenizer
# for the generated models, and `ip` (scripts/gpu-check.sh unpacks and uses them there).
mkdir -p "$here/.gpu"
gzip -c "$bin" > "$here/.gpu/shoal.gz"
gzip -c "$CARGO_TARGET_DIR/release/examples/device_check" > "$here/.gpu/device_check.gz"
# The `mv` kernels alone on the real shapes (a benchmark: run .gpu/mv_bench there).
nvcc -O3 -arch="sm_$cap" -L"$lib" -o "$here/.gpu/mv_bench" "$here/node/cuda/mv_bench.cu" >&2
# The greedy pick inside the LM head's launch against the host's argmax (a check: gpu-check.sh
# fidelity runs .gpu/pick_check).
nvcc -O3 -arch="sm_$cap" -L"$lib" -o "$here/.gpu/pick_check" "$here/node/cuda/pick_check.cu" >&2
# Q6_K rows in GGUF's 2-byte-aligned blocks against the same values split by field (.gpu/q6k_layout_bench).
nvcc -O3 -arch="sm_$cap" -L"$lib" -o "$here/.gpu/q6k_layout_bench" "$here/node/cuda/q6k_layout_bench.cu" >&2
# Long-context attention (`attend_group`) alone on the real shapes (.gpu/attend_bench).
nvcc -O3 -arch="sm_$cap" -L"$lib" -o "$here/.gpu/attend_bench" "$here/node/cuda/attend_bench.cu" >&2
# Short-context attention (`attend_d128`) alone, each phase's cycles once its input is there
# (.gpu/attend_short_bench).
nvcc -O3 -arch="sm_$cap" -L"$lib" -o "$here/.gpu/attend_short_bench" "$here/node/cuda/attend_short_bench.cu" >&2
# Every block reading the residual: time per block, one copy or several (.gpu/residual_read_probe).
nvcc -O3 -arch="sm_$cap" -L"$lib" -o "$here/.gpu/residual_read_probe" "$here/node/cuda/residual_read_probe.cu" >&2
# The floor a step's 141 dependent launches set, per hand-off with no weights and per step with a
# model's bytes (.gpu/chain_floor_bench [models]).
nvcc -O3 -arch="sm_$cap" -L"$lib" -o "$here/.gpu/chain_floor_bench" "$here/node/cuda/chain_floor_bench.cu" >&2
tok="${SHOAL_MODEL_CACHE:-$HOME/.cache/shoal/models}/qwen2.5-coder-1.5b/tokenizer.json"
[[ -f $tok ]] && cp "$tok" "$here/.gpu/tokenizer.json"
# iproute2's `ip` with the libraries it needs beyond libc, behind a wrapper: GPU machines without
# it can still run the mixed swarm in network namespaces (scripts/gpu-check.sh swarm).
if ip=$(command -v ip); then
  mkdir -p "$here/.gpu/netns/lib"
  cp "$ip" "$here/.gpu/netns/ip.bin"
  ldd "$ip" | awk '$3 ~ /^\// {print $3}' | grep -vE '/(libc|libm|libz|ld-linux[^/]*)\.so' | xargs -r -I{} cp -L {} "$here/.gpu/netns/lib/"
  printf '#!/bin/sh\nd="$(dirname "$(readlink -f "$0")")"\nLD_LIBRARY_PATH="$d/lib" exec "$d/ip.bin" "$@"\n' > "$here/.gpu/netns/ip"
  chmod +x "$here/.gpu/netns/ip"
fi
echo "$bin"
