//! Opening a model from disk: a GGUF file or an HF directory becomes a `ModelSource`
//! (weights + spec), from which shards and the text codec are loaded. `LoadedModel` is the
//! single-node case: the text codec plus one shard spanning every layer (or a given range).

use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::Device;

use super::device::ComputeDevice;
use super::families::{spec_from_gguf, spec_from_hf_config};
use super::shard::{LayerRange, Shard};
use super::spec::{ModelSpec, RopeScaling};
use super::text::TextCodec;
use super::weights::{read_to_string, Role, Weights};
use super::{EngineError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    Gguf,
    Safetensors,
}

/// Weights and spec of a model on disk, before any tensor is read.
pub struct ModelSource {
    pub path: PathBuf,
    pub format: WeightFormat,
    pub weights: Weights,
    pub spec: ModelSpec,
    hf_config: Option<serde_json::Value>,
}

impl ModelSource {
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(EngineError::MissingFile { path: path.to_path_buf() });
        }
        let path = resolve(path)?;
        if path.is_dir() {
            let cfg_path = path.join("config.json");
            let raw: serde_json::Value = serde_json::from_str(&read_to_string(&cfg_path)?)
                .map_err(|e| EngineError::InvalidModel(format!("{}: {e}", cfg_path.display())))?;
            let spec = spec_from_hf_config(&raw)?;
            let weights = Weights::open_safetensors(&path, spec.sandwich_norms)?;
            Ok(ModelSource { path, format: WeightFormat::Safetensors, weights, spec, hf_config: Some(raw) })
        } else {
            let mut weights = Weights::open_gguf(&path, false)?;
            let md = weights.gguf_metadata().expect("gguf weights carry metadata");
            let vocab = weights.shape(Role::Embed, 0)?.first().copied().ok_or_else(|| EngineError::InvalidModel("token_embd.weight has no rows".into()))?;
            let mut spec = spec_from_gguf(md, vocab)?;
            weights.set_sandwich_norms(spec.sandwich_norms);
            if weights.contains(Role::RopeFreqs, 0) {
                let divisors = weights.vector(Role::RopeFreqs, 0, &Device::Cpu)?.to_vec1::<f32>()?;
                spec.rope.scaling = RopeScaling::Divisors(divisors);
            }
            Ok(ModelSource { path, format: WeightFormat::Gguf, weights, spec, hf_config: None })
        }
    }

    pub fn load_shard(&self, range: LayerRange, device: &Device) -> Result<Shard> {
        Shard::load(&self.weights, &self.spec, range, device)
    }

    pub fn load_text(&self) -> Result<TextCodec> {
        match (&self.format, &self.hf_config) {
            (WeightFormat::Safetensors, Some(cfg)) => TextCodec::for_hf_dir(&self.path, cfg),
            _ => TextCodec::for_gguf(&self.path, self.weights.gguf_metadata().expect("gguf weights carry metadata")),
        }
    }

    /// Bytes of weights per decoder layer (the largest layer), of the embedding table and of
    /// the head (final norm plus LM head, or the embedding again when tied), from tensor headers.
    pub fn footprint_bytes(&self) -> (u64, u64, u64) {
        let layer_roles = [Role::AttnNorm, Role::Q, Role::K, Role::V, Role::O, Role::QBias, Role::KBias, Role::VBias, Role::QNorm, Role::KNorm, Role::PostAttnNorm, Role::FfnNorm, Role::PostFfnNorm, Role::Gate, Role::Up, Role::Down];
        // Roles may name one tensor twice (a non-sandwich model's FFN norm is its post-attention norm).
        let layer_bytes = |l: usize| {
            let tensors: std::collections::BTreeMap<String, Role> = layer_roles.iter().map(|r| (self.weights.name(*r, l), *r)).collect();
            tensors.values().map(|r| self.weights.stored_bytes(*r, l)).sum::<u64>()
        };
        let per_layer = (0..self.spec.num_layers).map(layer_bytes).max().unwrap_or(0);
        let embedding = self.weights.stored_bytes(Role::Embed, 0);
        let head = self.weights.stored_bytes(Role::FinalNorm, 0) + if self.weights.contains(Role::LmHead, 0) && !self.spec.tie_embeddings { self.weights.stored_bytes(Role::LmHead, 0) } else { embedding };
        (per_layer, embedding, head)
    }

    /// Memory each layer's KV cache takes at the positions placement reserves for this model
    /// served with `context_limit` (`cache::RESERVED_POSITIONS` at most).
    pub fn kv_reserve_per_layer(&self, context_limit: Option<usize>) -> u64 {
        let positions = self.spec.context_length.min(context_limit.unwrap_or(usize::MAX)).min(super::cache::RESERVED_POSITIONS);
        super::cache::reserved_bytes(self.spec.num_kv_heads, self.spec.head_dim, positions)
    }

    /// The model's id, by the one rule in `models::id` (the directory's whole name, or the
    /// file stem of a loose GGUF).
    pub fn name(&self) -> String {
        crate::models::id::model_id(&self.path)
    }
}

/// A model file or directory given by the user → the GGUF file or HF directory to open.
fn resolve(path: &Path) -> Result<PathBuf> {
    if path.is_dir() {
        if path.join("config.json").exists() {
            return Ok(path.to_path_buf());
        }
        let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().map(|x| x == "gguf").unwrap_or(false))
            .collect();
        return match ggufs.as_slice() {
            [one] => Ok(one.clone()),
            [] => Err(EngineError::InvalidModel(format!("{}: neither config.json nor a .gguf file inside", path.display()))),
            _ => Err(EngineError::InvalidModel(format!("{}: several .gguf files inside; name one", path.display()))),
        };
    }
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e })?;
    if f.read_exact(&mut magic).is_ok() && &magic == b"GGUF" {
        return Ok(path.to_path_buf());
    }
    if path.extension().map(|x| x == "safetensors").unwrap_or(false) {
        if let Some(dir) = path.parent() {
            return Ok(dir.to_path_buf());
        }
    }
    Err(EngineError::InvalidModel(format!("{}: not a GGUF file (bad magic) nor a model directory", path.display())))
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Layers to load; all of them when `None`.
    pub range: Option<LayerRange>,
    pub device: ComputeDevice,
    /// Caps the context window below the model's own (memory for the KV cache grows with it).
    pub context_limit: Option<usize>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { range: None, device: ComputeDevice::cpu(), context_limit: None }
    }
}

/// A model ready to generate on one node.
pub struct LoadedModel {
    pub name: String,
    pub path: PathBuf,
    pub format: WeightFormat,
    pub spec: ModelSpec,
    pub shard: Shard,
    pub text: TextCodec,
}

impl LoadedModel {
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        let mut source = ModelSource::open(path)?;
        if let Some(limit) = opts.context_limit {
            if limit == 0 {
                return Err(EngineError::InvalidRequest("the context limit must be at least 1 token".into()));
            }
            source.spec.context_length = source.spec.context_length.min(limit);
        }
        let range = opts.range.unwrap_or(LayerRange::full(source.spec.num_layers));
        let text = source.load_text()?;
        let shard = source.load_shard(range, opts.device.candle())?;
        Ok(LoadedModel { name: source.name(), path: source.path.clone(), format: source.format, spec: source.spec.clone(), shard, text })
    }
}
