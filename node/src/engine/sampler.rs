//! Turning logits into the next token: repetition, presence and frequency penalties over a
//! recent window, then greedy or top-k / temperature / top-p / min-p sampling with a seeded
//! generator (same seed, same output). It knows nothing of text or stop strings.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{EngineError, Result};

/// Most candidates a GPU hands back for the host's cuts (64 KB); a flatter distribution copies
/// the whole row instead.
#[cfg(feature = "cuda")]
const GPU_CANDIDATES: usize = 8192;

/// How many recent tokens the penalties look at (llama.cpp's default).
pub const DEFAULT_PENALTY_WINDOW: usize = 64;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub penalty_window: usize,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_window: DEFAULT_PENALTY_WINDOW,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Whether any repetition, presence or frequency penalty changes the logits.
    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if self.top_k == Some(0) {
            return bad("top_k must be >= 1".into());
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    counts: std::collections::HashMap<u32, u32>,
    /// The candidates of the current step, reused so that a step on the CPU allocates nothing.
    cands: Vec<(u32, f32)>,
    /// Page-locked host memory that whole rows of logits on a GPU are copied into (allocated at
    /// the first such step, then reused).
    #[cfg(feature = "cuda")]
    pinned: Option<super::cuda_decode::PinnedRow>,
}

/// Best first: the higher weight, then the lower token id.
fn best_first(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Ok(Sampler {
            params,
            rng: StdRng::seed_from_u64(seed),
            counts: Default::default(),
            cands: Vec::new(),
            #[cfg(feature = "cuda")]
            pinned: None,
        })
    }

    /// The temperature a pick on the GPU takes for these settings (`pick_token` in decode.cu: 0
    /// for the argmax, else a plain temperature draw), or `None` when penalties or cuts need the
    /// host. Either way it picks what `sample_logits` picks from logits on a GPU.
    pub fn device_temperature(&self) -> Option<f32> {
        let p = &self.params;
        let no_cuts = p.top_k.is_none() && p.top_p >= 1.0 && p.min_p == 0.0;
        (!p.has_penalties() && (p.temperature == 0.0 || no_cuts)).then_some(p.temperature)
    }

    /// The uniform draw a GPU pick takes: one a token from the generator for a temperature draw
    /// (as `sample_logits` takes it), none for greedy decoding.
    pub fn device_uniform(&mut self) -> f64 {
        if self.params.temperature > 0.0 { self.rng.random::<f64>() } else { 0.0 }
    }

    /// Picks the next token from a row of logits (rank 1) where the model left them (a GPU's memory, or
    /// the host's). On a GPU, plain greedy decoding reads only the argmax; on CUDA a plain
    /// temperature draw runs there too, and top-k / top-p / min-p gather their candidates there
    /// for `cut`. Every other setting needs the whole row on the host (a 600 KB copy for a 150k
    /// vocabulary, into page-locked memory on CUDA).
    pub fn sample_logits(&mut self, logits: &candle_core::Tensor, history: &[u32]) -> Result<u32> {
        let p = &self.params;
        if p.temperature == 0.0 && !p.has_penalties() && !logits.device().is_cpu() {
            #[cfg(feature = "cuda")]
            if logits.device().is_cuda() {
                return super::cuda_decode::argmax(logits);
            }
            return Ok(logits.argmax(0)?.to_scalar::<u32>()?);
        }
        #[cfg(feature = "cuda")]
        if logits.device().is_cuda() {
            if p.temperature > 0.0 && !p.has_penalties() && p.top_k.is_none() && p.top_p >= 1.0 && p.min_p == 0.0 {
                // A plain temperature draw runs where the logits are; it takes one uniform draw
                // a token from the generator, as `sample` does.
                let r = self.rng.random::<f64>();
                return super::cuda_decode::sample_temperature(logits, p.temperature, r);
            }
            if p.temperature > 0.0 && !p.has_penalties() {
                // Top-k, top-p or min-p: the candidates are gathered on the GPU (a few KB cross
                // the bus), then cut here as `distribution` cuts them.
                if let Some((all, cands)) = super::cuda_decode::sample_candidates(logits, p.temperature, p.top_k, p.top_p, p.min_p, GPU_CANDIDATES)? {
                    self.cands = cands;
                    self.cut(all);
                    return Ok(self.draw_candidate());
                }
            }
            let mut pinned = self.pinned.take();
            let id = super::cuda_decode::copy_to_pinned(logits, &mut pinned).map(|row| self.sample(row, history));
            self.pinned = pinned;
            return id;
        }
        Ok(self.sample(&mut logits.to_vec1::<f32>()?, history))
    }

    /// Picks the next token from `logits` given the sequence so far (`history`).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.apply_penalties(logits, history);
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        if p.top_k.is_none() && p.top_p >= 1.0 && p.min_p == 0.0 {
            // Every token is a candidate: draw straight from the weights.
            let total = to_weights(logits, p.temperature);
            let r = self.rng.random::<f64>() * total;
            return draw(logits.iter().enumerate().map(|(i, w)| (i as u32, *w)), r);
        }
        self.distribution(logits);
        self.draw_candidate()
    }

    /// A draw from the kept candidates, by weight.
    fn draw_candidate(&mut self) -> u32 {
        let r = self.rng.random::<f64>() * weight_sum(self.cands.iter().map(|c| c.1));
        draw(self.cands.iter().copied(), r)
    }

    /// The tokens that temperature, top-k, top-p and min-p keep (for `temperature > 0`), each
    /// with a weight proportional to its probability, the best token's being 1; `logits` is
    /// overwritten with every token's weight. The order is by token id unless top-k selected or
    /// top-p sorted (deterministic either way, so a seeded run repeats).
    /// A whole vocabulary is never sorted, nor even gathered: only tokens that can pass the
    /// cuts become candidates (top-k: those above a weight that at least k tokens reach; top-p:
    /// those heavy enough for its nucleus), then top-k selects, min-p filters and top-p sorts
    /// what is left (tens to hundreds of tokens for a real model).
    pub fn distribution(&mut self, logits: &mut [f32]) -> &[(u32, f32)] {
        let p = &self.params;
        let cands = &mut self.cands;
        cands.clear();
        let all = to_weights(logits, p.temperature);
        // The lightest weight a candidate can have (every candidate is also > 0).
        let lightest = match p.top_k {
            // The k best all weigh at least the first of these that k tokens reach.
            Some(k) => [(-1f32).exp(), (-4f32).exp(), (-16f32).exp()].into_iter().find(|t| logits.iter().filter(|w| **w >= *t).count() >= k).unwrap_or(0.0),
            // Tokens lighter than (1 - top_p)·total / n together weigh less than the share
            // top-p leaves out, so its nucleus (the shortest best-first prefix reaching top_p)
            // ends before any of them.
            None => p.min_p.max(((1.0 - p.top_p as f64) * all / logits.len() as f64) as f32),
        };
        cands.extend(logits.iter().enumerate().filter(|(_, w)| **w > 0.0 && **w >= lightest).map(|(i, w)| (i as u32, *w)));
        self.cut(all)
    }

    /// Top-k, min-p and top-p over the gathered candidates (in token order); `all` is the total
    /// weight of every token.
    fn cut(&mut self, all: f64) -> &[(u32, f32)] {
        let p = &self.params;
        let cands = &mut self.cands;
        if cands.is_empty() {
            // Only NaN logits: the first token, as argmax would say.
            cands.push((0, 1.0));
            return cands;
        }
        if let Some(k) = p.top_k.filter(|k| *k < cands.len()) {
            cands.select_nth_unstable_by(k.max(1) - 1, best_first);
            cands.truncate(k.max(1));
        }
        // Probabilities are normalised over the top-k candidates (else over every token),
        // before top-p and min-p cut.
        let total = if p.top_k.is_some() { weight_sum(cands.iter().map(|c| c.1)) } else { all };
        if p.min_p > 0.0 {
            cands.retain(|c| c.1 >= p.min_p);
        }
        if p.top_p < 1.0 {
            if p.top_k.is_some() {
                // As above, within the top-k.
                let light = ((1.0 - p.top_p as f64) * total / cands.len() as f64) as f32;
                cands.retain(|c| c.1 >= light);
            }
            cands.sort_unstable_by(best_first);
            let mut acc = 0.0;
            if let Some(i) = cands.iter().position(|c| {
                acc += c.1 as f64;
                acc >= p.top_p as f64 * total
            }) {
                cands.truncate(i + 1);
            }
        }
        cands
    }

    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        if !p.has_penalties() {
            return;
        }
        let window = &history[history.len().saturating_sub(p.penalty_window)..];
        self.counts.clear();
        for &id in window {
            *self.counts.entry(id).or_default() += 1;
        }
        for (&id, &count) in &self.counts {
            let Some(l) = logits.get_mut(id as usize) else { continue };
            if p.repetition_penalty != 1.0 {
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
            *l -= p.presence_penalty + p.frequency_penalty * count as f32;
        }
    }
}

/// Overwrites logits with weights relative to the best token's (whose weight is 1):
/// exp((l - max) / temperature), in one vectorised pass; tokens more than e^-40 below the best
/// cannot matter after softmax and get 0 (as NaN logits). Returns the weights' sum.
fn to_weights(logits: &mut [f32], temperature: f32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let floor = max - 40.0 * temperature;
    let scale = 1.0 / temperature;
    for l in logits.iter_mut() {
        *l = if *l >= floor { exp_nonpositive((*l - max) * scale) } else { 0.0 };
    }
    weight_sum(logits.iter().copied())
}

/// A sum of weights in f64 (a vocabulary's worth of f32 adds drifts), in eight running sums
/// (one is a chain of dependent adds, four times slower).
fn weight_sum(weights: impl Iterator<Item = f32>) -> f64 {
    let mut lanes = [0f64; 8];
    for (i, w) in weights.enumerate() {
        lanes[i % 8] += w as f64;
    }
    lanes.iter().sum()
}

/// The token where the running sum of weights first passes `r` (the last one if rounding
/// leaves `r` beyond the sum).
fn draw(weights: impl Iterator<Item = (u32, f32)>, r: f64) -> u32 {
    let mut acc = 0.0;
    let mut last = 0;
    for (id, w) in weights {
        if w > 0.0 {
            acc += w as f64;
            last = id;
            if r < acc {
                return id;
            }
        }
    }
    last
}

/// e^x for x <= 0, within 1e-5 relative (2^-126 below e^-87): 2^(x·log2 e) as an integer power of two
/// times a polynomial for the fraction. Straight-line float and integer arithmetic, so a loop
/// over a vocabulary's weights vectorises where libm's `expf` calls would not.
pub fn exp_nonpositive(x: f32) -> f32 {
    let t = (x * std::f32::consts::LOG2_E).max(-126.0);
    // Round to the nearest integer by the float-add trick: n in [-126, 0], f in [-0.5, 0.5].
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23
    let n = (t + ROUND) - ROUND;
    let f = t - n;
    // 2^f on [-0.5, 0.5] (Taylor series of e^(f ln 2) to the sixth power).
    let p = 1.0 + f * (0.693_147_2 + f * (0.240_226_5 + f * (0.055_504_11 + f * (0.009_618_129 + f * (0.001_333_355 + f * 0.000_154_035_3)))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Index of the largest logit; the lowest index wins a tie (as torch.argmax does).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, l) in logits.iter().enumerate() {
        if *l > logits[best] {
            best = i;
        }
    }
    best as u32
}
