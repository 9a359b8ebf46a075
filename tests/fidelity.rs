//! Fidelity: for every family, our f32 logits match transformers' on the committed tiny
//! random models (prefill at every position, then 16 greedy steps through the KV cache).

use candle_core::Device;
use shoal::engine::model::ModelSource;
use shoal::engine::{LayerRange, ShardInput, ShardOutput};

use crate::util::{fixture, max_abs_diff, reference};

const TOLERANCE: f32 = 1e-4;

fn check_family(name: &str) {
    let source = ModelSource::open(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let shard = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("shard loads");
    let r = reference(name);
    assert!(r.prompt_ids.len() >= 16 && r.greedy_ids.len() == 16);
    let mut cache = shard.new_cache();

    let ShardOutput::Logits(prefill) = shard.forward(ShardInput::Tokens(&r.prompt_ids), &mut cache, true).expect("prefill") else {
        panic!("a full shard returns logits")
    };
    let prefill = prefill.to_vec2::<f32>().expect("2-d logits");
    assert_eq!(prefill.len(), r.prompt_ids.len());
    for (pos, (ours, theirs)) in prefill.iter().zip(&r.prefill_logits).enumerate() {
        let d = max_abs_diff(ours, theirs);
        assert!(d <= TOLERANCE, "{name}: prefill logits at position {pos} differ by {d}");
    }

    let mut next = shoal::engine::sampler::argmax(prefill.last().expect("non-empty prompt"));
    for step in 0..16 {
        if step > 0 {
            let ShardOutput::Logits(l) = shard.forward(ShardInput::Tokens(&[next]), &mut cache, false).expect("decode step") else {
                panic!("a full shard returns logits")
            };
            let l = l.squeeze(0).expect("one row").to_vec1::<f32>().expect("1-d logits");
            let d = max_abs_diff(&l, &r.step_logits[step]);
            assert!(d <= TOLERANCE, "{name}: step {step} logits differ by {d}");
            next = shoal::engine::sampler::argmax(&l);
        }
        assert_eq!(next, r.greedy_ids[step], "{name}: greedy token {step} differs");
    }
}

#[test]
fn llama_matches_transformers() {
    check_family("llama");
}

#[test]
fn mistral_matches_transformers() {
    check_family("mistral");
}

#[test]
fn qwen2_matches_transformers() {
    check_family("qwen2");
}

#[test]
fn qwen2_bf16_weights_match_transformers() {
    check_family("qwen2-bf16");
}

#[test]
fn qwen2_f16_weights_match_transformers() {
    check_family("qwen2-f16");
}

#[test]
fn qwen3_matches_transformers() {
    check_family("qwen3");
}

#[test]
fn gemma3_matches_transformers() {
    check_family("gemma3");
}
