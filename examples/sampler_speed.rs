//! How long the sampler takes per token over a whole vocabulary, for greedy and the usual
//! sampling settings: a benchmark that prints figures and asserts nothing.
//!   sampler_speed [--model <gguf or model dir>] [--prompt TEXT]
//! With a model, the logits are the model's for the prompt's next token (run on the CPU);
//! without, 151,936 synthetic logits shaped like a model's (most near zero, a few far above).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal::engine::sampler::{Sampler, SamplingParams};
use shoal::engine::shard::{ShardInput, ShardOutput};
use shoal::engine::{LoadOptions, LoadedModel};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned());
    let (source, logits) = match flag("--model") {
        Some(path) => {
            let m = LoadedModel::load(path.as_ref(), &LoadOptions::default())?;
            let ids = m.text.encode_prompt(&flag("--prompt").unwrap_or_else(|| "Write a short poem about the sea.".into()))?;
            let ShardOutput::Logits(l) = m.shard.forward(ShardInput::Tokens(&ids), &mut m.shard.new_cache(), false)? else { anyhow::bail!("no logits") };
            (path, l.flatten_all()?.to_vec1::<f32>()?)
        }
        None => {
            let mut rng = StdRng::seed_from_u64(1);
            let mut l: Vec<f32> = (0..151_936).map(|_| (0..4).map(|_| rng.random::<f32>()).sum::<f32>() * 3.0 - 6.0).collect();
            for _ in 0..30 {
                let i = rng.random_range(0..l.len());
                l[i] += rng.random_range(5.0..20.0);
            }
            ("synthetic".to_string(), l)
        }
    };
    println!("{} logits ({source})", logits.len());
    let settings = [
        ("greedy", SamplingParams::greedy()),
        ("temperature 0.8 (the API's default)", SamplingParams::default()),
        ("temperature 0.8, top-p 0.9", SamplingParams { top_p: 0.9, ..Default::default() }),
        ("temperature 0.8, top-k 40", SamplingParams { top_k: Some(40), ..Default::default() }),
        ("Ollama's: top-k 40, top-p 0.9, repeat penalty 1.1", SamplingParams { top_k: Some(40), top_p: 0.9, repetition_penalty: 1.1, ..Default::default() }),
    ];
    let history: Vec<u32> = (0..64).collect();
    for (name, p) in settings {
        let mut s = Sampler::new(SamplingParams { seed: Some(1), ..p })?;
        let runs = 50;
        let mut buf = logits.clone();
        let mut best = f64::MAX;
        for _ in 0..runs {
            buf.copy_from_slice(&logits);
            let t0 = std::time::Instant::now();
            std::hint::black_box(s.sample(&mut buf, &history));
            best = best.min(t0.elapsed().as_secs_f64());
        }
        println!("{name:52} {:.3} ms per token (best of {runs})", best * 1e3);
    }
    Ok(())
}
