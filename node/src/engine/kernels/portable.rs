//! Portable kernels: GGUF block decoding, the load-time repacking of blocks into step order (and
//! the eight-row interleaving of k-quant rows for the x86 kernels),
//! row dequantization and the integer dot products of each (repacked) weight format with
//! quantized activations, in plain Rust written so that the compiler
//! vectorizes it (this is the path on CPUs without a hand-written one, NEON included).
//! They are also the reference the SIMD kernels are tested against. No `unsafe` here.

use super::act::{Q8x4, Q8K};

#[inline]
pub fn f16_at(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// The eight 6-bit scales and mins of a Q4_K block as GGUF packs them (its 12 `scales` bytes).
fn gguf_q4k_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
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

/// The eight 6-bit scales and mins of a repacked Q4_K block (its 12 `scales` bytes, see
/// `repack_q4k`): byte j < 8 holds the low 4 bits of scale j and (high nibble) of min j; the
/// little-endian word at 8 holds the high 2 bits of scale j at bit `2 j` and of min j at `16 + 2 j`.
#[inline]
pub fn q4k_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let lo = u64::from_le_bytes(s[0..8].try_into().expect("8 bytes"));
    let hi = u32::from_le_bytes(s[8..12].try_into().expect("4 bytes"));
    let sc = (lo & 0x0F0F_0F0F_0F0F_0F0F) | spread_2bit_fields(hi);
    let mn = ((lo >> 4) & 0x0F0F_0F0F_0F0F_0F0F) | spread_2bit_fields(hi >> 16);
    (sc.to_le_bytes(), mn.to_le_bytes())
}

/// The eight 2-bit fields of `x`'s low 16 bits, field j into bits 4 and 5 of byte j.
#[inline]
pub fn spread_2bit_fields(x: u32) -> u64 {
    let mut x = (x & 0xFFFF) as u64;
    x = (x | x << 24) & 0x0000_00FF_0000_00FF;
    x = (x | x << 12) & 0x000F_000F_000F_000F;
    x = (x | x << 6) & 0x0303_0303_0303_0303;
    x << 4
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

// ---- Repacking: GGUF blocks → step order, in place, same size ----
//
// The SIMD kernels take 32 bytes of weights at a time and want each 32-bit lane to belong to one
// sub-block, so that an integer dot product (`vpdpbusd`, or `maddubs` + `madd`) sums a sub-block per
// lane and the sub-block scales apply per lane afterwards, with no horizontal sums per sub-block.
// So at load every block is rewritten in "step order" (the activations are quantized in the same
// order, see `act.rs`); headers (scales, `d`) keep their GGUF places. Values are stored unsigned:
// Q4_K's 0..15 as they are, Q6_K's 0..63 without the -32, Q5_0's 0..31 without the -16.
//
// - Q4_K (144 bytes): `qs` byte `32 c + 4 s + e` (c < 4) holds in its low nibble value
//   `32 s + 4 c + e` (step c) and in its high nibble value `32 s + 4 (c + 4) + e` (step c + 4).
// - Q6_K (210 bytes): `ql` byte `32 c + i` (i = 4 s + e) holds step c's low 4 bits in its low nibble
//   and step c + 4's in its high nibble; `qh` byte `32 h + i` holds in bits `2 j, 2 j + 1` the high
//   2 bits of step `2 j + h`. Step k, byte i is value `32 s + 4 k + e`.
// - Q5_0 and Q8_0 go in groups of four blocks (128 values; rows must be whole groups): the four
//   f16 scales first, then step k (k < 4) byte `32 k + 8 s + e` is value `8 k + e` of block s.
//   Q8_0: 128 signed bytes. Q5_0: 16 bytes of fifth bits (bit i of little-endian word k is step k,
//   byte i), then 64 bytes of nibbles, byte `32 c + i` holding step c (low) and step c + 2 (high).

/// Rewrites one Q4_K block (144 bytes) into step order, and its scales into the layout
/// `q4k_scales_mins` reads: the same 12 bytes, unpacked by a few masks instead of GGUF's shuffle.
pub fn repack_q4k(b: &mut [u8]) {
    let (sc, mn) = gguf_q4k_scales_mins(&b[4..16]);
    let mut hi = 0u32;
    for j in 0..8 {
        b[4 + j] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4);
        hi |= u32::from(sc[j] >> 4) << (2 * j) | u32::from(mn[j] >> 4) << (16 + 2 * j);
    }
    b[12..16].copy_from_slice(&hi.to_le_bytes());
    let v = q4k_values(&b[16..144]);
    for c in 0..4 {
        for s in 0..8 {
            for e in 0..4 {
                b[16 + 32 * c + 4 * s + e] = v[32 * s + 4 * c + e] | (v[32 * s + 4 * (c + 4) + e] << 4);
            }
        }
    }
}

/// Rewrites one Q6_K block (210 bytes) into step order.
pub fn repack_q6k(b: &mut [u8]) {
    let v = q6k_values(&b[0..128], &b[128..192]);
    let u = |k: usize, i: usize| (v[32 * (i / 4) + 4 * k + i % 4] + 32) as u8;
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for i in 0..32 {
        for c in 0..4 {
            ql[32 * c + i] = (u(c, i) & 0xF) | ((u(c + 4, i) & 0xF) << 4);
        }
        for h in 0..2 {
            qh[32 * h + i] = (0..4).map(|j| (u(2 * j + h, i) >> 4) << (2 * j)).fold(0, |a, x| a | x);
        }
    }
    b[0..128].copy_from_slice(&ql);
    b[128..192].copy_from_slice(&qh);
}

/// Rewrites four consecutive Q8_0 blocks (136 bytes) into one step-ordered group.
pub fn repack_q8_0x4(g: &mut [u8]) {
    let old = g.to_vec();
    for s in 0..4 {
        let blk = &old[34 * s..34 * s + 34];
        g[2 * s..2 * s + 2].copy_from_slice(&blk[0..2]);
        for k in 0..4 {
            g[8 + 32 * k + 8 * s..8 + 32 * k + 8 * s + 8].copy_from_slice(&blk[2 + 8 * k..2 + 8 * k + 8]);
        }
    }
}

/// Rewrites four consecutive Q5_0 blocks (88 bytes) into one step-ordered group.
pub fn repack_q5_0x4(g: &mut [u8]) {
    let old = g.to_vec();
    let mut u = [0u8; 128];
    for s in 0..4 {
        let blk = &old[22 * s..22 * s + 22];
        g[2 * s..2 * s + 2].copy_from_slice(&blk[0..2]);
        let v = q5_0_values(blk);
        for k in 0..4 {
            for e in 0..8 {
                u[32 * k + 8 * s + e] = (v[8 * k + e] + 16) as u8;
            }
        }
    }
    for k in 0..4 {
        let word = (0..32).fold(0u32, |w, i| w | (((u[32 * k + i] >> 4) as u32) << i));
        g[8 + 4 * k..12 + 4 * k].copy_from_slice(&word.to_le_bytes());
    }
    for c in 0..2 {
        for i in 0..32 {
            g[24 + 32 * c + i] = (u[32 * c + i] & 0xF) | ((u[32 * (c + 2) + i] & 0xF) << 4);
        }
    }
}

/// A repacked Q4_K block's 256 values (0..15) in step order.
#[inline]
fn q4k_steps(b: &[u8]) -> [u8; 256] {
    let mut u = [0u8; 256];
    for c in 0..4 {
        for i in 0..32 {
            u[32 * c + i] = b[16 + 32 * c + i] & 0xF;
            u[32 * (c + 4) + i] = b[16 + 32 * c + i] >> 4;
        }
    }
    u
}

/// A repacked Q6_K block's 256 values (0..63, unsigned) in step order.
#[inline]
fn q6k_steps(b: &[u8]) -> [u8; 256] {
    let mut u = [0u8; 256];
    for k in 0..8 {
        for i in 0..32 {
            let lo = (b[32 * (k % 4) + i] >> (4 * (k / 4))) & 0xF;
            let hi = (b[128 + 32 * (k % 2) + i] >> (2 * (k / 2))) & 3;
            u[32 * k + i] = lo | (hi << 4);
        }
    }
    u
}

/// A repacked Q5_0 group's 128 values (0..31, unsigned) in step order.
#[inline]
fn q5_0x4_steps(g: &[u8]) -> [u8; 128] {
    let mut u = [0u8; 128];
    for k in 0..4 {
        let word = u32::from_le_bytes([g[8 + 4 * k], g[9 + 4 * k], g[10 + 4 * k], g[11 + 4 * k]]);
        for i in 0..32 {
            let nib = (g[24 + 32 * (k % 2) + i] >> (4 * (k / 2))) & 0xF;
            u[32 * k + i] = nib | ((((word >> i) & 1) as u8) << 4);
        }
    }
    u
}

/// Sum over step bytes `32 k + off .. 32 k + off + len` for every step of `w · a`.
#[inline]
fn lane_dot<W: Copy + Into<i32>>(w: &[W], a: &[i8], steps: std::ops::Range<usize>, off: usize, len: usize) -> i32 {
    steps.map(|k| (32 * k + off..32 * k + off + len).map(|i| w[i].into() * a[i] as i32).sum::<i32>()).sum()
}

pub fn dot_q4k(w: &[u8], a: &[Q8K]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in w.chunks_exact(144).zip(a) {
        let (sc, mn) = q4k_scales_mins(&b[4..16]);
        let u = q4k_steps(b);
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        for s in 0..8 {
            sum += d * sc[s] as f32 * y.d * lane_dot(&u, &y.qs, 0..8, 4 * s, 4) as f32;
            sum -= dmin * mn[s] as f32 * y.ybs[s];
        }
    }
    sum
}

pub fn dot_q6k(w: &[u8], a: &[Q8K]) -> f32 {
    let mut sum = 0f32;
    for (b, y) in w.chunks_exact(210).zip(a) {
        let u = q6k_steps(b);
        let sc = |t: usize| (b[192 + t] as i8) as i32;
        let d = f16_at(b, 208);
        for s in 0..8 {
            let lo = (lane_dot(&u, &y.qs, 0..4, 4 * s, 4) + y.nbl[s]) as f32;
            let hi = (lane_dot(&u, &y.qs, 4..8, 4 * s, 4) + y.nbh[s]) as f32;
            sum += y.d * (d * sc(2 * s) as f32 * lo + d * sc(2 * s + 1) as f32 * hi);
        }
    }
    sum
}

pub fn dot_q8_0(w: &[u8], a: &[Q8x4]) -> f32 {
    let mut sum = 0f32;
    for (g, y) in w.chunks_exact(136).zip(a) {
        let q: &[i8] = bytemuck_i8(&g[8..136]);
        for s in 0..4 {
            sum += f16_at(g, 2 * s) * y.d[2 * s] * lane_dot(q, &y.qs, 0..4, 8 * s, 8) as f32;
        }
    }
    sum
}

pub fn dot_q5_0(w: &[u8], a: &[Q8x4]) -> f32 {
    let mut sum = 0f32;
    for (g, y) in w.chunks_exact(88).zip(a) {
        let u = q5_0x4_steps(g);
        for s in 0..4 {
            let dot = lane_dot(&u, &y.qs, 0..4, 8 * s, 8) - 16 * (y.lsum[2 * s] + y.lsum[2 * s + 1]);
            sum += f16_at(g, 2 * s) * y.d[2 * s] * dot as f32;
        }
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
        let u = q4k_steps(b);
        for (v, o) in o.iter_mut().enumerate() {
            let (s, k, e) = (v / 32, (v % 32) / 4, v % 4);
            *o = d * sc[s] as f32 * u[32 * k + 4 * s + e] as f32 - dmin * mn[s] as f32;
        }
    }
}

pub fn dequantize_q6k(w: &[u8], out: &mut [f32]) {
    for (b, o) in w.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(b, 208);
        let u = q6k_steps(b);
        for (v, o) in o.iter_mut().enumerate() {
            let (s, k, e) = (v / 32, (v % 32) / 4, v % 4);
            *o = d * (b[192 + v / 16] as i8) as f32 * (u[32 * k + 4 * s + e] as i32 - 32) as f32;
        }
    }
}

pub fn dequantize_q8_0(w: &[u8], out: &mut [f32]) {
    for (g, o) in w.chunks_exact(136).zip(out.chunks_exact_mut(128)) {
        for (v, o) in o.iter_mut().enumerate() {
            let (s, k, e) = (v / 32, (v % 32) / 8, v % 8);
            *o = f16_at(g, 2 * s) * (g[8 + 32 * k + 8 * s + e] as i8) as f32;
        }
    }
}

pub fn dequantize_q5_0(w: &[u8], out: &mut [f32]) {
    for (g, o) in w.chunks_exact(88).zip(out.chunks_exact_mut(128)) {
        let u = q5_0x4_steps(g);
        for (v, o) in o.iter_mut().enumerate() {
            let (s, k, e) = (v / 32, (v % 32) / 8, v % 8);
            *o = f16_at(g, 2 * s) * (u[32 * k + 8 * s + e] as i32 - 16) as f32;
        }
    }
}

// ---- Eight-row interleaving (Q4_K and Q6_K, rows in groups of eight) ----
//
// On x86-64 a k-quant matrix whose rows come in eights is stored one more step further: the
// step-ordered blocks `i` of rows `8 g .. 8 g + 8` are interleaved into one block of eight times
// the size, so that each 32-bit lane of a 256-bit register belongs to one row. A decode kernel then
// broadcasts 4 activation bytes, takes one integer dot product for eight rows, and does each
// block's scale work (6-bit unpacking, f16 conversion, multiply-adds) once for eight rows instead
// of once per row. The bytes are the same bytes, moved:
//
// - Q4_K ×8 (1152 bytes): `d` of row j at 2 j, `dmin` at 16 + 2 j; byte 32 + 8 s + j is row j's
//   scale byte s (low 4 bits of scale and min); the two high bits of row j's scale s sit in
//   bits 2 p, 2 p + 1 of byte 96 + 8 (s % 4) + j, with p = s / 4 for a scale and 2 + s / 4 for a
//   min, so that one 32-byte load shifted by 4, 2, 0 or -2 and masked puts them beside the low
//   bits of 32 values at once; byte 128 + 128 s + 32 k + 4 j + e is row j's `qs` byte
//   32 k + 4 s + e (values 32 s + 4 k + e, low nibble, and 32 s + 16 + 4 k + e, high nibble).
// - Q6_K ×8 (1680 bytes): `d` of row j at 2 j; byte 16 + 8 t + j is row j's scale t; then each
//   sub-block s in 192 bytes from 144 + 192 s: byte 32 c + 4 j + e of them is row j's `ql` byte
//   32 c + 4 s + e, and byte 128 + 32 h + 4 j + e its `qh` byte 128 + 32 h + 4 s + e.

/// Bytes of one interleaved block of eight rows.
pub fn x8_block_bytes(q4k: bool) -> usize {
    if q4k { 8 * 144 } else { 8 * 210 }
}

/// Where byte `o` of row `j`'s step-ordered block lives in the interleaved block (for every byte
/// that moves whole: all but Q4_K's word of high scale bits, bytes 12..16).
fn x8_place(q4k: bool, j: usize, o: usize) -> usize {
    let group = |base: usize, o: usize| base + 128 * ((o % 32) / 4) + 32 * (o / 32) + 4 * j + o % 4;
    if q4k {
        match o {
            0..4 => 16 * (o / 2) + 2 * j + o % 2,
            4..12 => 32 + 8 * (o - 4) + j,
            _ => group(128, o - 16),
        }
    } else {
        match o {
            0..128 => 144 + 192 * ((o % 32) / 4) + 32 * (o / 32) + 4 * j + o % 4,
            128..192 => 272 + 192 * ((o % 32) / 4) + 32 * ((o - 128) / 32) + 4 * j + o % 4,
            192..208 => 16 + 8 * (o - 192) + j,
            _ => 2 * j + (o - 208),
        }
    }
}

/// The byte ranges of a step-ordered block that move whole: single bytes in the headers, and
/// the 4-byte groups of values (which stay together).
fn x8_moves(q4k: bool) -> impl Iterator<Item = (usize, usize)> {
    let (header, bb) = if q4k { (12, 144) } else { (0, 192) };
    let groups = (if q4k { 16 } else { 0 }..bb).step_by(4).map(|o| (o, 4));
    let tail = if q4k { 0..0 } else { 192..210 };
    (0..header).chain(tail).map(|o| (o, 1)).chain(groups)
}

/// Interleaves eight step-ordered blocks (one per row) into `out`.
pub fn interleave_x8(q4k: bool, rows: [&[u8]; 8], out: &mut [u8]) {
    for (j, b) in rows.iter().enumerate() {
        for (o, n) in x8_moves(q4k) {
            let at = x8_place(q4k, j, o);
            out[at..at + n].copy_from_slice(&b[o..o + n]);
        }
    }
    if q4k {
        out[96..128].fill(0);
        for (j, b) in rows.iter().enumerate() {
            let hi = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
            for (at, p, shift) in q4k_x8_high_bits(j) {
                out[at] |= (((hi >> shift) & 3) as u8) << (2 * p);
            }
        }
    }
}

/// Row `j`'s step-ordered block, taken back out of an interleaved block.
pub fn row_of_x8(q4k: bool, x8: &[u8], j: usize, out: &mut [u8]) {
    for (o, n) in x8_moves(q4k) {
        let at = x8_place(q4k, j, o);
        out[o..o + n].copy_from_slice(&x8[at..at + n]);
    }
    if q4k {
        let mut hi = 0u32;
        for (at, p, shift) in q4k_x8_high_bits(j) {
            hi |= u32::from((x8[at] >> (2 * p)) & 3) << shift;
        }
        out[12..16].copy_from_slice(&hi.to_le_bytes());
    }
}

/// Where row `j`'s 16 high-bit pairs of a Q4_K block live in the interleaved block: (byte, pair
/// within the byte, the pair's bit offset in the step-ordered block's word at 12..16).
fn q4k_x8_high_bits(j: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..8).flat_map(move |s| [(96 + 8 * (s % 4) + j, s / 4, 2 * s), (96 + 8 * (s % 4) + j, 2 + s / 4, 16 + 2 * s)])
}

/// Row `j` of an interleaved group of eight rows (`blocks` interleaved blocks), step-ordered.
pub fn row_of_x8_group(q4k: bool, group: &[u8], j: usize) -> Vec<u8> {
    let (xb, bb) = (x8_block_bytes(q4k), x8_block_bytes(q4k) / 8);
    let mut row = vec![0u8; group.len() / 8];
    for (x8, out) in group.chunks_exact(xb).zip(row.chunks_exact_mut(bb)) {
        row_of_x8(q4k, x8, j, out);
    }
    row
}

/// The reference dot products of an interleaved group of eight rows with one activation row:
/// each row taken back out and multiplied as the step-ordered kernels do (bit for bit the same).
pub fn dot_x8(q4k: bool, group: &[u8], a: &[Q8K]) -> [f32; 8] {
    std::array::from_fn(|j| {
        let row = row_of_x8_group(q4k, group, j);
        if q4k { dot_q4k(&row, a) } else { dot_q6k(&row, a) }
    })
}
