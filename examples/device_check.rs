//! Fidelity on a compute device (a GPU), run where the GPU is (CI has none):
//!   device_check fixtures <tests/fixtures> [--device cuda]
//!     every fixture with a transformers `reference.json`: prefill logits at every position and
//!     16 greedy steps through the KV cache, within 1e-4 for f32 weights and within half-precision
//!     rounding (1% of the logit range for f16, 8% for bf16) for half weights, which compute in
//!     their own type on a GPU, with every greedy token equal;
//!   device_check same <model> [--device cuda] [--tokens 16] [--prompt TEXT]
//!     greedy tokens on the device equal those on the CPU.
//! Prints one line per check and exits non-zero on any failure. Not a timing tool.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use shoal::engine::device::{ComputeDevice, DeviceChoice};
use shoal::engine::shard::{Shard, ShardInput, ShardOutput};
use shoal::engine::{LoadOptions, LoadedModel};

#[derive(serde::Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    prefill_logits: Vec<Vec<f32>>,
    greedy_ids: Vec<u32>,
    step_logits: Vec<Vec<f32>>,
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn logits(shard: &Shard, input: &[u32], cache: &mut shoal::engine::cache::ShardCache, all: bool) -> anyhow::Result<Vec<Vec<f32>>> {
    let ShardOutput::Logits(l) = shard.forward(ShardInput::Tokens(input), cache, all)? else { bail!("no logits") };
    Ok(if l.rank() == 2 { l.to_vec2::<f32>()? } else { vec![l.to_vec1::<f32>()?] })
}

fn argmax(v: &[f32]) -> u32 {
    shoal::engine::sampler::argmax(v)
}

/// Largest |a - b| over the pair, and that divided by the reference's largest |logit|.
fn gap(a: &[f32], b: &[f32]) -> (f32, f32) {
    let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    (d, d / scale)
}

fn check_fixture(dir: &Path, device: &ComputeDevice) -> anyhow::Result<String> {
    let r: Reference = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
    // Fixtures carry no tokenizer: the weights alone, as tests/fidelity.rs loads them.
    let source = shoal::engine::model::ModelSource::open(dir)?;
    let shard = &source.load_shard(shoal::engine::LayerRange::full(source.spec.num_layers), device.candle())?;
    let cfg = std::fs::read_to_string(dir.join("config.json"))?;
    // Half-precision weights compute in their own type on a GPU: 1% of the logit range for f16,
    // 8x that for bf16 (3 fewer mantissa bits); the greedy tokens must still all agree.
    let half_budget = if cfg.contains("\"bfloat16\"") { Some(8e-2f32) } else if cfg.contains("\"float16\"") { Some(1e-2) } else { None };
    let mut cache = shard.new_cache();
    let prefill = logits(shard, &r.prompt_ids, &mut cache, true)?;
    let mut worst = (0f32, 0f32);
    for (ours, theirs) in prefill.iter().zip(&r.prefill_logits) {
        let g = gap(ours, theirs);
        worst = (worst.0.max(g.0), worst.1.max(g.1));
    }
    let mut next = argmax(prefill.last().context("empty prompt")?);
    let mut greedy = vec![next];
    for step in 1..r.greedy_ids.len() {
        let l = logits(shard, &[next], &mut cache, false)?.remove(0);
        let g = gap(&l, &r.step_logits[step]);
        worst = (worst.0.max(g.0), worst.1.max(g.1));
        next = argmax(&l);
        greedy.push(next);
    }
    let ok = greedy == r.greedy_ids && half_budget.map_or(worst.0 <= 1e-4, |b| worst.1 <= b);
    let budget = half_budget.map_or("f32 budget 1e-4 absolute".to_string(), |b| format!("half-precision budget {b:.0e} of range"));
    let line = format!("max |Δlogit| {:.2e} ({:.2e} of range), greedy {}/{} equal, {budget}", worst.0, worst.1, greedy.iter().zip(&r.greedy_ids).filter(|(a, b)| a == b).count(), r.greedy_ids.len());
    if ok { Ok(line) } else { bail!(line) }
}

/// Greedy ids and, per step, the margin between the best and the second-best logit.
fn greedy_tokens(model: &LoadedModel, prompt: &str, n: usize) -> anyhow::Result<(Vec<u32>, Vec<f32>)> {
    let ids = model.text.encode_prompt(prompt)?;
    let mut cache = model.shard.new_cache();
    let (mut out, mut margins) = (vec![], vec![]);
    let mut l = logits(&model.shard, &ids, &mut cache, false)?.pop().context("no logits")?;
    loop {
        let next = argmax(&l);
        let second = l.iter().enumerate().filter(|(i, _)| *i != next as usize).map(|(_, x)| *x).fold(f32::MIN, f32::max);
        out.push(next);
        margins.push(l[next as usize] - second);
        if out.len() == n {
            return Ok((out, margins));
        }
        l = logits(&model.shard, &[next], &mut cache, false)?.remove(0);
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let device = ComputeDevice::open(flag(&args, "--device").unwrap_or_else(|| "cuda".into()).parse::<DeviceChoice>().map_err(anyhow::Error::msg)?)?;
    println!("device {}", device.gpu().map_or_else(|| "cpu".to_string(), |g| format!("{} (cuda:{})", g.name, g.index)));
    let mut failures = 0;
    match (args.get(1).map(String::as_str), args.get(2)) {
        (Some("fixtures"), Some(root)) => {
            let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)?.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.join("reference.json").exists()).collect();
            dirs.sort();
            for dir in dirs {
                let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                match check_fixture(&dir, &device) {
                    Ok(line) => println!("PASS {name:12} {line}"),
                    Err(e) => {
                        failures += 1;
                        println!("FAIL {name:12} {e:#}");
                    }
                }
            }
        }
        (Some("same"), Some(model)) => {
            let n: usize = flag(&args, "--tokens").map(|t| t.parse()).transpose()?.unwrap_or(16);
            let prompt = flag(&args, "--prompt").unwrap_or_else(|| "The capital of France is".into());
            let on_device = LoadedModel::load(model.as_ref(), &LoadOptions { device: device.clone(), ..LoadOptions::default() })?;
            let (gpu, gpu_margin) = greedy_tokens(&on_device, &prompt, n)?;
            drop(on_device);
            let (cpu, cpu_margin) = greedy_tokens(&LoadedModel::load(model.as_ref(), &LoadOptions::default())?, &prompt, n)?;
            let equal = gpu.iter().zip(&cpu).take_while(|(a, b)| a == b).count();
            println!("{} {model}: {equal}/{n} greedy tokens equal on the device and the CPU\n  device {gpu:?}\n  cpu    {cpu:?}", if equal == n { "PASS" } else { "FAIL" });
            let smallest = cpu_margin[..equal.min(n)].iter().copied().fold(f32::MAX, f32::min);
            println!("  smallest top-1/top-2 logit margin over the equal tokens (cpu) {smallest:.3}");
            if equal < n {
                println!("  at the first difference (token {equal}): top-1/top-2 margin {:.3} on the CPU, {:.3} on the device", cpu_margin[equal], gpu_margin[equal]);
            }
            failures += usize::from(equal < n);
        }
        _ => bail!("usage: device_check fixtures <dir> | same <model> [--device cuda] [--tokens N] [--prompt TEXT]"),
    }
    if failures > 0 {
        bail!("{failures} check(s) failed");
    }
    Ok(())
}
