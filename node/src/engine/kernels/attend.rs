//! Attention of one query position (decode) over a KV cache read in place: per query head, the
//! scaled dot products with every visible key, an optional tanh soft-cap, softmax, and the
//! probability-weighted sum of values, with heads shared out over the kernel `pool`. Grouped-query
//! heads read their KV head directly, so nothing is copied or expanded.
//! It does not mask (one query sees every key it is given) and does not handle prompts: those
//! go through candle's batched matmuls.

use std::ops::Range;

use super::pool::Pool;
use super::SendPtr;

/// The KV cache of one layer as stored: `(kv_heads, capacity, head_dim)` f32, row-major.
pub struct KvView<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub capacity: usize,
}

/// `out[h * d .. (h + 1) * d]` = attention of query head `h` (`q` is `heads × d`) over positions
/// `keys` of its KV head (query heads `h` sharing KV head `h / (heads / kv_heads)`).
#[allow(clippy::too_many_arguments)]
pub fn attend_one(q: &[f32], heads: usize, kv_heads: usize, d: usize, kv: &KvView<'_>, keys: Range<usize>, scale: f32, softcap: Option<f32>, out: &mut [f32], pool: &Pool) {
    assert!(heads % kv_heads.max(1) == 0 && q.len() == heads * d && out.len() == heads * d);
    assert!(keys.end <= kv.capacity && kv.k.len() >= kv_heads * kv.capacity * d && kv.v.len() >= kv_heads * kv.capacity * d);
    let rep = heads / kv_heads;
    let out_ptr = SendPtr(out.as_mut_ptr());
    let task = |h: usize| {
        let kvh = h / rep;
        let qh = &q[h * d..(h + 1) * d];
        let base = kvh * kv.capacity * d;
        let mut s: Vec<f32> = keys.clone().map(|j| dot(qh, &kv.k[base + j * d..base + (j + 1) * d]) * scale).collect();
        if let Some(cap) = softcap {
            s.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
        }
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        s.iter_mut().for_each(|x| *x = (*x - max).exp());
        let sum: f32 = s.iter().sum();
        s.iter_mut().for_each(|x| *x /= sum);
        // SAFETY: each task writes only its own head's `d` outputs; `out` outlives the job.
        let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(h * d), d) };
        o.iter_mut().for_each(|x| *x = 0.0);
        for (p, j) in s.iter().zip(keys.clone()) {
            let vj = &kv.v[base + j * d..base + (j + 1) * d];
            o.iter_mut().zip(vj).for_each(|(o, v)| *o += p * v);
        }
    };
    pool.run(heads, &task);
}

/// A dot product in eight independent lanes, so that it vectorizes.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}
