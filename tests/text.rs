//! Text and sampling on a real model: same seed gives the same output and different seeds
//! differ, stop strings end the stream without being emitted, streamed pieces concatenate to
//! the full decode, invalid sampling settings are refused, and peak memory stays bounded.

use std::time::Duration;

use shoal::engine::generate::{generate, Prompt};
use shoal::engine::text::ChatMessage;
use shoal::engine::{FinishReason, GenerationEvent, GenerationRequest, LoadOptions, LoadedModel, SamplingParams};

use crate::util::{real_model, run_shoal};

fn gemma() -> LoadedModel {
    LoadedModel::load(&real_model("gemma3-270m").join("model.gguf"), &LoadOptions::default()).expect("model loads")
}

/// Runs a request; returns (token ids, streamed text, finish reason).
fn run(model: &LoadedModel, req: &GenerationRequest) -> (Vec<u32>, String, FinishReason) {
    let (mut ids, mut text, mut finish) = (Vec::new(), String::new(), None);
    generate(model, req, &mut |e| {
        match e {
            GenerationEvent::Token { id, text: t } => {
                if id != u32::MAX {
                    ids.push(id);
                }
                text.push_str(&t);
            }
            GenerationEvent::Done { finish: f, .. } => finish = Some(f),
        }
        true
    })
    .expect("generation succeeds");
    (ids, text, finish.expect("a Done event ends every generation"))
}

fn sampled(seed: u64) -> GenerationRequest {
    GenerationRequest {
        prompt: Prompt::Text("Once upon a time".into()),
        sampling: SamplingParams { temperature: 1.0, top_k: Some(40), top_p: 0.95, min_p: 0.05, repetition_penalty: 1.1, seed: Some(seed), ..Default::default() },
        max_tokens: Some(24),
        stop: vec![],
    }
}

#[test]
fn same_seed_same_output_different_seed_different_output() {
    let model = gemma();
    let a = run(&model, &sampled(42));
    let b = run(&model, &sampled(42));
    assert_eq!(a.0, b.0, "same seed must give the same tokens");
    let others: Vec<Vec<u32>> = (1..4).map(|s| run(&model, &sampled(s)).0).collect();
    assert!(others.iter().any(|o| *o != a.0), "different seeds never changed the output");
}

#[test]
fn streamed_pieces_concatenate_to_the_full_decode_and_stop_strings_cut() {
    let model = gemma();
    let greedy = |stop: Vec<String>, prompt: &str| GenerationRequest { prompt: Prompt::Text(prompt.into()), sampling: SamplingParams::greedy(), max_tokens: Some(40), stop };
    // Multi-byte text (accents, CJK, emoji) streamed piece by piece must equal one decode.
    for prompt in ["The capital of France is", "Les crêpes et le café à Paris,", "日本の首都は", "My favourite emoji are 🎉 and"] {
        let (ids, text, finish) = run(&model, &greedy(vec![], prompt));
        assert_eq!(finish, FinishReason::Length);
        assert_eq!(text, model.text.decode(&ids).unwrap(), "streamed text differs from the full decode for {prompt:?}");
        assert!(!text.contains('\u{FFFD}'), "a character was split: {text:?}");
    }
    // Greedy output for this prompt says "France. It is"; stop at "It".
    let (_, full, _) = run(&model, &greedy(vec![], "The capital of France is"));
    let at = full.find(" It").expect("the greedy continuation contains ' It'");
    let (_, cut, finish) = run(&model, &greedy(vec![" It".into()], "The capital of France is"));
    assert_eq!(finish, FinishReason::Stop);
    assert_eq!(cut, full[..at], "output must end right before the stop string");
}

#[test]
fn invalid_sampling_settings_are_refused() {
    let model = gemma();
    for bad in [
        SamplingParams { temperature: -1.0, ..Default::default() },
        SamplingParams { top_p: 0.0, ..Default::default() },
        SamplingParams { min_p: 1.5, ..Default::default() },
        SamplingParams { repetition_penalty: 0.0, ..Default::default() },
        SamplingParams { presence_penalty: 3.0, ..Default::default() },
        SamplingParams { top_k: Some(0), ..Default::default() },
    ] {
        let req = GenerationRequest { prompt: Prompt::Text("hi".into()), sampling: bad.clone(), max_tokens: Some(2), stop: vec![] };
        let err = generate(&model, &req, &mut |_| true).expect_err("invalid settings are refused");
        assert!(err.to_string().starts_with("invalid request"), "{bad:?}: {err}");
    }
    let req = GenerationRequest { prompt: Prompt::Tokens(vec![2, 999_999]), sampling: SamplingParams::greedy(), max_tokens: Some(2), stop: vec![] };
    let err = generate(&model, &req, &mut |_| true).expect_err("out-of-vocabulary ids are refused");
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}

#[test]
fn chat_needs_a_template_and_stop_tokens_end_a_turn() {
    // Gemma 3 270M is a base model whose GGUF carries no chat template: a clear error.
    let model = gemma();
    let chat = GenerationRequest { prompt: Prompt::Chat(vec![ChatMessage { role: "user".into(), content: "hi".into() }]), sampling: SamplingParams::greedy(), max_tokens: Some(4), stop: vec![] };
    let err = generate(&model, &chat, &mut |_| true).expect_err("no template");
    assert!(err.to_string().contains("no chat template"), "{err}");
    // Its end-of-turn token is a stop token (found in the vocabulary, as llama.cpp does).
    assert!(model.text.stop_ids().contains(&106) && model.text.stop_ids().contains(&1), "{:?}", model.text.stop_ids());

    // Qwen2.5 Coder Instruct answers a chat turn and stops at <|im_end|> on its own.
    let qwen = LoadedModel::load(&real_model("qwen2.5-coder-1.5b").join("model.gguf"), &LoadOptions::default()).expect("loads");
    let chat = GenerationRequest {
        prompt: Prompt::Chat(vec![
            ChatMessage { role: "system".into(), content: "Answer with one word.".into() },
            ChatMessage { role: "user".into(), content: "What is the capital of France?".into() },
        ]),
        sampling: SamplingParams::greedy(),
        max_tokens: Some(16),
        stop: vec![],
    };
    let (_, text, finish) = run(&qwen, &chat);
    assert_eq!(finish, FinishReason::Stop, "the turn ends by its stop token: {text:?}");
    assert!(text.contains("Paris") && !text.contains("<|im_end|>"), "{text:?}");
}

#[test]
fn gemma3_270m_peak_rss_stays_under_600_mb() {
    let model = real_model("gemma3-270m").join("model.gguf");
    let out = run_shoal(&["run", "--model", model.to_str().unwrap(), "--prompt", "Once upon a time", "--max-tokens", "64"], Duration::from_secs(120));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let mb: u64 = err.lines().find_map(|l| l.strip_prefix("peak RSS ")).and_then(|l| l.trim_end_matches(" MB").parse().ok()).expect("peak RSS is reported");
    eprintln!("gemma3-270m Q4_K_M peak RSS: {mb} MB");
    assert!(mb < 600, "peak RSS {mb} MB exceeds 600 MB");
}
