//! aarch64 kernels (Apple silicon, Graviton, Ampere, recent Cortex), chosen at run time: the
//! integer dot products of each GGUF weight format with 8-bit activations for `R` activation rows
//! at once, as `x86.rs` does, on 128-bit registers. Each 32-byte step of the step order
//! (`portable.rs`) is two halves, sub-block lanes 0-3 and 4-7, so every 32-bit lane of an integer
//! dot product still sums one sub-block and the scales apply per lane. One source is compiled
//! twice: with FEAT_DotProd (`sdot`, Apple M1 and later, Neoverse, Cortex-A76 and later) written
//! as inline assembly because its intrinsic is not stable Rust, and for plain NEON with `smull`
//! and pairwise adds. Every value fits a signed byte (Q4_K 0..15, Q6_K 0..63 and Q5_0 0..31 as
//! stored, Q8_0 as is), so no unsigned-offset corrections are needed beyond the stored ones.
//! Nothing here allocates; every function is checked against `portable.rs` in the tests. It does
//! not quantize activations (the portable code does, autovectorized).

use std::arch::aarch64::*;
use std::arch::asm;

use super::act::{Q8x4, Q8K};
use super::portable::{f16_at, q4k_scales_mins};

/// FEAT_DotProd (`sdot`); NEON itself is part of every aarch64 CPU.
pub fn has_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// Four f16 scales as `[d0, d0, d1, d1]` and `[d2, d2, d3, d3]`: one per 32-bit lane of each half.
#[inline(always)]
unsafe fn group_scales(g: &[u8]) -> [float32x4_t; 2] {
    let d = [f16_at(g, 0), f16_at(g, 2), f16_at(g, 4), f16_at(g, 6)];
    let v = vld1q_f32(d.as_ptr());
    [vzip1q_f32(v, v), vzip2q_f32(v, v)]
}

/// 16 bits → 16 bytes, `0x10` where the bit is set (bit i → byte i).
#[inline(always)]
unsafe fn bit4(bits: u16) -> uint8x16_t {
    const MASK: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let v = vcombine_u8(vdup_n_u8(bits as u8), vdup_n_u8((bits >> 8) as u8));
    vandq_u8(vtstq_u8(v, vld1q_u8(MASK.as_ptr())), vdupq_n_u8(0x10))
}

macro_rules! kernels {
    ($features:literal, $sdot:literal) => {
        /// `acc + Σ a·b` over each 4-byte group, per 32-bit lane.
        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn dot4(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
            if $sdot {
                let mut r = acc;
                asm!("sdot {0:v}.4s, {1:v}.16b, {2:v}.16b", inout(vreg) r, in(vreg) a, in(vreg) b, options(pure, nomem, nostack));
                r
            } else {
                let lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
                let hi = vpaddlq_s16(vmull_high_s8(a, b));
                vaddq_s32(acc, vpaddq_s32(lo, hi))
            }
        }

        #[target_feature(enable = $features)]
        #[inline]
        unsafe fn u8x8_to_f32(p: *const u8, scale: f32) -> [float32x4_t; 2] {
            let w = vmovl_u8(vld1_u8(p));
            [vmulq_n_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), scale), vmulq_n_f32(vcvtq_f32_u32(vmovl_high_u16(w)), scale)]
        }

        /// Dot products of one repacked Q4_K row with `R` Q8_K activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q4k<const R: usize>(w: &[u8], a: [&[Q8K]; R]) -> [f32; R] {
            let nb = w.len() / 144;
            for r in a.iter() {
                assert!(r.len() >= nb);
            }
            let m4 = vdupq_n_u8(0xF);
            let mut acc = [[vdupq_n_f32(0.0); 2]; R];
            for (i, blk) in w.chunks_exact(144).enumerate() {
                let (sc, mn) = q4k_scales_mins(&blk[4..16]);
                let dsc = u8x8_to_f32(sc.as_ptr(), f16_at(blk, 0));
                let dmn = u8x8_to_f32(mn.as_ptr(), f16_at(blk, 2));
                // Separate chains for the low and high nibbles of each half.
                let mut dp = [[[vdupq_n_s32(0); 2]; 2]; R];
                for c in 0..4 {
                    for h in 0..2 {
                        let bits = vld1q_u8(blk.as_ptr().add(16 + 32 * c + 16 * h));
                        let lo = vreinterpretq_s8_u8(vandq_u8(bits, m4));
                        let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(bits));
                        for r in 0..R {
                            let q8 = a[r].get_unchecked(i).qs.as_ptr();
                            dp[r][h][0] = dot4(dp[r][h][0], lo, vld1q_s8(q8.add(32 * c + 16 * h)));
                            dp[r][h][1] = dot4(dp[r][h][1], hi, vld1q_s8(q8.add(32 * c + 128 + 16 * h)));
                        }
                    }
                }
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    for h in 0..2 {
                        let dots = vcvtq_f32_s32(vaddq_s32(dp[r][h][0], dp[r][h][1]));
                        let t = vmulq_f32(vmulq_n_f32(dsc[h], y.d), dots);
                        let t = vfmsq_f32(t, dmn[h], vld1q_f32(y.ybs.as_ptr().add(4 * h)));
                        acc[r][h] = vaddq_f32(acc[r][h], t);
                    }
                }
            }
            std::array::from_fn(|r| vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1])))
        }

        /// Dot products of one repacked Q6_K row with `R` Q8_K activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q6k<const R: usize>(w: &[u8], a: [&[Q8K]; R]) -> [f32; R] {
            let nb = w.len() / 210;
            for r in a.iter() {
                assert!(r.len() >= nb);
            }
            let m4 = vdupq_n_u8(0xF);
            let m3 = vdupq_n_u8(3);
            let mut acc = [[vdupq_n_f32(0.0); 2]; R];
            for (i, blk) in w.chunks_exact(210).enumerate() {
                let b = blk.as_ptr();
                let d = f16_at(blk, 208);
                // The scales of each sub-block's low (even) and high (odd) 16 values, × d.
                let eo = vld2_s8(b.add(192) as *const i8);
                let widen = |v: int8x8_t| {
                    let w = vmovl_s8(v);
                    [vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), d), vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(w)), d)]
                };
                let (sca, scb) = (widen(eo.0), widen(eo.1));
                // Values are stored as q + 32: start from -32 × the activation sums.
                let mut dpa = [[vdupq_n_s32(0); 2]; R];
                let mut dpb = [[vdupq_n_s32(0); 2]; R];
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    for h in 0..2 {
                        dpa[r][h] = vld1q_s32(y.nbl.as_ptr().add(4 * h));
                        dpb[r][h] = vld1q_s32(y.nbh.as_ptr().add(4 * h));
                    }
                }
                for c in 0..4 {
                    let shift = vdupq_n_s8(-2 * (c / 2) as i8);
                    let shift4 = vdupq_n_s8(-2 * (c / 2) as i8 - 4);
                    for h in 0..2 {
                        let bits = vld1q_u8(b.add(32 * c + 16 * h));
                        let qh = vld1q_u8(b.add(128 + 32 * (c % 2) + 16 * h));
                        let hl = vshlq_n_u8::<4>(vandq_u8(vshlq_u8(qh, shift), m3));
                        let hh = vshlq_n_u8::<4>(vandq_u8(vshlq_u8(qh, shift4), m3));
                        let qa = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(bits, m4), hl));
                        let qb = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(bits), hh));
                        for r in 0..R {
                            let q8 = a[r].get_unchecked(i).qs.as_ptr();
                            dpa[r][h] = dot4(dpa[r][h], qa, vld1q_s8(q8.add(32 * c + 16 * h)));
                            dpb[r][h] = dot4(dpb[r][h], qb, vld1q_s8(q8.add(32 * c + 128 + 16 * h)));
                        }
                    }
                }
                for r in 0..R {
                    let yd = a[r].get_unchecked(i).d;
                    for h in 0..2 {
                        let t = vfmaq_f32(vmulq_f32(sca[h], vcvtq_f32_s32(dpa[r][h])), scb[h], vcvtq_f32_s32(dpb[r][h]));
                        acc[r][h] = vfmaq_n_f32(acc[r][h], t, yd);
                    }
                }
            }
            std::array::from_fn(|r| vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1])))
        }

        /// Dot products of one repacked Q8_0 row (groups of four blocks) with `R` activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q8_0<const R: usize>(w: &[u8], a: [&[Q8x4]; R]) -> [f32; R] {
            let ng = w.len() / 136;
            for r in a.iter() {
                assert!(r.len() >= ng);
            }
            let mut acc = [[vdupq_n_f32(0.0); 2]; R];
            for (i, g) in w.chunks_exact(136).enumerate() {
                let dw = group_scales(g);
                let mut dp = [[[vdupq_n_s32(0); 2]; 2]; R];
                for k in 0..4 {
                    for h in 0..2 {
                        let q = vld1q_s8(g.as_ptr().add(8 + 32 * k + 16 * h) as *const i8);
                        for r in 0..R {
                            let y = a[r].get_unchecked(i).qs.as_ptr();
                            dp[r][h][k % 2] = dot4(dp[r][h][k % 2], q, vld1q_s8(y.add(32 * k + 16 * h)));
                        }
                    }
                }
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    for h in 0..2 {
                        let s = vmulq_f32(dw[h], vld1q_f32(y.d.as_ptr().add(4 * h)));
                        acc[r][h] = vfmaq_f32(acc[r][h], s, vcvtq_f32_s32(vaddq_s32(dp[r][h][0], dp[r][h][1])));
                    }
                }
            }
            std::array::from_fn(|r| vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1])))
        }

        /// Dot products of one repacked Q5_0 row (groups of four blocks) with `R` activation rows.
        #[target_feature(enable = $features)]
        pub unsafe fn dot_q5_0<const R: usize>(w: &[u8], a: [&[Q8x4]; R]) -> [f32; R] {
            let ng = w.len() / 88;
            for r in a.iter() {
                assert!(r.len() >= ng);
            }
            let m4 = vdupq_n_u8(0xF);
            let mut acc = [[vdupq_n_f32(0.0); 2]; R];
            for (i, g) in w.chunks_exact(88).enumerate() {
                let dw = group_scales(g);
                // Bits 16 h .. 16 h + 16 of fifth-bit word k: half h of step k.
                let fifth = |k: usize, h: usize| u16::from_le_bytes([g[8 + 4 * k + 2 * h], g[9 + 4 * k + 2 * h]]);
                let mut dp = [[[vdupq_n_s32(0); 2]; 2]; R];
                for r in 0..R {
                    // Values are stored as q + 16; take 16 × the activation sums back.
                    let y = a[r].get_unchecked(i);
                    for h in 0..2 {
                        dp[r][h][0] = vnegq_s32(vshlq_n_s32::<4>(vld1q_s32(y.lsum.as_ptr().add(4 * h))));
                    }
                }
                for c in 0..2 {
                    for h in 0..2 {
                        let bits = vld1q_u8(g.as_ptr().add(24 + 32 * c + 16 * h));
                        let qa = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(bits, m4), bit4(fifth(c, h))));
                        let qb = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(bits), bit4(fifth(c + 2, h))));
                        for r in 0..R {
                            let y = a[r].get_unchecked(i).qs.as_ptr();
                            dp[r][h][0] = dot4(dp[r][h][0], qa, vld1q_s8(y.add(32 * c + 16 * h)));
                            dp[r][h][1] = dot4(dp[r][h][1], qb, vld1q_s8(y.add(32 * c + 64 + 16 * h)));
                        }
                    }
                }
                for r in 0..R {
                    let y = a[r].get_unchecked(i);
                    for h in 0..2 {
                        let s = vmulq_f32(dw[h], vld1q_f32(y.d.as_ptr().add(4 * h)));
                        acc[r][h] = vfmaq_f32(acc[r][h], s, vcvtq_f32_s32(vaddq_s32(dp[r][h][0], dp[r][h][1])));
                    }
                }
            }
            std::array::from_fn(|r| vaddvq_f32(vaddq_f32(acc[r][0], acc[r][1])))
        }
    };
}

/// FEAT_DotProd: `sdot`.
pub mod dotprod {
    use super::*;
    kernels!("neon,dotprod", true);
}

/// Plain NEON: `smull` and pairwise adds.
pub mod plain {
    use super::*;
    kernels!("neon", false);
}
