//! A prompt's attention scores to probabilities on the CPU, in one pass per row over the kernel
//! `pool`: the scale, an optional tanh soft-cap, the causal (and sliding-window) visibility of
//! each key computed from positions, and the softmax, in place of candle's four passes and a
//! mask tensor (on a 2,048-token prompt of Qwen2.5-1.5B those took a quarter of the prompt's
//! time on two cores). `e^x` is the vectorizable polynomial of `gated::exp`. Decode (one query
//! row) goes through `attend` instead; this does not multiply by the values.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape};

use super::gated::exp;
use super::pool::Pool;
use super::SendPtr;

/// Where the rows' queries and keys sit: row `r` is query `r % t`, at position `start + r % t`;
/// column `j` is the key at position `first_key + j`. A query sees keys at or before it, and
/// with `window` only those fewer than `window` positions behind.
#[derive(Debug, Clone, Copy)]
pub struct Visibility {
    pub t: usize,
    pub start: usize,
    pub first_key: usize,
    pub window: Option<usize>,
}

impl Visibility {
    /// The columns row `r` may see.
    fn columns(&self, r: usize, keys: usize) -> std::ops::Range<usize> {
        let q = self.start + r % self.t;
        let hi = (q + 1).saturating_sub(self.first_key).min(keys);
        let lo = self.window.map_or(0, |w| (q + 1).saturating_sub(w).saturating_sub(self.first_key)).min(hi);
        lo..hi
    }
}

/// Rows per pool task at the fewest (below this a task claim costs more than it saves).
const MIN_ROWS: usize = 4;

/// Each row of `scores` (`rows × keys`, row-major) as its softmax over its visible columns of
/// `scale · s` (soft-capped as `cap · tanh(x / cap)` first when `softcap` is set), written to
/// `out`; hidden columns become 0.
pub fn prompt_softmax(scores: &[f32], out: &mut [f32], keys: usize, vis: Visibility, scale: f32, softcap: Option<f32>, pool: &Pool) {
    assert!(keys > 0 && vis.t > 0 && scores.len().is_multiple_of(keys) && out.len() == scores.len());
    let rows = scores.len() / keys;
    let per_task = rows.div_ceil(2 * pool.threads()).max(MIN_ROWS);
    let ptr = SendPtr(out.as_mut_ptr());
    let task = |task: usize| {
        for r in task * per_task..((task + 1) * per_task).min(rows) {
            // SAFETY: each task owns its rows of `out`, which outlives the job.
            let row = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r * keys), keys) };
            softmax_row(&scores[r * keys..(r + 1) * keys], row, vis.columns(r, keys), scale, softcap);
        }
    };
    let tasks = rows.div_ceil(per_task);
    if tasks <= 1 {
        (0..tasks).for_each(task);
    } else {
        pool.run(tasks, &task);
    }
}

/// One row, with the widest vectors this CPU has.
fn softmax_row(scores: &[f32], out: &mut [f32], seen: std::ops::Range<usize>, scale: f32, softcap: Option<f32>) {
    #[cfg(target_arch = "x86_64")]
    if super::x86::has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        unsafe { softmax_row_avx2(scores, out, seen, scale, softcap) };
        return;
    }
    softmax_row_portable(scores, out, seen, scale, softcap)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_row_avx2(scores: &[f32], out: &mut [f32], seen: std::ops::Range<usize>, scale: f32, softcap: Option<f32>) {
    softmax_row_portable(scores, out, seen, scale, softcap)
}

/// Each pass a plain map or an eight-lane reduction, so that all of them vectorize.
#[inline(always)]
fn softmax_row_portable(scores: &[f32], out: &mut [f32], seen: std::ops::Range<usize>, scale: f32, softcap: Option<f32>) {
    let (lo, hi) = (seen.start, seen.end);
    let visible = &mut out[lo..hi];
    match softcap {
        Some(cap) => visible.iter_mut().zip(&scores[lo..hi]).for_each(|(o, s)| *o = (s * scale / cap).tanh() * cap),
        None => visible.iter_mut().zip(&scores[lo..hi]).for_each(|(o, s)| *o = s * scale),
    }
    let max = lanes(visible, f32::NEG_INFINITY, f32::max);
    visible.iter_mut().for_each(|x| *x = exp(*x - max));
    let inv = 1.0 / lanes(visible, 0.0, |a, b| a + b);
    visible.iter_mut().for_each(|x| *x *= inv);
    out[..lo].fill(0.0);
    out[hi..].fill(0.0);
}

/// `xs` folded by `f` in eight independent lanes (then across them), so that it vectorizes.
#[inline(always)]
fn lanes(xs: &[f32], init: f32, f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [init; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(init, |a, &x| f(a, x));
    for c in chunks {
        for l in 0..8 {
            acc[l] = f(acc[l], c[l]);
        }
    }
    acc.iter().fold(tail, |a, &x| f(a, x))
}

/// `prompt_softmax` as a candle op on contiguous f32 CPU tensors `(.., rows, keys)`.
pub struct PromptSoftmaxOp {
    pub vis: Visibility,
    pub scale: f32,
    pub softcap: Option<f32>,
}

impl CustomOp1 for PromptSoftmaxOp {
    fn name(&self) -> &'static str {
        "shoal-prompt-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(data), Some((a, b))) = (storage, layout.contiguous_offsets()) else {
            return Err(candle_core::Error::Msg("the prompt softmax takes contiguous f32 scores".into()));
        };
        let keys = layout.dims().last().copied().unwrap_or(0);
        if keys == 0 || self.vis.t == 0 || !(b - a).is_multiple_of(keys) {
            return Err(candle_core::Error::Msg(format!("the prompt softmax cannot take scores of shape {:?}", layout.dims())));
        }
        let mut out = vec![0f32; b - a];
        prompt_softmax(&data[a..b], &mut out, keys, self.vis, self.scale, self.softcap, super::pool::global());
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the rule applied key by key with std's exp: causal, windowed, soft-capped.
    #[test]
    fn rows_follow_the_visibility_rule_and_sum_to_one() {
        let pool = Pool::new(2);
        let (t, keys) = (5, 9);
        for (start, first_key, window, softcap) in [(4, 0, None, None), (4, 0, Some(3), Some(20.0)), (10, 6, Some(4), None)] {
            let rows = 2 * t; // two heads over the same queries
            let raw: Vec<f32> = (0..rows * keys).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7).collect();
            let mut got = vec![f32::NAN; raw.len()];
            let vis = Visibility { t, start, first_key, window };
            prompt_softmax(&raw, &mut got, keys, vis, 0.5, softcap, &pool);
            for r in 0..rows {
                let q = start + r % t;
                let seen = |j: usize| {
                    let k = first_key + j;
                    k <= q && window.is_none_or(|w| q - k < w)
                };
                let logit = |j: usize| {
                    let x = raw[r * keys + j] * 0.5;
                    softcap.map_or(x, |c: f32| (x / c).tanh() * c)
                };
                let max = (0..keys).filter(|&j| seen(j)).map(logit).fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = (0..keys).filter(|&j| seen(j)).map(|j| (logit(j) - max).exp()).sum();
                for j in 0..keys {
                    let want = if seen(j) { (logit(j) - max).exp() / sum } else { 0.0 };
                    assert!((got[r * keys + j] - want).abs() < 1e-6, "row {r} key {j}: {} vs {want} ({start}, {first_key}, {window:?})", got[r * keys + j]);
                }
            }
        }
    }
}
