//! Placement: turns a model's footprint and the members' offered memory and measured speed
//! into stages. A single node when one can hold the model (the fastest such node), otherwise a
//! memory-weighted pipeline: layers in proportion to offered memory, corrected by memory
//! bandwidth, largest-remainder rounding, at least one layer per stage, never more than a
//! node offers: a layer counts its weights and its reserved KV cache, so a GPU filled by
//! placement still has room for the cache its prompts grow. Nodes far faster than the rest (a
//! GPU beside CPUs) form a tier that is filled first: every layer they hold runs many times
//! faster. `place_all` places every wanted model over the members that hold its files, in name
//! order, each model using only the memory the ones before it left. Pure: no I/O, no clocks;
//! the same inputs give the same plan on every node.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::cost::LinkCost;
use super::state::NodeAdvert;
use super::NodeId;

/// What a model needs, known before any weights are read (from the catalogue or the file).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelFootprint {
    pub model: String,
    pub layers: usize,
    pub bytes_per_layer: u64,
    /// Embedding table (first stage), final norm and LM head (last stage), in bytes.
    pub embedding_bytes: u64,
    pub head_bytes: u64,
    /// Memory a layer's KV cache takes at the context the wanting node reserves for (see
    /// `engine::cache::reserved_bytes`); counted as memory, never as bytes read per token.
    #[serde(default)]
    pub kv_bytes_per_layer: u64,
    /// Dense half-precision weights (an f16/bf16 checkpoint): a CPU widens them to f32, a GPU
    /// keeps them and their KV cache at half width (see `held_on`).
    #[serde(default)]
    pub dense_half: bool,
    /// Quantized (GGUF) weights: a GPU keeps their KV cache at half width too (see `held_on`).
    #[serde(default)]
    pub quantized: bool,
    /// How far the model splits tensor-parallel (see `tensor.rs`).
    #[serde(default)]
    pub tp: super::tensor::TpUnits,
    /// The strategy the wanting node pinned (`None`: the cost model's best).
    #[serde(default)]
    pub strategy: Option<Strategy>,
}

impl ModelFootprint {
    /// What a node holds of the model, by the device it computes on (`engine::device::
    /// compute_dtype` and `cache_dtype`): the bytes as stored and the KV cache in f32, except
    /// that a CPU widens dense half-precision weights to f32 (twice their bytes) and a GPU keeps
    /// the KV cache of such a model, or of a quantized one, at half width (half the f32 reserve).
    pub fn held_on(&self, gpu: bool) -> Held {
        let held = Held { bytes_per_layer: self.bytes_per_layer, kv_bytes_per_layer: self.kv_bytes_per_layer, embedding_bytes: self.embedding_bytes, head_bytes: self.head_bytes };
        match (gpu, self.dense_half || self.quantized) {
            (true, true) => Held { kv_bytes_per_layer: self.kv_bytes_per_layer / 2, ..held },
            (false, _) if self.dense_half => Held { bytes_per_layer: 2 * self.bytes_per_layer, embedding_bytes: 2 * self.embedding_bytes, head_bytes: 2 * self.head_bytes, ..held },
            _ => held,
        }
    }

    /// Memory the whole model takes on one node of the kind given.
    pub fn total_bytes_on(&self, gpu: bool) -> u64 {
        let held = self.held_on(gpu);
        held.layer_memory() * self.layers as u64 + held.embedding_bytes + held.head_bytes
    }
}

/// A model's bytes as one kind of node holds them (`ModelFootprint::held_on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// Weights a layer reads per token.
    pub bytes_per_layer: u64,
    pub kv_bytes_per_layer: u64,
    pub embedding_bytes: u64,
    pub head_bytes: u64,
}

impl Held {
    /// Memory one layer takes while serving: its weights and its KV cache.
    pub fn layer_memory(&self) -> u64 {
        self.bytes_per_layer + self.kv_bytes_per_layer
    }
}

/// What a member offers, from its advert.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    pub node: NodeId,
    pub memory_offered: u64,
    /// Measured memory read bandwidth in bytes/s (decode speed is bound by it).
    pub mem_bandwidth: f64,
    /// Whether the node computes on a GPU (what it holds of a model depends on it).
    #[serde(default)]
    pub gpu: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    Single,
    Pipeline,
    /// One tensor-parallel group runs every layer.
    Tensor,
    /// Tensor-parallel groups as pipeline stages.
    Hybrid,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    pub node: NodeId,
    pub start: usize,
    pub end: usize,
    /// With members, a tensor-parallel group: `node` is rank 0 (it passes results on) and
    /// these are ranks 1.., each running its slice of the same layers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub group: Vec<NodeId>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub strategy: Strategy,
    pub stages: Vec<Stage>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PlacementError {
    /// No member holds the model's files.
    #[error("no node of the swarm has the files of {model}")]
    NoMembers { model: String },
    /// The members together offer too little memory.
    #[error("{model} needs {needed} bytes (weights and KV cache) but the swarm offers {offered} bytes; add a node, raise --memory-limit or lower --context")]
    DoesNotFit { model: String, needed: u64, offered: u64 },
    /// The footprint is not placeable (zero layers).
    #[error("{model} has no layers to place")]
    Empty { model: String },
}

/// Places every model wanted by `members` (their adverts), in name order: each over the members
/// that hold its files, with the memory the models before it left; `link` is what the cost model
/// assumes between members.
pub fn place_all(members: &[&NodeAdvert], link: LinkCost) -> BTreeMap<String, Result<Placement, String>> {
    let mut wanted: BTreeMap<&str, &ModelFootprint> = BTreeMap::new();
    for a in members {
        for w in &a.wants {
            wanted.entry(w.model.as_str()).or_insert(w);
        }
    }
    let mut left: BTreeMap<&str, u64> = members.iter().map(|a| (a.id.as_str(), a.memory_offered)).collect();
    let mut placements = BTreeMap::new();
    for (name, footprint) in wanted {
        let holders: Vec<Capacity> = members
            .iter()
            .filter(|a| a.models.iter().any(|m| m == name))
            .map(|a| Capacity { node: a.id.clone(), memory_offered: left[a.id.as_str()], mem_bandwidth: a.decode_rate(), gpu: a.gpu.is_some() })
            .collect();
        let placed = super::tensor::place_choice(footprint, &holders, link);
        if let Ok(p) = &placed {
            for (node, used) in super::tensor::memory_used(footprint, p, &holders) {
                if let Some(l) = left.get_mut(node.as_str()) {
                    *l = l.saturating_sub(used);
                }
            }
        }
        placements.insert(name.to_string(), placed.map_err(|e| e.to_string()));
    }
    placements
}

/// Places `model` on `members` (order does not matter; the result is deterministic).
pub fn place(model: &ModelFootprint, members: &[Capacity]) -> Result<Placement, PlacementError> {
    if model.layers == 0 {
        return Err(PlacementError::Empty { model: model.model.clone() });
    }
    if members.is_empty() {
        return Err(PlacementError::NoMembers { model: model.model.clone() });
    }
    let mut nodes: Vec<&Capacity> = members.iter().collect();
    nodes.sort_by(|a, b| a.node.cmp(&b.node));

    // Single node: the fastest member that can hold everything, unless a far faster tier
    // (a GPU too small for the whole model) makes a split predict a faster token.
    if let Some(best) = nodes
        .iter()
        .filter(|c| c.memory_offered >= model.total_bytes_on(c.gpu))
        .max_by(|a, b| a.mem_bandwidth.total_cmp(&b.mem_bandwidth).then(b.node.cmp(&a.node)))
    {
        let single = Placement { strategy: Strategy::Single, stages: vec![Stage { node: best.node.clone(), start: 0, end: model.layers, group: vec![] }] };
        let top = nodes.iter().map(|c| c.mem_bandwidth).fold(0.0, f64::max);
        if best.mem_bandwidth.max(1.0) * TIER_RATIO >= top {
            return Ok(single);
        }
        return Ok(match pipeline(model, &nodes) {
            Ok(split) if token_seconds(model, &split, &nodes) < token_seconds(model, &single, &nodes) => split,
            _ => single,
        });
    }
    pipeline(model, &nodes)
}

/// Seconds a decode step is predicted to take: every stage streams its weights at its node's
/// bandwidth, plus one hop between stages (1.5 ms measured on a LAN-less loopback, a floor).
fn token_seconds(model: &ModelFootprint, p: &Placement, nodes: &[&Capacity]) -> f64 {
    const HOP_SECONDS: f64 = 1.5e-3;
    let last = p.stages.len().saturating_sub(1);
    p.stages
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let node = nodes.iter().find(|c| c.node == s.node);
            let bw = node.map_or(1.0, |c| c.mem_bandwidth.max(1.0));
            let held = model.held_on(node.is_some_and(|c| c.gpu));
            let fixed = if i == last { held.head_bytes } else { 0 };
            ((s.end - s.start) as u64 * held.bytes_per_layer + fixed) as f64 / bw
        })
        .sum::<f64>()
        + last as f64 * HOP_SECONDS
}

/// A pipeline over `nodes` (sorted by id), or why none fits.
pub(super) fn pipeline(model: &ModelFootprint, nodes: &[&Capacity]) -> Result<Placement, PlacementError> {
    let offered: u64 = nodes.iter().map(|c| c.memory_offered).sum();
    // What the whole model takes on these nodes' kind (the CPU's figure when they are mixed).
    let needed = model.total_bytes_on(nodes.iter().all(|c| c.gpu));
    let not_fit = || PlacementError::DoesNotFit { model: model.model.clone(), needed, offered };
    if offered < model.total_bytes_on(nodes.iter().any(|c| c.gpu)) {
        return Err(not_fit());
    }
    // Stage order: the first stage also holds the embedding, the last the head; give those
    // roles to the nodes with the most memory so that the extra bytes land where there is room.
    let mut by_memory = nodes.to_vec();
    by_memory.sort_by(|a, b| b.memory_offered.cmp(&a.memory_offered).then(a.node.cmp(&b.node)));
    let first = by_memory[0].node.clone();
    let last = by_memory.get(1).map(|c| c.node.clone()).unwrap_or_else(|| first.clone());
    let mut order: Vec<&Capacity> = Vec::with_capacity(nodes.len());
    order.extend(nodes.iter().copied().filter(|c| c.node == first));
    order.extend(nodes.iter().copied().filter(|c| c.node != first && c.node != last));
    order.extend(nodes.iter().copied().filter(|c| c.node == last && c.node != first));

    // Layers each node can hold after its fixed share.
    let capacity: Vec<usize> = order
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let held = model.held_on(c.gpu);
            let fixed = if i == 0 { held.embedding_bytes } else { 0 } + if i + 1 == order.len() { held.head_bytes } else { 0 };
            (c.memory_offered.saturating_sub(fixed) / held.layer_memory().max(1)) as usize
        })
        .collect();
    if capacity.iter().sum::<usize>() < model.layers {
        return Err(not_fit());
    }
    let layers = tiered_shares(model.layers, &order, &capacity);

    let mut stages = Vec::new();
    let mut start = 0;
    for (c, n) in order.iter().zip(layers) {
        if n > 0 {
            stages.push(Stage { node: c.node.clone(), start, end: start + n, group: vec![] });
            start += n;
        }
    }
    // The first and last stage own extra tensors: re-check them after dropping empty nodes.
    let fits = stages.iter().enumerate().all(|(i, s)| {
        let Some(c) = order.iter().find(|c| c.node == s.node) else { return false };
        let held = model.held_on(c.gpu);
        let fixed = if i == 0 { held.embedding_bytes } else { 0 } + if i + 1 == stages.len() { held.head_bytes } else { 0 };
        (s.end - s.start) as u64 * held.layer_memory() + fixed <= c.memory_offered
    });
    if !fits {
        return Err(not_fit());
    }
    Ok(Placement { strategy: if stages.len() == 1 { Strategy::Single } else { Strategy::Pipeline }, stages })
}

/// A node this many times slower (memory bandwidth) than the fastest open one is in a lower tier.
const TIER_RATIO: f64 = 8.0;

/// Layers per node (in `order`): the fastest tier is filled up to its capacity first, then the
/// next. Within a tier, layers follow offered memory corrected by bandwidth relative to the
/// tier's mean (the square root damps measurement noise).
fn tiered_shares(total: usize, order: &[&Capacity], capacity: &[usize]) -> Vec<usize> {
    let mut shares = vec![0usize; order.len()];
    let mut open: Vec<usize> = (0..order.len()).collect();
    let mut left = total;
    while left > 0 && !open.is_empty() {
        let top = open.iter().map(|&i| order[i].mem_bandwidth.max(1.0)).fold(0.0, f64::max);
        let (tier, rest): (Vec<usize>, Vec<usize>) = open.iter().partition(|&&i| order[i].mem_bandwidth.max(1.0) * TIER_RATIO >= top);
        let mean_bw = tier.iter().map(|&i| order[i].mem_bandwidth.max(1.0)).sum::<f64>() / tier.len() as f64;
        let weights: Vec<f64> = tier.iter().map(|&i| order[i].memory_offered as f64 * (order[i].mem_bandwidth.max(1.0) / mean_bw).sqrt()).collect();
        let caps: Vec<usize> = tier.iter().map(|&i| capacity[i]).collect();
        let take = left.min(caps.iter().sum());
        for (&i, n) in tier.iter().zip(largest_remainder(take, &weights, &caps)) {
            shares[i] = n;
        }
        left -= take;
        open = rest;
    }
    shares
}

/// Splits `total` into integer shares proportional to `weights`, each at most `cap[i]`,
/// by largest remainder; overflow from capped shares goes to the others the same way.
fn largest_remainder(total: usize, weights: &[f64], cap: &[usize]) -> Vec<usize> {
    let mut shares = vec![0usize; weights.len()];
    let mut open: Vec<usize> = (0..weights.len()).filter(|&i| cap[i] > 0).collect();
    let mut left = total;
    while left > 0 && !open.is_empty() {
        let sum: f64 = open.iter().map(|&i| weights[i].max(1e-9)).sum();
        let ideal: Vec<(usize, f64)> = open.iter().map(|&i| (i, left as f64 * weights[i].max(1e-9) / sum)).collect();
        let mut given = 0;
        for &(i, x) in &ideal {
            let n = (x.floor() as usize).min(cap[i] - shares[i]);
            shares[i] += n;
            given += n;
        }
        let mut rest: Vec<(usize, f64)> = ideal.iter().map(|&(i, x)| (i, x - x.floor())).collect();
        rest.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for (i, _) in rest {
            if given == left {
                break;
            }
            if shares[i] < cap[i] {
                shares[i] += 1;
                given += 1;
            }
        }
        left -= given;
        open.retain(|&i| shares[i] < cap[i]);
        if given == 0 {
            break;
        }
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(node: &str, gb: u64, bw: f64) -> Capacity {
        Capacity { node: node.into(), memory_offered: gb << 30, mem_bandwidth: bw, gpu: node.starts_with("gpu") }
    }

    fn model(layers: usize, gb_per_layer_x10: u64) -> ModelFootprint {
        ModelFootprint { model: "m".into(), layers, bytes_per_layer: (gb_per_layer_x10 << 30) / 10, embedding_bytes: 1 << 29, head_bytes: 1 << 29, ..Default::default() }
    }

    #[test]
    fn single_node_when_one_fits_and_it_is_the_fastest() {
        let m = model(10, 1); // 1 GiB of layers + 1 GiB extra
        let p = place(&m, &[cap("a", 4, 10.0), cap("b", 4, 20.0), cap("c", 1, 50.0)]).unwrap();
        assert_eq!(p.strategy, Strategy::Single);
        assert_eq!(p.stages, vec![Stage { node: "b".into(), start: 0, end: 10, group: vec![] }]);
    }

    #[test]
    fn pipeline_in_proportion_to_memory_with_every_layer_once() {
        let m = model(28, 5); // 14 GiB of layers
        let p = place(&m, &[cap("a", 4, 10.0), cap("b", 8, 10.0), cap("c", 4, 10.0)]).unwrap();
        assert_eq!(p.strategy, Strategy::Pipeline);
        assert_eq!(p.stages.first().unwrap().start, 0);
        assert_eq!(p.stages.last().unwrap().end, 28);
        for w in p.stages.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        let b = p.stages.iter().find(|s| s.node == "b").unwrap();
        assert!(b.end - b.start >= 12, "the 8 GiB node holds about half: {p:?}");
    }

    #[test]
    fn never_more_than_a_node_offers_and_a_clear_error_when_the_swarm_is_too_small() {
        let m = model(28, 5);
        let p = place(&m, &[cap("a", 2, 100.0), cap("b", 14, 1.0)]).unwrap();
        for s in &p.stages {
            let offered = if s.node == "a" { 2u64 << 30 } else { 14 << 30 };
            assert!((s.end - s.start) as u64 * m.bytes_per_layer <= offered, "{p:?}");
        }
        let err = place(&m, &[cap("a", 4, 1.0), cap("b", 4, 1.0)]).unwrap_err();
        assert!(matches!(err, PlacementError::DoesNotFit { .. }));
        assert!(err.to_string().contains("needs"), "{err}");
    }

    #[test]
    fn deterministic_whatever_the_member_order() {
        let m = model(30, 5);
        let members = [cap("x", 5, 3.0), cap("y", 6, 9.0), cap("z", 7, 1.0)];
        let mut rev = members.to_vec();
        rev.reverse();
        assert_eq!(place(&m, &members).unwrap(), place(&m, &rev).unwrap());
    }

    fn n_of(p: &Placement, id: &str) -> usize {
        p.stages.iter().find(|s| s.node == id).map_or(0, |s| s.end - s.start)
    }

    #[test]
    fn a_gpu_beside_cpus_is_filled_first_and_the_cpus_share_the_rest() {
        // 20 layers of 0.5 GB (11 GB in all); the GPU offers 4 GB at 3 TB/s, the CPUs 6 GB each at 50 GB/s.
        let m = model(20, 5);
        let p = place(&m, &[cap("gpu", 4, 3000.0), cap("cpu1", 6, 50.0), cap("cpu2", 6, 50.0)]).unwrap();
        let n = |id: &str| p.stages.iter().find(|s| s.node == id).map_or(0, |s| s.end - s.start);
        assert_eq!(n("gpu"), 8, "the GPU holds all it can: {p:?}");
        assert_eq!(n("cpu1") + n("cpu2"), 12, "{p:?}");
        assert!(n("cpu1").abs_diff(n("cpu2")) <= 1, "equal CPUs share evenly: {p:?}");
        // With room for everything, the GPU alone serves.
        let p = place(&m, &[cap("gpu", 80, 3000.0), cap("cpu1", 16, 50.0)]).unwrap();
        assert_eq!((p.strategy, p.stages.len(), p.stages[0].node.as_str()), (Strategy::Single, 1, "gpu"));
        // A CPU could hold it alone, but running 7 of its layers (and the 0.5 GB head, as the
        // last stage) on the GPU predicts a faster token.
        let p = place(&m, &[cap("gpu", 4, 3000.0), cap("cpu1", 16, 50.0)]).unwrap();
        assert_eq!((p.strategy, n_of(&p, "gpu"), n_of(&p, "cpu1")), (Strategy::Pipeline, 7, 13), "{p:?}");
    }

    #[test]
    fn the_reserved_kv_cache_counts_as_memory_so_a_filled_gpu_keeps_room_for_it() {
        // As above (0.5 GB of weights a layer), each layer's cache reserving 0.25 GB more.
        let m = ModelFootprint { kv_bytes_per_layer: (1 << 30) / 4, ..model(20, 5) };
        let members = [cap("gpu", 4, 3000.0), cap("cpu1", 8, 50.0), cap("cpu2", 8, 50.0)];
        let p = place(&m, &members).unwrap();
        assert_eq!(n_of(&p, "gpu"), 5, "4 GB holds 5 layers with their caches, not 8: {p:?}");
        let last = p.stages.len() - 1;
        for (i, s) in p.stages.iter().enumerate() {
            let fixed = if i == 0 { m.embedding_bytes } else { 0 } + if i == last { m.head_bytes } else { 0 };
            let offered = members.iter().find(|c| c.node == s.node).unwrap().memory_offered;
            assert!((s.end - s.start) as u64 * m.held_on(false).layer_memory() + fixed <= offered, "{p:?}");
        }
        // 11 GB of weights fit one 12 GB node; with 5 GB of caches they need two.
        assert_eq!(place(&model(20, 5), &[cap("a", 12, 50.0), cap("b", 12, 50.0)]).unwrap().strategy, Strategy::Single);
        assert_eq!(place(&m, &[cap("a", 12, 50.0), cap("b", 12, 50.0)]).unwrap().strategy, Strategy::Pipeline);
        let err = place(&m, &[cap("a", 12, 50.0)]).unwrap_err();
        assert_eq!(err, PlacementError::DoesNotFit { model: "m".into(), needed: 16 << 30, offered: 12 << 30 });
        // The caches are memory, not bytes read per token: the predicted token time is the same.
        assert_eq!(token_seconds(&m, &p, &members.iter().collect::<Vec<_>>()), token_seconds(&model(20, 5), &p, &members.iter().collect::<Vec<_>>()));
    }

    #[test]
    fn a_half_precision_model_takes_twice_its_bytes_on_a_cpu_and_a_half_width_cache_on_a_gpu() {
        // 20 layers of 0.5 GB as stored (f16), each reserving 0.25 GB of f32 cache.
        let m = ModelFootprint { kv_bytes_per_layer: (1 << 30) / 4, dense_half: true, ..model(20, 5) };
        let gb = 1u64 << 30;
        assert_eq!(m.held_on(false), Held { bytes_per_layer: gb, kv_bytes_per_layer: gb / 4, embedding_bytes: gb, head_bytes: gb });
        assert_eq!(m.held_on(true), Held { bytes_per_layer: gb / 2, kv_bytes_per_layer: gb / 8, embedding_bytes: gb / 2, head_bytes: gb / 2 });
        // Its 16 GB file and caches would fit a 16 GB CPU node as stored; widened they need 27.
        let stored = ModelFootprint { dense_half: false, ..m.clone() };
        assert_eq!(place(&stored, &[cap("cpu", 16, 50.0)]).unwrap().strategy, Strategy::Single);
        assert_eq!(place(&m, &[cap("cpu", 16, 50.0)]).unwrap_err(), PlacementError::DoesNotFit { model: "m".into(), needed: 27 * gb, offered: 16 * gb });
        // A 14 GB GPU holds it all (0.625 GB a layer); a GPU beside CPUs fills at its own width.
        assert_eq!(place(&m, &[cap("gpu", 14, 3000.0)]).unwrap().strategy, Strategy::Single);
        let members = [cap("gpu", 4, 3000.0), cap("cpu1", 16, 50.0), cap("cpu2", 16, 50.0)];
        let p = place(&m, &members).unwrap();
        assert_eq!(n_of(&p, "gpu"), 6, "4 GB hold 6 layers at the GPU's 0.625 GB, not 3 at a CPU's 1.25: {p:?}");
        let last = p.stages.len() - 1;
        for (i, s) in p.stages.iter().enumerate() {
            let c = members.iter().find(|c| c.node == s.node).unwrap();
            let held = m.held_on(c.gpu);
            let fixed = if i == 0 { held.embedding_bytes } else { 0 } + if i == last { held.head_bytes } else { 0 };
            assert!((s.end - s.start) as u64 * held.layer_memory() + fixed <= c.memory_offered, "{p:?}");
        }
        // A CPU reads the widened weights each token: twice the stored figure's time there.
        let cpu_alone = Placement { strategy: Strategy::Single, stages: vec![Stage { node: "cpu1".into(), start: 0, end: 20, group: vec![] }] };
        let nodes: Vec<&Capacity> = members.iter().collect();
        assert_eq!(token_seconds(&m, &cpu_alone, &nodes), 2.0 * token_seconds(&stored, &cpu_alone, &nodes));
        // Quantized weights stay as stored everywhere; only a GPU halves their cache.
        let gguf = ModelFootprint { dense_half: false, quantized: true, ..m.clone() };
        assert_eq!(gguf.held_on(false), stored.held_on(false));
        assert_eq!(gguf.held_on(true), Held { kv_bytes_per_layer: gb / 8, ..stored.held_on(true) });
        assert_eq!(stored.held_on(true).kv_bytes_per_layer, gb / 4, "an f32 checkpoint's cache stays f32 on a GPU");
    }

    #[test]
    fn faster_nodes_get_more_layers_at_equal_memory() {
        let m = model(20, 5);
        let p = place(&m, &[cap("a", 8, 40.0), cap("b", 8, 10.0)]).unwrap();
        let n = |id: &str| p.stages.iter().find(|s| s.node == id).map(|s| s.end - s.start).unwrap();
        assert!(n("a") > n("b"), "{p:?}");
    }
}
