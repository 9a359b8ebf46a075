//! The registry-packaged real models (Gemma 3 270M and Qwen2.5-Coder-1.5B, Q4_K_M GGUF):
//! our tokenization and chat rendering equal llama.cpp's; fed llama.cpp's 16 greedy tokens,
//! our greedy choice at every step is llama.cpp's, except at a near-tie that quantized
//! kernels may break either way (llama.cpp's token within `NEAR_TIE` logits of our top;
//! at most `MAX_NEAR_TIES` per model); free-running greedy output agrees
//! on the first 8 tokens wherever no near-tie occurs; `shoal run` prints coherent text.

use std::time::Duration;

use serde::Deserialize;
use shoal::engine::generate::Prompt;
use shoal::engine::text::ChatMessage;
use shoal::engine::sampler::argmax;
use shoal::engine::model::ModelSource;
use shoal::engine::{LoadOptions, LoadedModel, SamplingParams, ShardInput, ShardOutput};

use crate::util::{generate_ids, real_model, repo_root, run_shoal};

/// One case of `tests/fixtures/llamacpp/greedy.json` (made by `scripts/llamacpp-reference.sh`).
#[derive(Deserialize)]
struct LlamaCppCase {
    model: String,
    prompt: String,
    chat: bool,
    rendered_prompt: String,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
}

const AGREE_TOKENS: usize = 8;
/// Largest gap between our top logit and llama.cpp's choice that counts as a near-tie.
/// llama.cpp keeps its KV cache in f16 and accumulates in another order; measured: one
/// deviation in 144 Qwen steps (0.31 logits) and one in 64 Gemma steps (0.08).
const NEAR_TIE: f32 = 0.5;
const MAX_NEAR_TIES: usize = 2;

fn cases(model: &str) -> Vec<LlamaCppCase> {
    let text = std::fs::read_to_string(repo_root().join("tests/fixtures/llamacpp/greedy.json")).expect("greedy.json");
    let all: Vec<LlamaCppCase> = serde_json::from_str(&text).expect("greedy.json parses");
    all.into_iter().filter(|c| c.model == model).collect()
}

/// Feeds `prompt` then `forced` through the model; returns our logits before each forced token.
fn teacher_forced_logits(model: &LoadedModel, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.shard.new_cache();
    let mut input = prompt.to_vec();
    let mut out = Vec::new();
    for &next in forced {
        let ShardOutput::Logits(l) = model.shard.forward(ShardInput::Tokens(&input), &mut cache, false).expect("forward") else { panic!("logits") };
        out.push(l.squeeze(0).unwrap().to_vec1::<f32>().unwrap());
        input = vec![next];
    }
    out
}

fn agrees_with_llama_cpp(id: &str) {
    let model = LoadedModel::load(&real_model(id).join("model.gguf"), &LoadOptions::default()).expect("model loads");
    let cases = cases(id);
    assert!(!cases.is_empty(), "no llama.cpp reference for {id}");
    let mut near_ties = 0;
    for case in cases {
        let prompt = if case.chat {
            let messages = vec![ChatMessage { role: "user".into(), content: case.prompt.clone() }];
            let rendered = model.text.render_chat(&messages).expect("chat template renders");
            assert_eq!(rendered, case.rendered_prompt, "{id}: chat template renders differently from llama.cpp");
            Prompt::Chat(messages)
        } else {
            Prompt::Text(case.prompt.clone())
        };
        let ids = model.text.encode_prompt(&case.rendered_prompt).expect("tokenizes");
        assert_eq!(ids, case.prompt_ids, "{id}: tokens of {:?} differ from llama.cpp's", case.prompt);

        let mut first_tie = None;
        for (step, logits) in teacher_forced_logits(&model, &ids, &case.generated_ids).iter().enumerate() {
            let theirs = case.generated_ids[step];
            let ours = argmax(logits);
            if ours != theirs {
                let gap = logits[ours as usize] - logits[theirs as usize];
                assert!(gap < NEAR_TIE, "{id}: {:?} step {step}: we pick {ours}, llama.cpp {theirs}, {gap:.3} logits apart", case.prompt);
                eprintln!("{id}: {:?} step {step}: near-tie ({gap:.3} logits) broken the other way", case.prompt);
                near_ties += 1;
                first_tie.get_or_insert(step);
            }
        }
        let free = generate_ids(&model, prompt, &SamplingParams::greedy(), AGREE_TOKENS);
        let must_agree = first_tie.unwrap_or(AGREE_TOKENS).min(AGREE_TOKENS);
        assert_eq!(free[..must_agree], case.generated_ids[..must_agree], "{id}: greedy output for {:?} differs from llama.cpp", case.prompt);
    }
    assert!(near_ties <= MAX_NEAR_TIES, "{id}: {near_ties} near-ties, more than quantization noise explains");
}

#[test]
fn gemma3_270m_agrees_with_llama_cpp() {
    agrees_with_llama_cpp("gemma3-270m");
}

#[test]
fn qwen25_coder_15b_agrees_with_llama_cpp() {
    agrees_with_llama_cpp("qwen2.5-coder-1.5b");
}

#[test]
fn shoal_run_prints_coherent_text() {
    for (id, chat, prompt, expected) in [
        ("gemma3-270m", false, "The capital of France is", "the capital of"),
        ("qwen2.5-coder-1.5b", false, "The capital of France is", "Paris"),
        ("qwen2.5-coder-1.5b", true, "What is the capital of France? Answer in one word.", "Paris"),
    ] {
        let model = real_model(id).join("model.gguf");
        let mut args = vec!["run", "--model", model.to_str().unwrap(), "--prompt", prompt, "--max-tokens", "12"];
        if chat {
            args.push("--chat");
        }
        let out = run_shoal(&args, Duration::from_secs(120));
        let stdout = String::from_utf8(out.stdout).expect("utf-8 output");
        assert!(out.status.success(), "shoal run failed: {}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains(expected), "{id}: expected {expected:?} in {stdout:?}");
        assert!(!stdout.contains("tok/s"), "timing belongs on stderr, not stdout");
        assert!(String::from_utf8_lossy(&out.stderr).contains("tok/s"), "timing is reported on stderr");
    }
}

#[test]
fn gguf_without_tokenizer_json_uses_its_own_vocabulary() {
    // Only the GGUF (linked into an empty directory): the tokenizer is built from its metadata.
    let dir = tempfile::tempdir().unwrap();
    let lone = dir.path().join("model.gguf");
    std::os::unix::fs::symlink(real_model("gemma3-270m").join("model.gguf"), &lone).unwrap();
    let out = run_shoal(&["run", "--model", lone.to_str().unwrap(), "--prompt", "The capital of France is", "--max-tokens", "8"], Duration::from_secs(120));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let case = cases("gemma3-270m").into_iter().find(|c| c.prompt == "The capital of France is").expect("reference case");
    let model = LoadedModel::load(&lone, &LoadOptions::default()).expect("loads without tokenizer.json");
    let expected = model.text.decode(&case.generated_ids[..8]).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim_end_matches('\n'), expected);
}

#[test]
fn shoal_bench_reports_every_figure_as_json_and_refuses_a_prompt_past_the_context() {
    let model = real_model("gemma3-270m").join("model.gguf");
    let m = model.to_str().unwrap();
    let args = ["bench", "--model", m, "--threads", "2", "--prompt-tokens", "32", "--gen-tokens", "8", "--depth", "40", "--repetitions", "1", "--json"];
    let out = run_shoal(&args, Duration::from_secs(120));
    assert!(out.status.success(), "shoal bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    for key in ["prefill_tok_s", "decode_tok_s", "mem_bw_bytes_s", "roofline_fraction"] {
        let v = report[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {report}"));
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    assert_eq!(report["prompt_tokens"], 32, "{report}");
    assert_eq!(report["gen_tokens"], 8, "{report}");
    // Decode ran after 40 tokens of context, and the roofline counts the f32 cache it read: on
    // average the 40 positions and half of the 8 generated, over every layer's keys and values.
    assert_eq!(report["depth"], 40, "{report}");
    let spec = ModelSource::open(&model).expect("model").spec;
    let per_position = (spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4) as u64;
    assert_eq!(report["kv_bytes_per_token"].as_u64(), Some(per_position * (40 + 4)), "{report}");
    // One bandwidth probe before the decode run and one after it, and the run's own roofline.
    assert_eq!(report["mem_bw_runs"].as_array().map(Vec::len), Some(2), "{report}");
    assert_eq!(report["roofline_runs"].as_array().map(Vec::len), Some(1), "{report}");
    // The weights are read once per token, and the process holds at least them.
    let weights = std::fs::metadata(&model).unwrap().len();
    let per_token = report["bytes_per_token"].as_u64().expect("bytes_per_token");
    assert!(per_token > weights / 2 && per_token <= weights, "{per_token} bytes per token for a {weights}-byte file");
    let rss = report["rss_bytes"].as_u64().expect("rss_bytes");
    assert!(rss > per_token && rss < 3 * weights + (512 << 20), "peak RSS {rss} for {weights} bytes of weights");

    let too_long = ["bench", "--model", m, "--prompt-tokens", "100000000", "--gen-tokens", "8", "--json"];
    let out = run_shoal(&too_long, Duration::from_secs(60));
    assert!(!out.status.success(), "a prompt past the context must be refused");
    assert!(String::from_utf8_lossy(&out.stderr).contains("context"), "{}", String::from_utf8_lossy(&out.stderr));
}
