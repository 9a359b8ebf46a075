// mv_bench.cu — times decode.cu's `mv` kernel alone on the real shapes of Qwen2.5 1.5B and 7B,
// in each weight format, over enough copies of each matrix that nothing stays in L2.
// Prints µs per launch and the weight bytes streamed per second. Built by scripts/build-cuda.sh
// (standalone nvcc, cudart static); run on the GPU machine. Not a test: it asserts nothing.
#include "decode.cu"
#include "bench_common.cuh"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <string>


struct Case { const char* name; int fmt; int rows; int cols; int mode; int nseg; };

int main(int argc, char** argv) {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    // Usage: mv_bench [waves per SM, default 4] [overlap launches: 1 (default) or 0]
    int waves = argc > 1 ? atoi(argv[1]) : 4;
    bool pdl = argc <= 2 || atoi(argv[2]) != 0;  // programmatic stream serialization, as the engine
    printf("waves %d, programmatic dependent launch %s\n", waves, pdl ? "on" : "off");
    const Case cases[] = {
        {"7B qkv", 0, 4608, 3584, MODE_STORE, 1},
        {"7B o", 0, 3584, 3584, MODE_ADD, 1},
        {"7B gate/up", 0, 18944, 3584, MODE_SILU, 2},
        {"7B down", 0, 3584, 18944, MODE_ADD, 1},
        {"7B head", 0, 152064, 3584, MODE_STORE, 1},
        {"1.5B qkv", 0, 2048, 1536, MODE_STORE, 1},
        {"1.5B gate/up", 0, 8960, 1536, MODE_SILU, 2},
        {"1.5B down", 0, 1536, 8960, MODE_ADD, 1},
        {"1.5B head", 0, 151936, 1536, MODE_STORE, 1},
    };
    const int fmts[] = {FMT_F16, FMT_Q4_K, FMT_Q6_K, FMT_Q8_0};
    const char* fmt_names[] = {"f16", "q4_k", "q6_k", "q8_0"};
    void (*kernels[4][2])(MvArgs) = {{mv_f16, mv_gated_f16}, {mv_q4_k, mv_gated_q4_k}, {mv_q6_k, mv_gated_q6_k}, {mv_q8_0, mv_gated_q8_0}};
    for (auto& k : kernels)
        for (auto f : k) cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024);
    cudaFuncSetAttribute(mv_gated_q4_k_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024);
    // MV_STREAM=2|3: gated Q4_K through each warp's ring of that many stages (mv_gated_q4_k_ring).
    int stream = env_int("MV_STREAM", 0);

    // MV_FMT / MV_CASE: only the formats / cases whose names contain them (e.g. MV_FMT=q4_k
    // MV_CASE="7B gate").
    const char* only_fmt = getenv("MV_FMT");
    const char* only_case = getenv("MV_CASE");
    for (int fi = 0; fi < 4; fi++) {
        int fmt = fmts[fi];
        if (only_fmt && !strstr(only_fmt, fmt_names[fi])) continue;
        for (const Case& c0 : cases) {
            if (only_case && !strstr(c0.name, only_case)) continue;
            Case c = c0;
            c.fmt = fmt;
            size_t per = fmt_bytes(fmt, (size_t)c.rows * c.cols) * c.nseg;
            int copies = (int)std::max<size_t>(2, (size_t)(600u << 20) / per + 1);
            if (per > (size_t)(300u << 20)) copies = 2;
            std::vector<void*> ws(copies * c.nseg);
            auto h = random_weights(fmt, c.rows, c.cols, 7);  // the same bytes in every copy
            for (int k = 0; k < copies * c.nseg; k++) {
                CK(cudaMalloc(&ws[k], h.size()));
                CK(cudaMemcpy(ws[k], h.data(), h.size(), cudaMemcpyHostToDevice));
            }
            float *x, *nw, *out;
            CK(cudaMalloc(&x, c.cols * 4));
            CK(cudaMalloc(&nw, c.cols * 4));
            CK(cudaMalloc(&out, (size_t)c.rows * 2 * 4));
            std::vector<float> hx(c.cols), hn(c.cols, 1.f);
            for (int i = 0; i < c.cols; i++) hx[i] = ((rand() % 2001) - 1000) * 1e-3f;
            CK(cudaMemcpy(x, hx.data(), c.cols * 4, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(nw, hn.data(), c.cols * 4, cudaMemcpyHostToDevice));
            CK(cudaMemset(out, 0, (size_t)c.rows * 2 * 4));
            bool gated = c.mode == MODE_SILU;
            int split = env_int("MV_SPLIT", 2048);  // values a split-K slice (SHOAL_FUSED_SPLIT_K)
            // Equal slices, as cuda_decode.rs, for rows longer than MV_SPLIT_ABOVE (4,096) values.
            int split_above = env_int("MV_SPLIT_ABOVE", 4096);
            int nslices = c.cols > split_above ? (c.cols + split - 1) / split : 1;
            // MV_SPLIT_STORE=1: stored launches under 8,192 rows split too (cuda_decode.rs's default).
            bool split_store = env_int("MV_SPLIT_STORE", 0) && c.mode == MODE_STORE && c.rows * c.nseg < 8192;
            int slice = ((c.mode == MODE_ADD || split_store) && nslices > 1) ? ((c.cols / 256 + nslices - 1) / nslices) * 256 : c.cols;
            int rows_total = gated ? c.rows : c.rows * c.nseg;
            int per_block = 8;  // rows, or gate/up pairs
            size_t smem = (size_t)slice * 4 + (fmt == FMT_Q4_K ? (size_t)slice * 4 + slice / 16 * 4 : 0);
            bool ring = stream && fmt == FMT_Q4_K && gated;
            // MV_Q8=1: Q4_K and Q6_K rows of other launches with int8 activations (`mv_q4_k_q8`,
            // `mv_q6_k_q8`).
            bool q8 = env_int("MV_Q8", 0) && (fmt == FMT_Q4_K || fmt == FMT_Q6_K) && !gated;
            if (q8) smem = (size_t)slice * 8 + slice / 16 * 4;  // as for f32 Q4_K: the int8 input takes the reordered copy's space
            if (ring) smem = q4k_ring_smem(c.cols, 8, stream);
            int slices = (c.cols + slice - 1) / slice;
            int cap = waves > 0 ? std::max(1, waves * sms / slices) : 1 << 30;  // as cuda_decode.rs
            // f16 rows beyond one per warp: timed one a warp and two a warp (`pairs`), side by side.
            // (Q4_K and Q6_K with int8 activations too: `mv_q4_k_q8_pairs`, and `mv_q6_k_q8_pairs`
            // at 3 blocks an SM, as cuda_decode.rs launches them.)
            bool can_pair = (fmt == FMT_F16 || q8) && !gated && rows_total > cap * per_block;
            for (int pairs = 0; pairs <= (int)can_pair; pairs++) {
            int most = pairs && q8 && fmt == FMT_Q6_K ? std::max(1, 3 * sms / slices) : cap;
            int blocks = std::min(most, (rows_total + (per_block << pairs) - 1) / (per_block << pairs));
            dim3 grid(blocks, slices);
            int iters = std::max(copies * 4, 64);
            // Split-K partial sums as tagged words, as cuda_decode.rs plans them, and a tag for
            // each launch.
            float* partial = nullptr;
            if (slices > 1) {
                CK(cudaMalloc(&partial, (size_t)slices * rows_total * 8));
                CK(cudaMemset(partial, 0, (size_t)slices * rows_total * 8));
            }
            unsigned long long* tags = launch_tags(copies + iters + 1);
            int launches = 0;
            auto launch = [&](int k) {
                MvArgs a;
                memset(&a, 0, sizeof a);
                for (int s = 0; s < c.nseg; s++) { a.seg[s].w = ws[k * c.nseg + s]; a.seg[s].fmt = fmt; a.seg[s].rows = c.rows; }
                a.nseg = c.nseg; a.cols = c.cols; a.slice = slice; a.q4k = fmt == FMT_Q4_K; a.pairs = pairs;
                a.x = x; a.norm_w = c.mode == MODE_ADD ? nullptr : nw; a.eps = 1e-6f; a.mode = c.mode; a.out = out;
                a.partial = partial; a.tag = tags + launches++;
                a.stream = ring ? stream : 0;
                if (ring) a.q4k = 0;  // the ring kernel stages its input its own way
                if (q8) a.q4k = 2;
                auto q8_kernel = fmt == FMT_Q4_K ? (pairs ? mv_q4_k_q8_pairs : mv_q4_k_q8) : (pairs ? mv_q6_k_q8_pairs : mv_q6_k_q8);
                auto kernel = ring ? mv_gated_q4_k_ring : q8 ? q8_kernel : kernels[fi][gated];
                if (!pdl) {
                    kernel<<<grid, 256, smem>>>(a);
                    return;
                }
                launch_overlapping(kernel, grid, dim3(256), smem, a);
            };
            double us = us_per_launch(launch, copies, iters);
            // One clean launch for a checksum that builds can be compared by.
            CK(cudaMemset(out, 0, (size_t)c.rows * 2 * 4));
            launch(0);
            double check = checksum(out, rows_total);
            printf("%-5s %-13s %7.1f us  %7.0f GB/s  (%.1f MB, grid %dx%d%s%s%s)  check %.6e\n", fmt_names[fi], c.name, us, per / us / 1e3, per / 1e6, grid.x, grid.y, pairs ? ", pairs" : "", ring ? ", ring" : "", q8 ? ", int8" : "", check);
            cudaFree(partial); cudaFree(tags);
            }
            for (void* p : ws) cudaFree(p);
            cudaFree(x); cudaFree(nw); cudaFree(out);
        }
    }
    return 0;
}
