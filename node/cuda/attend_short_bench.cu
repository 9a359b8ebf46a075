// attend_short_bench.cu — where short-context attention (`attend_d128`, one block a query head)
// spends its cycles once its input is there. decode.cu is compiled with -DATTEND_PHASES: each
// warp records its clock at eight points of `attend_heads`, and the block spins where the engine
// waits for q/k/v (AS_SPIN cycles), so that the K/V loads issued before the wait have landed, as
// they have in the engine. Prints, per shape, context, block size and q/k/v form (plain or tagged
// words), the mean over blocks of each phase's cycles (the slowest warp's mark each time), their
// sum from the q/k rotation on ("after": what follows the input's arrival) and a checksum of the
// output. AS_FLUSH=1: before each launch, a kernel of 128 KB of straight-line code runs, two
// blocks an SM, to push the kernel under test's code out of the instruction caches, as in the
// engine, where the matrix kernels' code runs between two attention launches. Built by
// scripts/build-cuda.sh; run on the GPU machine. Not a test: it asserts nothing.
#define ATTEND_PHASES
#ifndef DECODE_CU
#define DECODE_CU "decode.cu"
#endif
#include DECODE_CU
#include "bench_common.cuh"
#include <algorithm>

struct Shape { const char* name; int heads, kv_heads, d; };

// 16,384 dependent FMAs, unrolled: a 128 KB .text section for sm_90.
__global__ void flush_instruction_caches(float* p) {
    float x = p[threadIdx.x];
#pragma unroll
    for (int i = 0; i < 16384; i++) asm volatile("fma.rn.f32 %0, %0, %0, %0;" : "+f"(x));
    p[threadIdx.x] = x;
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int clock_khz = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    printf("device: %s, %d SMs, max SM clock %.0f MHz (cycles below; µs at that clock)\n", prop.name, prop.multiProcessorCount, clock_khz / 1e3);
    long long spin = env_int("AS_SPIN", 12000);
    bool flush = env_int("AS_FLUSH", 0) != 0;
    float* scratch;
    CK(cudaMalloc(&scratch, 128 * sizeof(float)));
    CK(cudaMemset(scratch, 0, 128 * sizeof(float)));
    CK(cudaMemcpyToSymbol(attend_spin_cycles, &spin, sizeof spin));
    const Shape shapes[] = {{"1.5B", 12, 2, 128}, {"7B", 28, 4, 128}};
    const int contexts[] = {32, 128};
    const int threads_list[] = {512, 256, 128};
    const char* phase_names[] = {"setup", "spin", "q/k rope", "key loop", "warp merge", "weights", "store"};
    printf("%-4s %4s %7s %6s |", "", "keys", "threads", "qkv");
    for (const char* n : phase_names) printf(" %10s", n);
    printf(" | %8s %8s  check\n", "after", "µs");
    for (const Shape& s : shapes) {
        int d = s.d, width = (s.heads + 2 * s.kv_heads) * d;
        for (int ctx : contexts) {
            // Keys 0..ctx-1 cached; the new one at position ctx.
            size_t cache_elems = (size_t)s.kv_heads * (ctx + 1) * d;
            std::vector<uint16_t> hk(cache_elems);
            uint64_t st = 0x9E3779B97F4A7C15ull;
            for (auto& v : hk) v = f2h(random_unit(st));
            KvSlot slot;
            CK(cudaMalloc(&slot.k, cache_elems * 2));
            CK(cudaMalloc(&slot.v, cache_elems * 2));
            CK(cudaMemcpy(slot.k, hk.data(), cache_elems * 2, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(slot.v, hk.data(), cache_elems * 2, cudaMemcpyHostToDevice));
            slot.capacity = ctx + 1;
            KvSlot* dslot;
            CK(cudaMalloc(&dslot, sizeof slot));
            CK(cudaMemcpy(dslot, &slot, sizeof slot, cudaMemcpyHostToDevice));
            std::vector<float> hq(width), hf(d / 2);
            for (auto& v : hq) v = random_unit(st);
            for (int i = 0; i < d / 2; i++) hf[i] = powf(1e6f, -2.f * i / d);
            const unsigned kTag = 7;
            std::vector<unsigned long long> htagged(width);
            for (int i = 0; i < width; i++) { uint32_t b; memcpy(&b, &hq[i], 4); htagged[i] = (unsigned long long)kTag << 32 | b; }
            float *qkv, *qkv_tagged, *inv_freq, *out;
            long long* pos;
            unsigned long long* tag;
            CK(cudaMalloc(&qkv, width * 4));
            CK(cudaMemcpy(qkv, hq.data(), width * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&qkv_tagged, width * 8));
            CK(cudaMemcpy(qkv_tagged, htagged.data(), width * 8, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&inv_freq, d / 2 * 4));
            CK(cudaMemcpy(inv_freq, hf.data(), d / 2 * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&out, s.heads * d * 8));
            long long hpos = ctx;
            CK(cudaMalloc(&pos, 8));
            CK(cudaMemcpy(pos, &hpos, 8, cudaMemcpyHostToDevice));
            unsigned long long htag = kTag;
            CK(cudaMalloc(&tag, 8));
            CK(cudaMemcpy(tag, &htag, 8, cudaMemcpyHostToDevice));
            for (int threads : threads_list) {
                for (int tagged = 0; tagged < 2; tagged++) {
                    AttnArgs a;
                    memset(&a, 0, sizeof a);
                    a.qkv = tagged ? qkv_tagged : qkv; a.kv = dslot; a.inv_freq = inv_freq; a.pos = pos; a.out = out;
                    a.cache_fmt = FMT_F16; a.heads = s.heads; a.kv_heads = s.kv_heads; a.d = d; a.rope_halves = 1;
                    a.scale = 1.f / sqrtf((float)d); a.eps = 1e-6f; a.tag = tag; a.tagged = tagged; a.splits = 1;
                    std::vector<long long> sum(8, 0);
                    const int reps = 20;
                    for (int r = 0; r < reps; r++) {
                        CK(cudaMemset(out, 0, s.heads * d * 8));
                        if (flush) flush_instruction_caches<<<2 * prop.multiProcessorCount, 128>>>(scratch);
                        attend_d128<<<s.heads, threads>>>(a);
                        CK(cudaDeviceSynchronize());
                        CK(cudaGetLastError());
                        if (r < 2) continue;  // warm-up
                        std::vector<long long> log(ATTEND_PHASE_BLOCKS * ATTN_MAX_WARPS * 8);
                        CK(cudaMemcpyFromSymbol(log.data(), attend_phase_log, log.size() * 8));
                        int warps = threads / 32;
                        for (int b = 0; b < s.heads; b++) {
                            // The block's time at each mark: its slowest warp's.
                            long long at[8];
                            for (int p = 0; p < 8; p++) {
                                at[p] = 0;
                                for (int w = 0; w < warps; w++) at[p] = std::max(at[p], log[((size_t)b * ATTN_MAX_WARPS + w) * 8 + p] - log[((size_t)b * ATTN_MAX_WARPS) * 8]);
                            }
                            for (int p = 1; p < 8; p++) sum[p] += at[p] - at[p - 1];
                        }
                    }
                    int samples = (reps - 2) * s.heads;
                    printf("%-4s %4d %7d %6s |", s.name, ctx + 1, threads, tagged ? "tagged" : "plain");
                    long long after = 0;
                    for (int p = 1; p < 8; p++) {
                        printf(" %10.0f", (double)sum[p] / samples);
                        if (p >= 3) after += sum[p];
                    }
                    // The output: tagged words' low halves, or floats.
                    std::vector<float> ho(s.heads * d * (tagged ? 2 : 1));
                    CK(cudaMemcpy(ho.data(), out, ho.size() * 4, cudaMemcpyDeviceToHost));
                    double check = 0;
                    for (int i = 0; i < s.heads * d; i++) check += ho[tagged ? 2 * i : i] * (double)(i % 7 + 1);
                    printf(" | %8.0f %8.2f  %.6e\n", (double)after / samples, (double)after / samples / (clock_khz / 1e3), check);
                }
            }
            cudaFree(slot.k); cudaFree(slot.v); cudaFree(dslot); cudaFree(qkv); cudaFree(qkv_tagged);
            cudaFree(inv_freq); cudaFree(out); cudaFree(pos); cudaFree(tag);
        }
    }
    return 0;
}
