//! Attention of one query position (decode) over a KV cache read in place: per query head, the
//! scaled dot products with every visible key, an optional tanh soft-cap, softmax, and the
//! probability-weighted sum of values. A task is a KV head with a run of the query heads that
//! share it, so each cache row is read once per run and nothing is copied or expanded; over a
//! long context a task is a KV head with all its query heads and a chunk of the keys, the chunks'
//! softmax states merged after (each cache row then read once in all). Tasks are shared out over
//! the kernel `pool`, and the loops vectorize with AVX2 where the CPU has it.
//! It does not mask (one query sees every key it is given) and does not handle prompts: those
//! go through candle's batched matmuls and `softmax`.

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
///
/// A task is one KV head with a run of the query heads that share it: each key and value row is
/// read once for the whole run (grouped-query models share one KV head among up to eight query
/// heads), and runs are cut short enough to give every pool thread about two tasks. Where that
/// would cut runs and the context holds at least two `CHUNK_KEYS`, a task is instead a KV head's
/// whole run over a chunk of the keys (`attend_chunked`).
#[allow(clippy::too_many_arguments)]
pub fn attend_one(q: &[f32], heads: usize, kv_heads: usize, d: usize, kv: &KvView<'_>, keys: Range<usize>, scale: f32, softcap: Option<f32>, out: &mut [f32], pool: &Pool) {
    assert!(kv_heads > 0 && heads.is_multiple_of(kv_heads) && q.len() == heads * d && out.len() == heads * d);
    assert!(keys.end <= kv.capacity && kv.k.len() >= kv_heads * kv.capacity * d && kv.v.len() >= kv_heads * kv.capacity * d);
    let rep = heads / kv_heads;
    let wanted = 2 * pool.threads();
    if rep > 1 && kv_heads < wanted && keys.len() >= 2 * CHUNK_KEYS {
        let chunks = wanted.div_ceil(kv_heads).min(keys.len() / CHUNK_KEYS);
        return attend_chunked(q, rep, kv_heads, d, kv, keys, chunks, scale, softcap, out, pool);
    }
    // About two tasks per thread; the count is taken again from the run length so none is empty.
    let runs_per_kv = wanted.div_ceil(kv_heads).clamp(1, rep);
    let run = rep.div_ceil(runs_per_kv);
    let runs_per_kv = rep.div_ceil(run);
    let out_ptr = SendPtr(out.as_mut_ptr());
    let task = |t: usize| {
        let kvh = t / runs_per_kv;
        let h0 = kvh * rep + (t % runs_per_kv) * run;
        let h1 = (h0 + run).min((kvh + 1) * rep);
        // SAFETY: each task writes only its own heads' outputs `h0 * d .. h1 * d`; `out` outlives the job.
        let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(h0 * d), (h1 - h0) * d) };
        let base = kvh * kv.capacity * d;
        let (k, v) = (&kv.k[base..base + kv.capacity * d], &kv.v[base..base + kv.capacity * d]);
        let run = Run { q: &q[h0 * d..h1 * d], k, v, d, keys: keys.clone(), scale, softcap };
        #[cfg(target_arch = "x86_64")]
        if super::x86::has_avx2() {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { run.attend_avx2(o) };
        }
        run.attend(o);
    };
    pool.run(kv_heads * runs_per_kv, &task);
}

/// The fewest keys a chunk of a long context takes (`attend_chunked`).
pub const CHUNK_KEYS: usize = 256;

/// `attend_one` over `chunks` near-equal chunks of `keys` for each KV head (every query head of
/// it in one task), each task's softmax state kept unnormalized with its max and sum, then merged.
#[allow(clippy::too_many_arguments)]
fn attend_chunked(q: &[f32], rep: usize, kv_heads: usize, d: usize, kv: &KvView<'_>, keys: Range<usize>, chunks: usize, scale: f32, softcap: Option<f32>, out: &mut [f32], pool: &Pool) {
    let chunk = keys.len().div_ceil(chunks.max(1));
    let chunks = keys.len().div_ceil(chunk);
    // Per task (KV head, chunk): its heads' unnormalized values, then each head's (max, sum).
    let mut values = vec![0f32; kv_heads * chunks * rep * d];
    let mut stats = vec![0f32; kv_heads * chunks * rep * 2];
    let (values_ptr, stats_ptr) = (SendPtr(values.as_mut_ptr()), SendPtr(stats.as_mut_ptr()));
    let task = |t: usize| {
        let (kvh, c) = (t / chunks, t % chunks);
        let start = keys.start + c * chunk;
        // SAFETY: task t writes only its own slots of `values` and `stats`, which outlive the job.
        let (o, st) = unsafe { (std::slice::from_raw_parts_mut(values_ptr.get().add(t * rep * d), rep * d), std::slice::from_raw_parts_mut(stats_ptr.get().add(t * rep * 2), rep * 2)) };
        let base = kvh * kv.capacity * d;
        let (k, v) = (&kv.k[base..base + kv.capacity * d], &kv.v[base..base + kv.capacity * d]);
        let run = Run { q: &q[kvh * rep * d..(kvh + 1) * rep * d], k, v, d, keys: start..(start + chunk).min(keys.end), scale, softcap };
        #[cfg(target_arch = "x86_64")]
        if super::x86::has_avx2() {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { run.partial_avx2(o, st) };
        }
        run.partial(o, st);
    };
    pool.run(kv_heads * chunks, &task);
    for (h, oh) in out.chunks_exact_mut(d).enumerate() {
        let (kvh, r) = (h / rep, h % rep);
        let slot = |c: usize| (kvh * chunks + c) * rep + r;
        let top = (0..chunks).map(|c| stats[2 * slot(c)]).fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f32> = (0..chunks).map(|c| (stats[2 * slot(c)] - top).exp()).collect();
        let sum: f32 = (0..chunks).map(|c| weights[c] * stats[2 * slot(c) + 1]).sum();
        oh.iter_mut().for_each(|x| *x = 0.0);
        for (c, w) in weights.iter().enumerate() {
            let vals = &values[slot(c) * d..(slot(c) + 1) * d];
            oh.iter_mut().zip(vals).for_each(|(o, x)| *o += w * x);
        }
        oh.iter_mut().for_each(|x| *x /= sum);
    }
}

/// Query heads sharing one KV head (`q` is their rows, `k` and `v` that head's cache rows).
struct Run<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    d: usize,
    keys: Range<usize>,
    scale: f32,
    softcap: Option<f32>,
}

impl Run<'_> {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn attend_avx2(&self, out: &mut [f32]) {
        self.attend(out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn partial_avx2(&self, out: &mut [f32], stats: &mut [f32]) {
        self.partial(out, stats)
    }

    /// The run's outputs (`heads × d`): every key and value row is read once for all its heads.
    #[inline(always)]
    fn attend(&self, out: &mut [f32]) {
        let mut p = self.scores();
        for s in p.chunks_exact_mut(self.keys.len().max(1)) {
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            s.iter_mut().for_each(|x| *x = (*x - max).exp());
            let sum: f32 = s.iter().sum();
            s.iter_mut().for_each(|x| *x /= sum);
        }
        self.weighted_sum(&p, out);
    }

    /// As `attend`, but the values stay unnormalized, `Σ exp(s - max) · v`, and each head's
    /// `(max, Σ exp(s - max))` go to `stats`, for merging with other chunks of keys.
    #[inline(always)]
    fn partial(&self, out: &mut [f32], stats: &mut [f32]) {
        let mut p = self.scores();
        for (s, st) in p.chunks_exact_mut(self.keys.len().max(1)).zip(stats.chunks_exact_mut(2)) {
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            s.iter_mut().for_each(|x| *x = (*x - max).exp());
            st.copy_from_slice(&[max, s.iter().sum()]);
        }
        self.weighted_sum(&p, out);
    }

    /// Each head's scaled (and soft-capped) scores: row `h`, one value a key.
    #[inline(always)]
    fn scores(&self) -> Vec<f32> {
        let (d, n) = (self.d, self.keys.len());
        let mut p = vec![0f32; self.q.len() / d * n];
        for (i, j) in self.keys.clone().enumerate() {
            let kj = &self.k[j * d..(j + 1) * d];
            for (h, qh) in self.q.chunks_exact(d).enumerate() {
                p[h * n + i] = dot(qh, kj) * self.scale;
            }
        }
        if let Some(cap) = self.softcap {
            p.iter_mut().for_each(|x| *x = (*x / cap).tanh() * cap);
        }
        p
    }

    /// `out` (`heads × d`) = each head's weights `p` times the value rows, each row read once.
    #[inline(always)]
    fn weighted_sum(&self, p: &[f32], out: &mut [f32]) {
        let (d, n) = (self.d, self.keys.len());
        out.iter_mut().for_each(|x| *x = 0.0);
        for (i, j) in self.keys.clone().enumerate() {
            let vj = &self.v[j * d..(j + 1) * d];
            for (h, oh) in out.chunks_exact_mut(d).enumerate() {
                let w = p[h * n + i];
                oh.iter_mut().zip(vj).for_each(|(o, v)| *o += w * v);
            }
        }
    }
}

/// A dot product in eight independent lanes, so that it vectorizes.
#[inline(always)]
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
