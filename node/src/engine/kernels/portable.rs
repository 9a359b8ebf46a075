//! Portable kernels: GGUF block decoding, row dequantization and the integer dot products of
//! each weight format with quantized activations, in plain Rust written so that the compiler
//! vectorizes it (this is the path on CPUs without a hand-written one, NEON included).
//! They are also the reference the SIMD kernels are tested against. No `unsafe` here.

use super::act::{Q8K, Q8_0};

#[inline]
pub fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// The eight 6-bit scales and mins of a Q4_K block (its 12 `scales` bytes).
#[inline]
pub fn q4k_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        if j < 4 {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
    (sc, mn)
}

/// The 256 4-bit values of a Q4_K block, in order.
#[inline]
fn q4k_values(qs: &[u8]) -> [u8; 256] {
    let mut v = [0u8; 256];
    for j in 0..4 {
        for l in 0..32 {
            v[64 * j + l] = qs[32 * j + l] & 0xF;
            v[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
    }
    v
}

/// The 256 6-bit values of a Q6_K block, offset by -32, in order.
#[inline]
fn q6k_values(ql: &[u8], qh: &[u8]) -> [i8; 256] {
    let mut v = [0i8; 256];
    for h in 0..2 {
        let (ql, qh) = (&ql[64 * h..], &qh[32 * h..]);
        for l in 0..32 {
            let o = 128 * h + l;
            v[o] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            v[o + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            v[o + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            v[o + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    v
}

/// The 32 5-bit values of a Q5_0 block, offset by -16, in order.
#[inline]
fn q5_0_values(b: &[u8]) -> [i8; 32] {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    let mut v = [0i8; 32];
    for j in 0..16 {
        v[j] = ((qs[j] & 0xF) | ((((qh >> j) & 1) as u8) << 4)) as i8 - 16;
        v[j + 16] = ((qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4)) as i8 - 16;
    }
    v
}

#[inline]
fn idot<A: Copy + Into<i32>>(w: &[A], a: &[i8]) -> i32 {
    w.iter().zip(a).map(|(&w, &a)| w.into() * a as i32).sum()
}

pub fn dot_q4k(w: &[u8], a: &[Q8K]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in w.chunks_exact(144).zip(a) {
        let (sc, mn) = q4k_scales_mins(&b[4..16]);
        let v = q4k_values(&b[16..144]);
        let mut isum = 0i32;
        let mut msum = 0i32;
        for j in 0..8 {
            isum += sc[j] as i32 * idot(&v[32 * j..32 * j + 32], &y.qs[32 * j..32 * j + 32]);
            msum += mn[j] as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
        }
        sum += f16_at(b, 0) * y.d * isum as f32 - f16_at(b, 2) * y.d * msum as f32;
    }
    sum
}

pub fn dot_q6k(w: &[u8], a: &[Q8K]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in w.chunks_exact(210).zip(a) {
        let v = q6k_values(&b[0..128], &b[128..192]);
        let mut isum = 0i32;
        for g in 0..16 {
            isum += (b[192 + g] as i8) as i32 * idot(&v[16 * g..16 * g + 16], &y.qs[16 * g..16 * g + 16]);
        }
        sum += f16_at(b, 208) * y.d * isum as f32;
    }
    sum
}

pub fn dot_q8_0(w: &[u8], a: &[Q8_0]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in w.chunks_exact(34).zip(a) {
        let q: &[i8] = bytemuck_i8(&b[2..34]);
        sum += f16_at(b, 0) * y.d * idot(q, &y.qs) as f32;
    }
    sum
}

pub fn dot_q5_0(w: &[u8], a: &[Q8_0]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in w.chunks_exact(22).zip(a) {
        sum += f16_at(b, 0) * y.d * idot(&q5_0_values(b), &y.qs) as f32;
    }
    sum
}

fn bytemuck_i8(b: &[u8]) -> &[i8] {
    // SAFETY: i8 and u8 have the same size, alignment and validity.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const i8, b.len()) }
}

pub fn dequantize_q4k(w: &[u8], out: &mut [f32]) {
    for (b, o) in w.chunks_exact(144).zip(out.chunks_exact_mut(256)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (sc, mn) = q4k_scales_mins(&b[4..16]);
        let v = q4k_values(&b[16..144]);
        for (i, o) in o.iter_mut().enumerate() {
            *o = d * sc[i / 32] as f32 * v[i] as f32 - dmin * mn[i / 32] as f32;
        }
    }
}

pub fn dequantize_q6k(w: &[u8], out: &mut [f32]) {
    for (b, o) in w.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(b, 208);
        let v = q6k_values(&b[0..128], &b[128..192]);
        for (i, o) in o.iter_mut().enumerate() {
            *o = d * (b[192 + i / 16] as i8) as f32 * v[i] as f32;
        }
    }
}

pub fn dequantize_q8_0(w: &[u8], out: &mut [f32]) {
    for (b, o) in w.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        for (o, &q) in o.iter_mut().zip(&b[2..34]) {
            *o = d * (q as i8) as f32;
        }
    }
}

pub fn dequantize_q5_0(w: &[u8], out: &mut [f32]) {
    for (b, o) in w.chunks_exact(22).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        for (o, q) in o.iter_mut().zip(q5_0_values(b)) {
            *o = d * q as f32;
        }
    }
}
