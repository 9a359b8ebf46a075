// residual_read_probe.cu — how long a block takes to read a 3,584-value f32 vector from L2 and
// sum its squares (what every `mv` block's RMSNorm staging does after its wait), when every block
// of a full grid reads the same copy of it or one of several copies (do the lines' L2 slices
// contend?). Prints the median and slowest block's time per grid shape and copy count. Built by
// scripts/build-cuda.sh (standalone nvcc, cudart static); run on the GPU machine. Not a test: it
// asserts nothing. Session 41, one H100: 1.06–1.18 µs at 264 blocks of 512 threads whatever the
// copies (1 to 32), 1.25–1.34 at 396 of 384, 1.44–1.50 at 528 of 256; the same read as one bulk
// (TMA) copy a block (`bulk_reader`), 0.93–0.99 µs.
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
// Every thread with its sum of squares: the block's sum, then thread 0 records the block's time
// since t0 (and keeps the sum and xs alive through an unlikely store).
__device__ void block_done(float ss, const float* xs, unsigned long long t0, unsigned long long* t, float* sink) {
    __shared__ float part[32];
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
__global__ void reader(const float* x, int n, int copies, int stride, unsigned long long* t, float* sink) {
    __shared__ float xs[8192];
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
    block_done(ss, xs, t0, t, sink);
}
// The same read as one bulk copy (TMA, sm_90): thread 0 asks for the whole vector into shared
// memory against an mbarrier, every thread waits on it, then sums from shared memory.
__global__ void bulk_reader(const float* x, int n, int copies, int stride, unsigned long long* t, float* sink) {
    __shared__ alignas(128) float xs[8192];
    __shared__ alignas(8) unsigned long long mbar;
    __shared__ unsigned long long t0;
    unsigned bar = (unsigned)__cvta_generic_to_shared(&mbar), dst = (unsigned)__cvta_generic_to_shared(xs);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        t0 = now_ns();
        unsigned bytes = n * 4;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(dst), "l"(x + (blockIdx.x % copies) * stride), "r"(bytes), "r"(bar) : "memory");
    }
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar) : "memory");
    float ss = 0.f;
    for (int j = threadIdx.x; j < n / 4; j += blockDim.x) {
        float4 v = reinterpret_cast<const float4*>(xs)[j];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    block_done(ss, xs, t0, t, sink);
}

int main() {
    int n = 3584, stride = 4096;
    float *x, *sink; unsigned long long* t;
    CK(cudaMalloc(&x, 64 * stride * 4)); CK(cudaMemset(x, 0, 64 * stride * 4));
    CK(cudaMalloc(&sink, 4)); CK(cudaMalloc(&t, 528 * 8));
    // 264 blocks of 512 threads (2 an SM on an H100: the unsplit launches), 396 of 384, 528 of 256.
    // Then (bulk) the same 264 blocks reading by one bulk copy each.
    for (int bulk : {0, 1}) for (int bl : {264, 396, 528}) for (int copies : {1, 2, 4, 8, 16, 32}) {
        if (bulk && (bl != 264 || copies > 2)) continue;
        std::vector<double> meds, maxs;
        for (int rep = 0; rep < 50; rep++) {
            writer<<<14, 256>>>(x, n, copies, stride);
            int threads = bl == 528 ? 256 : bl == 396 ? 384 : 512;
            if (bulk) bulk_reader<<<bl, threads>>>(x, n, copies, stride, t, sink);
            else reader<<<bl, threads>>>(x, n, copies, stride, t, sink);
            CK(cudaDeviceSynchronize());
            std::vector<unsigned long long> h(bl);
            CK(cudaMemcpy(h.data(), t, bl * 8, cudaMemcpyDeviceToHost));
            std::sort(h.begin(), h.end());
            meds.push_back(h[bl / 2]); maxs.push_back(h[bl - 1]);
        }
        std::sort(meds.begin(), meds.end()); std::sort(maxs.begin(), maxs.end());
        printf("%s blocks %d copies %2d: block read+sum median %.0f ns, slowest block %.0f ns (medians over 50 runs)\n", bulk ? "bulk " : "loads", bl, copies, meds[25], maxs[25]);
    }
    return 0;
}
