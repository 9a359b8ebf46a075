//! Bad input through the CLI: a missing file, truncated or corrupt GGUF and safetensors, an
//! unknown architecture and an over-long prompt each end with a clear message on stderr and a
//! non-zero exit code, never a panic or a hang.

use std::path::Path;
use std::time::Duration;

use crate::util::{fixture, real_model, run_shoal};

/// Runs `shoal run` on `model` and returns stderr, asserting a clean failure.
fn fails_cleanly(model: &Path, prompt: &str) -> String {
    let out = run_shoal(&["run", "--model", model.to_str().unwrap(), "--prompt", prompt, "--max-tokens", "4"], Duration::from_secs(60));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "shoal run on {} should fail", model.display());
    assert_eq!(out.status.code(), Some(1), "a clean error exits with 1, not a signal or panic code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "shoal panicked: {stderr}");
    assert!(stderr.contains("error:"), "no error message: {stderr}");
    assert!(out.stdout.is_empty(), "nothing on stdout when failing");
    stderr
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

#[test]
fn missing_model_file() {
    let err = fails_cleanly(Path::new("/nonexistent/model.gguf"), "hi");
    assert!(err.contains("no such file"), "{err}");
}

#[test]
fn truncated_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let src = real_model("gemma3-270m").join("model.gguf");
    let bytes = std::fs::read(&src).unwrap();
    let cut = dir.path().join("model.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = fails_cleanly(&cut, "hi");
    assert!(err.contains("truncated") || err.contains("ends at byte"), "{err}");
    // Cut inside the header (metadata) as well.
    std::fs::write(&cut, &bytes[..100_000]).unwrap();
    let err = fails_cleanly(&cut, "hi");
    assert!(err.contains("not a readable GGUF"), "{err}");
}

#[test]
fn corrupt_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("garbage.gguf");
    // Right magic, then a header whose counts and lengths are nonsense.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    bytes.extend(std::iter::repeat_n(0xAB, 4096));
    std::fs::write(&path, &bytes).unwrap();
    fails_cleanly(&path, "hi");
    std::fs::write(&path, b"definitely not a model").unwrap();
    let err = fails_cleanly(&path, "hi");
    assert!(err.contains("not a GGUF file"), "{err}");
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("qwen2");
    copy_dir(&fixture("qwen2"), &model);
    let weights = model.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 1000]).unwrap();
    fails_cleanly(&model, "hi");
    let mut bad_header = bytes.clone();
    bad_header[8..40].copy_from_slice(&[b'#'; 32]);
    std::fs::write(&weights, &bad_header).unwrap();
    fails_cleanly(&model, "hi");
    std::fs::write(model.join("config.json"), "{ not json").unwrap();
    let err = fails_cleanly(&model, "hi");
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn unknown_architecture_lists_supported_ones() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    copy_dir(&fixture("qwen2"), &model);
    let cfg = std::fs::read_to_string(model.join("config.json")).unwrap().replace("\"qwen2\"", "\"falcon\"").replace("Qwen2ForCausalLM", "FalconForCausalLM");
    std::fs::write(model.join("config.json"), cfg).unwrap();
    let err = fails_cleanly(&model, "hi");
    assert!(err.contains("unsupported architecture `falcon`"), "{err}");
    for family in ["llama", "mistral", "qwen2", "qwen3", "gemma3"] {
        assert!(err.contains(family), "the message lists {family}: {err}");
    }
}

#[test]
fn prompt_longer_than_the_context() {
    let model = real_model("gemma3-270m").join("model.gguf");
    let model = model.to_str().unwrap();
    let prompt = "word ".repeat(100);
    let out = run_shoal(&["run", "--model", model, "--context", "64", "--prompt", &prompt], Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("tokens does not fit the context of 64 tokens"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    // Past the model's own 32k window, with the prompt from a file (too long for argv).
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "word ".repeat(33_000)).unwrap();
    let out = run_shoal(&["run", "--model", model, "--prompt-file", file.to_str().unwrap()], Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("does not fit the context of 32768 tokens"), "{err}");
}
