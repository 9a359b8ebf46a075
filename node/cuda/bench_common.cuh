// bench_common.cuh — what the standalone kernel benchmarks (mv_bench.cu, attend_bench.cu) share:
// a CUDA call checked, the step tags launches read, the mean time of a launch, and a checksum of a
// device buffer that builds can be compared by. Nothing else: each benchmark sets up its own shapes and arguments.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <vector>

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

// Σ value i × (i mod 7 + 1) over `n` floats on the device.
inline double checksum(const float* device_values, size_t n) {
    std::vector<float> host(n);
    CK(cudaMemcpy(host.data(), device_values, n * 4, cudaMemcpyDeviceToHost));
    double check = 0;
    for (size_t i = 0; i < n; i++) check += host[i] * (double)(i % 7 + 1);
    return check;
}
