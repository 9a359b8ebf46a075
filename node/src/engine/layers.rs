//! The building blocks every family shares: RMSNorm, rotary embeddings, grouped-query
//! attention with an optional sliding window, the gated MLP and the decoder layer.
//! Blocks are built from a `ModelSpec` and a `Weights` source; they hold no KV state.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{CpuStorage, DType, Device, Module, Tensor};

use super::cache::LayerCache;
use super::spec::{Activation, ModelSpec, Rope, RopeStyle};
use super::kernels::{self, QMatMulOp};
use super::tp::{AllReduce, RankParts};
use super::weights::{Matrix, Role, Weights};
use super::{EngineError, Result};

#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub(super) weight: Tensor,
    pub(super) eps: f32,
}

impl RmsNorm {
    pub fn load(w: &Weights, role: Role, layer: usize, spec: &ModelSpec, device: &Device) -> Result<Self> {
        let mut weight = w.vector(role, layer, device)?;
        if spec.norm_weight_offset != 0.0 {
            weight = (weight + spec.norm_weight_offset as f64)?;
        }
        Ok(RmsNorm { weight, eps: spec.rms_eps as f32 })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps)?)
    }

    pub fn weight_bytes(&self) -> u64 {
        tensor_bytes(&self.weight)
    }
}

/// Token rows from which a quantized matrix on a GPU multiplies its input dequantized to f16 by
/// cuBLAS rather than through candle's MMQ kernels (0: never); `usize::MAX` until first read
/// from `SHOAL_DEQUANT_PROMPT`. Default 128. With candle's dequantization (one H100, earlier
/// sessions) Q4_K_M prompts of 512 tokens ran 27% (7B) and 19% (1.5B) faster this way than
/// through MMQ, and at 256 the 7B gained 4% and the 1.5B lost 16%. With decode.cu's, into a
/// reused scratch (`cuda_decode::with_dequantized_f16`; one H200, session 45, medians of 3):
/// 7B 128 tokens +32% (5,471 -> 7,229 tok/s), 256 +61% (6,985 -> 11,270), 512 +70% (7,740 ->
/// 13,127); 1.5B 128 -0.8% (8,925 -> 8,852), 256 unchanged (15,726 -> 15,714), 512 +45% (20,319 ->
/// 29,395).
static DEQUANT_PROMPT_FROM: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Sets that bound for this process (`device_check prompt` compares both paths).
pub fn set_dequantize_prompt_from(token_rows: usize) {
    DEQUANT_PROMPT_FROM.store(token_rows, Ordering::Relaxed);
}

fn dequantize_for(x: &Tensor) -> bool {
    let mut from = DEQUANT_PROMPT_FROM.load(Ordering::Relaxed);
    if from == usize::MAX {
        from = std::env::var("SHOAL_DEQUANT_PROMPT").ok().and_then(|v| v.parse().ok()).unwrap_or(128);
        DEQUANT_PROMPT_FROM.store(from, Ordering::Relaxed);
    }
    let token_rows: usize = x.dims().iter().rev().skip(1).product();
    from > 0 && x.device().is_cuda() && token_rows >= from
}

/// `x` times quantized matrices that share it, dequantized to f16 and stacked by rows, in one
/// cuBLAS GEMM: the result's columns follow the matrices' rows in order (q/k/v, or gate/up, with
/// one conversion of `x` and one product), its f16 values converted to `out`. None where
/// decode.cu does not dequantize a format (Q4_K and Q6_K only), or without the `cuda` feature.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn dequantized_product(qs: &[&candle_core::quantized::QTensor], x: &Tensor, out: DType) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        let multiply = |dense: &Tensor| -> Result<Tensor> {
            let dense = match *x.dims() {
                [b1, b2, _, _] => dense.broadcast_left((b1, b2))?.t()?,
                [b, _, _] => dense.broadcast_left(b)?.t()?,
                _ => dense.t()?,
            };
            Ok(x.to_dtype(DType::F16)?.matmul(&dense)?.to_dtype(out)?)
        };
        return super::cuda_decode::with_dequantized_f16(qs, multiply);
    }
    #[cfg(not(feature = "cuda"))]
    Ok(None)
}

/// The quantized matrix a prompt on a GPU multiplies dequantized (`dequantize_for`), if `l` has one.
fn dequantizable<'a>(l: &'a Linear, x: &Tensor) -> Option<&'a candle_core::quantized::QTensor> {
    match &l.weight {
        Matrix::Candle(candle_core::quantized::QMatMul::QTensor(q)) if dequantize_for(x) => Some(q),
        _ => None,
    }
}

/// A linear layer with an optional bias.
#[derive(Debug, Clone)]
pub struct Linear {
    pub(super) weight: Matrix,
    pub(super) bias: Option<Tensor>,
}

impl Linear {
    pub fn load(w: &Weights, role: Role, bias: Option<Role>, layer: usize, device: &Device) -> Result<Self> {
        let weight = w.matmul(role, layer, device)?;
        let bias = bias.map(|b| w.vector(b, layer, device)).transpose()?;
        Ok(Linear { weight, bias })
    }

    /// Rows `rows` (column-parallel) or input columns `cols` (row-parallel) of a linear layer;
    /// the bias, if any, is cut to the same rows.
    pub fn load_part(w: &Weights, role: Role, bias: Option<Role>, layer: usize, rows: Option<Range<usize>>, cols: Option<Range<usize>>, device: &Device) -> Result<Self> {
        if rows.is_none() && cols.is_none() {
            return Linear::load(w, role, bias, layer, device);
        }
        let weight = w.matmul_part(role, layer, rows.clone(), cols, device)?;
        let bias = match (bias, rows) {
            (Some(b), Some(r)) => Some(w.vector_part(b, layer, r, device)?),
            (Some(b), None) => Some(w.vector(b, layer, device)?),
            (None, _) => None,
        };
        Ok(Linear { weight, bias })
    }

    pub fn from_matmul(weight: Matrix) -> Self {
        Linear { weight, bias: None }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_to(x, x.dtype())
    }

    /// `forward` with its output in `out`. A quantized matrix multiplied dequantized (a prompt
    /// on a GPU, `dequantize_for`) takes `x` in f16 or f32 as it comes and converts its f16
    /// product to `out`; every other path takes `x` converted to `out` first.
    pub fn forward_to(&self, x: &Tensor, out: DType) -> Result<Tensor> {
        let y = match &self.weight {
            Matrix::Candle(w @ candle_core::quantized::QMatMul::QTensor(q)) if dequantize_for(x) => {
                // A prompt on a GPU: the matrix dequantized to f16 (Q4_K and Q6_K into the
                // device's reused scratch, others into a transient copy by candle) and multiplied
                // by cuBLAS, rather than candle's MMQ kernels; those still take it where that
                // fails (a format candle cannot dequantize to f16 there, or no GPU memory left).
                let dequantized = dequantized_product(&[q], x, out).and_then(|y| match y {
                    Some(y) => Ok(y),
                    None => Ok(w.forward_via_f16(&x.to_dtype(out)?)?),
                });
                match dequantized {
                    Ok(y) => y,
                    Err(e) => {
                        tracing::debug!(error = %e, dtype = ?q.dtype(), "dequantized prompt matmul failed; using MMQ");
                        w.forward(&x.to_dtype(out)?)?
                    }
                }
            }
            Matrix::Packed(w) => x.to_dtype(out)?.contiguous()?.apply_op1_no_bwd(&QMatMulOp { weight: w.clone() })?,
            Matrix::Candle(w) => w.forward(&x.to_dtype(out)?)?,
        };
        self.add_bias(y)
    }

    /// Bytes of weights (and bias) a forward pass reads.
    pub fn weight_bytes(&self) -> u64 {
        let w = match &self.weight {
            Matrix::Packed(m) => m.size_in_bytes() as u64,
            Matrix::Candle(candle_core::quantized::QMatMul::QTensor(q)) => q.storage_size_in_bytes() as u64,
            Matrix::Candle(candle_core::quantized::QMatMul::Tensor(t) | candle_core::quantized::QMatMul::TensorF16(t)) => tensor_bytes(t),
        };
        w + self.bias.as_ref().map_or(0, tensor_bytes)
    }

    /// On a GPU, dense matrices that share an input run as one GEMM: their weights (and biases)
    /// are stacked once at load and each part keeps a view of its own rows, so memory is not
    /// doubled. `None` (nothing changed) on the CPU, for quantized matrices, or mixed biases.
    fn fuse(parts: &mut [&mut Linear]) -> Result<Option<Linear>> {
        let dense: Option<Vec<Tensor>> = parts
            .iter()
            .map(|l| match &l.weight {
                Matrix::Candle(candle_core::quantized::QMatMul::Tensor(t)) if !t.device().is_cpu() => Some(t.clone()),
                _ => None,
            })
            .collect();
        let Some(weights) = dense else { return Ok(None) };
        let biases: Option<Vec<Tensor>> = parts.iter().map(|l| l.bias.clone()).collect();
        if biases.is_none() && parts.iter().any(|l| l.bias.is_some()) {
            return Ok(None);
        }
        let w = Tensor::cat(&weights, 0)?;
        let b = biases.map(|bs| Tensor::cat(&bs, 0)).transpose()?;
        let mut row = 0;
        for (l, part) in parts.iter_mut().zip(&weights) {
            let n = part.dim(0)?;
            l.weight = Matrix::Candle(candle_core::quantized::QMatMul::Tensor(w.narrow(0, row, n)?));
            l.bias = b.as_ref().map(|b| b.narrow(0, row, n)).transpose()?;
            row += n;
        }
        Ok(Some(Linear { weight: Matrix::Candle(candle_core::quantized::QMatMul::Tensor(w)), bias: b }))
    }

    /// The output rows of a fused or stacked forward, split back into its parts' outputs.
    fn split<const N: usize>(y: Tensor, parts: [&Linear; N]) -> Result<[Tensor; N]> {
        let mut out = Vec::with_capacity(N);
        let mut col = 0;
        for l in parts {
            let n = match &l.weight {
                Matrix::Candle(candle_core::quantized::QMatMul::Tensor(t)) => t.dim(0)?,
                Matrix::Candle(candle_core::quantized::QMatMul::QTensor(q)) => q.shape().dims2()?.0,
                _ => unreachable!("only dense parts are fused and only quantized ones stacked"),
            };
            out.push(y.narrow(candle_core::D::Minus1, col, n)?);
            col += n;
        }
        Ok(out.try_into().expect("N outputs"))
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?)?,
            None => y,
        })
    }

    /// Several layers applied to one input: with shoal's CPU kernels the input is quantized once
    /// and every matrix's rows run as one job; a prompt on a GPU multiplies its quantized matrices
    /// dequantized into one stack by one GEMM. Otherwise each layer runs alone.
    pub fn forward_group<const N: usize>(layers: [&Linear; N], x: &Tensor) -> Result<[Tensor; N]> {
        Self::forward_group_to(layers, x, x.dtype())
    }

    /// `forward_group` with its outputs in `out` (as `forward_to`).
    pub fn forward_group_to<const N: usize>(layers: [&Linear; N], x: &Tensor, out: DType) -> Result<[Tensor; N]> {
        let ys: Vec<Tensor> = match Self::forward_stacked(layers, x, out)? {
            Some(ys) => layers.iter().zip(ys).map(|(l, y)| l.add_bias(y)).collect::<Result<_>>()?,
            None => layers.iter().map(|l| l.forward_to(x, out)).collect::<Result<_>>()?,
        };
        Ok(ys.try_into().expect("N outputs"))
    }

    /// `forward_group_to`'s products before their biases, where the layers share one kernel job
    /// or one stacked GEMM; None where they do not.
    fn forward_stacked<const N: usize>(layers: [&Linear; N], x: &Tensor, out: DType) -> Result<Option<Vec<Tensor>>> {
        let packed: Option<Vec<_>> = layers.iter().map(|l| if let Matrix::Packed(w) = &l.weight { Some(w) } else { None }).collect();
        if let Some(packed) = packed {
            return Ok(Some(kernels::forward_many(&packed, &x.to_dtype(out)?)?));
        }
        let quantized: Option<Vec<_>> = layers.iter().map(|l| dequantizable(l, x)).collect();
        let Some(qs) = quantized.filter(|qs| qs.len() > 1) else { return Ok(None) };
        match dequantized_product(&qs, x, out) {
            Ok(Some(y)) => Ok(Some(Linear::split(y, layers)?.to_vec())),
            Ok(None) => Ok(None),
            Err(e) => {
                tracing::debug!(error = %e, "stacked dequantized prompt matmul failed; each matrix alone");
                Ok(None)
            }
        }
    }
}

fn tensor_bytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

/// Cosine and sine tables for the positions `[start, start + len)`, each `(len, head_dim / 2)`.
pub fn rope_tables(rope: &Rope, head_dim: usize, start: usize, len: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let inv_freq = rope.inv_freq(head_dim);
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(len * half);
    let mut sin = Vec::with_capacity(len * half);
    for p in start..start + len {
        for f in &inv_freq {
            // transformers multiplies in f32, then takes cos/sin of the f32 angle.
            let angle = p as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    Ok((Tensor::from_vec(cos, (len, half), device)?, Tensor::from_vec(sin, (len, half), device)?))
}

#[derive(Debug, Clone)]
pub struct Attention {
    pub(super) q: Linear,
    pub(super) k: Linear,
    pub(super) v: Linear,
    pub(super) o: Linear,
    pub(super) q_norm: Option<RmsNorm>,
    pub(super) k_norm: Option<RmsNorm>,
    /// Query and KV heads this node runs (all of them, or a tensor-parallel slice's).
    pub(super) num_heads: usize,
    pub(super) num_kv_heads: usize,
    /// For a slice whose query heads do not share their KV heads evenly: the local KV head of
    /// each local query head, to expand the KV history with (`None`: fold heads, no copy).
    pub(super) kv_of_head: Option<Tensor>,
    pub(super) head_dim: usize,
    pub(super) scale: f64,
    pub(super) softcap: Option<f64>,
    pub(super) rope_style: RopeStyle,
    pub(super) window: Option<usize>,
    /// The KV cache's dtype, in which scores and weighted sums are multiplied too
    /// (`Weights::cache_dtype`: the activations' but for GGUF weights on a GPU, f16).
    pub(super) kv_dtype: DType,
    /// q, k and v stacked into one matrix on a GPU (see `Linear::fuse`).
    pub(super) qkv: Option<Linear>,
}

impl Attention {
    /// All heads, or with `part` only its query heads, the KV heads they read and o_proj's
    /// matching input columns.
    pub fn load(w: &Weights, spec: &ModelSpec, layer: usize, part: Option<&RankParts>, device: &Device) -> Result<Self> {
        let bias = |r| if spec.qkv_bias { Some(r) } else { None };
        let norm = |r| -> Result<Option<RmsNorm>> {
            if spec.qk_norm { Ok(Some(RmsNorm::load(w, r, layer, spec, device)?)) } else { Ok(None) }
        };
        let d = spec.head_dim;
        let (q, k, v, o, num_heads, num_kv_heads, kv_of_head) = match part {
            None => (
                Linear::load(w, Role::Q, bias(Role::QBias), layer, device)?,
                Linear::load(w, Role::K, bias(Role::KBias), layer, device)?,
                Linear::load(w, Role::V, bias(Role::VBias), layer, device)?,
                Linear::load(w, Role::O, None, layer, device)?,
                spec.num_heads,
                spec.num_kv_heads,
                None,
            ),
            Some(p) => {
                let (h, kv) = (&p.heads, &p.kv_heads);
                let rows = |r: &Range<usize>| Some(r.start * d..r.end * d);
                let rep = spec.num_heads / spec.num_kv_heads.max(1);
                // The local KV head of each local query head; folding needs each KV head to serve
                // the same number of consecutive query heads.
                let map: Vec<u32> = h.clone().map(|q| (q / rep - kv.start) as u32).collect();
                let even = map.len() % kv.len() == 0 && map.iter().enumerate().all(|(i, &k)| k as usize == i / (map.len() / kv.len()));
                let kv_of_head = if even { None } else { Some(Tensor::new(map, device)?) };
                (
                    Linear::load_part(w, Role::Q, bias(Role::QBias), layer, rows(h), None, device)?,
                    Linear::load_part(w, Role::K, bias(Role::KBias), layer, rows(kv), None, device)?,
                    Linear::load_part(w, Role::V, bias(Role::VBias), layer, rows(kv), None, device)?,
                    Linear::load_part(w, Role::O, None, layer, None, rows(h), device)?,
                    h.len(),
                    kv.len(),
                    kv_of_head,
                )
            }
        };
        let (mut q, mut k, mut v) = (q, k, v);
        let qkv = Linear::fuse(&mut [&mut q, &mut k, &mut v])?;
        Ok(Attention {
            q,
            k,
            v,
            qkv,
            o,
            q_norm: norm(Role::QNorm)?,
            k_norm: norm(Role::KNorm)?,
            num_heads,
            num_kv_heads,
            kv_of_head,
            head_dim: spec.head_dim,
            scale: spec.attention_scale,
            softcap: spec.attn_logit_softcap,
            rope_style: spec.rope_style,
            window: spec.window_for_layer(layer),
            kv_dtype: w.cache_dtype(device),
        })
    }

    pub fn weight_bytes(&self) -> u64 {
        let norms = self.q_norm.as_ref().map_or(0, RmsNorm::weight_bytes) + self.k_norm.as_ref().map_or(0, RmsNorm::weight_bytes);
        self.q.weight_bytes() + self.k.weight_bytes() + self.v.weight_bytes() + self.o.weight_bytes() + norms
    }

    /// `x` is `(1, t, hidden)` for positions `[start, start + t)`; `cos`/`sin` cover those positions.
    pub fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, cache: &mut LayerCache) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let start = cache.len();
        let dev = x.device();
        let mut clock = super::op_timing::start(dev);
        let heads = |y: Tensor, n: usize| -> Result<Tensor> { Ok(y.reshape((b, t, n, self.head_dim))?.transpose(1, 2)?.contiguous()?) };
        let [q, k, v] = match &self.qkv {
            Some(fused) => Linear::split(fused.forward(x)?, [&self.q, &self.k, &self.v])?,
            None => Linear::forward_group([&self.q, &self.k, &self.v], x)?,
        };
        clock.mark(dev, "qkv");
        let mut q = heads(q, self.num_heads)?;
        let mut k = heads(k, self.num_kv_heads)?;
        let v = heads(v, self.num_kv_heads)?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let (q, k) = match self.rope_style {
            RopeStyle::Halves => (candle_nn::rotary_emb::rope(&q, cos, sin)?, candle_nn::rotary_emb::rope(&k, cos, sin)?),
            RopeStyle::Interleaved => (candle_nn::rotary_emb::rope_i(&q, cos, sin)?, candle_nn::rotary_emb::rope_i(&k, cos, sin)?),
        };
        clock.mark(dev, "heads+rope");
        let q = q.to_dtype(self.kv_dtype)?;
        let (k_all, v_all) = cache.append(&k.to_dtype(self.kv_dtype)?, &v.to_dtype(self.kv_dtype)?)?;
        clock.mark(dev, "kv append");
        let total = start + t;
        // Keys older than the window can never be seen again by these queries: skip them.
        let first_key = match self.window {
            Some(w) if start + 1 > w => start + 1 - w,
            _ => 0,
        };
        let keys = total - first_key;
        // Decode on the CPU: one query row reads the cache in place (no copy, no mask needed).
        if t == 1 && b == 1 && self.kv_of_head.is_none() && x.device().is_cpu() {
            if let Some(out) = self.attend_cached(&q, cache, first_key..total)? {
                return self.o.forward(&out);
            }
        }
        let (mut k_all, mut v_all) = (k_all.narrow(2, first_key, keys)?, v_all.narrow(2, first_key, keys)?);
        // cuBLAS reads the cache's strided rows as they are; the CPU matmul is faster on a copy.
        if x.device().is_cpu() {
            (k_all, v_all) = (k_all.contiguous()?, v_all.contiguous()?);
        }
        let mut kv_heads = self.num_kv_heads;
        if let Some(map) = &self.kv_of_head {
            // An uneven tensor-parallel slice: one KV head per query head, copied.
            k_all = k_all.index_select(map, 1)?;
            v_all = v_all.index_select(map, 1)?;
            kv_heads = self.num_heads;
        }
        // Grouped-query attention without copying KV: the heads sharing a KV head are
        // consecutive, so fold them into the query-length axis.
        let rep = self.num_heads / kv_heads;
        let q = q.reshape((b, kv_heads, rep * t, self.head_dim))?;
        let mut scores = q.matmul(&k_all.t()?)?;
        clock.mark(dev, "scores");
        // Rows are query-fastest: row r is query r % t.
        let visibility = kernels::softmax::Visibility { t, start, first_key, window: self.window };
        let probs = match fused_softmax(&scores, visibility, self.scale, self.softcap)? {
            Some(probs) => probs,
            None => {
                scores = (scores * self.scale)?;
                if let Some(cap) = self.softcap {
                    scores = ((scores / cap)?.tanh()? * cap)?;
                }
                if let Some(mask) = attention_mask(start, t, first_key, keys, self.window, x.device())? {
                    let mask = mask.to_dtype(scores.dtype())?;
                    scores = scores
                        .reshape((b, kv_heads, rep, t, keys))?
                        .broadcast_add(&mask)?
                        .reshape((b, kv_heads, rep * t, keys))?;
                }
                candle_nn::ops::softmax_last_dim(&scores)?
            }
        };
        clock.mark(dev, "softmax");
        // In the cache's dtype until o, which returns the hidden states' (a quantized model's
        // f16 products on a GPU go into its dequantized o's GEMM as they are).
        let out = probs.matmul(&v_all)?; // (b, kv_heads, rep * t, head_dim)
        clock.mark(dev, "pv");
        let out = out
            .reshape((b, self.num_heads, t, self.head_dim))?
            .transpose(1, 2)?
            .reshape((b, t, self.num_heads * self.head_dim))?;
        clock.mark(dev, "merge heads");
        let y = self.o.forward_to(&out, x.dtype());
        clock.mark(dev, "o");
        y
    }
}

impl Attention {
    /// One query position against the KV cache buffers read in place (`kernels::attend`);
    /// `None` when the cache is not f32 CPU storage (the caller then takes the general path).
    fn attend_cached(&self, q: &Tensor, cache: &LayerCache, keys: Range<usize>) -> Result<Option<Tensor>> {
        let Some((kb, vb)) = cache.buffers() else { return Ok(None) };
        let capacity = kb.dim(2)?;
        let (ks, kl) = kb.storage_and_layout();
        let (vs, vl) = vb.storage_and_layout();
        let (candle_core::Storage::Cpu(CpuStorage::F32(k)), candle_core::Storage::Cpu(CpuStorage::F32(v))) = (&*ks, &*vs) else { return Ok(None) };
        if !kl.is_contiguous() || !vl.is_contiguous() {
            return Ok(None);
        }
        let n = self.num_kv_heads * capacity * self.head_dim;
        let (k, v) = (&k[kl.start_offset()..kl.start_offset() + n], &v[vl.start_offset()..vl.start_offset() + n]);
        let qv = q.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; self.num_heads * self.head_dim];
        let view = kernels::attend::KvView { k, v, capacity };
        let softcap = self.softcap.map(|c| c as f32);
        kernels::attend::attend_one(&qv, self.num_heads, self.num_kv_heads, self.head_dim, &view, keys, self.scale as f32, softcap, &mut out, kernels::pool::global());
        drop((ks, vs));
        Ok(Some(Tensor::from_vec(out, (1, 1, self.num_heads * self.head_dim), q.device())?.to_dtype(q.dtype())?))
    }
}

/// `SHOAL_PROMPT_KERNELS=candle`: candle's ops for prompts' softmax and gated product instead
/// of shoal's one-pass kernels (an A/B aid).
fn candle_prompt_ops() -> bool {
    static CANDLE: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| std::env::var("SHOAL_PROMPT_KERNELS").is_ok_and(|v| v == "candle"));
    *CANDLE
}

/// A prompt's raw attention scores `(.., rows, keys)` as probabilities in one pass where shoal
/// has a kernel for their device (`kernels::softmax` on the CPU, `cuda_decode::attention_softmax`
/// on a GPU); None where none applies, and the caller takes candle's ops with `attention_mask`.
fn fused_softmax(scores: &Tensor, visibility: kernels::softmax::Visibility, scale: f64, softcap: Option<f64>) -> Result<Option<Tensor>> {
    if candle_prompt_ops() {
        return Ok(None);
    }
    if scores.device().is_cpu() {
        if scores.dtype() != DType::F32 || !scores.is_contiguous() {
            return Ok(None);
        }
        let op = kernels::softmax::PromptSoftmaxOp { vis: visibility, scale: scale as f32, softcap: softcap.map(|c| c as f32) };
        return Ok(Some(scores.apply_op1_no_bwd(&op)?));
    }
    #[cfg(feature = "cuda")]
    return super::cuda_decode::attention_softmax(scores, visibility.t, visibility.start, visibility.first_key, visibility.window, scale, softcap);
    #[cfg(not(feature = "cuda"))]
    Ok(None)
}

/// Additive mask `(t, keys)` for queries at `[start, start + t)` over keys `[first_key, first_key + keys)`,
/// or `None` when every query may see every key. Built where the scores are (a 2,048-token
/// prompt's mask is 16 MB, which every layer would otherwise fill on the host and copy over).
fn attention_mask(start: usize, t: usize, first_key: usize, keys: usize, window: Option<usize>, device: &Device) -> Result<Option<Tensor>> {
    let visible = |q: usize, k: usize| k <= q && window.is_none_or(|w| q - k < w);
    let all_visible = (start..start + t).all(|q| visible(q, first_key) && visible(q, first_key + keys - 1));
    if all_visible {
        return Ok(None);
    }
    let position = |from: usize, n: usize| Tensor::arange(from as i64, (from + n) as i64, device);
    let queries = position(start, t)?.reshape((t, 1))?;
    let mut seen = position(first_key, keys)?.reshape((1, keys))?.broadcast_le(&queries)?;
    if let Some(w) = window {
        // q - k < w, as k + w > q.
        seen = (seen * position(first_key + w, keys)?.reshape((1, keys))?.broadcast_gt(&queries)?)?;
    }
    let (open, shut) = (Tensor::zeros((t, keys), DType::F32, device)?, Tensor::full(f32::NEG_INFINITY, (t, keys), device)?);
    Ok(Some(seen.where_cond(&open, &shut)?))
}

#[derive(Debug, Clone)]
pub struct Mlp {
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
    pub(super) activation: Activation,
    /// gate and up stacked into one matrix on a GPU (see `Linear::fuse`).
    pub(super) gate_up: Option<Linear>,
}

impl Mlp {
    /// The whole MLP, or with `ffn` only those intermediate columns (gate/up rows, down's input columns).
    pub fn load(w: &Weights, spec: &ModelSpec, layer: usize, ffn: Option<Range<usize>>, device: &Device) -> Result<Self> {
        let mut gate = Linear::load_part(w, Role::Gate, None, layer, ffn.clone(), None, device)?;
        let mut up = Linear::load_part(w, Role::Up, None, layer, ffn.clone(), None, device)?;
        let gate_up = Linear::fuse(&mut [&mut gate, &mut up])?;
        Ok(Mlp { gate, up, down: Linear::load_part(w, Role::Down, None, layer, None, ffn, device)?, activation: spec.activation, gate_up })
    }

    pub fn weight_bytes(&self) -> u64 {
        self.gate.weight_bytes() + self.up.weight_bytes() + self.down.weight_bytes()
    }

    /// Whether a prompt keeps this MLP's intermediate in f16 between its products: on a GPU,
    /// where gate, up and down are all multiplied dequantized by decode.cu's kernels
    /// (`cuda_decode::dequant_kernel`: Q4_K / Q6_K) and have no biases. The values are those of
    /// the f32 route (cuBLAS's f16 products widened exactly, the gated product rounded to f16 once
    /// before down either way), without two conversions and with half the intermediate's traffic.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn intermediate_in_half(&self, x: &Tensor) -> bool {
        #[cfg(feature = "cuda")]
        return !candle_prompt_ops()
            && [&self.gate, &self.up, &self.down]
                .iter()
                .all(|l| l.bias.is_none() && dequantizable(l, x).is_some_and(|q| super::cuda_decode::dequant_kernel(q.dtype()).is_some()));
        #[cfg(not(feature = "cuda"))]
        false
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dev = x.device();
        let mut clock = super::op_timing::start(dev);
        let inner = if self.intermediate_in_half(x) { DType::F16 } else { x.dtype() };
        let [gate, up] = match &self.gate_up {
            Some(fused) => Linear::split(fused.forward(x)?, [&self.gate, &self.up])?,
            None => Linear::forward_group_to([&self.gate, &self.up], x, inner)?,
        };
        clock.mark(dev, "gate/up");
        if let Some(h) = gated_on_pool(self.activation, &gate, &up)? {
            return self.down.forward(&h);
        }
        #[cfg(feature = "cuda")]
        let fused = if candle_prompt_ops() { None } else { super::cuda_decode::gated_product(&gate, &up, self.activation)? };
        #[cfg(not(feature = "cuda"))]
        let fused: Option<Tensor> = None;
        let h = match fused {
            Some(h) => h,
            None => {
                let gate = match self.activation {
                    Activation::Silu => candle_nn::ops::silu(&gate)?,
                    Activation::GeluTanh => gate.gelu()?,
                };
                (gate * up)?
            }
        };
        clock.mark(dev, "activation");
        let y = self.down.forward_to(&h, x.dtype());
        clock.mark(dev, "down");
        y
    }
}

/// `act(gate) * up` in one pass on the kernel pool, for contiguous f32 CPU tensors (`None`
/// otherwise: the caller uses candle's ops, which give the same values).
fn gated_on_pool(act: Activation, gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    if !gate.device().is_cpu() || gate.dtype() != candle_core::DType::F32 || up.dtype() != candle_core::DType::F32 || gate.shape() != up.shape() {
        return Ok(None);
    }
    let (gs, gl) = gate.storage_and_layout();
    let (us, ul) = up.storage_and_layout();
    let (candle_core::Storage::Cpu(CpuStorage::F32(g)), candle_core::Storage::Cpu(CpuStorage::F32(u))) = (&*gs, &*us) else { return Ok(None) };
    let (Some((g0, g1)), Some((u0, u1))) = (gl.contiguous_offsets(), ul.contiguous_offsets()) else { return Ok(None) };
    let mut out = vec![0f32; g1 - g0];
    let act = match act {
        Activation::Silu => kernels::gated::Gate::Silu,
        Activation::GeluTanh => kernels::gated::Gate::GeluTanh,
    };
    kernels::gated::gated(act, &g[g0..g1], &u[u0..u1], &mut out, kernels::pool::global());
    drop((gs, us));
    Ok(Some(Tensor::from_vec(out, gate.shape(), gate.device())?))
}

/// One transformer block: pre-norm attention and MLP with residuals, plus Gemma's sandwich norms.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub(super) attn_norm: RmsNorm,
    pub(super) attn: Attention,
    pub(super) post_attn_norm: Option<RmsNorm>,
    pub(super) ffn_norm: RmsNorm,
    pub(super) mlp: Mlp,
    pub(super) post_ffn_norm: Option<RmsNorm>,
    pub(super) rope: Rope,
    pub(super) head_dim: usize,
}

impl DecoderLayer {
    /// The whole layer, or with `part` one tensor-parallel member's slice of it.
    pub fn load(w: &Weights, spec: &ModelSpec, layer: usize, part: Option<&RankParts>, device: &Device) -> Result<Self> {
        let sandwich = |r| -> Result<Option<RmsNorm>> {
            if spec.sandwich_norms { Ok(Some(RmsNorm::load(w, r, layer, spec, device)?)) } else { Ok(None) }
        };
        Ok(DecoderLayer {
            attn_norm: RmsNorm::load(w, Role::AttnNorm, layer, spec, device)?,
            attn: Attention::load(w, spec, layer, part, device)?,
            post_attn_norm: sandwich(Role::PostAttnNorm)?,
            ffn_norm: RmsNorm::load(w, Role::FfnNorm, layer, spec, device)?,
            mlp: Mlp::load(w, spec, layer, part.map(|p| p.ffn.clone()), device)?,
            post_ffn_norm: sandwich(Role::PostFfnNorm)?,
            rope: spec.rope_for_layer(layer).clone(),
            head_dim: spec.head_dim,
        })
    }

    /// Bytes of weights one forward step reads.
    pub fn weight_bytes(&self) -> u64 {
        let opt = |n: &Option<RmsNorm>| n.as_ref().map_or(0, RmsNorm::weight_bytes);
        self.attn_norm.weight_bytes() + self.attn.weight_bytes() + opt(&self.post_attn_norm) + self.ffn_norm.weight_bytes() + self.mlp.weight_bytes() + opt(&self.post_ffn_norm)
    }

    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// `reduce` joins a tensor-parallel slice's partial sums (after o_proj and after down_proj)
    /// with its group's; `None` for a whole layer.
    pub fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, cache: &mut LayerCache, reduce: Option<&dyn AllReduce>) -> Result<Tensor> {
        let mut h = all_reduce(self.attn.forward(&self.attn_norm.forward(x)?, cos, sin, cache)?, reduce)?;
        if let Some(n) = &self.post_attn_norm {
            h = n.forward(&h)?;
        }
        let x = (x + h)?;
        let mut h = all_reduce(self.mlp.forward(&self.ffn_norm.forward(&x)?)?, reduce)?;
        if let Some(n) = &self.post_ffn_norm {
            h = n.forward(&h)?;
        }
        Ok((x + h)?)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
}

/// Sums a row-parallel output over the group (a blocking call into the data plane).
fn all_reduce(h: Tensor, reduce: Option<&dyn AllReduce>) -> Result<Tensor> {
    let Some(reduce) = reduce else { return Ok(h) };
    let (shape, device) = (h.shape().clone(), h.device().clone());
    let mut buf = h.flatten_all()?.to_vec1::<f32>()?;
    reduce.all_reduce(&mut buf).map_err(|e| EngineError::Shard(e.to_string()))?;
    Ok(Tensor::from_vec(buf, shape, &device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mask built from tensor ops equals the rule applied key by key: causal, with a window,
    /// and over a cache whose oldest keys have left the window.
    #[test]
    fn attention_masks_follow_the_visibility_rule() {
        let cases = [(0, 5, 0, 5, None), (3, 4, 0, 7, None), (0, 9, 0, 9, Some(3)), (10, 3, 8, 5, Some(4)), (6, 1, 0, 7, Some(2))];
        for (start, t, first_key, keys, window) in cases {
            let mask = attention_mask(start, t, first_key, keys, window, &Device::Cpu).unwrap().expect("some key is hidden");
            let got = mask.to_vec2::<f32>().unwrap();
            for (i, row) in got.iter().enumerate() {
                for (j, m) in row.iter().enumerate() {
                    let (q, k) = (start + i, first_key + j);
                    let visible = k <= q && window.is_none_or(|w| q - k < w);
                    assert_eq!(*m, if visible { 0.0 } else { f32::NEG_INFINITY }, "case {:?}, query {q}, key {k}", (start, t, first_key, keys, window));
                }
            }
        }
        // Every key visible: no mask at all.
        assert!(attention_mask(7, 1, 0, 8, None, &Device::Cpu).unwrap().is_none());
    }
}
