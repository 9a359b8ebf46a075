// chain_floor_bench.cu — the floor that a decode step's chain of dependent launches sets, with no
// weights at all: N launches (141 by default: a 28-layer step's five a layer and its LM head) in
// which every block waits for the launch before, reads the whole vector it wrote (n f32 values,
// as every `mv` block stages its whole input), sums it, and writes its share of the next vector.
// Timed as one CUDA graph per chain, in plain stream order and with programmatic dependent launch
// (the engine's `allow_next_kernel` / `wait_for_previous_kernel`: a launch's blocks may start
// beside the previous launch's and wait inside); then the same N phases inside one persistent
// cooperative kernel between grid-wide barriers (a counter and a spin: what a megakernel would pay
// per hand-off instead). Prints µs per hand-off and what N of them make a step. Built by
// scripts/build-cuda.sh; run on the GPU machine. Not a test: it asserts nothing (it reports
// whether the modes' last vectors agree).
#include "decode.cu"
#include "bench_common.cuh"
#include <cstdio>
#include <cstdlib>
#include <vector>

struct HopArgs {
    const float* in;
    float* out;
    int n;
};

// One hand-off's work: the whole of `in` summed, this block's share of `out` written from it.
__device__ __forceinline__ void hop_body(const float* in, float* out, int n) {
    __shared__ float scratch[32];
    float s = 0.f;
    for (int j = threadIdx.x; j < n / 4; j += blockDim.x) {
        float4 v = reinterpret_cast<const float4*>(in)[j];
        s += v.x + v.y + v.z + v.w;
    }
    s = block_sum(s, scratch);
    int per = (n + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per, hi = min(n, lo + per);
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) out[j] = s * (1.f / 65536.f) + (float)(j & 7);
}

// Without the launch attribute the wait returns at once: the kernel serves both graph forms.
__global__ void hop(HopArgs a) {
    allow_next_kernel();
    wait_for_previous_kernel();
    hop_body(a.in, a.out, a.n);
}

// All N phases in one launch of co-resident blocks; between phases every block counts itself in
// (one thread: a fence, then an atomic add) and spins until all have, on a counter that only grows.
__global__ void persistent(float* a, float* b, int n, int phases, unsigned* counter, unsigned base) {
    for (int p = 0; p < phases; p++) {
        hop_body(p & 1 ? b : a, p & 1 ? a : b, n);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counter, 1u);
            unsigned target = base + (unsigned)(p + 1) * gridDim.x, seen;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
            } while ((int)(seen - target) < 0);
        }
        __syncthreads();
    }
}

int main(int argc, char** argv) {
    int chain = argc > 1 ? atoi(argv[1]) : 141, reps = 50;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int sms = prop.multiProcessorCount;
    printf("%s, %d SMs; chains of %d dependent hand-offs, %d replays each, no weights\n", prop.name, sms, chain, reps);
    float *a, *b;
    unsigned* counter;
    CK(cudaMalloc(&a, 8192 * 4));
    CK(cudaMalloc(&b, 8192 * 4));
    CK(cudaMalloc(&counter, 4));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    struct Shape { int blocks_per_sm, threads; };
    for (int n : {1536, 3584}) {
        for (Shape sh : {Shape{1, 512}, Shape{2, 512}, Shape{4, 256}}) {
            int grid = sms * sh.blocks_per_sm;
            std::vector<float> first(n), host(n);
            for (int mode = 0; mode < 3; mode++) {
                CK(cudaMemset(a, 0, 8192 * 4));
                CK(cudaMemset(b, 0, 8192 * 4));
                CK(cudaMemset(counter, 0, 4));
                float ms = 0.f;
                if (mode < 2) {
                    // The chain captured once as a graph; mode 1's launches after the first overlap.
                    cudaGraph_t g;
                    cudaGraphExec_t ge;
                    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                    for (int i = 0; i < chain; i++) {
                        HopArgs args{i & 1 ? b : a, i & 1 ? a : b, n};
                        if (mode == 1 && i > 0) launch_overlapping(hop, dim3(grid), dim3(sh.threads), 0, args, st);
                        else hop<<<grid, sh.threads, 0, st>>>(args);
                    }
                    CK(cudaStreamEndCapture(st, &g));
                    CK(cudaGraphInstantiate(&ge, g, 0));
                    for (int w = 0; w < 5; w++) CK(cudaGraphLaunch(ge, st));
                    CK(cudaEventRecord(e0, st));
                    for (int r = 0; r < reps; r++) CK(cudaGraphLaunch(ge, st));
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    CK(cudaGraphExecDestroy(ge));
                    CK(cudaGraphDestroy(g));
                } else {
                    int fit = 0;
                    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, persistent, sh.threads, 0));
                    if (fit < sh.blocks_per_sm) {
                        printf("n %4d, %3d blocks of %3d: persistent kernel does not fit (%d an SM)\n", n, grid, sh.threads, fit);
                        continue;
                    }
                    unsigned base = 0;
                    auto launch = [&]() {
                        void* args[] = {&a, &b, &n, &chain, &counter, &base};
                        CK(cudaLaunchCooperativeKernel((void*)persistent, dim3(grid), dim3(sh.threads), args, 0, st));
                        base += (unsigned)chain * grid;
                    };
                    for (int w = 0; w < 5; w++) launch();
                    CK(cudaEventRecord(e0, st));
                    for (int r = 0; r < reps; r++) launch();
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                }
                CK(cudaMemcpy(host.data(), chain & 1 ? b : a, n * 4, cudaMemcpyDeviceToHost));
                if (mode == 0) first = host;
                bool same = first == host;
                double per = ms * 1000.0 / reps / chain;
                const char* name = mode == 0 ? "graph, stream order" : mode == 1 ? "graph, programmatic" : "persistent, spin barrier";
                printf("n %4d, %3d blocks of %3d, %-24s %5.2f us a hand-off, %6.1f us a chain%s\n", n, grid, sh.threads, name, per,
                       per * chain, same ? "" : " (VECTORS DIFFER from stream order)");
            }
        }
    }
    return 0;
}
