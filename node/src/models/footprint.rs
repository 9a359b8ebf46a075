//! What placing a model takes, read from its header (`cluster::ModelFootprint`): each layer's
//! weights, the embedding and the head as stored, whether its dense weights are half precision
//! (a CPU widens them), the KV cache reserved for a context, and how far it splits
//! tensor-parallel. One rule for the coordinator's wants, the API's `fits` and the tools; it
//! reads no weights.

use crate::cluster::{ModelFootprint, TpUnits};
use crate::engine::model::ModelSource;
use crate::engine::tp::TpShape;

/// The footprint of `model` (files opened as `source`) served with `context_limit`.
pub fn footprint(model: &str, source: &ModelSource, context_limit: Option<usize>) -> ModelFootprint {
    let (bytes_per_layer, embedding_bytes, head_bytes) = source.footprint_bytes();
    // A model whose header does not say how it splits is placed only whole or by layers.
    let (heads, ffn) = TpShape::of(&source.weights, &source.spec).map(|s| s.units()).unwrap_or((0, 0));
    ModelFootprint {
        model: model.to_string(),
        layers: source.spec.num_layers,
        bytes_per_layer,
        kv_bytes_per_layer: source.kv_reserve_per_layer(context_limit),
        dense_half: source.weights.dense_half(),
        quantized: source.weights.quantized(),
        embedding_bytes,
        head_bytes,
        tp: TpUnits { heads, ffn },
        strategy: None,
    }
}
