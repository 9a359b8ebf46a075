//! Tensor parallelism inside the engine: which slice of every layer a member of a group of N
//! loads (`TpLayout`), and the `AllReduce` a decoder layer calls after its two row-parallel
//! matmuls (o_proj and down_proj), whose outputs are partial sums.
//! Attention heads are split column-parallel (q and the KV heads those q heads read; a KV head
//! is replicated on every member whose q heads use it, as vLLM does when KV heads < members),
//! o_proj row-parallel on the matching input columns; the MLP's gate/up rows and down's
//! matching columns likewise. Column ranges of quantized matrices fall on block boundaries, so
//! splits may be uneven by one block (Qwen2.5-1.5B's 8960 = 35 × 256 → 18 + 17 blocks).
//! It does not move bytes between members: `dataplane` implements `AllReduce` over threads,
//! shared memory or sockets. The embedding is replicated; the LM head is split by vocabulary
//! rows and the logits gathered (an all-reduce of a buffer where each member fills only its
//! rows, so the sum is exact), which measured faster than reading a replicated head on every
//! member; every member produces the same logits.

use std::ops::Range;
use std::sync::Arc;

use super::spec::ModelSpec;
use super::weights::{Role, Weights};
use super::{EngineError, Result};

/// This member's place in a tensor-parallel group of `size` members.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TpSlice {
    pub rank: usize,
    pub size: usize,
}

impl std::fmt::Display for TpSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.rank, self.size)
    }
}

/// Why an all-reduce did not complete.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum AllReduceError {
    /// A member did not contribute before the deadline.
    #[error("all-reduce timed out waiting for member {0}")]
    Timeout(usize),
    /// The group lost a member or a link (and no fallback link was left).
    #[error("all-reduce group broken: {0}")]
    Broken(String),
    /// Members disagreed on the buffer's length.
    #[error("all-reduce length mismatch: {0}")]
    Length(String),
}

/// Sums a buffer element-wise over every member of a group, in place, so that every member
/// ends with the same values. A blocking call on the engine thread: implementations never
/// require an async runtime on the caller's thread and always end by success, error or deadline.
pub trait AllReduce: Send + Sync {
    fn all_reduce(&self, buf: &mut [f32]) -> std::result::Result<(), AllReduceError>;
}

/// A member's handle on its group: its slice and the all-reduce that joins it to the others.
#[derive(Clone)]
pub struct TpMember {
    pub slice: TpSlice,
    pub reduce: Arc<dyn AllReduce>,
}

impl std::fmt::Debug for TpMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TpMember({})", self.slice)
    }
}

/// The slice of every layer that one member loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankParts {
    /// Query heads (and o_proj's input columns `heads × head_dim`).
    pub heads: Range<usize>,
    /// KV heads those query heads read.
    pub kv_heads: Range<usize>,
    /// MLP intermediate columns (gate/up rows, down's input columns).
    pub ffn: Range<usize>,
}

/// How a model splits over `size` members: one `RankParts` per rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpLayout {
    pub size: usize,
    pub parts: Vec<RankParts>,
}

/// Granularity constraints of a model for splitting: heads come in groups of `head_granule`
/// (so that o_proj's column ranges fall on its blocks) and MLP columns in multiples of
/// `ffn_granule` (down's block length).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TpShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub head_granule: usize,
    pub ffn_granule: usize,
}

impl TpShape {
    /// Reads the block lengths of every layer's o_proj and down_proj from the weights' headers.
    pub fn of(weights: &Weights, spec: &ModelSpec) -> Result<TpShape> {
        let mut o_block = 1;
        let mut down_block = 1;
        let mut intermediate = 0;
        for l in 0..spec.num_layers {
            o_block = lcm(o_block, weights.block_len(Role::O, l)?);
            down_block = lcm(down_block, weights.block_len(Role::Down, l)?);
            intermediate = intermediate.max(*weights.shape(Role::Down, l)?.get(1).unwrap_or(&0));
        }
        let head_granule = o_block / gcd(o_block, spec.head_dim.max(1));
        Ok(TpShape { num_heads: spec.num_heads, num_kv_heads: spec.num_kv_heads, head_dim: spec.head_dim, intermediate, head_granule, ffn_granule: down_block })
    }

    /// Block-aligned head groups and MLP blocks: the most members each allows (0 when the
    /// model cannot be split at all), for placement to check before anything loads.
    pub fn units(&self) -> (usize, usize) {
        if self.num_kv_heads == 0 || self.num_heads % self.num_kv_heads != 0 || self.num_heads % self.head_granule.max(1) != 0 || self.intermediate % self.ffn_granule.max(1) != 0 {
            return (0, 0);
        }
        (self.num_heads / self.head_granule.max(1), self.intermediate / self.ffn_granule.max(1))
    }

    /// The split over `size` members, or why there is none.
    pub fn layout(&self, size: usize) -> std::result::Result<TpLayout, String> {
        if size == 0 {
            return Err("a tensor-parallel group needs at least one member".into());
        }
        if self.num_kv_heads == 0 || self.num_heads % self.num_kv_heads != 0 {
            return Err(format!("{} query heads do not group over {} KV heads", self.num_heads, self.num_kv_heads));
        }
        if self.num_heads % self.head_granule != 0 {
            return Err(format!("o_proj's blocks take heads in groups of {}, which {} heads are not", self.head_granule, self.num_heads));
        }
        let head_units = self.num_heads / self.head_granule;
        if head_units < size {
            return Err(format!(
                "{} heads of {} values make only {head_units} block-aligned groups of {} heads in o_proj: at most {head_units} members, not {size}",
                self.num_heads, self.head_dim, self.head_granule
            ));
        }
        if self.intermediate % self.ffn_granule != 0 {
            return Err(format!("the MLP's {} columns are not whole blocks of {}", self.intermediate, self.ffn_granule));
        }
        let ffn_units = self.intermediate / self.ffn_granule;
        if ffn_units < size {
            return Err(format!("the MLP's {} columns make only {ffn_units} blocks of {}: at most {ffn_units} members, not {size}", self.intermediate, self.ffn_granule));
        }
        let rep = self.num_heads / self.num_kv_heads;
        let heads = split(head_units, size);
        let ffn = split(ffn_units, size);
        let parts = heads
            .into_iter()
            .zip(ffn)
            .map(|(h, f)| {
                let heads = h.start * self.head_granule..h.end * self.head_granule;
                let kv_heads = heads.start / rep..(heads.end - 1) / rep + 1;
                RankParts { heads, kv_heads, ffn: f.start * self.ffn_granule..f.end * self.ffn_granule }
            })
            .collect();
        Ok(TpLayout { size, parts })
    }
}

impl TpLayout {
    /// The layout for `size` members of the model behind `weights`, or an `EngineError::Shard`
    /// naming the reason it cannot be split so.
    pub fn of(weights: &Weights, spec: &ModelSpec, size: usize) -> Result<TpLayout> {
        TpShape::of(weights, spec)?.layout(size).map_err(|why| EngineError::Shard(format!("cannot split the model {size} ways: {why}")))
    }

    pub fn part(&self, slice: TpSlice) -> Result<&RankParts> {
        if slice.size != self.size {
            return Err(EngineError::Shard(format!("slice {slice} does not belong to a layout of {} members", self.size)));
        }
        self.parts.get(slice.rank).ok_or_else(|| EngineError::Shard(format!("rank {} is outside a group of {}", slice.rank, self.size)))
    }
}

/// The LM head rows (vocabulary ids) `slice` computes, of `rows` in all.
pub fn vocab_part(rows: usize, slice: TpSlice) -> Range<usize> {
    split(rows, slice.size.max(1)).get(slice.rank).cloned().unwrap_or(0..0)
}

/// Logits `[t, rows.len()]` for this member's vocabulary rows → the whole `[t, total]`, the
/// same on every member: each fills its columns of a zero buffer and the group sums.
pub fn gather_logits(part: &candle_core::Tensor, rows: Range<usize>, total: usize, reduce: &dyn AllReduce) -> Result<candle_core::Tensor> {
    let (t, n) = part.dims2()?;
    if n != rows.len() || rows.end > total {
        return Err(EngineError::Shard(format!("logits of {n} rows for vocabulary rows {rows:?} of {total}")));
    }
    let values = part.to_vec2::<f32>()?;
    let mut full = vec![0f32; t * total];
    for (row, v) in values.iter().enumerate() {
        full[row * total + rows.start..row * total + rows.end].copy_from_slice(v);
    }
    reduce.all_reduce(&mut full).map_err(|e| EngineError::Shard(e.to_string()))?;
    Ok(candle_core::Tensor::from_vec(full, (t, total), part.device())?)
}

/// `units` split into `n` contiguous ranges, the first `units % n` one longer.
fn split(units: usize, n: usize) -> Vec<Range<usize>> {
    let (base, extra) = (units / n, units % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen_1_5b() -> TpShape {
        TpShape { num_heads: 12, num_kv_heads: 2, head_dim: 128, intermediate: 8960, head_granule: 2, ffn_granule: 256 }
    }

    #[test]
    fn qwen_splits_two_ways_with_an_uneven_mlp() {
        let l = qwen_1_5b().layout(2).expect("splits");
        assert_eq!(l.parts[0], RankParts { heads: 0..6, kv_heads: 0..1, ffn: 0..18 * 256 });
        assert_eq!(l.parts[1], RankParts { heads: 6..12, kv_heads: 1..2, ffn: 18 * 256..8960 });
    }

    #[test]
    fn qwen_four_ways_replicates_kv_heads_and_splits_heads_by_block_pairs() {
        let l = qwen_1_5b().layout(4).expect("splits");
        let heads: Vec<_> = l.parts.iter().map(|p| p.heads.clone()).collect();
        assert_eq!(heads, vec![0..4, 4..8, 8..10, 10..12]);
        assert_eq!(l.parts[1].kv_heads, 0..2, "heads 4..8 straddle both KV groups");
        assert_eq!(l.parts[3].kv_heads, 1..2);
        assert!(qwen_1_5b().layout(7).unwrap_err().contains("at most 6 members"));
    }

    #[test]
    fn splits_cover_everything_once() {
        for n in 1..10 {
            let s = split(35, n);
            assert_eq!(s.first().map(|r| r.start), Some(0));
            assert_eq!(s.last().map(|r| r.end), Some(35));
            assert!(s.windows(2).all(|w| w[0].end == w[1].start && w[0].len() >= w[1].len()));
        }
    }
}
