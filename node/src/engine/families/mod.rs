//! Model families: each file turns a family's `config.json` or GGUF metadata into the
//! shared `ModelSpec` (with the family's quirks) that `layers` runs. Detection of the family
//! from either source lives here; no file here reads tensors or computes anything.

pub mod gemma3;
pub mod llama;
pub mod qwen2;
pub mod qwen3;

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value as GgufValue;
use serde::Deserialize;
use serde_json::Value;

use super::spec::{Family, ModelSpec};
use super::EngineError;

/// The `config.json` fields every supported family shares (names as transformers writes them).
#[derive(Debug, Clone, Deserialize)]
pub struct HfConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    pub max_position_embeddings: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub tie_word_embeddings: Option<bool>,
    pub hidden_act: Option<String>,
    pub hidden_activation: Option<String>,
    pub attention_bias: Option<bool>,
    pub sliding_window: Option<usize>,
}

impl HfConfig {
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }
}

/// Picks the family named by an HF `config.json` and builds its spec.
pub fn spec_from_hf_config(raw: &Value) -> Result<ModelSpec, EngineError> {
    // Multimodal Gemma 3 checkpoints nest the language model's settings.
    let model_type = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
    let arch = raw.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str).unwrap_or("");
    let text = match raw.get("text_config") {
        Some(t) if model_type == "gemma3" => t,
        _ => raw,
    };
    let family = match (model_type, arch) {
        ("llama", _) | (_, "LlamaForCausalLM") => Family::Llama,
        ("mistral", _) | (_, "MistralForCausalLM") => Family::Mistral,
        ("qwen2", _) | (_, "Qwen2ForCausalLM") => Family::Qwen2,
        ("qwen3", _) | (_, "Qwen3ForCausalLM") => Family::Qwen3,
        ("gemma3" | "gemma3_text", _) | (_, "Gemma3ForCausalLM" | "Gemma3ForConditionalGeneration") => Family::Gemma3,
        _ => {
            let found = if model_type.is_empty() { arch } else { model_type };
            return Err(EngineError::UnsupportedArchitecture { found: if found.is_empty() { "(none given)".into() } else { found.into() } });
        }
    };
    let cfg: HfConfig = serde_json::from_value(text.clone()).map_err(|e| EngineError::InvalidModel(format!("config.json: {e}")))?;
    let spec = match family {
        Family::Llama | Family::Mistral => llama::from_hf(family, &cfg, text),
        Family::Qwen2 => qwen2::from_hf(&cfg, text),
        Family::Qwen3 => qwen3::from_hf(&cfg, text),
        Family::Gemma3 => gemma3::from_hf(&cfg, text),
    }
    .map_err(|e| EngineError::InvalidModel(format!("config.json: {e}")))?;
    spec.validate().map_err(|e| EngineError::InvalidModel(format!("config.json: {e}")))?;
    Ok(spec)
}

/// Picks the family named by GGUF `general.architecture` and builds its spec.
/// `vocab_size` comes from the embedding tensor's shape.
pub fn spec_from_gguf(md: &HashMap<String, GgufValue>, vocab_size: usize) -> Result<ModelSpec, EngineError> {
    let meta = GgufMeta::new(md)?;
    let spec = match meta.arch.as_str() {
        "llama" | "mistral" => llama::from_gguf(&meta, vocab_size),
        "qwen2" => qwen2::from_gguf(&meta, vocab_size),
        "qwen3" => qwen3::from_gguf(&meta, vocab_size),
        "gemma3" => gemma3::from_gguf(&meta, vocab_size),
        other => return Err(EngineError::UnsupportedArchitecture { found: other.to_string() }),
    }
    .map_err(|e| EngineError::InvalidModel(format!("gguf metadata: {e}")))?;
    spec.validate().map_err(|e| EngineError::InvalidModel(format!("gguf metadata: {e}")))?;
    Ok(spec)
}

pub fn hf_activation(cfg: &HfConfig) -> Result<super::spec::Activation, String> {
    match cfg.hidden_activation.as_deref().or(cfg.hidden_act.as_deref()).unwrap_or("silu") {
        "silu" | "swish" => Ok(super::spec::Activation::Silu),
        "gelu_pytorch_tanh" | "gelu_tanh" => Ok(super::spec::Activation::GeluTanh),
        other => Err(format!("unsupported activation `{other}`")),
    }
}

/// Typed access to `<arch>.<key>` GGUF metadata.
pub struct GgufMeta<'a> {
    pub md: &'a HashMap<String, GgufValue>,
    pub arch: String,
}

impl<'a> GgufMeta<'a> {
    pub fn new(md: &'a HashMap<String, GgufValue>) -> Result<Self, EngineError> {
        let arch = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .ok_or_else(|| EngineError::InvalidModel("gguf metadata has no general.architecture".into()))?;
        Ok(GgufMeta { md, arch })
    }

    fn get(&self, key: &str) -> Option<&GgufValue> {
        self.md.get(&format!("{}.{key}", self.arch))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => Ok(Some(value_usize(v).map_err(|e| format!("{}.{key}: {e}", self.arch))?)),
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize, String> {
        self.opt_usize(key)?.ok_or_else(|| format!("missing {}.{key}", self.arch))
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => Ok(Some(value_f64(v).map_err(|e| format!("{}.{key}: {e}", self.arch))?)),
        }
    }

    pub fn opt_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(|v| v.to_string().ok()).map(String::as_str)
    }
}

fn value_usize(v: &GgufValue) -> Result<usize, String> {
    let n: i128 = match v {
        GgufValue::U8(x) => *x as i128,
        GgufValue::I8(x) => *x as i128,
        GgufValue::U16(x) => *x as i128,
        GgufValue::I16(x) => *x as i128,
        GgufValue::U32(x) => *x as i128,
        GgufValue::I32(x) => *x as i128,
        GgufValue::U64(x) => *x as i128,
        GgufValue::I64(x) => *x as i128,
        // Some converters store a per-layer array (e.g. head counts); use it only when uniform.
        GgufValue::Array(a) => {
            let vals = a.iter().map(value_usize).collect::<Result<Vec<_>, _>>()?;
            match vals.first() {
                Some(first) if vals.iter().all(|x| x == first) => *first as i128,
                _ => return Err("per-layer values differ".into()),
            }
        }
        _ => return Err("expected an integer".into()),
    };
    usize::try_from(n).map_err(|_| format!("{n} is out of range"))
}

fn value_f64(v: &GgufValue) -> Result<f64, String> {
    match v {
        GgufValue::F32(x) => Ok(*x as f64),
        GgufValue::F64(x) => Ok(*x),
        other => value_usize(other).map(|x| x as f64),
    }
}
