//! Activation quantization: f32 rows become 8-bit blocks that the integer dot products read,
//! `Q8K` (256 values, f32 scale, 16 partial sums) for the k-quants and `Q8_0` (32 values) for
//! the 32-element formats. Rounding follows llama.cpp's x86 build (ties to even; Q8_0's inverse
//! scale is `127 / amax`), so activations quantize as in the engine we are compared with.
//! It does not quantize weights: GGUF weights arrive quantized and are only copied.

/// 256 activations as `d * qs[i]`, with `bsums[j]` the sum of `qs[16 j .. 16 j + 16]`.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct Q8K {
    pub d: f32,
    pub qs: [i8; 256],
    pub bsums: [i16; 16],
}

impl Default for Q8K {
    fn default() -> Self {
        Q8K { d: 0.0, qs: [0; 256], bsums: [0; 16] }
    }
}

/// 32 activations as `d * qs[i]`; `d` is rounded through f16 as ggml stores it.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
pub struct Q8_0 {
    pub d: f32,
    pub qs: [i8; 32],
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
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = (iscale * v).round_ties_even().clamp(-128.0, 127.0) as i8;
        }
        fill_bsums(y);
        y.d = 1.0 / iscale;
    }
}

pub(crate) fn fill_bsums(y: &mut Q8K) {
    for j in 0..16 {
        y.bsums[j] = y.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum::<i32>() as i16;
    }
}

/// Quantizes `xs` (a multiple of 32 long) into `out`, portably.
pub fn quantize_q8_0_portable(xs: &[f32], out: &mut [Q8_0]) {
    for (y, x) in out.iter_mut().zip(xs.chunks_exact(32)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        y.d = half::f16::from_f32(d).to_f32();
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = (v * id).round_ties_even().clamp(-128.0, 127.0) as i8;
        }
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
pub fn quantize_q8_0(xs: &[f32], out: &mut [Q8_0]) {
    #[cfg(target_arch = "x86_64")]
    if super::x86::has_avx2() {
        // SAFETY: as above.
        unsafe { super::x86::avx2::quantize_q8_0(xs, out) };
        return;
    }
    quantize_q8_0_portable(xs, out)
}
