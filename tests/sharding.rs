//! Sharding: every two-way split point and a three-way split, run in sequence on the hidden
//! states, give the unsharded model's logits (within 1e-5) and greedy tokens.

use candle_core::Device;
use shoal::engine::model::ModelSource;
use shoal::engine::sampler::argmax;
use shoal::engine::{LayerRange, Shard, ShardInput, ShardOutput};

use crate::util::{fixture, max_abs_diff, reference};

const TOLERANCE: f32 = 1e-5;

/// Runs a prompt then `steps` greedy tokens through `shards` in order; returns every step's logits.
fn run_chain(shards: &[Shard], prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut caches: Vec<_> = shards.iter().map(Shard::new_cache).collect();
    let mut tokens = prompt.to_vec();
    let mut all_logits = Vec::new();
    let mut generated = Vec::new();
    for _ in 0..steps {
        let mut hidden = None;
        let mut logits = None;
        for (shard, cache) in shards.iter().zip(caches.iter_mut()) {
            let input = match hidden.take() {
                None => ShardInput::Tokens(&tokens),
                Some(h) => ShardInput::Hidden(h),
            };
            match shard.forward(input, cache, false).expect("shard forward") {
                ShardOutput::Hidden(h) => hidden = Some(h),
                ShardOutput::Logits(l) => logits = Some(l.squeeze(0).expect("one row").to_vec1::<f32>().expect("1-d")),
            }
        }
        let logits = logits.expect("the last shard returns logits");
        let next = argmax(&logits);
        all_logits.push(logits);
        generated.push(next);
        tokens = vec![next];
    }
    (all_logits, generated)
}

fn check_splits(name: &str) {
    let source = ModelSource::open(&fixture(name)).expect("fixture opens");
    let layers = source.spec.num_layers;
    let prompt = reference(name).prompt_ids;
    let load = |s: usize, e: usize| source.load_shard(LayerRange::new(s, e), &Device::Cpu).expect("shard loads");
    let (whole_logits, whole_tokens) = run_chain(&[load(0, layers)], &prompt, 16);

    let mut splits: Vec<Vec<usize>> = (1..layers).map(|s| vec![0, s, layers]).collect();
    splits.push(vec![0, 1, layers / 2 + 1, layers]);
    for bounds in splits {
        let shards: Vec<Shard> = bounds.windows(2).map(|w| load(w[0], w[1])).collect();
        let (logits, tokens) = run_chain(&shards, &prompt, 16);
        assert_eq!(tokens, whole_tokens, "{name}: split {bounds:?} changed the greedy tokens");
        for (step, (a, b)) in logits.iter().zip(&whole_logits).enumerate() {
            let d = max_abs_diff(a, b);
            assert!(d <= TOLERANCE, "{name}: split {bounds:?} step {step} logits differ by {d}");
        }
    }
}

#[test]
fn every_split_of_llama_equals_the_whole() {
    check_splits("llama");
}

#[test]
fn every_split_of_qwen2_equals_the_whole() {
    check_splits("qwen2");
}

#[test]
fn every_split_of_qwen3_equals_the_whole() {
    check_splits("qwen3");
}

#[test]
fn every_split_of_gemma3_equals_the_whole() {
    check_splits("gemma3");
}

#[test]
fn middle_shard_rejects_tokens_and_first_rejects_hidden_states() {
    let source = ModelSource::open(&fixture("qwen2")).expect("fixture opens");
    let middle = source.load_shard(LayerRange::new(1, 3), &Device::Cpu).expect("shard loads");
    let mut cache = middle.new_cache();
    assert!(middle.forward(ShardInput::Tokens(&[1, 2]), &mut cache, false).is_err());
    let bad = candle_core::Tensor::zeros((1, 2, 7), candle_core::DType::F32, &Device::Cpu).expect("tensor");
    assert!(middle.forward(ShardInput::Hidden(bad), &mut cache, false).is_err(), "wrong hidden size is refused");
    assert!(source.load_shard(LayerRange::new(2, 9), &Device::Cpu).is_err(), "a range past the last layer is refused");
    assert!(source.load_shard(LayerRange::new(2, 2), &Device::Cpu).is_err(), "an empty range is refused");
}
