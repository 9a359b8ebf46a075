//! Pipeline stages on real models: `StageService`s chained through serialized hidden states
//! (as they cross the wire) generate exactly what one node generates, greedy and seeded
//! sampling alike; a step out of position or for an unknown request is refused clearly.

use std::time::Duration;

use candle_core::Device;
use shoal::engine::generate::Prompt;
use shoal::engine::model::ModelSource;
use shoal::engine::stage::{StageService, Step, StepInput, StepOutput};
use shoal::engine::{LayerRange, LoadOptions, LoadedModel, SamplingParams};

use crate::util::{generate_ids, real_model};

/// Drives `stages` the way an entry node does: prefill, then one token at a time.
fn pipelined(stages: &mut [StageService], request_id: u64, prompt: &[u32], sampling: &SamplingParams, n: usize) -> Vec<u32> {
    let mut history = prompt.to_vec();
    let mut input = prompt.to_vec();
    let mut position = 0;
    let mut out = Vec::new();
    for _ in 0..n {
        let mut step_input = StepInput::Tokens(input.clone());
        let mut token = None;
        for stage in stages.iter_mut() {
            let step = Step { request_id, position, input: step_input, sampling: sampling.clone(), history: history.clone() };
            match stage.step(step).expect("stage step") {
                StepOutput::Hidden { rows, hidden, data } => step_input = StepInput::Hidden { rows, hidden, data },
                StepOutput::Token(t) => {
                    token = Some(t);
                    step_input = StepInput::Tokens(vec![]);
                }
            }
        }
        let t = token.expect("the last stage samples");
        position += input.len();
        out.push(t);
        history.push(t);
        input = vec![t];
    }
    out
}

fn stages(path: &std::path::Path, bounds: &[usize]) -> Vec<StageService> {
    let source = ModelSource::open(path).expect("opens");
    bounds
        .windows(2)
        .map(|w| StageService::new(source.load_shard(LayerRange::new(w[0], w[1]), &Device::Cpu).expect("shard"), 4, Duration::from_secs(60)))
        .collect()
}

#[test]
fn gemma3_two_and_three_stages_equal_one_node() {
    let path = real_model("gemma3-270m").join("model.gguf");
    let model = LoadedModel::load(&path, &LoadOptions::default()).expect("loads");
    let prompt = model.text.encode_prompt("The capital of France is").unwrap();
    let greedy = SamplingParams::greedy();
    let sampled = SamplingParams { temperature: 0.9, top_k: Some(40), top_p: 0.95, repetition_penalty: 1.1, seed: Some(7), ..Default::default() };
    for params in [&greedy, &sampled] {
        let expected = generate_ids(&model, Prompt::Tokens(prompt.clone()), params, 12);
        assert_eq!(pipelined(&mut stages(&path, &[0, 9, 18]), 1, &prompt, params, 12), expected, "two stages differ ({params:?})");
        assert_eq!(pipelined(&mut stages(&path, &[0, 5, 11, 18]), 2, &prompt, params, 12), expected, "three stages differ ({params:?})");
    }
}

#[test]
fn qwen25_three_stages_equal_one_node() {
    let path = real_model("qwen2.5-coder-1.5b").join("model.gguf");
    let model = LoadedModel::load(&path, &LoadOptions::default()).expect("loads");
    let prompt = model.text.encode_prompt("def fibonacci(n):").unwrap();
    let expected = generate_ids(&model, Prompt::Tokens(prompt.clone()), &SamplingParams::greedy(), 10);
    assert_eq!(pipelined(&mut stages(&path, &[0, 10, 19, 28]), 3, &prompt, &SamplingParams::greedy(), 10), expected);
}

#[test]
fn steps_out_of_position_or_for_unknown_requests_are_refused() {
    let path = real_model("gemma3-270m").join("model.gguf");
    let mut first = stages(&path, &[0, 9]).remove(0);
    let step = |request_id, position, ids: Vec<u32>| Step { request_id, position, input: StepInput::Tokens(ids), sampling: SamplingParams::greedy(), history: vec![] };
    let err = first.step(step(9, 3, vec![2])).expect_err("unknown request");
    assert!(err.to_string().contains("restart it from position 0"), "{err}");
    first.step(step(9, 0, vec![2, 818, 5279])).expect("prefill");
    let err = first.step(step(9, 5, vec![529])).expect_err("a gap in positions");
    assert!(err.to_string().contains("continues at position 5 but this stage is at 3"), "{err}");
    assert_eq!(first.sessions(), 0, "a broken request is forgotten");
    let bad = StepInput::Hidden { rows: 2, hidden: 640, data: vec![0; 100] };
    let mut last = stages(&path, &[9, 18]).remove(0);
    let err = last.step(Step { request_id: 1, position: 0, input: bad, sampling: SamplingParams::greedy(), history: vec![] }).expect_err("short frame");
    assert!(err.to_string().contains("do not hold"), "{err}");
}
