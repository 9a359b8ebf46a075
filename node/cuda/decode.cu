// decode.cu — shoal's fused kernels for one decode step (one token, batch 1) on an NVIDIA GPU.
//
// A step runs five kernels per layer, on f32 activations (Q4_K gate/up rows: int8, see
// `mv_gated_q4_k_ring`):
//   mv (RMSNorm + q/k/v rows + bias)  ->  attend (q/k norm, rope, KV append, softmax·V;
//   attend_split past 512 keys: a head's keys over several blocks, merged by the last)
//   ->  mv (o rows, added into the residual)  ->  mv (RMSNorm + gate/up rows, act(gate)·up)
//   ->  mv (down rows, added into the residual)
// plus `add_norm` for families with post-norms. Weights are read in the form they are stored
// (f32/f16/bf16 rows, GGUF Q8_0/Q4_K/Q6_K blocks) and never copied; the position and the
// KV cache addresses come from device memory, so a step is captured once as a CUDA graph (per
// count of attention splits) and replayed for every sequence. On sm_90 and later
// each kernel may start while the previous one finishes (programmatic dependent launch): it
// fetches what depends on no earlier kernel (f16/bf16 warps load their first rows, Q4_K warps
// with int8 activations their first step, other formats pull theirs into L2; RMSNorm weights go
// to shared memory), then waits before reading earlier results. Where a kernel needs only part
// of the previous one's output (attention its head's q/k/v, o and down a slice of their input),
// it does not wait for that kernel's end: it reads each value once it carries the step's tag
// (`load_tagged`).
// Also here: a prompt's Q4_K and Q6_K matrices dequantized to f16 for cuBLAS
// (`dequant_q4_k_f16`, `dequant_q6_k_f16`); at the end, sampling where the logits are (`sample_temperature` draws a token,
// `sample_candidates` gathers top-k / top-p / min-p candidates for the host's cuts, `pick_token`
// feeds a temperature pick straight into the next step's embedding; a greedy one is picked inside
// the LM head's launch, `pick_greedy`).
// For prompts also: attention's scale, mask and softmax in one pass (`attention_softmax_*`) and
// the MLP's act(gate) * up (`gated_product_*`).
// What this file does not do: prompts' matrix products (t > 1 run through candle and cuBLAS),
// batches, the
// sampler's cuts or penalties (the host applies those).

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_Q8_0 8
#define FMT_Q4_K 12
#define FMT_Q6_K 14
#define FMT_ANY -1  // a kernel instance for matrices of mixed formats

#define MODE_STORE 0
#define MODE_ADD 1
#define MODE_SILU 2
#define MODE_GELU_TANH 3

struct Seg {
    const void* w;       // rows x cols, row-major in `fmt`
    const float* bias;   // rows, or null
    int fmt;
    int rows;
};

struct MvArgs {
    Seg seg[3];
    int nseg;
    int cols;
    int slice;           // input values per block row (gridDim.y = ceil(cols / slice))
    int q4k;             // 1: some matrix is Q4_K (the input is also staged for dot_q4_k)
    int pairs;           // 1: each warp takes rows 2i and 2i + 1 together (f16/bf16 instances)
    int stream;          // mv_gated_q4_k_ring: stages of each warp's ring of rows (2 or 3; q4k is 0)
    const float* x;      // cols
    const float* norm_w; // cols: RMSNorm the input first; null: use x as it is
    float eps;
    int mode;
    float* out;
    float* partial;      // split-K: this launch's own slices x rows partial sums as tagged words
                         // (`store_tagged`), or null (then summed atomically)
    int preload;         // 1: f16/bf16 rows: a warp loads its first rows before the wait (see `mv_rows`)
    int launch;          // this launch's place in the step (for the trace)
    unsigned long long* trace;  // `SHOAL_FUSED_TRACE`: block timeline records, or null
    int tag_in;          // 1: x is tagged (see `load_tagged`): read each value as it arrives, no wait;
                         // 2: x is tagged int8 (`store_q8_tagged`), for an int8 instance's whole rows
    int tag_out;         // 1: out gets tagged values (`store_tagged`)
    const unsigned long long* tag;  // the step's tag, written before its first kernel (tagged
                                    // input or output, or split-K partials)
    const uint8_t* ahead[2];        // read-ahead: where, in each of two matrices that a later
    long long ahead_bytes;          // launch reads, this launch's blocks pull that many bytes
                                    // into L2 before their wait (0: none; see `stage_input`)
    const unsigned long long* pick; // an LM head's: the step's greedy pick (`pick_greedy`), or null
    unsigned long long* pick_scratch;  // its running maximum and count of blocks done, zeroed
};

// Programmatic dependent launch (Hopper on): `allow_next_kernel` lets the next kernel's blocks
// start while this one runs; `wait_for_previous_kernel` waits until the previous one has
// finished and its writes are visible. Every kernel waits before it reads what another wrote,
// so a launch may allow overlap whatever kernel comes next. Both are no-ops on a launch that
// does not allow overlap, and compiled out before sm_90.
__device__ __forceinline__ void allow_next_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- Tagged values: where a kernel needs only some of the previous kernel's outputs (down a
// slice of gate/up's rows, attention its head's q/k/v, o a slice of the heads), the producer
// stores each value as one 64-bit word with the step's tag in its high half, and the consumer
// reads each value once it carries this step's tag instead of waiting for the producer's last
// block. A 64-bit aligned access is single-copy atomic, so a value and its tag arrive together
// and no fence or counter is needed. Buffers start zeroed and tags start at 1.
__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_tagged(float* base, int i, float y, unsigned tag) {
    unsigned long long v = ((unsigned long long)tag << 32) | __float_as_uint(y);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(reinterpret_cast<unsigned long long*>(base) + i), "l"(v) : "memory");
}

// Between polls of a value not yet written. A producer that never writes it is a bug; after
// 5 s the kernel traps (the step then fails with a CUDA error) rather than hang the node.
__device__ __forceinline__ void poll_pause(unsigned long long* since) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (*since == 0) *since = t;
    else if (t - *since > 5000000000ull) __trap();
    __nanosleep(128);
}

// Loads tagged values at[u] of `s` (at[u] < 0: none) into v, then polls until every one carries
// `tag`, reloading all that do not together (one round trip a poll, not one a value).
template <int N>
__device__ __forceinline__ void poll_tagged(const unsigned long long* s, const int* at, unsigned tag, unsigned long long* v, unsigned long long* since) {
#pragma unroll
    for (int u = 0; u < N; u++) v[u] = at[u] >= 0 ? load_relaxed(s + at[u]) : (unsigned long long)tag << 32;
    for (;;) {
        bool ready = true;
#pragma unroll
        for (int u = 0; u < N; u++) ready &= (unsigned)(v[u] >> 32) == tag;
        if (ready) return;
        poll_pause(since);
#pragma unroll
        for (int u = 0; u < N; u++)
            if ((unsigned)(v[u] >> 32) != tag) v[u] = load_relaxed(s + at[u]);
    }
}

// As `load_tagged` for one warp (a head of at most 256 values, eight a lane).
__device__ void load_tagged_warp(const float* src, int n, unsigned tag, float* dst) {
    int lane = threadIdx.x & 31, at[8];
    unsigned long long since = 0, v[8];
#pragma unroll
    for (int u = 0; u < 8; u++) at[u] = lane + 32 * u < n ? lane + 32 * u : -1;
    poll_tagged<8>(reinterpret_cast<const unsigned long long*>(src), at, tag, v, &since);
#pragma unroll
    for (int u = 0; u < 8; u++)
        if (at[u] >= 0) dst[at[u]] = __uint_as_float((unsigned)v[u]);
}

#define TAG_BATCH 4  // 8 spills registers in f16 launches that hold their preloaded rows meanwhile
// dst[j] = value j of the tagged vector src, j in [0, n), the block's threads taking every
// blockDim.x-th, TAG_BATCH at once.
__device__ void load_tagged(const float* src, int n, unsigned tag, float* dst) {
    const unsigned long long* s = reinterpret_cast<const unsigned long long*>(src);
    unsigned long long since = 0;
    // One thread polls the last value first (in the producers' row order, among the last to
    // come), so that a block waiting for a whole slice does not send every thread's polls to L2
    // beside the producer's weight reads.
    if (threadIdx.x == 0)
        while ((unsigned)(load_relaxed(s + n - 1) >> 32) != tag) poll_pause(&since);
    __syncthreads();
    for (int j0 = threadIdx.x; j0 < n; j0 += TAG_BATCH * blockDim.x) {
        int at[TAG_BATCH];
        unsigned long long v[TAG_BATCH];
#pragma unroll
        for (int u = 0; u < TAG_BATCH; u++) at[u] = j0 + u * blockDim.x < n ? j0 + u * (int)blockDim.x : -1;
        poll_tagged<TAG_BATCH>(s, at, tag, v, &since);
#pragma unroll
        for (int u = 0; u < TAG_BATCH; u++)
            if (at[u] >= 0) dst[at[u]] = __uint_as_float((unsigned)v[u]);
    }
}

// ---- `SHOAL_FUSED_TRACE` (a diagnostic): per block, when it started, passed its wait for the
// previous kernel, had its input ready, and ended (%globaltimer, ns). trace[0] counts records,
// trace[1] is their capacity; a record is 5 words from trace[2] on. Off (null) in normal runs.
__shared__ unsigned long long trace_started, trace_waited, trace_ready;

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void trace_mark(const unsigned long long* trace, unsigned long long* at) {
    if (trace && threadIdx.x == 0) *at = now_ns();
}

// Every thread of the block calls this last (a uniform branch on `trace`).
__device__ void trace_block(unsigned long long* trace, int launch) {
    if (!trace) return;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long end = now_ns();  // before the shared counter's round trip
        unsigned long long slot = atomicAdd(trace, 1ull);
        if (slot < trace[1]) {
            unsigned smid;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
            unsigned long long* r = trace + 2 + 5 * slot;
            r[0] = trace_started;
            r[1] = trace_waited;
            r[2] = trace_ready;
            r[3] = end;
            r[4] = ((unsigned long long)launch << 32) | ((unsigned long long)smid << 20) | (blockIdx.y * gridDim.x + blockIdx.x);
        }
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats; `first_use`: no
// thread has read it before (no barrier needed before it is written).
__device__ float block_sum(float v, float* scratch, bool first_use = false) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (!first_use) __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : 0.f;
    return warp_sum(t);
}

// A 16-byte load of f16/bf16 weight rows, which a step reads once and not again until the
// next step, after every other weight: marked evict-first in L2, so that they push out each
// other rather than what the launches hand each other (tagged outputs, the residual) or the KV
// cache, and not kept in L1. H200s, four calls
// (session 55): 1.5B f16 892.3 -> 905.1 tok/s on average (+1.4%; faster in each of 11 rounds),
// 7B f16 274.0 -> 276.0 (+0.7%; 9 of 9). Q4_K and Q6_K rows load as they did: the same hint
// there made the 7B Q4_K_M 3.4% slower and the 1.5B 1.5% (and without L1, Q6_K's 2-byte-aligned
// words, three loads a sector, took the 7B's LM head 2.6 times as long); evict-first with L1 kept,
// 0.7% and 0.6% slower (session 56).
__device__ __forceinline__ uint4 load_weight16(const void* at) {
#if __CUDA_ARCH__ >= 800
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(at), "l"(policy));
    return v;
#else
    return __ldg(reinterpret_cast<const uint4*>(at));
#endif
}

__device__ __forceinline__ float half_at(const void* p, int byte_offset) {
    return __half2float(*reinterpret_cast<const __half*>(reinterpret_cast<const uint8_t*>(p) + byte_offset));
}

__device__ __forceinline__ uint32_t load_u16x2(const uint8_t* p) {  // 4 bytes at a 2-byte-aligned address
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    return (uint32_t)__ldg(h) | ((uint32_t)__ldg(h + 1) << 16);
}

// ---- one row · xs, per weight format; every lane returns the full sum ----
// Each function issues the loads of several steps before using any of them: a warp's bytes in
// flight, not arithmetic, bound a matrix-vector product.

__device__ __forceinline__ void widen2(uint32_t p, int fmt, float* lo, float* hi) {
    if (fmt == FMT_F16) {
        float2 f = __half22float2(*reinterpret_cast<const __half2*>(&p));
        *lo = f.x;
        *hi = f.y;
    } else {
        *lo = __uint_as_float(p << 16);
        *hi = __uint_as_float(p & 0xffff0000u);
    }
}

// One round of `dot_half`'s loads: 8 / R steps of R rows, step k's row rr at u[k * R + rr].
struct HalfLoads {
    uint4 u[8];
};

// (HINT: `load_weight16`'s evict-first loads: the f16 and bf16 instances (timed on f16 models;
// bf16 rows load the same way); the mixed-format ones, which no model timed here runs, as before.)
template <int R, bool HINT = false>
__device__ __forceinline__ void half_load(const uint8_t* const* rows, int cols, int base, HalfLoads& l) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < 8 / R; k++) {
        int j = base + k * 256 + lane * 8;
#pragma unroll
        for (int rr = 0; rr < R; rr++)
            l.u[k * R + rr] = j >= cols ? make_uint4(0, 0, 0, 0) : HINT ? load_weight16(reinterpret_cast<const uint16_t*>(rows[rr]) + j) : __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(rows[rr]) + j));
    }
}

// Adds one round of `dot_half` (loaded from `base`) into acc.
template <int FMT, int R>
__device__ __forceinline__ void half_use(const HalfLoads& l, int cols, int base, const float* xs, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < 8 / R; k++) {
        int j = base + k * 256 + lane * 8;
        if (j < cols) {
            // x as two 16-byte shared loads (scalar loads 8 values apart would conflict).
            float4 xa = *reinterpret_cast<const float4*>(xs + j), xb = *reinterpret_cast<const float4*>(xs + j + 4);
            float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                const uint32_t* p = reinterpret_cast<const uint32_t*>(&l.u[k * R + rr]);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float lo, hi;
                    widen2(p[e], FMT, &lo, &hi);
                    acc[rr] = fmaf(lo, xv[2 * e], acc[rr]);
                    acc[rr] = fmaf(hi, xv[2 * e + 1], acc[rr]);
                }
            }
        }
    }
}

// f16/bf16 rows: 8 values (16 bytes) per lane per step, 8 / R steps (2048 / R values) per round,
// R rows at once (their loads in flight together, each x value read once for all R). With
// `preloaded`, `first` is the first round, already loaded (`half_load` from 0).
template <int FMT, int R, bool HINT = false>
__device__ __forceinline__ void dot_half(const uint8_t* const* rows, int cols, const float* xs, float* out, bool preloaded = false, const HalfLoads& first = HalfLoads{}) {
    constexpr int ROUND = 8 / R * 256;
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.f;
    int base = 0;
    if (preloaded) {
        half_use<FMT, R>(first, cols, 0, xs, acc);
        base = ROUND;
    }
    for (; base < cols; base += ROUND) {
        HalfLoads l;
        half_load<R, HINT>(rows, cols, base, l);
        half_use<FMT, R>(l, cols, base, xs, acc);
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) out[rr] = warp_sum(acc[rr]);
}

// f32 rows: 4 values per lane per step, 8 steps (1024 values) per round.
__device__ float dot_f32(const uint8_t* rp, int cols, const float* xs) {
    int lane = threadIdx.x & 31;
    const float* r = reinterpret_cast<const float*>(rp);
    float acc = 0.f;
    for (int base = 0; base < cols; base += 8 * 128) {
        float4 u[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int j = base + k * 128 + lane * 4;
            u[k] = j < cols ? __ldg(reinterpret_cast<const float4*>(r + j)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int j = base + k * 128 + lane * 4;
            if (j < cols) {
                float4 xv = *reinterpret_cast<const float4*>(xs + j);
                acc += u[k].x * xv.x + u[k].y * xv.y + u[k].z * xv.z + u[k].w * xv.w;
            }
        }
    }
    return warp_sum(acc);
}

// Q8_0: 34-byte blocks of 32 values (f16 scale, 32 int8). Four lanes per block (8 values each),
// 8 blocks per step, 4 steps per round.
__device__ float dot_q8_0(const uint8_t* r, int cols, const float* xs) {
    int lane = threadIdx.x & 31, part = lane & 3;
    int nb = cols >> 5;
    float acc = 0.f;
    for (int b0 = 0; b0 < nb; b0 += 32) {
        uint32_t q0[4], q1[4];
        float d[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int b = b0 + 8 * k + (lane >> 2);
            if (b < nb) {
                const uint8_t* blk = r + (size_t)b * 34;
                d[k] = half_at(blk, 0);
                q0[k] = load_u16x2(blk + 2 + part * 8);
                q1[k] = load_u16x2(blk + 2 + part * 8 + 4);
            } else {
                d[k] = 0.f;
                q0[k] = q1[k] = 0;
            }
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int b = b0 + 8 * k + (lane >> 2);
            if (b < nb) {
                float4 xa = *reinterpret_cast<const float4*>(xs + b * 32 + part * 8), xb = *reinterpret_cast<const float4*>(xs + b * 32 + part * 8 + 4);
                float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < 4; e++) s += (float)(int8_t)(q0[k] >> (8 * e)) * xv[e] + (float)(int8_t)(q1[k] >> (8 * e)) * xv[4 + e];
                acc += d[k] * s;
            }
        }
    }
    return warp_sum(acc);
}

// The 6-bit scale and min of sub-block j (0..7) from a K-quant's 12 packed bytes (3 words). The
// words are picked by j's half and the byte by shifts: indexing them with a lane-dependent j
// would put them in local memory.
__device__ __forceinline__ void scale_min_k4(int j, const uint32_t* q, float* sc, float* m) {
    int shift = 8 * (j & 3);
    uint32_t b0 = (q[0] >> shift) & 0xFF, b1 = (q[1] >> shift) & 0xFF, b2 = (q[2] >> shift) & 0xFF;
    if (j < 4) {
        *sc = (float)(b0 & 63);
        *m = (float)(b1 & 63);
    } else {
        *sc = (float)((b2 & 0xF) | ((b0 >> 6) << 4));
        *m = (float)((b2 >> 4) | ((b1 >> 6) << 4));
    }
}

// Q4_K: 144-byte blocks of 256 values: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes
// of nibbles (four groups of 32 bytes: low nibbles are values 64g..64g+31, high 64g+32..64g+63).
// Eight lanes per block, 16 nibble bytes each; 4 blocks per step, 6 / R steps per round, R rows
// at once (their loads in flight together, each x value read once for all R). `xp` is the input
// in `q4k_order`, so each lane's 32 values are 8 float4 that its neighbours' interleave with (no
// shared-memory bank conflicts); `xsum` holds the sums of each 16 consecutive input values (the
// mins' term needs only those).
//
// A nibble becomes a float without an integer conversion (a quarter-rate instruction): masked in place under the exponent of 2^e whose last mantissa bit it fills, it
// reads as 2^e + n exactly, and one subtraction leaves n.
// (The mask and the exponent go in as registers so that `(w & mask) | pow2` is one LOP3: an
// instruction takes only one immediate, and the compiler would split it in two.)
__device__ __forceinline__ float nibble(uint32_t w, uint32_t mask, uint32_t pow2) {
    uint32_t bits;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(bits) : "r"(w), "r"(mask), "r"(pow2));
    return __uint_as_float(bits) - __uint_as_float(pow2);
}
#define P23 0x4B000000u  // 2^23: a nibble in bits 0..3
#define P19 0x49000000u  // bits 4..7
#define P15 0x47000000u  // bits 8..11
#define P11 0x45000000u  // bits 12..15

template <int R>
__device__ __forceinline__ void dot_q4_k(const uint8_t* const* rows, int cols, const float* xp, const float* xsum, float* out) {
    constexpr int STEPS = 6 / R;  // 8 / R spills registers
    int lane = threadIdx.x & 31;
    int nb = cols >> 8;
    int sub = lane & 7, g = sub >> 1, h = sub & 1;
    float acc[R];
#pragma unroll
    for (int k = 0; k < R; k++) acc[k] = 0.f;
    for (int b0 = 0; b0 < nb; b0 += 4 * STEPS) {
        // Each lane loads one word of its block's 16-byte head (d and dmin, then the 12 scale
        // bytes) and takes the others from its neighbours: 1 register a block, not 4.
        uint4 q[STEPS][R];
        uint32_t head[STEPS][R];
#pragma unroll
        for (int k = 0; k < STEPS; k++) {
            int b = b0 + 4 * k + (lane >> 3);
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                if (b < nb) {
                    const uint8_t* blk = rows[rr] + (size_t)b * 144;
                    q[k][rr] = __ldg(reinterpret_cast<const uint4*>(blk + 16 + 32 * g + 16 * h));
                    head[k][rr] = __ldg(reinterpret_cast<const uint32_t*>(blk) + (sub & 3));
                } else {
                    q[k][rr] = make_uint4(0, 0, 0, 0);
                    head[k][rr] = 0;
                }
            }
        }
#pragma unroll
        for (int k = 0; k < STEPS; k++) {
            int b = b0 + 4 * k + (lane >> 3);
            uint32_t hws[R][4];
#pragma unroll
            for (int rr = 0; rr < R; rr++)
#pragma unroll
                for (int i = 0; i < 4; i++) hws[rr][i] = __shfl_sync(0xffffffffu, head[k][rr], (lane & ~7) | i);
            if (b < nb) {
                const float4* xv = reinterpret_cast<const float4*>(xp + b * 256) + sub;
                float slo = xsum[b * 16 + 4 * g + h], shi = xsum[b * 16 + 4 * g + 2 + h];
                float qlo[R], qhi[R];
#pragma unroll
                for (int rr = 0; rr < R; rr++) qlo[rr] = qhi[rr] = 0.f;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float4 xl = xv[i * 8], xh = xv[(i + 4) * 8];
#pragma unroll
                    for (int rr = 0; rr < R; rr++) {
                        uint32_t w = reinterpret_cast<const uint32_t*>(&q[k][rr])[i], w16 = w >> 16;
                        qlo[rr] = fmaf(nibble(w, 0xF, P23), xl.x, qlo[rr]);
                        qlo[rr] = fmaf(nibble(w, 0xF00, P15), xl.y, qlo[rr]);
                        qlo[rr] = fmaf(nibble(w16, 0xF, P23), xl.z, qlo[rr]);
                        qlo[rr] = fmaf(nibble(w16, 0xF00, P15), xl.w, qlo[rr]);
                        qhi[rr] = fmaf(nibble(w, 0xF0, P19), xh.x, qhi[rr]);
                        qhi[rr] = fmaf(nibble(w, 0xF000, P11), xh.y, qhi[rr]);
                        qhi[rr] = fmaf(nibble(w16, 0xF0, P19), xh.z, qhi[rr]);
                        qhi[rr] = fmaf(nibble(w16, 0xF000, P11), xh.w, qhi[rr]);
                    }
                }
#pragma unroll
                for (int rr = 0; rr < R; rr++) {
                    const uint32_t* hw = hws[rr];
                    float2 d = __half22float2(*reinterpret_cast<const __half2*>(&hw[0]));
                    float sc0, m0, sc1, m1;
                    scale_min_k4(2 * g, hw + 1, &sc0, &m0);
                    scale_min_k4(2 * g + 1, hw + 1, &sc1, &m1);
                    acc[rr] += d.x * (sc0 * qlo[rr] + sc1 * qhi[rr]) - d.y * (m0 * slo + m1 * shi);
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) out[rr] = warp_sum(acc[rr]);
}

// Where input value v (0..255) of a block goes in `dot_q4_k`'s order: lane `sub` = 2g + h reads
// its i-th float4 (i < 4: low nibbles, else high) at (8i + sub) * 4.
__device__ __forceinline__ int q4k_order(int v) {
    int g = v >> 6, rem = v & 63, hi = rem >> 5, t = rem & 31, h = t >> 4, e = t & 15;
    return ((hi * 4 + (e >> 2)) * 8 + 2 * g + h) * 4 + (e & 3);
}

// Q6_K: 210-byte blocks of 256 values: 128 bytes of low nibbles (ql), 64 bytes of high bit pairs
// (qh), 16 int8 scales, f16 d. Sixteen lanes per block (16 values each), 2 blocks per step,
// 4 steps per round. Blocks are only 2-byte aligned, so loads are 16-bit.
//
// No integer-to-float conversion (a quarter-rate instruction; with one a value the LM head of a
// 7B Q4_K_M model was bound by it, not by memory): each lane's four words of 6-bit values are
// assembled four values at a time, and a `prmt` puts one value's byte under the exponent of
// 2^23 (`byte_float`), as `nibble` does for Q4_K. The int8 scales go the same way, offset by 128.
__device__ __forceinline__ float byte_float(uint32_t w, int c, float bias) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | c)) - bias;  // (2^23 + byte c) - bias
}

// One step of a lane's Q6_K loads: blocks b0 + 2k + lane / 16 for k < 4 (16 lanes a block,
// 2 blocks a step), each lane's 16 values of a block as two words of low nibbles, one of high
// bit pairs, its four scales and the block's d (zero past the row's end).
struct Q6Step {
    uint32_t qa[4], qb[4], qh[4], scw[4];
    float d[4];
};
__device__ __forceinline__ void q6k_load(const uint8_t* r, int nb, int b0, Q6Step& st) {
    int lane = threadIdx.x & 31, s = lane & 15, n = s >> 3, l0 = (s & 7) * 4;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int b = b0 + 2 * k + (lane >> 4);
        if (b < nb) {
            const uint8_t* blk = r + (size_t)b * 210;
            st.qa[k] = load_u16x2(blk + 64 * n + l0);
            st.qb[k] = load_u16x2(blk + 64 * n + l0 + 32);
            st.qh[k] = load_u16x2(blk + 128 + 32 * n + l0);
            // Scales 8n + l0/16 + {0, 2, 4, 6}: bytes 0, 2, 4, 6 of these 8.
            const uint8_t* sp = blk + 192 + 8 * n + l0 / 16;
            st.scw[k] = (uint32_t)__ldg(sp) | ((uint32_t)__ldg(sp + 2) << 8) | ((uint32_t)__ldg(sp + 4) << 16) | ((uint32_t)__ldg(sp + 6) << 24);
            st.d[k] = half_at(blk, 208);
        } else {
            st.qa[k] = st.qb[k] = st.qh[k] = st.scw[k] = 0;
            st.d[k] = 0.f;
        }
    }
}
// Four bytes of low nibbles at l (qa) and at l + 32 (qb) and of high bit pairs (h) as the values
// l + c + {0, 32, 64, 96} of a block's half (c = 0..3), stored + 32, four to a word.
__device__ __forceinline__ void q6k_words(uint32_t qa, uint32_t qb, uint32_t h, uint32_t* q) {
    q[0] = (qa & 0x0F0F0F0Fu) | ((h << 4) & 0x30303030u);
    q[1] = (qb & 0x0F0F0F0Fu) | ((h << 2) & 0x30303030u);
    q[2] = ((qa >> 4) & 0x0F0F0F0Fu) | (h & 0x30303030u);
    q[3] = ((qb >> 4) & 0x0F0F0F0Fu) | ((h >> 2) & 0x30303030u);
}

// A lane's walk over R rows' Q6_K blocks, their loads in flight together: `block_sum(b, q, sc,
// sums)` gives the lane's sum for block b of each row from its words of values (`q[rr]`,
// `q6k_words`) and the block's int8 scales + 128 as unsigned bytes (`sc[rr]`); each is scaled
// here by its block's d.
template <int R, typename BlockSum>
__device__ __forceinline__ void q6k_dot(const uint8_t* const* rows, int cols, float* out, BlockSum block_sum) {
    int lane = threadIdx.x & 31, nb = cols >> 8;
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.f;
    for (int b0 = 0; b0 < nb; b0 += 8) {
        Q6Step st[R];
#pragma unroll
        for (int rr = 0; rr < R; rr++) q6k_load(rows[rr], nb, b0, st[rr]);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int b = b0 + 2 * k + (lane >> 4);
            if (b < nb) {
                uint32_t q[R][4], sc[R];
                float sums[R];
#pragma unroll
                for (int rr = 0; rr < R; rr++) {
                    q6k_words(st[rr].qa[k], st[rr].qb[k], st[rr].qh[k], q[rr]);
                    sc[rr] = st[rr].scw[k] ^ 0x80808080u;
                }
                block_sum(b, q, sc, sums);
#pragma unroll
                for (int rr = 0; rr < R; rr++) acc[rr] = fmaf(st[rr].d[k], sums[rr], acc[rr]);
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) out[rr] = warp_sum(acc[rr]);
}

__device__ float dot_q6_k(const uint8_t* r, int cols, const float* xs) {
    int s = threadIdx.x & 15, n = s >> 3, l0 = (s & 7) * 4;
    const float six_bit = 8388608.f + 32.f, scale_byte = 8388608.f + 128.f;
    float y;
    q6k_dot<1>(&r, cols, &y, [&](int b, const uint32_t (*q)[4], const uint32_t* sc, float* sums) {
        const float* xp = xs + b * 256 + 128 * n + l0;
        const float4 xv[4] = {*reinterpret_cast<const float4*>(xp), *reinterpret_cast<const float4*>(xp + 32),
                              *reinterpret_cast<const float4*>(xp + 64), *reinterpret_cast<const float4*>(xp + 96)};
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float part = byte_float(q[0][j], 0, six_bit) * xv[j].x;
            part = fmaf(byte_float(q[0][j], 1, six_bit), xv[j].y, part);
            part = fmaf(byte_float(q[0][j], 2, six_bit), xv[j].z, part);
            part = fmaf(byte_float(q[0][j], 3, six_bit), xv[j].w, part);
            sum = fmaf(byte_float(sc[0], j, scale_byte), part, sum);
        }
        sums[0] = sum;
    });
    return y;
}

// A lane's walk over its steps of quantized rows (PER blocks a step, from block b), two at a
// time, both loaded before either is used. Every lane of the warp makes the same passes (a lane
// whose row ends a step earlier skips that step), so the warp never runs a last step for some
// lanes after the others' pairs. `advance(2)` moves b (and the walk's pointers) on by two steps.
template <typename Loads, int PER = 4, typename Load, typename Use, typename Advance>
__device__ __forceinline__ void two_steps_at_a_time(const int& b, int nb, Load load, Use use, Advance advance) {
    for (int warp_b = b - (threadIdx.x & 31) / (32 / PER); warp_b < nb; warp_b += 2 * PER, advance(2)) {
        bool has0 = b < nb, has1 = b + PER < nb;
        Loads l0, l1;
        if (has0) load(0, l0);
        if (has1) load(1, l1);
        if (has0) use(0, l0);
        if (has1) use(1, l1);
    }
}

// The same one step at a time (for walks whose loads of one step already fill the registers).
template <typename Loads, int PER = 4, typename Load, typename Use, typename Advance>
__device__ __forceinline__ void one_step_at_a_time(const int& b, int nb, Load load, Use use, Advance advance) {
    for (int warp_b = b - (threadIdx.x & 31) / (32 / PER); warp_b < nb; warp_b += PER, advance(1)) {
        if (b < nb) {
            Loads l;
            load(0, l);
            use(0, l);
        }
    }
}

// One block of a lane's Q6_K row in `dot_q6_k_q8`: its 8 low-nibble bytes at l0 and at l0 + 32
// (qa, qb), 8 high-bit-pair bytes (qh), the 8 scales of its half (sc) and d.
struct Q6Loads {
    uint32_t qa[2], qb[2], qh[2], sc[2];
    float d;
};

// One step of `dot_q6_k_q8`'s loads for R rows: the lane's 8 bytes of each field of the block at
// p[rr] (its low nibbles at word qa_w and 8 words on, high bit pairs at qh_w, scales at sc_w) and
// its d. Q6_K blocks are only 2-byte aligned: each 8 bytes come as aligned words (three where
// the block starts off a word, else two) and two funnel shifts. (The third word only where the
// block starts 2 bytes past a word: for an aligned last block of a tensor, the scales' third word
// would lie past its end.)
template <int R>
__device__ __forceinline__ void q6k_load_words(const uint8_t* const* p, int qa_w, int qh_w, int sc_w, Q6Loads* l) {
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const uint32_t* w = reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(p[rr]) & ~(uintptr_t)3);
        uint32_t shift = (uint32_t)(reinterpret_cast<uintptr_t>(p[rr]) & 2) * 8;
        auto eight = [&](int at, uint32_t* out2) {
            uint32_t w0 = __ldg(w + at), w1 = __ldg(w + at + 1), w2 = shift ? __ldg(w + at + 2) : 0u;
            out2[0] = __funnelshift_r(w0, w1, shift);
            out2[1] = __funnelshift_r(w1, w2, shift);
        };
        eight(qa_w, l[rr].qa);
        eight(qa_w + 8, l[rr].qb);
        eight(qh_w, l[rr].qh);
        eight(sc_w, l[rr].sc);
        l[rr].d = half_at(p[rr], 208);
    }
}

// One step of `dot_q6_k_q8`'s products for R rows, added into acc: the lane's loads `l` against
// its int8 inputs from `xp` (8 of each of four 32-value groups, 32 apart) and their groups' scales
// `dp`. Each word of four 6-bit values (`q6k_words`) meets four input bytes in one `dp4a`, chained
// over the group's two words from minus 32 times the inputs' sum (the values' offset; once for
// all R rows); `sc_pick` selects the lane's four scales of the eight loaded.
template <int R>
__device__ __forceinline__ void q6k_use(const Q6Loads* l, const int8_t* xp, const float* dp, uint32_t sc_pick, float* acc) {
    const float scale_byte = 8388608.f + 128.f;
    int2 xw[4];
    int start[4];
    float dxj[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        xw[j] = *reinterpret_cast<const int2*>(xp + 32 * j);
        start[j] = -32 * __dp4a(0x01010101, xw[j].y, __dp4a(0x01010101, xw[j].x, 0));
        dxj[j] = dp[j];
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        uint32_t q0[4], q1[4];
        q6k_words(l[rr].qa[0], l[rr].qb[0], l[rr].qh[0], q0);
        q6k_words(l[rr].qa[1], l[rr].qb[1], l[rr].qh[1], q1);
        uint32_t sc = __byte_perm(l[rr].sc[0], l[rr].sc[1], sc_pick) ^ 0x80808080u;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int v = __dp4a((int)q1[j], xw[j].y, __dp4a((int)q0[j], xw[j].x, start[j]));  // |v| < 2^16
            float f = __int_as_float(v + 0x4B400000) - 12582912.f;  // exact for |v| < 2^22
            sum = fmaf(byte_float(sc, j, scale_byte) * dxj[j], f, sum);
        }
        acc[rr] = fmaf(l[rr].d, sum, acc[rr]);
    }
}

// R Q6_K rows · int8 activations (`x8`, one scale `dx` per 32 values). Eight lanes a block, four
// blocks a step: lane (n, l0) takes l0 .. l0 + 7 of each of the four 32-value groups of its half
// n (all under one scale each), so a block's scales and d are loaded once per 32 values
// (`q6k_load_words`, `q6k_use`). Like the Q4_K kernel this one is bound by instruction issue;
// steps go two at a time (`two_steps_at_a_time`).
template <int R>
__device__ __forceinline__ void dot_q6_k_q8(const uint8_t* const* rows, int cols, const int8_t* x8, const float* dx, float* out) {
    int lane = threadIdx.x & 31, sub = lane & 7, n = sub >> 2, l0 = (sub & 3) * 8, c = (sub & 3) >> 1;
    const int qa_w = (64 * n + l0) / 4, qh_w = (128 + 32 * n + l0) / 4, sc_w = (192 + 8 * n) / 4;
    const uint32_t sc_pick = c | (c + 2) << 4 | (c + 4) << 8 | (c + 6) << 12;  // scales l0 / 16 + {0, 2, 4, 6}
    int nb = cols >> 8, b = lane >> 3;
    const uint8_t* blk[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) blk[rr] = rows[rr] + (size_t)b * 210;
    const int8_t* xb = x8 + b * 256 + 128 * n + l0;
    const float* db = dx + b * 8 + 4 * n;
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.f;
    auto load = [&](int step, Q6Loads* l) {
        const uint8_t* p[R];
#pragma unroll
        for (int rr = 0; rr < R; rr++) p[rr] = blk[rr] + step * 840;
        q6k_load_words<R>(p, qa_w, qh_w, sc_w, l);
    };
    auto use = [&](int step, const Q6Loads* l) { q6k_use<R>(l, xb + step * 1024, db + step * 32, sc_pick, acc); };
    auto advance = [&](int steps) {
#pragma unroll
        for (int rr = 0; rr < R; rr++) blk[rr] += steps * 840;
        xb += steps * 1024;
        db += steps * 32;
        b += steps * 4;
    };
    // Four rows a warp one step at a time: as many loads in flight as two rows two steps at a
    // time, and each step's input loads serve four rows.
    if constexpr (R >= 4) one_step_at_a_time<Q6Loads[R]>(b, nb, load, use, advance);
    else two_steps_at_a_time<Q6Loads[R]>(b, nb, load, use, advance);
#pragma unroll
    for (int rr = 0; rr < R; rr++) out[rr] = warp_sum(acc[rr]);
}

// Bytes that `n` values of one row take in `fmt` (n a whole number of blocks).
__host__ __device__ __forceinline__ size_t fmt_bytes(int fmt, size_t n) {
    switch (fmt) {
        case FMT_F32: return n * 4;
        case FMT_F16:
        case FMT_BF16: return n * 2;
        case FMT_Q8_0: return n / 32 * 34;
        case FMT_Q4_K: return n / 256 * 144;
        default: return n / 256 * 210;
    }
}

// The start of row `row` of a matrix `cols` wide, from input value k0 on.
__device__ __forceinline__ const uint8_t* row_at(const void* w, int fmt, int row, int cols, int k0) {
    return reinterpret_cast<const uint8_t*>(w) + fmt_bytes(fmt, (size_t)row * cols) + fmt_bytes(fmt, k0);
}

// The staged input of one `mv` block: as loaded (and normed), and for Q4_K rows in
// `q4k_order` with the sums of each 16 values, or (`q4k` = 2) as int8 (`x8`, one scale `dx` per
// 32 values) with the sums of each 16 int8 values times their scale (`xsum`).
struct Staged {
    const float* xs;
    const float* xp;
    const float* xsum;
    const int8_t* x8;
    const float* dx;
    unsigned tag;  // the step's tag (`load_tagged`), read before the wait; 0 where unused
};

// What every product with a block's staged input is multiplied by where `stage_input` folds
// RMSNorm's 1/rms into the results: that, or 1. A copy a warp in shared memory, written and read
// by its lane 0 (`staged_scale`), not a register held across the products.
__shared__ float staged_scales[32];
__device__ __forceinline__ float staged_scale() { return staged_scales[threadIdx.x >> 5]; }

// Row `row` of a matrix `cols` wide, values [k0, k0 + n), · the staged input. F: the format
// every matrix of the kernel instance has (the switch folds away), or FMT_ANY (`fmt` decides).
template <int F>
__device__ __forceinline__ float dot_row(const void* w, int fmt, int row, int cols, int k0, int n, Staged in) {
    int f = F == FMT_ANY ? fmt : F;
    const uint8_t* r = row_at(w, f, row, cols, k0);
    float y;
    switch (f) {
        case FMT_F32: return dot_f32(r, n, in.xs);
        case FMT_F16: dot_half<FMT_F16, 1>(&r, n, in.xs, &y); return y;
        case FMT_BF16: dot_half<FMT_BF16, 1>(&r, n, in.xs, &y); return y;
        case FMT_Q8_0: return dot_q8_0(r, n, in.xs);
        case FMT_Q4_K: dot_q4_k<1>(&r, n, in.xp, in.xsum, &y); return y;
        default: return dot_q6_k(r, n, in.xs);
    }
}

// Segment of stacked row `r` (rows of seg[0], then seg[1], then seg[2]); `r` becomes its row there.
__device__ __forceinline__ Seg seg_of_row(const MvArgs& a, int* r) {
    Seg sg = a.seg[0];
    if (a.nseg > 1 && *r >= sg.rows) {
        *r -= sg.rows;
        sg = a.seg[1];
        if (a.nseg > 2 && *r >= sg.rows) {
            *r -= sg.rows;
            sg = a.seg[2];
        }
    }
    return sg;
}

// Pulls the first 2 KB of `bytes` from `p` on into L2, the warp's lanes taking alternate
// 128-byte lines. (Whole first rows, tens of MB over a grid, evicted each other.)
__device__ __forceinline__ void prefetch_l2(const uint8_t* p, size_t bytes, int lane) {
    const uint8_t* end = p + min(bytes, (size_t)2048);
    for (const uint8_t* q = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)127) + lane * 128; q < end; q += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(q));
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ float gelu_tanh(float g) {
    return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// Stores output row r (a stored launch's, not one added into the residual).
__device__ __forceinline__ void store_out(const MvArgs& a, int r, float y, unsigned tag) {
    if (a.tag_out) store_tagged(a.out, r, y, tag);
    else a.out[r] = y;
}

// xf (n values, f32, a multiple of 128) as int8 with one scale per 32 values (`dx`), and the
// sums of each 16 of the int8 values times their scale (`xsum`): the mins' term of Q4_K must see
// the same inputs as the nibbles' (with exact sums, the rounding of the inputs no longer cancels
// between the two terms and the error grows with the nibbles' mean, as in llama.cpp's q8_1
// blocks). A lane takes 4 values, so a warp quantizes 128 (four scales' worth) at a time. The
// caller synchronizes the block before reading the results.
// `scale`: what the scales (and so the sums) are multiplied by; the int8 values do not depend on it.
__device__ void quantize_q8(const float* xf, int n, int8_t* x8, float* dx, float* xsum, float scale = 1.f) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int j = 128 * warp + 4 * lane; j < n; j += 128 * warps) {
        float4 v = *reinterpret_cast<const float4*>(xf + j);
        float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));  // the 8 lanes of a scale
        float d = amax / 127.f * scale, inv = amax > 0.f ? 127.f / amax : 0.f;
        int q0 = __float2int_rn(v.x * inv), q1 = __float2int_rn(v.y * inv), q2 = __float2int_rn(v.z * inv), q3 = __float2int_rn(v.w * inv);
        *reinterpret_cast<char4*>(x8 + j) = make_char4((signed char)q0, (signed char)q1, (signed char)q2, (signed char)q3);
        int sum = q0 + q1 + q2 + q3;
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);  // the 4 lanes of 16 values
        if ((lane & 3) == 0) xsum[j / 16] = d * (float)sum;
        if ((lane & 7) == 0) dx[j / 32] = d;
    }
}

// Whether a launch's input is RMSNormed where it is staged (tagged inputs are gate/up's and
// attention's outputs, never normed).
__device__ __forceinline__ bool normed_input(const MvArgs& a) { return a.norm_w && !a.tag_in; }

// Where an int8 instance's staged input goes: `stage_q8`'s places, or the gate/up ring's.
struct Q8Dest {
    int8_t* x8;
    float* dx;
    float* xsum;
};

// One warp: the 32 values v (a lane each) from value `at` of a vector of n (at a multiple of 32)
// as `quantize_q8` makes them, stored as tagged words for an int8 consumer that reads them
// whole (`tag_in` = 2): its int8 values four a word (words [0, n/4)), then the scales (n/32
// words), then the sums of 16 (n/16 words), as `stage_q8` lays them out in shared memory. The
// same arithmetic as `quantize_q8`: the consumer's products are those of quantizing there.
__device__ void store_q8_tagged(float* out, int n, int at, float v, unsigned tag) {
    int lane = threadIdx.x & 31;
    float amax = fabsf(v);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int q = __float2int_rn(v * inv);
    uint32_t b = (uint32_t)q & 0xFFu;
    uint32_t word = b | __shfl_down_sync(0xffffffffu, b, 1) << 8 | __shfl_down_sync(0xffffffffu, b, 2) << 16 | __shfl_down_sync(0xffffffffu, b, 3) << 24;
    int sum = q;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if ((lane & 3) == 0) store_tagged(out, (at + lane) / 4, __uint_as_float(word), tag);
    if (lane == 0) store_tagged(out, n / 4 + at / 32, d, tag);
    if ((lane & 15) == 0) store_tagged(out, n / 4 + n / 32 + (at + lane) / 16, d * (float)sum, tag);
}

// Stages one `mv` block's input (values [k0, k0 + kn), RMSNormed first when `norm_w` is set)
// in shared memory, and for the f32 Q4_K instances (`q4k` = 1) also in `q4k_order` with the sums
// of each 16 values. FOLD: a normed input is staged as x·w, and RMSNorm's 1/rms is left for the
// caller to multiply each product by (`staged_scale`): no second pass over the staged values and
// no barrier after it. One H200 (session 61, three alternating rounds, the same greedy tokens):
// 1.5B f16 905.4 -> 910.1 tok/s, 7B f16 276.3 -> 277.5 (faster in every round).
//
// Q8 (int8 instances): a normed input is quantized into `q8` here, after the block sum, as x·w
// with 1/rms multiplied into its scales (the same int8 values as x·w·(1/rms)), in place of a pass
// multiplying the staged values by 1/rms and a barrier before `quantize_q8`; `normed_input` tells
// the caller. Other inputs are staged as f32 for the caller to quantize. One H200 (session 68,
// six alternating rounds over two calls): 7B Q4_K_M 547.0 -> 556.0 tok/s (+1.6%; faster in every
// round), 1.5B Q4_K_M 1,147.0 -> 1,137.5 (-0.8%, within its rounds' spread of 1,123-1,161).
// Quantized inside the load loop instead (before the block sum, session 61), the kernels' main
// loops spilled and the 1.5B Q4_K_M ran 2.3% slower.
//
// Before it waits for the previous kernel, each warp pulls the start of its first rows, which
// depend on nothing, into L2.
template <bool FOLD = false, bool Q8 = false>
__device__ Staged stage_input(const MvArgs& a, int k0, int kn, bool gated, int first, int total, float* xs, Q8Dest q8 = Q8Dest{}) {
    __shared__ float scratch[32];
    int lane = threadIdx.x & 31;
    allow_next_kernel();
    // Written before the step's first kernel: read now, off the path from input to output.
    unsigned tag = a.tag_in || a.tag_out || a.partial ? (unsigned)*a.tag : 0u;
    if (first < total) {
        if (gated) {
            prefetch_l2(row_at(a.seg[0].w, a.seg[0].fmt, first, a.cols, 0), fmt_bytes(a.seg[0].fmt, a.cols), lane);
            prefetch_l2(row_at(a.seg[1].w, a.seg[1].fmt, first, a.cols, 0), fmt_bytes(a.seg[1].fmt, a.cols), lane);
        } else {
            int lr = first;
            Seg sg = seg_of_row(a, &lr);
            prefetch_l2(row_at(sg.w, sg.fmt, lr, a.cols, k0), fmt_bytes(sg.fmt, kn), lane);
        }
    }
    // Read-ahead: this block's share of `ahead_bytes` of each of two matrices that a later
    // launch reads (gate/up's first rows, or a large 16-bit pair's last: `read_ahead` in
    // cuda_plan.rs; set on o), pulled into L2 after this block's own rows went out: HBM idles
    // while the launches from q/k/v to o wait on each other's results. A few MB: more was slower
    // (sessions 41 and 74; the log has the figures).
    if (a.ahead_bytes > 0) {
        long long blocks = (long long)gridDim.x * gridDim.y, b = (long long)blockIdx.y * gridDim.x + blockIdx.x;
        long long lines = (a.ahead_bytes + 127) >> 7, per = (lines + blocks - 1) / blocks, end = min(lines, (b + 1) * per);
        for (long long l = b * per + threadIdx.x; l < end; l += blockDim.x) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(a.ahead[0] + (l << 7)));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(a.ahead[1] + (l << 7)));
        }
    }
    // The norm weights of this block's slice depend on no kernel: they go to xs before the wait,
    // each thread loading the values it will multiply (so no barrier is needed in between).
    // Four values a load (rows are whole 4-value blocks; k0 and kn are multiples of 256).
    bool normed = normed_input(a);
    if (normed) {
        const float4* w4 = reinterpret_cast<const float4*>(a.norm_w);
        for (int j = threadIdx.x; j < a.cols / 4; j += blockDim.x) {
            unsigned i = (unsigned)(4 * j - k0);
            if (i < (unsigned)kn) *reinterpret_cast<float4*>(xs + i) = w4[j];
        }
    }
    if (!a.tag_in) wait_for_previous_kernel();
    trace_mark(a.trace, &trace_waited);
    float scale = 1.f;
    if (a.tag_in == 2) {
        // Already int8 (`store_q8_tagged`; the launch is not split): into `stage_q8`'s places.
        load_tagged(a.x, kn / 4 + kn / 32 + kn / 16, tag, xs + kn);
    } else if (a.tag_in) {
        load_tagged(a.x + 2 * k0, kn, tag, xs);
    } else if (normed) {
        // One round of loads: x over the whole row (the norm takes all of it, also for a
        // split-K slice); xs holds x·w until the row's scale is known.
        float ss = 0.f;
        const float4* x4 = reinterpret_cast<const float4*>(a.x);
#pragma unroll 4
        for (int j = threadIdx.x; j < a.cols / 4; j += blockDim.x) {
            float4 v = x4[j];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            unsigned i = (unsigned)(4 * j - k0);
            if (i < (unsigned)kn) {
                float4 w = *reinterpret_cast<const float4*>(xs + i);
                *reinterpret_cast<float4*>(xs + i) = make_float4(v.x * w.x, v.y * w.y, v.z * w.z, v.w * w.w);
            }
        }
        ss = block_sum(ss, scratch, true);  // its barrier also publishes xs
        float rinv = rsqrtf(ss / (float)a.cols + a.eps);
        if (Q8) quantize_q8(xs, kn, q8.x8, q8.dx, q8.xsum, rinv);
        else if (FOLD) scale = rinv;
        else
            for (int j = threadIdx.x; j < kn; j += blockDim.x) xs[j] *= rinv;
    } else {
#pragma unroll 8
        for (int j = threadIdx.x; j < kn; j += blockDim.x) xs[j] = a.x[k0 + j];
    }
    if (!(FOLD && normed)) __syncthreads();  // (folded, the block sum's barriers published xs)
    if (FOLD && (threadIdx.x & 31) == 0) staged_scales[threadIdx.x >> 5] = scale;
    float* xp = xs + kn;
    float* xsum = xp + kn;
    if (a.q4k == 1) {  // (2: the int8 instances quantize the input themselves, `stage_q8`)
        for (int j = threadIdx.x; j < kn; j += blockDim.x) xp[(j & ~255) + q4k_order(j & 255)] = xs[j];
        for (int t = threadIdx.x; t < kn / 16; t += blockDim.x) {
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 16; j++) sum += xs[16 * t + ((j + t) & 15)];  // rotated: no bank conflicts
            xsum[t] = sum;
        }
        __syncthreads();
    }
    trace_mark(a.trace, &trace_ready);
    return Staged{xs, xp, xsum, nullptr, nullptr, tag};
}

// Where a lane's values lie in a Q4_K block for `dot_q4_k_q8`: 4 lanes a block, 8 blocks a step;
// lane g of a block takes sub-blocks 2g and 2g + 1 whole (the 32 bytes whose low nibbles are
// 2g's values and high nibbles 2g + 1's), so its scales and mins are cut once per 64 values.
// Its inputs come in a lane-dependent order (`first_hi`: sub-block 2g + 1's first, for g >= 2),
// so that the 16-byte loads of a quarter warp fall on distinct bank pairs but for a 2-way
// conflict (without it, 4-way: every lane's input lies 0 or 64 bytes past a multiple of 128).
constexpr int Q4_PER_STEP = 8;  // blocks a step, 4 lanes each
struct Q4Lane {
    int blk;                       // the lane's block within a step
    int qoff, xoff, dxoff, soff;   // the lane's 32 nibble bytes in a block, its first inputs, their scale, their sums
    int other;                     // from the first inputs (and their scale) to the second: 32 (1) or -32 (-1)
    uint32_t shift;                // 8 * (j & 3) for the lane's sub-blocks j = 2g, 2g + 1
    uint32_t low_mask, high_mask;  // sub-blocks 0-3: 6 bits from bytes 0-3; 4-7: 4 bits from 8-11 and 2 from 0-7
    bool upper;                    // sub-blocks 4-7
    uint32_t mask_a, mask_b;       // the nibbles met first (a) and second (b)
    uint32_t pick_a, pick_b;       // `__byte_perm` selectors of their scales (byte 0 or 1 of the pair)
    float dx_a, dx_b;              // their inputs' scale factors (1/16 for high nibbles, summed in place)
};

__device__ __forceinline__ Q4Lane q4k_lane() {
    int lane = threadIdx.x & 31, g = lane & 3;
    bool upper = g >= 2, first_hi = upper;
    return Q4Lane{lane >> 2, 16 + 32 * g, 64 * g + (first_hi ? 32 : 0), 2 * g + first_hi, 4 * g, first_hi ? -32 : 32, (uint32_t)(16 * (g & 1)),
                  upper ? 0x0F0Fu : 0x3F3Fu, upper ? 0x3030u : 0u, upper,
                  first_hi ? 0xF0F0F0F0u : 0x0F0F0F0Fu, first_hi ? 0x0F0F0F0Fu : 0xF0F0F0F0u,
                  first_hi ? 0x4441u : 0x4440u, first_hi ? 0x4440u : 0x4441u,
                  first_hi ? 0.0625f : 1.f, first_hi ? 1.f : 0.0625f};
}

// One step of `dot_q4_k_q8`'s loads for R rows: the header of block `blk[rr]` and this lane's
// 32 nibble bytes of it.
struct Q4Loads {
    uint4 hw[2], q[2][2];
};

template <int R>
__device__ __forceinline__ void q4k_load(const Q4Lane& ln, const uint8_t* const* blk, Q4Loads& l) {
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        l.hw[rr] = *reinterpret_cast<const uint4*>(blk[rr]);
        l.q[rr][0] = *reinterpret_cast<const uint4*>(blk[rr] + ln.qoff);
        l.q[rr][1] = *reinterpret_cast<const uint4*>(blk[rr] + ln.qoff + 16);
    }
}

template <int R, bool ONE_STEP = false>
__device__ __forceinline__ void dot_q4_k_q8(const uint8_t* const* rows, int cols, const int8_t* x8, const float* dx, const float* xsum, float* out, bool preloaded = false, const Q4Loads& first = Q4Loads{});

// The staged input of an int8 instance (`q4k` = 2): `in.xs` quantized into the space of the
// reordered copy that f32 Q4_K instances use (kn + kn / 8 + kn / 4 of its 4 kn bytes): the int8
// values (kn bytes), their scales (kn / 32 f32), then the sums of 16 (kn / 16 f32). With `tag_in`
// = 2 the producer quantized them and `stage_input` put them there; a normed input
// `stage_input<FOLD, true>` quantized there itself (`normed_input`).
__device__ __forceinline__ Q8Dest q8_places(float* xs, int kn) {
    int8_t* x8 = reinterpret_cast<int8_t*>(xs + kn);
    float* dx = reinterpret_cast<float*>(x8 + kn);
    return Q8Dest{x8, dx, dx + kn / 32};
}

__device__ __forceinline__ void stage_q8(const MvArgs& a, Staged& in, int kn) {
    Q8Dest at = q8_places(const_cast<float*>(in.xs), kn);
    if (a.tag_in != 2 && !normed_input(a)) {
        quantize_q8(in.xs, kn, at.x8, at.dx, at.xsum);
        __syncthreads();
    }
    in.x8 = at.x8;
    in.dx = at.dx;
    in.xsum = at.xsum;
}

// The q-th of the rows an `mv` block (column) took: `span` (its warps' rows) a pass, passes
// gridDim.x spans apart; it grows with q.
__device__ __forceinline__ int block_row(int q, int span) {
    return blockIdx.x * span + q / span * gridDim.x * span + q % span;
}

// A logit and its row as one 64-bit key whose unsigned order is the argmax's: larger values
// first, then lower rows (the first of equal values wins); -0 counts as +0, and every key of a
// number is above 0, which no logit takes (NaN never wins).
__device__ __forceinline__ unsigned long long logit_key(float v, int r) {
    unsigned u = v == 0.f ? 0u : __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (0xFFFFFFFFu - (unsigned)r);
}

// Greedy decoding's pick fused into the LM head's launch, where a chained step asks for it
// (`a.pick`: the step's words [next, host, vocab], written before the step; next = 0: the host
// or `pick_token` picks): each block takes the largest of the logits its warps stored (the rows
// below `vocab` it took, `block_row`), folds it into one 64-bit
// atomic maximum, and the last block to finish writes the token where the next step's embedding
// reads it and into mapped host memory, as `pick_token` does, and leaves the scratch zeroed for
// the next step. Only for unsplit stored launches (one block row).
__device__ void pick_greedy(const MvArgs& a, int total, int span) {
    unsigned* next = reinterpret_cast<unsigned*>(a.pick[0]);
    if (next == nullptr) return;
    int vocab = min(total, (int)a.pick[2]);
    __shared__ unsigned long long block_best[32];
    __syncthreads();  // the block's logits are stored (and visible to the whole block)
    unsigned long long best = 0;
    for (int q = threadIdx.x;; q += blockDim.x) {
        int r = block_row(q, span);
        if (r >= vocab) break;
        float v = a.out[r];
        if (v == v) best = max(best, logit_key(v, r));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    if ((threadIdx.x & 31) == 0) block_best[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) best = max(best, block_best[w]);
    if (best) atomicMax(&a.pick_scratch[0], best);
    __threadfence();
    unsigned* done = reinterpret_cast<unsigned*>(&a.pick_scratch[1]);
    if (atomicAdd(done, 1u) != gridDim.x - 1) return;
    __threadfence();
    unsigned long long won = atomicExch(&a.pick_scratch[0], 0ull);
    *done = 0;
    unsigned id = won ? 0xFFFFFFFFu - (unsigned)won : 0u;  // only NaN: token 0, as `row_argmax`
    *next = id;
    *reinterpret_cast<volatile unsigned*>(a.pick[1]) = id;
}

// out (=|+=) W · norm(x) over up to three stacked matrices, one warp per output row. Long rows
// added into the residual, and those of short stored launches (q/k/v), are split over block rows
// (split-K): block row y takes input values [k0, k0 + kn) and stores its partial sums; the
// column's last block row adds them (to the output, or as it) in slice order, so that every run
// sums in the same order (atomic adds would not, and a seeded sampler would then draw
// differently from run to run).
// PAIRS (instances of their own for their registers): Q4_K or Q6_K rows two a warp.
// Q8: int8 activations (`q4k` = 2) for Q4_K and Q6_K rows (with FMT_ANY: matrices of both).
#define MV_MAX_WARPS 16  // the `mv` launches' 256 or 512 threads
// QUADS (Q6_K with int8 activations, `a.pairs` = 2): rows four a warp (`dot_q6_k_q8<4>`).
template <int F, bool PAIRS = false, bool Q8 = false, bool QUADS = false>
__device__ void mv_rows(const MvArgs& a) {
    static_assert(!PAIRS || F == FMT_Q4_K || F == FMT_Q6_K && Q8, "pairs: Q4_K rows, or Q6_K rows with int8 activations");
    extern __shared__ float4 xs4[];  // float4: 16-byte aligned for the vector loads
    int k0 = blockIdx.y * a.slice, kn = min(a.slice, a.cols - k0);
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    int first = blockIdx.x * warps + (threadIdx.x >> 5);
    int total = a.seg[0].rows + (a.nseg > 1 ? a.seg[1].rows : 0) + (a.nseg > 2 ? a.seg[2].rows : 0);
    // The row of a launch's q-th (in the order warps take them). Launches mixing formats (q/k/v
    // with a Q6_K v, one row a warp) move their last matrix's rows (v, the slower rows, with no
    // first step loaded before the wait) to just after the rows of the warps that take a second
    // row: those rows go to warps that take no other (the 7B's 4,608 rows over 4,224 warps: the
    // 384 second rows had been v's, after a first q row each), or to the first warps, which start
    // earliest, where no warp takes two (the 1.5B's 2,048). One H200 (session 54, three rounds):
    // 7B Q4_K_M 515.5 / 511.3 / 511.9 -> 518.7 / 518.5 / 518.9 tok/s, its q/k/v 9.4 -> 8.6 µs a
    // layer (10.3 -> 8.8 where v is Q6_K); the 1.5B Q4_K_M within its noise.
    int moved = F == FMT_ANY && Q8 ? a.seg[a.nseg - 1].rows : 0, at = min(max(0, total - (int)(gridDim.x * warps)), total - moved);
    auto walk = [&](int q) { return q < at || q >= total ? q : q < at + moved ? total - moved + (q - at) : q - moved; };
    trace_mark(a.trace, &trace_started);
    // f16/bf16 rows with `preload`: the warp's first rows (one round of loads) go out before the
    // wait for the previous kernel, as weights depend on none; otherwise their start is pulled
    // into L2 there.
    constexpr bool HALF = F == FMT_F16 || F == FMT_BF16;
    constexpr int HF = F == FMT_BF16 ? FMT_BF16 : FMT_F16;
    HalfLoads pre;
    bool preloaded = false;
    if (HALF && a.preload && (first << a.pairs) < total) {
        int r = first << a.pairs;
        int lr[2] = {r, min(r + 1, total - 1)};
        Seg sg[2] = {seg_of_row(a, &lr[0]), seg_of_row(a, &lr[1])};
        const uint8_t* rows[2] = {row_at(sg[0].w, HF, lr[0], a.cols, k0), row_at(sg[1].w, HF, lr[1], a.cols, k0)};
        if (a.pairs) half_load<2, HALF>(rows, kn, 0, pre);
        else half_load<1, HALF>(rows, kn, 0, pre);
        preloaded = true;
    }
    // Q4_K rows with int8 activations: likewise the first step of the warp's first row or pair
    // (with mixed formats, where that row is Q4_K; Q6_K's first step gained nothing, session 31).
    Q4Loads q4first;
    bool q4pre = false;
    if (Q8 && a.preload && (first << a.pairs) < total) {
        int lr = walk(first << a.pairs);
        Seg sg = seg_of_row(a, &lr);
        if ((F == FMT_Q4_K || F == FMT_ANY) && sg.fmt == FMT_Q4_K) {
            const Q4Lane ln = q4k_lane();
            const uint8_t* blk0 = row_at(sg.w, FMT_Q4_K, lr, a.cols, k0) + (size_t)ln.blk * 144;
            const uint8_t* blks[2] = {blk0, blk0 + fmt_bytes(FMT_Q4_K, a.cols)};
            if (ln.blk < (kn >> 8)) {
                if (PAIRS) q4k_load<2>(ln, blks, q4first);
                else q4k_load<1>(ln, blks, q4first);
            }
            q4pre = true;
        }
    }
    // A row's bias (added by the first slice). The warp's first rows' biases are loaded before
    // the wait, off the path from input to output, and kept in shared memory rather than in
    // registers across it. Nothing about a row but its index stays live across its product
    // (the bias's segment is looked up again after it): with each row's segment held there,
    // `mv_f16` spilled 68 bytes of registers, and decode was 6% slower (session 35).
    auto bias_of = [&](int r) {
        int lr = r;
        Seg sg = seg_of_row(a, &lr);
        return lane == 0 && r < total && sg.bias && k0 == 0 ? sg.bias[lr] : 0.f;
    };
    __shared__ float first_bias[MV_MAX_WARPS][2];
    float* my_first_bias = first_bias[threadIdx.x >> 5];
    if (lane == 0) my_first_bias[0] = bias_of(walk(first << a.pairs)), my_first_bias[1] = a.pairs ? bias_of((first << a.pairs) + 1) : 0.f;
    Staged in = stage_input<!Q8, Q8>(a, k0, kn, false, preloaded ? total : walk(first << a.pairs), total, reinterpret_cast<float*>(xs4),
                                     q8_places(reinterpret_cast<float*>(xs4), kn));
    if (Q8) stage_q8(a, in, kn);
    // Row r's product y, the k-th of the warp's rows at a time (`first_rows`: its first ones).
    auto put = [&](int r, int k, bool first_rows, float y) {
        if (lane == 0) {
            if (!Q8) y *= staged_scale();
            y += first_rows ? my_first_bias[k] : bias_of(r);
            if (gridDim.y > 1 && a.partial) store_tagged(a.partial, blockIdx.y * total + r, y, in.tag);
            else if (a.mode != MODE_ADD) store_out(a, r, y, in.tag);
            // Into the residual (one warp a row, or split-K without scratch) as an atomic add whose
            // result is unused: the warp does not wait for a load of the old value, and with one
            // writer the sum is the `+=` one (rounded to nearest; a subnormal would flush to zero).
            else atomicAdd(&a.out[r], y);
        }
    };
    if (HALF && a.pairs) {
        // More rows than warps: two rows a warp with their loads in flight together, rather
        // than a second pass over the rows that leaves most warps idle.
        auto pair = [&](int r, bool use_pre) {
            int lr[2] = {r, min(r + 1, total - 1)};
            Seg sg[2] = {seg_of_row(a, &lr[0]), seg_of_row(a, &lr[1])};
            const uint8_t* rows[2] = {row_at(sg[0].w, F, lr[0], a.cols, k0), row_at(sg[1].w, F, lr[1], a.cols, k0)};
            float y[2];
            dot_half<HF, 2, HALF>(rows, kn, in.xs, y, use_pre, pre);
            put(r, 0, use_pre, y[0]);
            if (r + 1 < total) put(r + 1, 1, use_pre, y[1]);
        };
        int r = 2 * first, stride = 2 * gridDim.x * warps;
        if (preloaded) {  // peeled, so that `pre` is dead in the loop
            pair(r, true);
            r += stride;
        }
        for (; r < total; r += stride) pair(r, false);
    } else if (HALF) {
        auto one = [&](int r, bool use_pre) {
            int lr = r;
            Seg sg = seg_of_row(a, &lr);
            const uint8_t* row = row_at(sg.w, HF, lr, a.cols, k0);
            float y;
            dot_half<HF, 1, HALF>(&row, kn, in.xs, &y, use_pre, pre);
            put(r, 0, use_pre, y);
        };
        int r = first, stride = gridDim.x * warps;
        if (preloaded) {
            one(r, true);
            r += stride;
        }
        for (; r < total; r += stride) one(r, false);
    } else if (PAIRS) {
        // As f16 pairs: two rows' loads in one round, where a warp would take them one by one.
        // (Every matrix has an even number of rows, so a pair never spans two.)
        auto pair = [&](int r, bool use_pre) {
            int lr = r;
            Seg sg = seg_of_row(a, &lr);
            const uint8_t* row0 = row_at(sg.w, F, lr, a.cols, k0);
            if (QUADS) {
                const uint8_t* rows[4];
                float y[4];
#pragma unroll
                for (int k = 0; k < 4; k++) rows[k] = row0 + k * fmt_bytes(F, a.cols);
                dot_q6_k_q8<4>(rows, kn, in.x8, in.dx, y);
#pragma unroll
                for (int k = 0; k < 4; k++) put(r + k, k & 1, false, y[k]);
                return;
            }
            const uint8_t* rows[2] = {row0, row0 + fmt_bytes(F, a.cols)};
            float y[2];
            // (Each pair walked as one run of 2·nb blocks, one row's step at a time, as the 1.5B's
            // gate/up pairs are, was slower: session 66, LM head work 74 -> 84 µs on the 1.5B
            // (6 blocks a row), 139 -> 173 on the 7B (14): a pair's loads then take twice the
            // rounds, and a step's input loads serve one row, not two.)
            if (F == FMT_Q6_K) dot_q6_k_q8<2>(rows, kn, in.x8, in.dx, y);
            else if (Q8) dot_q4_k_q8<2>(rows, kn, in.x8, in.dx, in.xsum, y, use_pre, q4first);
            else dot_q4_k<2>(rows, kn, in.xp, in.xsum, y);
            put(r, 0, use_pre, y[0]);
            put(r + 1, 1, use_pre, y[1]);
        };
        constexpr int PER_WARP = QUADS ? 4 : 2;
        int r = PER_WARP * first, stride = PER_WARP * gridDim.x * warps;
        if (q4pre) {  // peeled, so that `q4first` is dead in the loop
            pair(r, true);
            r += stride;
        }
        for (; r < total; r += stride) pair(r, false);
    } else {
        auto one = [&](int r, bool use_pre) {
            int lr = r;
            Seg sg = seg_of_row(a, &lr);
            float y;
            if (Q8 && (F == FMT_Q4_K || F == FMT_ANY && sg.fmt == FMT_Q4_K)) {
                const uint8_t* row = row_at(sg.w, FMT_Q4_K, lr, a.cols, k0);
                // (Mixed launches one step at a time: two spilled 32 bytes beside the Q6_K walk.)
                dot_q4_k_q8<1, F == FMT_ANY>(&row, kn, in.x8, in.dx, in.xsum, &y, use_pre, q4first);
            } else if (Q8) {
                // (Four lanes a block, 16 bytes of each field a lane, was slower here: session 62,
                // 1.5B down 7.44 -> 10.06 µs a layer, 7B q/k/v 8.26 -> 8.93; the log has it.)
                const uint8_t* row = row_at(sg.w, FMT_Q6_K, lr, a.cols, k0);
                dot_q6_k_q8<1>(&row, kn, in.x8, in.dx, &y);
            } else {
                y = dot_row<F>(sg.w, sg.fmt, lr, a.cols, k0, kn, in);
            }
            put(r, 0, use_pre, y);
        };
        int r = first, stride = gridDim.x * warps;
        if (q4pre) {
            one(walk(r), true);
            r += stride;
        }
        for (; r < total; r += stride) one(walk(r), false);
    }
    if (gridDim.y > 1 && a.partial && blockIdx.y == gridDim.y - 1) {
        // The column's last slice's block (the last to be scheduled, so the one that waits
        // least) sums each of its column's rows' partials in slice order, polling eight slices'
        // words at a time, so that a seeded run repeats exactly. GPUs dispatch a grid's blocks
        // in index order (not a documented promise; the 5 s trap stands behind it), so the
        // blocks it waits for are running or done however few blocks fit at once.
        // Partials carry the step's tag, so no counter or fence orders them. One H100 against a
        // last-arriving block behind an arrival counter (session 38, two alternating rounds):
        // decode 1.5B Q4_K_M 1019.1 / 1023.3 -> 1056.9 / 1044.3 tok/s, 7B Q4_K_M 420.1 / 422.8 ->
        // 427.9 / 424.4, 1.5B f16 684.8 / 686.4 -> 685.8 / 684.6 (the log has the other calls).
        // (The residual as a 64-bit fixed-point sum, which integer atomic adds from every slice
        // give in any order, with no block waiting here, was no better: session 67, 1.5B +1.1 to
        // +1.3%, 7B Q4_K_M -1.1%; each normed launch's staging then reads 8 more bytes a value.)
        const unsigned long long* words = reinterpret_cast<const unsigned long long*>(a.partial);
        unsigned long long since = 0;
        // The rows this block column took (`block_row`), a thread per row.
        int span = warps << a.pairs;
        for (int q = threadIdx.x;; q += blockDim.x) {
            int r = block_row(q, span);
            if (r >= total) break;
            r = walk(r);
            float sum = 0.f;
            for (int s0 = 0; s0 < (int)gridDim.y; s0 += 8) {
                int at[8];
                unsigned long long v[8];
#pragma unroll
                for (int u = 0; u < 8; u++) at[u] = s0 + u < (int)gridDim.y ? (s0 + u) * total + r : -1;
                poll_tagged<8>(words, at, in.tag, v, &since);
#pragma unroll
                for (int u = 0; u < 8; u++)
                    if (at[u] >= 0) sum += __uint_as_float((unsigned)v[u]);
            }
            if (a.mode == MODE_ADD) atomicAdd(&a.out[r], sum);  // as in `put`: the only add to row r
            else store_out(a, r, sum, in.tag);
        }
    }
    if (a.pick) pick_greedy(a, total, warps << a.pairs);
    trace_block(a.trace, a.launch);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Q4_K rows · int8 activations (`x8`, one f32 scale `dx` per 32 values, as llama.cpp's MMVQ
// quantizes them): each lane's 32 nibble bytes meet 32 + 32 input bytes in 16 `dp4a`s, against
// 3 instructions a value with f32 inputs. The mins' term takes `xsum`, the sums of each 16 int8
// inputs times their scale. Lanes as `Q4Lane` places them: 4 a block, 8 blocks a step. These
// kernels were bound by instruction issue (`ncu`, session 31: 3.7 bytes of weights an
// instruction against 12 for f16 rows), so a step is written for few instructions: high nibbles
// stay in place (a `dp4a` of unsigned bytes, 16 times the sum, taken out with the input's
// scale), and the lane's two 6-bit scales and mins are cut from the packed bytes without
// branches, both at once, once for its 64 values.
__device__ __forceinline__ int dp4a_u8_s8(uint32_t a, int b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Adds one step (a block's header `l.hw` and the lane's 32 nibble bytes `l.q`, per row) into acc;
// x8, dx and xsum point at the step's block as `Q4Lane` places the lane in it (x8 at the inputs
// met first).
template <int R>
__device__ __forceinline__ void q4k_use(const Q4Lane& ln, const Q4Loads& l, const int8_t* x8, const float* dx, const float* xsum, float* acc) {
    const int4* xv = reinterpret_cast<const int4*>(x8);
    const int4* xw = reinterpret_cast<const int4*>(x8 + ln.other);
    int4 xa0 = xv[0], xa1 = xv[1], xb0 = xw[0], xb1 = xw[1];
    float dxa = dx[0] * ln.dx_a, dxb = dx[ln.other >> 5] * ln.dx_b;
    float4 s4 = *reinterpret_cast<const float4*>(xsum);
    float slo = s4.x + s4.y, shi = s4.z + s4.w;
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        uint4 q0 = l.q[rr][0], q1 = l.q[rr][1];
        int sa = 0, sb = 0;
        sa = dp4a_u8_s8(q0.x & ln.mask_a, xa0.x, sa);
        sb = dp4a_u8_s8(q0.x & ln.mask_b, xb0.x, sb);
        sa = dp4a_u8_s8(q0.y & ln.mask_a, xa0.y, sa);
        sb = dp4a_u8_s8(q0.y & ln.mask_b, xb0.y, sb);
        sa = dp4a_u8_s8(q0.z & ln.mask_a, xa0.z, sa);
        sb = dp4a_u8_s8(q0.z & ln.mask_b, xb0.z, sb);
        sa = dp4a_u8_s8(q0.w & ln.mask_a, xa0.w, sa);
        sb = dp4a_u8_s8(q0.w & ln.mask_b, xb0.w, sb);
        sa = dp4a_u8_s8(q1.x & ln.mask_a, xa1.x, sa);
        sb = dp4a_u8_s8(q1.x & ln.mask_b, xb1.x, sb);
        sa = dp4a_u8_s8(q1.y & ln.mask_a, xa1.y, sa);
        sb = dp4a_u8_s8(q1.y & ln.mask_b, xb1.y, sb);
        sa = dp4a_u8_s8(q1.z & ln.mask_a, xa1.z, sa);
        sb = dp4a_u8_s8(q1.z & ln.mask_b, xb1.z, sb);
        sa = dp4a_u8_s8(q1.w & ln.mask_a, xa1.w, sa);
        sb = dp4a_u8_s8(q1.w & ln.mask_b, xb1.w, sb);
        // Scales (sc) and mins (m) of sub-blocks j and j + 1, in bytes 0 and 1 (see `scale_min_k4`).
        uint32_t w0 = l.hw[rr].y, w1 = l.hw[rr].z, w2 = l.hw[rr].w;
        uint32_t sc_src = ln.upper ? w2 : w0, m_src = ln.upper ? w2 >> 4 : w1;
        uint32_t sc = ((sc_src >> ln.shift) & ln.low_mask) | ((w0 >> (ln.shift + 2)) & ln.high_mask);
        uint32_t m = ((m_src >> ln.shift) & ln.low_mask) | ((w1 >> (ln.shift + 2)) & ln.high_mask);
        // Scaled sums in integers (|sc · sum| < 2^26: within a float's rounding): the scales need
        // no float conversion of their own.
        float a_s = (float)((int)__byte_perm(sc, 0, ln.pick_a) * sa), b_s = (float)((int)__byte_perm(sc, 0, ln.pick_b) * sb);
        float m0 = (float)(m & 0xFF), m1 = (float)(m >> 8);
        float2 d = __half22float2(*reinterpret_cast<const __half2*>(&l.hw[rr].x));
        acc[rr] += d.x * fmaf(dxb, b_s, dxa * a_s) - d.y * fmaf(m1, shi, m0 * slo);
    }
}

// With `preloaded`, `first` holds the loads of the lane's first step (block `Q4Lane::blk`).
// One row's steps go two at a time, both loaded before either is used; two rows' steps (as many
// bytes a step as two steps of one row) one at a time, and so do one row's with ONE_STEP (launches
// that mix Q4_K and Q6_K rows, where two steps spilled).
template <int R, bool ONE_STEP>
__device__ __forceinline__ void dot_q4_k_q8(const uint8_t* const* rows, int cols, const int8_t* x8, const float* dx, const float* xsum, float* out, bool preloaded, const Q4Loads& first) {
    const Q4Lane ln = q4k_lane();
    int nb = cols >> 8, b = ln.blk;
    float acc[R];
#pragma unroll
    for (int k = 0; k < R; k++) acc[k] = 0.f;
    const uint8_t* blk[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) blk[rr] = rows[rr] + (size_t)b * 144;
    constexpr int STEP_BYTES = Q4_PER_STEP * 144, STEP_X = Q4_PER_STEP * 256, STEP_DX = Q4_PER_STEP * 8, STEP_S = Q4_PER_STEP * 16;
    const int8_t* xb = x8 + b * 256 + ln.xoff;
    const float* dxb = dx + b * 8 + ln.dxoff;
    const float* sb = xsum + b * 16 + ln.soff;
    auto load = [&](int step, Q4Loads& l) {
        const uint8_t* at[R];
#pragma unroll
        for (int rr = 0; rr < R; rr++) at[rr] = blk[rr] + step * STEP_BYTES;
        q4k_load<R>(ln, at, l);
    };
    auto use = [&](int step, const Q4Loads& l) { q4k_use<R>(ln, l, xb + step * STEP_X, dxb + step * STEP_DX, sb + step * STEP_S, acc); };
    auto advance = [&](int steps) {
#pragma unroll
        for (int rr = 0; rr < R; rr++) blk[rr] += steps * STEP_BYTES;
        xb += steps * STEP_X;
        dxb += steps * STEP_DX;
        sb += steps * STEP_S;
        b += steps * Q4_PER_STEP;
    };
    if (preloaded) {
        if (b < nb) use(0, first);
        advance(1);
    }
    if (ONE_STEP || R == 2) {  // two rows' steps two at a time would hold 48 registers of loads
        for (; b < nb; advance(1)) {
            Q4Loads l;
            load(0, l);
            use(0, l);
        }
    } else {
        two_steps_at_a_time<Q4Loads, Q4_PER_STEP>(b, nb, load, use, advance);
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) out[rr] = warp_sum(acc[rr]);
}

// gate's row and up's row of a ring slot, which lie as one run of 2·nb blocks, walked as one row
// of 2·nb blocks, two steps at a time (block i < nb into gate's sum, the others into up's): where
// nb is not a multiple of the blocks a step (the 1.5B's 6), fewer lanes idle through a row's last
// step. Each block's product is the one `dot_q4_k_q8` adds; up's blocks fall to other lanes, so
// up's sum may differ from it in the last bits. Where nb is a multiple of 4 it saved no step and
// was slower with 8 lanes a block (`mv_gated_q4_k_ring_2_run` has the figures), and so was the
// 3-stage ring walked this way, one step at a time or two (7B Q4_K_M 518.5 -> 505.1 and 518.3 ->
// 497.4 tok/s, three rounds each).
__device__ __forceinline__ void dot_q4_k_q8_pair_run(const uint8_t* run, int cols, const int8_t* x8, const float* dx, const float* xsum, float* out) {
    const Q4Lane ln = q4k_lane();
    int nb = cols >> 8, b = ln.blk;
    float gate = 0.f, up_sum = 0.f;
    auto load = [&](int step, Q4Loads& l) {
        const uint8_t* at = run + (size_t)(b + Q4_PER_STEP * step) * 144;
        q4k_load<1>(ln, &at, l);
    };
    auto use = [&](int step, const Q4Loads& l) {
        int i = b + Q4_PER_STEP * step;
        bool up = i >= nb;
        int bx = up ? i - nb : i;
        float v = 0.f;
        q4k_use<1>(ln, l, x8 + bx * 256 + ln.xoff, dx + bx * 8 + ln.dxoff, xsum + bx * 16 + ln.soff, &v);
        if (up) up_sum += v;
        else gate += v;
    };
    two_steps_at_a_time<Q4Loads, Q4_PER_STEP>(b, 2 * nb, load, use, [&](int steps) { b += Q4_PER_STEP * steps; });
    out[0] = warp_sum(gate);
    out[1] = warp_sum(up_sum);
}

// The ring kernel's shared memory: the input as int8 (`cols` bytes), its scales (cols / 32
// f32) and sums of 16 (cols / 16 f32), then the ring: `stages` slots, each one gate/up row pair
// per warp (slot-major: a slot of every warp is contiguous).
__host__ __device__ __forceinline__ size_t q4k_ring_input_bytes(int cols) { return (size_t)cols + (size_t)cols / 32 * 4 + (size_t)cols / 16 * 4; }
__host__ __device__ __forceinline__ size_t q4k_ring_smem(int cols, int warps, int stages) {
    return q4k_ring_input_bytes(cols) + (size_t)stages * warps * 2 * fmt_bytes(FMT_Q4_K, cols);
}

// act(gate · norm(x)) · (up · norm(x)) for Q4_K gate/up rows that stream through a ring in
// shared memory, one per warp: each warp copies its next STAGES - 1 row pairs with cp.async
// (no registers held while in flight, so more bytes in flight than loads into registers allow)
// while it multiplies the pair that has landed, with int8 activations (`dot_q4_k_q8`). Its first
// copies go out before the previous kernel is waited for (weights depend on no kernel). No
// block-wide hand-off: a warp waits only for its own copies. PAIR_RUN: each slot's gate/up rows
// walked as one run (`dot_q4_k_q8_pair_run`, see `mv_gated_q4_k_ring_2_run`).
template <int STAGES, bool PAIR_RUN = false>
__device__ void q4k_gated_ring(const MvArgs& a, uint8_t* smem) {
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
    int cols = a.cols, rows = a.seg[0].rows;
    int first = blockIdx.x * warps + warp, stride = gridDim.x * warps;
    size_t rb = fmt_bytes(FMT_Q4_K, cols), slot_bytes = (size_t)warps * 2 * rb;
    int8_t* x8 = reinterpret_cast<int8_t*>(smem);
    float* dx = reinterpret_cast<float*>(smem + cols);
    float* xsum = dx + cols / 32;
    uint8_t* ring = smem + q4k_ring_input_bytes(cols);
    const uint8_t* gw = reinterpret_cast<const uint8_t*>(a.seg[0].w);
    const uint8_t* uw = reinterpret_cast<const uint8_t*>(a.seg[1].w);
    trace_mark(a.trace, &trace_started);
    auto slot_of = [&](int slot) { return ring + (size_t)slot * slot_bytes + (size_t)warp * 2 * rb; };
    auto issue = [&](int slot, int r) {
        if (r < rows) {
            uint8_t* dst = slot_of(slot);
            for (size_t off = (size_t)lane * 16; off < rb; off += 512) {
                cp_async16(dst + off, gw + (size_t)r * rb + off);
                cp_async16(dst + rb + off, uw + (size_t)r * rb + off);
            }
        }
        cp_async_commit();  // an empty group past the last row keeps the count uniform
    };
    allow_next_kernel();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) issue(s, first + s * stride);
    // The normed input, f32, in the last slot (its first copies go out in the loop below);
    // `q4k` is 0 for this kernel's launches, and first = rows skips the L2 prefetch of rows.
    Staged in = stage_input<false, true>(a, 0, cols, true, rows, rows, reinterpret_cast<float*>(ring + (size_t)(STAGES - 1) * slot_bytes), Q8Dest{x8, dx, xsum});
    if (!normed_input(a)) {  // int8 with one scale per 32 values, and the sums of each 16 int8 values times their scale
        quantize_q8(in.xs, cols, x8, dx, xsum);
        __syncthreads();
    }

    int i = 0;
    for (int r = first; r < rows; r += stride, i++) {
        issue((i + STAGES - 1) % STAGES, r + (STAGES - 1) * stride);  // the slot row i - 1 used
        cp_async_wait<STAGES - 1>();  // row i's copies have landed
        __syncwarp();
        const uint8_t* slot = slot_of(i % STAGES);
        float gu[2];
        if (PAIR_RUN) {
            dot_q4_k_q8_pair_run(slot, cols, x8, dx, xsum, gu);
        } else {
            const uint8_t* pair[2] = {slot, slot + rb};
            dot_q4_k_q8<2>(pair, cols, x8, dx, xsum, gu);
        }
        if (lane == 0) {
            float gv = gu[0] + (a.seg[0].bias ? a.seg[0].bias[r] : 0.f), uv = gu[1] + (a.seg[1].bias ? a.seg[1].bias[r] : 0.f);
            store_out(a, r, (a.mode == MODE_SILU ? silu(gv) : gelu_tanh(gv)) * uv, in.tag);
        }
        __syncwarp();  // every lane has read the slot before it is refilled
    }
    cp_async_wait<0>();
    trace_block(a.trace, a.launch);
}

// out[i] = act(gate_i · norm(x)) · (up_i · norm(x)) with seg[0] = gate, seg[1] = up: one warp
// per i takes both rows, loading them together where both are f16, bf16 or Q4_K.
template <int F>
__device__ void mv_gated_rows(const MvArgs& a) {
    extern __shared__ float4 xs4[];
    int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    int first = blockIdx.x * warps + (threadIdx.x >> 5);
    Seg gs = a.seg[0], us = a.seg[1];
    trace_mark(a.trace, &trace_started);
    constexpr bool HALF = F == FMT_F16 || F == FMT_BF16;
    HalfLoads pre;  // as in `mv_rows`: the first gate/up pair's loads before the wait
    bool preloaded = HALF && a.preload && first < gs.rows;
    if (preloaded) {
        const uint8_t* rows[2] = {row_at(gs.w, F, first, a.cols, 0), row_at(us.w, F, first, a.cols, 0)};
        half_load<2, HALF>(rows, a.cols, 0, pre);
    }
    Staged in = stage_input<true>(a, 0, a.cols, true, preloaded ? gs.rows : first, gs.rows, reinterpret_cast<float*>(xs4));
    auto gated = [&](int r, bool use_pre) {
        float gu[2];
        const uint8_t* rows[2] = {row_at(gs.w, gs.fmt, r, a.cols, 0), row_at(us.w, us.fmt, r, a.cols, 0)};
        if (F == FMT_Q4_K) {
            dot_q4_k<2>(rows, a.cols, in.xp, in.xsum, gu);
        } else if (HALF) {
            dot_half<F == FMT_BF16 ? FMT_BF16 : FMT_F16, 2, HALF>(rows, a.cols, in.xs, gu, use_pre, pre);
        } else {
            gu[0] = dot_row<F>(gs.w, gs.fmt, r, a.cols, 0, a.cols, in);
            gu[1] = dot_row<F>(us.w, us.fmt, r, a.cols, 0, a.cols, in);
        }
        if (lane == 0) {
            float g = gu[0] * staged_scale() + (gs.bias ? gs.bias[r] : 0.f), u = gu[1] * staged_scale() + (us.bias ? us.bias[r] : 0.f);
            store_out(a, r, (a.mode == MODE_SILU ? silu(g) : gelu_tanh(g)) * u, in.tag);
        }
    };
    int r = first, stride = gridDim.x * warps;
    if (preloaded) {  // peeled, so that `pre` is dead in the loop
        gated(r, true);
        r += stride;
    }
    for (; r < gs.rows; r += stride) gated(r, false);
    trace_block(a.trace, a.launch);
}

// One instance of each kernel per weight format, each with registers for its own loop only,
// and one for launches whose matrices differ in format: mv_<fmt>, mv_gated_<fmt>.
#define MV_KERNELS(NAME, F)                                                                            \
    extern "C" __global__ void __launch_bounds__(512, 2) mv_##NAME(MvArgs a) { mv_rows<F>(a); }             \
    extern "C" __global__ void __launch_bounds__(512, 2) mv_gated_##NAME(MvArgs a) { mv_gated_rows<F>(a); }
MV_KERNELS(any, FMT_ANY)
MV_KERNELS(f32, FMT_F32)
MV_KERNELS(f16, FMT_F16)
MV_KERNELS(bf16, FMT_BF16)
MV_KERNELS(q8_0, FMT_Q8_0)
MV_KERNELS(q4_k, FMT_Q4_K)
MV_KERNELS(q6_k, FMT_Q6_K)
extern "C" __global__ void __launch_bounds__(512, 2) mv_q4_k_pairs(MvArgs a) { mv_rows<FMT_Q4_K, true>(a); }
// Q4_K rows with int8 activations (`q4k` = 2), one and two rows a warp; Q6_K rows the same way.
extern "C" __global__ void __launch_bounds__(512, 2) mv_q4_k_q8(MvArgs a) { mv_rows<FMT_Q4_K, false, true>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) mv_q4_k_q8_pairs(MvArgs a) { mv_rows<FMT_Q4_K, true, true>(a); }
extern "C" __global__ void __launch_bounds__(512, 2) mv_q6_k_q8(MvArgs a) { mv_rows<FMT_Q6_K, false, true>(a); }
// Q6_K pairs hold both rows' loads in registers: 3 blocks an SM (at 4 they spill).
extern "C" __global__ void __launch_bounds__(256, 3) mv_q6_k_q8_pairs(MvArgs a) { mv_rows<FMT_Q6_K, true, true>(a); }
// Q6_K rows four a warp, one step at a time (the default for the pairs' launches since session 66;
// `SHOAL_FUSED_Q6_QUADS=0`: two a warp).
extern "C" __global__ void __launch_bounds__(256, 3) mv_q6_k_q8_quads(MvArgs a) { mv_rows<FMT_Q6_K, true, true, true>(a); }
// Q4_K and Q6_K matrices in one launch (q/k/v with a Q6_K v), int8 activations.
extern "C" __global__ void __launch_bounds__(512, 2) mv_any_q8(MvArgs a) { mv_rows<FMT_ANY, false, true>(a); }

// Gated Q4_K rows through each warp's ring (`q4k_gated_ring`), `stream` stages (2 or 3):
// shared memory, not registers, bounds its blocks per SM.
extern "C" __global__ void __launch_bounds__(256, 4) mv_gated_q4_k_ring(MvArgs a) {
    extern __shared__ float4 ring_smem4[];
    uint8_t* smem = reinterpret_cast<uint8_t*>(ring_smem4);
    if (a.stream == 3) q4k_gated_ring<3>(a, smem);
    else q4k_gated_ring<2>(a, smem);
}

// 2-stage rings where a row's blocks are not a whole number of steps (cols not a multiple of
// 2,048): each slot's gate/up rows walked as one run (`dot_q4_k_q8_pair_run`), an instance of its
// own. H200s, alternating rounds against the rows walked apart (session 56, when a step was 4
// blocks and 2-stage rings read a row two steps at a time): 1.5B Q4_K_M (6 blocks a row) 1,127.9
// -> 1,137.2 tok/s on average over twelve rounds in three calls (+0.8%, faster in 11), its
// gate/up 10.58-10.70 -> 10.05-10.06 µs a layer in traces (tail 2.63-2.80 -> 2.31-2.33); but with
// whole steps slower: 3B (8 blocks) 769.1 -> 750.1, Llama-3-8B shape (16) 490.0 -> 474.6, three
// rounds each.
extern "C" __global__ void __launch_bounds__(256, 4) mv_gated_q4_k_ring_2_run(MvArgs a) {
    extern __shared__ float4 ring_smem4[];
    q4k_gated_ring<2, true>(a, reinterpret_cast<uint8_t*>(ring_smem4));
}

// The first shard's input: row `**token_at` of the embedding table (rows `cols` wide in `fmt`,
// dequantized as ggml's CUDA kernels do), times `scale`, into the residual `out`. The token id's
// address is written with the step's other arguments, so the captured step takes it from there
// and no lookup runs outside the graph: it points at the id the host wrote beside it, or at the
// one the previous step picked (`pick_greedy`, `pick_token`: decoding that never waits for the host).
struct EmbedArgs {
    const void* table;
    int fmt;
    int cols;
    float scale;
    const unsigned* const* token_at;
    float* out;
};

__device__ float embed_value(const uint8_t* row, int fmt, int i) {
    switch (fmt) {
        case FMT_F32: return reinterpret_cast<const float*>(row)[i];
        case FMT_F16: return __half2float(reinterpret_cast<const __half*>(row)[i]);
        case FMT_BF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(row)[i]);
        case FMT_Q8_0: {
            const uint8_t* b = row + (size_t)(i / 32) * 34;
            return half_at(b, 0) * (float)(int8_t)b[2 + i % 32];
        }
        case FMT_Q4_K: {  // 64 values a group of 32 bytes: low nibbles, then high
            const uint8_t* b = row + (size_t)(i / 256) * 144;
            int j = i % 256, g = j / 64, w = j % 64;
            const uint32_t* words = reinterpret_cast<const uint32_t*>(b);
            uint32_t scales[3] = {words[1], words[2], words[3]};
            float sc, m;
            scale_min_k4(2 * g + w / 32, scales, &sc, &m);
            uint8_t q = b[16 + 32 * g + w % 32];
            float d1 = half_at(b, 0) * sc, m1 = half_at(b, 2) * m;
            return d1 * (float)(w < 32 ? q & 0xF : q >> 4) - m1;
        }
        default: {  // Q6_K: halves of 128 values, each four runs of 32
            const uint8_t* b = row + (size_t)(i / 256) * 210;
            int j = i % 256, n = j / 128, run = (j % 128) / 32, l = j % 32;
            uint8_t ql = b[64 * n + l + 32 * (run & 1)];
            int q = ((run < 2 ? ql & 0xF : ql >> 4) | (((b[128 + 32 * n + l] >> (2 * run)) & 3) << 4)) - 32;
            return half_at(b, 208) * (float)(int8_t)b[192 + 8 * n + l / 16 + 2 * run] * (float)q;
        }
    }
}

extern "C" __global__ void embed_row(EmbedArgs a) {
    allow_next_kernel();
    // Launched after the previous step's last kernel, which reads the residual (a no-op where
    // the launch does not overlap it, as in the captured step).
    wait_for_previous_kernel();
    const uint8_t* row = reinterpret_cast<const uint8_t*>(a.table) + fmt_bytes(a.fmt, (size_t)**a.token_at * a.cols);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.cols; i += gridDim.x * blockDim.x) a.out[i] = embed_value(row, a.fmt, i) * a.scale;
}

// x += RMSNorm(h) · w (the post-attention and post-MLP norms of Gemma-style blocks). One block.
extern "C" __global__ void add_norm(float* x, const float* h, const float* w, int n, float eps) {
    __shared__ float scratch[32];
    wait_for_previous_kernel();
    float ss = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) ss += h[j] * h[j];
    ss = block_sum(ss, scratch);
    float rinv = rsqrtf(ss / (float)n + eps);
    for (int j = threadIdx.x; j < n; j += blockDim.x) x[j] += h[j] * rinv * w[j];
}

// A prompt's quantized matrices, dequantized to f16 for cuBLAS (`cuda_decode::with_dequantized_f16`):
// the values candle's CPU dequantization gives (the same products in the same order, no fused
// multiply-adds), rounded to f16. These are copies at HBM speed, so a warp takes one block of 256
// values and each lane stores 8 consecutive values as one 16-byte word: a warp's store is 512
// contiguous bytes (candle's own kernels store one half at a time).
__device__ __forceinline__ uint32_t half2_bits(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}

// Q4_K (144-byte blocks, see `dot_q4_k`): lane 8j + 4h + p stores values 64j + 32h + 8p.. of the
// block, the low (h = 0) or high nibbles of nibble bytes 32j + 8p.. (sub-block 2j + h).
extern "C" __global__ void __launch_bounds__(256) dequant_q4_k_f16(const uint8_t* __restrict__ w, __half* __restrict__ out, long long blocks) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= blocks * 32) return;
    long long b = t >> 5;
    int lane = t & 31, j = lane >> 3, h = (lane >> 2) & 1, p = lane & 3;
    const uint8_t* blk = w + b * 144;
    float2 dm = __half22float2(*reinterpret_cast<const __half2*>(blk));
    uint32_t sc[3] = {*reinterpret_cast<const uint32_t*>(blk + 4), *reinterpret_cast<const uint32_t*>(blk + 8), *reinterpret_cast<const uint32_t*>(blk + 12)};
    float s, m;
    scale_min_k4(2 * j + h, sc, &s, &m);
    float d = dm.x * s, n = dm.y * m;
    uint2 q = *reinterpret_cast<const uint2*>(blk + 16 + 32 * j + 8 * p);
    uint32_t qw[2] = {q.x >> (4 * h), q.y >> (4 * h)}, y[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t word = qw[i >> 1] >> (16 * (i & 1));
        y[i] = half2_bits(__fsub_rn(__fmul_rn(d, (float)(word & 0xF)), n), __fsub_rn(__fmul_rn(d, (float)((word >> 8) & 0xF)), n));
    }
    *reinterpret_cast<uint4*>(out + b * 256 + 8 * lane) = make_uint4(y[0], y[1], y[2], y[3]);
}

// Q6_K (210-byte blocks: 128 bytes of low nibbles `ql`, 64 of high bit pairs `qh`, 16 int8
// scales, f16 d; only 2-byte aligned): lane 16n + 4k + p stores values 128n + 32k + 8p.. of the
// block, the low (k < 2) or high nibbles of ql bytes 64n + 32 (k & 1) + 8p.. with bit pair k of qh
// bytes 32n + 8p.., under scale 8n + 2k + p / 2.
extern "C" __global__ void __launch_bounds__(256) dequant_q6_k_f16(const uint8_t* __restrict__ w, __half* __restrict__ out, long long blocks) {
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= blocks * 32) return;
    long long b = t >> 5;
    int lane = t & 31, n = lane >> 4, k = (lane >> 2) & 3, p = lane & 3;
    const uint8_t* blk = w + b * 210;
    const uint8_t* ql = blk + 64 * n + 32 * (k & 1) + 8 * p;
    const uint8_t* qh = blk + 128 + 32 * n + 8 * p;
    float ds = half_at(blk, 208) * (float)reinterpret_cast<const int8_t*>(blk)[192 + 8 * n + 2 * k + p / 2];
    uint32_t lo[2] = {load_u16x2(ql) >> (4 * (k >> 1)), load_u16x2(ql + 4) >> (4 * (k >> 1))};
    uint32_t hi[2] = {load_u16x2(qh) >> (2 * k), load_u16x2(qh + 4) >> (2 * k)}, y[4];
    auto value = [&](int i) {
        uint32_t l = lo[i >> 2] >> (8 * (i & 3)), hb = hi[i >> 2] >> (8 * (i & 3));
        return __fmul_rn(ds, (float)((int)((l & 0xF) | ((hb & 3) << 4)) - 32));
    };
#pragma unroll
    for (int i = 0; i < 4; i++) y[i] = half2_bits(value(2 * i), value(2 * i + 1));
    *reinterpret_cast<uint4*>(out + b * 256 + 8 * lane) = make_uint4(y[0], y[1], y[2], y[3]);
}

// One layer's KV cache for this step: (kv_heads, capacity, d) keys and values in cache_fmt.
struct KvSlot {
    void* k;
    void* v;
    long long capacity;
};

// The position and the KV caches live in device memory, written before each step's first
// kernel, so one captured step replays for every sequence and every cache size.
struct AttnArgs {
    const float* qkv;      // q (heads·d), then k (kv_heads·d), then v (kv_heads·d)
    const KvSlot* kv;      // this layer's cache
    const float* inv_freq; // d/2
    const float* q_norm;   // d, or null
    const float* k_norm;   // d, or null
    const long long* pos;  // the new token's position
    float* out;            // heads·d
    int cache_fmt;         // FMT_F32, FMT_F16 or FMT_BF16
    int heads;
    int kv_heads;
    int d;
    int rope_halves;       // 1: rotate (i, i + d/2) pairs (NeoX); 0: (2i, 2i + 1) pairs
    int window;            // 0: every earlier key; else the last `window` positions
    float scale;
    float softcap;         // 0: none
    float eps;
    int launch;            // as in MvArgs
    unsigned long long* trace;
    int tagged;            // 1: qkv is tagged (read as it arrives, no wait) and so is out
    const unsigned long long* tag;  // as in MvArgs
    int out_q8;            // 1 (tagged only): out as int8 for o's int8 instance (`store_q8_tagged`)
    int splits;            // blocks a head (the grid is heads·splits); 1: one block a head
    int split_keys;        // fewest keys a split takes (splits > 1)
    float* partial;        // heads·splits·(d + 2): each split's unnormalized values, max, sum
                           // (`attend_group`: as tagged words, twice the floats)
    unsigned* count;       // heads (`attend_split`): splits of this step done (the last one resets it to 0)
};

__device__ __forceinline__ void cache_store(void* c, int fmt, size_t i, float v) {
    if (fmt == FMT_F32) reinterpret_cast<float*>(c)[i] = v;
    else if (fmt == FMT_F16) reinterpret_cast<__half*>(c)[i] = __float2half(v);
    else reinterpret_cast<__nv_bfloat16*>(c)[i] = __float2bfloat16(v);
}

// Eight consecutive cached values from index i (a multiple of 8) as f32: one 16-byte load for
// f16/bf16, two for f32.
// A half (f16 / bf16) cache's 8 values from i on, as they are stored.
__device__ __forceinline__ uint4 cache_load8_half(const void* c, size_t i) {
    return *reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(c) + i);
}

__device__ __forceinline__ void cache_load8(const void* c, int fmt, size_t i, float* v) {
    if (fmt == FMT_F32) {
        const float4* p = reinterpret_cast<const float4*>(reinterpret_cast<const float*>(c) + i);
        float4 a = p[0], b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
    uint4 u = cache_load8_half(c, i);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&u);
#pragma unroll
    for (int e = 0; e < 4; e++) widen2(w[e], fmt, &v[2 * e], &v[2 * e + 1]);
}

// One warp: v = rope(norm(src)) for one head of `d` values, in shared memory (src may be v);
// `rope_cos` / `rope_sin` hold the position's rotation, d/2 values each.
__device__ void warp_norm_rope(float* v, const float* src, const float* norm_w, float eps, const float* rope_cos, const float* rope_sin, int d, int halves) {
    int lane = threadIdx.x & 31;
    float ss = 0.f;
    for (int i = lane; i < d; i += 32) {
        float x = src[i];
        v[i] = x;
        ss += x * x;
    }
    if (norm_w) {
        float rinv = rsqrtf(warp_sum(ss) / (float)d + eps);
        for (int i = lane; i < d; i += 32) v[i] *= rinv * norm_w[i];
    }
    __syncwarp();
    int half = d / 2;
    for (int i = lane; i < half; i += 32) {
        float s = rope_sin[i], c = rope_cos[i];
        int i0 = halves ? i : 2 * i, i1 = halves ? i + half : 2 * i + 1;
        float x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * c - x1 * s;
        v[i1] = x1 * c + x0 * s;
    }
    __syncwarp();
}

// Folds softmax state (m2, l2, o2) into (m, l, o): running maxima, sums of exp(s - max), and
// the exp-weighted sums of values. A state with no keys has m = -inf.
__device__ __forceinline__ void softmax_merge(float& m, float& l, float* o, float m2, float l2, const float* o2) {
    float mn = fmaxf(m, m2);
    float c1 = m == -INFINITY ? 0.f : expf(m - mn), c2 = m2 == -INFINITY ? 0.f : expf(m2 - mn);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int e = 0; e < 8; e++) o[e] = o[e] * c1 + o2[e] * c2;
    m = mn;
}

#define ATTN_MAX_D 256
#define ATTN_MAX_WARPS 16  // 512 threads (the launch bound; its registers allow no more)
#define ATTN_MAX_SPLITS 32  // merged by one warp, a lane a split
#define ATTN_UNROLL 4  // warp steps whose loads are in flight together
#define LOG2E 1.4426950408889634f  // exp(x) = exp2(x * LOG2E)

// attend_short_bench's marks: each warp's clock at eight points of `attend_heads`, and a spin
// where the engine would wait for q/k/v. Compiled only with -DATTEND_PHASES (that bench); no code
// in the engine's kernels.
#ifdef ATTEND_PHASES
#define ATTEND_PHASE_BLOCKS 256
__device__ long long attend_phase_log[ATTEND_PHASE_BLOCKS * ATTN_MAX_WARPS * 8];
__device__ long long attend_spin_cycles;
#define ATTEND_PHASE(i) do { if ((threadIdx.x & 31) == 0 && blockIdx.x < ATTEND_PHASE_BLOCKS) attend_phase_log[((size_t)blockIdx.x * ATTN_MAX_WARPS + (threadIdx.x >> 5)) * 8 + (i)] = clock64(); } while (0)
#define ATTEND_SPIN() do { long long t0_ = clock64(); while (clock64() - t0_ < attend_spin_cycles) {} } while (0)
#else
#define ATTEND_PHASE(i) do {} while (0)
#define ATTEND_SPIN() do {} while (0)
#endif

// One block per query head. Warp 0 norms and rotates q, warp 1 k (and copies v); the first head
// of each KV group appends this step's key and value to the cache. Then every warp streams its
// share of the visible keys with an online softmax: lanes in groups of G (the power of two
// >= d/8) take one key each, 8 values per lane, so a warp reads 32/G keys and their values per
// step with 16-byte loads; the ATTN_UNROLL steps loaded together are scored together and folded
// into the running state with one rescale (session 36: each key rescaling the state in turn made
// 1.5B decode 2-4% slower). The warps' states are merged at the end, each warp's weight computed
// once. The newest key comes from shared memory (another block writes it to the cache). What
// depends on no earlier kernel is done before waiting for q/k/v: the position's rotation, and the
// loads of each warp's first ATTN_UNROLL steps of cached keys and values (a context of up to 128
// keys for d = 128).
// `attend_split` (SPLIT) takes a long context over several blocks a head (flash-decoding), for
// shapes `attend_group` (below) does not take:
// `a.splits` blocks a head in the grid, of which as many take a near-equal run of the visible
// keys as give each at least `a.split_keys` (the rest end at once). Each writes its warps'
// merged state unnormalized, with its max and sum, to `a.partial`; the last of a head's splits
// to finish (a counter) merges them and writes the head's values as one block does alone.
// `attend` is the one-block-a-head instance, none of that compiled in.
template <bool SPLIT, int D = 0>
__device__ __forceinline__ void attend_heads(AttnArgs a) {
    __shared__ float q[ATTN_MAX_D], kn[ATTN_MAX_D], vn[ATTN_MAX_D];
    __shared__ float rope_cos[ATTN_MAX_D / 2], rope_sin[ATTN_MAX_D / 2];
    __shared__ float part[ATTN_MAX_WARPS][ATTN_MAX_D];
    __shared__ float wmax[ATTN_MAX_WARPS], wsum[ATTN_MAX_WARPS];
    trace_mark(a.trace, &trace_started);
    allow_next_kernel();
    ATTEND_PHASE(0);
    int splits = SPLIT && a.splits > 1 ? a.splits : 1;
    const int d = D > 0 ? D : a.d;  // D: the head dim at compile time, or 0
    int h = blockIdx.x / splits, split = blockIdx.x % splits;
    int rep = a.heads / a.kv_heads, kvh = h / rep;
    // Written before the step's first kernel, not by the previous one.
    int pos = (int)*a.pos;
    unsigned tag = a.tagged ? (unsigned)*a.tag : 0u;
    const KvSlot cache = *a.kv;
    int first = (a.window > 0 && pos + 1 > a.window) ? pos + 1 - a.window : 0;
    // This block's keys: [lo, lo + nkeys), all the visible ones or a near-equal share of them.
    int lo = first, nkeys = pos + 1 - first, used = 1;
    if (SPLIT && splits > 1) {
        int want = min(splits, max(1, (nkeys + a.split_keys - 1) / max(a.split_keys, 1)));
        int chunk = (nkeys + want - 1) / want;
        used = (nkeys + chunk - 1) / chunk;
        if (split >= used) {
            trace_block(a.trace, a.launch);
            return;
        }
        lo = first + split * chunk, nkeys = min(chunk, pos + 1 - lo);
    }
    size_t head_base = (size_t)kvh * cache.capacity * d;
    // The cached keys and values this block will read depend on no earlier kernel: pull them
    // into L2 while that kernel finishes.
    {
        size_t esize = a.cache_fmt == FMT_F32 ? 4 : 2, bytes = (size_t)max(0, min(lo + nkeys, pos) - lo) * d * esize;
        const uint8_t* kp = reinterpret_cast<const uint8_t*>(cache.k) + (head_base + (size_t)lo * d) * esize;
        const uint8_t* vp = reinterpret_cast<const uint8_t*>(cache.v) + (head_base + (size_t)lo * d) * esize;
        for (size_t off = (size_t)threadIdx.x * 128; off < bytes; off += (size_t)blockDim.x * 128) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(kp + off));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vp + off));
        }
    }
    for (int i = threadIdx.x; i < d / 2; i += blockDim.x) sincosf((float)pos * a.inv_freq[i], &rope_sin[i], &rope_cos[i]);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int group = 1;
    while (group * 8 < d) group <<= 1;
    int per_step = 32 / group, grp = lane / group, col = (lane % group) * 8;
    bool active = col < d;
    int stride = warps * per_step;
    // Cached keys and values of ATTN_UNROLL warp steps from `base` (zeros past the end and for
    // this step's key, which the loop takes from shared memory). Half caches: every step's loads
    // go out before any is widened, so that a warp waits for one round trip, not one a load (each
    // load's widening had followed it at once). One H200 (session 57, three alternating rounds,
    // the same tokens): 7B Q4_K_M 515.7 -> 519.6 tok/s, 1.5B Q4_K_M 1,116.0 -> 1,140.1, 1.5B f16
    // 900.7 -> 900.1.
    float kv[ATTN_UNROLL][8], vv[ATTN_UNROLL][8];
    auto load_steps = [&](int base) {
        if (a.cache_fmt != FMT_F32) {
            uint4 rk[ATTN_UNROLL], rv[ATTN_UNROLL];
#pragma unroll
            for (int u = 0; u < ATTN_UNROLL; u++) {
                int t = base + u * stride + grp, key = lo + t;
                bool cached = active && t < nkeys && key != pos;
                size_t at = head_base + (size_t)key * d + col;
                rk[u] = cached ? cache_load8_half(cache.k, at) : make_uint4(0, 0, 0, 0);
                rv[u] = cached ? cache_load8_half(cache.v, at) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < ATTN_UNROLL; u++) {
                // K's and V's words in turn: the measured schedule (widening a whole K row, then
                // V's, compiled to 123 registers, not 121, in another order).
                const uint32_t* wk = reinterpret_cast<const uint32_t*>(&rk[u]);
                const uint32_t* wv = reinterpret_cast<const uint32_t*>(&rv[u]);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    widen2(wk[e], a.cache_fmt, &kv[u][2 * e], &kv[u][2 * e + 1]);
                    widen2(wv[e], a.cache_fmt, &vv[u][2 * e], &vv[u][2 * e + 1]);
                }
            }
            return;
        }
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            int t = base + u * stride + grp, key = lo + t;
            if (active && t < nkeys && key != pos) {
                cache_load8(cache.k, a.cache_fmt, head_base + (size_t)key * d + col, kv[u]);
                cache_load8(cache.v, a.cache_fmt, head_base + (size_t)key * d + col, vv[u]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) kv[u][e] = vv[u][e] = 0.f;
            }
        }
    };
    int base = warp * per_step;
    load_steps(base);
    __syncthreads();  // the rotation table
    ATTEND_PHASE(1);
    ATTEND_SPIN();
    if (!a.tagged) wait_for_previous_kernel();
    trace_mark(a.trace, &trace_waited);
    ATTEND_PHASE(2);
    int kin = a.heads * d + kvh * d, vin = a.heads * d + a.kv_heads * d + kvh * d;
    if (a.tagged) {
        // Warps 0-2 read q, k and v as they arrive (warp 0 also v with two warps); warps 0 and 1
        // then norm and rotate what they read themselves, with no barrier in between.
        for (int w = warp; w < 3; w += warps) load_tagged_warp(a.qkv + 2 * (w == 0 ? h * d : w == 1 ? kin : vin), d, tag, w == 0 ? q : w == 1 ? kn : vn);
        __syncwarp();
    }
    if (warp == 0) {
        warp_norm_rope(q, a.tagged ? q : a.qkv + h * d, a.q_norm, a.eps, rope_cos, rope_sin, d, a.rope_halves);
    } else if (warp == 1) {
        warp_norm_rope(kn, a.tagged ? kn : a.qkv + kin, a.k_norm, a.eps, rope_cos, rope_sin, d, a.rope_halves);
        if (!a.tagged)
            for (int i = lane; i < d; i += 32) vn[i] = a.qkv[vin + i];
    }
    __syncthreads();
    trace_mark(a.trace, &trace_ready);
    ATTEND_PHASE(3);
    if (h % rep == 0 && split == 0) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            cache_store(cache.k, a.cache_fmt, head_base + (size_t)pos * d + i, kn[i]);
            cache_store(cache.v, a.cache_fmt, head_base + (size_t)pos * d + i, vn[i]);
        }
    }
    float qr[8];
#pragma unroll
    for (int e = 0; e < 8; e++) qr[e] = active ? q[col + e] : 0.f;
    float m = -INFINITY, l = 0.f, o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // Warp-uniform trip count: every lane reaches the shuffles.
    for (; base < nkeys; base += ATTN_UNROLL * stride) {
        if (base != warp * per_step) load_steps(base);  // the first steps are loaded
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            if (active && lo + base + u * stride + grp == pos) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    kv[u][e] = kn[col + e];
                    vv[u][e] = vn[col + e];
                }
            }
        }
        // The steps' scores first (independent chains), then one rescale for all of them.
        float sc[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < 8; e++) s = fmaf(qr[e], kv[u][e], s);
            sc[u] = s;
        }
        for (int off = group / 2; off > 0; off >>= 1) {
#pragma unroll
            for (int u = 0; u < ATTN_UNROLL; u++) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], off);
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            float s = sc[u] * a.scale;
            if (a.softcap > 0.f) s = tanhf(s / a.softcap) * a.softcap;
            sc[u] = base + u * stride + grp < nkeys ? s : -INFINITY;  // the same for every lane of a group
            mx = fmaxf(mx, sc[u]);
        }
        if (mx != -INFINITY) {
            float c = m == -INFINITY ? 0.f : exp2f((m - mx) * LOG2E);
            l *= c;
#pragma unroll
            for (int e = 0; e < 8; e++) o[e] *= c;
#pragma unroll
            for (int u = 0; u < ATTN_UNROLL; u++) {
                float p = sc[u] == -INFINITY ? 0.f : exp2f((sc[u] - mx) * LOG2E);
                l += p;
#pragma unroll
                for (int e = 0; e < 8; e++) o[e] = fmaf(p, vv[u][e], o[e]);
            }
            m = mx;
        }
    }
    ATTEND_PHASE(4);
    // Merge the groups of a warp (lanes `group` apart hold the same columns), then the warps.
    for (int off = group; off < 32; off <<= 1) {
        float o2[8];
#pragma unroll
        for (int e = 0; e < 8; e++) o2[e] = __shfl_xor_sync(0xffffffffu, o[e], off);
        float m2 = __shfl_xor_sync(0xffffffffu, m, off), l2 = __shfl_xor_sync(0xffffffffu, l, off);
        softmax_merge(m, l, o, m2, l2, o2);
    }
    if (grp == 0 && active) {
#pragma unroll
        for (int e = 0; e < 8; e++) part[warp][col + e] = o[e];
    }
    if (lane == 0) {
        wmax[warp] = m;
        wsum[warp] = l;
    }
    __syncthreads();
    ATTEND_PHASE(5);
    // Each warp's weight once (a lane a warp), then every column a sum of products.
    __shared__ float wweight[SPLIT && ATTN_MAX_SPLITS > ATTN_MAX_WARPS ? ATTN_MAX_SPLITS : ATTN_MAX_WARPS];
    __shared__ float wden, wtop;
    if (warp == 0) {
        float mw = lane < warps ? wmax[lane] : -INFINITY, mx = mw;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float c = mw != -INFINITY ? exp2f((mw - mx) * LOG2E) : 0.f;
        if (lane < warps) wweight[lane] = c;
        float den = warp_sum(lane < warps ? wsum[lane] * c : 0.f);
        if (lane == 0) wden = den, wtop = mx;
    }
    __syncthreads();
    ATTEND_PHASE(6);
    auto numerator = [&](int i) {
        // Four independent sums (the warps' loads in flight together, not one chain of 16).
        float nums[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < ATTN_MAX_WARPS; w++)
            if (w < warps) nums[w & 3] = fmaf(part[w][i], wweight[w], nums[w & 3]);
        return (nums[0] + nums[1]) + (nums[2] + nums[3]);
    };
    auto store_out = [&](auto value) {
        if (a.out_q8) {
            for (int g = warp; g < d / 32; g += warps) store_q8_tagged(a.out, a.heads * d, h * d + 32 * g, value(32 * g + lane), tag);
        } else {
            for (int i = threadIdx.x; i < d; i += blockDim.x) {
                if (a.tagged) store_tagged(a.out, h * d + i, value(i), tag);
                else a.out[h * d + i] = value(i);
            }
        }
    };
    if (!SPLIT || used == 1) {
        store_out([&](int i) { return numerator(i) / wden; });
        ATTEND_PHASE(7);
        trace_block(a.trace, a.launch);
        return;
    }
    // One of several splits: its state to `partial`, made visible before it counts itself.
    float* parts = a.partial + (size_t)h * splits * (d + 2);
    float* mine = parts + (size_t)split * (d + 2);
    for (int i = threadIdx.x; i < d; i += blockDim.x) mine[i] = numerator(i);
    if (threadIdx.x == 0) mine[d] = wtop, mine[d + 1] = wden;
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) {
        last = atomicAdd(a.count + h, 1u) == (unsigned)(used - 1);
        // Every split of this head has counted itself: ready for the next step.
        if (last) atomicExch(a.count + h, 0u);
    }
    __syncthreads();
    if (!last) {
        trace_block(a.trace, a.launch);
        return;
    }
    __threadfence();
    // The last split merges: each split's weight once (a lane a split), read past L1.
    if (warp == 0) {
        float ms = lane < used ? __ldcg(parts + (size_t)lane * (d + 2) + d) : -INFINITY, mx = ms;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float c = ms != -INFINITY ? exp2f((ms - mx) * LOG2E) : 0.f;
        if (lane < ATTN_MAX_SPLITS) wweight[lane] = lane < used ? c : 0.f;
        float den = warp_sum(lane < used ? __ldcg(parts + (size_t)lane * (d + 2) + d + 1) * c : 0.f);
        if (lane == 0) wden = den;
    }
    __syncthreads();
    store_out([&](int i) {
        float nums[4] = {0.f, 0.f, 0.f, 0.f};
        for (int s = 0; s < used; s++) nums[s & 3] = fmaf(__ldcg(parts + (size_t)s * (d + 2) + i), wweight[s], nums[s & 3]);
        return ((nums[0] + nums[1]) + (nums[2] + nums[3])) / wden;
    });
    trace_block(a.trace, a.launch);
}

extern "C" __global__ void __launch_bounds__(512) attend(AttnArgs a) { attend_heads<false>(a); }
extern "C" __global__ void __launch_bounds__(512) attend_d64(AttnArgs a) { attend_heads<false, 64>(a); }
extern "C" __global__ void __launch_bounds__(512) attend_d128(AttnArgs a) { attend_heads<false, 128>(a); }
extern "C" __global__ void __launch_bounds__(512) attend_split(AttnArgs a) { attend_heads<true>(a); }

// ---- `attend_group`: long contexts, a KV head's keys shared out over blocks (flash-decoding) ----
// `attend` gives each query head a block that streams its KV head's keys, so rep query heads read
// the same keys rep times over; past a few hundred keys those reads bound it. Here a block takes
// one KV head and a near-equal run of its keys (at least `split_keys`; the grid is kv_heads ·
// splits, and the blocks past the run's need end at once) for all rep of its query heads: its
// run goes in near-equal tiles of at most GRP_TILE keys (a multiple of 16), each tile's keys and
// values copied into shared memory with cp.async one tile ahead (the first before the wait for
// q/k/v, since the cache's earlier rows depend on no earlier kernel), so each cached byte is read
// once. The group's query heads (at most 16) are the rows of tensor-core products (`mma.sync`
// m16n8k16, f16 or bf16 as the cache, f32 sums): per tile, a warp scores 8 keys, a warp updates
// a head's online softmax in f32, and every warp multiplies the probabilities by its n-tiles of
// the values, its sums held in registers across tiles. Each block then stores its unnormalized
// values with each head's max and sum in `partial` as tagged words, and merges a share of the
// group's outputs (a unit of 32 values of one head a turn, the splits shared out over its warps),
// reading each split's words as they arrive: one round trip where the splits are done, and no
// single block reads every split's state. (Session 51, `attend_bench`: flags behind a fence,
// then the merge's three dependent reads, took about 5 µs a launch; 32-key tiles three stages
// deep, 1.5 µs a tile longer at 16K keys for the 7B; an L2 prefetch of the run gained nothing.)
// A group's blocks wait for one another, so they must all be resident at once: the host sizes
// the grid to what the GPU holds (`GroupAttend::plan`), the next kernel's blocks start only once
// every block of this one has, and the earlier kernels' blocks finish without waiting on this
// one. A process runs one step at a time on a GPU (one stream); only under MPS could another
// process's grid hold SMs the group needs, and a value that never comes traps after 5 s
// (`poll_pause`): the step fails rather than hang.
#define GRP_THREADS 256
#define GRP_WARPS (GRP_THREADS / 32)
#define GRP_MAX_REP 16         // query heads a KV head at most: an mma's rows (fewer are padded)
#define GRP_TILE 64            // keys a tile at most (two a lane in the softmax update)
#define GRP_STAGES 2           // tiles in shared memory: the one in use and the next
#define GRP_TILE_BYTES 17408   // one tile of keys (or values) at most: 64 rows of 128 f16 + 16 bytes
#define GRP_MAX_SPLITS 128     // 16 a warp in the merge (lanes k and 16 + k: split k's max and sum)
#define GRP_NTILES (ATTN_MAX_D / 8 / GRP_WARPS)  // a warp's n-tiles of 8 output columns at most
static_assert(GRP_TILE <= 8 * GRP_WARPS && GRP_TILE % 16 == 0, "a warp scores 8 keys of a tile, an mma takes 16");
static_assert(GRP_TILE % 32 == 0, "the softmax update takes GRP_TILE / 32 keys a lane");

// D += A (16 x 16, row-major) · B (16 x 8, column-major), f32 sums of f16 or bf16 products.
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b, bool bf16) {
    if (bf16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ uint32_t lds32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }
// Two 16-bit values (lo from p, hi from q) in one register, as mma's B fragments pair them.
__device__ __forceinline__ uint32_t pack16(const uint8_t* p, const uint8_t* q) {
    return (uint32_t)*reinterpret_cast<const uint16_t*>(p) | ((uint32_t)*reinterpret_cast<const uint16_t*>(q) << 16);
}
__device__ __forceinline__ uint16_t to_bits16(float x, bool bf16) {
    return bf16 ? __bfloat16_as_ushort(__float2bfloat16(x)) : __half_as_ushort(__float2half(x));
}

// D: the head dim at compile time (its loops unrolled, a warp's sums sized for it), or 0: a.d.
template <int D>
__device__ __forceinline__ void attend_group_body(AttnArgs a) {
    constexpr int NT = D > 0 ? (D / 8 + GRP_WARPS - 1) / GRP_WARPS : GRP_NTILES;  // a warp's n-tiles
    extern __shared__ __align__(16) uint8_t grp_smem[];
    __shared__ float kn[ATTN_MAX_D], vn[ATTN_MAX_D];
    __shared__ float rope_cos[ATTN_MAX_D / 2], rope_sin[ATTN_MAX_D / 2];
    __shared__ __align__(16) float probs[GRP_MAX_REP][GRP_TILE];
    __shared__ __align__(16) uint16_t q16[GRP_MAX_REP][ATTN_MAX_D + 8], p16[GRP_MAX_REP][GRP_TILE + 8];
    __shared__ float run_max[GRP_MAX_REP], run_sum[GRP_MAX_REP], rescale[GRP_MAX_REP];
    __shared__ float warp_max[GRP_WARPS], warp_total[GRP_WARPS], warp_num[GRP_WARPS][32];
    trace_mark(a.trace, &trace_started);
    allow_next_kernel();
    const int d = D > 0 ? D : a.d;
    int splits = a.splits, g = blockIdx.x / splits, split = blockIdx.x % splits;
    int rep = a.heads / a.kv_heads, h0 = g * rep;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Written before the step's first kernel, not by the previous one.
    int pos = (int)*a.pos;
    unsigned tag = (unsigned)*a.tag;
    const KvSlot cache = *a.kv;
    int first = (a.window > 0 && pos + 1 > a.window) ? pos + 1 - a.window : 0;
    int visible = pos + 1 - first;
    int want = min(splits, max(1, (visible + a.split_keys - 1) / max(a.split_keys, 1)));
    int chunk = (visible + want - 1) / want, used = (visible + chunk - 1) / chunk;
    if (split >= used) {
        trace_block(a.trace, a.launch);
        return;
    }
    int lo = first + split * chunk, nkeys = min(chunk, pos + 1 - lo);
    int esize = a.cache_fmt == FMT_F32 ? 4 : 2, row_bytes = d * esize, row = row_bytes + 16;
    // As few tiles as the stage allows, near-equal and a multiple of 16 keys (an mma's depth).
    int most = min(GRP_TILE, GRP_TILE_BYTES / row / 16 * 16), ntiles = (nkeys + most - 1) / most;
    int tile = ((nkeys + ntiles - 1) / ntiles + 15) / 16 * 16;
    uint8_t* tiles = grp_smem;  // [stage][keys, values][tile][row]
    float* qs = reinterpret_cast<float*>(grp_smem + GRP_STAGES * 2 * tile * row);  // rep · d
    size_t head_base = (size_t)g * cache.capacity * row_bytes;
    const uint8_t* kbase = reinterpret_cast<const uint8_t*>(cache.k) + head_base;
    const uint8_t* vbase = reinterpret_cast<const uint8_t*>(cache.v) + head_base;
    // Tile t into stage t % GRP_STAGES; a group is committed even past the last tile, so that
    // `cp_async_wait` counts the same everywhere. This step's key is written after the wait.
    auto issue = [&](int t) {
        if (t < ntiles) {
            // A warp a row of keys or of values, a lane 16 bytes.
            int k0 = t * tile, n = min(tile, nkeys - k0);
            uint8_t* st = tiles + (t % GRP_STAGES) * 2 * tile * row;
            for (int r = warp; r < 2 * n; r += GRP_WARPS) {
                int m = r >= n, rr = r - m * n, key = lo + k0 + rr;
                if (key == pos) continue;
                const uint8_t* src = (m ? vbase : kbase) + (size_t)key * row_bytes;
                uint8_t* dst = st + (m * tile + rr) * row;
                for (int c = 16 * lane; c < row_bytes; c += 512) cp_async16(dst + c, src + c);
            }
            // Value rows past the run hold zeros: a zero probability times stale bits could be NaN.
            for (int r = n + warp; r < tile; r += GRP_WARPS)
                for (int c = 16 * lane; c < row_bytes; c += 512) *reinterpret_cast<uint4*>(st + (tile + r) * row + c) = make_uint4(0, 0, 0, 0);
        }
        cp_async_commit();
    };
#pragma unroll
    for (int t = 0; t < GRP_STAGES - 1; t++) issue(t);
    for (int i = threadIdx.x; i < d / 2; i += GRP_THREADS) sincosf((float)pos * a.inv_freq[i], &rope_sin[i], &rope_cos[i]);
    if (threadIdx.x < GRP_MAX_REP) run_max[threadIdx.x] = -INFINITY, run_sum[threadIdx.x] = 0.f;
    __syncthreads();  // the rotation table
    if (!a.tagged) wait_for_previous_kernel();
    trace_mark(a.trace, &trace_waited);
    // A warp a job: the group's query heads, then its key, then its value.
    int kin = a.heads * d + g * d, vin = a.heads * d + a.kv_heads * d + g * d;
    for (int j = warp; j < rep + 2; j += GRP_WARPS) {
        float* dst = j < rep ? qs + j * d : j == rep ? kn : vn;
        int at = j < rep ? (h0 + j) * d : j == rep ? kin : vin;
        if (a.tagged) {
            load_tagged_warp(a.qkv + 2 * at, d, tag, dst);
            __syncwarp();
        }
        if (j <= rep) warp_norm_rope(dst, a.tagged ? dst : a.qkv + at, j < rep ? a.q_norm : a.k_norm, a.eps, rope_cos, rope_sin, d, a.rope_halves);
        else if (!a.tagged)
            for (int i = lane; i < d; i += 32) dst[i] = a.qkv[at + i];
    }
    __syncthreads();
    if (split == 0) {
        for (int i = threadIdx.x; i < d; i += GRP_THREADS) {
            cache_store(cache.k, a.cache_fmt, (size_t)g * cache.capacity * d + (size_t)pos * d + i, kn[i]);
            cache_store(cache.v, a.cache_fmt, (size_t)g * cache.capacity * d + (size_t)pos * d + i, vn[i]);
        }
    }
    // The query heads as the rows of `mma` products, in the cache's format (rows past rep zero),
    // and the probabilities' rows likewise (zero until a tile's softmax writes them).
    bool bf16 = a.cache_fmt == FMT_BF16;
    for (int i = threadIdx.x; i < GRP_MAX_REP * d; i += GRP_THREADS) {
        int r = i / d, c = i % d;
        q16[r][c] = r < rep ? to_bits16(qs[r * d + c], bf16) : 0;
    }
    for (int i = threadIdx.x; i < GRP_MAX_REP * (GRP_TILE + 8); i += GRP_THREADS) p16[i / (GRP_TILE + 8)][i % (GRP_TILE + 8)] = 0;
    // A warp's sums: its n-tiles of 8 output columns, rows mr and mr + 8 of each (mma's C layout).
    int mr = lane >> 2, tig = lane & 3;
    float acc[4 * NT];
#pragma unroll
    for (int e = 0; e < 4 * NT; e++) acc[e] = 0.f;
    for (int t = 0; t < ntiles; t++) {
        issue(t + GRP_STAGES - 1);
        cp_async_wait<GRP_STAGES - 1>();  // tile t's copies have landed
        __syncthreads();
        uint8_t* kt = tiles + (t % GRP_STAGES) * 2 * tile * row;
        uint8_t* vt = kt + tile * row;
        int k0 = t * tile, n = min(tile, nkeys - k0), mine = pos - lo - k0;
        if (mine >= 0 && mine < n) {  // this step's key and value, from shared memory
            for (int i = threadIdx.x; i < d; i += GRP_THREADS) {
                cache_store(kt + mine * row, a.cache_fmt, i, kn[i]);
                cache_store(vt + mine * row, a.cache_fmt, i, vn[i]);
            }
            __syncthreads();
        }
        // Scores: a warp 8 keys (one n-tile), d / 16 products over the head's dims.
        if (warp < tile / 8) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            const uint8_t* key_row = kt + (warp * 8 + mr) * row;
            for (int kd = 0; kd < d; kd += 16) {
                uint32_t af[4] = {lds32(&q16[mr][kd + 2 * tig]), lds32(&q16[mr + 8][kd + 2 * tig]), lds32(&q16[mr][kd + 8 + 2 * tig]), lds32(&q16[mr + 8][kd + 8 + 2 * tig])};
                uint32_t bf[2] = {lds32(key_row + 2 * (kd + 2 * tig)), lds32(key_row + 2 * (kd + 8 + 2 * tig))};
                mma16816(c, af, bf, bf16);
            }
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = mr + 8 * (e >> 1), j = warp * 8 + 2 * tig + (e & 1);
                if (r < rep) {
                    float s = c[e] * a.scale;
                    if (a.softcap > 0.f) s = tanhf(s / a.softcap) * a.softcap;
                    probs[r][j] = j < n ? s : -INFINITY;
                }
            }
        }
        __syncthreads();
        for (int r = warp; r < rep; r += GRP_WARPS) {
            float s[GRP_TILE / 32], mx = -INFINITY, total = 0.f;
#pragma unroll
            for (int e = 0; e < GRP_TILE / 32; e++) s[e] = lane + 32 * e < n ? probs[r][lane + 32 * e] : -INFINITY, mx = fmaxf(mx, s[e]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            float m = run_max[r], mn = fmaxf(m, mx);
            float c = m == -INFINITY ? 0.f : exp2f((m - mn) * LOG2E);
#pragma unroll
            for (int e = 0; e < GRP_TILE / 32; e++) {
                float p = s[e] == -INFINITY ? 0.f : exp2f((s[e] - mn) * LOG2E);
                if (lane + 32 * e < tile) p16[r][lane + 32 * e] = to_bits16(p, bf16);
                total += p;
            }
            total = warp_sum(total);
            if (lane == 0) run_sum[r] = run_sum[r] * c + total, run_max[r] = mn, rescale[r] = c;
        }
        __syncthreads();
        // Values: the sums rescaled, then probabilities (16 rows x the tile's keys) times the
        // tile's values, a warp its n-tiles of 8 columns.
        float rs0 = mr < rep ? rescale[mr] : 0.f, rs1 = mr + 8 < rep ? rescale[mr + 8] : 0.f;
        uint32_t pf[GRP_TILE / 16][4];
#pragma unroll
        for (int ks = 0; ks < GRP_TILE / 16; ks++) {
            if (16 * ks >= tile) break;
            int kk = 16 * ks + 2 * tig;
            pf[ks][0] = lds32(&p16[mr][kk]), pf[ks][1] = lds32(&p16[mr + 8][kk]), pf[ks][2] = lds32(&p16[mr][kk + 8]), pf[ks][3] = lds32(&p16[mr + 8][kk + 8]);
        }
#pragma unroll
        for (int i = 0; i < NT; i++) {
            int nt = warp + GRP_WARPS * i;
            if (nt < d / 8) {
                float* c = acc + 4 * i;
                c[0] *= rs0, c[1] *= rs0, c[2] *= rs1, c[3] *= rs1;
                const uint8_t* col = vt + 2 * (nt * 8 + mr);
#pragma unroll
                for (int ks = 0; ks < GRP_TILE / 16; ks++) {
                    if (16 * ks >= tile) break;  // (rows past the tile are the next stage's)
                    const uint8_t* v = col + (16 * ks + 2 * tig) * row;
                    uint32_t bf[2] = {pack16(v, v + row), pack16(v + 8 * row, v + 9 * row)};
                    mma16816(c, pf[ks], bf, bf16);
                }
            }
        }
        __syncthreads();  // the stage and the probabilities are free again
    }
    cp_async_wait<0>();
    // The trace's "ready" here: a block's stage is its q/k/v and its tiles, its work the wait for
    // its group and the merge.
    trace_mark(a.trace, &trace_ready);
    // This block's state as tagged words (values, then each head's max and sum): a reader takes
    // each word once it carries this step's tag, so no fence or flag orders them.
    size_t stride = (size_t)rep * (d + 2);
    float* parts = a.partial + 2 * (size_t)g * splits * stride;
    float* own = parts + 2 * (size_t)split * stride;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        int col = 8 * (warp + GRP_WARPS * i) + 2 * tig;
        if (col < d) {
            if (mr < rep) store_tagged(own, mr * d + col, acc[4 * i], tag), store_tagged(own, mr * d + col + 1, acc[4 * i + 1], tag);
            if (mr + 8 < rep) store_tagged(own, (mr + 8) * d + col, acc[4 * i + 2], tag), store_tagged(own, (mr + 8) * d + col + 1, acc[4 * i + 3], tag);
        }
    }
    if (threadIdx.x < rep) store_tagged(own, rep * d + threadIdx.x, run_max[threadIdx.x], tag), store_tagged(own, rep * d + rep + threadIdx.x, run_sum[threadIdx.x], tag);
    // This block's units of the group's outputs, 32 values of one head each. A warp takes the
    // splits warp + GRP_WARPS·k (k < 16) and loads all it needs at once: a lane its column of
    // each split's values, and lane k (16 + k) split k's max (sum). It folds them, then warp 0
    // folds the warps'.
    constexpr int PER_WARP = GRP_MAX_SPLITS / GRP_WARPS;
    for (int unit = split; unit < rep * d / 32; unit += used) {
        int r = unit * 32 / d, col = unit * 32 % d;
        int at[PER_WARP + 1];
        unsigned long long words[PER_WARP + 1], since = 0;
#pragma unroll
        for (int k = 0; k < PER_WARP; k++) {
            int s = warp + GRP_WARPS * k;
            at[k] = s < used ? (int)(s * stride) + r * d + col + lane : -1;
        }
        int mine = warp + GRP_WARPS * (lane & 15);
        at[PER_WARP] = mine < used ? (int)(mine * stride) + rep * d + (lane < 16 ? 0 : rep) + r : -1;
        poll_tagged<PER_WARP + 1>(reinterpret_cast<const unsigned long long*>(parts), at, tag, words, &since);
        float own_ml = __uint_as_float((unsigned)words[PER_WARP]);  // absent: 0
        float m = lane < 16 && mine < used ? own_ml : -INFINITY, mx = m;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        float c = m == -INFINITY ? 0.f : exp2f((m - mx) * LOG2E);  // lane k: split k's weight
        float c_of_mine = __shfl_sync(0xffffffffu, c, lane & 15);
        float sum = warp_sum(lane >= 16 ? c_of_mine * own_ml : 0.f), num = 0.f;
#pragma unroll
        for (int k = 0; k < PER_WARP; k++) num = fmaf(__shfl_sync(0xffffffffu, c, k), __uint_as_float((unsigned)words[k]), num);
        if (lane == 0) warp_max[warp] = mx, warp_total[warp] = sum;
        warp_num[warp][lane] = num;
        __syncthreads();
        if (warp == 0) {
            float top = -INFINITY, den = 0.f, v = 0.f;
#pragma unroll
            for (int w = 0; w < GRP_WARPS; w++) top = fmaxf(top, warp_max[w]);
#pragma unroll
            for (int w = 0; w < GRP_WARPS; w++) {
                float cw = warp_max[w] == -INFINITY ? 0.f : exp2f((warp_max[w] - top) * LOG2E);
                den = fmaf(cw, warp_total[w], den);
                v = fmaf(cw, warp_num[w][lane], v);
            }
            v /= den;
            int at = (h0 + r) * d + col;
            if (a.out_q8) store_q8_tagged(a.out, a.heads * d, at, v, tag);
            else if (a.tagged) store_tagged(a.out, at + lane, v, tag);
            else a.out[at + lane] = v;
        }
        __syncthreads();
    }
    trace_block(a.trace, a.launch);
}

// Any head dim (a multiple of 32 up to ATTN_MAX_D), and the common ones compiled for theirs.
extern "C" __global__ void __launch_bounds__(GRP_THREADS, 2) attend_group(AttnArgs a) { attend_group_body<0>(a); }
extern "C" __global__ void __launch_bounds__(GRP_THREADS, 2) attend_group_d64(AttnArgs a) { attend_group_body<64>(a); }
extern "C" __global__ void __launch_bounds__(GRP_THREADS, 2) attend_group_d128(AttnArgs a) { attend_group_body<128>(a); }

// Each of this thread's logits, `f(value, index)`: float4s strided over the block, four loads in
// flight, where the row is 16-byte aligned (the logits are in L2: the latency of one load at a
// time, not bandwidth, bounds a pass), then the tail. Indices reach a thread in increasing order.
template <typename F>
__device__ __forceinline__ void strided_logits(const float* logits, int n, F f) {
    int vec = ((uintptr_t)logits & 15) == 0 ? n >> 2 : 0;
    const float4* l4 = reinterpret_cast<const float4*>(logits);
#pragma unroll 4
    for (int i = threadIdx.x; i < vec; i += blockDim.x) {
        float4 q = l4[i];
        f(q.x, 4 * i), f(q.y, 4 * i + 1), f(q.z, 4 * i + 2), f(q.w, 4 * i + 3);
    }
    for (int i = 4 * vec + threadIdx.x; i < n; i += blockDim.x) f(logits[i], i);
}

// The largest of `n` logits (NaN skipped, as f32::max does), for every thread of the block.
__device__ float row_max(const float* logits, int n) {
    __shared__ float maxes[32];
    int lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    float m = -INFINITY;
    strided_logits(logits, n, [&](float l, int) { m = fmaxf(m, l); });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) maxes[threadIdx.x >> 5] = m;
    __syncthreads();
    m = -INFINITY;
    for (int w = 0; w < nw; w++) m = fmaxf(m, maxes[w]);
    return m;
}

// A token's sampling weight, exp((l - max) / T), 0 below max - 40T (`floor`) or for NaN, as the
// CPU sampler's `to_weights` gives it.
__device__ __forceinline__ float sample_weight(float l, float m, float floor, float scale) {
    return l >= floor ? expf((l - m) * scale) : 0.f;
}

// Inclusive prefix sums of `v` over the block's threads in thread order, added in a fixed order
// (within each warp, then over the warps' totals), so a run repeats; `total` gets the block's
// sum. Every thread of the block calls it.
template <typename T>
__device__ T block_scan(T v, T* total) {
    __shared__ T warp_sums[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        T u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
    }
    if (lane == 31) warp_sums[w] = v;
    __syncthreads();
    if (w == 0) {
        T s = lane < nw ? warp_sums[lane] : (T)0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            T u = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += u;
        }
        if (lane < nw) warp_sums[lane] = s;
    }
    __syncthreads();
    if (w > 0) v += warp_sums[w - 1];
    *total = warp_sums[nw - 1];
    __syncthreads();  // read by all before a next call writes
    return v;
}

// The weights exp((l - max) / T) of a thread's chunk [lo, hi) of the logits, in token order,
// passed to `f(i, w)`: float4 loads, four in flight, where the chunk is a whole aligned run.
template <typename F>
__device__ __forceinline__ void chunk_weights(const float* logits, int lo, int hi, float m, float floor, float scale, F f) {
    if (((uintptr_t)(logits + lo) & 15) == 0 && ((hi - lo) & 3) == 0) {
        const float4* l4 = reinterpret_cast<const float4*>(logits + lo);
#pragma unroll 4
        for (int i = 0; i < (hi - lo) / 4; i++) {
            float4 q = l4[i];
            f(lo + 4 * i, sample_weight(q.x, m, floor, scale));
            f(lo + 4 * i + 1, sample_weight(q.y, m, floor, scale));
            f(lo + 4 * i + 2, sample_weight(q.z, m, floor, scale));
            f(lo + 4 * i + 3, sample_weight(q.w, m, floor, scale));
        }
    } else {
        for (int i = lo; i < hi; i++) f(i, sample_weight(logits[i], m, floor, scale));
    }
}

// Each thread's contiguous chunk of n tokens: a multiple of 4 long (so float4 loads stay aligned).
__device__ __forceinline__ void token_chunk(int n, int* lo, int* hi) {
    int per = ((n + blockDim.x - 1) / blockDim.x + 3) & ~3;
    *lo = min(n, (int)threadIdx.x * per);
    *hi = min(n, *lo + per);
}

// Draws a token from softmax(logits / temperature) with `r`, a uniform draw in [0, 1) made by the
// host's seeded generator, as the CPU sampler does without top-k, top-p, min-p or penalties:
// weights exp((l - max) / T), 0 below max - 40T, and the first token whose running sum of weights
// passes r times their total. One block of 1024 threads: each sums a contiguous chunk
// (`token_chunk`) in f64; a block-wide scan gives each chunk the sum before it; the chunk where
// the running sum passes the target is walked token by token by its thread. Every thread gets
// the token.
__device__ unsigned draw_temperature(const float* logits, int n, float temperature, double r) {
    __shared__ int chunk, last;
    __shared__ unsigned picked;
    int t = threadIdx.x, lo, hi;
    if (t == 0) chunk = 0x7fffffff, last = -1;
    float m = row_max(logits, n);  // its barrier also publishes `chunk` and `last`
    float floor = m - 40.f * temperature, scale = 1.f / temperature;
    token_chunk(n, &lo, &hi);
    double s = 0.0, total;
    chunk_weights(logits, lo, hi, m, floor, scale, [&](int, float w) { s += (double)w; });
    double incl = block_scan(s, &total), excl = incl - s, target = r * total;
    // The first chunk with weight whose running sum passes the target; else (rounding left the
    // target beyond the total) the last chunk with weight, walked whole.
    if (s > 0.0 && target < incl) atomicMin(&chunk, t);
    if (s > 0.0) atomicMax(&last, t);
    __syncthreads();
    int c = chunk == 0x7fffffff ? last : chunk;
    if (c < 0) c = 0;  // no weight at all (only NaN): the first token, as below
    if (t == c) {
        double acc = excl, goal = chunk == 0x7fffffff ? INFINITY : target;
        unsigned pick = (unsigned)lo;
        for (int i = lo; i < hi; i++) {
            float wt = sample_weight(logits[i], m, floor, scale);
            if (wt == 0.f) continue;
            acc += (double)wt;
            pick = (unsigned)i;
            if (goal < acc) break;
        }
        picked = pick;
    }
    __syncthreads();
    return picked;
}

// Only the token id leaves the GPU.
extern "C" __global__ void __launch_bounds__(1024) sample_temperature(const float* logits, int n, float temperature, double r, unsigned* out) {
    unsigned id = draw_temperature(logits, n, temperature, r);
    if (threadIdx.x == 0) *out = id;
}

// The first of the largest logits (NaN never wins; only NaN: token 0, as the CPU sampler's
// `argmax` says), for every thread of the block.
__device__ unsigned row_argmax(const float* logits, int n) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    int lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    float v = -INFINITY;
    int at = -1;
    // Indices reach a thread in increasing order, so a strict > keeps the first of equal values.
    strided_logits(logits, n, [&](float l, int i) {
        if (l > v || (at < 0 && l == l)) v = l, at = i;
    });
    // (v, at) takes (ov, oa) when that is larger, or equal at a lower index; none (-1) loses.
    auto take = [&](float ov, int oa) {
        if (oa >= 0 && (at < 0 || ov > v || (ov == v && oa < at))) v = ov, at = oa;
    };
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) take(__shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, at, o));
    if (lane == 0) best_v[threadIdx.x >> 5] = v, best_i[threadIdx.x >> 5] = at;
    __syncthreads();
    for (int w = 0; w < nw; w++) take(best_v[w], best_i[w]);
    return at < 0 ? 0u : (unsigned)at;
}

// The argmax of a row of logits (greedy decoding's pick where the host waits for it).
extern "C" __global__ void __launch_bounds__(1024) argmax_row(const float* logits, int n, unsigned* out) {
    unsigned id = row_argmax(logits, n);
    if (threadIdx.x == 0) *out = id;
}

// The next token of a sequence decoded on the GPU: the argmax (temperature 0) or a temperature
// draw with `r`, written where the next step's embedding reads it (`next`) and into page-locked
// host memory (`host`, mapped) for the host to read once this kernel is done. One block of 1024.
extern "C" __global__ void __launch_bounds__(1024) pick_token(const float* logits, int n, float temperature, double r, unsigned* next, unsigned* host) {
    unsigned id = temperature == 0.f ? row_argmax(logits, n) : draw_temperature(logits, n, temperature, r);
    if (threadIdx.x == 0) {
        *next = id;
        *(volatile unsigned*)host = id;
    }
}

// The candidates of a sampled step with top-k, top-p or min-p, as the CPU sampler's
// `distribution` gathers them before its cuts: weights exp((l - max) / T) (0 below max - 40T),
// their total (f64, chunk sums added in order), and in token order every token whose weight is
// > 0 and at least the lightest a candidate can weigh: with top_k > 0 the first of e^-1, e^-4,
// e^-16 that top_k tokens reach (else 0), otherwise max(min_p, (1 - top_p) · total / n). Writes
// out[0] = the number of candidates, out[2..4] = the total (a double), then the first `cap`
// candidates as (id, weight bits) pairs. One block of 1024 threads, each taking a contiguous chunk.
extern "C" __global__ void __launch_bounds__(1024) sample_candidates(const float* logits, int n, float temperature, int top_k, float top_p, float min_p, int cap, unsigned* out) {
    __shared__ unsigned reach[3];
    const float cuts[3] = {0.36787944117f, 0.018315638889f, 1.1253517472e-07f};  // e^-1, e^-4, e^-16
    int t = threadIdx.x, lo, hi;
    if (t < 3) reach[t] = 0;
    float m = row_max(logits, n);  // its barrier also publishes `reach`
    float floor = m - 40.f * temperature, scale = 1.f / temperature;
    token_chunk(n, &lo, &hi);
    double s = 0.0, all;
    unsigned k[3] = {0, 0, 0};
    chunk_weights(logits, lo, hi, m, floor, scale, [&](int, float w) {
        s += (double)w;
#pragma unroll
        for (int c = 0; c < 3; c++) k[c] += w >= cuts[c];
    });
#pragma unroll
    for (int c = 0; c < 3; c++) atomicAdd(&reach[c], k[c]);
    block_scan(s, &all);  // its barriers also publish `reach`
    float lightest = 0.f;
    if (top_k > 0) {
        for (int c = 0; c < 3; c++)
            if (reach[c] >= (unsigned)top_k) {
                lightest = cuts[c];
                break;
            }
    } else {
        lightest = fmaxf(min_p, (float)((1.0 - (double)top_p) * all / (double)n));
    }
    unsigned count = 0, candidates;
    chunk_weights(logits, lo, hi, m, floor, scale, [&](int, float w) { count += w > 0.f && w >= lightest; });
    unsigned at = block_scan(count, &candidates) - count;
    if (t == 0) {
        out[0] = candidates;
        *reinterpret_cast<double*>(out + 2) = all;
    }
    if (at < (unsigned)cap)
        chunk_weights(logits, lo, hi, m, floor, scale, [&](int i, float w) {
            if (w > 0.f && w >= lightest && at < (unsigned)cap) {
                out[4 + 2 * at] = (unsigned)i;
                out[5 + 2 * at] = __float_as_uint(w);
                at++;
            }
        });
}

// ---- Prompts (t > 1): attention's softmax and the MLP's gated product, each in one pass ----
// candle's ops took a pass each for the scale, the mask (built per layer, added through its
// strided broadcast kernel) and the softmax, and two strided passes for act(gate) * up; on a
// 7B f16 model's 4,096-token prompt those were about 60% of the prompt's time (session 48).

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : -INFINITY;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

// One block a row of raw scores q·k (rows ordered query-fastest: row r is query r % t, at
// position start + r % t; key j at position first_key + j), replaced by its probabilities:
// softmax over the visible keys (k <= q, and q - k < window when window > 0) of the score times
// `scale`, soft-capped as cap · tanh(x / cap) when softcap > 0; hidden keys get 0.
template <typename T>
__device__ void attention_softmax(T* s, int keys, int t, long long start, long long first_key, int window, float scale, float softcap) {
    __shared__ float scratch[32];
    T* row = s + (long long)blockIdx.x * keys;
    long long q = start + blockIdx.x % t;
    int hi = (int)min((long long)keys, q - first_key + 1);
    int lo = window > 0 ? (int)max(0LL, q - window + 1 - first_key) : 0;
    auto logit = [&](int j) {
        float x = as_float(row[j]) * scale;
        return softcap > 0.f ? tanhf(x / softcap) * softcap : x;
    };
    float m = -INFINITY;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) m = fmaxf(m, logit(j));
    m = block_max(m, scratch);
    float sum = 0.f;
    for (int j = lo + threadIdx.x; j < hi; j += blockDim.x) sum += __expf(logit(j) - m);
    float inv = 1.f / block_sum(sum, scratch);
    for (int j = threadIdx.x; j < keys; j += blockDim.x) row[j] = from_float<T>(j >= lo && j < hi ? __expf(logit(j) - m) * inv : 0.f);
}

extern "C" __global__ void __launch_bounds__(256) attention_softmax_f32(float* s, int keys, int t, long long start, long long first_key, int window, float scale, float softcap) {
    attention_softmax(s, keys, t, start, first_key, window, scale, softcap);
}
extern "C" __global__ void __launch_bounds__(256) attention_softmax_f16(__half* s, int keys, int t, long long start, long long first_key, int window, float scale, float softcap) {
    attention_softmax(s, keys, t, start, first_key, window, scale, softcap);
}
extern "C" __global__ void __launch_bounds__(256) attention_softmax_bf16(__nv_bfloat16* s, int keys, int t, long long start, long long first_key, int window, float scale, float softcap) {
    attention_softmax(s, keys, t, start, first_key, window, scale, softcap);
}

// out[r, c] = act(gate[r, c]) * up[r, c] over `rows` rows of `cols` values, the inputs' rows
// `gate_stride` and `up_stride` elements apart (views of one stacked gate/up product), `out`
// contiguous; act is SiLU (MODE_SILU) or GELU's tanh form (MODE_GELU_TANH), in f32, rounded once.
template <typename T>
__device__ void gated_product(const T* gate, const T* up, T* out, long long rows, int cols, long long gate_stride, long long up_stride, int act) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    long long r = i / cols;
    int c = (int)(i - r * cols);
    float g = as_float(gate[r * gate_stride + c]), u = as_float(up[r * up_stride + c]);
    float a = act == MODE_SILU ? g / (1.f + __expf(-g)) : 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    out[i] = from_float<T>(a * u);
}

extern "C" __global__ void __launch_bounds__(256) gated_product_f32(const float* g, const float* u, float* o, long long rows, int cols, long long gs, long long us, int act) {
    gated_product(g, u, o, rows, cols, gs, us, act);
}
extern "C" __global__ void __launch_bounds__(256) gated_product_f16(const __half* g, const __half* u, __half* o, long long rows, int cols, long long gs, long long us, int act) {
    gated_product(g, u, o, rows, cols, gs, us, act);
}
extern "C" __global__ void __launch_bounds__(256) gated_product_bf16(const __nv_bfloat16* g, const __nv_bfloat16* u, __nv_bfloat16* o, long long rows, int cols, long long gs, long long us, int act) {
    gated_product(g, u, o, rows, cols, gs, us, act);
}
