// q6k_layout_bench.cu — what an aligned Q6_K layout would be worth to the decode step's int8
// matrix-vector product: decode.cu's `dot_q6_k_q8` (two or four rows a warp, 8 warps a block, 3
// blocks an SM) over GGUF's 210-byte blocks, which are only 2-byte aligned (each 8 bytes a lane
// reads come as two or three words and two funnel shifts), against walks over the same values split
// by field into four arrays (low nibbles, high bit pairs, scales, d): the same walk and products
// (`q6k_use`, 8 lanes a block, each lane's 8 bytes of a field one 8-byte load), and 4 lanes a block
// with each lane's 16 bytes of a field one load (`dot_q6_quad_split`; rows two or four a warp,
// steps one or two at a time). On the 7B's down (3,584 x 18,944, in 7 slices as the engine runs it,
// and in 5) and LM head shapes and the 1.5B's, over enough copies that nothing stays in L2. Prints
// µs per launch, GB/s of GGUF bytes, and each walk's checksum (GGUF blocks two rows a warp and the
// 8-lane split equal: the same sums in the same order; the others' last digits may differ). Built
// by scripts/build-cuda.sh; run on the GPU machine. Not a test: it asserts nothing; shoal does not
// repack Q6_K (candle's kernels read the GGUF layout for short prompts; session 60 tried a
// regrouped layout in the engine, see docs/gpu-performance-log.md). Session 59's third variant,
// GGUF's blocks streamed through a `cp.async` ring in shared memory, was run in session 60 and
// removed (H200: 7B head 138.1 µs at 2 stages, 168.5 at 3, against 142.5 here; 7B down 24.8 and
// 29.7 against 23.0; 1.5B head 82.4 against 73.7).
#include "decode.cu"
#include "bench_common.cuh"
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

// One Q6_K matrix split by field: block g (row-major over rows and blocks) has its 128 bytes of
// low nibbles at ql + 128 g, 64 of high bit pairs at qh + 64 g, 16 scales at sc + 16 g, d at d + g.
struct Q6Split {
    const uint8_t* ql;
    const uint8_t* qh;
    const uint8_t* sc;
    const __half* d;
};

struct BenchArgs {
    const uint8_t* w;  // GGUF blocks (split = false)
    Q6Split s;         // the same values split by field (split = true)
    int rows, cols;    // the matrix; a block column takes values [k0, k0 + slice) of every row
    int slice;
    const int8_t* x8;  // cols int8 inputs, one scale a 32 (dx)
    const float* dx;
    float* out;        // gridDim.y x rows partial sums
};

// dot_q6_k_q8<2>'s walk over the split layout: one 8-byte load a field, the products `q6k_use`.
__device__ __forceinline__ void dot_q6_pair_split(const BenchArgs& a, int row, int b_first, int nb, const int8_t* x8, const float* dx, float* out) {
    constexpr int R = 2;
    int lane = threadIdx.x & 31, sub = lane & 7, n = sub >> 2, l0 = (sub & 3) * 8, c = (sub & 3) >> 1;
    const uint32_t sc_pick = c | (c + 2) << 4 | (c + 4) << 8 | (c + 6) << 12;
    int b = lane >> 3;
    size_t g[R];  // the lane's block of each row, counted over the whole matrix
#pragma unroll
    for (int rr = 0; rr < R; rr++) g[rr] = (size_t)(row + rr) * (a.cols >> 8) + b_first + b;
    float acc[R] = {0.f, 0.f};
    auto load = [&](int step, Q6Loads* l) {
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            size_t gg = g[rr] + 4 * step;
            uint2 qa = *reinterpret_cast<const uint2*>(a.s.ql + gg * 128 + 64 * n + l0);
            uint2 qb = *reinterpret_cast<const uint2*>(a.s.ql + gg * 128 + 64 * n + l0 + 32);
            uint2 qh = *reinterpret_cast<const uint2*>(a.s.qh + gg * 64 + 32 * n + l0);
            uint2 sc = *reinterpret_cast<const uint2*>(a.s.sc + gg * 16 + 8 * n);
            l[rr].qa[0] = qa.x, l[rr].qa[1] = qa.y, l[rr].qb[0] = qb.x, l[rr].qb[1] = qb.y;
            l[rr].qh[0] = qh.x, l[rr].qh[1] = qh.y, l[rr].sc[0] = sc.x, l[rr].sc[1] = sc.y;
            l[rr].d = __half2float(a.s.d[gg]);
        }
    };
    auto use = [&](int step, const Q6Loads* l) { q6k_use<R>(l, x8 + (b + 4 * step) * 256 + 128 * n + l0, dx + (b + 4 * step) * 8 + 4 * n, sc_pick, acc); };
    auto advance = [&](int steps) {
        g[0] += 4 * steps, g[1] += 4 * steps;
        b += 4 * steps;
    };
    two_steps_at_a_time<Q6Loads[R]>(b, nb, load, use, advance);
    out[0] = warp_sum(acc[0]), out[1] = warp_sum(acc[1]);
}

// 4 lanes a block over the split layout, each lane's bytes of a field one 16-byte load: lane s
// (0-3) of a block takes half n = s / 2 and its values l0 .. l0 + 15 (l0 = 16 (s % 2)) of each of
// the half's four 32-value groups, under one scale each. 64 values a lane and block, 8 blocks a
// warp step, in 5 loads (3 of 16 bytes, the half's 8 scale bytes, d), where the 8-lane split walk
// makes 5 for 32 values and the GGUF walk 9 to 13. The products are q6k_use's, four dp4a a group
// instead of two, written out here: calling q6k_use on each 8-byte half would sum each group's
// inputs twice, and the log's figures are for this form.
struct Q6Quad {
    uint4 qa, qb, qh;
    uint2 sc;
    float d;
};

template <int R, bool TWO_STEPS>
__device__ __forceinline__ void dot_q6_quad_split(const BenchArgs& a, int row, int b_first, int nb, const int8_t* x8, const float* dx, float* out) {
    const float scale_byte = 8388608.f + 128.f;
    int lane = threadIdx.x & 31, s = lane & 3, n = s >> 1, l0 = (s & 1) * 16, c = s & 1;
    const uint32_t sc_pick = c | (c + 2) << 4 | (c + 4) << 8 | (c + 6) << 12;
    int b = lane >> 2;
    size_t g[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) g[rr] = (size_t)(row + rr) * (a.cols >> 8) + b_first + b;
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.f;
    auto load = [&](int step, Q6Quad* l) {
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            size_t gg = g[rr] + 8 * step;
            l[rr].qa = *reinterpret_cast<const uint4*>(a.s.ql + gg * 128 + 64 * n + l0);
            l[rr].qb = *reinterpret_cast<const uint4*>(a.s.ql + gg * 128 + 64 * n + 32 + l0);
            l[rr].qh = *reinterpret_cast<const uint4*>(a.s.qh + gg * 64 + 32 * n + l0);
            l[rr].sc = *reinterpret_cast<const uint2*>(a.s.sc + gg * 16 + 8 * n);
            l[rr].d = __half2float(a.s.d[gg]);
        }
    };
    auto use = [&](int step, const Q6Quad* l) {
        int bb = b + 8 * step;
        const int8_t* xp = x8 + bb * 256 + 128 * n + l0;
        const float* dp = dx + bb * 8 + 4 * n;
        int4 xw[4];
        int start[4];
        float dxj[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            xw[j] = *reinterpret_cast<const int4*>(xp + 32 * j);
            start[j] = -32 * __dp4a(0x01010101, xw[j].w, __dp4a(0x01010101, xw[j].z, __dp4a(0x01010101, xw[j].y, __dp4a(0x01010101, xw[j].x, 0))));
            dxj[j] = dp[j];
        }
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            uint32_t q0[4], q1[4], q2[4], q3[4];
            q6k_words(l[rr].qa.x, l[rr].qb.x, l[rr].qh.x, q0);
            q6k_words(l[rr].qa.y, l[rr].qb.y, l[rr].qh.y, q1);
            q6k_words(l[rr].qa.z, l[rr].qb.z, l[rr].qh.z, q2);
            q6k_words(l[rr].qa.w, l[rr].qb.w, l[rr].qh.w, q3);
            uint32_t sc = __byte_perm(l[rr].sc.x, l[rr].sc.y, sc_pick) ^ 0x80808080u;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int v = __dp4a((int)q3[j], xw[j].w, __dp4a((int)q2[j], xw[j].z, __dp4a((int)q1[j], xw[j].y, __dp4a((int)q0[j], xw[j].x, start[j]))));
                float f = __int_as_float(v + 0x4B400000) - 12582912.f;  // exact for |v| < 2^22
                sum = fmaf(byte_float(sc, j, scale_byte) * dxj[j], f, sum);
            }
            acc[rr] = fmaf(l[rr].d, sum, acc[rr]);
        }
    };
    auto advance = [&](int steps) {
#pragma unroll
        for (int rr = 0; rr < R; rr++) g[rr] += 8 * steps;
        b += 8 * steps;
    };
    if (TWO_STEPS) two_steps_at_a_time<Q6Quad[R], 8>(b, nb, load, use, advance);
    else one_step_at_a_time<Q6Quad[R], 8>(b, nb, load, use, advance);
#pragma unroll
    for (int rr = 0; rr < R; rr++) out[rr] = warp_sum(acc[rr]);
}

// The walks timed: GGUF blocks (the engine's `dot_q6_k_q8`, rows two a warp, and four as the
// engine's `mv_q6_k_q8_quads` takes them), the split layout 8 lanes a block (two rows a warp), and
// 4 lanes a block (rows a warp, steps at a time).
enum Walk { GGUF = 0, GGUF4 = 1, SPLIT8 = 2, QUAD2 = 3, QUAD2_TWO = 4, QUAD4 = 5, WALKS = 6 };
const char* const WALK_NAMES[WALKS] = {"GGUF blocks", "GGUF blocks, 4 rows", "split, 8 lanes", "split, 4 lanes, 2 rows", "split, 4 lanes, 2x2", "split, 4 lanes, 4 rows"};

// Rows R a warp over a block column's slice; the slice's int8 input staged in shared memory.
// (The walks that hold more loads get 2 blocks an SM, 128 registers: at 3 they spilled.)
constexpr int blocks_per_sm(int walk) { return walk == QUAD2_TWO || walk == QUAD4 ? 2 : 3; }
template <int WALK>
__global__ void __launch_bounds__(256, blocks_per_sm(WALK)) q6_rows(BenchArgs a) {
    constexpr int R = WALK == QUAD4 || WALK == GGUF4 ? 4 : 2;
    extern __shared__ float4 smem4[];
    int8_t* x8 = reinterpret_cast<int8_t*>(smem4);
    float* dx = reinterpret_cast<float*>(x8 + a.slice);
    int k0 = blockIdx.y * a.slice, kn = min(a.slice, a.cols - k0);
    for (int i = threadIdx.x; i < kn / 4; i += blockDim.x) reinterpret_cast<int*>(x8)[i] = reinterpret_cast<const int*>(a.x8 + k0)[i];
    for (int i = threadIdx.x; i < kn / 32; i += blockDim.x) dx[i] = a.dx[k0 / 32 + i];
    __syncthreads();
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int r = R * (blockIdx.x * warps + (threadIdx.x >> 5)); r < a.rows; r += R * gridDim.x * warps) {
        float y[R];
        if constexpr (WALK == SPLIT8) {
            dot_q6_pair_split(a, r, k0 >> 8, kn >> 8, x8, dx, y);
        } else if constexpr (WALK == GGUF || WALK == GGUF4) {  // the engine's own
            const uint8_t* rows[R];
#pragma unroll
            for (int rr = 0; rr < R; rr++) rows[rr] = row_at(a.w, FMT_Q6_K, r + rr, a.cols, k0);
            dot_q6_k_q8<R>(rows, kn, x8, dx, y);
        } else {
            dot_q6_quad_split<R, WALK == QUAD2_TWO>(a, r, k0 >> 8, kn >> 8, x8, dx, y);
        }
        if (lane == 0)
#pragma unroll
            for (int rr = 0; rr < R; rr++) a.out[(size_t)blockIdx.y * a.rows + r + rr] = y[rr];
    }
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    struct Case { const char* name; int rows, cols, slices; };
    const Case cases[] = {{"7B down", 3584, 18944, 7}, {"7B down/5", 3584, 18944, 5}, {"7B head", 152064, 3584, 1}, {"1.5B down", 1536, 8960, 5}, {"1.5B head", 151936, 1536, 1}};
    for (const Case& c : cases) {
        size_t blocks = (size_t)c.rows * c.cols / 256, bytes = blocks * 210;
        int copies = (int)std::max<size_t>(2, (size_t)(600u << 20) / bytes + 1);
        auto h = random_weights(FMT_Q6_K, c.rows, c.cols, 9);
        std::vector<uint8_t> ql(blocks * 128), qh(blocks * 64), sc(blocks * 16), d(blocks * 2);
        for (size_t g = 0; g < blocks; g++) {
            memcpy(&ql[g * 128], &h[g * 210], 128);
            memcpy(&qh[g * 64], &h[g * 210 + 128], 64);
            memcpy(&sc[g * 16], &h[g * 210 + 192], 16);
            memcpy(&d[g * 2], &h[g * 210 + 208], 2);
        }
        std::vector<BenchArgs> args(copies);
        std::vector<int8_t> hx(c.cols);
        std::vector<float> hdx(c.cols / 32);
        for (int i = 0; i < c.cols; i++) hx[i] = (int8_t)((i * 37) % 255 - 127);
        for (int i = 0; i < c.cols / 32; i++) hdx[i] = 1e-2f * (1 + i % 5);
        int8_t* x8;
        float *dx, *out;
        CK(cudaMalloc(&x8, c.cols));
        CK(cudaMalloc(&dx, c.cols / 32 * 4));
        CK(cudaMalloc(&out, (size_t)c.slices * c.rows * 4));
        CK(cudaMemcpy(x8, hx.data(), c.cols, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dx, hdx.data(), c.cols / 32 * 4, cudaMemcpyHostToDevice));
        for (BenchArgs& a : args) {
            uint8_t *w, *pl, *ph, *ps, *pd;
            CK(cudaMalloc(&w, bytes));
            CK(cudaMalloc(&pl, ql.size()));
            CK(cudaMalloc(&ph, qh.size()));
            CK(cudaMalloc(&ps, sc.size()));
            CK(cudaMalloc(&pd, d.size()));
            CK(cudaMemcpy(w, h.data(), bytes, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(pl, ql.data(), ql.size(), cudaMemcpyHostToDevice));
            CK(cudaMemcpy(ph, qh.data(), qh.size(), cudaMemcpyHostToDevice));
            CK(cudaMemcpy(ps, sc.data(), sc.size(), cudaMemcpyHostToDevice));
            CK(cudaMemcpy(pd, d.data(), d.size(), cudaMemcpyHostToDevice));
            a = BenchArgs{w, Q6Split{pl, ph, ps, reinterpret_cast<const __half*>(pd)}, c.rows, c.cols, c.cols / c.slices / 256 * 256 + (c.cols / 256 % c.slices ? 256 : 0), x8, dx, out};
        }
        int slice = args[0].slice, slices = (c.cols + slice - 1) / slice;
        size_t smem = slice + slice / 32 * 4;
        void (*const kernels[WALKS])(BenchArgs) = {q6_rows<GGUF>, q6_rows<GGUF4>, q6_rows<SPLIT8>, q6_rows<QUAD2>, q6_rows<QUAD2_TWO>, q6_rows<QUAD4>};
        for (int walk = 0; walk < WALKS; walk++) {
            auto kernel = kernels[walk];
            int blocks_x = std::max(1, blocks_per_sm(walk) * sms / slices);
            CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            auto launch = [&](int k) { launch_overlapping(kernel, dim3(blocks_x, slices), dim3(256), smem, args[k]); };
            double us = us_per_launch(launch, copies, std::max(copies * 4, 64));
            CK(cudaMemset(out, 0, (size_t)slices * c.rows * 4));
            launch(0);
            double check = checksum(out, (size_t)slices * c.rows);
            printf("%-10s %-24s %7.1f us  %6.0f GB/s  (%.1f MB, grid %dx%d)  check %.6e\n", c.name, WALK_NAMES[walk], us, bytes / us / 1e3, bytes / 1e6, blocks_x, slices, check);
        }
        for (BenchArgs& a : args) {
            cudaFree(const_cast<uint8_t*>(a.w));
            cudaFree(const_cast<uint8_t*>(a.s.ql));
            cudaFree(const_cast<uint8_t*>(a.s.qh));
            cudaFree(const_cast<uint8_t*>(a.s.sc));
            cudaFree(const_cast<__half*>(a.s.d));
        }
        cudaFree(x8);
        cudaFree(dx);
        cudaFree(out);
    }
    return 0;
}
