//! Gemma 3 (text): tanh-GELU MLP, four RMSNorms per layer scaling by `1 + w`, q/k norm,
//! embeddings scaled by `sqrt(hidden)`, and sliding-window layers (own rope base) between
//! periodic global layers. GGUF files already store norms as `1 + w`.

use serde_json::Value;

use super::{hf_activation, GgufMeta, HfConfig};
use crate::engine::spec::{hf_rope, Activation, Family, ModelSpec, Rope, RopeScaling};

/// Every sixth layer is global in released Gemma 3 checkpoints (llama.cpp hard-codes it too).
const DEFAULT_PATTERN: usize = 6;
const DEFAULT_LOCAL_THETA: f64 = 10_000.0;

fn pattern_layers(layers: usize, pattern: usize) -> Vec<bool> {
    (0..layers).map(|i| pattern != 0 && (i + 1) % pattern != 0).collect()
}

pub fn from_hf(cfg: &HfConfig, raw: &Value) -> Result<ModelSpec, String> {
    let layers = cfg.num_hidden_layers;
    let sliding_layers = match raw.get("layer_types").and_then(Value::as_array) {
        Some(types) => {
            if types.len() != layers {
                return Err(format!("layer_types has {} entries for {layers} layers", types.len()));
            }
            types.iter().map(|t| t.as_str() == Some("sliding_attention")).collect()
        }
        None => pattern_layers(layers, raw.get("sliding_window_pattern").and_then(Value::as_u64).unwrap_or(DEFAULT_PATTERN as u64) as usize),
    };
    let head_dim = cfg.head_dim.unwrap_or(256);
    let query_scalar = raw.get("query_pre_attn_scalar").and_then(Value::as_f64).unwrap_or(head_dim as f64);
    let local_theta = raw.get("rope_local_base_freq").and_then(Value::as_f64).unwrap_or(DEFAULT_LOCAL_THETA);
    let local_rope = hf_rope(raw, Some("sliding_attention"), local_theta)?;
    // In the 4.x form the single rope_scaling applies to global layers only.
    let local_rope = if raw.get("rope_parameters").is_some() { local_rope } else { Rope { theta: local_theta, scaling: RopeScaling::None } };
    Ok(ModelSpec {
        family: Family::Gemma3,
        hidden_size: cfg.hidden_size,
        intermediate_size: cfg.intermediate_size,
        num_layers: layers,
        num_heads: cfg.num_attention_heads,
        num_kv_heads: cfg.kv_heads(),
        head_dim,
        vocab_size: cfg.vocab_size,
        context_length: cfg.max_position_embeddings.unwrap_or(32_768),
        rms_eps: cfg.rms_norm_eps.unwrap_or(1e-6),
        rope: hf_rope(raw, Some("full_attention"), 1_000_000.0)?,
        rope_style: crate::engine::spec::RopeStyle::Halves,
        local_rope: Some(local_rope),
        sliding_window: cfg.sliding_window.or(Some(4096)),
        sliding_layers,
        qkv_bias: cfg.attention_bias.unwrap_or(false),
        qk_norm: true,
        sandwich_norms: true,
        norm_weight_offset: 1.0,
        activation: hf_activation(cfg).unwrap_or(Activation::GeluTanh),
        attention_scale: 1.0 / query_scalar.sqrt(),
        embedding_scale: Some((cfg.hidden_size as f64).sqrt()),
        final_logit_softcap: raw.get("final_logit_softcapping").and_then(Value::as_f64),
        attn_logit_softcap: raw.get("attn_logit_softcapping").and_then(Value::as_f64),
        tie_embeddings: cfg.tie_word_embeddings.unwrap_or(true),
    })
}

pub fn from_gguf(meta: &GgufMeta<'_>, vocab_size: usize) -> Result<ModelSpec, String> {
    let mut spec = super::llama::common_gguf(meta, vocab_size, Family::Gemma3)?;
    let layers = spec.num_layers;
    spec.head_dim = meta.opt_usize("attention.key_length")?.unwrap_or(256);
    spec.qk_norm = true;
    spec.sandwich_norms = true;
    spec.activation = Activation::GeluTanh;
    spec.rms_eps = meta.opt_f64("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
    spec.attention_scale = 1.0 / (spec.head_dim as f64).sqrt();
    spec.embedding_scale = Some((spec.hidden_size as f64).sqrt());
    spec.final_logit_softcap = meta.opt_f64("final_logit_softcapping")?;
    spec.attn_logit_softcap = meta.opt_f64("attn_logit_softcapping")?;
    spec.sliding_window = Some(meta.opt_usize("attention.sliding_window")?.unwrap_or(4096));
    spec.sliding_layers = pattern_layers(layers, DEFAULT_PATTERN);
    spec.local_rope = Some(Rope { theta: DEFAULT_LOCAL_THETA, scaling: RopeScaling::None });
    spec.context_length = meta.opt_usize("context_length")?.unwrap_or(32_768);
    spec.tie_embeddings = true;
    Ok(spec)
}
