//! The family-neutral description of a decoder-only transformer that the shared layers run.
//! Family files (`families/`) translate a `config.json` or GGUF metadata into a `ModelSpec`;
//! nothing here reads files or knows tensor names.

use serde_json::Value;

/// Architectures accepted in `config.json` (`architectures[0]` or `model_type`) or GGUF
/// `general.architecture`, listed in error messages.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "gemma3"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma3,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Halves rotated together (`rotate_half`, HF layout; GGUF "neox" rope).
    Halves,
    /// Adjacent pairs rotated together (GGUF llama, whose q/k rows were permuted at conversion).
    Interleaved,
}

/// Frequency scaling applied to the rotary base frequencies.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Every frequency divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.x wavelength-dependent scaling.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position: f64 },
    /// Per-frequency divisors given by the weights (GGUF `rope_freqs.weight`).
    Divisors(Vec<f32>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

impl Rope {
    /// The inverse frequencies for a head of `head_dim`, as transformers computes them.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let half = head_dim / 2;
        (0..half)
            .map(|i| {
                let base = 1.0f32 / (self.theta as f32).powf((2 * i) as f32 / head_dim as f32);
                match &self.scaling {
                    RopeScaling::None => base,
                    RopeScaling::Linear { factor } => base / *factor as f32,
                    RopeScaling::Divisors(d) => base / d.get(i).copied().unwrap_or(1.0),
                    RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                        let (factor, lo, hi, old) = (*factor as f32, *low_freq_factor as f32, *high_freq_factor as f32, *original_max_position as f32);
                        let wavelen = 2.0 * std::f32::consts::PI / base;
                        let low_freq_wavelen = old / lo;
                        let high_freq_wavelen = old / hi;
                        if wavelen < high_freq_wavelen {
                            base
                        } else if wavelen > low_freq_wavelen {
                            base / factor
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * base / factor + smooth * base
                        }
                    }
                }
            })
            .collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

/// Everything the shared layers need to run a model, independent of where weights come from.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_eps: f64,
    pub rope: Rope,
    pub rope_style: RopeStyle,
    /// Rope for sliding-window layers when it differs (Gemma 3's local base frequency).
    pub local_rope: Option<Rope>,
    /// Window of the sliding-window layers, in tokens (a query sees this many, itself included).
    pub sliding_window: Option<usize>,
    /// Per layer: whether it attends only within `sliding_window`.
    pub sliding_layers: Vec<bool>,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    /// Gemma's extra norms after attention and after the MLP.
    pub sandwich_norms: bool,
    /// Added to every RMSNorm weight at load (1.0 for HF Gemma, whose norms scale by `1 + w`).
    pub norm_weight_offset: f32,
    pub activation: Activation,
    /// Multiplier for q·k (usually `1/sqrt(head_dim)`).
    pub attention_scale: f64,
    /// Multiplier applied to the token embeddings (Gemma: `sqrt(hidden_size)`).
    pub embedding_scale: Option<f64>,
    pub final_logit_softcap: Option<f64>,
    pub attn_logit_softcap: Option<f64>,
    pub tie_embeddings: bool,
}

impl ModelSpec {
    /// Rejects shapes that would make the layers index out of bounds or divide by zero.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("context_length", self.context_length),
        ];
        for (name, v) in positive {
            if v == 0 || v > 1 << 24 {
                return Err(format!("{name} = {v} is out of range"));
            }
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(format!("{} attention heads are not a multiple of {} KV heads", self.num_heads, self.num_kv_heads));
        }
        if self.head_dim % 2 != 0 {
            return Err(format!("head_dim {} is odd", self.head_dim));
        }
        if self.sliding_layers.len() != self.num_layers {
            return Err("sliding layer pattern does not cover every layer".into());
        }
        if self.sliding_layers.iter().any(|s| *s) && self.sliding_window.unwrap_or(0) == 0 {
            return Err("sliding-window layers without a window size".into());
        }
        Ok(())
    }

    pub fn rope_for_layer(&self, layer: usize) -> &Rope {
        match (&self.local_rope, self.sliding_layers.get(layer)) {
            (Some(local), Some(true)) => local,
            _ => &self.rope,
        }
    }

    pub fn window_for_layer(&self, layer: usize) -> Option<usize> {
        if self.sliding_layers.get(layer).copied().unwrap_or(false) {
            self.sliding_window
        } else {
            None
        }
    }
}

/// Reads the rope settings of an HF `config.json` in both the transformers 4.x form
/// (`rope_theta`, `rope_scaling`) and the 5.x form (`rope_parameters`, possibly per layer type).
pub fn hf_rope(config: &Value, layer_type: Option<&str>, default_theta: f64) -> Result<Rope, String> {
    let mut params = config.get("rope_parameters").filter(|v| v.is_object()).cloned();
    if let (Some(p), Some(lt)) = (&params, layer_type) {
        if let Some(per_type) = p.get(lt) {
            params = Some(per_type.clone());
        }
    }
    let theta = params
        .as_ref()
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .or_else(|| config.get("rope_theta").and_then(Value::as_f64))
        .unwrap_or(default_theta);
    let scaling_src = params.or_else(|| config.get("rope_scaling").filter(|v| v.is_object()).cloned());
    let scaling = match scaling_src {
        None => RopeScaling::None,
        Some(s) => {
            let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
            let num = |k: &str| s.get(k).and_then(Value::as_f64);
            match kind {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor: num("factor").ok_or("linear rope scaling without factor")? },
                "llama3" => RopeScaling::Llama3 {
                    factor: num("factor").ok_or("llama3 rope scaling without factor")?,
                    low_freq_factor: num("low_freq_factor").unwrap_or(1.0),
                    high_freq_factor: num("high_freq_factor").unwrap_or(4.0),
                    original_max_position: num("original_max_position_embeddings").unwrap_or(8192.0),
                },
                other => return Err(format!("unsupported rope scaling `{other}`")),
            }
        }
    };
    Ok(Rope { theta, scaling })
}
