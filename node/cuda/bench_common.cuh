// bench_common.cuh — what the standalone kernel harnesses (mv_bench.cu, attend_bench.cu,
// attend_short_bench.cu, pick_check.cu, q6k_layout_bench.cu, chain_floor_bench.cu) share: a CUDA call checked, the step tags launches read, a launch that may overlap
// the previous kernel (as the engine's), the mean time of a launch, a checksum of a device buffer
// that builds can be compared by, an integer from the environment (BENCH_SERIAL=1: launches in plain stream order), random values in [-1, 1], and random weights in each format. Included after decode.cu (its formats and `fmt_bytes`). Nothing else: each harness sets
// up its own shapes and arguments.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cstring>
#include <cstdint>
#include <cuda_fp16.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

// Tags 1, 2, ... n on the device: a launch each (the engine's steps), so that no launch reads an
// earlier one's tagged words.
inline unsigned long long* launch_tags(size_t n) {
    std::vector<unsigned long long> host(n);
    for (size_t i = 0; i < n; i++) host[i] = i + 1;
    unsigned long long* tags = nullptr;
    CK(cudaMalloc(&tags, n * 8));
    CK(cudaMemcpy(tags, host.data(), n * 8, cudaMemcpyHostToDevice));
    return tags;
}

// An integer from the environment, or `fallback`.
inline int env_int(const char* name, int fallback) { return getenv(name) ? atoi(getenv(name)) : fallback; }

// µs a launch: `launch(k)` once for each of `copies` (warming them), then `iters` times round them.
template <typename Launch>
double us_per_launch(Launch launch, int copies, int iters) {
    for (int k = 0; k < copies; k++) launch(k);
    CK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; i++) launch(i % copies);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ms * 1000.0 / iters;
}

// One launch as the engine makes it on Hopper: allowed to start while the previous kernel
// finishes (programmatic stream serialization). BENCH_SERIAL=1: in plain stream order instead, so
// that a launch's time includes its ramp and its tail, as the step's last launch (the LM head)
// pays them with nothing of its own kind beside it.
template <typename Args>
inline void launch_overlapping(void (*kernel)(Args), dim3 grid, dim3 block, size_t smem, Args a, cudaStream_t stream = 0) {
    static const bool serial = env_int("BENCH_SERIAL", 0) != 0;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = serial ? 0 : 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, a));
}

// Σ value i × (i mod 7 + 1) over `n` floats on the device.
inline double checksum(const float* device_values, size_t n) {
    std::vector<float> host(n);
    CK(cudaMemcpy(host.data(), device_values, n * 4, cudaMemcpyDeviceToHost));
    double check = 0;
    for (size_t i = 0; i < n; i++) check += host[i] * (double)(i % 7 + 1);
    return check;
}

// The next of a xorshift sequence's values in [-1, 1], steps of 0.001 (the attention benches'
// caches and q/k/v).
inline float random_unit(uint64_t& st) {
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return ((int)(st % 2001) - 1000) * 1e-3f;
}

inline uint16_t f2h(float f) { __half h = __float2half(f); uint16_t u; memcpy(&u, &h, 2); return u; }

// Random weights whose scales are sane halves (so sums stay finite).
inline std::vector<uint8_t> random_weights(int fmt, size_t rows, size_t cols, unsigned seed) {
    size_t n = fmt_bytes(fmt, rows * cols);
    std::vector<uint8_t> w(n);
    srand(seed);
    uint64_t st = 0x9E3779B97F4A7C15ull * seed;
    for (size_t i = 0; i < n; i++) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; w[i] = (uint8_t)st; }
    auto put = [&](size_t off, float v) { uint16_t h = f2h(v); memcpy(&w[off], &h, 2); };
    size_t nblk;
    switch (fmt) {
        case FMT_F16: for (size_t i = 0; i < rows * cols; i++) put(2 * i, ((rand() % 2001) - 1000) * 1e-5f); break;
        case FMT_BF16: for (size_t i = 0; i < rows * cols; i++) { float v = ((rand() % 2001) - 1000) * 1e-5f; uint32_t u; memcpy(&u, &v, 4); uint16_t b = u >> 16; memcpy(&w[2 * i], &b, 2); } break;
        case FMT_F32: for (size_t i = 0; i < rows * cols; i++) { float v = ((rand() % 2001) - 1000) * 1e-5f; memcpy(&w[4 * i], &v, 4); } break;
        case FMT_Q8_0: nblk = rows * cols / 32; for (size_t b = 0; b < nblk; b++) put(b * 34, 1e-3f); break;
        case FMT_Q4_K: nblk = rows * cols / 256; for (size_t b = 0; b < nblk; b++) { put(b * 144, 1e-3f); put(b * 144 + 2, 1e-3f); } break;
        default: nblk = rows * cols / 256; for (size_t b = 0; b < nblk; b++) put(b * 210 + 208, 1e-3f); break;
    }
    return w;
}
