//! Qwen2 / Qwen2.5: the Llama block with biases on the q/k/v projections.
//! The sliding-window option of Qwen2 configs (`use_sliding_window`) is off in every
//! released checkpoint and is rejected rather than half-implemented.

use serde_json::Value;

use super::{llama, GgufMeta, HfConfig};
use crate::engine::spec::{Family, ModelSpec};

pub fn from_hf(cfg: &HfConfig, raw: &Value) -> Result<ModelSpec, String> {
    if raw.get("use_sliding_window").and_then(Value::as_bool).unwrap_or(false) {
        return Err("qwen2 with use_sliding_window is not supported".into());
    }
    let mut spec = llama::from_hf(Family::Qwen2, cfg, raw)?;
    spec.qkv_bias = true;
    spec.rms_eps = cfg.rms_norm_eps.unwrap_or(1e-6);
    Ok(spec)
}

pub fn from_gguf(meta: &GgufMeta<'_>, vocab_size: usize) -> Result<ModelSpec, String> {
    let mut spec = llama::common_gguf(meta, vocab_size, Family::Qwen2)?;
    spec.qkv_bias = true;
    Ok(spec)
}
