//! Where a shard's tensors come from: a Hugging Face safetensors directory (memory-mapped,
//! possibly sharded by `model.safetensors.index.json`) or a GGUF file (tensors read by offset).
//! Tensors are named by role and layer; this file maps roles to each format's names.
//! It reads only the tensors asked for and never dequantizes quantized matrices.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use super::kernels::QMatrix;
use super::{EngineError, Result};

/// A tensor's role in a decoder layer or around the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Embed,
    FinalNorm,
    LmHead,
    RopeFreqs,
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    /// Gemma's norm after attention.
    PostAttnNorm,
    /// The norm before the MLP (`post_attention_layernorm` in HF Llama, `pre_feedforward_layernorm` in HF Gemma).
    FfnNorm,
    /// Gemma's norm after the MLP.
    PostFfnNorm,
    Gate,
    Up,
    Down,
}

/// A weight matrix for `x @ W^T`: GGUF blocks that shoal's kernels multiply (`Packed`), or
/// anything else through candle's `QMatMul` (f32, f16, other GGUF formats, non-CPU devices).
#[derive(Debug, Clone)]
pub enum Matrix {
    Packed(Arc<QMatrix>),
    Candle(QMatMul),
}

/// shoal's kernels are used unless `SHOAL_KERNELS=candle` asks for candle's (a diagnostic switch
/// for comparing the two; read once per process).
pub fn own_kernels() -> bool {
    static OWN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| std::env::var("SHOAL_KERNELS").map_or(true, |v| v != "candle"))
}

impl Matrix {
    pub(super) fn from_qtensor(q: QTensor, device: &Device) -> Result<Matrix> {
        if device.is_cpu() && own_kernels() {
            if let Some(m) = QMatrix::from_qtensor(&q).map_err(|e| EngineError::InvalidModel(e.to_string()))? {
                return Ok(Matrix::Packed(Arc::new(m)));
            }
        }
        Ok(Matrix::Candle(QMatMul::from_qtensor(q)?))
    }
}

/// An error for the first of `ids` outside a table of `rows` rows.
pub fn check_token_ids(ids: &[u32], rows: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= rows) {
        Some(bad) => Err(EngineError::InvalidRequest(format!("token id {bad} is outside the vocabulary of {rows}"))),
        None => Ok(()),
    }
}

/// An embedding table kept in its stored form; rows are materialised only for looked-up ids.
#[derive(Debug, Clone)]
pub enum EmbeddingTable {
    Dense(Tensor),
    Packed(Arc<QMatrix>),
    Quantized(Arc<QTensor>),
}

impl EmbeddingTable {
    pub fn rows(&self) -> usize {
        match self {
            EmbeddingTable::Dense(t) => t.dim(0).unwrap_or(0),
            EmbeddingTable::Packed(q) => q.rows,
            EmbeddingTable::Quantized(q) => q.shape().dims().first().copied().unwrap_or(0),
        }
    }

    /// Embeds `ids` into a `(len, hidden)` f32 tensor; ids outside the table are an error.
    pub fn lookup(&self, ids: &[u32]) -> Result<Tensor> {
        check_token_ids(ids, self.rows())?;
        let device = match self {
            EmbeddingTable::Dense(t) => t.device().clone(),
            EmbeddingTable::Packed(q) => {
                let mut out = vec![0f32; ids.len() * q.cols];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(q.cols)) {
                    q.dequantize_row(id as usize, row);
                }
                return Ok(Tensor::from_vec(out, (ids.len(), q.cols), &Device::Cpu)?);
            }
            EmbeddingTable::Quantized(q) => q.device(),
        };
        let ids_t = Tensor::new(ids, &device)?;
        Ok(match self {
            EmbeddingTable::Dense(t) => t.index_select(&ids_t, 0)?,
            EmbeddingTable::Quantized(q) => q.embedding(&ids_t)?,
            EmbeddingTable::Packed(_) => unreachable!("returned above"),
        })
    }

    /// The same table used as an output projection (tied embeddings), sharing its memory.
    pub fn as_matmul(&self) -> Matrix {
        match self {
            EmbeddingTable::Dense(t) => Matrix::Candle(QMatMul::Tensor(t.clone())),
            EmbeddingTable::Packed(q) => Matrix::Packed(q.clone()),
            EmbeddingTable::Quantized(q) => Matrix::Candle(QMatMul::QTensor(q.clone())),
        }
    }
}

/// The file formats weights can come in.
pub enum Weights {
    Safetensors { st: MmapedSafetensors, prefix: String, sandwich_norms: bool },
    Gguf { path: PathBuf, content: gguf_file::Content, sandwich_norms: bool },
}

impl Weights {
    /// Maps the safetensors files of an HF model directory (one file or an index of shards).
    pub fn open_safetensors(dir: &Path, sandwich_norms: bool) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = read_to_string(&index)?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| EngineError::InvalidModel(format!("{}: {e}", index.display())))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| EngineError::InvalidModel(format!("{}: no weight_map", index.display())))?;
            let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            // A pipeline stage's directory holds only the shards with its layers (`models::select`):
            // map those present; a tensor in a missing shard fails at `Shard::load` as missing.
            let all: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
            let present: Vec<PathBuf> = all.iter().filter(|f| f.exists()).cloned().collect();
            if present.is_empty() {
                return Err(EngineError::MissingFile { path: all.first().cloned().unwrap_or(index) });
            }
            present
        } else {
            vec![dir.join("model.safetensors")]
        };
        for f in &files {
            if !f.exists() {
                return Err(EngineError::MissingFile { path: f.clone() });
            }
        }
        // SAFETY: the files are mapped read-only; shoal never writes model files while a
        // model is loaded (the store writes new files under temporary names and renames).
        let st = unsafe { MmapedSafetensors::multi(&files) }
            .map_err(|e| EngineError::InvalidModel(format!("{}: {e}", dir.display())))?;
        let prefix = ["model.", "model.language_model.", "language_model.model."]
            .into_iter()
            .find(|p| st.get(&format!("{p}embed_tokens.weight")).is_ok() || st.tensors().iter().any(|(name, _)| name.starts_with(&format!("{p}layers."))))
            .unwrap_or("model.")
            .to_string();
        Ok(Weights::Safetensors { st, prefix, sandwich_norms })
    }

    /// Reads a GGUF header and checks that every tensor lies inside the file.
    pub fn open_gguf(path: &Path, sandwich_norms: bool) -> Result<Self> {
        let content = read_gguf_header(path)?;
        Ok(Weights::Gguf { path: path.to_path_buf(), content, sandwich_norms })
    }

    pub fn set_sandwich_norms(&mut self, value: bool) {
        match self {
            Weights::Safetensors { sandwich_norms, .. } | Weights::Gguf { sandwich_norms, .. } => *sandwich_norms = value,
        }
    }

    /// The format-specific name of a tensor.
    pub fn name(&self, role: Role, layer: usize) -> String {
        match self {
            Weights::Safetensors { prefix, sandwich_norms, .. } => {
                let l = format!("{prefix}layers.{layer}.");
                match role {
                    Role::Embed => format!("{prefix}embed_tokens.weight"),
                    Role::FinalNorm => format!("{prefix}norm.weight"),
                    Role::LmHead => {
                        // Multimodal checkpoints keep the head beside the language model.
                        if prefix.starts_with("language_model") { "language_model.lm_head.weight".into() } else { "lm_head.weight".into() }
                    }
                    Role::RopeFreqs => "rope_freqs.weight".into(),
                    Role::AttnNorm => format!("{l}input_layernorm.weight"),
                    Role::Q => format!("{l}self_attn.q_proj.weight"),
                    Role::K => format!("{l}self_attn.k_proj.weight"),
                    Role::V => format!("{l}self_attn.v_proj.weight"),
                    Role::O => format!("{l}self_attn.o_proj.weight"),
                    Role::QBias => format!("{l}self_attn.q_proj.bias"),
                    Role::KBias => format!("{l}self_attn.k_proj.bias"),
                    Role::VBias => format!("{l}self_attn.v_proj.bias"),
                    Role::QNorm => format!("{l}self_attn.q_norm.weight"),
                    Role::KNorm => format!("{l}self_attn.k_norm.weight"),
                    Role::PostAttnNorm => format!("{l}post_attention_layernorm.weight"),
                    Role::FfnNorm if *sandwich_norms => format!("{l}pre_feedforward_layernorm.weight"),
                    Role::FfnNorm => format!("{l}post_attention_layernorm.weight"),
                    Role::PostFfnNorm => format!("{l}post_feedforward_layernorm.weight"),
                    Role::Gate => format!("{l}mlp.gate_proj.weight"),
                    Role::Up => format!("{l}mlp.up_proj.weight"),
                    Role::Down => format!("{l}mlp.down_proj.weight"),
                }
            }
            Weights::Gguf { .. } => gguf_name(role, layer),
        }
    }

    pub fn contains(&self, role: Role, layer: usize) -> bool {
        let name = self.name(role, layer);
        match self {
            Weights::Safetensors { st, .. } => st.get(&name).is_ok(),
            Weights::Gguf { content, .. } => content.tensor_infos.contains_key(&name),
        }
    }

    /// Shape of a tensor in PyTorch order (rows first), without reading its data.
    pub fn shape(&self, role: Role, layer: usize) -> Result<Vec<usize>> {
        let name = self.name(role, layer);
        match self {
            Weights::Safetensors { st, .. } => Ok(st.get(&name).map_err(|_| EngineError::MissingTensor(name))?.shape().to_vec()),
            Weights::Gguf { content, .. } => {
                let info = content.tensor_infos.get(&name).ok_or(EngineError::MissingTensor(name))?;
                Ok(info.shape.dims().to_vec())
            }
        }
    }

    /// Bytes a tensor occupies in its file (0 when absent), read from headers only.
    pub fn stored_bytes(&self, role: Role, layer: usize) -> u64 {
        let name = self.name(role, layer);
        match self {
            Weights::Safetensors { st, .. } => st.get(&name).map(|v| v.data().len() as u64).unwrap_or(0),
            Weights::Gguf { content, .. } => content
                .tensor_infos
                .get(&name)
                .map(|i| (i.shape.elem_count() / i.ggml_dtype.block_size() * i.ggml_dtype.type_size()) as u64)
                .unwrap_or(0),
        }
    }

    fn read_qtensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        match self {
            Weights::Gguf { path, content, .. } => {
                if !content.tensor_infos.contains_key(name) {
                    return Err(EngineError::MissingTensor(name.to_string()));
                }
                let mut file = open(path)?;
                content
                    .tensor(&mut file, name, device)
                    .map_err(|e| EngineError::InvalidModel(format!("{}: tensor `{name}`: {e}", path.display())))
            }
            Weights::Safetensors { .. } => unreachable!("only called for GGUF weights"),
        }
    }

    pub(super) fn read_dense(&self, name: &str, device: &Device) -> Result<Tensor> {
        match self {
            Weights::Safetensors { st, .. } => {
                let view = st.get(name).map_err(|_| EngineError::MissingTensor(name.to_string()))?;
                let t = candle_core::safetensors::Load::load(&view, device)
                    .map_err(|e| EngineError::InvalidModel(format!("tensor `{name}`: {e}")))?;
                // One dtype for every dense tensor: f32 on the CPU (bf16/f16 widened once here),
                // the checkpoint's own half type on a GPU.
                Ok(t.to_dtype(self.compute_dtype(device))?)
            }
            Weights::Gguf { .. } => Ok(self.read_qtensor(name, device)?.dequantize(device)?),
        }
    }

    /// The dtype of activations and dense tensors on `device` (see `device::compute_dtype`): the
    /// embedding's stored type decides for safetensors; GGUF computes in f32 (quantized matmuls
    /// take f32 input).
    pub fn compute_dtype(&self, device: &Device) -> DType {
        super::device::compute_dtype(device, self.dense_dtype())
    }

    /// The dtype of the KV cache and attention's products on `device` (see `device::cache_dtype`).
    pub fn cache_dtype(&self, device: &Device) -> DType {
        super::device::cache_dtype(device, self.dense_dtype(), self.quantized())
    }

    /// GGUF weights: quantized matrices, multiplied by f32 activations.
    pub fn quantized(&self) -> bool {
        matches!(self, Weights::Gguf { .. })
    }

    /// The stored type of dense weights: the embedding's for safetensors; f32 for GGUF (its
    /// quantized matrices stay as they are, the rest is dequantized to f32).
    fn dense_dtype(&self) -> DType {
        match self {
            Weights::Safetensors { st, .. } => st.get(&self.name(Role::Embed, 0)).ok().and_then(|v| DType::try_from(v.dtype()).ok()).unwrap_or(DType::F32),
            Weights::Gguf { .. } => DType::F32,
        }
    }

    /// Whether dense weights are stored in half precision, so that a CPU holds them at twice
    /// their stored bytes and a GPU keeps them (and the KV cache) at half width.
    pub fn dense_half(&self) -> bool {
        matches!(self.dense_dtype(), DType::F16 | DType::BF16)
    }

    /// A weight matrix for `x @ W^T`, quantized blocks kept as they are.
    pub fn matmul(&self, role: Role, layer: usize, device: &Device) -> Result<Matrix> {
        let name = self.name(role, layer);
        match self {
            Weights::Safetensors { .. } => Ok(Matrix::Candle(QMatMul::Tensor(self.read_dense(&name, device)?))),
            Weights::Gguf { .. } => Matrix::from_qtensor(self.read_qtensor(&name, device)?, device),
        }
    }

    /// Any tensor as a dense `dtype` tensor on `device` (quantized ones dequantized).
    pub fn dense_on(&self, role: Role, layer: usize, device: &Device, dtype: DType) -> Result<Tensor> {
        let name = self.name(role, layer);
        let t = match self {
            Weights::Safetensors { st, .. } => {
                let view = st.get(&name).map_err(|_| EngineError::MissingTensor(name.clone()))?;
                candle_core::safetensors::Load::load(&view, device).map_err(|e| EngineError::InvalidModel(format!("tensor `{name}`: {e}")))?
            }
            Weights::Gguf { .. } => self.read_qtensor(&name, device)?.dequantize(device)?,
        };
        Ok(t.to_dtype(dtype)?)
    }

    /// A small tensor (norm weight, bias) as f32.
    pub fn vector(&self, role: Role, layer: usize, device: &Device) -> Result<Tensor> {
        self.read_dense(&self.name(role, layer), device)
    }

    pub fn embedding(&self, device: &Device) -> Result<EmbeddingTable> {
        let name = self.name(Role::Embed, 0);
        match self {
            Weights::Safetensors { .. } => Ok(EmbeddingTable::Dense(self.read_dense(&name, device)?)),
            Weights::Gguf { .. } => {
                let q = self.read_qtensor(&name, device)?;
                let hidden = q.shape().dims().get(1).copied().unwrap_or(0);
                let float = matches!(q.dtype(), candle_core::quantized::GgmlDType::F32 | candle_core::quantized::GgmlDType::F16 | candle_core::quantized::GgmlDType::BF16);
                if float || hidden % q.dtype().block_size() != 0 {
                    Ok(EmbeddingTable::Dense(q.dequantize(device)?))
                } else if let (true, Some(m)) = (device.is_cpu() && own_kernels(), QMatrix::from_qtensor(&q).map_err(|e| EngineError::InvalidModel(e.to_string()))?) {
                    Ok(EmbeddingTable::Packed(Arc::new(m)))
                } else {
                    Ok(EmbeddingTable::Quantized(Arc::new(q)))
                }
            }
        }
    }

    /// GGUF metadata, or an empty map for safetensors.
    pub fn gguf_metadata(&self) -> Option<&HashMap<String, gguf_file::Value>> {
        match self {
            Weights::Gguf { content, .. } => Some(&content.metadata),
            Weights::Safetensors { .. } => None,
        }
    }
}

/// A tensor's name in GGUF files (llama.cpp's names).
pub fn gguf_name(role: Role, layer: usize) -> String {
    let l = format!("blk.{layer}.");
    match role {
        Role::Embed => "token_embd.weight".into(),
        Role::FinalNorm => "output_norm.weight".into(),
        Role::LmHead => "output.weight".into(),
        Role::RopeFreqs => "rope_freqs.weight".into(),
        Role::AttnNorm => format!("{l}attn_norm.weight"),
        Role::Q => format!("{l}attn_q.weight"),
        Role::K => format!("{l}attn_k.weight"),
        Role::V => format!("{l}attn_v.weight"),
        Role::O => format!("{l}attn_output.weight"),
        Role::QBias => format!("{l}attn_q.bias"),
        Role::KBias => format!("{l}attn_k.bias"),
        Role::VBias => format!("{l}attn_v.bias"),
        Role::QNorm => format!("{l}attn_q_norm.weight"),
        Role::KNorm => format!("{l}attn_k_norm.weight"),
        Role::PostAttnNorm => format!("{l}post_attention_norm.weight"),
        Role::FfnNorm => format!("{l}ffn_norm.weight"),
        Role::PostFfnNorm => format!("{l}post_ffw_norm.weight"),
        Role::Gate => format!("{l}ffn_gate.weight"),
        Role::Up => format!("{l}ffn_up.weight"),
        Role::Down => format!("{l}ffn_down.weight"),
    }
}

pub(super) fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => EngineError::MissingFile { path: path.to_path_buf() },
        _ => EngineError::Io { path: path.to_path_buf(), source: e },
    })
}

pub(crate) fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => EngineError::MissingFile { path: path.to_path_buf() },
        _ => EngineError::Io { path: path.to_path_buf(), source: e },
    })
}

/// Parses a GGUF header and rejects files whose tensors would reach past the end.
pub fn read_gguf_header(path: &Path) -> Result<gguf_file::Content> {
    let mut file = open(path)?;
    let len = file.metadata().map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e })?.len();
    let content = gguf_file::Content::read(&mut file)
        .map_err(|e| EngineError::InvalidModel(format!("{}: not a readable GGUF file: {e}", path.display())))?;
    for (name, info) in &content.tensor_infos {
        let elems = info.shape.elem_count();
        let block = info.ggml_dtype.block_size();
        if elems % block != 0 {
            return Err(EngineError::InvalidModel(format!("{}: tensor `{name}` has {elems} elements, not a multiple of its block size", path.display())));
        }
        let bytes = (elems / block) as u128 * info.ggml_dtype.type_size() as u128;
        let end = content.tensor_data_offset as u128 + info.offset as u128 + bytes;
        if end > len as u128 {
            return Err(EngineError::InvalidModel(format!(
                "{}: tensor `{name}` ends at byte {end} but the file has {len} bytes (truncated download?)",
                path.display()
            )));
        }
    }
    Ok(content)
}
