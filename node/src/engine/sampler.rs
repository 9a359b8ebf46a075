//! Turning logits into the next token: repetition, presence and frequency penalties over a
//! recent window, then greedy or top-k / temperature / top-p / min-p sampling with a seeded
//! generator (same seed, same output). It knows nothing of text or stop strings.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{EngineError, Result};

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
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Ok(Sampler { params, rng: StdRng::seed_from_u64(seed), counts: Default::default() })
    }

    /// Picks the next token from `logits` given the sequence so far (`history`).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.apply_penalties(logits, history);
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let temp = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Tokens more than e^-40 below the best cannot matter after softmax: drop them before sorting.
        let floor = max - 40.0 * temp;
        let mut cands: Vec<(u32, f32)> = logits.iter().enumerate().filter(|(_, l)| **l >= floor).map(|(i, l)| (i as u32, *l)).collect();
        cands.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(k) = self.params.top_k {
            cands.truncate(k.max(1));
        }
        let mut probs: Vec<f32> = cands.iter().map(|(_, l)| ((l - max) / temp).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut keep = probs.len();
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate() {
                acc += p;
                if acc >= self.params.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if self.params.min_p > 0.0 {
            let threshold = self.params.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|p| **p >= threshold).count().max(1));
        }
        let kept = &probs[..keep];
        let r = self.rng.random::<f32>() * kept.iter().sum::<f32>();
        let mut acc = 0.0;
        for (i, p) in kept.iter().enumerate() {
            acc += p;
            if r < acc {
                return cands[i].0;
            }
        }
        cands[keep - 1].0
    }

    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
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
