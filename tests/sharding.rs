//! Sharding: every two-way split point and a three-way split, run in sequence on the hidden
//! states, give the unsharded model's logits (within 1e-5) and greedy tokens; a prompt longer
//! than one prefill chunk gives, at every position, the logits of its tokens fed one at a time;
//! what placement counts for a CPU node is what a loaded shard really holds.

use candle_core::Device;
use shoal::engine::model::ModelSource;
use shoal::engine::sampler::argmax;
use shoal::engine::shard::PREFILL_CHUNK;
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

/// A prompt of a little over two chunks, run at once (in chunks), against the same tokens fed
/// one at a time: every position's logits, whole and split into two shards (the first passing
/// every position's hidden state on), and the cache ends at the prompt's length.
fn check_long_prompt(name: &str) {
    let mut source = ModelSource::open(&fixture(name)).expect("fixture opens");
    let t = 2 * PREFILL_CHUNK + 77;
    source.spec.context_length = source.spec.context_length.max(t + 1);
    let vocab = source.spec.vocab_size;
    let prompt: Vec<u32> = (0..t).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let layers = source.spec.num_layers;
    let load = |s: usize, e: usize| source.load_shard(LayerRange::new(s, e), &Device::Cpu).expect("shard loads");
    let whole = load(0, layers);
    let logits = |out: ShardOutput| match out {
        ShardOutput::Logits(l) => l.to_vec2::<f32>().expect("(rows, vocab)"),
        ShardOutput::Hidden(_) => panic!("the last shard returns logits"),
    };

    let mut cache = whole.new_cache();
    let stepwise: Vec<Vec<f32>> = prompt.iter().map(|id| logits(whole.forward(ShardInput::Tokens(&[*id]), &mut cache, false).expect("step")).remove(0)).collect();

    let mut cache = whole.new_cache();
    let at_once = logits(whole.forward(ShardInput::Tokens(&prompt), &mut cache, true).expect("prompt"));
    assert_eq!((at_once.len(), cache.position()), (t, t));
    for (pos, (a, b)) in at_once.iter().zip(&stepwise).enumerate() {
        let d = max_abs_diff(a, b);
        assert!(d <= 1e-4, "{name}: position {pos} of a {t}-token prompt differs by {d} from feeding it token by token");
    }

    let (first, last) = (load(0, layers / 2), load(layers / 2, layers));
    let (mut c1, mut c2) = (first.new_cache(), last.new_cache());
    let ShardOutput::Hidden(h) = first.forward(ShardInput::Tokens(&prompt), &mut c1, false).expect("first shard") else { panic!("the first shard returns hidden states") };
    assert_eq!(h.dims(), [1, t, source.spec.hidden_size]);
    let end = logits(last.forward(ShardInput::Hidden(h), &mut c2, false).expect("last shard"));
    let d = max_abs_diff(&end[0], &stepwise[t - 1]);
    assert!(end.len() == 1 && d <= 1e-4, "{name}: the split prompt's last logits differ by {d}");
}

#[test]
fn a_prompt_longer_than_a_prefill_chunk_equals_it_fed_token_by_token() {
    check_long_prompt("qwen2");
    // Sliding-window layers (a window of 8) across the chunks' boundaries.
    check_long_prompt("gemma3");
}

/// Placement's figure for a CPU node (`ModelFootprint::held_on(false)` of the footprint the
/// coordinator builds from the header) covers the weight bytes a CPU shard of the whole model reads per
/// token, within 2%: f16 and bf16 checkpoints are widened to f32 on a CPU, so they take twice
/// their file.
#[test]
fn placement_counts_the_weights_a_cpu_shard_really_holds() {
    let gguf = crate::util::real_model("gemma3-270m");
    for (name, path, half) in [("qwen2", fixture("qwen2"), false), ("qwen2-f16", fixture("qwen2-f16"), true), ("qwen2-bf16", fixture("qwen2-bf16"), true), ("gemma3-270m Q4_K_M", gguf, false)] {
        let source = ModelSource::open(&path).expect("model");
        let footprint = shoal::models::footprint(name, &source, None);
        assert_eq!(footprint.dense_half, half, "{name}");
        assert_eq!(footprint.quantized, name.contains("Q4_K"), "{name}");
        let shard = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("load");
        let held = footprint.held_on(false);
        let counted = held.bytes_per_layer * footprint.layers as u64 + held.head_bytes;
        // Every layer counts as the largest: a Q4_K_M file's layers differ (some hold Q6_K).
        let real = shard.decode_bytes();
        assert!(real <= counted && counted - real <= counted / 50, "{name}: placement counts {counted} bytes, the shard holds {real}");
        let stored = footprint.bytes_per_layer * footprint.layers as u64 + footprint.head_bytes;
        if half {
            assert_eq!(real, 2 * stored, "{name}");
        }
    }
}
