//! Tensor parallelism in one process: N members, each loading only its slice of every layer
//! and joined by an in-process all-reduce group, give the single node's logits (f32 fixtures of
//! every family at 2 and 4 members, within 1e-4) and greedy tokens (Qwen2.5-Coder-1.5B Q4_K_M at
//! 2 and 4 members: uneven block splits of the MLP, replicated KV heads, heads in block pairs).
//! Every member ends each step with bit-identical logits. Models that cannot be split so are
//! refused at load with the reason.

use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use shoal::dataplane::local::local_group;
use shoal::engine::model::ModelSource;
use shoal::engine::sampler::argmax;
use shoal::engine::tp::{TpLayout, TpMember, TpShape, TpSlice};
use shoal::engine::{LayerRange, Shard, ShardInput, ShardOutput};

use crate::util::{fixture, max_abs_diff, real_model, reference};

const TOLERANCE: f32 = 1e-4;

/// Prompt then `steps` greedy tokens on one shard; every step's logits and the tokens.
pub(crate) fn run_one(shard: &Shard, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut cache = shard.new_cache();
    let mut input = prompt.to_vec();
    let (mut logits, mut tokens) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let ShardOutput::Logits(l) = shard.forward(ShardInput::Tokens(&input), &mut cache, false).expect("forward") else { panic!("a whole-range shard returns logits") };
        let l = l.squeeze(0).expect("one row").to_vec1::<f32>().expect("1-d");
        let next = argmax(&l);
        logits.push(l);
        tokens.push(next);
        input = vec![next];
    }
    (logits, tokens)
}

/// Loads `n` tensor-parallel members of `source` and runs them on their own threads.
pub(crate) fn run_tp(source: &ModelSource, n: usize, prompt: &[u32], steps: usize) -> Vec<(Vec<Vec<f32>>, Vec<u32>)> {
    let group = local_group(n, 0, Duration::from_secs(60)).expect("group");
    let shards: Vec<Shard> = group
        .iter()
        .enumerate()
        .map(|(rank, g)| {
            let member = TpMember { slice: TpSlice { rank, size: n }, reduce: g.clone() };
            Shard::load_tp(&source.weights, &source.spec, LayerRange::full(source.spec.num_layers), &Device::Cpu, Some(member)).expect("slice loads")
        })
        .collect();
    let whole_bytes: u64 = {
        let whole = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("whole loads");
        whole.decode_bytes()
    };
    let slice_bytes: Vec<u64> = shards.iter().map(Shard::decode_bytes).collect();
    assert!(slice_bytes.iter().all(|b| *b < whole_bytes), "each member holds less than the whole: {slice_bytes:?} vs {whole_bytes}");
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = shards.iter().map(|shard| s.spawn(move || run_one(shard, prompt, steps))).collect();
        handles.into_iter().map(|h| h.join().expect("member thread")).collect::<Vec<_>>()
    });
    for (rank, o) in out.iter().enumerate().skip(1) {
        assert_eq!(o.1, out[0].1, "member {rank} sampled other tokens than member 0");
        for (a, b) in o.0.iter().zip(&out[0].0) {
            assert_eq!(a, b, "member {rank}'s logits are not bit-identical to member 0's");
        }
    }
    let _ = Arc::strong_count(&group[0]);
    out
}

fn check_family(name: &str) {
    let source = ModelSource::open(&fixture(name)).expect("fixture opens");
    let prompt = reference(name).prompt_ids;
    let whole = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("whole loads");
    let (whole_logits, whole_tokens) = run_one(&whole, &prompt, 16);
    for n in [2, 4] {
        let out = run_tp(&source, n, &prompt, 16);
        let (logits, tokens) = &out[0];
        assert_eq!(tokens, &whole_tokens, "{name}: TP {n} changed the greedy tokens");
        for (step, (a, b)) in logits.iter().zip(&whole_logits).enumerate() {
            let d = max_abs_diff(a, b);
            assert!(d <= TOLERANCE, "{name}: TP {n} step {step} logits differ by {d}");
        }
    }
}

#[test]
fn llama_at_two_and_four_members_equals_one_node() {
    check_family("llama");
}

#[test]
fn mistral_at_two_and_four_members_equals_one_node() {
    check_family("mistral");
}

#[test]
fn qwen2_at_two_and_four_members_equals_one_node() {
    check_family("qwen2");
}

#[test]
fn qwen3_at_two_and_four_members_equals_one_node() {
    check_family("qwen3");
}

#[test]
fn gemma3_at_two_and_four_members_equals_one_node() {
    check_family("gemma3");
}

#[test]
fn a_model_with_too_few_heads_is_refused_with_the_reason() {
    let source = ModelSource::open(&fixture("qwen2")).expect("fixture opens");
    let err = TpLayout::of(&source.weights, &source.spec, 8).expect_err("4 heads cannot go to 8 members");
    let msg = err.to_string();
    assert!(msg.contains("cannot split the model 8 ways") && msg.contains("at most 4 members"), "{msg}");
    let group = local_group(8, 0, Duration::from_secs(5)).expect("group");
    let member = TpMember { slice: TpSlice { rank: 0, size: 8 }, reduce: group[0].clone() };
    let err = Shard::load_tp(&source.weights, &source.spec, LayerRange::full(source.spec.num_layers), &Device::Cpu, Some(member)).err().expect("load refuses");
    assert!(err.to_string().contains("at most 4 members"), "{err}");
}

fn qwen_gguf() -> ModelSource {
    ModelSource::open(&real_model("qwen2.5-coder-1.5b").join("model.gguf")).expect("qwen opens")
}

/// Qwen2.5-Coder-1.5B's prompt from the llama.cpp reference.
fn qwen_prompt() -> Vec<u32> {
    let text = std::fs::read_to_string(crate::util::repo_root().join("tests/fixtures/llamacpp/greedy.json")).expect("greedy.json");
    let cases: Vec<serde_json::Value> = serde_json::from_str(&text).expect("parses");
    let case = cases.iter().find(|c| c["model"] == "qwen2.5-coder-1.5b").expect("a qwen case");
    case["prompt_ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect()
}

#[test]
fn qwen_1_5b_gguf_layouts_follow_its_blocks() {
    let source = qwen_gguf();
    let shape = TpShape::of(&source.weights, &source.spec).expect("shape");
    assert_eq!((shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate), (12, 2, 128, 8960));
    assert_eq!((shape.head_granule, shape.ffn_granule), (2, 256), "Q4_K/Q6_K blocks of 256 take heads of 128 in pairs");
    let two = shape.layout(2).expect("two ways");
    assert_eq!(two.parts.iter().map(|p| p.ffn.len()).collect::<Vec<_>>(), vec![18 * 256, 17 * 256]);
    let four = shape.layout(4).expect("four ways");
    assert_eq!(four.parts.iter().map(|p| p.heads.len()).collect::<Vec<_>>(), vec![4, 4, 2, 2]);
    assert_eq!(four.parts.iter().map(|p| p.kv_heads.len()).collect::<Vec<_>>(), vec![1, 2, 1, 1], "KV heads replicated where q heads need them");
    let err = shape.layout(8).expect_err("6 head pairs cannot go to 8 members");
    assert!(err.contains("at most 6 members"), "{err}");
}

fn qwen_greedy_at(n: usize) {
    let source = qwen_gguf();
    let prompt = qwen_prompt();
    let whole = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("whole loads");
    let (whole_logits, whole_tokens) = run_one(&whole, &prompt, 16);
    drop(whole);
    let out = run_tp(&source, n, &prompt, 16);
    let (logits, tokens) = &out[0];
    let gap = logits.iter().zip(&whole_logits).map(|(a, b)| max_abs_diff(a, b)).fold(0.0, f32::max);
    eprintln!("qwen TP {n}: largest logit difference from one node over 16 steps: {gap}");
    assert_eq!(tokens, &whole_tokens, "qwen TP {n} changed the greedy tokens (largest logit gap {gap})");
}

#[test]
fn qwen_1_5b_gguf_at_two_members_equals_one_node() {
    qwen_greedy_at(2);
}

#[test]
fn qwen_1_5b_gguf_at_four_members_equals_one_node() {
    qwen_greedy_at(4);
}

/// Gemma 3 270M (GGUF) at two members on a prompt whose greedy continuation meets a near-tie:
/// the slices sum their partial products in another order than one node, and the kernels'
/// int8-quantized activations turn that rounding noise into logit moves of up to ~1 (Qwen's
/// test prints ~0.8 with equal tokens); tokens agree up to the first step whose top-two margin
/// is within that movement.
/// (`shoal serve`'s tensor tests therefore compare with this in-process split, not one node.)
#[test]
fn gemma_270m_gguf_at_two_members_differs_from_one_node_only_at_a_near_tie() {
    let source = ModelSource::open(&real_model("gemma3-270m").join("model.gguf")).expect("gemma opens");
    let prompt = source.load_text().expect("text").encode_prompt("Once upon a time").expect("encodes");
    let whole = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("whole loads");
    let (whole_logits, whole_tokens) = run_one(&whole, &prompt, 16);
    drop(whole);
    let out = run_tp(&source, 2, &prompt, 16);
    let (logits, tokens) = &out[0];
    let margin = |l: &[f32]| {
        let mut v = l.to_vec();
        v.sort_by(|a, b| b.total_cmp(a));
        v[0] - v[1]
    };
    let mut moved = 0f32;
    for step in 0..16 {
        moved = moved.max(max_abs_diff(&logits[step], &whole_logits[step]));
        if tokens[step] != whole_tokens[step] {
            let m = margin(&whole_logits[step]);
            eprintln!("gemma TP 2: first different token at step {step}; one node's top-two margin there {m}, logits moved by up to {moved}");
            assert!(m <= 2.0 * moved, "a token changed at step {step} where one node's margin {m} is far above the logit movement {moved}");
            return;
        }
    }
    eprintln!("gemma TP 2: all 16 tokens equal; logits moved by up to {moved}");
}
