//! The fused decode step on an NVIDIA GPU: one token of a shard's layers in five kernels per
//! layer (`cuda/decode.cu`), reading the weights where candle loaded them (dense rows or GGUF
//! blocks, never copied) and the KV cache in place, with f32 activations (Q4_K and Q6_K rows take
//! int8 ones, as llama.cpp's CUDA kernels do for every quantized matrix). The launch
//! sequence is captured as a CUDA graph, once per count of blocks attention takes (one a head,
//! or more for long contexts: `attend_splits`), and replayed each token, for every sequence: the
//! position and the KV buffers' addresses are read from device memory, written before each step,
//! and a first shard's token is embedded by the step's first kernel (no lookup outside the graph).
//! Also the sampler's CUDA side: a temperature draw or top-k / top-p / min-p candidates computed
//! where the logits are, and page-locked copies of whole rows; and for prompts, Q4_K / Q6_K
//! matrices dequantized to f16 and stacked for cuBLAS (`with_dequantized_f16`), and prompts' attention
//! softmax and gated product each in one pass (`attention_softmax`, `gated_product`).
//! What it does not do: prompts' matrix products (t > 1 stay on candle and cuBLAS),
//! tensor-parallel slices, or
//! anything on the CPU. A shard whose weights or shapes these kernels do not cover says why at
//! load and keeps candle's path.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice, PushKernelArg};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::cuda_backend::DeviceId;
use candle_core::{DType, Device, Storage, Tensor};

use super::cache::ShardCache;
use super::layers::{DecoderLayer, Linear, RmsNorm};
use super::spec::{Activation, RopeStyle};
use super::weights::{check_token_ids, EmbeddingTable, Matrix};
use super::cuda_plan::*;
use super::{EngineError, Result};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));
const MODULE: &str = "shoal_decode";
/// `SHOAL_FUSED_ATOMIC_SPLIT=1`: split-K partial sums are added atomically, in arrival order.
fn atomic_split() -> bool {
    std::env::var("SHOAL_FUSED_ATOMIC_SPLIT").is_ok_and(|v| v == "1")
}

/// One kernel launch of the step (attention finds its KV cache through `Buffers::step`).
#[derive(Clone, Copy)]
enum Launch {
    /// The first shard's token row of the embedding (`embed_row`), first in the step.
    Embed { args: EmbedArgs },
    /// `kernel`: the instance for its matrices' formats (see `mv_kernel`).
    Mv { args: MvArgs, rows: u32, kernel: &'static str },
    Attend { args: AttnArgs },
    AddNorm { x: u64, h: u64, w: u64, n: i32, eps: f32 },
}

/// Buffers a step writes, allocated once per shard. Steps are serialised by the mutex around
/// them; their kernels run in stream order.
struct Buffers {
    /// The residual stream (hidden f32).
    x: Tensor,
    /// What a step reads from the host: the position, then per layer the key and value cache
    /// addresses and their capacity (`KvSlot` in decode.cu), then the step's tag (see `tags`),
    /// the token id (`step_token`) and the address the embedding reads the id from (that word,
    /// or a `DeviceChain`'s pick), then where the LM head's launch writes a greedy pick (`Pick`),
    /// written before the step's kernels (`step_words` in all).
    step: CudaSlice<u64>,
    /// The latest step's tag: steps taken, from 1 (tagged buffers start zeroed).
    tag: u32,
    logits: Option<Tensor>,
    /// The captured step for each count of attention splits (`FusedDecode::attend_splits`),
    /// replayed for every sequence.
    graphs: Vec<(u32, Captured)>,
    /// `SHOAL_FUSED_TRACE=1`: the block timeline records of the latest step (`trace_block` in
    /// decode.cu), and the steps taken.
    trace: Option<(CudaSlice<u64>, u64)>,
    /// Page-locked copies of `step` for its uploads, used in turn, each with an event recorded
    /// after its copy. A copy from pageable memory may wait for the stream to drain, which would
    /// stop the host from queueing a step while the previous one runs (`DeviceChain`).
    uploads: Vec<(PinnedHostSlice<u64>, CudaEvent)>,
    /// Uploads so far.
    uploaded: usize,
}

/// Words of a step's arguments (`Buffers::step`) for `layers` layers: the position, each
/// layer's `KvSlot`, the tag, the token id and its address, then `Pick` (the last three).
fn step_words(layers: usize) -> usize {
    1 + 3 * layers + 3 + 3
}

/// Where a step's LM head launch writes its greedy pick (`pick_greedy` in decode.cu): a
/// `DeviceChain`'s next-token word and the mapped host word for this step, and the vocabulary's
/// size; all 0 where the host or `pick_token` picks.
#[derive(Clone, Copy, Default)]
struct Pick {
    next: u64,
    host: u64,
    vocab: u64,
}

/// Page-locked copies of a step's arguments (`Buffers::uploads`): with a step queued ahead, the
/// copy of one may still wait in the stream while the next is written.
const UPLOAD_SLOTS: usize = 4;

/// Where a launch sits in a layer, for the profile and the trace.
const KIND_NAMES: [&str; 8] = ["qkv", "attend", "o", "gate/up", "down", "head", "add_norm", "embed"];

/// Each launch's kind (an index into `KIND_NAMES`): per layer q/k/v, attend, o, gate/up and
/// down (with add_norm after o or down for post-norm families), then the head.
fn launch_kinds(launches: &[Launch], layers: usize) -> Vec<usize> {
    let mut mv_in_layer = 0usize;
    launches
        .iter()
        .map(|l| match l {
            Launch::Mv { .. } if mv_in_layer == 4 * layers => 5,
            Launch::Mv { .. } => {
                mv_in_layer += 1;
                [0, 2, 3, 4][(mv_in_layer - 1) % 4]
            }
            Launch::Attend { .. } => 1,
            Launch::AddNorm { .. } => 6,
            Launch::Embed { .. } => 7,
        })
        .collect()
}

/// Block records per traced step (a 7B step has about 70,000 blocks).
const TRACE_RECORDS: usize = 1 << 18;

/// The trace of one step, per launch kind, averaged over the layers (µs): the time from the
/// previous launch's last block end to this one's (`span`; the spans add up to the step), when
/// its first and its median block started and its first wait returned (negative: before the
/// previous launch ended), and per block (medians) the staging and the work after it, then how
/// long the last block ended after the median one.
/// `each_launch` (`SHOAL_FUSED_TRACE=2`): also one line per launch, in step order, with its layer.
fn trace_summary(records: &[u64], kinds: &[usize], each_launch: bool) -> String {
    #[derive(Clone, Default)]
    struct PerLaunch {
        start: Vec<f64>,
        waited: Vec<f64>,
        stage: Vec<f64>,
        work: Vec<f64>,
        end: Vec<f64>,
    }
    let mut launches = vec![PerLaunch::default(); kinds.len()];
    let t0 = trace_start(records);
    let us = |t: u64| t.saturating_sub(t0) as f64 / 1e3;
    for r in records.chunks_exact(5) {
        let Some(l) = launches.get_mut((r[4] >> 32) as usize) else { continue };
        l.start.push(us(r[0]));
        l.waited.push(us(r[1]));
        l.stage.push(us(r[2]) - us(r[1]));
        l.work.push(us(r[3]) - us(r[2]));
        l.end.push(us(r[3]));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = |v: &[f64]| v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    // Per kind: count, then the printed columns in order (span, first start, median start,
    // first wait, stage, work, tail).
    let mut sums = vec![[0f64; 8]; KIND_NAMES.len()];
    let mut lines = String::new();
    let mut prev_end = None;
    let mut layer = 0;
    for (i, (l, &kind)) in launches.iter_mut().zip(kinds).enumerate() {
        if l.end.is_empty() {
            continue;
        }
        let end = max(&l.end);
        if let Some(pe) = prev_end {
            let f = [1.0, end - pe, min(&l.start) - pe, median(&mut l.start) - pe, min(&l.waited) - pe, median(&mut l.stage), median(&mut l.work), end - median(&mut l.end)];
            for (s, v) in sums[kind].iter_mut().zip(f) {
                *s += v;
            }
            if each_launch {
                lines += &format!("\n  #{i} layer {layer} {}: {:.2} | {:.2}, {:.2}, {:.2} | {:.2}, {:.2} | {:.2} ({} blocks)", KIND_NAMES[kind], f[1], f[2], f[3], f[4], f[5], f[6], f[7], l.end.len());
            }
        }
        layer += usize::from(kind == 4);
        prev_end = Some(end);
    }
    let mut out = String::from("fused step trace, µs per launch (mean over layers): kind: span | first start, median start, first wait after the previous end | median stage, work | tail");
    for (name, s) in KIND_NAMES.iter().zip(&sums) {
        if s[0] > 0.0 {
            let n = s[0];
            out += &format!("\n  {name}: {:.2} | {:.2}, {:.2}, {:.2} | {:.2}, {:.2} | {:.2}", s[1] / n, s[2] / n, s[3] / n, s[4] / n, s[5] / n, s[6] / n, s[7] / n);
        }
    }
    out + &lines
}

/// The step's first block start among the trace's records (5 words each, the start first).
fn trace_start(records: &[u64]) -> u64 {
    records.chunks_exact(5).map(|r| r[0]).min().unwrap_or(0)
}

/// The trace's block records, one line each (`SHOAL_FUSED_TRACE_DUMP=FILE` writes them): launch,
/// kind, SM, block, then start, wait passed, input ready and end in ns from the step's first start.
fn trace_records(records: &[u64], kinds: &[usize]) -> String {
    let t0 = trace_start(records);
    let mut out = String::from("launch kind sm block start waited ready end\n");
    for r in records.chunks_exact(5) {
        let launch = (r[4] >> 32) as usize;
        let kind = kinds.get(launch).map_or("?", |&k| KIND_NAMES[k]);
        let (sm, block) = ((r[4] >> 20) & 0xFFF, r[4] & 0xFFFFF);
        let [start, waited, ready, end] = [r[0], r[1], r[2], r[3]].map(|t| t.saturating_sub(t0));
        out += &format!("{launch} {kind} {sm} {block} {start} {waited} {ready} {end}\n");
    }
    out
}

/// A captured step. CUDA graph handles may move between threads; they must not be used from two
/// at once, which the mutex around `Buffers` rules out.
struct Captured(CudaGraph);
// SAFETY: only reached through `FusedDecode::buffers`' mutex (see above).
unsafe impl Send for Captured {}

/// Where a step's input comes from.
#[derive(Clone, Copy)]
enum TokenSource {
    /// The row in `Buffers::x` (`step`).
    Row,
    /// A token id the host knows (`step_token`, a chain's first step).
    Host(u32),
    /// The id a `DeviceChain`'s previous pick wrote at this device address.
    Device(u64),
}

/// One sequence decoded with each next token picked on the GPU (greedy: by the LM head's launch,
/// `Pick`; a temperature draw: by `pick_token` after the step) and fed from
/// there into the following step, so that the host queues a step before it has read the token
/// its input is: the GPU never idles between steps for the host's round trip.
/// Steps `k` and `k + 1` write their picks into alternate words of mapped page-locked memory;
/// the host reads step `k`'s once its event has fired (`picked`), before it queues `k + 2`.
pub struct DeviceChain {
    stream: Arc<CudaStream>,
    /// The latest pick, where the next step's embedding reads it.
    next: CudaSlice<u32>,
    /// Two words, mapped: the picks of even and odd steps (held for `host_ptr`, `host_dev`).
    _host: PinnedHostSlice<u32>,
    host_ptr: *const u32,
    host_dev: u64,
    done: [CudaEvent; 2],
    /// Steps queued so far.
    queued: u64,
    pick: CudaFunction,
    vocab: i32,
}

// SAFETY: `host_ptr` points into `_host`, which the chain owns; nothing else aliases it.
unsafe impl Send for DeviceChain {}

impl DeviceChain {
    /// Waits for step `k`'s pick (`queue_chained`'s number), which must be one of the last two
    /// queued, and returns the token.
    pub fn picked(&self, k: u64) -> Result<u32> {
        if k >= self.queued || k + 2 < self.queued {
            return Err(EngineError::Shard(format!("step {k} of a chain with {} queued has no pick to read", self.queued)));
        }
        self.done[(k % 2) as usize].synchronize().map_err(driver)?;
        // SAFETY: word k % 2 of the two in `host`; the event says the pick that wrote it is done.
        Ok(unsafe { std::ptr::read_volatile(self.host_ptr.add((k % 2) as usize)) })
    }
}

impl Drop for DeviceChain {
    /// Queued steps may still write the pick words (and the caches): wait for them first.
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
    }
}

pub struct FusedDecode {
    stream: Arc<CudaStream>,
    /// The `mv` instances the launches use, by name.
    mv: HashMap<&'static str, CudaFunction>,
    attend: CudaFunction,
    /// `attend_split`: a head's keys over several blocks (long contexts; `attend_splits`).
    attend_split: CudaFunction,
    /// `attend_group`: a KV head's keys over several blocks for all its query heads (long
    /// contexts), where every layer's shape allows it.
    attend_group: Option<GroupAttend>,
    add_norm: CudaFunction,
    embed_row: CudaFunction,
    /// Rows of the embedding table when the step embeds its own token (`Launch::Embed`).
    embed_rows: Option<usize>,
    device: Device,
    launches: Vec<Launch>,
    /// Per layer: (kv heads, head dim, cache dtype).
    kv: Vec<(usize, usize, DType)>,
    hidden: usize,
    grids: MvGrids,
    attend_threads: u32,
    /// Long contexts split each head's attention over up to `attend_max_splits` blocks, about
    /// `attend_split_keys` keys each (`attend_splits`).
    attend_max_splits: u32,
    attend_split_keys: u32,
    /// f16/bf16 warps load their first rows before waiting for the previous kernel (H100s, eight
    /// alternating pairs: 7B f16 decode +0.2-1.9%, 1.5B +2.3-7.4%); `SHOAL_FUSED_PRELOAD=0` pulls
    /// only their start into L2.
    preload: bool,
    /// `launch_kinds` of `launches`.
    kinds: Vec<usize>,
    /// The LM head's launch picks greedy chained tokens itself (`Pick`).
    fused_pick: bool,
    /// `SHOAL_FUSED_TRACE=2`: the trace prints every launch's line too.
    trace_each_launch: bool,
    /// Launch with programmatic stream serialization (sm_90 on): a kernel's blocks may start
    /// while the previous kernel finishes (the kernels wait before reading its results).
    overlap: bool,
    /// The step's carveout (`step_carveout`), set on each of its launches (not on the module's
    /// functions, which every step in the process shares).
    carveout: Option<u32>,
    buffers: Mutex<Buffers>,
    /// f32 copies of norms and biases, rope tables and scratch buffers the launches point into.
    _keep: Vec<Tensor>,
    enabled: AtomicBool,
    use_graph: bool,
    /// `SHOAL_FUSED_PROFILE=1`: no graph; every launch is timed with CUDA events by its place in
    /// the layer, and the totals are printed every 64 steps (a diagnostic).
    profile: Option<Mutex<(u64, Vec<std::time::Duration>)>>,
}

fn unsupported(why: impl Into<String>) -> EngineError {
    EngineError::Device(why.into())
}

fn driver(e: impl std::fmt::Display) -> EngineError {
    EngineError::Device(format!("cuda: {e}"))
}

/// The device address of a contiguous CUDA tensor's first element.
fn tensor_ptr(t: &Tensor) -> Result<u64> {
    if !t.is_contiguous() {
        return Err(unsupported("tensor is not contiguous"));
    }
    element_ptr(t)
}

/// The device address of a CUDA tensor's first element, whatever its layout.
fn element_ptr(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else { return Err(unsupported("tensor is not on a CUDA device")) };
    let stream = cs.device.cuda_stream();
    let base = match t.dtype() {
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::F16 => cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        other => return Err(unsupported(format!("no kernels for {other:?} tensors"))),
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

/// Page-locked host memory for a row of logits (`copy_to_pinned`).
pub type PinnedRow = PinnedHostSlice<f32>;

/// Copies a row of logits on a GPU into `buf` (page-locked, allocated or grown when too small,
/// then reused: a copy into pageable memory goes through the driver's staging buffers) and
/// returns the row.
pub fn copy_to_pinned<'a>(logits: &Tensor, buf: &'a mut Option<PinnedRow>) -> Result<&'a mut [f32]> {
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let n = logits.elem_count();
    let (storage, layout) = logits.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else { return Err(unsupported("logits are not on a CUDA device")) };
    let stream = cs.device.cuda_stream();
    let row = cs.as_cuda_slice::<f32>()?.slice(layout.start_offset()..layout.start_offset() + n);
    if buf.as_ref().is_none_or(|b| b.len() < n) {
        // Flags 0: cached memory (cudarc's default, write-combined, is slow for the CPU to read).
        // SAFETY: the buffer is written by the copy below before anything reads it.
        *buf = Some(unsafe { stream.context().alloc_pinned_with_flags::<f32>(n, 0) }.map_err(driver)?);
    }
    let Some(host) = buf.as_mut() else { return Err(unsupported("no page-locked buffer")) };
    stream.memcpy_dtoh(&row, host).map_err(driver)?;
    // candle leaves stream synchronisation to its users, so the buffer's own event is never
    // recorded: wait for the stream.
    stream.synchronize().map_err(driver)?;
    Ok(&mut host.as_mut_slice().map_err(driver)?[..n])
}

/// A kernel of decode.cu that reads a row of logits, its stream, and the row as contiguous f32.
fn row_kernel(logits: &Tensor, name: &str) -> Result<(CudaFunction, Arc<CudaStream>, Tensor)> {
    let cuda = logits.device().as_cuda_device()?;
    let f = cuda.get_or_load_custom_func(name, MODULE, PTX)?.into_cuda_function();
    Ok((f, cuda.cuda_stream(), logits.to_dtype(DType::F32)?.contiguous()?))
}

/// Runs `name`, a one-block kernel of decode.cu taking (logits, n, [temperature, r,] out) that
/// writes one token id to `out`, over a row of logits on a GPU; only that id is copied to the host.
fn row_pick(logits: &Tensor, name: &str, draw: Option<(f32, f64)>) -> Result<u32> {
    let (f, stream, logits) = row_kernel(logits, name)?;
    let (ptr, n) = (tensor_ptr(&logits)?, logits.elem_count() as i32);
    let mut out = stream.alloc_zeros::<u32>(1).map_err(driver)?;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&ptr).arg(&n);
    if let Some((temperature, r)) = &draw {
        launch.arg(temperature).arg(r);
    }
    launch.arg(&mut out);
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's (a pointer to `n` f32 values kept alive by
    // `logits`, n, the draw's temperature and r where it takes them, one u32 out).
    unsafe { launch.launch(cfg) }.map_err(driver)?;
    // A copy into pageable memory returns once it is done, after the kernel (stream order).
    let id = stream.clone_dtoh(&out).map_err(driver)?;
    id.first().copied().ok_or_else(|| unsupported("no token came back"))
}

/// Per CUDA device (candle's id: one stream each), the f16 scratch that prompts' dequantized
/// matrices are written into (`with_dequantized_f16`): grown to the largest matrix, then reused.
static DEQUANT_SCRATCH: Mutex<Vec<(DeviceId, Tensor)>> = Mutex::new(Vec::new());

/// The device address of a CUDA tensor's first element, its rows (every dimension but the
/// last, collapsed), its row length and the elements between rows; None unless its last
/// dimension is contiguous and its rows evenly spaced (a contiguous tensor, or a view of some
/// of each row's columns).
fn strided_rows(t: &Tensor) -> Result<Option<(u64, usize, usize, usize)>> {
    let (dims, strides) = (t.dims(), t.stride());
    let Some((&cols, lead)) = dims.split_last() else { return Ok(None) };
    let rank = dims.len();
    if rank < 2 || strides[rank - 1] != 1 || (0..rank - 2).any(|d| strides[d] != strides[d + 1] * dims[d + 1]) {
        return Ok(None);
    }
    if !t.device().is_cuda() || !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        return Ok(None);
    }
    Ok(Some((element_ptr(t)?, lead.iter().product(), cols, strides[rank - 2])))
}

/// The `attention_softmax_*` or `gated_product_*` instance for `dtype`.
fn prompt_kernel(cuda: &candle_core::CudaDevice, name: &str, dtype: DType) -> Result<CudaFunction> {
    let suffix = match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => return Err(unsupported(format!("no prompt kernels for {other:?}"))),
    };
    Ok(cuda.get_or_load_custom_func(&format!("{name}_{suffix}"), MODULE, PTX)?.into_cuda_function())
}

/// A prompt's attention scores, `(.., rows, keys)` raw from q·kᵀ (rows query-fastest over `t`
/// queries at positions `start..`, keys at `first_key..`), turned into probabilities in place:
/// times `scale`, soft-capped by `softcap`, the keys a query may not see (later ones, and with
/// `window` those `window` or more behind) left out, softmax in f32 (`attention_softmax_*`, one
/// pass for what candle's ops did in four plus a mask built per layer). None off a GPU.
pub fn attention_softmax(scores: &Tensor, t: usize, start: usize, first_key: usize, window: Option<usize>, scale: f64, softcap: Option<f64>) -> Result<Option<Tensor>> {
    let Device::Cuda(cuda) = scores.device() else { return Ok(None) };
    if !scores.is_contiguous() {
        return Ok(None);
    }
    let Some((ptr, rows, keys, _)) = strided_rows(scores)? else { return Ok(None) };
    if t == 0 || rows % t != 0 || rows > u32::MAX as usize || keys > i32::MAX as usize {
        return Ok(None);
    }
    let f = prompt_kernel(cuda, "attention_softmax", scores.dtype())?;
    let stream = cuda.cuda_stream();
    let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let (keys, t, start, first_key) = (keys as i32, t as i32, start as i64, first_key as i64);
    let (window, scale, softcap) = (window.map_or(0, |w| w.min(i32::MAX as usize)) as i32, scale as f32, softcap.unwrap_or(0.0) as f32);
    let mut launch = stream.launch_builder(&f);
    launch.arg(&ptr).arg(&keys).arg(&t).arg(&start).arg(&first_key).arg(&window).arg(&scale).arg(&softcap);
    // SAFETY: `ptr` is the contiguous rows × keys of `scores` on this stream, which this call's
    // caller owns alone (a product it just made).
    unsafe { launch.launch(cfg) }.map_err(driver)?;
    Ok(Some(scores.clone()))
}

/// `act(gate) * up` in one pass (`gated_product_*`, in f32, rounded once) for views of one
/// stacked product or separate tensors, `(.., cols)` each with evenly spaced rows; a new
/// contiguous tensor of their shape. None off a GPU or for other layouts.
pub fn gated_product(gate: &Tensor, up: &Tensor, act: Activation) -> Result<Option<Tensor>> {
    let Device::Cuda(cuda) = gate.device() else { return Ok(None) };
    if gate.shape() != up.shape() || gate.dtype() != up.dtype() {
        return Ok(None);
    }
    let (Some((g, rows, cols, gs)), Some((u, _, _, us))) = (strided_rows(gate)?, strided_rows(up)?) else { return Ok(None) };
    let f = prompt_kernel(cuda, "gated_product", gate.dtype())?;
    let stream = cuda.cuda_stream();
    let n = rows * cols;
    let storage = match gate.dtype() {
        // SAFETY (each): the kernel below writes all n elements before anything reads them.
        DType::F32 => candle_core::CudaStorage::wrap_cuda_slice(unsafe { stream.alloc::<f32>(n) }.map_err(driver)?, cuda.clone()),
        DType::F16 => candle_core::CudaStorage::wrap_cuda_slice(unsafe { stream.alloc::<half::f16>(n) }.map_err(driver)?, cuda.clone()),
        DType::BF16 => candle_core::CudaStorage::wrap_cuda_slice(unsafe { stream.alloc::<half::bf16>(n) }.map_err(driver)?, cuda.clone()),
        _ => return Ok(None),
    };
    let out = Tensor::from_storage(Storage::Cuda(storage), gate.shape().clone(), candle_core::op::BackpropOp::none(), false);
    let o = tensor_ptr(&out)?;
    let (rows_arg, cols_arg, gs, us) = (rows as i64, cols as i32, gs as i64, us as i64);
    let mode: i32 = match act {
        Activation::Silu => 2,      // MODE_SILU
        Activation::GeluTanh => 3,  // MODE_GELU_TANH
    };
    let cfg = LaunchConfig { grid_dim: (n.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut launch = stream.launch_builder(&f);
    launch.arg(&g).arg(&u).arg(&o).arg(&rows_arg).arg(&cols_arg).arg(&gs).arg(&us).arg(&mode);
    // SAFETY: `g` and `u` address rows × cols values `gs` and `us` apart, `o` n contiguous ones,
    // all on this stream.
    unsafe { launch.launch(cfg) }.map_err(driver)?;
    Ok(Some(out))
}

/// Frees every device's dequantization scratch (when no model is loaded any more: the next
/// prompt's first matrix allocates it again). Freed in stream order, after the work that read it.
pub fn release_dequant_scratch() {
    DEQUANT_SCRATCH.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
}

/// decode.cu's kernel that dequantizes `dtype` to f16 for `with_dequantized_f16`; None for formats
/// it leaves to candle.
pub fn dequant_kernel(dtype: GgmlDType) -> Option<&'static str> {
    match dtype {
        GgmlDType::Q4K => Some("dequant_q4_k_f16"),
        GgmlDType::Q6K => Some("dequant_q6_k_f16"),
        _ => None,
    }
}

/// Runs `multiply` on Q4_K or Q6_K matrices on a GPU dequantized to f16 (`dequant_q4_k_f16` /
/// `dequant_q6_k_f16` in decode.cu: the values candle's CPU dequantization gives, rounded to f16)
/// and stacked by rows in the order given (matrices with one input, such as q/k/v or gate/up, then
/// take one GEMM), for a prompt's matrix products through cuBLAS; None when one of them is in
/// another format (candle dequantizes those), their widths differ, or they are not on a GPU. The
/// stack lands in the device's scratch, which `multiply` must only read, and only through work it
/// queues on the device's stream before returning (candle's ops do): the next stack overwrites it
/// in stream order. One H200 (session 45): 0.051 ms for a 7B gate's Q4_K into the scratch
/// against 0.176 for candle's kernel (one half stored at a time, and a new tensor); with a new
/// tensor for each matrix, the 1.5B Q4_K_M's 256-token prompt ran 24-30% slower than through MMQ,
/// with the scratch as fast.
pub fn with_dequantized_f16<R>(qs: &[&QTensor], multiply: impl FnOnce(&Tensor) -> Result<R>) -> Result<Option<R>> {
    // `SHOAL_DEQUANT_KERNEL=candle`: candle's kernels for these too (an A/B aid).
    if std::env::var("SHOAL_DEQUANT_KERNEL").is_ok_and(|v| v == "candle") {
        return Ok(None);
    }
    let Some(first) = qs.first() else { return Ok(None) };
    let Device::Cuda(cuda) = first.device() else { return Ok(None) };
    let Ok((_, cols)) = first.shape().dims2() else { return Ok(None) };
    let mut parts = Vec::with_capacity(qs.len());
    for q in qs {
        let Some(name) = dequant_kernel(q.dtype()) else { return Ok(None) };
        match (q.device(), q.shape().dims2()) {
            (Device::Cuda(c), Ok((rows, c_cols))) if c.id() == cuda.id() && c_cols == cols && (rows * cols) % 256 == 0 => parts.push((name, *q, rows * cols)),
            _ => return Ok(None),
        }
    }
    let n: usize = parts.iter().map(|p| p.2).sum();
    let stream = cuda.cuda_stream();
    // Held until `multiply` has queued its work: another thread's matrix waits for the scratch.
    let mut scratch = DEQUANT_SCRATCH.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let at = scratch.iter().position(|(id, _)| *id == cuda.id());
    let at = match at {
        Some(at) if scratch[at].1.elem_count() >= n => at,
        _ => {
            // A grown scratch replaces the old one, which is freed in stream order, after the
            // work that read it.
            // SAFETY: the kernels below write every element this call reads.
            let grown = unsafe { stream.alloc::<half::f16>(n) }.map_err(driver)?;
            let storage = candle_core::CudaStorage::wrap_cuda_slice(grown, cuda.clone());
            let grown = Tensor::from_storage(Storage::Cuda(storage), n, candle_core::op::BackpropOp::none(), false);
            match at {
                Some(at) => {
                    scratch[at].1 = grown;
                    at
                }
                None => {
                    scratch.push((cuda.id(), grown));
                    scratch.len() - 1
                }
            }
        }
    };
    let dense = &scratch[at].1;
    let mut dst = tensor_ptr(dense)?;
    for (name, q, values) in parts {
        let f = cuda.get_or_load_custom_func(name, MODULE, PTX)?.into_cuda_function();
        let (src, blocks) = (q.device_ptr()? as u64, (values / 256) as i64);
        let threads = blocks as u64 * 32; // a warp a block of 256 values
        let cfg = LaunchConfig { grid_dim: (threads.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut launch = stream.launch_builder(&f);
        launch.arg(&src).arg(&dst).arg(&blocks);
        // SAFETY: `src` holds `blocks` blocks of the kernel's format and `dst` room for 256 halves
        // for each (the scratch holds every part's values, in order), both on this stream.
        unsafe { launch.launch(cfg) }.map_err(driver)?;
        dst += 2 * values as u64;
    }
    multiply(&dense.narrow(0, 0, n)?.reshape((n / cols, cols))?).map(Some)
}

/// The first of the largest logits of a row on a GPU (`argmax_row` in decode.cu, the CPU
/// sampler's `argmax`).
pub fn argmax(logits: &Tensor) -> Result<u32> {
    row_pick(logits, "argmax_row", None)
}

/// Draws a token from a row of logits on a GPU (`sample_temperature` in decode.cu): the CPU
/// sampler's plain temperature draw (no top-k, top-p, min-p or penalties) with its uniform draw
/// `r` in [0, 1), where the logits are.
pub fn sample_temperature(logits: &Tensor, temperature: f32, r: f64) -> Result<u32> {
    row_pick(logits, "sample_temperature", Some((temperature, r)))
}

/// The candidates of a sampled step with top-k, top-p or min-p, gathered on the GPU
/// (`sample_candidates` in decode.cu) as `Sampler::distribution` gathers them before its cuts:
/// the total weight of every token and the candidates in token order, or `None` when more than
/// `cap` tokens pass (the caller then takes the whole row).
pub fn sample_candidates(logits: &Tensor, temperature: f32, top_k: Option<usize>, top_p: f32, min_p: f32, cap: usize) -> Result<Option<(f64, Vec<(u32, f32)>)>> {
    let (f, stream, logits) = row_kernel(logits, "sample_candidates")?;
    let (ptr, n) = (tensor_ptr(&logits)?, logits.elem_count() as i32);
    let (top_k, cap_i32) = (top_k.map_or(0, |k| k.min(i32::MAX as usize) as i32), cap.min(i32::MAX as usize / 2) as i32);
    let mut out = stream.alloc_zeros::<u32>(4 + 2 * cap_i32 as usize).map_err(driver)?;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&ptr).arg(&n).arg(&temperature).arg(&top_k).arg(&top_p).arg(&min_p).arg(&cap_i32).arg(&mut out);
    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match the kernel's; `out` holds 4 + 2·cap words.
    unsafe { launch.launch(cfg) }.map_err(driver)?;
    let head = stream.clone_dtoh(&out.slice(0..4)).map_err(driver)?;
    let (count, total) = (head[0] as usize, f64::from_bits(u64::from(head[2]) | (u64::from(head[3]) << 32)));
    if count > cap_i32 as usize {
        return Ok(None);
    }
    if count == 0 {
        return Ok(Some((total, Vec::new())));
    }
    let body = stream.clone_dtoh(&out.slice(4..4 + 2 * count)).map_err(driver)?;
    Ok(Some((total, body.chunks_exact(2).map(|c| (c[0], f32::from_bits(c[1]))).collect())))
}

/// (rows, cols) of a linear layer's matrix as candle holds it on the GPU.
fn shape(l: &Linear) -> Result<(usize, usize)> {
    match &l.weight {
        Matrix::Candle(QMatMul::QTensor(q)) => Ok(q.shape().dims2()?),
        Matrix::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => Ok(t.dims2()?),
        Matrix::Packed(_) => Err(unsupported("weights are packed for the CPU")),
    }
}

fn dense_fmt(dtype: DType) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(FMT_F32),
        DType::F16 => Ok(FMT_F16),
        DType::BF16 => Ok(FMT_BF16),
        other => Err(unsupported(format!("no kernels for {other:?} activations"))),
    }
}

/// `embed_row`'s arguments for a table whose rows it can take exactly as `EmbeddingTable::lookup`
/// and `Shard::forward` produce them (the same dequantization, no rounding to a narrower compute
/// type, the scale applied in f32), else None: then the caller embeds.
fn embed_args(table: &EmbeddingTable, scale: Option<f64>, dtype: DType, hidden: usize) -> Result<Option<EmbedArgs>> {
    let (ptr, fmt, stored) = match table {
        EmbeddingTable::Dense(t) if t.is_contiguous() && matches!(t.dims(), [_, h] if *h == hidden) => match dense_fmt(t.dtype()) {
            Ok(fmt) => (tensor_ptr(t)?, fmt, t.dtype()),
            Err(_) => return Ok(None),
        },
        EmbeddingTable::Quantized(q) if q.shape().dims().get(1) == Some(&hidden) => match q.dtype() {
            GgmlDType::Q8_0 => (q.device_ptr()? as u64, FMT_Q8_0, DType::F32),
            GgmlDType::Q4K => (q.device_ptr()? as u64, FMT_Q4_K, DType::F32),
            GgmlDType::Q6K => (q.device_ptr()? as u64, FMT_Q6_K, DType::F32),
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    if stored != dtype || (scale.is_some() && dtype != DType::F32) {
        return Ok(None);
    }
    Ok(Some(EmbedArgs { table: ptr, fmt, cols: hidden as i32, scale: scale.unwrap_or(1.0) as f32, ..EmbedArgs::default() }))
}

/// Whether a matrix's weights are f16 or bf16 (the rows `mv_f16` / `mv_bf16` read).
fn sixteen_bit(l: &Linear) -> bool {
    match &l.weight {
        Matrix::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => matches!(t.dtype(), DType::F16 | DType::BF16),
        Matrix::Candle(QMatMul::QTensor(q)) => matches!(q.dtype(), GgmlDType::F16 | GgmlDType::BF16),
        Matrix::Packed(_) => false,
    }
}

/// Builds launches, keeping what they point into alive.
struct Planner<'a> {
    device: &'a Device,
    keep: Vec<Tensor>,
    max_smem: usize,
    /// The most shared memory a block may have on this GPU.
    smem_limit: usize,
    grids: MvGrids,
    /// This GPU's SMs, and the shared memory of each (all of it, and what each block reserves).
    sms: u32,
    smem_per_sm: usize,
    smem_reserved: usize,
}

/// `attend_group` (decode.cu): long contexts' attention, a block per KV head and run of its keys.
struct GroupAttend {
    function: CudaFunction,
    /// Blocks a KV head's keys are shared out over: as many as fit on the GPU at once (two an SM
    /// at most, its launch bounds), over every KV head, at most `GRP_MAX_SPLITS`.
    max_splits: u32,
    /// Fewest keys a block takes (`SHOAL_FUSED_ATTEND_GROUP_KEYS`).
    split_keys: u32,
}

impl GroupAttend {
    /// The grouped kernel where every layer's attention fits it (`group_splits`), else `None`:
    /// long contexts then split each query head instead (`attend_split`).
    /// `SHOAL_FUSED_ATTEND_GROUP=0` turns it off.
    fn plan(launches: &[Launch], p: &Planner, function: CudaFunction) -> Result<Option<Self>> {
        let attends: Vec<&AttnArgs> = launches.iter().filter_map(|l| if let Launch::Attend { args } = l { Some(args) } else { None }).collect();
        let static_smem = function.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).map_err(driver)? as usize;
        let Some(most_splits) = group_splits(&attends, p.sms, p.smem_per_sm, p.smem_reserved, p.smem_limit, static_smem) else {
            return Ok(None);
        };
        let max_splits = tuned("ATTEND_GROUP_SPLITS", most_splits).min(most_splits);
        if tuned("ATTEND_GROUP", 1) == 0 || max_splits < 2 {
            return Ok(None);
        }
        let most = attends.iter().map(|a| group_smem(a)).max().unwrap_or(0);
        function.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, most as i32).map_err(driver)?;
        Ok(Some(GroupAttend { function, max_splits, split_keys: tuned("ATTEND_GROUP_KEYS", 32).max(1) }))
    }
}

impl Planner<'_> {
    /// An f32 copy of a vector on the device, and its address.
    fn vector(&mut self, t: &Tensor) -> Result<u64> {
        let t = t.to_dtype(DType::F32)?.contiguous()?;
        let p = tensor_ptr(&t)?;
        self.keep.push(t);
        Ok(p)
    }

    fn scratch(&mut self, n: usize) -> Result<u64> {
        let t = Tensor::zeros(n, DType::F32, self.device)?;
        let p = tensor_ptr(&t)?;
        self.keep.push(t);
        Ok(p)
    }

    /// One matrix as a segment, with its input width.
    fn seg(&mut self, l: &Linear) -> Result<(Seg, usize)> {
        let (rows, cols) = shape(l)?;
        let (w, fmt) = match &l.weight {
            Matrix::Candle(QMatMul::QTensor(q)) => {
                let fmt = match q.dtype() {
                    GgmlDType::F32 => FMT_F32,
                    GgmlDType::F16 => FMT_F16,
                    GgmlDType::BF16 => FMT_BF16,
                    GgmlDType::Q8_0 => FMT_Q8_0,
                    GgmlDType::Q4K => FMT_Q4_K,
                    GgmlDType::Q6K => FMT_Q6_K,
                    other => return Err(unsupported(format!("no decode kernel for {other:?} weights"))),
                };
                (q.device_ptr()? as u64, fmt)
            }
            Matrix::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => (tensor_ptr(t)?, dense_fmt(t.dtype())?),
            Matrix::Packed(_) => return Err(unsupported("weights are packed for the CPU")),
        };
        // The kernels' vector loads: 16-byte aligned rows of whole blocks.
        let (block, align) = match fmt {
            FMT_F32 => (4, 16),
            FMT_F16 | FMT_BF16 => (8, 16),
            FMT_Q8_0 => (32, 2),
            FMT_Q4_K => (256, 16),
            _ => (256, 2),
        };
        if cols % block != 0 || w % align != 0 {
            return Err(unsupported(format!("a {rows}x{cols} matrix does not fit the kernels' {block}-value rows")));
        }
        let bias = match &l.bias {
            Some(b) => self.vector(b)?,
            None => 0,
        };
        Ok((Seg { w, bias, fmt, rows: rows as i32 }, cols))
    }

    /// `out (=|+=) W·norm(x)` over `parts` stacked by rows.
    fn mv(&mut self, parts: &[&Linear], x: u64, norm: Option<&RmsNorm>, mode: i32, out: u64) -> Result<Launch> {
        let mut args = MvArgs { nseg: parts.len() as i32, x, mode, out, ..MvArgs::default() };
        let mut width = None;
        for (i, l) in parts.iter().enumerate() {
            let (seg, cols) = self.seg(l)?;
            if *width.get_or_insert(cols) != cols {
                return Err(unsupported("stacked matrices differ in width"));
            }
            args.seg[i] = seg;
        }
        let cols = width.unwrap_or(0);
        (args.cols, args.slice) = (cols as i32, cols as i32);
        args.q4k = i32::from(args.seg[..parts.len()].iter().any(|s| s.fmt == FMT_Q4_K));
        if let Some(n) = norm {
            args.norm_w = self.vector(&n.weight)?;
            args.eps = n.eps;
        }
        let rows = if mode == MODE_SILU || mode == MODE_GELU_TANH {
            if args.seg[0].rows != args.seg[1].rows {
                return Err(unsupported("gate and up differ in rows"));
            }
            args.seg[0].rows
        } else {
            args.seg.iter().map(|s| s.rows).sum()
        };
        let fmts: Vec<i32> = args.seg[..parts.len()].iter().map(|s| s.fmt).collect();
        let mut kernel = mv_kernel(mode == MODE_SILU || mode == MODE_GELU_TANH, &fmts);
        // Q4_K gate/up rows stream through each warp's ring in shared memory, multiplied with
        // int8 activations (`mv_gated_q4_k_ring`; `SHOAL_FUSED_RING` stages: 2, or 3; 0 keeps
        // `mv_gated_q4_k` and f32 activations). By default 3 stages where the grid they allow
        // (fewer blocks an SM: more shared memory a block) still gives every warp at least 4 row
        // pairs, else 2. One H100 (session 39, two alternating rounds, `SHOAL_FUSED_RING=3`
        // against 2): 7B Q4_K_M (gate/up 2 blocks an SM, 9 pairs a warp) 433.0 / 434.7 -> 437.7
        // / 440.9 tok/s; 1.5B Q4_K_M (4 blocks an SM either way, 2.1 pairs a warp) 1048.3 /
        // 1062.7 -> 1020.4 / 1007.2; and 2 stages at 2 blocks an SM took the 7B to 406.0 / 403.5.
        let stages = match overridden("RING") {
            Some(n) => n.min(3) as i32,
            None if kernel == "mv_gated_q4_k" => ring_stages(&args, rows as u32, self.sms, self.smem_per_sm, self.smem_reserved, self.smem_limit),
            None => 2,
        };
        let ring = MvArgs { stream: stages, q4k: 0, ..args };
        if kernel == "mv_gated_q4_k" && stages >= 2 && mv_smem(&ring) <= self.smem_limit {
            (args, kernel) = (ring, "mv_gated_q4_k_ring");
        }
        // The other launches whose matrices are all Q4_K, or all Q6_K, take int8 activations too
        // (`q4k` = 2: `dot_q4_k_q8`, `dot_q6_k_q8`): with f32 inputs those kernels were bound by
        // instruction issue, not by memory. `SHOAL_FUSED_RING=0`, or `SHOAL_FUSED_Q4_INT8=0` /
        // `SHOAL_FUSED_Q6_INT8=0` for one format, keep f32 activations.
        // Launches mixing the two (q/k/v where v is Q6_K) take `mv_any_q8` (`SHOAL_FUSED_ANY_INT8=0`: f32).
        let quantized = fmts.iter().all(|&f| f == FMT_Q4_K || f == FMT_Q6_K);
        let int8 = match kernel {
            "mv_q4_k" => tuned("Q4_INT8", 1) != 0,
            "mv_q6_k" => tuned("Q6_INT8", 1) != 0,
            "mv_any" => quantized && tuned("ANY_INT8", 1) != 0,
            _ => false,
        };
        if int8 && stages >= 2 {
            args.q4k = 2;
        }
        // Long rows added into the residual are split over blocks (split-K, see `mv_rows`), so a
        // block stages only its slice of the input and the grid has enough blocks to fill the GPU
        // (`MvGrids::split_slice`: how many). Stored launches with few rows (q/k/v) split too,
        // when `SPLIT_STORE_ROWS` (rows, 0: never) is above theirs (7B f16 q/k/v on an H100, when
        // their rows were split: 22.2 -> 21.0 us); atomic split-K adds need a zeroed output, so
        // there stored launches stay whole. Rows of at most `SPLIT_ABOVE` values (4096) stay
        // whole: 7B q/k/v and o (3584) whole took 7B f16 decode from 179.8 / 179.9 to 183.4 /
        // 183.3 tok/s on an H100 (Q4_K_M unchanged).
        let split_store = mode == MODE_STORE && !atomic_split() && (rows as u32) < tuned("SPLIT_STORE_ROWS", 8192);
        if (mode == MODE_ADD || split_store) && cols > tuned("SPLIT_ABOVE", 4096) as usize {
            args.slice = self.grids.split_slice(kernel, &args, rows as u32);
        }
        self.max_smem = self.max_smem.max(mv_smem(&args));
        Ok(Launch::Mv { args, rows: rows as u32, kernel })
    }

    /// `x += W·input`, or through a post-norm first (`h = W·input; x += norm(h)`, Gemma's blocks).
    fn residual(&mut self, w: &Linear, input: u64, post_norm: Option<&RmsNorm>, x: u64, h: u64, hidden: usize) -> Result<Vec<Launch>> {
        Ok(match post_norm {
            None => vec![self.mv(&[w], input, None, MODE_ADD, x)?],
            Some(n) => {
                let mv = self.mv(&[w], input, None, MODE_STORE, h)?;
                let nw = self.vector(&n.weight)?;
                vec![mv, Launch::AddNorm { x, h, w: nw, n: hidden as i32, eps: n.eps }]
            }
        })
    }
}

impl FusedDecode {
    /// Plans the step for `layers` (and, for a last shard, the final norm and LM head).
    /// An error says why these layers cannot run fused; the caller then keeps candle's path.
    /// `embed`: a first shard's embedding table and scale. Where its format allows, the step
    /// takes token ids (`step_token`) and embeds them itself; otherwise the caller passes
    /// embedded rows (`step`).
    pub fn build(layers: &[DecoderLayer], head: Option<(&RmsNorm, &Linear)>, embed: Option<(&EmbeddingTable, Option<f64>)>, hidden: usize, device: &Device, dtype: DType) -> Result<Self> {
        let cuda = device.as_cuda_device()?;
        let stream = cuda.cuda_stream();
        // One shared-memory carveout for every launch of the step (a launch attribute, so that
        // steps of other models in the process keep theirs), or the driver's choice per kernel.
        let all_16bit = layers.iter().all(|l| [&l.attn.q, &l.attn.k, &l.attn.v, &l.attn.o, &l.mlp.gate, &l.mlp.up, &l.mlp.down].into_iter().all(sixteen_bit))
            && head.is_none_or(|(_, w)| sixteen_bit(w));
        let carveout = step_carveout(std::env::var("SHOAL_FUSED_CARVEOUT").ok().as_deref(), all_16bit, hidden);
        let load = |name: &str| -> Result<CudaFunction> {
            Ok(cuda.get_or_load_custom_func(name, MODULE, PTX)?.into_cuda_function())
        };
        let head_dims: Vec<usize> = layers.iter().map(|l| l.attn.head_dim).collect();
        let (attend, attend_split, add_norm, embed_row) = (load(for_head_dim("attend", &head_dims))?, load("attend_split")?, load("add_norm")?, load("embed_row")?);
        let attend_group = load(for_head_dim("attend_group", &head_dims))?;
        // The dynamic shared memory a block may ask for: the GPU's per-block limit less the
        // kernels' static shared memory (block sums' scratch, the trace marks; under 1 KB).
        let optin = stream.context().attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).map_err(driver)? as usize;
        let optin = optin.saturating_sub(1024);
        let sms = stream.context().attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(driver)? as u32;
        let mv_pairs = tuned("PAIRS", 1) != 0;
        // Unsplit launches in blocks of 512 threads (`SHOAL_FUSED_MV_THREADS=256`: 256): half as
        // many blocks each staging (norming, quantizing) the whole input, each faster. One H100
        // (session 40, two alternating rounds, 64-token prompts): 1.5B f16 684.7 / 687.2 -> 703.2 /
        // 699.5 tok/s, 7B Q4_K_M 447.2 / 447.0 -> 453.7 / 451.0, 1.5B Q4_K_M 1076.7 / 1060.1 ->
        // 1061.7 / 1080.8. Split launches too were slower on the 7B Q4_K_M (445.0 / 444.7 -> 438.0
        // / 434.8): their slice counts are chosen for 8-warp grids.
        let mv_warps = if tuned("MV_THREADS", 512) == 256 { 8 } else { 16 };
        let grids = MvGrids {
            mv_warps,
            mv_blocks: sms * tuned("MV_WAVES", 4),
            ring_blocks: 0,
            mv_pairs,
            q4_pairs: mv_pairs && tuned("Q4_PAIRS", 1) != 0,
            q6_pairs_blocks: if mv_pairs && tuned("Q6_PAIRS", 1) != 0 { sms * 3 } else { 0 },
            q6_pairs_rows: tuned("Q6_PAIRS_ROWS", 4).max(1),
            q6_quads: tuned("Q6_QUADS", 1) != 0,
            o_pairs: false,  // (set once the ring's grid is known, below)
        };
        let smem_per_sm = stream.context().attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR).map_err(driver)? as usize;
        let smem_reserved = stream.context().attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK).map_err(driver)? as usize;
        // Read-ahead (`ahead` in decode.cu): o's blocks pull the first 2 MB of gate/up's rows
        // (`SHOAL_FUSED_AHEAD_KB`: that many KB, half from each matrix; 0: none) into L2 while
        // they wait, HBM's idle time between q/k/v and gate/up; from large f16/bf16 matrices
        // their last 6 MB instead (`SHOAL_FUSED_AHEAD_END_KB`; 0: the first rows everywhere;
        // `read_ahead` has the figures). The first rows on one H100 (session 41, 64-token
        // prompts, alternating rounds, 0 -> 2 MB): 1.5B f16 697.4 / 701.5 / 697.6 -> 708.0 /
        // 707.5 / 703.9 tok/s; 1.5B Q4_K_M 1063.4 / 1065.5 / 1056.4 -> 1048.7 / 1071.6 / 1070.8,
        // 7B Q4_K_M and f16 unchanged. More lost: 8.5 MB 1.5B Q4_K_M 1038.5 / 1049.9, 17 MB
        // 1024.3 / 1024.8 against 1072.3 / 1054.7 (session 40: 25 MB lost on all but the 7B).
        let (ahead, ahead_end) = (tuned("AHEAD_KB", 2048) as usize * 1024, tuned("AHEAD_END_KB", 6144) as usize * 1024);
        let mut p = Planner { device, keep: Vec::new(), max_smem: 0, smem_limit: optin, grids, sms, smem_per_sm, smem_reserved };
        let x_t = Tensor::zeros(hidden, DType::F32, device)?;
        let x = tensor_ptr(&x_t)?;
        // The position, each layer's KV buffers (keys, values, capacity), the tag, the token id
        // and its address, and the greedy pick's words (`Pick`).
        let step = stream.alloc_zeros::<u64>(step_words(layers.len())).map_err(driver)?;
        let step_ptr = step.device_ptr(&stream).0;
        // q/k/v, attention's and gate/up's outputs are tagged (`load_tagged` in decode.cu): the
        // next kernel reads each value as it is written instead of waiting for the last block.
        // `SHOAL_FUSED_TAGS=0` makes every kernel wait for the whole previous one.
        let tag = step_ptr + 8 * (1 + 3 * layers.len() as u64);
        let tags = tuned("TAGS", 1) != 0;
        let tagged = |mut l: Launch, tag_in: bool, tag_out: bool| {
            if let Launch::Mv { args, .. } = &mut l {
                if tags {
                    (args.tag_in, args.tag_out, args.tag) = (i32::from(tag_in), i32::from(tag_out), tag);
                }
            }
            l
        };
        let mut launches = Vec::new();
        let embed_rows = match embed.map(|(table, scale)| embed_args(table, scale, dtype, hidden)).transpose()?.flatten() {
            Some(args) => {
                let token_at = step_ptr + 8 * (3 + 3 * layers.len() as u64);
                launches.push(Launch::Embed { args: EmbedArgs { token_at, out: x, ..args } });
                embed.map(|(table, _)| table.rows())
            }
            None => None,
        };
        // Long contexts: about two blocks an SM over every head at the most, a power of two
        // (`SHOAL_FUSED_ATTEND_SPLITS=1`: one block a head whatever the context).
        let heads = layers.iter().map(|l| l.attn.num_heads as u32).max().unwrap_or(1).max(1);
        let attend_max_splits = tuned("ATTEND_SPLITS", (2 * sms / heads).clamp(1, 32)).clamp(1, 32);
        let attend_max_splits = 1 << attend_max_splits.ilog2();
        let attend_split_keys = tuned("ATTEND_SPLIT_KEYS", 512).max(32);
        let mut kv = Vec::new();
        let h = p.scratch(hidden)?;
        for layer in layers {
            let a = &layer.attn;
            let d = a.head_dim;
            if a.kv_of_head.is_some() || a.num_kv_heads == 0 || a.num_heads % a.num_kv_heads != 0 {
                return Err(unsupported("query heads do not share KV heads evenly"));
            }
            if d % 8 != 0 || d > 256 {
                return Err(unsupported(format!("head dim {d} (the attention kernel takes multiples of 8 up to 256)")));
            }
            // Tagged buffers hold a 64-bit word a value.
            let qkv = p.scratch(2 * (a.num_heads + 2 * a.num_kv_heads) * d)?;
            let attn_out = p.scratch(2 * a.num_heads * d)?;
            launches.push(tagged(p.mv(&[&a.q, &a.k, &a.v], x, Some(&layer.attn_norm), MODE_STORE, qkv)?, false, true));
            let inv_freq = Tensor::new(layer.rope.inv_freq(d), device)?;
            let inv_freq_ptr = tensor_ptr(&inv_freq)?;
            p.keep.push(inv_freq);
            let q_norm = a.q_norm.as_ref().map(|n| p.vector(&n.weight)).transpose()?.unwrap_or(0);
            let k_norm = a.k_norm.as_ref().map(|n| p.vector(&n.weight)).transpose()?.unwrap_or(0);
            let mut args = AttnArgs {
                qkv,
                kv: step_ptr + 8 * (1 + 3 * kv.len() as u64),
                inv_freq: inv_freq_ptr,
                q_norm,
                k_norm,
                pos: step_ptr,
                out: attn_out,
                cache_fmt: dense_fmt(a.kv_dtype)?,
                heads: a.num_heads as i32,
                kv_heads: a.num_kv_heads as i32,
                d: d as i32,
                rope_halves: i32::from(a.rope_style == RopeStyle::Halves),
                window: a.window.unwrap_or(0) as i32,
                scale: a.scale as f32,
                softcap: a.softcap.unwrap_or(0.0) as f32,
                eps: a.q_norm.as_ref().map_or(layer.attn_norm.eps, |n| n.eps),
                tagged: i32::from(tags),
                tag,
                ..AttnArgs::default()
            };
            kv.push((a.num_kv_heads, d, a.kv_dtype));
            let mut o = p.residual(&a.o, attn_out, layer.post_attn_norm.as_ref(), x, h, hidden)?;
            o[0] = tagged(o[0], true, false);
            // Where o multiplies int8 activations over whole rows, attention quantizes its heads'
            // values once (`store_q8_tagged`) instead of each of o's blocks quantizing all of them
            // (`SHOAL_FUSED_ATTN_Q8=0`: o quantizes).
            if let Launch::Mv { args: o_args, .. } = &mut o[0] {
                if tags && o_args.q4k == 2 && o_args.slice == o_args.cols && d % 32 == 0 && tuned("ATTN_Q8", 1) != 0 {
                    (o_args.tag_in, args.out_q8) = (2, 1);
                }
            }
            launches.push(Launch::Attend { args });
            let m = &layer.mlp;
            let act = p.scratch(2 * shape(&m.gate)?.0)?;
            let mode = match m.activation {
                Activation::Silu => MODE_SILU,
                Activation::GeluTanh => MODE_GELU_TANH,
            };
            let gate_up = tagged(p.mv(&[&m.gate, &m.up], x, Some(&layer.ffn_norm), mode, act)?, false, true);
            // o's blocks pull some of gate/up's rows into L2 while they wait for attention.
            if let (Launch::Mv { args: o_args, .. }, Launch::Mv { args: gu, .. }) = (&mut o[0], &gate_up) {
                let (at, bytes) = read_ahead(ahead, ahead_end, gu);
                (o_args.ahead, o_args.ahead_bytes) = ([gu.seg[0].w + at, gu.seg[1].w + at], bytes);
            }
            launches.extend(o);
            launches.push(gate_up);
            let mut down = p.residual(&m.down, act, layer.post_ffn_norm.as_ref(), x, h, hidden)?;
            down[0] = tagged(down[0], true, false);
            launches.extend(down);
        }
        // Each split attention's partial states (as tagged words for the grouped kernel) and
        // counters (after the layers' other buffers, which so lie where they did before splits
        // existed).
        let attend_group = GroupAttend::plan(&launches, &p, attend_group)?;
        let most_splits = attend_max_splits.max(attend_group.as_ref().map_or(1, |g| g.max_splits)) as usize;
        for l in &mut launches {
            if let Launch::Attend { args } = l {
                args.partial = p.scratch(2 * args.heads as usize * most_splits * (args.d as usize + 2))?;
                args.count = p.scratch(args.heads as usize)?;
            }
        }
        let mut logits = None;
        // Greedy chained decoding picks its token in the LM head's own launch (`pick_greedy`),
        // where that launch is one block row; `SHOAL_FUSED_PICK=0` leaves it to `pick_token`.
        let mut fused_pick = false;
        if let Some((norm, lm_head)) = head {
            let t = Tensor::zeros((1, shape(lm_head)?.0), DType::F32, device)?;
            let mut launch = p.mv(&[lm_head], x, Some(norm), MODE_STORE, tensor_ptr(&t)?)?;
            if let Launch::Mv { args, .. } = &mut launch {
                if args.slice >= args.cols && tuned("PICK", 1) != 0 {
                    (args.pick, args.pick_scratch) = (step_ptr + 8 * (step_words(layers.len()) - 3) as u64, p.scratch(4)?);
                    fused_pick = true;
                }
            }
            launches.push(launch);
            logits = Some(t);
        }
        let kinds = launch_kinds(&launches, layers.len());
        // Split-K launches store their partial sums (slices x rows) as tagged words in a buffer
        // of their own, and the last block row of each column adds them up in slice order as they
        // come, so that a seeded run repeats exactly. Words of earlier steps carry older tags, so
        // the buffers need no reset, and a launch reading tagged input may run beside the one
        // before it. `SHOAL_FUSED_ATOMIC_SPLIT=1`: add split-K partial sums atomically instead
        // (about 5% faster decode on an H100, but sums, and so seeded sampling, then vary
        // between runs).
        if !atomic_split() {
            for l in launches.iter_mut() {
                if let Launch::Mv { args, rows, .. } = l {
                    if args.slice < args.cols {
                        let words = (args.cols as usize).div_ceil(args.slice as usize) * *rows as usize;
                        (args.partial, args.tag) = (p.scratch(2 * words)?, tag);
                    }
                }
            }
        }
        // Every block of `mv` stages its (normed) input, or its slice of it, in shared memory.
        let smem = p.max_smem;
        let ctx = stream.context();
        if smem > optin {
            return Err(unsupported(format!("inputs needing {smem} bytes of shared memory per block (the GPU has {optin})")));
        }
        let mut mv = HashMap::new();
        for l in &launches {
            if let Launch::Mv { kernel, .. } = *l {
                // `mv_q4_k` and `mv_q6_k` launches may take their pairs and int8 instances,
                // `mv_any` its int8 one (decided at launch).
                let names: &[&'static str] = match kernel {
                    "mv_q4_k" => &["mv_q4_k", "mv_q4_k_pairs", "mv_q4_k_q8", "mv_q4_k_q8_pairs"],
                    "mv_q6_k" => &["mv_q6_k", "mv_q6_k_q8", "mv_q6_k_q8_pairs", "mv_q6_k_q8_quads"],
                    "mv_any" => &["mv_any", "mv_any_q8"],
                    "mv_gated_q4_k_ring" => &["mv_gated_q4_k_ring", "mv_gated_q4_k_ring_2_run"],
                    _ => &[kernel],
                };
                for &kernel in names {
                    if mv.contains_key(kernel) {
                        continue;
                    }
                    let f = load(kernel)?;
                    f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).map_err(driver)?;
                    mv.insert(kernel, f);
                }
            }
        }
        let major = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).map_err(driver)?;
        // `SHOAL_KERNEL_OVERLAP=0`: launch each kernel only after the previous one (a diagnostic).
        let overlap = major >= 9 && std::env::var("SHOAL_KERNEL_OVERLAP").map_or(true, |v| v != "0");
        // The ring kernel's grid: as many blocks an SM as its shared memory holds at once
        // (`blocks_per_sm_by_smem`). One H100 (session 36, alternating): the 1.5B Q4_K_M's gate/up
        // (29 KB a block) at 4 an SM decoded 964.2 / 967.3 tok/s against 947.9 / 952.5 at 3; the
        // 7B's (68 KB at 2 stages) fit 3 (4 was slower: a second wave), at 3 stages 2.
        let ring_smem = launches.iter().filter_map(|l| match l {
            Launch::Mv { args, kernel: "mv_gated_q4_k_ring", .. } => Some(mv_smem(args)),
            _ => None,
        });
        let ring_per_sm = ring_smem.max().map(|bytes| tuned("RING_WAVES", blocks_per_sm_by_smem(p.smem_per_sm, p.smem_reserved, bytes)));
        let grids = MvGrids { ring_blocks: sms * ring_per_sm.unwrap_or(3), o_pairs: o_in_pairs(ring_per_sm), ..grids };
        let attend_threads = tuned("ATTEND_THREADS", 512).clamp(64, 512) / 32 * 32;
        let use_graph = std::env::var("SHOAL_CUDA_GRAPH").map_or(true, |v| v != "0");
        // `SHOAL_FUSED_DECODE=0` turns the fused step off (a diagnostic).
        let enabled = std::env::var("SHOAL_FUSED_DECODE").map_or(true, |v| v != "0");
        let profile = std::env::var("SHOAL_FUSED_PROFILE").is_ok_and(|v| v == "1").then(|| Mutex::new((0, vec![std::time::Duration::ZERO; KIND_NAMES.len()])));
        // `SHOAL_FUSED_TRACE=1`: the per-kind trace; `=2`: every launch's line too.
        let trace_level = std::env::var("SHOAL_FUSED_TRACE").map_or(0, |v| match v.as_str() {
            "1" => 1,
            "2" => 2,
            _ => 0,
        });
        let trace = match trace_level > 0 {
            true => {
                let mut t = stream.alloc_zeros::<u64>(2 + 5 * TRACE_RECORDS).map_err(driver)?;
                stream.memcpy_htod(&[0, TRACE_RECORDS as u64], &mut t.slice_mut(0..2)).map_err(driver)?;
                Some((t, 0))
            }
            false => None,
        };
        let mut uploads = Vec::with_capacity(UPLOAD_SLOTS);
        for _ in 0..UPLOAD_SLOTS {
            // SAFETY: a slot is written (`queue`) before any copy reads it.
            let staged = unsafe { ctx.alloc_pinned::<u64>(step_words(layers.len())) }.map_err(driver)?;
            uploads.push((staged, ctx.new_event(None).map_err(driver)?));
        }
        Ok(FusedDecode {
            stream,
            mv,
            attend,
            attend_split,
            attend_group,
            add_norm,
            embed_row,
            embed_rows,
            device: device.clone(),
            launches,
            kv,
            hidden,
            grids,
            attend_threads,
            attend_max_splits,
            attend_split_keys,
            preload: tuned("PRELOAD", 1) != 0,
            kinds,
            fused_pick,
            trace_each_launch: trace_level == 2,
            overlap,
            carveout,
            buffers: Mutex::new(Buffers { x: x_t, step, tag: 0, logits, graphs: Vec::new(), trace, uploads, uploaded: 0 }),
            _keep: p.keep,
            enabled: AtomicBool::new(enabled),
            use_graph: use_graph && profile.is_none(),
            profile,
        })
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns the fused step on or off (off: candle's ops decode, for comparisons).
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// Whether the step embeds its own token (`step_token`), rather than taking a row (`step`).
    pub fn takes_tokens(&self) -> bool {
        self.embed_rows.is_some()
    }

    /// One token: `x` is its `(1, 1, hidden)` input. Returns `(1, vocab)` f32 logits for a last
    /// shard, else the `(1, 1, hidden)` f32 hidden state; the cache advances by one position.
    pub fn step(&self, x: &Tensor, cache: &mut ShardCache) -> Result<Tensor> {
        if self.takes_tokens() {
            return Err(EngineError::Shard("this fused step embeds its own tokens".into()));
        }
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let b = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: both buffers are `hidden` f32 values on this device; the copy is in stream order.
        unsafe { candle_core::cuda_backend::cudarc::driver::result::memcpy_dtod_async(tensor_ptr(&b.x)?, tensor_ptr(&x)?, self.hidden * 4, self.stream.cu_stream()) }.map_err(driver)?;
        self.run(b, None, cache)
    }

    /// One token of a first shard (`takes_tokens`): as `step`, embedding token `id` inside the
    /// step (one copy of the step's arguments and one graph launch a token, nothing else).
    pub fn step_token(&self, id: u32, cache: &mut ShardCache) -> Result<Tensor> {
        let rows = self.embed_rows.ok_or_else(|| EngineError::Shard("this fused step takes embedded rows".into()))?;
        check_token_ids(&[id], rows)?;
        let b = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        self.run(b, Some(id), cache)
    }

    /// The step itself, its input in `b.x` or (`token`) to be embedded by its first kernel.
    fn run(&self, mut b: std::sync::MutexGuard<'_, Buffers>, token: Option<u32>, cache: &mut ShardCache) -> Result<Tensor> {
        self.queue(&mut b, token.map_or(TokenSource::Row, TokenSource::Host), Pick::default(), cache)?;
        match &b.logits {
            // The next step overwrites the buffers: hand out a copy.
            Some(l) => Ok(l.copy()?),
            None => Ok(b.x.copy()?.reshape((1, 1, self.hidden))?),
        }
    }

    /// Queues one step on the stream (its arguments, then the captured graph) and counts its
    /// position as written; nothing waits for it.
    fn queue(&self, b: &mut Buffers, input: TokenSource, pick: Pick, cache: &mut ShardCache) -> Result<()> {
        let pos = cache.position();
        let mut step = Vec::with_capacity(step_words(self.kv.len()));
        step.push(pos as u64);
        for (lc, &(kv_heads, d, dtype)) in cache.layers.iter_mut().zip(&self.kv) {
            let (k, v) = lc.reserve(pos + 1, kv_heads, d, dtype, &self.device)?;
            step.extend([tensor_ptr(k)?, tensor_ptr(v)?, k.dim(2)? as u64]);
        }
        // A tag no value of the last 2^32 - 1 steps carries (0 is the zeroed buffers').
        b.tag = b.tag.checked_add(1).unwrap_or(1);
        step.push(u64::from(b.tag));
        let own_word = b.step.device_ptr(&self.stream).0 + 8 * step.len() as u64;
        let (token, token_at) = match input {
            TokenSource::Row => (0, 0),
            TokenSource::Host(id) => (id, own_word),
            TokenSource::Device(at) => (0, at),
        };
        step.extend([u64::from(token), token_at, pick.next, pick.host, pick.vocab]);
        let Buffers { uploads, uploaded, step: args, .. } = &mut *b;
        let (staged, copied) = &mut uploads[*uploaded % UPLOAD_SLOTS];
        *uploaded += 1;
        // The copy from this slot UPLOAD_SLOTS uploads ago has long run; make sure.
        copied.synchronize().map_err(driver)?;
        staged.as_mut_slice().map_err(driver)?[..step.len()].copy_from_slice(&step);
        self.stream.memcpy_htod(staged, args).map_err(driver)?;
        copied.record(&self.stream).map_err(driver)?;
        let trace = match &mut b.trace {
            Some((t, _)) => {
                self.stream.memcpy_htod(&[0u64], &mut t.slice_mut(0..1)).map_err(driver)?;
                t.device_ptr(&self.stream).0
            }
            None => 0,
        };
        let splits = self.attend_splits(pos + 1);
        if self.use_graph && !b.graphs.iter().any(|(n, _)| *n == splits) {
            self.stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(driver)?;
            let launched = self.launch_all(trace, splits);
            let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(driver);
            launched?;
            if let Some(g) = graph? {
                b.graphs.push((splits, Captured(g)));
            }
        }
        match b.graphs.iter().find(|(n, _)| *n == splits) {
            Some((_, g)) => g.0.launch().map_err(driver)?,
            None => self.launch_all(trace, splits)?,
        }
        if let Some((t, steps)) = &mut b.trace {
            *steps += 1;
            if *steps % 64 == 32 {
                let head = self.stream.clone_dtoh(&t.slice(0..1)).map_err(driver)?;
                let n = (head[0] as usize).min(TRACE_RECORDS);
                let records = self.stream.clone_dtoh(&t.slice(2..2 + 5 * n)).map_err(driver)?;
                eprintln!("{}", trace_summary(&records, &self.kinds, self.trace_each_launch));
                if let Ok(path) = std::env::var("SHOAL_FUSED_TRACE_DUMP") {
                    if let Err(e) = std::fs::write(&path, trace_records(&records, &self.kinds)) {
                        eprintln!("SHOAL_FUSED_TRACE_DUMP: cannot write {path}: {e}");
                    }
                }
            }
        }
        for lc in cache.layers.iter_mut() {
            lc.advance(1);
        }
        Ok(())
    }

    /// A sequence decoded by `queue_chained` from a whole model's step (it embeds its tokens and
    /// ends with logits), picking among the first `vocab` logits.
    pub fn chain(&self, vocab: usize) -> Result<DeviceChain> {
        let logits = self.buffers.lock().unwrap_or_else(|e| e.into_inner()).logits.as_ref().map(Tensor::elem_count);
        if !self.takes_tokens() || logits.is_none_or(|n| n < vocab) || vocab == 0 {
            return Err(unsupported("only a whole model's step picks its own next token"));
        }
        let cuda = self.device.as_cuda_device()?;
        let pick = cuda.get_or_load_custom_func("pick_token", MODULE, PTX)?.into_cuda_function();
        let ctx = self.stream.context();
        // Mapped, so that `pick_token` writes the id straight into it (no copy queued behind it).
        // SAFETY: each word is written by a pick before the host reads it (`picked`).
        let host = unsafe { ctx.alloc_pinned_with_flags::<u32>(2, sys::CU_MEMHOSTALLOC_DEVICEMAP) }.map_err(driver)?;
        let mut host_dev: sys::CUdeviceptr = 0;
        let host_ptr = host.as_ptr().map_err(driver)?;
        // SAFETY: `host_ptr` was allocated by cuMemHostAlloc with DEVICEMAP in this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut host_dev, host_ptr as *mut c_void, 0) }.result().map_err(driver)?;
        Ok(DeviceChain {
            stream: self.stream.clone(),
            next: self.stream.alloc_zeros::<u32>(1).map_err(driver)?,
            _host: host,
            host_ptr,
            host_dev,
            done: [ctx.new_event(None).map_err(driver)?, ctx.new_event(None).map_err(driver)?],
            queued: 0,
            pick,
            vocab: vocab as i32,
        })
    }

    /// Queues a step of `chain`'s sequence and the pick of the token after it (temperature 0:
    /// the argmax; else a draw with `r`), without waiting for anything: its input is `token`, or
    /// (None) the token the previous queued step picks. Returns the step's number for `picked`.
    pub fn queue_chained(&self, chain: &mut DeviceChain, token: Option<u32>, temperature: f32, r: f64, cache: &mut ShardCache) -> Result<u64> {
        if !Arc::ptr_eq(&chain.stream, &self.stream) {
            return Err(unsupported("a chain decodes on the stream it was made for"));
        }
        let input = match token {
            Some(id) => {
                check_token_ids(&[id], self.embed_rows.unwrap_or(0))?;
                TokenSource::Host(id)
            }
            None if chain.queued == 0 => return Err(EngineError::Shard("a chain's first step needs its token".into())),
            None => TokenSource::Device(chain.next.device_ptr(&self.stream).0),
        };
        let k = chain.queued;
        let (next, host) = (chain.next.device_ptr(&self.stream).0, chain.host_dev + 4 * (k % 2));
        // Greedy: the LM head's launch picks (`Pick`); otherwise `pick_token` after the step.
        let in_head = temperature == 0.0 && self.fused_pick;
        let pick = if in_head { Pick { next, host, vocab: chain.vocab as u64 } } else { Pick::default() };
        let mut b = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        self.queue(&mut b, input, pick, cache)?;
        if !in_head {
            let logits = tensor_ptr(b.logits.as_ref().ok_or_else(|| unsupported("this step ends without logits"))?)?;
            let mut launch = self.stream.launch_builder(&chain.pick);
            launch.arg(&logits).arg(&chain.vocab).arg(&temperature).arg(&r).arg(&next).arg(&host);
            let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match `pick_token`'s: `vocab` f32 logits (checked at `chain`),
            // one device word and one mapped host word, all owned by `self` or `chain`, which waits
            // for the stream before it lets them go.
            unsafe { launch.launch(cfg) }.map_err(driver)?;
        }
        chain.done[(k % 2) as usize].record(&self.stream).map_err(driver)?;
        chain.queued += 1;
        Ok(k)
    }

    /// Launches `f` on the step's stream, allowing it to overlap the previous kernel's end
    /// when `overlap` is set (every kernel in decode.cu waits before reading earlier results).
    ///
    /// # Safety
    /// `params` must match `f`'s parameters in number, order and layout, and every pointer in
    /// them must stay valid until the kernel has run.
    unsafe fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, params: &mut [*mut c_void]) -> Result<()> {
        self.stream.context().bind_to_thread().map_err(driver)?;
        // SAFETY: a plain C union of integers and small structs; all zero is a valid value.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut count = 0;
        if self.overlap {
            attrs[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[count].value.programmaticStreamSerializationAllowed = 1;
            count += 1;
        }
        if let Some(percent) = self.carveout {
            attrs[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT;
            attrs[count].value.sharedMemCarveout = percent;
            count += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: count as u32,
        };
        // SAFETY: the caller vouches for `params`; `config` and `attrs` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result().map_err(driver)
    }

    /// Splits of attention for a step whose cache holds `keys` positions (each count has a graph
    /// of its own): one up to `attend_split_keys`; past it the grouped kernel's
    /// `GroupAttend::max_splits` blocks a KV head, of which it uses as many as give each at least
    /// `split_keys` keys; without it, blocks a query head: ⌈keys ÷ attend_split_keys⌉ rounded up
    /// to a power of two, at most `attend_max_splits`, shared out as that quotient asks.
    fn attend_splits(&self, keys: usize) -> u32 {
        let wanted = keys.div_ceil(self.attend_split_keys as usize).max(1);
        match &self.attend_group {
            Some(group) if wanted > 1 => group.max_splits,
            _ => (wanted.next_power_of_two() as u32).min(self.attend_max_splits),
        }
    }

    /// Every kernel of one step, in order (the KV buffers are in `Buffers::step`), attention in
    /// `splits` blocks a head. `trace`: the trace buffer (`SHOAL_FUSED_TRACE`), or 0.
    fn launch_all(&self, trace: u64, splits: u32) -> Result<()> {
        let mut prof = self.profile.as_ref().map(|p| p.lock().unwrap_or_else(|e| e.into_inner()));
        let mut events = Vec::new();
        for (i, (l, &kind)) in self.launches.iter().zip(&self.kinds).enumerate() {
            let t0 = match prof {
                Some(_) => Some(self.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver)?),
                None => None,
            };
            match *l {
                Launch::Mv { mut args, rows, kernel } => {
                    (args.trace, args.launch, args.preload) = (trace, i as i32, i32::from(self.preload));
                    let MvShape { kernel, pairs, blocks, slices, threads } = self.grids.shape(kernel, &args, rows);
                    args.pairs = pairs;
                    let cfg = LaunchConfig { grid_dim: (blocks, slices, 1), block_dim: (threads, 1, 1), shared_mem_bytes: mv_smem(&args) as u32 };
                    // SAFETY: `args` points at buffers kept alive by `self` (weights held by the
                    // shard, scratch in `_keep`), sized at planning for these rows and columns.
                    unsafe { self.launch(&self.mv[kernel], cfg, &mut [(&raw mut args).cast()]) }?;
                }
                Launch::Attend { mut args } => {
                    (args.trace, args.launch, args.splits, args.split_keys) = (trace, i as i32, splits as i32, self.attend_split_keys as i32);
                    let (kernel, cfg) = match &self.attend_group {
                        Some(group) if splits > 1 => {
                            args.split_keys = group.split_keys as i32;
                            let cfg = LaunchConfig { grid_dim: (args.kv_heads as u32 * splits, 1, 1), block_dim: (group::GRP_THREADS, 1, 1), shared_mem_bytes: group_smem(&args) };
                            (&group.function, cfg)
                        }
                        _ => {
                            let cfg = LaunchConfig { grid_dim: (args.heads as u32 * splits, 1, 1), block_dim: (self.attend_threads, 1, 1), shared_mem_bytes: 0 };
                            (if splits > 1 { &self.attend_split } else { &self.attend }, cfg)
                        }
                    };
                    // SAFETY: as above; `step` names caches with `capacity` > position rows
                    // (reserved); `partial` holds `heads` × the most splits states as tagged
                    // words, and `count` `heads` counters.
                    unsafe { self.launch(kernel, cfg, &mut [(&raw mut args).cast()]) }?;
                }
                Launch::Embed { mut args } => {
                    let cfg = LaunchConfig { grid_dim: ((args.cols as u32).div_ceil(256), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                    // SAFETY: the table (held by the shard), the step's arguments and the residual
                    // buffer (held by `self`) outlive the step; the token id is below the table's rows.
                    unsafe { self.launch(&self.embed_row, cfg, &mut [(&raw mut args).cast()]) }?;
                }
                Launch::AddNorm { mut x, mut h, mut w, mut n, mut eps } => {
                    let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
                    let mut params: [*mut c_void; 5] = [(&raw mut x).cast(), (&raw mut h).cast(), (&raw mut w).cast(), (&raw mut n).cast(), (&raw mut eps).cast()];
                    // SAFETY: three buffers of `n` f32 values kept alive by `self`.
                    unsafe { self.launch(&self.add_norm, cfg, &mut params) }?;
                }
            }
            if let Some(t0) = t0 {
                let t1 = self.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(driver)?;
                events.push((kind, t0, t1));
            }
        }
        if let Some((steps, totals)) = prof.as_deref_mut() {
            self.stream.synchronize().map_err(driver)?;
            for (slot, t0, t1) in events {
                totals[slot] += std::time::Duration::from_secs_f64(t0.elapsed_ms(&t1).map_err(driver)? as f64 / 1e3);
            }
            *steps += 1;
            if *steps % 64 == 0 {
                let per_kind: Vec<String> = KIND_NAMES.iter().zip(totals.iter()).map(|(name, d)| format!("{name} {:.0}", d.as_secs_f64() * 1e6 / *steps as f64)).collect();
                eprintln!("fused step, GPU µs per token over {steps} steps (no graph): {}", per_kind.join(", "));
            }
        }
        Ok(())
    }
}
