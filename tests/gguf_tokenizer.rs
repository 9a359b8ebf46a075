//! The tokenizer built from GGUF metadata (`engine::gguf_tokenizer`): against the reference
//! `tokenizer.json` of real models (same ids, same decoded text on varied strings), and on
//! malformed or synthetic metadata (clear errors, no panics).
//! The real-model tests need `scripts/fetch-model.sh`'s cache and fail, never skip, without it.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use shoal::engine::gguf_tokenizer::{tokenizer_from_gguf, GgufTokenizerError};
use tokenizers::Tokenizer;


/// Strings covering the tokenizer's corners; the chat markers of both families are included.
const TEXTS: &[&str] = &[
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "multiple   spaces    inside     text",
    "line one\nline two\n\nline four\n\n\n",
    "\n\nstarts with newlines",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet x = vec![1, 2, 3];\n\tprintln!(\"{:?}\", x);\n}\n",
    "\t\ttabs\tand\t\t\tmore tabs",
    "mixed \t \n whitespace \r\n windows line",
    "Numbers: 0 7 42 123 1234 12345 3.14159 -2.5e10 1,000,000",
    "Phone 555-0199, year 2024, ISBN 978-3-16-148410-0",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "中文测试：你好，世界！机器学习很有趣。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Café déjà vu, naïve coöperation, façade, Ærøskøbing, Straße",
    "Cafe\u{301} decomposed accent",
    "Ελληνικά και русский текст, עברית, العربية",
    "I'm sure you've seen it; they'll say we'd done it. DON'T SHOUT",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|><|endoftext|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "text<end_of_turn>more<start_of_turn>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<table><tr><td>cell</td></tr></table>",
    "<bos>literal bos<eos>",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@c.io",
    "{\"key\": [1, 2, {\"nested\": null}], \"b\": true}",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%o%';",
    "∑ᵢ xᵢ² ≤ ∞ — “quotes” ‘single’ … •",
    "A",
    "",
    " ",
    "\u{0}\u{1}\u{7f} control chars and \u{feff} BOM",
    "unknown-ish: ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u{10FFFF}",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "                                                  fifty spaces then text",
];

/// (VmRSS, VmHWM) of this process in KiB, zeros where /proc is unavailable; for the log only.
fn memory_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn compare_with_reference(id: &str) -> Result<()> {
    let dir = crate::util::real_model(id);
    let mut file = std::fs::File::open(dir.join("model.gguf"))?;
    let content = Content::read(&mut file).context("reading gguf metadata")?;

    let (rss_before, _) = memory_kib();
    let start = Instant::now();
    let built = tokenizer_from_gguf(&content.metadata)?;
    let elapsed = start.elapsed();
    let (rss_after, peak) = memory_kib();
    eprintln!(
        "{id}: tokenizer built from gguf metadata in {elapsed:?}; rss {} -> {} MiB (process peak {} MiB)",
        rss_before / 1024,
        rss_after / 1024,
        peak / 1024
    );

    let start = Instant::now();
    let reference = Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| anyhow!("reference tokenizer.json: {e}"))?;
    let (rss_reference, _) = memory_kib();
    eprintln!(
        "{id}: reference tokenizer.json loaded in {:?}; rss -> {} MiB",
        start.elapsed(),
        rss_reference / 1024
    );

    let mut failures = Vec::new();
    for text in TEXTS {
        let ours = built
            .encode(*text, false)
            .map_err(|e| anyhow!("encode {text:?}: {e}"))?;
        let theirs = reference
            .encode(*text, false)
            .map_err(|e| anyhow!("reference encode {text:?}: {e}"))?;
        if ours.get_ids() != theirs.get_ids() {
            failures.push(format!(
                "{text:?}: ids {:?} != reference {:?}",
                ours.get_ids(),
                theirs.get_ids()
            ));
            continue;
        }
        let ours = built
            .decode(ours.get_ids(), false)
            .map_err(|e| anyhow!("decode {text:?}: {e}"))?;
        let theirs = reference
            .decode(theirs.get_ids(), false)
            .map_err(|e| anyhow!("reference decode {text:?}: {e}"))?;
        if ours != theirs {
            failures.push(format!(
                "{text:?}: decoded {ours:?} != reference {theirs:?}"
            ));
        }
    }
    eprintln!(
        "{id}: {} of {} strings match the reference",
        TEXTS.len() - failures.len(),
        TEXTS.len()
    );
    if !failures.is_empty() {
        bail!(
            "{id}: {} mismatches:\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
    Ok(())
}

#[test]
fn gemma3_matches_reference_tokenizer() -> Result<()> {
    compare_with_reference("gemma3-270m")
}

#[test]
fn qwen2_matches_reference_tokenizer() -> Result<()> {
    compare_with_reference("qwen2.5-coder-1.5b")
}

#[test]
fn gemma3_chat_markers_are_single_tokens() -> Result<()> {
    let dir = crate::util::real_model("gemma3-270m");
    let content = Content::read(&mut std::fs::File::open(dir.join("model.gguf"))?)?;
    let tok = tokenizer_from_gguf(&content.metadata)?;
    let ids = tok
        .encode("<start_of_turn>user\nhi<end_of_turn>", false)
        .map_err(|e| anyhow!("{e}"))?;
    let start = tok
        .token_to_id("<start_of_turn>")
        .context("no <start_of_turn>")?;
    let end = tok
        .token_to_id("<end_of_turn>")
        .context("no <end_of_turn>")?;
    assert_eq!(ids.get_ids().first(), Some(&start));
    assert_eq!(ids.get_ids().last(), Some(&end));
    // Control tokens are special (dropped when skipping specials); user-defined "\n" is not.
    assert_eq!(
        tok.decode(ids.get_ids(), true)
            .map_err(|e| anyhow!("{e}"))?,
        "user\nhi"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Synthetic metadata: errors and a tiny SentencePiece vocabulary.
// ---------------------------------------------------------------------------------------

fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
}

/// A tiny Llama-2-style SentencePiece vocabulary.
fn spm_metadata() -> HashMap<String, Value> {
    let tokens = [
        "<unk>", "<s>", "</s>", "<0x0A>", "<0xC3>", "<0xA9>", "▁", "h", "i", "▁h", "▁hi", "<ctl>",
        "  ",
    ];
    let scores = [
        0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -1000.0, -1000.0,
    ];
    let types = [2, 3, 3, 6, 6, 6, 1, 1, 1, 1, 1, 3, 4];
    HashMap::from([
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("llama".into()),
        ),
        ("tokenizer.ggml.tokens".to_string(), strings(&tokens)),
        (
            "tokenizer.ggml.scores".to_string(),
            Value::Array(scores.iter().map(|s| Value::F32(*s)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(types.iter().map(|t| Value::I32(*t)).collect()),
        ),
        ("tokenizer.ggml.unknown_token_id".to_string(), Value::U32(0)),
    ])
}

fn bpe_metadata() -> HashMap<String, Value> {
    HashMap::from([
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            Value::String("qwen2".into()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            strings(&["h", "i", "hi", "Ġ", "Ġhi", "<|im_start|>"]),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array([1, 1, 1, 1, 1, 3].map(Value::I32).to_vec()),
        ),
        (
            "tokenizer.ggml.merges".to_string(),
            strings(&["h i", "Ġ hi"]),
        ),
    ])
}

fn error_of(md: &HashMap<String, Value>) -> GgufTokenizerError {
    match tokenizer_from_gguf(md) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

#[test]
fn synthetic_sentencepiece_vocab_encodes_and_decodes() -> Result<()> {
    let tok = tokenizer_from_gguf(&spm_metadata())?;
    let enc = tok
        .encode("hi hi\né<ctl>", false)
        .map_err(|e| anyhow!("{e}"))?;
    // Llama 2 style: a space prefix is added, '\n' and 'é' fall back to bytes, <ctl> is one token.
    assert_eq!(enc.get_ids(), &[10, 10, 3, 4, 5, 11]);
    assert_eq!(
        tok.decode(enc.get_ids(), false)
            .map_err(|e| anyhow!("{e}"))?,
        "hi hi\né<ctl>"
    );
    // The user-defined "  " is stored by SentencePiece as "▁▁".
    assert_eq!(tok.token_to_id("▁▁"), Some(12));
    Ok(())
}

#[test]
fn synthetic_byte_level_vocab_matches_special_tokens_whole() -> Result<()> {
    let tok = tokenizer_from_gguf(&bpe_metadata())?;
    let enc = tok
        .encode("<|im_start|>hi hi", false)
        .map_err(|e| anyhow!("{e}"))?;
    assert_eq!(enc.get_ids(), &[5, 2, 4]);
    assert_eq!(
        tok.decode(enc.get_ids(), false)
            .map_err(|e| anyhow!("{e}"))?,
        "<|im_start|>hi hi"
    );
    Ok(())
}

#[test]
fn malformed_metadata_gives_clear_errors() {
    let e = error_of(&HashMap::new());
    assert!(
        matches!(e, GgufTokenizerError::MissingKey("tokenizer.ggml.model")),
        "{e}"
    );

    let mut md = spm_metadata();
    md.insert("tokenizer.ggml.model".into(), Value::String("t5".into()));
    let e = error_of(&md);
    assert!(matches!(e, GgufTokenizerError::UnsupportedModel(_)), "{e}");
    assert!(e.to_string().contains("gpt2, llama"), "{e}");

    let mut md = spm_metadata();
    md.insert("tokenizer.ggml.model".into(), Value::U32(1));
    assert!(matches!(
        error_of(&md),
        GgufTokenizerError::WrongType { .. }
    ));

    let mut md = spm_metadata();
    md.remove("tokenizer.ggml.tokens");
    assert!(matches!(
        error_of(&md),
        GgufTokenizerError::MissingKey("tokenizer.ggml.tokens")
    ));

    let mut md = spm_metadata();
    md.insert("tokenizer.ggml.tokens".into(), Value::String("x".into()));
    assert!(matches!(
        error_of(&md),
        GgufTokenizerError::WrongType { .. }
    ));

    let mut md = spm_metadata();
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(vec![Value::String("a".into()), Value::U8(1)]),
    );
    let e = error_of(&md);
    assert!(
        matches!(&e, GgufTokenizerError::WrongType { key, .. } if key == "tokenizer.ggml.tokens[1]"),
        "{e}"
    );

    let mut md = spm_metadata();
    md.insert("tokenizer.ggml.tokens".into(), Value::Array(vec![]));
    assert!(matches!(error_of(&md), GgufTokenizerError::Malformed(_)));

    let mut md = spm_metadata();
    md.insert(
        "tokenizer.ggml.scores".into(),
        Value::Array(vec![Value::F32(0.0); 3]),
    );
    let e = error_of(&md);
    assert!(
        matches!(e, GgufTokenizerError::Malformed(_)) && e.to_string().contains("entries"),
        "{e}"
    );

    let mut md = spm_metadata();
    md.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(vec![Value::I32(9); 13]),
    );
    assert!(matches!(error_of(&md), GgufTokenizerError::Malformed(_)));

    let mut md = spm_metadata();
    md.insert("tokenizer.ggml.unknown_token_id".into(), Value::I64(-1));
    assert!(matches!(error_of(&md), GgufTokenizerError::Malformed(_)));

    let mut md = spm_metadata();
    md.insert(
        "tokenizer.ggml.add_space_prefix".into(),
        Value::String("yes".into()),
    );
    assert!(matches!(
        error_of(&md),
        GgufTokenizerError::WrongType { .. }
    ));

    let mut md = spm_metadata();
    md.insert(
        "tokenizer.ggml.tokens".into(),
        strings(&["x".repeat(1 << 20).as_str()]),
    );
    assert!(matches!(error_of(&md), GgufTokenizerError::Malformed(_)));

    let mut md = spm_metadata();
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(vec![Value::Bool(true); (1 << 21) + 1]),
    );
    let e = error_of(&md);
    assert!(
        matches!(e, GgufTokenizerError::Malformed(_)) && e.to_string().contains("more than"),
        "{e}"
    );

    let mut md = bpe_metadata();
    md.insert("tokenizer.ggml.pre".into(), Value::String("mystery".into()));
    let e = error_of(&md);
    assert!(
        matches!(e, GgufTokenizerError::UnsupportedPreTokenizer(_))
            && e.to_string().contains("qwen2"),
        "{e}"
    );

    let mut md = bpe_metadata();
    md.remove("tokenizer.ggml.merges");
    assert!(matches!(
        error_of(&md),
        GgufTokenizerError::MissingKey("tokenizer.ggml.merges")
    ));

    let mut md = bpe_metadata();
    md.insert("tokenizer.ggml.merges".into(), strings(&["hi"]));
    assert!(matches!(error_of(&md), GgufTokenizerError::Malformed(_)));

    let mut md = bpe_metadata();
    md.insert("tokenizer.ggml.merges".into(), strings(&["h x"]));
    let e = error_of(&md);
    assert!(
        matches!(e, GgufTokenizerError::Malformed(_)) && e.to_string().contains("`x`"),
        "{e}"
    );

    let mut md = bpe_metadata();
    md.insert("tokenizer.ggml.merges".into(), strings(&["i h"]));
    assert!(
        matches!(error_of(&md), GgufTokenizerError::Malformed(_)),
        "merged token `ih` is not in the vocab"
    );
}
