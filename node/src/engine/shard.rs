//! A shard: the contiguous layer range `[start, end)` of one model that one node runs.
//! The first shard owns the token embedding, the last the final norm and LM head; a shard
//! loads only its own tensors. It turns tokens or hidden states into hidden states or logits
//! and keeps no per-sequence state of its own (that lives in `ShardCache`).
//! Long prompts run through its layers in chunks of at most `PREFILL_CHUNK` positions.
//! A shard may also be one member's tensor-parallel slice of its layers (`tp::TpMember`):
//! it then loads only its slices, and its layers all-reduce their partial sums with the group.

use candle_core::{DType, Device, Tensor, D};

use super::cache::ShardCache;
use super::layers::{rope_tables, DecoderLayer, Linear, RmsNorm};
use super::spec::ModelSpec;
use super::tp::{TpLayout, TpMember};
use super::weights::{EmbeddingTable, Role, Weights};
use super::{EngineError, Result};

/// Layers `[start, end)` of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerRange {
    pub start: usize,
    pub end: usize,
}

impl LayerRange {
    pub fn new(start: usize, end: usize) -> Self {
        LayerRange { start, end }
    }
    pub fn full(num_layers: usize) -> Self {
        LayerRange { start: 0, end: num_layers }
    }
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Display for LayerRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {})", self.start, self.end)
    }
}

/// What a shard consumes: token ids (first shard) or the previous shard's hidden states.
pub enum ShardInput<'a> {
    Tokens(&'a [u32]),
    Hidden(Tensor),
}

/// What a shard produces: hidden states `(1, t, hidden)` for the next shard, or logits.
pub enum ShardOutput {
    Hidden(Tensor),
    /// `(t, vocab)` when every position was asked for, else `(1, vocab)` for the last one.
    Logits(Tensor),
}

pub struct Shard {
    pub spec: ModelSpec,
    pub range: LayerRange,
    embed: Option<EmbeddingTable>,
    layers: Vec<DecoderLayer>,
    final_norm: Option<RmsNorm>,
    lm_head: Option<Linear>,
    device: Device,
    /// Activations inside the shard (f32 on the CPU; the checkpoint's half type on a GPU).
    /// Hidden states and logits leave the shard as f32 whatever this is.
    dtype: DType,
    /// This shard's tensor-parallel group, when it holds a slice of its layers.
    tp: Option<TpMember>,
    /// A tensor-parallel last shard holds only these rows of the LM head (of how many): its
    /// logits are gathered from the group (`tp::gather_logits`).
    head_part: Option<(std::ops::Range<usize>, usize)>,
    /// On a GPU: the fused one-token step (`cuda_decode`), when these layers fit its kernels.
    #[cfg(feature = "cuda")]
    fused: Option<super::cuda_decode::FusedDecode>,
}

impl Shard {
    pub fn load(weights: &Weights, spec: &ModelSpec, range: LayerRange, device: &Device) -> Result<Self> {
        Shard::load_tp(weights, spec, range, device, None)
    }

    /// Like `load`, but with `tp` only that member's slice of each layer (embedding, final norm
    /// and LM head are replicated); the split is `TpLayout::of`, whose error names why a model
    /// cannot be split that many ways.
    pub fn load_tp(weights: &Weights, spec: &ModelSpec, range: LayerRange, device: &Device, tp: Option<TpMember>) -> Result<Self> {
        let layout = match &tp {
            Some(m) => Some(TpLayout::of(weights, spec, m.slice.size)?),
            None => None,
        };
        let part = match (&layout, &tp) {
            (Some(l), Some(m)) => Some(l.part(m.slice)?.clone()),
            _ => None,
        };
        if range.is_empty() || range.end > spec.num_layers {
            return Err(EngineError::Shard(format!("layer range {range} is not inside the model's {} layers", spec.num_layers)));
        }
        let is_first = range.start == 0;
        let is_last = range.end == spec.num_layers;
        let tied = spec.tie_embeddings || !weights.contains(Role::LmHead, 0);
        let embed = if is_first || (is_last && tied) { Some(weights.embedding(device)?) } else { None };
        if let Some(e) = &embed {
            if e.rows() < spec.vocab_size {
                return Err(EngineError::InvalidModel(format!("embedding has {} rows for a vocabulary of {}", e.rows(), spec.vocab_size)));
            }
        }
        let layers = (range.start..range.end).map(|i| DecoderLayer::load(weights, spec, i, part.as_ref(), device)).collect::<Result<Vec<_>>>()?;
        // A group's last shard splits the LM head by vocabulary rows (see `tp::vocab_part`).
        let head_part = match (&tp, is_last) {
            (Some(m), true) if m.slice.size > 1 => {
                let rows = *weights.shape(if tied { Role::Embed } else { Role::LmHead }, 0)?.first().unwrap_or(&0);
                Some((super::tp::vocab_part(rows, m.slice), rows))
            }
            _ => None,
        };
        let (final_norm, lm_head) = if is_last {
            let head_role = if tied { Role::Embed } else { Role::LmHead };
            let head = match (&embed, tied, &head_part) {
                (_, _, Some((rows, _))) => Linear::from_matmul(weights.matmul_part(head_role, 0, Some(rows.clone()), None, device)?),
                (Some(e), true, None) => Linear::from_matmul(e.as_matmul()),
                _ => Linear::load(weights, Role::LmHead, None, 0, device)?,
            };
            (Some(RmsNorm::load(weights, Role::FinalNorm, 0, spec, device)?), Some(head))
        } else {
            (None, None)
        };
        let dtype = weights.compute_dtype(device);
        #[cfg(feature = "cuda")]
        let fused = match (device.is_cuda(), &tp) {
            (true, None) => {
                let head = final_norm.as_ref().zip(lm_head.as_ref());
                let first_embed = embed.as_ref().filter(|_| is_first).map(|e| (e, spec.embedding_scale));
                match super::cuda_decode::FusedDecode::build(&layers, head, first_embed, spec.hidden_size, device, dtype) {
                    Ok(f) => Some(f),
                    Err(e) => {
                        tracing::info!("layers {range} decode through candle's ops: {e}");
                        None
                    }
                }
            }
            _ => None,
        };
        Ok(Shard {
            spec: spec.clone(),
            range,
            embed: if is_first { embed } else { None },
            layers,
            final_norm,
            lm_head,
            device: device.clone(),
            dtype,
            tp,
            head_part,
            #[cfg(feature = "cuda")]
            fused,
        })
    }

    pub fn is_first(&self) -> bool {
        self.range.start == 0
    }

    pub fn is_last(&self) -> bool {
        self.range.end == self.spec.num_layers
    }

    /// This shard's tensor-parallel group, if it is a slice.
    pub fn tp(&self) -> Option<&TpMember> {
        self.tp.as_ref()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Weight bytes one decode step reads: every layer, the final norm and the LM head
    /// (the embedding contributes one row, left out).
    pub fn decode_bytes(&self) -> u64 {
        self.layers.iter().map(DecoderLayer::weight_bytes).sum::<u64>()
            + self.final_norm.as_ref().map_or(0, RmsNorm::weight_bytes)
            + self.lm_head.as_ref().map_or(0, Linear::weight_bytes)
    }

    /// Whether one-token steps run fused on the GPU (`cuda_decode`); always false on a CPU.
    pub fn fused_decode(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let Some(f) = &self.fused {
            return f.enabled();
        }
        false
    }

    /// Turns the fused GPU step on or off where there is one (off: candle's ops, to compare).
    pub fn set_fused_decode(&self, on: bool) {
        #[cfg(feature = "cuda")]
        if let Some(f) = &self.fused {
            f.set_enabled(on);
        }
        let _ = on;
    }

    /// The fused GPU step, where these layers have one.
    #[cfg(feature = "cuda")]
    pub(super) fn fused(&self) -> Option<&super::cuda_decode::FusedDecode> {
        self.fused.as_ref()
    }

    pub fn new_cache(&self) -> ShardCache {
        ShardCache::new(self.layers.len(), &self.device)
    }

    /// An error when `t` more positions after `start` would not fit the model's context.
    pub(super) fn check_context(&self, start: usize, t: usize) -> Result<()> {
        if start + t > self.spec.context_length {
            return Err(EngineError::PromptTooLong { prompt_tokens: start + t, context: self.spec.context_length });
        }
        Ok(())
    }

    /// Runs this shard's layers for the next `t` positions of a sequence.
    /// `all_logits` asks the last shard for logits at every position instead of only the last.
    pub fn forward(&self, input: ShardInput<'_>, cache: &mut ShardCache, all_logits: bool) -> Result<ShardOutput> {
        // One token of a first shard whose fused step embeds it: no lookup outside the step.
        #[cfg(feature = "cuda")]
        if let (ShardInput::Tokens([id]), Some(fused)) = (&input, &self.fused) {
            if fused.enabled() && fused.takes_tokens() {
                self.check_context(cache.position(), 1)?;
                let y = fused.step_token(*id, cache)?;
                return if self.is_last() { self.finish_logits(y) } else { Ok(ShardOutput::Hidden(y)) };
            }
        }
        let mut x = match (input, &self.embed) {
            (ShardInput::Tokens(ids), Some(embed)) => {
                if ids.is_empty() {
                    return Err(EngineError::InvalidRequest("no tokens to process".into()));
                }
                let x = embed.lookup(ids)?.to_device(&self.device)?.to_dtype(self.dtype)?.unsqueeze(0)?;
                match self.spec.embedding_scale {
                    Some(s) => (x * s)?,
                    None => x,
                }
            }
            (ShardInput::Hidden(h), None) => {
                let (b, t, d) = h.dims3().map_err(|_| EngineError::Shard("hidden states must be (1, t, hidden)".into()))?;
                if b != 1 || t == 0 || d != self.spec.hidden_size {
                    return Err(EngineError::Shard(format!("hidden states of shape ({b}, {t}, {d}) do not fit hidden size {}", self.spec.hidden_size)));
                }
                h.to_device(&self.device)?.to_dtype(self.dtype)?
            }
            (ShardInput::Tokens(_), None) => return Err(EngineError::Shard(format!("shard {} has no embedding: it takes hidden states", self.range))),
            (ShardInput::Hidden(_), Some(_)) => return Err(EngineError::Shard("the first shard takes token ids".into())),
        };
        let t = x.dim(1)?;
        let start = cache.position();
        self.check_context(start, t)?;
        #[cfg(feature = "cuda")]
        if let (1, Some(fused)) = (t, &self.fused) {
            if fused.enabled() {
                let y = fused.step(&x, cache)?;
                return if self.is_last() { self.finish_logits(y) } else { Ok(ShardOutput::Hidden(y)) };
            }
        }
        // Only the last position's logits wanted: earlier chunks' outputs are not kept.
        let last_only = self.lm_head.is_some() && !all_logits;
        let mut outputs = Vec::new();
        for chunk in prefill_chunks(t) {
            let mut h = if chunk.len() == t { x.clone() } else { x.narrow(1, chunk.start, chunk.len())? };
            // Rope tables depend only on (rope, positions): compute once per distinct rope.
            let mut tables: Vec<(&super::spec::Rope, (Tensor, Tensor))> = Vec::new();
            for (layer, layer_cache) in self.layers.iter().zip(cache.layers.iter_mut()) {
                let idx = match tables.iter().position(|(r, _)| *r == layer.rope()) {
                    Some(i) => i,
                    None => {
                        let (cos, sin) = rope_tables(layer.rope(), layer.head_dim(), start + chunk.start, chunk.len(), &self.device)?;
                        tables.push((layer.rope(), (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?)));
                        tables.len() - 1
                    }
                };
                let (cos, sin) = &tables[idx].1;
                h = layer.forward(&h, cos, sin, layer_cache, self.tp.as_ref().map(|m| &*m.reduce))?;
            }
            if !last_only || chunk.end == t {
                outputs.push(h);
            }
        }
        x = if outputs.len() == 1 { outputs.remove(0) } else { Tensor::cat(&outputs, 1)? };
        match (&self.final_norm, &self.lm_head) {
            (Some(norm), Some(head)) => {
                let x = if all_logits { x } else { x.narrow(1, x.dim(1)? - 1, 1)? };
                let mut logits = head.forward(&norm.forward(&x)?)?.squeeze(0)?.to_dtype(DType::F32)?;
                if let (Some((rows, total)), Some(m)) = (&self.head_part, &self.tp) {
                    logits = super::tp::gather_logits(&logits, rows.clone(), *total, &*m.reduce)?;
                }
                self.finish_logits(logits)
            }
            _ => Ok(ShardOutput::Hidden(x.to_dtype(DType::F32)?)),
        }
    }

    /// The model's final soft-cap, and only real vocabulary ids (some checkpoints pad it).
    fn finish_logits(&self, mut logits: Tensor) -> Result<ShardOutput> {
        if let Some(cap) = self.spec.final_logit_softcap {
            logits = ((logits / cap)?.tanh()? * cap)?;
        }
        if logits.dim(D::Minus1)? > self.spec.vocab_size {
            logits = logits.narrow(D::Minus1, 0, self.spec.vocab_size)?;
        }
        Ok(ShardOutput::Logits(logits.contiguous()?))
    }
}

/// Most positions one pass through the layers takes: a longer prompt runs in near-equal chunks
/// of at most this many (as llama.cpp's 512-token micro-batches), so that attention's scores,
/// heads × chunk × keys, stay bounded however long the prompt (a 4,096-token prompt's would
/// otherwise take 0.8 GB a copy for a 1.5B model, 1.9 GB for a 7B, in f32). Equal parts keep
/// every chunk of a long prompt at 256 rows or more, above the GPU's dequantize-then-GEMM bound.
pub const PREFILL_CHUNK: usize = 512;

/// The position ranges, within `t` new positions, that `Shard::forward` runs one after another.
fn prefill_chunks(t: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let n = t.div_ceil(PREFILL_CHUNK).max(1);
    (0..n).map(move |i| i * t / n..(i + 1) * t / n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_chunks_cover_every_position_once_in_bounded_near_equal_parts() {
        for t in [1, 7, 511, 512, 513, 600, 1024, 1025, 4096, 5000] {
            let chunks: Vec<_> = prefill_chunks(t).collect();
            assert_eq!((chunks.first().unwrap().start, chunks.last().unwrap().end), (0, t));
            assert!(chunks.windows(2).all(|w| w[0].end == w[1].start), "{t}: {chunks:?}");
            assert!(chunks.iter().all(|c| c.len() <= PREFILL_CHUNK), "{t}: {chunks:?}");
            if t > PREFILL_CHUNK {
                assert!(chunks.iter().all(|c| c.len() >= PREFILL_CHUNK / 2), "{t}: {chunks:?}");
            } else {
                assert_eq!(chunks.len(), 1);
            }
        }
    }
}
