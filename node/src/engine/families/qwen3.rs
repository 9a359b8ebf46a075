//! Qwen3: the Llama block with per-head RMSNorm on queries and keys (before rotary),
//! an explicit head_dim, and no q/k/v biases.

use serde_json::Value;

use super::{llama, GgufMeta, HfConfig};
use crate::engine::spec::{Family, ModelSpec};

pub fn from_hf(cfg: &HfConfig, raw: &Value) -> Result<ModelSpec, String> {
    let mut spec = llama::from_hf(Family::Qwen3, cfg, raw)?;
    spec.qk_norm = true;
    spec.rms_eps = cfg.rms_norm_eps.unwrap_or(1e-6);
    Ok(spec)
}

pub fn from_gguf(meta: &GgufMeta<'_>, vocab_size: usize) -> Result<ModelSpec, String> {
    let mut spec = llama::common_gguf(meta, vocab_size, Family::Qwen3)?;
    spec.qk_norm = true;
    Ok(spec)
}
