//! Conversions between the `cluster` types and their `proto` messages, with validation of
//! everything that arrives: versions, vector lengths, string sizes, peer ids, layer ranges,
//! numbers. Remote input never panics here; every refusal is a typed `WireError`.
//! Control RPC envelopes stay `proto` types (the pipeline owns their meaning); this file only
//! checks their shape (`check_request`, `check_response`) and packs hidden states.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use prost::Message;
use shoal_proto::v1;
use shoal_proto::WIRE_VERSION;

use crate::cluster::{Epoch, ModelFootprint, NodeAdvert, Placement, Plan, Stage, Strategy};

/// Longest name, backend, address or model string accepted.
pub const MAX_STRING_BYTES: usize = 256;
/// Longest placement error text accepted.
pub const MAX_ERROR_BYTES: usize = 1024;
/// Most addresses in one advert.
pub const MAX_ADDRESSES: usize = 32;
/// Most wanted models in one advert, and most placements in one plan.
pub const MAX_MODELS: usize = 64;
/// Most members in one plan (and stages in one placement).
pub const MAX_MEMBERS: usize = 256;
/// No model has more layers than this.
pub const MAX_LAYERS: u32 = 4096;
/// Tensor-parallel units beyond this are clamped (no group is that large).
pub const MAX_TP_UNITS: u32 = 4096;
/// Widest hidden state accepted.
pub const MAX_HIDDEN_SIZE: u32 = 1 << 16;

/// Why a message from the wire was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The bytes are not a valid protobuf message of the expected type (this includes strings that are not UTF-8).
    #[error("not a valid message: {0}")]
    Decode(String),
    /// The message's `version` is not the one this node speaks.
    #[error("wire version {got}, expected {}", WIRE_VERSION)]
    Version { got: u32 },
    /// A required field is absent.
    #[error("missing field {0}")]
    Missing(&'static str),
    /// A repeated field has more entries than allowed.
    #[error("{field} has {len} entries, at most {max} allowed")]
    TooMany { field: &'static str, len: usize, max: usize },
    /// A string or byte field is longer than allowed.
    #[error("{field} is {len} bytes, at most {max} allowed")]
    TooLong { field: &'static str, len: usize, max: usize },
    /// A node id is not a libp2p PeerId.
    #[error("{field} is not a peer id")]
    BadId { field: &'static str },
    /// The advert's id is not the peer that signed it.
    #[error("advert for {claimed} signed by {signer}")]
    NotSigner { claimed: String, signer: PeerId },
    /// A layer range or layer count is impossible (empty, reversed, gapped or too large).
    #[error("bad layers in {field}: {detail}")]
    BadLayers { field: &'static str, detail: String },
    /// A number is out of range (negative, not finite, or overflowing when summed).
    #[error("{field} is out of range")]
    OutOfRange { field: &'static str },
    /// The same member or model appears twice.
    #[error("{field} has a duplicate entry")]
    Duplicate { field: &'static str },
    /// Hidden states whose byte length does not match rows x hidden_size f32 values.
    #[error("hidden states of {rows} x {hidden_size} carry {bytes} bytes")]
    HiddenShape { rows: u32, hidden_size: u32, bytes: usize },
}

pub(super) fn check_len(field: &'static str, s: &str, max: usize) -> Result<(), WireError> {
    if s.len() > max {
        return Err(WireError::TooLong { field, len: s.len(), max });
    }
    Ok(())
}

pub(super) fn check_count<T>(field: &'static str, v: &[T], max: usize) -> Result<(), WireError> {
    if v.len() > max {
        return Err(WireError::TooMany { field, len: v.len(), max });
    }
    Ok(())
}

fn check_id(field: &'static str, id: &str) -> Result<(), WireError> {
    check_len(field, id, MAX_STRING_BYTES)?;
    PeerId::from_str(id).map(|_| ()).map_err(|_| WireError::BadId { field })
}

fn check_figure(field: &'static str, x: f64) -> Result<f64, WireError> {
    if x.is_finite() && x >= 0.0 {
        Ok(x)
    } else {
        Err(WireError::OutOfRange { field })
    }
}

fn check_version(got: u32) -> Result<(), WireError> {
    if got != WIRE_VERSION {
        return Err(WireError::Version { got });
    }
    Ok(())
}

/// The advert as sent: `version` set, the plan included.
pub fn advert_to_proto(a: &NodeAdvert) -> v1::Advert {
    v1::Advert {
        version: WIRE_VERSION,
        id: a.id.clone(),
        name: a.name.clone(),
        priority: a.priority,
        memory_total: a.memory_total,
        memory_offered: a.memory_offered,
        mem_bandwidth: a.mem_bandwidth,
        flops: a.flops,
        backend: a.backend.clone(),
        addresses: a.addresses.clone(),
        wants: a.wants.iter().map(footprint_to_proto).collect(),
        plan: a.plan.as_ref().map(plan_to_proto),
        models: a.models.clone(),
        gpu: a.gpu.as_ref().map(|g| v1::Gpu { name: g.name.clone(), memory_total: g.memory_total }),
        listen_addrs: Vec::new(),
        decode_bandwidth: a.decode_bandwidth,
    }
}

/// A received advert, validated; its id must be `signer`, the peer whose key signed it.
pub fn advert_from_proto(a: v1::Advert, signer: &PeerId) -> Result<NodeAdvert, WireError> {
    check_version(a.version)?;
    check_id("advert.id", &a.id)?;
    if a.id != signer.to_string() {
        return Err(WireError::NotSigner { claimed: a.id, signer: *signer });
    }
    check_len("advert.name", &a.name, MAX_STRING_BYTES)?;
    check_len("advert.backend", &a.backend, MAX_STRING_BYTES)?;
    check_count("advert.addresses", &a.addresses, MAX_ADDRESSES)?;
    for address in &a.addresses {
        check_len("advert.addresses", address, MAX_STRING_BYTES)?;
    }
    check_count("advert.wants", &a.wants, MAX_MODELS)?;
    check_count("advert.models", &a.models, MAX_MODELS)?;
    for model in &a.models {
        check_len("advert.models", model, MAX_STRING_BYTES)?;
    }
    if let Some(g) = &a.gpu {
        check_len("advert.gpu.name", &g.name, MAX_STRING_BYTES)?;
    }
    Ok(NodeAdvert {
        mem_bandwidth: check_figure("advert.mem_bandwidth", a.mem_bandwidth)?,
        flops: check_figure("advert.flops", a.flops)?,
        decode_bandwidth: check_figure("advert.decode_bandwidth", a.decode_bandwidth)?,
        wants: a.wants.into_iter().map(footprint_from_proto).collect::<Result<_, _>>()?,
        plan: a.plan.map(plan_from_proto).transpose()?,
        id: a.id,
        name: a.name,
        priority: a.priority,
        memory_total: a.memory_total,
        memory_offered: a.memory_offered,
        backend: a.backend,
        addresses: a.addresses,
        models: a.models,
        gpu: a.gpu.map(|g| crate::cluster::GpuAdvert { name: g.name, memory_total: g.memory_total }),
    })
}

/// The gossip payload of an advert.
pub fn encode_advert(a: &NodeAdvert) -> Vec<u8> {
    advert_to_proto(a).encode_to_vec()
}

/// The gossip payload of an advert with the libp2p addresses its sender listens on.
pub fn encode_advert_from(a: &NodeAdvert, listen_addrs: &[Multiaddr]) -> Vec<u8> {
    let mut p = advert_to_proto(a);
    p.listen_addrs = listen_addrs.iter().take(MAX_ADDRESSES).map(Multiaddr::to_string).collect();
    p.encode_to_vec()
}

/// A gossip payload, decoded and validated (the caller has already capped its size).
pub fn decode_advert(bytes: &[u8], signer: &PeerId) -> Result<NodeAdvert, WireError> {
    decode_advert_from(bytes, signer).map(|(advert, _)| advert)
}

/// A gossip payload, decoded and validated, with the sender's listen addresses: at most
/// `MAX_ADDRESSES`, each a well-formed multiaddr that names no peer but the signer (any
/// `/p2p/` suffix is checked and removed).
pub fn decode_advert_from(bytes: &[u8], signer: &PeerId) -> Result<(NodeAdvert, Vec<Multiaddr>), WireError> {
    let mut advert = v1::Advert::decode(bytes).map_err(|e| WireError::Decode(e.to_string()))?;
    let listen = std::mem::take(&mut advert.listen_addrs);
    check_count("advert.listen_addrs", &listen, MAX_ADDRESSES)?;
    let mut addrs = Vec::with_capacity(listen.len());
    for text in &listen {
        check_len("advert.listen_addrs", text, MAX_STRING_BYTES)?;
        let mut addr: Multiaddr = text.parse().map_err(|e| WireError::Decode(format!("advert.listen_addrs: {e}")))?;
        if let Some(Protocol::P2p(peer)) = addr.iter().last() {
            if peer != *signer {
                return Err(WireError::NotSigner { claimed: peer.to_string(), signer: *signer });
            }
            addr.pop();
        }
        addrs.push(addr);
    }
    Ok((advert_from_proto(advert, signer)?, addrs))
}

fn footprint_to_proto(f: &ModelFootprint) -> v1::ModelFootprint {
    v1::ModelFootprint {
        model: f.model.clone(),
        // Footprints made here come from real models, far below u32::MAX layers.
        layers: u32::try_from(f.layers).unwrap_or(u32::MAX),
        bytes_per_layer: f.bytes_per_layer,
        kv_bytes_per_layer: f.kv_bytes_per_layer,
        dense_half: f.dense_half,
        quantized: f.quantized,
        embedding_bytes: f.embedding_bytes,
        head_bytes: f.head_bytes,
        // Unit counts come from a model's heads and blocks, far below u32::MAX.
        tp_head_units: u32::try_from(f.tp.heads).unwrap_or(u32::MAX),
        tp_ffn_units: u32::try_from(f.tp.ffn).unwrap_or(u32::MAX),
        strategy: f.strategy.map_or(v1::Strategy::Unspecified, strategy_to_proto) as i32,
    }
}

fn strategy_to_proto(s: Strategy) -> v1::Strategy {
    match s {
        Strategy::Single => v1::Strategy::Single,
        Strategy::Pipeline => v1::Strategy::Pipeline,
        Strategy::Tensor => v1::Strategy::Tensor,
        Strategy::Hybrid => v1::Strategy::Hybrid,
    }
}

/// `None` for UNSPECIFIED; an unknown value is an error.
fn strategy_from_proto(field: &'static str, value: i32) -> Result<Option<Strategy>, WireError> {
    match v1::Strategy::try_from(value) {
        Ok(v1::Strategy::Unspecified) => Ok(None),
        Ok(v1::Strategy::Single) => Ok(Some(Strategy::Single)),
        Ok(v1::Strategy::Pipeline) => Ok(Some(Strategy::Pipeline)),
        Ok(v1::Strategy::Tensor) => Ok(Some(Strategy::Tensor)),
        Ok(v1::Strategy::Hybrid) => Ok(Some(Strategy::Hybrid)),
        Err(_) => Err(WireError::OutOfRange { field }),
    }
}

fn footprint_from_proto(f: v1::ModelFootprint) -> Result<ModelFootprint, WireError> {
    check_len("wants.model", &f.model, MAX_STRING_BYTES)?;
    if f.layers > MAX_LAYERS {
        return Err(WireError::BadLayers { field: "wants.layers", detail: format!("{} layers", f.layers) });
    }
    // `ModelFootprint::total_bytes_on` sums these unchecked, doubled on a CPU for dense half
    // weights: refuse what would overflow there.
    let total = f.bytes_per_layer.checked_add(f.kv_bytes_per_layer).and_then(|b| b.checked_mul(u64::from(f.layers))).and_then(|b| b.checked_add(f.embedding_bytes)).and_then(|b| b.checked_add(f.head_bytes)).and_then(|b| b.checked_mul(2));
    if total.is_none() {
        return Err(WireError::OutOfRange { field: "wants.bytes" });
    }
    let strategy = strategy_from_proto("wants.strategy", f.strategy)?;
    let tp = crate::cluster::TpUnits { heads: f.tp_head_units.min(MAX_TP_UNITS) as usize, ffn: f.tp_ffn_units.min(MAX_TP_UNITS) as usize };
    Ok(ModelFootprint { model: f.model, layers: f.layers as usize, bytes_per_layer: f.bytes_per_layer, kv_bytes_per_layer: f.kv_bytes_per_layer, dense_half: f.dense_half, quantized: f.quantized, embedding_bytes: f.embedding_bytes, head_bytes: f.head_bytes, tp, strategy })
}

fn plan_to_proto(p: &Plan) -> v1::Plan {
    let placements = p
        .placements
        .iter()
        .map(|(model, outcome)| v1::ModelPlacement {
            model: model.clone(),
            outcome: Some(match outcome {
                Ok(placement) => v1::model_placement::Outcome::Placement(placement_to_proto(placement)),
                Err(error) => v1::model_placement::Outcome::Error(error.clone()),
            }),
        })
        .collect();
    v1::Plan { epoch: Some(v1::Epoch { round: p.epoch.round, leader: p.epoch.leader.clone() }), members: p.members.clone(), placements }
}

fn plan_from_proto(p: v1::Plan) -> Result<Plan, WireError> {
    let epoch = p.epoch.ok_or(WireError::Missing("plan.epoch"))?;
    check_id("plan.epoch.leader", &epoch.leader)?;
    check_count("plan.members", &p.members, MAX_MEMBERS)?;
    let mut members = BTreeSet::new();
    for member in &p.members {
        check_id("plan.members", member)?;
        if !members.insert(member.as_str()) {
            return Err(WireError::Duplicate { field: "plan.members" });
        }
    }
    check_count("plan.placements", &p.placements, MAX_MODELS)?;
    let mut placements = BTreeMap::new();
    for mp in p.placements {
        check_len("plan.placements.model", &mp.model, MAX_STRING_BYTES)?;
        let outcome = match mp.outcome.ok_or(WireError::Missing("plan.placements.outcome"))? {
            v1::model_placement::Outcome::Placement(placement) => Ok(placement_from_proto(placement, &members)?),
            v1::model_placement::Outcome::Error(error) => {
                check_len("plan.placements.error", &error, MAX_ERROR_BYTES)?;
                Err(error)
            }
        };
        if placements.insert(mp.model, outcome).is_some() {
            return Err(WireError::Duplicate { field: "plan.placements" });
        }
    }
    Ok(Plan { epoch: Epoch { round: epoch.round, leader: epoch.leader }, members: p.members, placements })
}

fn placement_to_proto(p: &Placement) -> v1::Placement {
    let strategy = strategy_to_proto(p.strategy);
    let stages = p
        .stages
        .iter()
        .map(|s| v1::Stage {
            node: s.node.clone(),
            // Stages made here lie within a model's layers, far below u32::MAX.
            layers: Some(v1::LayerRange { start: u32::try_from(s.start).unwrap_or(u32::MAX), end: u32::try_from(s.end).unwrap_or(u32::MAX) }),
            group: s.group.clone(),
        })
        .collect();
    v1::Placement { strategy: strategy as i32, stages }
}

/// Stages must be contiguous from layer 0, each non-empty, each on a member of the plan; a
/// node appears in at most one stage (as its node or in its group).
fn placement_from_proto(p: v1::Placement, members: &BTreeSet<&str>) -> Result<Placement, WireError> {
    let Some(strategy) = strategy_from_proto("placement.strategy", p.strategy)? else {
        return Err(WireError::OutOfRange { field: "placement.strategy" });
    };
    let mut seen = BTreeSet::new();
    if p.stages.is_empty() {
        return Err(WireError::Missing("placement.stages"));
    }
    check_count("placement.stages", &p.stages, MAX_MEMBERS)?;
    let mut stages = Vec::with_capacity(p.stages.len());
    let mut next = 0u32;
    for stage in p.stages {
        check_id("placement.stages.node", &stage.node)?;
        if !members.contains(stage.node.as_str()) {
            return Err(WireError::BadId { field: "placement.stages.node" });
        }
        let range = stage.layers.ok_or(WireError::Missing("placement.stages.layers"))?;
        if range.start != next || range.end <= range.start || range.end > MAX_LAYERS {
            return Err(WireError::BadLayers { field: "placement.stages", detail: format!("[{}, {}) after layer {next}", range.start, range.end) });
        }
        next = range.end;
        check_count("placement.stages.group", &stage.group, MAX_MEMBERS)?;
        for id in std::iter::once(&stage.node).chain(&stage.group) {
            check_id("placement.stages.group", id)?;
            if !members.contains(id.as_str()) {
                return Err(WireError::BadId { field: "placement.stages.group" });
            }
            if !seen.insert(id.clone()) {
                return Err(WireError::Duplicate { field: "placement.stages" });
            }
        }
        stages.push(Stage { node: stage.node, start: range.start as usize, end: range.end as usize, group: stage.group });
    }
    Ok(Placement { strategy, stages })
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
