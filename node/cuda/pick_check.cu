// pick_check.cu — a check (it exits non-zero on a failure) of the greedy pick fused into the LM
// head's `mv` launch (`pick_greedy` in decode.cu), on each instance an LM head runs: f16 rows one
// and two a warp, Q6_K and Q4_K rows with int8 activations. Each case launches the head over
// crafted weights or inputs and compares the token the launch wrote (where the next step's
// embedding reads it, and into the host's word) with the host's argmax over the logits the same
// launch stored, by decode.cu's rules: the largest value, the lowest row among equal ones, NaN
// never, -0 as +0, only rows below the vocabulary's size; all NaN: token 0. Cases: random rows;
// a vocabulary that ends at the largest row; the largest row copied below and above itself with
// NaN rows before it; every logit NaN; every logit zero but the NaN rows'. Each case runs twice,
// so a scratch the previous launch left dirty shows. Built by scripts/build-cuda.sh (standalone
// nvcc); run by `scripts/gpu-check.sh fidelity`. Not a timing tool.
#include "decode.cu"
#include "bench_common.cuh"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

// The host's greedy pick over the first `vocab` logits, by `logit_key`'s order.
static int host_pick(const std::vector<float>& logits, int vocab) {
    int best = -1;
    for (int r = 0; r < vocab; r++) {
        float v = logits[r];
        if (std::isnan(v)) continue;
        if (best < 0 || v > logits[best]) best = r;
    }
    return best < 0 ? 0 : best;
}

struct Instance { const char* name; void (*kernel)(MvArgs); int fmt; int threads; int pairs; int most_per_sm; };

// A value that makes row `row`'s logit NaN: its first weight (f16), or its first block's scale.
static void poison_row(std::vector<uint8_t>& w, int fmt, int row, int cols) {
    size_t at = fmt_bytes(fmt, (size_t)row * cols) + (fmt == FMT_Q6_K ? 208 : 0);
    uint16_t nan16 = 0x7E00;
    memcpy(&w[at], &nan16, 2);
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int rows = 40002, cols = 1536;  // passes over the grid, an even count for pairs
    const Instance instances[] = {
        {"f16, two rows a warp", mv_f16, FMT_F16, 512, 1, 2},
        {"f16, one row a warp", mv_f16, FMT_F16, 256, 0, 4},
        {"Q6_K int8, two rows a warp", mv_q6_k_q8_pairs, FMT_Q6_K, 256, 1, 3},
        {"Q4_K int8, one row a warp", mv_q4_k_q8, FMT_Q4_K, 512, 0, 2},
        {"Q4_K int8, two rows a warp", mv_q4_k_q8_pairs, FMT_Q4_K, 512, 1, 2},
    };
    float *x, *norm_w, *out;
    unsigned *next, *host_word;
    unsigned long long *pick, *scratch;
    CK(cudaMalloc(&x, cols * 4));
    CK(cudaMalloc(&norm_w, cols * 4));
    CK(cudaMalloc(&out, (size_t)rows * 4));
    CK(cudaMalloc(&next, 4));
    CK(cudaMalloc(&host_word, 4));
    CK(cudaMalloc(&pick, 3 * 8));
    CK(cudaMalloc(&scratch, 4 * 8));
    CK(cudaMemset(scratch, 0, 4 * 8));
    std::vector<float> ones(cols, 1.f);
    CK(cudaMemcpy(norm_w, ones.data(), cols * 4, cudaMemcpyHostToDevice));
    unsigned long long* tags = launch_tags(1);
    int failures = 0, checks = 0;
    for (const Instance& in : instances) {
        CK(cudaFuncSetAttribute(in.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
        std::vector<uint8_t> w = random_weights(in.fmt, rows, cols, 11);
        void* wd;
        CK(cudaMalloc(&wd, w.size()));
        auto upload_weights = [&] { CK(cudaMemcpy(wd, w.data(), w.size(), cudaMemcpyHostToDevice)); };
        upload_weights();
        std::vector<float> hx(cols);
        srand(5);
        for (int i = 0; i < cols; i++) hx[i] = ((rand() % 2001) - 1000) * 1e-3f;
        auto upload_x = [&] { CK(cudaMemcpy(x, hx.data(), cols * 4, cudaMemcpyHostToDevice)); };
        upload_x();
        bool q8 = in.fmt != FMT_F16;
        size_t smem = q8 ? (size_t)cols * 8 + cols / 16 * 4 : (size_t)cols * 4;
        int warps = in.threads / 32;
        int blocks = std::min(in.most_per_sm * sms, (rows + (warps << in.pairs) - 1) / (warps << in.pairs));
        // One launch of the head picking among the first `vocab` rows; the logits it stored and
        // the token it wrote (both words, which must agree).
        auto run = [&](int vocab, std::vector<float>& logits) -> long long {
            unsigned long long words[3] = {(unsigned long long)next, (unsigned long long)host_word, (unsigned long long)vocab};
            CK(cudaMemcpy(pick, words, sizeof words, cudaMemcpyHostToDevice));
            unsigned poison = 0xDEADBEEFu;
            CK(cudaMemcpy(next, &poison, 4, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(host_word, &poison, 4, cudaMemcpyHostToDevice));
            MvArgs a;
            memset(&a, 0, sizeof a);
            a.seg[0].w = wd;
            a.seg[0].fmt = in.fmt;
            a.seg[0].rows = rows;
            a.nseg = 1;
            a.cols = a.slice = cols;
            a.q4k = q8 ? 2 : 0;
            a.pairs = in.pairs;
            a.x = x;
            a.norm_w = norm_w;
            a.eps = 1e-6f;
            a.mode = MODE_STORE;
            a.out = out;
            a.preload = 1;
            a.tag = tags;
            a.pick = pick;
            a.pick_scratch = scratch;
            launch_overlapping(in.kernel, dim3(blocks), dim3(in.threads), smem, a);
            CK(cudaDeviceSynchronize());
            logits.resize(rows);
            CK(cudaMemcpy(logits.data(), out, (size_t)rows * 4, cudaMemcpyDeviceToHost));
            unsigned got[2];
            CK(cudaMemcpy(&got[0], next, 4, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(&got[1], host_word, 4, cudaMemcpyDeviceToHost));
            return got[0] == got[1] ? (long long)got[0] : -1;
        };
        // Runs a case twice and judges it; `setup` holds what the case must have set up
        // (ties present, NaN present, ...), judged on the first run's logits.
        auto check = [&](const char* what, int vocab, auto setup) {
            for (int round = 0; round < 2; round++) {
                std::vector<float> logits;
                long long got = run(vocab, logits);
                int want = host_pick(logits, vocab);
                const char* bad = got != want ? "the pick differs from the host's" : round == 0 ? setup(logits, want) : nullptr;
                checks++;
                if (bad) {
                    failures++;
                    printf("FAIL pick %s: %s (round %d): got %lld (the two words %s), want %d\n", in.name, what, round + 1, got, got < 0 ? "differ" : "agree", want);
                    return;
                }
                if (round == 1) printf("PASS pick %s: %s -> %d\n", in.name, what, want);
            }
        };
        std::vector<float> base;
        run(rows, base);
        int top = host_pick(base, rows);
        check("random rows", rows, [&](const std::vector<float>&, int) -> const char* { return nullptr; });
        if (top > 0) {
            check("the vocabulary ending at the largest row", top, [&](const std::vector<float>&, int want) -> const char* {
                return want == top ? "the setup failed (picked the row past the vocabulary)" : nullptr;
            });
        }
        // The largest row copied to row 2 (below it) and the last row (above it), rows 0 and 1 NaN:
        // equal logits in different blocks and passes; the lowest must win over them and NaN.
        size_t row_bytes = fmt_bytes(in.fmt, cols);
        memcpy(&w[2 * row_bytes], &w[(size_t)top * row_bytes], row_bytes);
        memcpy(&w[(size_t)(rows - 1) * row_bytes], &w[(size_t)top * row_bytes], row_bytes);
        poison_row(w, in.fmt, 0, cols);
        poison_row(w, in.fmt, 1, cols);
        upload_weights();
        check("ties at the largest logit after NaN rows", rows, [&](const std::vector<float>& l, int want) -> const char* {
            if (!std::isnan(l[0]) || !std::isnan(l[1])) return "the setup failed (rows 0 and 1 are not NaN)";
            if (l[2] != l[top] || l[rows - 1] != l[top]) return "the setup failed (the copies' logits differ)";
            return want == 2 ? nullptr : "the setup failed (row 2 is not the host's pick)";
        });
        // A zero input: every logit 0 but the NaN rows' (int8 activations may make all NaN).
        std::vector<float> saved = hx;
        std::fill(hx.begin(), hx.end(), 0.f);
        upload_x();
        check("equal zero logits after NaN rows", rows, [&](const std::vector<float>& l, int want) -> const char* {
            return want == 2 || (want == 0 && std::isnan(l[2])) ? nullptr : "the setup failed (neither zeros nor NaN)";
        });
        // A NaN input: every logit NaN, token 0.
        hx = saved;
        hx[7] = NAN;
        upload_x();
        check("every logit NaN", rows, [&](const std::vector<float>& l, int want) -> const char* {
            for (int r = 0; r < rows; r++)
                if (!std::isnan(l[r])) return "the setup failed (a logit is not NaN)";
            return want == 0 ? nullptr : "the host's pick is not 0";
        });
        CK(cudaFree(wd));
    }
    printf("%s pick: %d of %d checks passed\n", failures ? "FAIL" : "PASS", checks - failures, checks);
    return failures ? 1 : 0;
}
