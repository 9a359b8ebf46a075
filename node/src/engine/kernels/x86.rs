//! x86-64 kernels, chosen at run time: the integer dot products of each GGUF weight format with
//! 8-bit activations for `R` activation rows at once (R = 1 for decode; larger R reuses each
//! unpacked weight register across prompt rows), and activation quantization. One source is
//! compiled twice: for AVX2 + FMA + F16C (`avx2`), and with AVX-512 (BW, VL, VNNI) also enabled
//! (`avx512`, with BMI2), where the compiler gets 32 vector registers and fuses multiply-adds (vpdpwssd).
//! The weights are in the step order `portable.rs` repacks them into at load, so each 32-bit lane
//! of an integer dot product (`vpdpbusd` with VNNI, else `maddubs` + `madd`) sums one sub-block
//! and the scales apply per lane. The `_x8` kernels take Q4_K / Q6_K rows interleaved by eight
//! (`portable::interleave_x8`): there each lane is one row and the activation bytes are broadcast.
//! Nothing here allocates or branches on data; every function is checked against `portable.rs`
//! in the tests.

use std::arch::x86_64::*;

use super::act::{finish_q8k, finish_q8x4, Q8x4, Q8K};
use super::portable::spread_2bit_fields;


/// How far ahead of the block being multiplied decode asks for weight bytes (`prefetcht0`).
/// Measured on a 2-core Zen 3 VM, 2 threads, 250 MB of Q4_K or Q6_K rows, distances 0-6,144
/// alternated in one process: 1,024 bytes gave 2-21% more GB/s than none in each of 8 rounds,
/// larger distances no more on the whole; `examples/decode_stream.rs` (the Qwen mix): best passes 14.3-18.6
/// against 13.9-14.0 GB/s without, medians within this VM's noise.
const PREFETCH_AHEAD: usize = 1024;

pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

pub fn has_avx512() -> bool {
    has_avx2()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("bmi2")
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

/// Asks for the cache lines of `bytes` bytes from `p` (which need not be valid memory).
#[inline(always)]
unsafe fn prefetch(p: *const u8, bytes: usize) {
    for l in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l) as *const i8);
    }
}

#[inline(always)]
unsafe fn loadu(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

macro_rules! kernels {
    ($features:literal, $vnni:literal) => {
        /// `acc + Σ u·s` over each 4-byte group (u unsigned, s signed), per 32-bit lane: one
        /// `vpdpbusd` with VNNI, else `maddubs` + `madd` (callers keep `u·s` pairs within i16).
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn dpbusd(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
            if $vnni {
                _mm256_dpbusd_epi32(acc, u, s)
            } else {
                _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
            }
        }

        /// 32 bits → 32 bytes, `0x10` where the bit is set.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn bit4(word: u32) -> __m256i {
            if $vnni {
                _mm256_maskz_mov_epi8(word, _mm256_set1_epi8(0x10))
            } else {
                let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
                let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(word as i32), shuf);
                let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
                _mm256_and_si256(set, _mm256_set1_epi8(0x10))
            }
        }

        /// The four f16 scales of a 32-value group, each twice: one per 32-bit lane.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn group_scales(g: *const u8) -> __m256 {
            let d = _mm_loadl_epi64(g as *const __m128i);
            _mm256_cvtph_ps(_mm_unpacklo_epi16(d, d))
        }

        /// A repacked Q4_K block's eight scales and eight mins (see `portable::q4k_scales_mins`)
        /// as f32 lanes. The high bits land in place by `pdep` with BMI2 (fast on every CPU with
        /// AVX-512); AVX2-only CPUs include early Zen, where `pdep` is microcoded, so they shift.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn q4k_scales(b: *const u8) -> (__m256, __m256) {
            let lo = (b.add(4) as *const u64).read_unaligned();
            let hi = (b.add(12) as *const u32).read_unaligned();
            let (hs, hm) = if $vnni {
                (_pdep_u64(hi as u64, 0x3030_3030_3030_3030), _pdep_u64((hi >> 16) as u64, 0x3030_3030_3030_3030))
            } else {
                (spread_2bit_fields(hi), spread_2bit_fields(hi >> 16))
            };
            let v = _mm_set_epi64x((((lo >> 4) & 0x0F0F_0F0F_0F0F_0F0F) | hm) as i64, ((lo & 0x0F0F_0F0F_0F0F_0F0F) | hs) as i64);
            (_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v))))
        }

        /// Dot products of one repacked Q4_K row with `R` Q8_K activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q4k<const R: usize>(w: &[u8], a: [&[Q8K]; R]) -> [f32; R] {
            let nb = w.len() / 144;
            for r in a.iter() {
                assert!(r.len() >= nb);
            }
            let m4 = _mm256_set1_epi8(0xF);
            let mut acc = [_mm256_setzero_ps(); R];
            for i in 0..nb {
                let b = w.as_ptr().add(144 * i);
                // d × the sub-block scales and dmin × the mins, as f32 lanes.
                let (sc, mn) = q4k_scales(b);
                let dsc = _mm256_mul_ps(_mm256_set1_ps(f16(b)), sc);
                let dmn = _mm256_mul_ps(_mm256_set1_ps(f16(b.add(2))), mn);
                let mut dp = [[_mm256_setzero_si256(); R]; 2];
                let q4 = b.add(16);
                for c in 0..4 {
                    let bits = loadu(q4.add(32 * c));
                    let lo = _mm256_and_si256(bits, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                    for r in 0..R {
                        let q8 = a[r].get_unchecked(i).qs.as_ptr() as *const u8;
                        dp[0][r] = dpbusd(dp[0][r], lo, loadu(q8.add(32 * c)));
                        dp[1][r] = dpbusd(dp[1][r], hi, loadu(q8.add(32 * c + 128)));
                    }
                }
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    let s = _mm256_mul_ps(dsc, _mm256_set1_ps(y.d));
                    acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_add_epi32(dp[0][r], dp[1][r])), acc[r]);
                    acc[r] = _mm256_fnmadd_ps(dmn, _mm256_loadu_ps(y.ybs.as_ptr()), acc[r]);
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r]);
            }
            out
        }

        /// Decode: one repacked Q4_K row (`row_bytes` long) against one activation row. Each
        /// block's result is finished off the accumulator and joins it with one add, so the
        /// loop-carried chain is one add per block rather than two dependent multiply-adds.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn q4k_row(w: *const u8, row_bytes: usize, a: &[Q8K]) -> f32 {
            let m4 = _mm256_set1_epi8(0xF);
            let mut acc = _mm256_setzero_ps();
            for i in 0..row_bytes / 144 {
                let y = a.get_unchecked(i);
                let q8 = y.qs.as_ptr() as *const u8;
                let b = w.add(144 * i);
                let mut dp = [_mm256_setzero_si256(); 2];
                for c in 0..4 {
                    let bits = loadu(b.add(16 + 32 * c));
                    dp[0] = dpbusd(dp[0], _mm256_and_si256(bits, m4), loadu(q8.add(32 * c)));
                    dp[1] = dpbusd(dp[1], _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), loadu(q8.add(32 * c + 128)));
                }
                let (sc, mn) = q4k_scales(b);
                let dsc = _mm256_mul_ps(_mm256_set1_ps(f16(b) * y.d), sc);
                let dmn = _mm256_mul_ps(_mm256_set1_ps(f16(b.add(2))), mn);
                let dots = _mm256_cvtepi32_ps(_mm256_add_epi32(dp[0], dp[1]));
                acc = _mm256_add_ps(acc, _mm256_fnmadd_ps(dmn, _mm256_loadu_ps(y.ybs.as_ptr()), _mm256_mul_ps(dsc, dots)));
            }
            hsum(acc)
        }

        /// One step of an interleaved block for each activation row: the weight lanes `lo` and
        /// `hi` (step `c` of sub-block `s`, eight rows) against the four activation bytes of that
        /// sub-block in the block's two 128-value halves, broadcast, into `dl` and `dh`.
        #[target_feature(enable = $features)]
        #[inline]
        #[allow(clippy::too_many_arguments)]
        unsafe fn dot_x8_step<const R: usize>(dl: &mut [__m256i; R], dh: &mut [__m256i; R], lo: __m256i, hi: __m256i, a: [&[Q8K]; R], i: usize, c: usize, s: usize) {
            for r in 0..R {
                let q8 = a[r].get_unchecked(i).qs.as_ptr() as *const u8;
                let al = _mm256_set1_epi32((q8.add(32 * c + 4 * s) as *const i32).read_unaligned());
                let ah = _mm256_set1_epi32((q8.add(32 * (c + 4) + 4 * s) as *const i32).read_unaligned());
                dl[r] = dpbusd(dl[r], lo, al);
                dh[r] = dpbusd(dh[r], hi, ah);
            }
        }

        /// A Q4_K ×8 block's 6-bit scales and mins, all 64 of each at once (byte 8 s + j of the
        /// pair is row j's value for sub-block s): the low bits are the nibbles of bytes 32..96,
        /// the high bits come from one 32-byte load at 96, shifted into place (`portable.rs`).
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn q4k_x8_scales_mins(b: *const u8) -> ([__m256i; 2], [__m256i; 2]) {
            let m4 = _mm256_set1_epi8(0xF);
            let m30 = _mm256_set1_epi8(0x30);
            let (l0, l1, h) = (loadu(b.add(32)), loadu(b.add(64)), loadu(b.add(96)));
            let high = |v: __m256i| _mm256_and_si256(v, m30);
            let sc = [
                _mm256_or_si256(_mm256_and_si256(l0, m4), high(_mm256_slli_epi16(h, 4))),
                _mm256_or_si256(_mm256_and_si256(l1, m4), high(_mm256_slli_epi16(h, 2))),
            ];
            let mn = [
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), high(h)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), high(_mm256_srli_epi16(h, 2))),
            ];
            (sc, mn)
        }

        /// Dot products of one interleaved group of eight Q4_K rows (`nb` blocks of 1152 bytes,
        /// see `portable::interleave_x8`) with `R` activation rows: lane j of result r is row j
        /// against activation row r. Each 32-bit lane sums one row; the four activation bytes it
        /// needs are broadcast. With VNNI the high nibbles are taken in place (16 × their value:
        /// `vpdpbusd` does not saturate) and the 1/16 goes into the block scale. Without it the
        /// eight `maddubs` products of a sub-block add up in 16 bits (at most 8 · 2 · 15 · 127 =
        /// 30,480) and one `madd` with the scale, doubled into both halves of each row's lane,
        /// takes them to 32 bits: two multiplies a step instead of four, and no `mullo`.
        /// `ahead` > 0: each block first asks for the cache lines of the bytes `ahead` further on.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q4k_x8<const R: usize>(w: *const u8, nb: usize, a: [&[Q8K]; R], ahead: usize) -> [__m256; R] {
            let m4 = _mm256_set1_epi8(0xF);
            let m4h = _mm256_set1_epi8(0xF0u8 as i8);
            let hi_weight = if $vnni { 1.0 / 16.0 } else { 1.0 };
            let mut acc = [_mm256_setzero_ps(); R];
            for i in 0..nb {
                let b = w.add(1152 * i);
                if ahead > 0 {
                    prefetch(b.wrapping_add(ahead), 1152);
                }
                let (sc, mn) = q4k_x8_scales_mins(b);
                // With VNNI the scales as they are; without, each byte twice (one 16-bit half of a
                // row's lane each), sub-blocks in the order 0, 2, 1, 3, 4, 6, 5, 7 by 16 bytes.
                let scales = if $vnni {
                    [sc[0], sc[1], sc[0], sc[1]]
                } else {
                    [_mm256_unpacklo_epi8(sc[0], sc[0]), _mm256_unpackhi_epi8(sc[0], sc[0]), _mm256_unpacklo_epi8(sc[1], sc[1]), _mm256_unpackhi_epi8(sc[1], sc[1])]
                };
                let scales = scales.as_ptr() as *const u8;
                let mins = mn.as_ptr() as *const u8;
                let mut isum = [_mm256_setzero_si256(); R];
                let mut fmin = [_mm256_setzero_ps(); R];
                for s in 0..8 {
                    let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(mins.add(8 * s) as *const __m128i)));
                    if $vnni {
                        let mut dl = [_mm256_setzero_si256(); R];
                        let mut dh = [_mm256_setzero_si256(); R];
                        for k in 0..4 {
                            let bits = loadu(b.add(128 + 128 * s + 32 * k));
                            dot_x8_step(&mut dl, &mut dh, _mm256_and_si256(bits, m4), _mm256_and_si256(bits, m4h), a, i, k, s);
                        }
                        let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(scales.add(8 * s) as *const __m128i));
                        for r in 0..R {
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(_mm256_add_epi32(_mm256_slli_epi32(dl[r], 4), dh[r]), sc));
                        }
                    } else {
                        let mut d16 = [_mm256_setzero_si256(); R];
                        for k in 0..4 {
                            let bits = loadu(b.add(128 + 128 * s + 32 * k));
                            let lo = _mm256_and_si256(bits, m4);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                            for r in 0..R {
                                let q8 = a[r].get_unchecked(i).qs.as_ptr() as *const u8;
                                let al = _mm256_set1_epi32((q8.add(32 * k + 4 * s) as *const i32).read_unaligned());
                                let ah = _mm256_set1_epi32((q8.add(32 * (k + 4) + 4 * s) as *const i32).read_unaligned());
                                let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, al), _mm256_maddubs_epi16(hi, ah));
                                d16[r] = if k == 0 { p } else { _mm256_add_epi16(d16[r], p) };
                            }
                        }
                        let at = 64 * (s / 4) + 32 * (s % 2) + 16 * ((s / 2) % 2);
                        let sc = _mm256_cvtepu8_epi16(_mm_loadu_si128(scales.add(at) as *const __m128i));
                        for r in 0..R {
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(d16[r], sc));
                        }
                    }
                    for r in 0..R {
                        fmin[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(*a[r].get_unchecked(i).ybs.get_unchecked(s)), fmin[r]);
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(b as *const __m128i));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(b.add(16) as *const __m128i));
                for r in 0..R {
                    let yd = _mm256_set1_ps(a[r].get_unchecked(i).d * hi_weight);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(isum[r]), acc[r]);
                    acc[r] = _mm256_fnmadd_ps(dmin, fmin[r], acc[r]);
                }
            }
            acc
        }

        /// Dot products of one interleaved group of eight Q6_K rows (`nb` blocks of 1680 bytes)
        /// with `R` activation rows, lane j of result r being row j against activation row r;
        /// `ahead` as for `dot_q4k_x8`.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q6k_x8<const R: usize>(w: *const u8, nb: usize, a: [&[Q8K]; R], ahead: usize) -> [__m256; R] {
            let m4 = _mm256_set1_epi8(0xF);
            let m30 = _mm256_set1_epi8(0x30);
            // Bits 2 j, 2 j + 1 of a high-bit byte, moved to bits 4 and 5.
            let field = |h: __m256i, j: usize| -> __m256i {
                let moved = match j {
                    0 => _mm256_slli_epi16(h, 4),
                    1 => _mm256_slli_epi16(h, 2),
                    2 => h,
                    _ => _mm256_srli_epi16(h, 2),
                };
                _mm256_and_si256(moved, m30)
            };
            let mut acc = [_mm256_setzero_ps(); R];
            for i in 0..nb {
                let b = w.add(1680 * i);
                if ahead > 0 {
                    prefetch(b.wrapping_add(ahead), 1680);
                }
                let mut isum = [_mm256_setzero_si256(); R];
                for s in 0..8 {
                    // Values are stored as q + 32: start from -32 × the activation sums.
                    let mut dl = [_mm256_setzero_si256(); R];
                    let mut dh = [_mm256_setzero_si256(); R];
                    for r in 0..R {
                        let y = a[r].get_unchecked(i);
                        dl[r] = _mm256_set1_epi32(*y.nbl.get_unchecked(s));
                        dh[r] = _mm256_set1_epi32(*y.nbh.get_unchecked(s));
                    }
                    let sb = b.add(144 + 192 * s);
                    let qh = [loadu(sb.add(128)), loadu(sb.add(160))];
                    for c in 0..4 {
                        let bits = loadu(sb.add(32 * c));
                        let h = qh[c % 2];
                        let lo = _mm256_or_si256(_mm256_and_si256(bits, m4), field(h, c / 2));
                        let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), field(h, c / 2 + 2));
                        dot_x8_step(&mut dl, &mut dh, lo, hi, a, i, c, s);
                    }
                    let sl = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(16 + 16 * s) as *const __m128i));
                    let sh = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(24 + 16 * s) as *const __m128i));
                    for r in 0..R {
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(dl[r], sl), _mm256_mullo_epi32(dh[r], sh)));
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(b as *const __m128i));
                for r in 0..R {
                    let yd = _mm256_set1_ps(a[r].get_unchecked(i).d);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, yd), _mm256_cvtepi32_ps(isum[r]), acc[r]);
                }
            }
            acc
        }

        /// Decode over interleaved groups of eight rows (`group_bytes` each): one activation row.
        #[target_feature(enable = $features)]
        pub unsafe fn gemv_x8(q4k: bool, w: &[u8], group_bytes: usize, a: &[Q8K], out: &mut [f32]) {
            let nb = group_bytes / if q4k { 1152 } else { 1680 };
            assert!(a.len() >= nb && w.len() >= out.len() / 8 * group_bytes && out.len() % 8 == 0);
            for (g, o) in out.chunks_exact_mut(8).enumerate() {
                let p = w.as_ptr().add(g * group_bytes);
                // Measured on Zen 3 (AVX2); on Zen 4 (AVX-512) software prefetch 2-8 KiB ahead
                // slowed the stream (README, Performance), so that build leaves it to the hardware.
                let ahead = if $vnni { 0 } else { PREFETCH_AHEAD };
                let [v] = if q4k { dot_q4k_x8::<1>(p, nb, [a], ahead) } else { dot_q6k_x8::<1>(p, nb, [a], ahead) };
                _mm256_storeu_ps(o.as_mut_ptr(), v);
            }
        }

        /// Dot products of one repacked Q6_K row with `R` Q8_K activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q6k<const R: usize>(w: &[u8], a: [&[Q8K]; R]) -> [f32; R] {
            let nb = w.len() / 210;
            for r in a.iter() {
                assert!(r.len() >= nb);
            }
            let m4 = _mm256_set1_epi8(0xF);
            let m3 = _mm256_set1_epi8(3);
            let even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            let mut acc = [_mm256_setzero_ps(); R];
            for i in 0..nb {
                let b = w.as_ptr().add(210 * i);
                let d = f16(b.add(208));
                let eo = _mm_shuffle_epi8(_mm_loadu_si128(b.add(192) as *const __m128i), even_odd);
                // d × the scales of the even and odd 16-value sub-blocks, as f32 lanes.
                let sca = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eo)));
                let scb = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(eo, 8))));
                // Values are stored as q + 32: start from -32 × the activation sums.
                // Two chains per row (low and high steps); one row gets four.
                let mut dpa = [[_mm256_setzero_si256(); R]; 2];
                let mut dpb = [[_mm256_setzero_si256(); R]; 2];
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    dpa[0][r] = loadu(y.nbl.as_ptr() as *const u8);
                    dpb[0][r] = loadu(y.nbh.as_ptr() as *const u8);
                }
                let qh = [loadu(b.add(128)), loadu(b.add(160))];
                for c in 0..4 {
                    let bits = loadu(b.add(32 * c));
                    let h = qh[c % 2];
                    let shift = _mm_cvtsi32_si128(2 * (c / 2) as i32);
                    let shift4 = _mm_cvtsi32_si128(2 * (c / 2) as i32 + 4);
                    let hl = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, shift), m3), 4);
                    let hh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, shift4), m3), 4);
                    let qa = _mm256_or_si256(_mm256_and_si256(bits, m4), hl);
                    let qb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), hh);
                    let ch = if R == 1 { c & 1 } else { 0 };
                    for r in 0..R {
                        let q8 = a[r].get_unchecked(i).qs.as_ptr() as *const u8;
                        dpa[ch][r] = dpbusd(dpa[ch][r], qa, loadu(q8.add(32 * c)));
                        dpb[ch][r] = dpbusd(dpb[ch][r], qb, loadu(q8.add(32 * c + 128)));
                    }
                }
                for r in 0..R {
                    let (mut da, mut db) = (dpa[0][r], dpb[0][r]);
                    if R == 1 {
                        (da, db) = (_mm256_add_epi32(da, dpa[1][r]), _mm256_add_epi32(db, dpb[1][r]));
                    }
                    let t = _mm256_fmadd_ps(scb, _mm256_cvtepi32_ps(db), _mm256_mul_ps(sca, _mm256_cvtepi32_ps(da)));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a[r].get_unchecked(i).d), t, acc[r]);
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r]);
            }
            out
        }

        /// Dot products of one repacked Q8_0 row (groups of four blocks) with `R` activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q8_0<const R: usize>(w: &[u8], a: [&[Q8x4]; R]) -> [f32; R] {
            let ng = w.len() / 136;
            for r in a.iter() {
                assert!(r.len() >= ng);
            }
            let mut acc = [_mm256_setzero_ps(); R];
            for i in 0..ng {
                let g = w.as_ptr().add(136 * i);
                let dw = group_scales(g);
                let mut dp = [_mm256_setzero_si256(); R];
                let mut dp2 = [_mm256_setzero_si256(); R];
                if $vnni {
                    // The weights go in as unsigned (q + 128); take 128 × the activation sums back.
                    for r in 0..R {
                        let y = a[r].get_unchecked(i);
                        dp[r] = _mm256_sub_epi32(dp[r], _mm256_slli_epi32(loadu(y.lsum.as_ptr() as *const u8), 7));
                    }
                }
                for k in 0..4 {
                    let q = loadu(g.add(8 + 32 * k));
                    if $vnni {
                        let u = _mm256_xor_si256(q, _mm256_set1_epi8(0x80u8 as i8));
                        for r in 0..R {
                            let y = a[r].get_unchecked(i).qs.as_ptr() as *const u8;
                            if k % 2 == 0 {
                                dp[r] = dpbusd(dp[r], u, loadu(y.add(32 * k)));
                            } else {
                                dp2[r] = dpbusd(dp2[r], u, loadu(y.add(32 * k)));
                            }
                        }
                    } else {
                        let aq = _mm256_sign_epi8(q, q);
                        for r in 0..R {
                            let y = a[r].get_unchecked(i).qs.as_ptr() as *const u8;
                            if k % 2 == 0 {
                                dp[r] = dpbusd(dp[r], aq, _mm256_sign_epi8(loadu(y.add(32 * k)), q));
                            } else {
                                dp2[r] = dpbusd(dp2[r], aq, _mm256_sign_epi8(loadu(y.add(32 * k)), q));
                            }
                        }
                    }
                }
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    let s = _mm256_mul_ps(dw, _mm256_loadu_ps(y.d.as_ptr()));
                    acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_add_epi32(dp[r], dp2[r])), acc[r]);
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r]);
            }
            out
        }

        /// Dot products of one repacked Q5_0 row (groups of four blocks) with `R` activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q5_0<const R: usize>(w: &[u8], a: [&[Q8x4]; R]) -> [f32; R] {
            let ng = w.len() / 88;
            for r in a.iter() {
                assert!(r.len() >= ng);
            }
            let m4 = _mm256_set1_epi8(0xF);
            let mut acc = [_mm256_setzero_ps(); R];
            for i in 0..ng {
                let g = w.as_ptr().add(88 * i);
                let dw = group_scales(g);
                let word = |k: usize| u32::from_le_bytes([*g.add(8 + 4 * k), *g.add(9 + 4 * k), *g.add(10 + 4 * k), *g.add(11 + 4 * k)]);
                let mut dp = [_mm256_setzero_si256(); R];
                let mut dp2 = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    // Values are stored as q + 16; take 16 × the activation sums back.
                    let y = a[r].get_unchecked(i);
                    dp[r] = _mm256_sub_epi32(dp[r], _mm256_slli_epi32(loadu(y.lsum.as_ptr() as *const u8), 4));
                }
                for c in 0..2 {
                    let bits = loadu(g.add(24 + 32 * c));
                    let qa = _mm256_or_si256(_mm256_and_si256(bits, m4), bit4(word(c)));
                    let qb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4), bit4(word(c + 2)));
                    for r in 0..R {
                        let y = a[r].get_unchecked(i).qs.as_ptr() as *const u8;
                        dp[r] = dpbusd(dp[r], qa, loadu(y.add(32 * c)));
                        dp2[r] = dpbusd(dp2[r], qb, loadu(y.add(32 * c + 64)));
                    }
                }
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    let s = _mm256_mul_ps(dw, _mm256_loadu_ps(y.d.as_ptr()));
                    acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_add_epi32(dp[r], dp2[r])), acc[r]);
                }
            }
            let mut out = [0f32; R];
            for r in 0..R {
                out[r] = hsum(acc[r]);
            }
            out
        }

        /// One activation row against consecutive weight rows (`row_bytes` each): decode's
        /// matrix-vector product, one call per task instead of one per row.
        #[target_feature(enable = $features)]
        pub unsafe fn gemv_q4k(w: &[u8], row_bytes: usize, a: &[Q8K], out: &mut [f32]) {
            assert!(a.len() >= row_bytes / 144 && w.len() >= out.len() * row_bytes);
            for (r, o) in out.iter_mut().enumerate() {
                *o = q4k_row(w.as_ptr().add(r * row_bytes), row_bytes, a);
            }
        }

        #[target_feature(enable = $features)]
        pub unsafe fn gemv_q6k(w: &[u8], row_bytes: usize, a: &[Q8K], out: &mut [f32]) {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                *o = dot_q6k::<1>(row, [a])[0];
            }
        }

        #[target_feature(enable = $features)]
        pub unsafe fn gemv_q8_0(w: &[u8], row_bytes: usize, a: &[Q8x4], out: &mut [f32]) {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                *o = dot_q8_0::<1>(row, [a])[0];
            }
        }

        #[target_feature(enable = $features)]
        pub unsafe fn gemv_q5_0(w: &[u8], row_bytes: usize, a: &[Q8x4], out: &mut [f32]) {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                *o = dot_q5_0::<1>(row, [a])[0];
            }
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
                let mut nat = [0i8; 256];
                for k in 0..8 {
                    quantize32(x.as_ptr().add(32 * k), s, nat.as_mut_ptr().add(32 * k));
                }
                finish_q8k(y, &nat, 1.0 / iscale);
            }
        }

        #[target_feature(enable = $features)]
        pub unsafe fn quantize_q8x4(xs: &[f32], out: &mut [Q8x4]) {
            for (y, x) in out.iter_mut().zip(xs.chunks_exact(128)) {
                let mut nat = [0i8; 128];
                let mut ds = [0f32; 4];
                for s in 0..4 {
                    let xb = x.as_ptr().add(32 * s);
                    let amax = absmax(xb, 32);
                    let d = amax / 127.0;
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    ds[s] = half::f16::from_f32(d).to_f32();
                    quantize32(xb, _mm256_set1_ps(id), nat.as_mut_ptr().add(32 * s));
                }
                finish_q8x4(y, &nat, ds);
            }
        }

    };
}

/// The wrapping sum of `words`, read with 256-bit loads into four independent sums: the pass of
/// the memory-read probe (`bench::read_bandwidth`), which a scalar loop leaves 20-30% short of
/// what this machine reads (15-22 against 22-27 GB/s, side by side in one process on a Zen 3 VM).
///
/// # Safety
/// The CPU must have AVX2 (`has_avx2`).
#[target_feature(enable = "avx2")]
pub unsafe fn read_sum(words: &[u64]) -> u64 {
    let (body, tail) = words.split_at(words.len() / 16 * 16);
    let p = body.as_ptr() as *const __m256i;
    let mut sums = [_mm256_setzero_si256(); 4];
    for i in 0..body.len() / 16 {
        for (k, s) in sums.iter_mut().enumerate() {
            *s = _mm256_add_epi64(*s, _mm256_loadu_si256(p.add(4 * i + k)));
        }
    }
    let total = _mm256_add_epi64(_mm256_add_epi64(sums[0], sums[1]), _mm256_add_epi64(sums[2], sums[3]));
    let lanes: [u64; 4] = std::mem::transmute(total);
    lanes.iter().chain(tail).fold(0u64, |a, x| a.wrapping_add(*x))
}

/// AVX2 + FMA + F16C.
pub mod avx2 {
    use super::*;
    kernels!("avx2,fma,f16c", false);
}

/// AVX2 with AVX-512 F/BW/VL/VNNI also enabled.
pub mod avx512 {
    use super::*;
    kernels!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,bmi2", true);
}
