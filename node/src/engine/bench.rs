//! `shoal bench`'s measurement: prompt processing and greedy decode throughput of a loaded model
//! (median over repetitions, after a warm-up), peak RSS, the memory-read bandwidth measured with
//! the same thread count (on a GPU: its device copy rate), and the decode roofline fraction (tok/s
//! × bytes read per token ÷ bandwidth: the weights, and the KV cache at the depth decoded).
//! Decode starts after a 4-token prompt, or after `depth` tokens (llama-bench's `-d`), where
//! attention's reads of the cache count. The bandwidth is measured right before and after every decode repetition and each
//! repetition is set against the higher of its two: on a shared VM the read rate moves by half
//! from one minute to the next, and a single probe minutes away from the decode says little. It runs the engine's own shard forward, the path `run` and `serve` use.
//! It does not compare with other engines (scripts/bench-vs-llamacpp.sh does) nor assert speeds.

use std::time::{Duration, Instant};

use candle_core::D;

use super::cache::ShardCache;
use super::chained::ChainedDecode;
use super::model::LoadedModel;
use super::sampler::{Sampler, SamplingParams};
use super::shard::{Shard, ShardInput, ShardOutput};
use super::{EngineError, Result};

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub repetitions: usize,
    /// Tokens in the cache before each timed decode run (0: a 4-token prompt).
    pub depth: usize,
    /// Threads for the bandwidth probe (the kernels' pool is sized by the caller).
    pub threads: usize,
    /// The device the model was loaded on, when it is a GPU (the roofline then uses its copy rate).
    pub device: Option<super::device::ComputeDevice>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub model: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
    pub threads: usize,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    /// Positions in the cache when each decode run starts.
    pub depth: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// Every repetition, in the order measured.
    pub prefill_runs: Vec<f64>,
    pub decode_runs: Vec<f64>,
    pub rss_bytes: u64,
    /// The median of the bandwidth probes.
    pub mem_bw_bytes_s: f64,
    /// Every probe: one before the first decode repetition and one after each.
    pub mem_bw_runs: Vec<f64>,
    /// Weight bytes a decode step reads: every layer's matrices and vectors and the LM head.
    pub bytes_per_token: u64,
    /// KV cache bytes a decode step reads on average over a run (every layer's keys and values
    /// of every position before it, at the cache's width).
    pub kv_bytes_per_token: u64,
    /// The median of `roofline_runs`.
    pub roofline_fraction: f64,
    /// Each decode repetition's tok/s × (weight and KV bytes per token) ÷ the higher probe beside it.
    pub roofline_runs: Vec<f64>,
}

/// The text the prompt is cut from (the same filler llama.cpp's side of the comparison uses).
const FILLER: &str = "The quick brown fox jumps over the lazy dog. In the beginning the Universe was created. This has made a lot of people very angry and been widely regarded as a bad move. ";

pub fn run(model: &LoadedModel, opts: &BenchOptions) -> Result<BenchReport> {
    if opts.prompt_tokens == 0 || opts.gen_tokens == 0 || opts.repetitions == 0 {
        return Err(EngineError::InvalidRequest("prompt tokens, generated tokens and repetitions must be at least 1".into()));
    }
    let shard = &model.shard;
    if !shard.is_first() || !shard.is_last() {
        return Err(EngineError::InvalidRequest("bench needs the whole model on this node".into()));
    }
    // Checked before the filler is built: a huge request must fail at once, not after encoding it.
    let too_long = || EngineError::InvalidRequest(format!("{} + {} tokens do not fit the context of {}", opts.prompt_tokens, opts.gen_tokens, model.spec.context_length));
    let longest = opts.prompt_tokens.max(opts.depth);
    if longest.saturating_add(opts.gen_tokens).saturating_add(8) > model.spec.context_length {
        return Err(too_long());
    }
    let filler = model.text.encode_prompt(&FILLER.repeat(longest / 16 + 2))?;
    if filler.len() < longest {
        return Err(too_long());
    }
    let prompt = &filler[..opts.prompt_tokens];
    let decode_prompt = match opts.depth {
        0 => model.text.encode_prompt("Once upon a time")?,
        depth => filler[..depth].to_vec(),
    };

    // Warm-up: page the weights in, size the caches and buffers.
    {
        let mut cache = shard.new_cache();
        shard.forward(ShardInput::Tokens(&prompt[..prompt.len().min(32)]), &mut cache, false)?;
        decode(shard, &mut cache, prompt[0], 4)?;
    }

    let mut prefill_runs = Vec::new();
    let _ = super::op_timing::report(); // only the timed runs below
    for _ in 0..opts.repetitions {
        let mut cache = shard.new_cache();
        let t0 = Instant::now();
        let out = shard.forward(ShardInput::Tokens(prompt), &mut cache, false)?;
        greedy(out)?;
        prefill_runs.push(prompt.len() as f64 / t0.elapsed().as_secs_f64());
    }
    if let Some(report) = super::op_timing::report() {
        eprintln!("prompt time by section over {} runs (SHOAL_PROMPT_TIMING):\n{report}", opts.repetitions);
    }

    // Taken before the bandwidth probes, whose buffer is not the model's memory (decode's own
    // buffers are smaller than the prompt's, measured above).
    let rss_bytes = peak_rss_bytes().unwrap_or(0);
    // The roofline's ceiling: CPU memory read over the same threads, or the GPU's copy rate.
    let probe = || -> Result<f64> {
        Ok(match &opts.device {
            Some(d) if d.is_gpu() => super::probe::gpu_copy_bandwidth(d, 1 << 30, Duration::from_millis(300))?,
            _ => read_bandwidth(opts.threads, 256 << 20, Duration::from_millis(300)),
        })
    };
    let mut mem_bw_runs = vec![probe()?];
    let mut decode_runs = Vec::new();
    let mut kv_bytes = 0;
    for _ in 0..opts.repetitions {
        let mut cache = shard.new_cache();
        let first = greedy(shard.forward(ShardInput::Tokens(&decode_prompt), &mut cache, false)?)?;
        let t0 = Instant::now();
        decode(shard, &mut cache, first, opts.gen_tokens)?;
        decode_runs.push(opts.gen_tokens as f64 / t0.elapsed().as_secs_f64());
        mem_bw_runs.push(probe()?);
        // Step i reads the positions before it: the prompt's and i - 1 generated, on average
        // the prompt's and half the run's.
        kv_bytes = cache.bytes_per_position()? * (decode_prompt.len() as u64 + opts.gen_tokens as u64 / 2);
    }
    let bytes = shard.decode_bytes() + kv_bytes;
    let roofline_runs: Vec<f64> = decode_runs.iter().zip(mem_bw_runs.windows(2)).map(|(tok_s, bw)| tok_s * bytes as f64 / bw[0].max(bw[1])).collect();
    Ok(BenchReport {
        model: model.name.clone(),
        device: opts.device.as_ref().map_or_else(|| "cpu".into(), |d| d.label()),
        threads: opts.threads,
        prompt_tokens: prompt.len(),
        gen_tokens: opts.gen_tokens,
        depth: decode_prompt.len(),
        prefill_tok_s: median(&prefill_runs),
        decode_tok_s: median(&decode_runs),
        prefill_runs,
        decode_runs,
        rss_bytes,
        mem_bw_bytes_s: median(&mem_bw_runs),
        mem_bw_runs,
        bytes_per_token: bytes - kv_bytes,
        kv_bytes_per_token: kv_bytes,
        roofline_fraction: median(&roofline_runs),
        roofline_runs,
    })
}

/// `n` greedy decode steps from `first`, as generation takes them (on a GPU that picks the
/// tokens itself, one step ahead of the host: `ChainedDecode`); returns the last token.
fn decode(shard: &Shard, cache: &mut ShardCache, first: u32, n: usize) -> Result<u32> {
    let mut sampler = Sampler::new(SamplingParams::greedy())?;
    let mut next = first;
    match ChainedDecode::new(shard, &sampler)? {
        Some(mut chained) => {
            for i in 0..n {
                next = chained.next(next, i + 1 < n, cache, &mut sampler)?;
            }
            chained.finish(cache);
        }
        None => {
            for _ in 0..n {
                next = greedy(shard.forward(ShardInput::Tokens(&[next]), cache, false)?)?;
            }
        }
    }
    Ok(next)
}

fn greedy(out: ShardOutput) -> Result<u32> {
    match out {
        ShardOutput::Logits(l) => {
            let l = if l.rank() == 2 { l.get(l.dim(0)? - 1)? } else { l };
            Ok(l.argmax(D::Minus1)?.to_scalar::<u32>()?)
        }
        ShardOutput::Hidden(_) => Err(EngineError::Shard("the last shard returned hidden states".into())),
    }
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// Memory read bandwidth with `threads` threads each summing its own part of a `bytes` buffer
/// (far larger than any cache) with the widest vector loads the CPU has (`kernels::read_sum`),
/// pass after pass, for `budget`; the best pass counts. The buffer
/// asks for huge pages as the weights do (`HugePageBuffer`), so the roofline is measured on the
/// same footing as the kernels that stream them.
pub fn read_bandwidth(threads: usize, bytes: usize, budget: Duration) -> f64 {
    let threads = threads.max(1);
    let words = (bytes / 8).max(1024);
    let mut mapped = super::kernels::HugePageBuffer::zeroed(words * 8);
    let mut heap: Vec<u64>;
    let buffer: &mut [u64] = match mapped.as_mut() {
        // SAFETY: every bit pattern is a valid u64; `align_to_mut` puts only whole aligned words in
        // the middle part, and a mapping is page-aligned, so that part is the whole buffer.
        Ok(m) => unsafe { m.align_to_mut::<u64>().1 },
        Err(_) => {
            heap = vec![0u64; words];
            &mut heap
        }
    };
    // Writing every word commits the pages, so the passes read real memory.
    buffer.iter_mut().enumerate().for_each(|(i, w)| *w = i as u64);
    let buffer = &*buffer;
    let chunk = buffer.len().div_ceil(threads);
    let pass = || {
        std::thread::scope(|s| {
            let hs: Vec<_> = buffer.chunks(chunk).map(|c| s.spawn(move || super::kernels::read_sum(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0u64, u64::wrapping_add)
        })
    };
    std::hint::black_box(pass());
    let started = Instant::now();
    let mut best = 0f64;
    while started.elapsed() < budget || best == 0.0 {
        let t0 = Instant::now();
        std::hint::black_box(pass());
        best = best.max((buffer.len() * 8) as f64 / t0.elapsed().as_secs_f64().max(1e-9));
    }
    best
}

/// The process's peak resident set size where the OS reports it (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
