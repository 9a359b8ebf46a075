//! `shoal models quantize`: turns a Hugging Face safetensors model (llama, mistral, qwen2, qwen3)
//! into a GGUF file that shoal (and llama.cpp's tensor layout) reads, quantized as Q4_K_M (Q4_K
//! matrices, Q6_K for the LM head and for attn_v/ffn_down in llama.cpp's "more bits" layers),
//! Q8_0 or F16; norms and biases stay f32. Tensors, and chunks of a large matrix's rows, are
//! quantized in parallel.
//! The tokenizer is not embedded: `tokenizer.json` is copied beside the GGUF (shoal's store
//! layout), and BOS/EOS and the chat template go into the metadata. It does not handle Gemma 3
//! (its GGUF norms differ) or re-quantize GGUF input.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::model::{ModelSource, WeightFormat};
use super::spec::{Family, Rope, RopeScaling};
use super::weights::{gguf_name, Role};
use super::{EngineError, Result};

/// The quantization a GGUF is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    Q4KM,
    Q8_0,
    F16,
}

impl FromStr for QuantKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "q4_k_m" | "q4km" | "q4_k" => Ok(QuantKind::Q4KM),
            "q8_0" | "q8" => Ok(QuantKind::Q8_0),
            "f16" => Ok(QuantKind::F16),
            _ => Err(format!("`{s}`: use q4_k_m, q8_0 or f16")),
        }
    }
}

impl QuantKind {
    pub fn name(self) -> &'static str {
        match self {
            QuantKind::Q4KM => "q4_k_m",
            QuantKind::Q8_0 => "q8_0",
            QuantKind::F16 => "f16",
        }
    }

    /// llama.cpp's `general.file_type` numbers.
    fn file_type(self) -> u32 {
        match self {
            QuantKind::Q4KM => 15,
            QuantKind::Q8_0 => 7,
            QuantKind::F16 => 1,
        }
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct QuantizeReport {
    pub gguf: PathBuf,
    pub tensors: usize,
    pub bytes: u64,
}

/// Quantizes the model directory `src` into `dst/model.gguf` (+ `dst/tokenizer.json`).
pub fn quantize_hf_dir(src: &Path, dst: &Path, kind: QuantKind) -> Result<QuantizeReport> {
    let source = ModelSource::open(src)?;
    if source.format != WeightFormat::Safetensors {
        return Err(EngineError::InvalidRequest(format!("{}: quantize takes a Hugging Face safetensors directory", src.display())));
    }
    let spec = &source.spec;
    let arch = match spec.family {
        Family::Llama | Family::Mistral => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Gemma3 => return Err(EngineError::InvalidRequest("quantizing gemma3 is not supported (its GGUF norms differ)".into())),
    };

    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(source.name())),
        ("general.file_type".into(), Value::U32(kind.file_type())),
        (format!("{arch}.block_count"), Value::U32(spec.num_layers as u32)),
        (format!("{arch}.context_length"), Value::U32(spec.context_length as u32)),
        (format!("{arch}.embedding_length"), Value::U32(spec.hidden_size as u32)),
        (format!("{arch}.feed_forward_length"), Value::U32(spec.intermediate_size as u32)),
        (format!("{arch}.attention.head_count"), Value::U32(spec.num_heads as u32)),
        (format!("{arch}.attention.head_count_kv"), Value::U32(spec.num_kv_heads as u32)),
        (format!("{arch}.attention.key_length"), Value::U32(spec.head_dim as u32)),
        (format!("{arch}.attention.value_length"), Value::U32(spec.head_dim as u32)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(spec.rms_eps as f32)),
        (format!("{arch}.rope.freq_base"), Value::F32(spec.rope.theta as f32)),
    ];
    match &spec.rope.scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            metadata.push((format!("{arch}.rope.scaling.type"), Value::String("linear".into())));
            metadata.push((format!("{arch}.rope.scaling.factor"), Value::F32(*factor as f32)));
        }
        // Llama 3 scaling (and divisors read from a GGUF) travel as llama.cpp's `rope_freqs.weight`.
        RopeScaling::Llama3 { .. } | RopeScaling::Divisors(_) => {}
    }
    let rope_divisors: Option<Vec<f32>> = match &spec.rope.scaling {
        RopeScaling::Llama3 { .. } | RopeScaling::Divisors(_) => {
            let base = Rope { theta: spec.rope.theta, scaling: RopeScaling::None }.inv_freq(spec.head_dim);
            Some(base.iter().zip(spec.rope.inv_freq(spec.head_dim)).map(|(b, s)| b / s).collect())
        }
        _ => None,
    };
    if let Some(w) = spec.sliding_window.filter(|_| arch == "llama") {
        metadata.push((format!("{arch}.attention.sliding_window"), Value::U32(w as u32)));
    }
    // Without tokenizer.json (test fixtures) the GGUF carries no tokenizer keys.
    let tokenizer = source.path.join("tokenizer.json");
    if tokenizer.exists() {
        metadata.extend(source.load_text()?.gguf_metadata());
    }

    // Every tensor the engine reads, with its GGUF name and target type.
    let mut jobs: Vec<(Role, usize)> = vec![(Role::Embed, 0), (Role::FinalNorm, 0)];
    let separate_head = source.weights.contains(Role::LmHead, 0) && !spec.tie_embeddings;
    if separate_head {
        jobs.push((Role::LmHead, 0));
    }
    let layer_roles = [Role::AttnNorm, Role::Q, Role::K, Role::V, Role::O, Role::QBias, Role::KBias, Role::VBias, Role::QNorm, Role::KNorm, Role::FfnNorm, Role::Gate, Role::Up, Role::Down];
    for layer in 0..spec.num_layers {
        for role in layer_roles {
            if source.weights.contains(role, layer) {
                jobs.push((role, layer));
            }
        }
    }
    let layers = spec.num_layers;
    let rope_permute = arch == "llama";
    let (heads, kv_heads) = (spec.num_heads, spec.num_kv_heads);
    let tensors: Vec<(String, QTensor)> = jobs
        .par_iter()
        .map(|&(role, layer)| -> Result<(String, QTensor)> {
            let mut t = source.weights.dense_on(role, layer, &Device::Cpu, DType::F32)?;
            // llama.cpp stores llama q/k rows so that rope pairs adjacent dimensions.
            if rope_permute && matches!(role, Role::Q | Role::K) {
                t = permute_for_interleaved_rope(&t, if role == Role::Q { heads } else { kv_heads })?;
            }
            let dtype = target_type(kind, role, layer, layers, t.dims(), !separate_head);
            Ok((gguf_name(role, layer), quantize_rows(&t, dtype, CHUNK_VALUES)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut tensors = tensors;
    if let Some(d) = rope_divisors {
        let n = d.len();
        tensors.push((gguf_name(Role::RopeFreqs, 0), QTensor::quantize(&Tensor::from_vec(d, n, &Device::Cpu)?, GgmlDType::F32)?));
    }

    std::fs::create_dir_all(dst).map_err(|e| EngineError::Io { path: dst.to_path_buf(), source: e })?;
    let gguf = dst.join("model.gguf");
    let partial = dst.join("model.gguf.part");
    let io = |e: std::io::Error| EngineError::Io { path: partial.clone(), source: e };
    {
        let mut file = std::io::BufWriter::new(std::fs::File::create(&partial).map_err(io)?);
        let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        candle_core::quantized::gguf_file::write(&mut file, &md, &ts)?;
        std::io::Write::flush(&mut file).map_err(io)?;
    }
    std::fs::rename(&partial, &gguf).map_err(io)?;
    if tokenizer.exists() {
        std::fs::copy(&tokenizer, dst.join("tokenizer.json")).map_err(|e| EngineError::Io { path: tokenizer, source: e })?;
    }
    let bytes = std::fs::metadata(&gguf).map(|m| m.len()).unwrap_or(0);
    Ok(QuantizeReport { gguf, tensors: tensors.len(), bytes })
}

/// Values a task quantizes at most (whole rows; a matrix of fewer rows is one task).
const CHUNK_VALUES: usize = 1 << 20;

/// `t` quantized to `dtype` as `QTensor::quantize` does it, with its rows in chunks of about
/// `chunk_values` quantized in parallel: blocks never span rows, so the bytes are the same, and an
/// embedding table or LM head (hundreds of millions of values) no longer keeps one thread busy
/// long after the other tensors are done.
fn quantize_rows(t: &Tensor, dtype: GgmlDType, chunk_values: usize) -> Result<QTensor> {
    let dims = t.dims().to_vec();
    let cols = dims.last().copied().unwrap_or(0);
    let rows = t.elem_count() / cols.max(1);
    let chunk_rows = (chunk_values / cols.max(1)).max(1);
    if rows <= chunk_rows || cols % dtype.block_size() != 0 {
        return Ok(QTensor::quantize(t, dtype)?);
    }
    let matrix = t.reshape((rows, cols))?;
    let starts: Vec<usize> = (0..rows).step_by(chunk_rows).collect();
    let parts = starts
        .into_par_iter()
        .map(|r0| -> Result<Vec<u8>> {
            let n = chunk_rows.min(rows - r0);
            // A tensor of its own: `QTensor::quantize` reads its input's storage from the start,
            // whatever the view's offset.
            let values = matrix.narrow(0, r0, n)?.flatten_all()?.to_vec1::<f32>()?;
            let part = QTensor::quantize(&Tensor::from_vec(values, (n, cols), &Device::Cpu)?, dtype)?;
            Ok(part.data()?.into_owned())
        })
        .collect::<Result<Vec<_>>>()?;
    let storage = QStorage::from_data(Cow::Owned(parts.concat()), &Device::Cpu, dtype)?;
    Ok(QTensor::new(storage, dims)?)
}

/// llama.cpp's Q4_K_M mix: vectors f32; the LM head Q6_K, and so the embedding table where it is
/// also the head (tied embeddings, as llama.cpp quantizes a table it finds no `output.weight`
/// beside); attn_v and ffn_down Q6_K in the first and last eighth of the layers and every third
/// layer between; other matrices Q4_K. A matrix whose rows do not split into whole blocks falls
/// back to Q8_0, then F16.
fn target_type(kind: QuantKind, role: Role, layer: usize, layers: usize, dims: &[usize], embed_is_head: bool) -> GgmlDType {
    if dims.len() < 2 {
        return GgmlDType::F32;
    }
    let cols = dims[dims.len() - 1];
    let wanted = match kind {
        QuantKind::F16 => GgmlDType::F16,
        QuantKind::Q8_0 => GgmlDType::Q8_0,
        QuantKind::Q4KM => {
            let more_bits = layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
            match role {
                Role::LmHead => GgmlDType::Q6K,
                Role::Embed if embed_is_head => GgmlDType::Q6K,
                Role::V | Role::Down if more_bits => GgmlDType::Q6K,
                _ => GgmlDType::Q4K,
            }
        }
    };
    [wanted, GgmlDType::Q8_0, GgmlDType::F16].into_iter().find(|d| cols % d.block_size() == 0).unwrap_or(GgmlDType::F16)
}

/// Rows of a q/k projection reordered from HF's halves layout to adjacent pairs per head.
fn permute_for_interleaved_rope(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims[0];
    let rest: usize = dims[1..].iter().product();
    let half = rows / heads / 2;
    Ok(w.reshape((heads, 2, half, rest))?.transpose(1, 2)?.contiguous()?.reshape(dims)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_k_m_mix_follows_llama_cpp() {
        let q4km = |role, layer, embed_is_head| target_type(QuantKind::Q4KM, role, layer, 28, &[1536, 1536], embed_is_head);
        // The head is Q6_K; so is a tied embedding table (it is the head), not an untied one.
        assert_eq!(q4km(Role::LmHead, 0, false), GgmlDType::Q6K);
        assert_eq!(q4km(Role::Embed, 0, true), GgmlDType::Q6K);
        assert_eq!(q4km(Role::Embed, 0, false), GgmlDType::Q4K);
        // 14 of 28 layers take Q6_K v and down rows by llama.cpp's rule. (The published
        // Qwen2.5-Coder-1.5B Q4_K_M file also has 14, at other layers: llama.cpp counted them in
        // its tensors' name order, blk.10 before blk.2.)
        let more_bits: Vec<usize> = (0..28).filter(|&l| q4km(Role::Down, l, false) == GgmlDType::Q6K).collect();
        assert_eq!(more_bits, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]);
        assert!((0..28).all(|l| q4km(Role::V, l, false) == q4km(Role::Down, l, false)));
        assert!((0..28).all(|l| q4km(Role::Gate, l, true) == GgmlDType::Q4K && q4km(Role::Q, l, true) == GgmlDType::Q4K));
        // Vectors stay f32; rows that are not whole Q4_K blocks fall back to Q8_0, then F16.
        assert_eq!(target_type(QuantKind::Q4KM, Role::AttnNorm, 0, 28, &[1536], false), GgmlDType::F32);
        assert_eq!(target_type(QuantKind::Q4KM, Role::Q, 0, 28, &[64, 96], false), GgmlDType::Q8_0);
        assert_eq!(target_type(QuantKind::Q4KM, Role::Q, 0, 28, &[64, 100], false), GgmlDType::F16);
    }

    #[test]
    fn row_chunks_quantize_to_the_same_bytes_as_the_whole_matrix() {
        // 37 rows of 512: chunks of 8 rows (4,096 values) leave a short last chunk.
        let t = Tensor::randn(0f32, 1f32, (37, 512), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0, GgmlDType::F16, GgmlDType::F32] {
            let whole = QTensor::quantize(&t, dtype).unwrap();
            let chunked = quantize_rows(&t, dtype, 4096).unwrap();
            assert_eq!(chunked.shape().dims(), &[37, 512], "{dtype:?}");
            assert_eq!(chunked.dtype(), dtype);
            assert_eq!(chunked.data().unwrap(), whole.data().unwrap(), "{dtype:?}: chunked bytes differ");
        }
        // A three-dimensional input keeps its shape.
        let t3 = t.narrow(0, 0, 36).unwrap().reshape((3, 12, 512)).unwrap();
        let chunked = quantize_rows(&t3, GgmlDType::Q4K, 4096).unwrap();
        assert_eq!(chunked.shape().dims(), &[3, 12, 512]);
        assert_eq!(chunked.data().unwrap(), QTensor::quantize(&t3.contiguous().unwrap(), GgmlDType::Q4K).unwrap().data().unwrap());
    }
}
