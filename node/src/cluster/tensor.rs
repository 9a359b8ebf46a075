//! Tensor-parallel and hybrid placement, and the choice between strategies. A tensor group
//! runs every layer on N members, each holding its share of the heads, MLP columns and LM head
//! rows plus a replicated embedding; a hybrid plan chains equal groups as pipeline stages. How far
//! a model splits (`TpUnits`: block-aligned head groups and MLP blocks, read from its header)
//! bounds N, and a model that cannot be split N ways gets the reason. `place_choice` honours a
//! pinned strategy or, for auto, asks the cost model: the memory-weighted single/pipeline plan
//! of `placement.rs` stands unless a tensor or hybrid plan is predicted `AUTO_MARGIN` faster
//! over the link the leader measured (its median ping RTT to its peers; `LinkCost::LAN` before
//! any). Pure: no I/O, no clocks; FLOP/s are not in `Capacity`, so predictions are bound by each
//! node's decode rate (the lower of memory bandwidth and measured Q4_K kernel rate).

use serde::{Deserialize, Serialize};

use super::cost::{self, LinkCost, Speed};
use super::placement::{pipeline, place, Capacity, ModelFootprint, Placement, PlacementError, Stage, Strategy};
use super::NodeId;

/// How finely a model splits: groups of attention heads whose o_proj columns fall on whole
/// blocks, and whole blocks of MLP columns. 0 means the model cannot be split at all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpUnits {
    pub heads: usize,
    pub ffn: usize,
}

impl TpUnits {
    /// The largest tensor-parallel group the model allows.
    pub fn max_members(&self) -> usize {
        self.heads.min(self.ffn)
    }
}

/// Auto moves from single/pipeline to tensor or hybrid only for a predicted gain this large.
pub const AUTO_MARGIN: f64 = 1.25;

/// Why a strategy cannot place a model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ChoiceError {
    /// Single or pipeline placement failed.
    #[error(transparent)]
    Placement(#[from] PlacementError),
    /// The model does not split into a group of that size.
    #[error("{model} cannot be split {members} ways: {reason}")]
    CannotSplit { model: String, members: usize, reason: String },
    /// The pinned strategy does not fit these members.
    #[error("{model} cannot run with strategy {strategy}: {reason}")]
    Pinned { model: String, strategy: &'static str, reason: String },
}

impl Stage {
    /// Every member of the stage, rank order (one for a plain stage).
    pub fn members(&self) -> impl Iterator<Item = &NodeId> {
        std::iter::once(&self.node).chain(self.group.iter())
    }

    /// `id`'s rank in this stage's group, if it is a member.
    pub fn rank_of(&self, id: &str) -> Option<usize> {
        self.members().position(|m| m == id)
    }

    /// Members of the tensor group (1 for a plain stage).
    pub fn tp_size(&self) -> usize {
        1 + self.group.len()
    }
}

impl Placement {
    /// The stage `id` serves in, and its rank there.
    pub fn stage_of(&self, id: &str) -> Option<(usize, usize)> {
        self.stages.iter().enumerate().find_map(|(i, s)| s.rank_of(id).map(|r| (i, r)))
    }
}

/// The largest member's share of a layer's bytes in a group of `n` (splits are uneven by a block).
fn share(tp: TpUnits, n: usize) -> f64 {
    if n <= 1 {
        return 1.0;
    }
    let part = |units: usize| if units == 0 { 1.0 } else { units.div_ceil(n) as f64 / units as f64 };
    part(tp.heads).max(part(tp.ffn))
}

/// Bytes one member (on a GPU or not) of a group of `n` holds for `layers` layers (plus the
/// embedding on the first stage, replicated on every member, and its rows of the head on the last).
pub(super) fn member_bytes(m: &ModelFootprint, gpu: bool, n: usize, layers: usize, first: bool, last: bool) -> u64 {
    let held = m.held_on(gpu);
    (layers as f64 * held.layer_memory() as f64 * share(m.tp, n)).ceil() as u64 + if first { held.embedding_bytes } else { 0 } + if last { held.head_bytes.div_ceil(n.max(1) as u64) } else { 0 }
}

/// Bytes each node of `members` holds under `p`.
pub fn memory_used(m: &ModelFootprint, p: &Placement, members: &[Capacity]) -> Vec<(NodeId, u64)> {
    let last = p.stages.len().saturating_sub(1);
    let on_gpu = |node: &NodeId| members.iter().any(|c| &c.node == node && c.gpu);
    p.stages
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.members().map(move |n| (n.clone(), member_bytes(m, on_gpu(n), s.tp_size(), s.end - s.start, i == 0, i == last))))
        .collect()
}

fn speed(c: &Capacity) -> Speed {
    Speed { node: c.node.clone(), mem_bandwidth: c.mem_bandwidth, flops: f64::INFINITY, memory_offered: c.memory_offered, gpu: c.gpu }
}

/// Predicted decode tok/s of `p` over `members`, with `link` between every pair.
pub fn predict(m: &ModelFootprint, p: &Placement, members: &[Capacity], link: LinkCost) -> f64 {
    let speeds: Vec<Speed> = members.iter().map(speed).collect();
    let stages: Vec<(Vec<&Speed>, usize)> = p.stages.iter().map(|s| (s.members().filter_map(|n| speeds.iter().find(|x| &x.node == n)).collect(), s.end - s.start)).collect();
    cost::predict_stages(m, &stages, link).0
}

/// Members fastest first (then by id), so groups take the fastest nodes.
fn by_speed(members: &[Capacity]) -> Vec<&Capacity> {
    let mut v: Vec<&Capacity> = members.iter().collect();
    v.sort_by(|a, b| b.mem_bandwidth.total_cmp(&a.mem_bandwidth).then(a.node.cmp(&b.node)));
    v
}

fn split_error(m: &ModelFootprint, n: usize) -> Option<ChoiceError> {
    let most = m.tp.max_members();
    let reason = if most == 0 {
        "its attention heads do not group over its KV heads or its matrices do not split on whole blocks".to_string()
    } else if m.tp.heads < n {
        format!("its attention heads make only {} block-aligned groups: at most {} members", m.tp.heads, most)
    } else if m.tp.ffn < n {
        format!("its MLP columns make only {} whole blocks: at most {} members", m.tp.ffn, most)
    } else {
        return None;
    };
    Some(ChoiceError::CannotSplit { model: m.model.clone(), members: n, reason })
}

/// A group of `members` (rank order by id) running `start..end`.
fn group_stage(members: &[&Capacity], start: usize, end: usize) -> Stage {
    let mut ids: Vec<NodeId> = members.iter().map(|c| c.node.clone()).collect();
    ids.sort();
    let node = ids.remove(0);
    Stage { node, start, end, group: ids }
}

/// `k` equal groups of `g` members (the fastest first) as pipeline stages, if they fit.
fn groups_of(m: &ModelFootprint, ranked: &[&Capacity], k: usize, g: usize) -> Option<Placement> {
    if k * g > ranked.len() || g < 2 || k == 0 || m.layers < k {
        return None;
    }
    let mut stages = Vec::with_capacity(k);
    let mut start = 0;
    for (i, chunk) in ranked.chunks(g).take(k).enumerate() {
        let layers = m.layers / k + usize::from(i < m.layers % k);
        if chunk.iter().any(|c| c.memory_offered < member_bytes(m, c.gpu, g, layers, i == 0, i + 1 == k)) {
            return None;
        }
        stages.push(group_stage(chunk, start, start + layers));
        start += layers;
    }
    Some(Placement { strategy: if k == 1 { Strategy::Tensor } else { Strategy::Hybrid }, stages })
}

/// The fastest predicted tensor plan (one group of 2..=max members that fit), or why none.
pub fn tensor(m: &ModelFootprint, members: &[Capacity], link: LinkCost) -> Result<Placement, ChoiceError> {
    if members.len() < 2 {
        return Err(ChoiceError::Pinned { model: m.model.clone(), strategy: "tensor", reason: format!("it needs at least 2 nodes holding the model, the swarm has {}", members.len()) });
    }
    if let Some(e) = split_error(m, 2) {
        return Err(e);
    }
    let most = m.tp.max_members().min(members.len());
    let mut best: Option<(f64, Placement)> = None;
    for n in 2..=most {
        // The n fastest members that can hold a member's share.
        let fit: Vec<&Capacity> = by_speed(members).into_iter().filter(|c| c.memory_offered >= member_bytes(m, c.gpu, n, m.layers, true, true)).take(n).collect();
        if fit.len() < n {
            continue;
        }
        let p = Placement { strategy: Strategy::Tensor, stages: vec![group_stage(&fit, 0, m.layers)] };
        let t = predict(m, &p, members, link);
        if best.as_ref().is_none_or(|(bt, _)| t > *bt) {
            best = Some((t, p));
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| ChoiceError::Pinned {
        model: m.model.clone(),
        strategy: "tensor",
        reason: format!("no group of 2 to {most} nodes has the memory for a member's share ({} bytes at 2 members)", member_bytes(m, members.iter().all(|c| c.gpu), 2, m.layers, true, true)),
    })
}

/// The fastest predicted hybrid plan (2 or more groups of 2 or more members), or why none.
pub fn hybrid(m: &ModelFootprint, members: &[Capacity], link: LinkCost) -> Result<Placement, ChoiceError> {
    if members.len() < 4 {
        return Err(ChoiceError::Pinned { model: m.model.clone(), strategy: "hybrid", reason: format!("it needs at least 4 nodes holding the model (2 groups of 2), the swarm has {}", members.len()) });
    }
    if let Some(e) = split_error(m, 2) {
        return Err(e);
    }
    let ranked = by_speed(members);
    let mut best: Option<(f64, Placement)> = None;
    for g in 2..=m.tp.max_members().min(members.len() / 2) {
        for k in 2..=members.len() / g {
            if let Some(p) = groups_of(m, &ranked, k, g) {
                let t = predict(m, &p, members, link);
                if best.as_ref().is_none_or(|(bt, _)| t > *bt) {
                    best = Some((t, p));
                }
            }
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| ChoiceError::Pinned { model: m.model.clone(), strategy: "hybrid", reason: "no split into 2 or more equal groups fits the nodes' memory".into() })
}

/// Places `m` by its pinned strategy, or (none pinned) by the cost model's choice over `link`.
pub fn place_choice(m: &ModelFootprint, members: &[Capacity], link: LinkCost) -> Result<Placement, ChoiceError> {
    match m.strategy {
        Some(Strategy::Single) => {
            let p = place(m, members)?;
            if p.strategy != Strategy::Single {
                let largest = members.iter().map(|c| c.memory_offered).max().unwrap_or(0);
                return Err(ChoiceError::Pinned { model: m.model.clone(), strategy: "single", reason: format!("it needs {} bytes and the largest node offers {largest}", m.total_bytes_on(members.iter().all(|c| c.gpu))) });
            }
            Ok(p)
        }
        Some(Strategy::Pipeline) => {
            if members.len() < 2 {
                return Err(ChoiceError::Pinned { model: m.model.clone(), strategy: "pipeline", reason: format!("it needs at least 2 nodes holding the model, the swarm has {}", members.len()) });
            }
            let mut nodes: Vec<&Capacity> = members.iter().collect();
            nodes.sort_by(|a, b| a.node.cmp(&b.node));
            let p = pipeline(m, &nodes)?;
            if p.stages.len() < 2 {
                return Err(ChoiceError::Pinned { model: m.model.clone(), strategy: "pipeline", reason: "only one node can hold layers".into() });
            }
            Ok(p)
        }
        Some(Strategy::Tensor) => tensor(m, members, link),
        Some(Strategy::Hybrid) => hybrid(m, members, link),
        None => {
            let base = place(m, members);
            let split = [tensor(m, members, link), hybrid(m, members, link)].into_iter().flatten().map(|p| (predict(m, &p, members, link), p)).max_by(|a, b| a.0.total_cmp(&b.0));
            match (base, split) {
                (Ok(b), Some((t, p))) if t >= AUTO_MARGIN * predict(m, &b, members, link) => Ok(p),
                (Ok(b), _) => Ok(b),
                (Err(_), Some((_, p))) => Ok(p),
                (Err(e), None) => Err(e.into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1 << 30;

    fn cap(node: &str, gb: u64, gbs: f64) -> Capacity {
        Capacity { node: node.into(), memory_offered: gb * GB, mem_bandwidth: gbs * 1e9, gpu: false }
    }

    /// Qwen2.5-7B-like: 28 layers of 233 MB, 14 head groups, 74 MLP blocks.
    fn seven_b(strategy: Option<Strategy>) -> ModelFootprint {
        ModelFootprint { model: "7b".into(), layers: 28, bytes_per_layer: 233 << 20, kv_bytes_per_layer: 0, dense_half: false, quantized: false, embedding_bytes: 545 << 20, head_bytes: 545 << 20, tp: TpUnits { heads: 14, ffn: 74 }, strategy }
    }

    #[test]
    fn pinned_tensor_makes_one_group_ranked_by_id_and_counts_each_members_memory() {
        let m = seven_b(Some(Strategy::Tensor));
        let members = [cap("b", 16, 20.0), cap("a", 16, 20.0)];
        let p = place_choice(&m, &members, LinkCost::LAN).unwrap();
        assert_eq!(p.strategy, Strategy::Tensor);
        assert_eq!(p.stages, vec![Stage { node: "a".into(), start: 0, end: 28, group: vec!["b".into()] }]);
        assert_eq!(p.stage_of("b"), Some((0, 1)));
        let used = memory_used(&m, &p, &members);
        assert_eq!(used.len(), 2);
        assert!(used[0].1 < m.total_bytes_on(false) * 3 / 5, "a member holds about half the layers: {used:?}");
    }

    #[test]
    fn a_model_that_cannot_split_gets_the_reason() {
        let mut m = seven_b(Some(Strategy::Tensor));
        m.tp = TpUnits { heads: 1, ffn: 74 };
        let e = place_choice(&m, &[cap("a", 16, 20.0), cap("b", 16, 20.0)], LinkCost::LAN).unwrap_err();
        assert!(e.to_string().contains("at most 1 members"), "{e}");
        m.tp = TpUnits::default();
        let e = place_choice(&m, &[cap("a", 16, 20.0), cap("b", 16, 20.0)], LinkCost::LAN).unwrap_err();
        assert!(e.to_string().contains("cannot be split 2 ways"), "{e}");
        // Qwen2.5-1.5B: 12 heads in pairs make 6 groups; 8 nodes give a group of at most 6.
        m.tp = TpUnits { heads: 6, ffn: 35 };
        let eight: Vec<Capacity> = (0..8).map(|i| cap(&format!("n{i}"), 16, 20.0)).collect();
        let p = tensor(&m, &eight, LinkCost { rtt_s: 1e-6, bytes_per_s: 1e11 }).unwrap();
        assert!(p.stages[0].tp_size() <= 6, "{p:?}");
        let e = place_choice(&m, &[cap("a", 16, 20.0)], LinkCost::LAN).unwrap_err();
        assert!(e.to_string().contains("at least 2 nodes"), "{e}");
    }

    #[test]
    fn pinned_hybrid_chains_groups_and_pinned_single_refuses_a_model_too_big() {
        let m = seven_b(Some(Strategy::Hybrid));
        let four = [cap("a", 8, 20.0), cap("b", 8, 20.0), cap("c", 8, 20.0), cap("d", 8, 20.0)];
        let p = place_choice(&m, &four, LinkCost::LAN).unwrap();
        assert_eq!(p.strategy, Strategy::Hybrid);
        assert_eq!(p.stages.len(), 2);
        assert!(p.stages.iter().all(|s| s.tp_size() == 2));
        assert_eq!((p.stages[0].end, p.stages[1].start, p.stages[1].end), (14, 14, 28));
        let small = [cap("a", 4, 20.0), cap("b", 4, 20.0), cap("c", 4, 20.0), cap("d", 4, 20.0)];
        let e = place_choice(&seven_b(Some(Strategy::Single)), &small, LinkCost::LAN).unwrap_err();
        assert!(e.to_string().contains("strategy single"), "{e}");
        let p = place_choice(&seven_b(Some(Strategy::Pipeline)), &four, LinkCost::LAN).unwrap();
        assert_eq!(p.strategy, Strategy::Pipeline);
    }

    #[test]
    fn auto_picks_tensor_for_a_large_model_on_equal_nodes_and_single_for_a_small_one() {
        let two = [cap("a", 16, 20.0), cap("b", 16, 20.0)];
        let p = place_choice(&seven_b(None), &two, LinkCost::LAN).unwrap();
        assert_eq!(p.strategy, Strategy::Tensor, "{p:?}");
        let tiny = ModelFootprint { model: "tiny".into(), layers: 4, bytes_per_layer: 1 << 20, kv_bytes_per_layer: 0, dense_half: false, quantized: false, embedding_bytes: 1 << 20, head_bytes: 1 << 20, tp: TpUnits { heads: 4, ffn: 4 }, strategy: None };
        let p = place_choice(&tiny, &two, LinkCost::LAN).unwrap();
        assert_eq!(p.strategy, Strategy::Single, "all-reduces cost more than a tiny model's compute: {p:?}");
    }
}
