//! A pipeline stage's compute: one shard serving many requests, each with its own KV cache
//! (and, at the last stage, its own seeded sampler), keyed by request id. It checks that every
//! step continues its request where it left off, evicts idle or excess sessions, and converts
//! hidden states to and from the little-endian f32 bytes that cross the wire. It neither
//! awaits nor knows which node sends the work or where the output goes.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};

use super::cache::ShardCache;
use super::sampler::{Sampler, SamplingParams};
use super::shard::{Shard, ShardInput, ShardOutput};
use super::{EngineError, Result};

/// What a step feeds a stage.
pub enum StepInput {
    Tokens(Vec<u32>),
    /// `(rows, hidden)` f32 values, little-endian, as they arrive from the previous stage.
    Hidden { rows: usize, hidden: usize, data: Vec<u8> },
}

/// What a stage gives back: hidden states for the next stage, or the sampled token.
#[derive(Debug)]
pub enum StepOutput {
    Hidden { rows: usize, hidden: usize, data: Vec<u8> },
    Token(u32),
}

/// One step of one request at this stage.
pub struct Step {
    pub request_id: u64,
    /// Position of the first input row; 0 starts (or restarts) the request.
    pub position: usize,
    pub input: StepInput,
    /// Used by the last stage only: how to pick the token, and the recent tokens for penalties.
    pub sampling: SamplingParams,
    pub history: Vec<u32>,
}

struct Session {
    cache: ShardCache,
    sampler: Option<Sampler>,
    last_used: Instant,
}

pub struct StageService {
    shard: Shard,
    sessions: HashMap<u64, Session>,
    max_sessions: usize,
    idle_timeout: Duration,
}

impl StageService {
    pub fn new(shard: Shard, max_sessions: usize, idle_timeout: Duration) -> Self {
        StageService { shard, sessions: HashMap::new(), max_sessions: max_sessions.max(1), idle_timeout }
    }

    pub fn shard(&self) -> &Shard {
        &self.shard
    }

    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Forgets a request's cache (it finished, or the entry node gave up on it).
    pub fn release(&mut self, request_id: u64) {
        self.sessions.remove(&request_id);
    }

    pub fn step(&mut self, step: Step) -> Result<StepOutput> {
        self.evict_idle();
        if step.position == 0 {
            self.sessions.remove(&step.request_id);
            if self.sessions.len() >= self.max_sessions {
                // Make room by dropping the least recently used request; its entry node re-prefills if it returns.
                if let Some(oldest) = self.sessions.iter().min_by_key(|(_, s)| s.last_used).map(|(id, _)| *id) {
                    self.sessions.remove(&oldest);
                }
            }
            let sampler = if self.shard.is_last() { Some(Sampler::new(step.sampling.clone())?) } else { None };
            self.sessions.insert(step.request_id, Session { cache: self.shard.new_cache(), sampler, last_used: Instant::now() });
        }
        let session = self
            .sessions
            .get_mut(&step.request_id)
            .ok_or_else(|| EngineError::Shard(format!("request {} is unknown here (evicted or never started): restart it from position 0", step.request_id)))?;
        if session.cache.position() != step.position {
            let have = session.cache.position();
            self.sessions.remove(&step.request_id);
            return Err(EngineError::Shard(format!("request {} continues at position {} but this stage is at {have}: restart it from position 0", step.request_id, step.position)));
        }
        session.last_used = Instant::now();
        let output = match step.input {
            StepInput::Tokens(ids) => self.shard.forward(ShardInput::Tokens(&ids), &mut session.cache, false),
            StepInput::Hidden { rows, hidden, data } => {
                let h = hidden_from_bytes(rows, hidden, &data, self.shard.device())?;
                self.shard.forward(ShardInput::Hidden(h), &mut session.cache, false)
            }
        };
        let output = match output {
            Ok(o) => o,
            Err(e) => {
                self.sessions.remove(&step.request_id);
                return Err(e);
            }
        };
        match output {
            ShardOutput::Hidden(h) => {
                let (rows, hidden, data) = hidden_to_bytes(&h)?;
                Ok(StepOutput::Hidden { rows, hidden, data })
            }
            ShardOutput::Logits(l) => {
                let sampler = session.sampler.as_mut().ok_or_else(|| EngineError::Shard("the last stage has no sampler for this request".into()))?;
                Ok(StepOutput::Token(sampler.sample_logits(&l.squeeze(0)?, &step.history)?))
            }
        }
    }

    fn evict_idle(&mut self) {
        let timeout = self.idle_timeout;
        self.sessions.retain(|_, s| s.last_used.elapsed() < timeout);
    }
}

/// `(1, rows, hidden)` f32 hidden states → `(rows, hidden, little-endian bytes)`.
pub fn hidden_to_bytes(h: &Tensor) -> Result<(usize, usize, Vec<u8>)> {
    let (_, rows, hidden) = h.dims3()?;
    let values = h.flatten_all()?.to_vec1::<f32>()?;
    let mut data = Vec::with_capacity(values.len() * 4);
    for v in values {
        data.extend_from_slice(&v.to_le_bytes());
    }
    Ok((rows, hidden, data))
}

/// The inverse of `hidden_to_bytes`, checking the size before building the tensor.
pub fn hidden_from_bytes(rows: usize, hidden: usize, data: &[u8], device: &Device) -> Result<Tensor> {
    let expected = rows.checked_mul(hidden).and_then(|n| n.checked_mul(4));
    if expected != Some(data.len()) || rows == 0 {
        return Err(EngineError::Shard(format!("hidden states of {} bytes do not hold {rows} rows of {hidden} f32 values", data.len())));
    }
    let values: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(Tensor::from_vec(values, (1, rows, hidden), device)?)
}
