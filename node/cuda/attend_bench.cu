// attend_bench.cu — times decode.cu's long-context attention kernel (`attend_group`) alone, on the
// attention shapes of Qwen2.5 1.5B and 7B with f16 caches, over enough copies of each layer's cache
// that nothing stays in L2. Prints µs per launch, the cache bytes streamed per second, and a
// checksum that builds can be compared by. Built by scripts/build-cuda.sh (standalone nvcc,
// cudart static); run on the GPU machine. Not a test: it asserts nothing.
#ifndef DECODE_CU
#define DECODE_CU "decode.cu"
#endif
#include DECODE_CU
#include "bench_common.cuh"
#ifndef AB_KERNEL
#define AB_KERNEL attend_group  // or attend_group_d128 (-DAB_KERNEL=...)
#endif
#include <algorithm>
#include <cstring>

struct Shape { const char* name; int heads, kv_heads, d; };

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    const Shape shapes[] = {{"1.5B", 12, 2, 128}, {"7B", 28, 4, 128}};
    // AB_CONTEXTS: keys before the new one, comma-separated; AB_KEYS: fewest keys a block
    // (SHOAL_FUSED_ATTEND_GROUP_KEYS); AB_SPLITS: blocks a KV head at most (else as the engine).
    std::vector<int> contexts;
    for (const char* p = getenv("AB_CONTEXTS") ? getenv("AB_CONTEXTS") : "1024,4096,16384"; *p;) {
        contexts.push_back(atoi(p));
        while (*p && *p != ',') p++;
        if (*p) p++;
    }
    int split_keys = env_int("AB_KEYS", 32);
    for (const Shape& s : shapes) {
        int rep = s.heads / s.kv_heads, d = s.d, row = d * 2 + 16;
        int tile = std::min(GRP_TILE, GRP_TILE_BYTES / row / 16 * 16);  // as the kernel (and group_smem) size a stage
        size_t smem = (size_t)GRP_STAGES * 2 * tile * row + (size_t)rep * d * 4;
        CK(cudaFuncSetAttribute(AB_KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, AB_KERNEL, GRP_THREADS, smem));
        int splits = std::min({GRP_MAX_SPLITS, std::min(per_sm, 2) * sms / s.kv_heads, env_int("AB_SPLITS", 1 << 30)});
        for (int ctx : contexts) {
            size_t cache_bytes = (size_t)s.kv_heads * (ctx + 1) * d * 2;  // keys, or values
            int copies = (int)std::max<size_t>(2, (size_t)(400u << 20) / (2 * cache_bytes) + 1);
            std::vector<KvSlot> slots(copies);
            std::vector<uint16_t> hk(cache_bytes / 2);
            uint64_t st = 0x9E3779B97F4A7C15ull;
            for (auto& v : hk) v = f2h(random_unit(st));
            for (auto& slot : slots) {
                CK(cudaMalloc(&slot.k, cache_bytes));
                CK(cudaMalloc(&slot.v, cache_bytes));
                CK(cudaMemcpy(slot.k, hk.data(), cache_bytes, cudaMemcpyHostToDevice));
                CK(cudaMemcpy(slot.v, hk.data(), cache_bytes, cudaMemcpyHostToDevice));
                slot.capacity = ctx + 1;
            }
            KvSlot* dslots;
            CK(cudaMalloc(&dslots, copies * sizeof(KvSlot)));
            CK(cudaMemcpy(dslots, slots.data(), copies * sizeof(KvSlot), cudaMemcpyHostToDevice));
            int width = (s.heads + 2 * s.kv_heads) * d;
            std::vector<float> hq(width), hf(d / 2);
            for (auto& v : hq) v = random_unit(st);
            for (int i = 0; i < d / 2; i++) hf[i] = powf(1e6f, -2.f * i / d);
            float *qkv, *inv_freq, *out, *partial;
            unsigned* count;
            long long* pos;
            int iters = std::max(copies * 8, 200);
            CK(cudaMalloc(&qkv, width * 4));
            CK(cudaMemcpy(qkv, hq.data(), width * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&inv_freq, d / 2 * 4));
            CK(cudaMemcpy(inv_freq, hf.data(), d / 2 * 4, cudaMemcpyHostToDevice));
            CK(cudaMalloc(&out, s.heads * d * 4));
            CK(cudaMalloc(&partial, (size_t)s.heads * splits * (d + 2) * 8));  // tagged words
            CK(cudaMalloc(&count, (size_t)s.kv_heads * splits * 4));
            CK(cudaMemset(count, 0, (size_t)s.kv_heads * splits * 4));
            long long hpos = ctx;
            CK(cudaMalloc(&pos, 8));
            CK(cudaMemcpy(pos, &hpos, 8, cudaMemcpyHostToDevice));
            unsigned long long* tags = launch_tags(iters + copies + 2);
            int launches = 0;
            auto launch = [&](int copy) {
                AttnArgs a;
                memset(&a, 0, sizeof a);
                a.qkv = qkv; a.kv = dslots + copy; a.inv_freq = inv_freq; a.pos = pos; a.out = out;
                a.cache_fmt = FMT_F16; a.heads = s.heads; a.kv_heads = s.kv_heads; a.d = d; a.rope_halves = 1;
                a.scale = 1.f / sqrtf((float)d); a.eps = 1e-6f; a.tag = tags + launches++;
                a.splits = splits; a.split_keys = split_keys; a.partial = partial; a.count = count;
                AB_KERNEL<<<s.kv_heads * splits, GRP_THREADS, smem>>>(a);
            };
            double us = us_per_launch(launch, copies, iters);
            double check = checksum(out, (size_t)s.heads * d);
            int want = std::min(splits, std::max(1, (ctx + split_keys) / split_keys)), chunk = (ctx + want) / want;
            printf("%-4s %6d keys  %7.2f us  %6.0f GB/s  (%.1f MB, %d blocks a KV head, %d keys each, tile %d)  check %.6e\n", s.name, ctx + 1, us,
                   2.0 * cache_bytes / us / 1e3, 2.0 * cache_bytes / 1e6, (ctx + chunk) / chunk, chunk, tile, check);
            for (auto& slot : slots) { cudaFree(slot.k); cudaFree(slot.v); }
            cudaFree(dslots); cudaFree(qkv); cudaFree(inv_freq); cudaFree(out); cudaFree(partial); cudaFree(count); cudaFree(pos); cudaFree(tags);
        }
    }
    return 0;
}
