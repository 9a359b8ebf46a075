//! Activation quantization: f32 rows become 8-bit blocks that the integer dot products read,
//! `Q8K` (256 values, f32 scale, partial sums) for the k-quants and `Q8x4` (four 32-value blocks)
//! for the 32-element formats. Rounding follows llama.cpp's x86 build (ties to even; Q8_0's
//! inverse scale is `127 / amax`), so activations quantize as in the engine we are compared with.
//! The values are stored in the "step order" the repacked weights use (see `portable.rs`): one
//! 32-byte load gives 4 (`Q8K`) or 8 (`Q8x4`) consecutive values of each of 8 sub-blocks, so
//! each 32-bit lane of an integer dot product sums one sub-block and scales apply per lane.
//! It does not quantize weights: GGUF weights arrive quantized and are only copied (and reordered).

/// 256 activations as `d * value`. `qs[32 k + 4 s + e]` is value `32 s + 4 k + e` (k, s < 8,
/// e < 4). With `bl[s]` / `bh[s]` the sums of values `32 s .. 32 s + 16` / `32 s + 16 .. 32 s + 32`,
/// the partial sums the kernels' corrections take are stored ready to use: `ybs[s] = d (bl[s] +
/// bh[s])` (Q4_K's mins) and `nbl[s] = -32 bl[s]`, `nbh[s] = -32 bh[s]` (Q6_K's offset of 32).
#[derive(Debug, Clone, Copy)]
/// `qs` comes first so that every 32-byte load of it is aligned and stays within a cache line.
#[repr(C, align(32))]
pub struct Q8K {
    pub qs: [i8; 256],
    pub ybs: [f32; 8],
    pub nbl: [i32; 8],
    pub nbh: [i32; 8],
    pub d: f32,
}

impl Default for Q8K {
    fn default() -> Self {
        Q8K { ybs: [0.0; 8], nbl: [0; 8], nbh: [0; 8], d: 0.0, qs: [0; 256] }
    }
}

/// Four 32-value blocks (128 activations). Block `s` is `d[2 s] * value` (`d[2 s + 1]` repeats
/// it: one scale per 32-bit lane); `qs[32 k + 8 s + e]` is value `8 k + e` of block `s` (k, s < 4,
/// e < 8), and `lsum[l]` the sum of the values in lane `l` (bytes `4 l .. 4 l + 4` of each step).
/// Each `d` is rounded through f16 as ggml stores it.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
pub struct Q8x4 {
    pub d: [f32; 8],
    pub lsum: [i32; 8],
    pub qs: [i8; 128],
}

impl Default for Q8x4 {
    fn default() -> Self {
        Q8x4 { d: [0.0; 8], lsum: [0; 8], qs: [0; 128] }
    }
}

/// The signed value of largest magnitude (the first one on ties), as ggml picks it.
#[inline]
fn signed_absmax(xs: &[f32]) -> (f32, f32) {
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let max = xs.iter().copied().find(|x| x.abs() == amax).unwrap_or(0.0);
    (amax, max)
}

/// Quantizes `xs` (a multiple of 256 long) into `out` (one block per 256 values), portably.
pub fn quantize_q8k_portable(xs: &[f32], out: &mut [Q8K]) {
    for (y, x) in out.iter_mut().zip(xs.chunks_exact(256)) {
        let (amax, max) = signed_absmax(x);
        if amax == 0.0 || !amax.is_finite() {
            *y = Q8K::default();
            continue;
        }
        let iscale = -127f32 / max;
        let mut nat = [0i8; 256];
        for (q, &v) in nat.iter_mut().zip(x) {
            *q = (iscale * v).round_ties_even().clamp(-128.0, 127.0) as i8;
        }
        finish_q8k(y, &nat, 1.0 / iscale);
    }
}

/// Scale, sums and step order of a block from its values in natural order.
pub(crate) fn finish_q8k(y: &mut Q8K, nat: &[i8; 256], d: f32) {
    let sum = |r: &[i8]| r.iter().map(|&q| q as i32).sum::<i32>();
    y.d = d;
    for s in 0..8 {
        let (bl, bh) = (sum(&nat[32 * s..32 * s + 16]), sum(&nat[32 * s + 16..32 * s + 32]));
        y.ybs[s] = d * (bl + bh) as f32;
        y.nbl[s] = -32 * bl;
        y.nbh[s] = -32 * bh;
        for k in 0..8 {
            y.qs[32 * k + 4 * s..32 * k + 4 * s + 4].copy_from_slice(&nat[32 * s + 4 * k..32 * s + 4 * k + 4]);
        }
    }
}

/// Step order and lane sums of four blocks from their values in natural order.
pub(crate) fn finish_q8x4(y: &mut Q8x4, nat: &[i8; 128], ds: [f32; 4]) {
    for s in 0..4 {
        y.d[2 * s] = ds[s];
        y.d[2 * s + 1] = ds[s];
        for k in 0..4 {
            y.qs[32 * k + 8 * s..32 * k + 8 * s + 8].copy_from_slice(&nat[32 * s + 8 * k..32 * s + 8 * k + 8]);
        }
    }
    for l in 0..8 {
        y.lsum[l] = (0..4).map(|k| y.qs[32 * k + 4 * l..32 * k + 4 * l + 4].iter().map(|&q| q as i32).sum::<i32>()).sum();
    }
}

/// Quantizes `xs` (a multiple of 128 long) into `out` (one `Q8x4` per 128 values), portably.
pub fn quantize_q8x4_portable(xs: &[f32], out: &mut [Q8x4]) {
    for (y, x) in out.iter_mut().zip(xs.chunks_exact(128)) {
        let mut nat = [0i8; 128];
        let mut ds = [0f32; 4];
        for (s, x) in x.chunks_exact(32).enumerate() {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            ds[s] = half::f16::from_f32(d).to_f32();
            for (q, &v) in nat[32 * s..32 * s + 32].iter_mut().zip(x) {
                *q = (v * id).round_ties_even().clamp(-128.0, 127.0) as i8;
            }
        }
        finish_q8x4(y, &nat, ds);
    }
}

/// Quantizes with the fastest implementation this CPU has.
pub fn quantize_q8k(xs: &[f32], out: &mut [Q8K]) {
    #[cfg(target_arch = "x86_64")]
    if super::x86::has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
        unsafe { super::x86::avx2::quantize_q8k(xs, out) };
        return;
    }
    quantize_q8k_portable(xs, out)
}

/// Quantizes with the fastest implementation this CPU has.
pub fn quantize_q8x4(xs: &[f32], out: &mut [Q8x4]) {
    #[cfg(target_arch = "x86_64")]
    if super::x86::has_avx2() {
        // SAFETY: as above.
        unsafe { super::x86::avx2::quantize_q8x4(xs, out) };
        return;
    }
    quantize_q8x4_portable(xs, out)
}
