//! Llama 2 / 3.x (and Mistral, which differs only by an optional sliding window):
//! SiLU-gated MLP, RMSNorm, grouped-query attention, rotary embeddings with Llama 3 scaling.
//! GGUF llama files were converted with permuted q/k rows, so they rotate adjacent pairs.

use serde_json::Value;

use super::{hf_activation, GgufMeta, HfConfig};
use crate::engine::spec::{hf_rope, Family, ModelSpec, Rope, RopeScaling, RopeStyle};

pub fn from_hf(family: Family, cfg: &HfConfig, raw: &Value) -> Result<ModelSpec, String> {
    let window = if family == Family::Mistral { cfg.sliding_window } else { None };
    Ok(ModelSpec {
        family,
        hidden_size: cfg.hidden_size,
        intermediate_size: cfg.intermediate_size,
        num_layers: cfg.num_hidden_layers,
        num_heads: cfg.num_attention_heads,
        num_kv_heads: cfg.kv_heads(),
        head_dim: cfg.head_dim(),
        vocab_size: cfg.vocab_size,
        context_length: cfg.max_position_embeddings.unwrap_or(4096),
        rms_eps: cfg.rms_norm_eps.unwrap_or(1e-5),
        rope: hf_rope(raw, None, 10_000.0)?,
        rope_style: RopeStyle::Halves,
        local_rope: None,
        sliding_window: window,
        sliding_layers: vec![window.is_some(); cfg.num_hidden_layers],
        qkv_bias: cfg.attention_bias.unwrap_or(false),
        qk_norm: false,
        sandwich_norms: false,
        norm_weight_offset: 0.0,
        activation: hf_activation(cfg)?,
        attention_scale: 1.0 / (cfg.head_dim() as f64).sqrt(),
        embedding_scale: None,
        final_logit_softcap: None,
        attn_logit_softcap: None,
        tie_embeddings: cfg.tie_word_embeddings.unwrap_or(false),
    })
}

pub fn from_gguf(meta: &GgufMeta<'_>, vocab_size: usize) -> Result<ModelSpec, String> {
    let mut spec = common_gguf(meta, vocab_size, Family::Llama)?;
    spec.rope_style = RopeStyle::Interleaved;
    let window = meta.opt_usize("attention.sliding_window")?;
    spec.sliding_window = window;
    spec.sliding_layers = vec![window.is_some(); spec.num_layers];
    Ok(spec)
}

/// The GGUF keys that Llama-shaped families (llama, qwen2, qwen3) share.
pub fn common_gguf(meta: &GgufMeta<'_>, vocab_size: usize, family: Family) -> Result<ModelSpec, String> {
    let hidden = meta.usize("embedding_length")?;
    let heads = meta.usize("attention.head_count")?;
    if heads == 0 {
        return Err("attention.head_count is 0".into());
    }
    let kv_heads = meta.opt_usize("attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = meta.opt_usize("attention.key_length")?.unwrap_or(hidden / heads);
    let layers = meta.usize("block_count")?;
    let scaling = match (meta.opt_str("rope.scaling.type"), meta.opt_f64("rope.scaling.factor")?) {
        (Some("linear"), Some(factor)) if factor > 0.0 => RopeScaling::Linear { factor },
        (Some("none") | None, _) => RopeScaling::None,
        (Some(other), _) => return Err(format!("unsupported rope scaling `{other}`")),
    };
    Ok(ModelSpec {
        family,
        hidden_size: hidden,
        intermediate_size: meta.usize("feed_forward_length")?,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        vocab_size,
        context_length: meta.opt_usize("context_length")?.unwrap_or(4096),
        rms_eps: meta.opt_f64("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5),
        rope: Rope { theta: meta.opt_f64("rope.freq_base")?.unwrap_or(10_000.0), scaling },
        rope_style: RopeStyle::Halves,
        local_rope: None,
        sliding_window: None,
        sliding_layers: vec![false; layers],
        qkv_bias: false,
        qk_norm: false,
        sandwich_norms: false,
        norm_weight_offset: 0.0,
        activation: crate::engine::spec::Activation::Silu,
        attention_scale: 1.0 / (head_dim as f64).sqrt(),
        embedding_scale: None,
        final_logit_softcap: None,
        attn_logit_softcap: None,
        tie_embeddings: false,
    })
}
