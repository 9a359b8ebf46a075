// residual_read_probe.cu — how long a block takes to read a 3,584-value f32 vector from L2 and
// sum its squares (what every `mv` block's RMSNorm staging does after its wait), when every block
// of a full grid reads the same copy of it or one of several copies (do the lines' L2 slices
// contend?). Prints the median and slowest block's time per grid shape and copy count. Built by
// scripts/build-cuda.sh (standalone nvcc, cudart static); run on the GPU machine. Not a test: it
// asserts nothing. Session 41, one H100: 1.06–1.18 µs at 264 blocks whatever the copies (1 to 32).
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__device__ __forceinline__ unsigned long long now_ns() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__global__ void writer(float* x, int n, int copies, int stride) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        for (int c = 0; c < copies; c++) atomicAdd(&x[c * stride + i], 1.0f);
}
__global__ void reader(const float* x, int n, int copies, int stride, unsigned long long* t, float* sink) {
    __shared__ float xs[8192];
    __shared__ float part[32];
    __shared__ unsigned long long t0;
    if (threadIdx.x == 0) t0 = now_ns();
    __syncthreads();
    const float4* x4 = reinterpret_cast<const float4*>(x + (blockIdx.x % copies) * stride);
    float ss = 0.f;
#pragma unroll 4
    for (int j = threadIdx.x; j < n / 4; j += blockDim.x) {
        float4 v = x4[j];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        reinterpret_cast<float4*>(xs)[j] = v;
    }
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(~0u, ss, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0; for (int w = 0; w < blockDim.x / 32; w++) s += part[w];
        unsigned long long t1 = now_ns();
        t[blockIdx.x] = t1 - t0;
        if (s == 12345.f) sink[0] = xs[5];
    }
}
int main() {
    int n = 3584, stride = 4096;
    float *x, *sink; unsigned long long* t;
    CK(cudaMalloc(&x, 64 * stride * 4)); CK(cudaMemset(x, 0, 64 * stride * 4));
    CK(cudaMalloc(&sink, 4)); CK(cudaMalloc(&t, 528 * 8));
    // 264 blocks of 512 threads (2 an SM on an H100: the unsplit launches), 396 of 384, 528 of 256.
    for (int bl : {264, 396, 528}) for (int copies : {1, 2, 4, 8, 16, 32}) {
        std::vector<double> meds, maxs;
        for (int rep = 0; rep < 50; rep++) {
            writer<<<14, 256>>>(x, n, copies, stride);
            reader<<<bl, bl == 528 ? 256 : bl == 396 ? 384 : 512>>>(x, n, copies, stride, t, sink);
            CK(cudaDeviceSynchronize());
            std::vector<unsigned long long> h(bl);
            CK(cudaMemcpy(h.data(), t, bl * 8, cudaMemcpyDeviceToHost));
            std::sort(h.begin(), h.end());
            meds.push_back(h[bl / 2]); maxs.push_back(h[bl - 1]);
        }
        std::sort(meds.begin(), meds.end()); std::sort(maxs.begin(), maxs.end());
        printf("blocks %d copies %2d: block read+sum median %.0f ns, slowest block %.0f ns (medians over 50 runs)\n", bl, copies, meds[25], maxs[25]);
    }
    return 0;
}
