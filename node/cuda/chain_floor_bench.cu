// chain_floor_bench.cu — the floor that a decode step's chain of dependent launches sets. With no
// weights (`chain_floor_bench [N]`): N launches (141 by default: a 28-layer step's five a layer and
// its LM head) in which every block waits for the launch before, reads the whole vector it wrote
// (n f32 values, as every `mv` block stages its whole input), sums it, and writes its share of the
// next vector. Timed as one CUDA graph per chain, in plain stream order and with programmatic
// dependent launch (the engine's `allow_next_kernel` / `wait_for_previous_kernel`: a launch's
// blocks may start beside the previous launch's and wait inside); then the same N phases inside
// one persistent cooperative kernel between grid-wide barriers (a counter and a spin: what a
// megakernel would pay per hand-off instead). Prints µs per hand-off and what N of them make a step.
// With weights (`chain_floor_bench models`): the same chain, each launch also streaming the bytes
// its engine launch reads in a decode step of a real model (Qwen2.5-1.5B / 7B in f16 and Q4_K_M:
// q/k/v, attention's KV cache at 128 positions, o, gate/up, down, then the LM head), with nothing
// computed from them: the fastest a step of that chain could be, printed as tok/s and as the
// roofline fraction `shoal bench` would print (bytes read over the device copy rate, measured as
// shoal measures it). Then the same bytes in one persistent cooperative kernel (a block an SM)
// that streams them through a ring of shared-memory stages (cp.async, or Hopper's bulk copies) and
// keeps the next phases' copies in flight through each grid-wide barrier: what a megakernel that
// reads its weights ahead across phases could reach. Built by scripts/build-cuda.sh; run on the
// GPU machine. Not a test: it asserts nothing (it reports whether the modes' last vectors agree).
#include "decode.cu"
#include "bench_common.cuh"
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cstring>
#include <algorithm>

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
__device__ __forceinline__ void end_phase(float* a, float* b, int n, int p, unsigned* counter, unsigned base) {
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

__global__ void persistent(float* a, float* b, int n, int phases, unsigned* counter, unsigned base) {
    for (int p = 0; p < phases; p++) end_phase(a, b, n, p, counter, base);
}

// µs a replay of the captured chain `g` (`warm` replays first, then `reps` timed); destroys it.
double replay_us(cudaStream_t st, cudaGraph_t g, int warm, int reps) {
    cudaGraphExec_t ge;
    cudaEvent_t e0, e1;
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int k = 0; k < warm; k++) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e0, st));
    for (int r = 0; r < reps; r++) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return ms * 1000.0 / reps;
}

// A hand-off that also streams `lines` 16-byte words of weights (a grid-strided share a thread,
// eight loads in flight at a time), combined into nothing but a guard store, so the loads stay.
// With `early`, each thread's first eight words go out before the wait (as the engine's launches
// load their first rows there).
struct WeightHopArgs {
    const float* in;
    float* out;
    int n;
    const uint4* w;
    long long lines;
    int early;
};

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

constexpr int IN_FLIGHT = 8;

// Eight words from i on, `stride` apart (zeros past the end).
__device__ __forceinline__ void load_eight(const uint4* w, long long i, long long stride, long long lines, uint4 (&v)[IN_FLIGHT]) {
#pragma unroll
    for (int k = 0; k < IN_FLIGHT; k++) v[k] = i + k * stride < lines ? load_streaming(w + i + k * stride) : make_uint4(0, 0, 0, 0);
}

// Their xor.
__device__ __forceinline__ unsigned fold(const uint4 (&v)[IN_FLIGHT]) {
    unsigned acc = 0;
#pragma unroll
    for (int k = 0; k < IN_FLIGHT; k++) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    return acc;
}

__global__ void weight_hop(WeightHopArgs a) {
    allow_next_kernel();
    long long stride = (long long)gridDim.x * blockDim.x, i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    uint4 v[IN_FLIGHT];
    if (a.early) load_eight(a.w, i, stride, a.lines, v);
    wait_for_previous_kernel();
    unsigned acc = 0;
    if (a.early) {
        acc = fold(v);
        i += IN_FLIGHT * stride;
    }
    for (; i < a.lines; i += IN_FLIGHT * stride) {
        load_eight(a.w, i, stride, a.lines, v);
        acc ^= fold(v);
    }
    hop_body(a.in, a.out, a.n);
    if (acc == 0x9e3779b9u) a.out[a.n] = 1.f;  // (a spare word past the vector: never read)
}

// The same chain as one persistent kernel (a block an SM) whose blocks stream their share of every
// phase's bytes through a ring of S shared-memory stages of `chunk` 16-byte words (cp.async),
// phase after phase without a break: a stage is refilled as soon as it is used, so the copies of
// the next phases' bytes go out before the barrier that ends a phase and stay in flight through
// it (weights wait for no activation). A phase ends, once its last stage is used, with the
// hand-off's work and a spin barrier, as `persistent`. What a megakernel that reads ahead across
// its phases could reach; nothing is computed from the bytes either.
struct StreamArgs {
    float* a;
    float* b;
    int n;
    const uint4* w;
    const long long* phase_at;     // each phase's first word in `w`
    const long long* phase_lines;  // its words
    int phases;
    unsigned* counter;
    unsigned base;
    int chunk;
};

// The next piece of this block's share of the phases: from phase `ip`, `ioff` words into the
// block's share of it, at most `s.chunk` words. Sets `src` and returns the words (advancing `ip`
// and `ioff` past them), or 0 once every phase is read (`ip` then `s.phases`).
__device__ __forceinline__ int next_piece(const StreamArgs& s, int& ip, long long& ioff, const uint4*& src) {
    for (; ip < s.phases; ip++, ioff = 0) {
        long long lines = s.phase_lines[ip], per = (lines + gridDim.x - 1) / gridDim.x;
        long long lo = min(lines, blockIdx.x * per), hi = min(lines, lo + per);
        if (lo + ioff < hi) {
            int n = (int)min((long long)s.chunk, hi - lo - ioff);
            src = s.w + s.phase_at[ip] + lo + ioff;
            ioff += n;
            return n;
        }
    }
    return 0;
}

template <int S>
__global__ void __launch_bounds__(512, 1) persistent_stream(StreamArgs s) {
    extern __shared__ uint4 ring[];
    int ip = 0;             // the next stage's phase
    long long ioff = 0;     // and where in this block's share of it
    int stage_phase[S], stage_words[S];
    auto issue = [&](int st) {
        const uint4* src = nullptr;
        int n = next_piece(s, ip, ioff, src);
        stage_phase[st] = ip;
        stage_words[st] = n;
        for (int t = threadIdx.x; t < n; t += blockDim.x) cp_async16(ring + st * s.chunk + t, src + t);
        cp_async_commit();
    };
#pragma unroll
    for (int st = 0; st < S; st++) issue(st);
    int cur = 0;
    unsigned acc = 0;
    for (int k = 0;; k = (k + 1) % S) {
        int p = stage_phase[k];
        if (p >= s.phases) break;
        cp_async_wait<S - 1>();
        __syncthreads();
        for (; cur < p; cur++) end_phase(s.a, s.b, s.n, cur, s.counter, s.base);
        for (int t = threadIdx.x; t < stage_words[k]; t += blockDim.x) {
            uint4 v = ring[k * s.chunk + t];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncthreads();
        issue(k);
    }
    for (; cur < s.phases; cur++) end_phase(s.a, s.b, s.n, cur, s.counter, s.base);
    if (acc == 0x9e3779b9u) s.b[s.n] = 1.f;  // (a spare word past the vector: never read)
}

// The same stream with Hopper's bulk copies (`cp.async.bulk`, the TMA engine): one thread issues
// each stage as one copy that completes on the stage's mbarrier, so no thread's registers or issue
// slots are spent on the loads and a stage may be as large as shared memory allows.
__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes),
                 "r"(smem_addr(bar))
                 : "memory");
}

__device__ __forceinline__ void bulk_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}

template <int S>
__global__ void __launch_bounds__(512, 1) persistent_bulk(StreamArgs s) {
    extern __shared__ __align__(128) uint4 ring[];
    __shared__ __align__(8) unsigned long long bars[S];
    __shared__ int stage_phase[S], stage_words[S];
    int ip = 0;          // (thread 0's) the next stage's phase
    long long ioff = 0;  // and where in this block's share of it
    auto issue = [&](int st) {
        const uint4* src = nullptr;
        int n = next_piece(s, ip, ioff, src);
        stage_phase[st] = ip;
        stage_words[st] = n;
        if (n > 0) bulk_load(ring + st * s.chunk, src, n * 16u, &bars[st]);
    };
    if (threadIdx.x == 0) {
        for (int st = 0; st < S; st++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[st])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int st = 0; st < S; st++) issue(st);
    }
    __syncthreads();
    int cur = 0;
    unsigned acc = 0, use = 0;
    for (int k = 0;;) {
        int p = stage_phase[k];  // (rewritten only after the barrier below, read again S stages on)
        if (p >= s.phases) break;
        for (; cur < p; cur++) end_phase(s.a, s.b, s.n, cur, s.counter, s.base);
        bulk_wait(&bars[k], use & 1);
        for (int t = threadIdx.x; t < stage_words[k]; t += blockDim.x) {
            uint4 v = ring[k * s.chunk + t];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncthreads();
        if (threadIdx.x == 0) issue(k);
        if (++k == S) k = 0, use++;
    }
    for (; cur < s.phases; cur++) end_phase(s.a, s.b, s.n, cur, s.counter, s.base);
    if (acc == 0x9e3779b9u) s.b[s.n] = 1.f;  // (a spare word past the vector: never read)
}

// The bytes each launch of a decode step reads, for a Qwen2.5-shaped model (28 layers) in f16 or
// Q4_K_M (llama.cpp's mix: v and down Q6_K in 14 of the 28 layers, the LM head Q6_K).
struct ModelShape {
    const char* name;
    int hidden, kv_dim, ffn;
    long long vocab;
    bool q4km;
};

std::vector<size_t> step_bytes(const ModelShape& m, int context) {
    const int layers = 28;
    auto bytes = [](int fmt, long long rows, long long cols) { return fmt_bytes(fmt, (size_t)(rows * cols)); };
    std::vector<size_t> hops;
    for (int l = 0; l < layers; l++) {
        bool more_bits = l < layers / 8 || l >= 7 * layers / 8 || (l - layers / 8) % 3 == 2;
        int q = m.q4km ? FMT_Q4_K : FMT_F16, q6 = m.q4km ? (more_bits ? FMT_Q6_K : FMT_Q4_K) : FMT_F16;
        hops.push_back(bytes(q, m.hidden + m.kv_dim, m.hidden) + bytes(q6, m.kv_dim, m.hidden));  // q/k/v
        hops.push_back((size_t)2 * m.kv_dim * 2 * context);                                     // attention: K and V, f16
        hops.push_back(bytes(q, m.hidden, m.hidden));                                          // o
        hops.push_back(bytes(q, 2LL * m.ffn, m.hidden));                                       // gate/up
        hops.push_back(bytes(q6, m.hidden, m.ffn));                                            // down
    }
    hops.push_back(bytes(m.q4km ? FMT_Q6_K : FMT_F16, m.vocab, m.hidden));                     // LM head
    return hops;
}

// The device copy rate as shoal's bench counts it (`probe::gpu_copy_bandwidth`): bytes read plus
// bytes written by device-to-device copies of 1 GiB, the best of the passes.
double copy_rate(cudaStream_t st) {
    size_t bytes = 1ull << 30;
    void *src, *dst;
    CK(cudaMalloc(&src, bytes));
    CK(cudaMalloc(&dst, bytes));
    CK(cudaMemsetAsync(src, 0, bytes, st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    double best = 0;
    for (int pass = 0; pass < 20; pass++) {
        CK(cudaEventRecord(e0, st));
        for (int k = 0; k < 4; k++) CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        best = std::max(best, 8.0 * bytes / (ms * 1e-3));
    }
    CK(cudaFree(src));
    CK(cudaFree(dst));
    return best;
}

int models(cudaStream_t st, int sms) {
    const int context = 128, reps = 20;
    double rate = copy_rate(st);
    printf("copy rate %.0f GB/s (read + written); chains with weights, KV cache at %d positions, %d replays\n", rate / 1e9, context, reps);
    const ModelShape shapes[] = {
        {"1.5B f16", 1536, 256, 8960, 151936, false},
        {"1.5B Q4_K_M", 1536, 256, 8960, 151936, true},
        {"7B f16", 3584, 512, 18944, 152064, false},
        {"7B Q4_K_M", 3584, 512, 18944, 152064, true},
    };
    float *a, *b;
    CK(cudaMalloc(&a, 8192 * 4));
    CK(cudaMalloc(&b, 8192 * 4));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (const ModelShape& m : shapes) {
        std::vector<size_t> hops = step_bytes(m, context);
        size_t total = 0;
        for (size_t h : hops) total += (h + 255) / 256 * 256;
        uint8_t* w;
        CK(cudaMalloc(&w, total));
        CK(cudaMemsetAsync(w, 1, total, st));
        // One launch streaming all of it: what a read-only kernel reaches without hand-offs.
        {
            WeightHopArgs args{a, b, m.hidden, reinterpret_cast<const uint4*>(w), (long long)(total / 16), 0};
            for (int k = 0; k < 3; k++) weight_hop<<<sms * 2, 512, 0, st>>>(args);
            CK(cudaEventRecord(e0, st));
            for (int r = 0; r < reps; r++) weight_hop<<<sms * 2, 512, 0, st>>>(args);
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            double us = ms * 1000.0 / reps;
            printf("%-12s %6.0f MB in %zu launches; one launch reading it all: %7.1f us (%.2f of the copy rate)\n", m.name, total / 1e6,
                   hops.size(), us, total / (us * 1e-6) / rate);
        }
        // The chain as a graph of programmatic launches; `skip`: the launches of one kind (the
        // k-th of each layer's five; 5: all of them) read no weights, so what their bytes cost shows.
        auto step_us = [&](int blocks_per_sm, int early, int skip) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            size_t at = 0;
            for (size_t i = 0; i < hops.size(); i++) {
                bool skipped = i + 1 < hops.size() && (skip == 5 || (int)(i % 5) == skip);
                WeightHopArgs args{i & 1 ? b : a, i & 1 ? a : b, m.hidden, reinterpret_cast<const uint4*>(w + at),
                                   skipped ? 0 : (long long)(hops[i] / 16), early};
                at += (hops[i] + 255) / 256 * 256;
                if (i > 0) launch_overlapping(weight_hop, dim3(sms * blocks_per_sm), dim3(512), 0, args, st);
                else weight_hop<<<sms * blocks_per_sm, 512, 0, st>>>(args);
            }
            CK(cudaStreamEndCapture(st, &g));
            return replay_us(st, g, 3, reps);
        };
        double best = 1e30;
        int best_blocks = 0;
        for (int blocks_per_sm : {1, 2}) {
            for (int early = 0; early < 2; early++) {
                double us = step_us(blocks_per_sm, early, -1);
                if (early && us < best) best = us, best_blocks = blocks_per_sm;
                printf("%-12s chain, %3d blocks of 512, programmatic, first words %s the wait: %7.1f us a step, %6.1f tok/s, roofline %.2f\n",
                       m.name, sms * blocks_per_sm, early ? "before" : "after ", us, 1e6 / us, total / (us * 1e-6) / rate);
            }
        }
        // The persistent streaming kernel: its last vector against the programmatic chain's.
        std::vector<float> chained(m.hidden), streamed(m.hidden);
        CK(cudaMemcpy(chained.data(), b, m.hidden * 4, cudaMemcpyDeviceToHost));
        {
            std::vector<long long> at_h, lines_h;
            size_t at = 0;
            for (size_t h : hops) {
                at_h.push_back((long long)(at / 16));
                lines_h.push_back((long long)(h / 16));
                at += (h + 255) / 256 * 256;
            }
            long long *at_d, *lines_d;
            unsigned* counter;
            CK(cudaMalloc(&at_d, at_h.size() * 8));
            CK(cudaMalloc(&lines_d, lines_h.size() * 8));
            CK(cudaMalloc(&counter, 4));
            CK(cudaMemcpy(at_d, at_h.data(), at_h.size() * 8, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(lines_d, lines_h.data(), lines_h.size() * 8, cudaMemcpyHostToDevice));
            CK(cudaMemset(counter, 0, 4));
            struct Ring { int stages, kb; void (*kernel)(StreamArgs); const char* form; };
            for (Ring r : {Ring{4, 32, persistent_stream<4>, "cp.async"}, Ring{6, 32, persistent_stream<6>, "cp.async"}, Ring{4, 32, persistent_bulk<4>, "bulk"},
                           Ring{6, 32, persistent_bulk<6>, "bulk"}, Ring{3, 64, persistent_bulk<3>, "bulk"}, Ring{12, 16, persistent_bulk<12>, "bulk"}}) {
                StreamArgs sa{a, b, m.hidden, reinterpret_cast<const uint4*>(w), at_d, lines_d, (int)hops.size(), counter, 0, r.kb * 1024 / 16};
                size_t smem = (size_t)r.stages * r.kb * 1024;
                CK(cudaFuncSetAttribute((const void*)r.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                int fit = 0;
                CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, r.kernel, 512, smem));
                if (fit < 1) {
                    printf("%-12s persistent stream (%s), %d stages of %d KB: does not fit\n", m.name, r.form, r.stages, r.kb);
                    continue;
                }
                unsigned base = 0;
                auto launch = [&]() {
                    sa.base = base;
                    void* args[] = {&sa};
                    CK(cudaLaunchCooperativeKernel((const void*)r.kernel, dim3(sms), dim3(512), args, smem, st));
                    base += (unsigned)hops.size() * sms;
                };
                for (int k = 0; k < 3; k++) launch();
                CK(cudaEventRecord(e0, st));
                for (int rep = 0; rep < reps; rep++) launch();
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                double us = ms * 1000.0 / reps;
                CK(cudaMemcpy(streamed.data(), b, m.hidden * 4, cudaMemcpyDeviceToHost));
                printf("%-12s persistent stream (%-8s), %3d blocks of 512, %2d stages of %2d KB ahead: %7.1f us a step, %6.1f tok/s, roofline %.2f%s\n", m.name, r.form, sms,
                       r.stages, r.kb, us, 1e6 / us, total / (us * 1e-6) / rate, streamed == chained ? "" : " (VECTOR DIFFERS from the chain's)");
            }
            CK(cudaFree(at_d));
            CK(cudaFree(lines_d));
            CK(cudaFree(counter));
        }
        const char* kinds[5] = {"q/k/v", "attention", "o", "gate/up", "down"};
        printf("%-12s what each launch's bytes add to that best chain, a layer:", m.name);
        for (int k = 0; k < 5; k++) printf(" %s %.2f us,", kinds[k], (best - step_us(best_blocks, 1, k)) / 28);
        printf(" the rest (hand-offs, LM head) %.1f us a step\n", step_us(best_blocks, 1, 5));
        CK(cudaFree(w));
    }
    return 0;
}

int main(int argc, char** argv) {
    int chain = argc > 1 ? atoi(argv[1]) : 141, reps = 50;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int sms = prop.multiProcessorCount;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    if (argc > 1 && !strcmp(argv[1], "models")) {
        printf("%s, %d SMs\n", prop.name, sms);
        return models(st, sms);
    }
    printf("%s, %d SMs; chains of %d dependent hand-offs, %d replays each, no weights\n", prop.name, sms, chain, reps);
    float *a, *b;
    unsigned* counter;
    CK(cudaMalloc(&a, 8192 * 4));
    CK(cudaMalloc(&b, 8192 * 4));
    CK(cudaMalloc(&counter, 4));
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
                    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                    for (int i = 0; i < chain; i++) {
                        HopArgs args{i & 1 ? b : a, i & 1 ? a : b, n};
                        if (mode == 1 && i > 0) launch_overlapping(hop, dim3(grid), dim3(sh.threads), 0, args, st);
                        else hop<<<grid, sh.threads, 0, st>>>(args);
                    }
                    CK(cudaStreamEndCapture(st, &g));
                    ms = (float)(replay_us(st, g, 5, reps) * reps / 1000.0);
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
