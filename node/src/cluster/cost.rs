//! The cost model: predicted single-sequence decode tok/s of a model under each strategy
//! (single node, pipeline, tensor-parallel group, hybrid: tensor groups as pipeline stages) from
//! the members' measured memory bandwidth and FLOP/s, the link RTT and the bytes that cross a
//! link per token. A decode step reads every weight once, so a node's time is the larger of
//! bytes / bandwidth and 2 FLOP per weight byte / FLOP/s; a pipeline adds one hop per stage
//! boundary; a tensor group divides the layers' bytes and the LM head (split by vocabulary,
//! its logits gathered by one more all-reduce) and adds two all-reduces per layer (one exchange for 2, recursive doubling for small
//! buffers, a ring otherwise, as `dataplane::group` runs them). Pure: no I/O, no clocks.
//! It does not measure anything itself and ignores KV-cache reads (short contexts).

use serde::Serialize;

use super::placement::ModelFootprint;

/// A link between members: round-trip time and bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkCost {
    pub rtt_s: f64,
    pub bytes_per_s: f64,
}

impl LinkCost {
    /// When nothing was measured: a LAN hop of 0.5 ms and 1 Gbit/s.
    pub const LAN: LinkCost = LinkCost { rtt_s: 0.5e-3, bytes_per_s: 125e6 };
}

/// A member's measured speed.
#[derive(Debug, Clone, PartialEq)]
pub struct Speed {
    pub node: String,
    pub mem_bandwidth: f64,
    pub flops: f64,
    pub memory_offered: u64,
    /// Whether the member computes on a GPU (what it holds and reads depends on it).
    pub gpu: bool,
}

/// One strategy's prediction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// `single`, `pipeline`, `tensor` or `hybrid`.
    pub strategy: &'static str,
    /// Members used (for hybrid: groups × group size).
    pub members: usize,
    /// Tensor-parallel group size (1 for single and pipeline).
    pub group: usize,
    pub tok_s: f64,
    /// Bytes each member sends on the data plane per generated token.
    pub link_bytes_per_token: u64,
    /// Whether the members' offered memory holds the parts.
    pub fits: bool,
}

/// Hidden size estimated from a layer's bytes: about 12·h² weights per layer at the ~1.8
/// weights per byte of Q4_K_M (only the all-reduce's bytes depend on it, and they are small).
pub fn hidden_estimate(bytes_per_layer: u64) -> usize {
    ((bytes_per_layer as f64 * 1.8 / 12.0).sqrt() as usize).max(1)
}

fn node_time(bytes: f64, s: &Speed) -> f64 {
    (bytes / s.mem_bandwidth.max(1.0)).max(2.0 * bytes / s.flops.max(1.0))
}

/// Seconds of one all-reduce of `bytes` over `n` members, and the bytes each member sends.
pub fn all_reduce_cost(n: usize, bytes: f64, link: LinkCost) -> (f64, f64) {
    let hop = |b: f64| link.rtt_s / 2.0 + b / link.bytes_per_s.max(1.0);
    match n {
        0 | 1 => (0.0, 0.0),
        2 => (hop(bytes), bytes),
        _ if n.is_power_of_two() && bytes <= 64.0 * 1024.0 => {
            let steps = n.trailing_zeros() as f64;
            (steps * hop(bytes), steps * bytes)
        }
        _ => {
            let steps = 2.0 * (n - 1) as f64;
            (steps * hop(bytes / n as f64), steps * bytes / n as f64)
        }
    }
}

/// Tok/s of one tensor group of `members` running `layers` layers (plus the head when `head`).
fn group_time(m: &ModelFootprint, members: &[&Speed], layers: usize, head: bool, link: LinkCost) -> (f64, f64) {
    let n = members.len().max(1);
    // The LM head is split by vocabulary rows and its logits gathered by one all-reduce of
    // vocab × 4 bytes (vocabulary estimated from the head's bytes at ~1.8 weights a byte).
    let hidden = hidden_estimate(m.bytes_per_layer) as f64;
    let slice = |s: &Speed| {
        let held = m.held_on(s.gpu);
        (layers as f64 * held.bytes_per_layer as f64 + if head { held.head_bytes as f64 } else { 0.0 }) / n as f64
    };
    let compute = members.iter().map(|s| node_time(slice(s), s)).fold(0.0, f64::max);
    let (ar, sent) = all_reduce_cost(n, hidden * 4.0, link);
    let (gather, gathered) = if head && n > 1 { all_reduce_cost(n, m.head_bytes as f64 * 1.8 / hidden * 4.0, link) } else { (0.0, 0.0) };
    (compute + 2.0 * layers as f64 * ar + gather, 2.0 * layers as f64 * sent + gathered)
}

fn fits(m: &ModelFootprint, members: &[&Speed], layers: usize, first: bool, last: bool) -> bool {
    let n = members.len().max(1) as u64;
    members.iter().all(|s| {
        let held = m.held_on(s.gpu);
        s.memory_offered >= layers as u64 * held.layer_memory() / n + if first { held.embedding_bytes } else { 0 } + if last { held.head_bytes } else { 0 }
    })
}

/// Pipeline over `stages` (each a tensor group of one or more members with its layer count).
pub fn predict_stages(m: &ModelFootprint, stages: &[(Vec<&Speed>, usize)], link: LinkCost) -> (f64, u64, bool) {
    let mut t = 0.0;
    let mut sent = 0.0;
    let mut ok = true;
    for (i, (group, layers)) in stages.iter().enumerate() {
        let last = i + 1 == stages.len();
        let (g, s) = group_time(m, group, *layers, last, link);
        t += g;
        sent += s;
        ok &= fits(m, group, *layers, i == 0, last);
    }
    let hops = stages.len().saturating_sub(1) as f64;
    let hidden = hidden_estimate(m.bytes_per_layer) as f64 * 4.0;
    t += hops * (link.rtt_s + hidden / link.bytes_per_s.max(1.0));
    sent += hops * hidden;
    (if t > 0.0 { 1.0 / t } else { 0.0 }, sent.round() as u64, ok)
}

/// Predictions for every strategy over `members` (fastest first in each group), best first.
pub fn predict_all(m: &ModelFootprint, members: &[Speed], link: LinkCost) -> Vec<Prediction> {
    let mut ranked: Vec<&Speed> = members.iter().collect();
    ranked.sort_by(|a, b| b.mem_bandwidth.total_cmp(&a.mem_bandwidth).then(a.node.cmp(&b.node)));
    let mut out = Vec::new();
    let mut push = |strategy, groups: Vec<Vec<&Speed>>| {
        let k = groups.len().max(1);
        let per = m.layers / k;
        let stages: Vec<(Vec<&Speed>, usize)> = groups.iter().enumerate().map(|(i, g)| (g.clone(), per + usize::from(i < m.layers % k))).collect();
        let (tok_s, bytes, ok) = predict_stages(m, &stages, link);
        out.push(Prediction { strategy, members: groups.iter().map(Vec::len).sum(), group: groups.first().map_or(1, Vec::len), tok_s, link_bytes_per_token: bytes, fits: ok });
    };
    if let Some(best) = ranked.first() {
        push("single", vec![vec![*best]]);
    }
    let n = ranked.len();
    if n >= 2 {
        push("pipeline", ranked.iter().map(|s| vec![*s]).collect());
        push("tensor", vec![ranked.clone()]);
    }
    for g in [2, 4] {
        if n >= 2 * g {
            push("hybrid", ranked.chunks(g).filter(|c| c.len() == g).map(|c| c.to_vec()).collect());
        }
    }
    out.sort_by(|a, b| b.fits.cmp(&a.fits).then(b.tok_s.total_cmp(&a.tok_s)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn speed(node: &str, gbs: f64) -> Speed {
        Speed { node: node.into(), mem_bandwidth: gbs * 1e9, flops: 1e12, memory_offered: 64 << 30, gpu: false }
    }

    fn seven_b() -> ModelFootprint {
        ModelFootprint { model: "7b".into(), layers: 28, bytes_per_layer: 233 << 20, embedding_bytes: 545 << 20, head_bytes: 545 << 20, ..Default::default() }
    }

    #[test]
    fn tensor_beats_single_on_a_fast_link_and_loses_on_a_slow_one() {
        let m = seven_b();
        let two = [speed("a", 20.0), speed("b", 20.0)];
        let fast = predict_all(&m, &two, LinkCost { rtt_s: 20e-6, bytes_per_s: 5e9 });
        let tok = |p: &[Prediction], s: &str| p.iter().find(|x| x.strategy == s).unwrap().tok_s;
        assert!(tok(&fast, "tensor") > 1.6 * tok(&fast, "single"), "{fast:?}");
        assert_eq!(fast[0].strategy, "tensor");
        let slow = predict_all(&m, &two, LinkCost { rtt_s: 10e-3, bytes_per_s: 125e6 });
        assert!(tok(&slow, "tensor") < tok(&slow, "single"), "{slow:?}");
        assert!(tok(&slow, "pipeline") < tok(&slow, "single"), "a pipeline never speeds up one sequence");
    }

    #[test]
    fn all_reduce_costs_follow_the_algorithms() {
        let link = LinkCost { rtt_s: 1e-4, bytes_per_s: 1e9 };
        let (two, sent2) = all_reduce_cost(2, 6144.0, link);
        let (four, _) = all_reduce_cost(4, 6144.0, link);
        assert!((four / two - 2.0).abs() < 1e-9, "doubling: log2 4 exchanges");
        assert_eq!(sent2, 6144.0);
        let (_, ring_sent) = all_reduce_cost(3, 3e6, link);
        assert!((ring_sent - 4e6).abs() < 1.0, "ring sends 2(n-1)/n of the buffer");
    }
}
