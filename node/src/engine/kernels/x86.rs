//! x86-64 kernels, chosen at run time: the integer dot products of each GGUF weight format with
//! 8-bit activations for `R` activation rows at once (R = 1 for decode; larger R reuses each
//! unpacked weight register across prompt rows), and activation quantization. One source is
//! compiled twice: for AVX2 + FMA + F16C (`avx2`), and with AVX-512 (BW, VL, VNNI) also enabled
//! (`avx512`), where the compiler gets 32 vector registers and fuses multiply-adds (vpdpwssd).
//! The layouts follow ggml's blocks as stored in the file. Nothing here allocates or branches on
//! data; every function is checked against `portable.rs` in the tests.

use std::arch::x86_64::*;

use super::act::{fill_bsums, Q8K, Q8_0};

pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

pub fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

#[inline(always)]
unsafe fn f16(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)))
}

#[inline(always)]
unsafe fn hsum128(s: __m128) -> f32 {
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

#[inline(always)]
unsafe fn loadu(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

macro_rules! kernels {
    ($features:literal) => {
        /// Dot products of one Q4_K row with `R` Q8_K activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q4k<const R: usize>(w: &[u8], a: [&[Q8K]; R]) -> [f32; R] {
            const KMASK1: u32 = 0x3f3f3f3f;
            const KMASK2: u32 = 0x0f0f0f0f;
            const KMASK3: u32 = 0x03030303;
            let nb = w.len() / 144;
            for r in a.iter() {
                assert!(r.len() >= nb);
            }
            let m4 = _mm256_set1_epi8(0xF);
            let mut acc = [_mm256_setzero_ps(); R];
            let mut accm = [_mm_setzero_ps(); R];
            for i in 0..nb {
                let b = w.as_ptr().add(144 * i);
                let d = f16(b);
                let dmin = f16(b.add(2));
                let mut utmp = [0u32; 4];
                std::ptr::copy_nonoverlapping(b.add(4), utmp.as_mut_ptr() as *mut u8, 12);
                utmp[3] = ((utmp[2] >> 4) & KMASK2) | (((utmp[1] >> 6) & KMASK3) << 4);
                let uaux = utmp[1] & KMASK1;
                utmp[1] = (utmp[2] & KMASK2) | (((utmp[0] >> 6) & KMASK3) << 4);
                utmp[2] = uaux;
                utmp[0] &= KMASK1;
                let mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3] as i32, utmp[2] as i32, utmp[1] as i32, utmp[0] as i32));
                let mins = _mm256_extracti128_si256(mins_and_scales, 1);
                let scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(mins_and_scales));
                let mut sumi = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    let q8sums = _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i);
                    let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(q8sums), _mm256_extracti128_si256(q8sums, 1));
                    let prod = _mm_madd_epi16(mins, q8s);
                    accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * y.d), _mm_cvtepi32_ps(prod), accm[r]);
                }
                let q4 = b.add(16);
                for j in 0..4 {
                    let scale_l = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((((4 * j + 1) << 8) | (4 * j)) as i16));
                    let scale_h = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((((4 * j + 3) << 8) | (4 * j + 2)) as i16));
                    let bits = loadu(q4.add(32 * j));
                    let q4l = _mm256_and_si256(bits, m4);
                    let q4h = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                    for r in 0..R {
                        let q8 = a[r].get_unchecked(i).qs.as_ptr().add(64 * j) as *const u8;
                        let pl = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, loadu(q8)));
                        let ph = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, loadu(q8.add(32))));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
                    }
                }
                for r in 0..R {
                    let yd = a[r].get_unchecked(i).d;
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * yd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r]) - hsum128(accm[r]);
            }
            out
        }

        /// Dot products of one Q6_K row with `R` Q8_K activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q6k<const R: usize>(w: &[u8], a: [&[Q8K]; R]) -> [f32; R] {
            let nb = w.len() / 210;
            for r in a.iter() {
                assert!(r.len() >= nb);
            }
            let m4 = _mm256_set1_epi8(0xF);
            let m2 = _mm256_set1_epi8(3);
            let mut acc = [_mm256_setzero_ps(); R];
            for i in 0..nb {
                let b = w.as_ptr().add(210 * i);
                let d = f16(b.add(208));
                let scales = _mm_loadu_si128(b.add(192) as *const __m128i);
                let sc16 = _mm256_cvtepi8_epi16(scales);
                let mut sumi = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    let corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256(y.bsums.as_ptr() as *const __m256i));
                    sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(corr, 5));
                }
                for j in 0..2 {
                    let ql = b.add(64 * j);
                    let qh = b.add(128 + 32 * j);
                    let sc = |k: usize| {
                        let lo = (2 * (4 * j + k)) as i64 * 0x0101010101010101;
                        let hi = (2 * (4 * j + k) + 1) as i64 * 0x0101010101010101;
                        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_set_epi64x(hi, lo)))
                    };
                    let (s0, s1, s2, s3) = (sc(0), sc(1), sc(2), sc(3));
                    let bits1 = loadu(ql);
                    let bits2 = loadu(ql.add(32));
                    let bits_h = loadu(qh);
                    let h0 = _mm256_slli_epi16(_mm256_and_si256(bits_h, m2), 4);
                    let h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits_h, 2), m2), 4);
                    let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits_h, 4), m2), 4);
                    let h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bits_h, 6), m2), 4);
                    let q0 = _mm256_or_si256(_mm256_and_si256(bits1, m4), h0);
                    let q1 = _mm256_or_si256(_mm256_and_si256(bits2, m4), h1);
                    let q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m4), h2);
                    let q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m4), h3);
                    for r in 0..R {
                        let q8 = a[r].get_unchecked(i).qs.as_ptr().add(128 * j) as *const u8;
                        let p0 = _mm256_madd_epi16(s0, _mm256_maddubs_epi16(q0, loadu(q8)));
                        let p1 = _mm256_madd_epi16(s1, _mm256_maddubs_epi16(q1, loadu(q8.add(32))));
                        let p2 = _mm256_madd_epi16(s2, _mm256_maddubs_epi16(q2, loadu(q8.add(64))));
                        let p3 = _mm256_madd_epi16(s3, _mm256_maddubs_epi16(q3, loadu(q8.add(96))));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
                    }
                }
                for r in 0..R {
                    let yd = a[r].get_unchecked(i).d;
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * yd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r]);
            }
            out
        }

        /// Signed 8-bit dot product of 32 pairs as 8 i32 lanes, via the sign trick for `maddubs`.
        #[inline(always)]
        unsafe fn dot_i8(ax: __m256i, x: __m256i, y: __m256i) -> __m256 {
            let sy = _mm256_sign_epi8(y, x);
            _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1)))
        }

        /// Dot products of one Q8_0 row with `R` Q8_0 activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q8_0<const R: usize>(w: &[u8], a: [&[Q8_0]; R]) -> [f32; R] {
            block32::<R, 34>(w, a, |b| loadu(b.add(2)))
        }

        /// Dot products of one Q5_0 row with `R` Q8_0 activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q5_0<const R: usize>(w: &[u8], a: [&[Q8_0]; R]) -> [f32; R] {
            block32::<R, 22>(w, a, |b| {
                let tmp = _mm_loadu_si128(b.add(6) as *const __m128i);
                let nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp), _mm256_set1_epi8(0xF));
                let qh = u32::from_le_bytes([*b.add(2), *b.add(3), *b.add(4), *b.add(5)]);
                let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
                let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
                let bits = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
                // Where the fifth bit is clear the value is (q - 16) = q | 0xF0 as a signed byte.
                _mm256_or_si256(nib, _mm256_andnot_si256(bits, _mm256_set1_epi8(0xF0u8 as i8)))
            })
        }

        /// The shared loop of the 32-element formats: `unpack` gives a block's 32 signed weights.
        #[inline(always)]
        unsafe fn block32<const R: usize, const BYTES: usize>(w: &[u8], a: [&[Q8_0]; R], unpack: impl Fn(*const u8) -> __m256i) -> [f32; R] {
            let nb = w.len() / BYTES;
            for r in a.iter() {
                assert!(r.len() >= nb);
            }
            let mut acc0 = [_mm256_setzero_ps(); R];
            let mut acc1 = [_mm256_setzero_ps(); R];
            let mut i = 0;
            while i + 1 < nb {
                let b0 = w.as_ptr().add(BYTES * i);
                let b1 = b0.add(BYTES);
                let (x0, x1) = (unpack(b0), unpack(b1));
                let (ax0, ax1) = (_mm256_sign_epi8(x0, x0), _mm256_sign_epi8(x1, x1));
                let (d0, d1) = (f16(b0), f16(b1));
                for r in 0..R {
                    let y0 = a[r].get_unchecked(i);
                    let y1 = a[r].get_unchecked(i + 1);
                    acc0[r] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * y0.d), dot_i8(ax0, x0, loadu(y0.qs.as_ptr() as *const u8)), acc0[r]);
                    acc1[r] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * y1.d), dot_i8(ax1, x1, loadu(y1.qs.as_ptr() as *const u8)), acc1[r]);
                }
                i += 2;
            }
            if i < nb {
                let b0 = w.as_ptr().add(BYTES * i);
                let x0 = unpack(b0);
                let ax0 = _mm256_sign_epi8(x0, x0);
                let d0 = f16(b0);
                for r in 0..R {
                    let y0 = a[r].get_unchecked(i);
                    acc0[r] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * y0.d), dot_i8(ax0, x0, loadu(y0.qs.as_ptr() as *const u8)), acc0[r]);
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
            }
            out
        }

        /// 32 floats → 32 saturated signed bytes, scaled by `s` and rounded to nearest, ties to even.
        #[inline(always)]
        unsafe fn quantize32(x: *const f32, s: __m256, out: *mut i8) {
            let q = |k: usize| _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x.add(8 * k)), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            let ab = _mm256_packs_epi32(q(0), q(1));
            let cd = _mm256_packs_epi32(q(2), q(3));
            let abcd = _mm256_packs_epi16(ab, cd);
            let fixed = _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(out as *mut __m256i, fixed);
        }

        #[inline(always)]
        unsafe fn absmax(x: *const f32, n: usize) -> f32 {
            let mut m = _mm256_setzero_ps();
            for k in 0..n / 8 {
                m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0), _mm256_loadu_ps(x.add(8 * k))));
            }
            let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            let h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            _mm_cvtss_f32(h)
        }

        #[target_feature(enable = $features)]
        pub unsafe fn quantize_q8k(xs: &[f32], out: &mut [Q8K]) {
            for (y, x) in out.iter_mut().zip(xs.chunks_exact(256)) {
                let amax = absmax(x.as_ptr(), 256);
                if amax == 0.0 || !amax.is_finite() {
                    *y = Q8K::default();
                    continue;
                }
                let max = x.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
                let iscale = -127f32 / max;
                let s = _mm256_set1_ps(iscale);
                for k in 0..8 {
                    quantize32(x.as_ptr().add(32 * k), s, y.qs.as_mut_ptr().add(32 * k));
                }
                fill_bsums(y);
                y.d = 1.0 / iscale;
            }
        }

        #[target_feature(enable = $features)]
        pub unsafe fn quantize_q8_0(xs: &[f32], out: &mut [Q8_0]) {
            for (y, x) in out.iter_mut().zip(xs.chunks_exact(32)) {
                let amax = absmax(x.as_ptr(), 32);
                let d = amax / 127.0;
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                y.d = half::f16::from_f32(d).to_f32();
                quantize32(x.as_ptr(), _mm256_set1_ps(id), y.qs.as_mut_ptr());
            }
        }

    };
}

/// AVX2 + FMA + F16C.
pub mod avx2 {
    use super::*;
    kernels!("avx2,fma,f16c");
}

/// AVX2 with AVX-512 F/BW/VL/VNNI also enabled.
pub mod avx512 {
    use super::*;
    kernels!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");
}
