//! Builds a `tokenizers::Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata, for GGUF
//! models that come without a `tokenizer.json` (as llama.cpp and Ollama do).
//! `gpt2` (byte-level BPE; pre-tokenizer regex chosen by `tokenizer.ggml.pre`) and `llama`
//! (SentencePiece BPE with byte fallback; merges derived from the piece scores) are assembled
//! the way Hugging Face's converters write `tokenizer.json`, so both give the same ids.
//! Control tokens become special added tokens, user-defined ones plain added tokens; both are
//! matched whole in the raw text.
//! It deliberately adds no BOS/EOS post-processor (the engine adds BOS from
//! `tokenizer.ggml.add_bos_token`), renders no chat template, reads no files, and does not build
//! the `bert`, `t5` (Unigram), `rwkv` or other GGUF tokenizer models.

use std::borrow::Cow;
use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BpeBuilder, Error as BpeError, Merges, Vocab, BPE};
use tokenizers::normalizers::{
    NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence, NFC,
};
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// Everything that can go wrong turning GGUF metadata into a tokenizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufTokenizerError {
    /// A metadata key the tokenizer needs is absent.
    #[error("missing gguf metadata key `{0}`")]
    MissingKey(&'static str),
    /// `tokenizer.ggml.model` names a tokenizer this module does not build.
    #[error("unsupported tokenizer.ggml.model `{0}` (supported: {list})", list = SUPPORTED_MODELS.join(", "))]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a byte-level pre-tokenizer this module does not know.
    #[error("unsupported tokenizer.ggml.pre `{0}` (supported: {list})", list = SUPPORTED_PRE.join(", "))]
    UnsupportedPreTokenizer(String),
    /// A metadata value has the wrong type.
    #[error("gguf metadata `{key}` is {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    /// The metadata is well typed but inconsistent or out of bounds.
    #[error("malformed tokenizer metadata: {0}")]
    Malformed(String),
    /// The tokenizers library rejected the assembled parts.
    #[error("assembling the tokenizer: {0}")]
    Assemble(String),
}

type Result<T> = std::result::Result<T, GgufTokenizerError>;
type Metadata = HashMap<String, Value>;

const SUPPORTED_MODELS: &[&str] = &["gpt2", "llama"];
const SUPPORTED_PRE: &[&str] = &[
    "default",
    "gpt-2",
    "gpt2",
    "qwen2",
    "deepseek-r1-qwen",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "smaug-bpe",
    "dbrx",
];

/// Largest vocabulary accepted; real models stay below 300k tokens.
const MAX_VOCAB: usize = 1 << 21;
/// Largest merge list accepted for byte-level BPE.
const MAX_MERGES: usize = 1 << 22;
/// Longest single token or merge entry accepted, in bytes.
const MAX_TOKEN_BYTES: usize = 1 << 14;

/// The character SentencePiece uses for a space.
const SPM_SPACE: &str = "\u{2581}";

/// Pre-tokenizer regexes, exactly as in the Hugging Face `tokenizer.json` of each family.
const REGEX_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const REGEX_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Build a tokenizer from GGUF metadata (`gguf_file::Content::metadata`).
pub fn tokenizer_from_gguf(
    metadata: &HashMap<String, Value>,
) -> std::result::Result<Tokenizer, GgufTokenizerError> {
    let model = as_str(
        "tokenizer.ggml.model",
        required(metadata, "tokenizer.ggml.model")?,
    )?;
    match model {
        "gpt2" => byte_level_bpe(metadata),
        "llama" => sentencepiece_bpe(metadata),
        other => Err(GgufTokenizerError::UnsupportedModel(other.to_string())),
    }
}

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

/// The token list and token kinds shared by both tokenizer models.
struct GgufVocab<'a> {
    tokens: Vec<&'a str>,
    kinds: Vec<TokenKind>,
}

fn read_vocab(md: &Metadata) -> Result<GgufVocab<'_>> {
    let tokens = string_array(
        "tokenizer.ggml.tokens",
        required(md, "tokenizer.ggml.tokens")?,
        MAX_VOCAB,
    )?;
    if tokens.is_empty() {
        return Err(malformed("tokenizer.ggml.tokens is empty"));
    }
    let kinds = match md.get("tokenizer.ggml.token_type") {
        None => vec![TokenKind::Normal; tokens.len()],
        Some(v) => {
            let key = "tokenizer.ggml.token_type";
            let raw = array(key, v, MAX_VOCAB)?;
            check_len(key, raw.len(), tokens.len())?;
            raw.iter()
                .enumerate()
                .map(|(i, v)| match int(v) {
                    Some(0 | 1) => Ok(TokenKind::Normal),
                    Some(2) => Ok(TokenKind::Unknown),
                    Some(3) => Ok(TokenKind::Control),
                    Some(4) => Ok(TokenKind::UserDefined),
                    Some(5) => Ok(TokenKind::Unused),
                    Some(6) => Ok(TokenKind::Byte),
                    Some(t) => Err(malformed(format!(
                        "{key}[{i}] = {t} is not a token type (0..=6)"
                    ))),
                    None => Err(wrong_type(format!("{key}[{i}]"), "an integer", v)),
                })
                .collect::<Result<_>>()?
        }
    };
    Ok(GgufVocab { tokens, kinds })
}

/// How a byte-level family pre-tokenizes, as its Hugging Face `tokenizer.json` says.
struct ByteLevelStyle {
    /// Split regex ahead of the byte mapping; `None` is GPT-2's, built into `ByteLevel`.
    regex: Option<&'static str>,
    /// Whether text is NFC-normalized first (Qwen2).
    nfc: bool,
    /// `ByteLevel`'s `trim_offsets` (affects offsets only, never ids).
    trim_offsets: bool,
    /// Whether a word already in the vocabulary skips merging (Llama 3).
    ignore_merges: bool,
}

/// Byte-level BPE (`tokenizer.ggml.model = gpt2`): GPT-2, Qwen2, Llama 3 and their kin.
fn byte_level_bpe(md: &Metadata) -> Result<Tokenizer> {
    let pre = match md.get("tokenizer.ggml.pre") {
        Some(v) => as_str("tokenizer.ggml.pre", v)?,
        None => {
            tracing::warn!("gguf has no tokenizer.ggml.pre; using the gpt-2 pre-tokenizer");
            "default"
        }
    };
    let style = match pre {
        "default" | "gpt-2" | "gpt2" => ByteLevelStyle {
            regex: None,
            nfc: false,
            trim_offsets: true,
            ignore_merges: false,
        },
        "qwen2" | "deepseek-r1-qwen" => ByteLevelStyle {
            regex: Some(REGEX_QWEN2),
            nfc: true,
            trim_offsets: false,
            ignore_merges: false,
        },
        "llama3" | "llama-v3" | "llama-bpe" => ByteLevelStyle {
            regex: Some(REGEX_LLAMA3),
            nfc: false,
            trim_offsets: true,
            ignore_merges: true,
        },
        "smaug-bpe" | "dbrx" => ByteLevelStyle {
            regex: Some(REGEX_LLAMA3),
            nfc: false,
            trim_offsets: true,
            ignore_merges: false,
        },
        other => {
            return Err(GgufTokenizerError::UnsupportedPreTokenizer(
                other.to_string(),
            ))
        }
    };

    let GgufVocab { tokens, kinds } = read_vocab(md)?;
    let vocab = vocab_map(tokens.iter().copied());
    let merges = byte_level_merges(md)?;
    let bpe = build_bpe(
        BpeBuilder::new()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(style.ignore_merges),
    )?;

    let mut tokenizer = Tokenizer::new(bpe);
    if style.nfc {
        tokenizer.with_normalizer(Some(NFC)).map_err(assemble)?;
    }
    let pre_tokenizer: PreTokenizerWrapper = match style.regex {
        None => ByteLevel::new(false, style.trim_offsets, true).into(),
        Some(regex) => {
            let split = Split::new(
                SplitPattern::Regex(regex.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(assemble)?;
            let byte_level = ByteLevel::new(false, style.trim_offsets, false);
            PreTokenizerSequence::new(vec![split.into(), byte_level.into()]).into()
        }
    };
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevel::new(false, false, false)));
    add_added_tokens(
        &mut tokenizer,
        tokens.iter().map(|t| Cow::Borrowed(*t)),
        &kinds,
    )?;
    Ok(tokenizer)
}

/// Parses `tokenizer.ggml.merges`, one "left right" string per merge.
fn byte_level_merges(md: &Metadata) -> Result<Merges> {
    let key = "tokenizer.ggml.merges";
    string_array(key, required(md, key)?, MAX_MERGES)?
        .into_iter()
        .enumerate()
        .map(|(i, entry)| match entry.split_once(' ') {
            Some((left, right)) => Ok((left.to_string(), right.to_string())),
            None => Err(malformed(format!(
                "{key}[{i}] `{entry}` is not two tokens separated by a space"
            ))),
        })
        .collect()
}

/// Builds the BPE model; a merge naming a token outside the vocabulary is malformed metadata.
fn build_bpe(builder: BpeBuilder) -> Result<BPE> {
    builder
        .build()
        .map_err(|e| match e.downcast_ref::<BpeError>() {
            Some(BpeError::MergeTokenOutOfVocabulary(token)) => malformed(format!(
                "tokenizer.ggml.merges uses `{token}`, which is not in the vocabulary"
            )),
            _ => assemble(e),
        })
}

/// SentencePiece BPE (`tokenizer.ggml.model = llama`): Llama 2, Mistral, Gemma and their kin.
fn sentencepiece_bpe(md: &Metadata) -> Result<Tokenizer> {
    let GgufVocab { tokens, kinds } = read_vocab(md)?;
    let scores = match md.get("tokenizer.ggml.scores") {
        None => vec![0.0; tokens.len()],
        Some(v) => {
            let key = "tokenizer.ggml.scores";
            let raw = array(key, v, MAX_VOCAB)?;
            check_len(key, raw.len(), tokens.len())?;
            raw.iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::F32(x) => Ok(*x),
                    Value::F64(x) => Ok(*x as f32),
                    other => Err(wrong_type(format!("{key}[{i}]"), "a float", other)),
                })
                .collect::<Result<Vec<f32>>>()?
        }
    };
    let add_space_prefix = match md.get("tokenizer.ggml.add_space_prefix") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(wrong_type(
                "tokenizer.ggml.add_space_prefix",
                "a bool",
                other,
            ))
        }
    };
    let unk = match md.get("tokenizer.ggml.unknown_token_id") {
        Some(v) => Some(token_id(
            "tokenizer.ggml.unknown_token_id",
            v,
            tokens.len(),
        )?),
        None => kinds.iter().position(|k| *k == TokenKind::Unknown),
    };

    // The GGUF converter writes user-defined pieces with ' ' where SentencePiece has '▁'.
    let pieces: Vec<Cow<'_, str>> = tokens
        .iter()
        .zip(&kinds)
        .map(|(t, k)| match k {
            TokenKind::UserDefined if t.contains(' ') => Cow::Owned(t.replace(' ', SPM_SPACE)),
            _ => Cow::Borrowed(*t),
        })
        .collect();
    let vocab = vocab_map(pieces.iter().map(|p| p.as_ref()));
    let merges = sentencepiece_merges(&pieces, &scores, &kinds, &vocab);

    let mut builder = BpeBuilder::new()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(pieces[unk].to_string());
    }
    let mut tokenizer = Tokenizer::new(build_bpe(builder)?);

    let replace_space = Replace::new(" ", SPM_SPACE).map_err(assemble)?;
    let normalizer: NormalizerWrapper = if add_space_prefix {
        NormalizerSequence::new(vec![
            Prepend::new(SPM_SPACE.to_string()).into(),
            replace_space.into(),
        ])
        .into()
    } else {
        replace_space.into()
    };
    tokenizer
        .with_normalizer(Some(normalizer))
        .map_err(assemble)?;
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPM_SPACE, " ").map_err(assemble)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    tokenizer.with_decoder(Some(DecoderSequence::new(decoders)));
    add_added_tokens(&mut tokenizer, pieces.into_iter(), &kinds)?;
    Ok(tokenizer)
}

/// Merges implied by a SentencePiece vocabulary, in the order Hugging Face's converter
/// (`generate_merges`) writes them: every split of a piece into two vocabulary pieces is a
/// merge, sorted by the piece's score (descending), then the left and right parts' lengths in
/// characters (descending), then piece id, left id and right id.
/// SentencePiece scores control and user-defined pieces 0; GGUF converters overwrite those
/// scores with -1000, so they are read as 0 here.
/// Costs one hash lookup per split point, i.e. O(total characters in the vocabulary).
fn sentencepiece_merges(
    pieces: &[Cow<'_, str>],
    scores: &[f32],
    kinds: &[TokenKind],
    vocab: &Vocab,
) -> Merges {
    struct Candidate {
        score: f32,
        left_chars: u32,
        right_chars: u32,
        piece: u32,
        left: u32,
        right: u32,
    }
    let mut candidates = Vec::new();
    for (id, piece) in pieces.iter().enumerate() {
        let id = id as u32; // fits: the vocabulary is capped at MAX_VOCAB
                            // Of duplicate pieces only the one the vocabulary maps to takes part.
        if vocab.get(piece.as_ref()) != Some(&id) {
            continue;
        }
        let score = match kinds[id as usize] {
            TokenKind::Control | TokenKind::UserDefined => 0.0,
            // NaN sorts last; adding 0.0 turns -0.0 into 0.0 so the two compare equal.
            _ if scores[id as usize].is_nan() => f32::NEG_INFINITY,
            _ => scores[id as usize] + 0.0,
        };
        let chars = piece.chars().count() as u32;
        for (left_chars, (at, _)) in piece.char_indices().enumerate().skip(1) {
            let (left, right) = piece.split_at(at);
            let Some(&left) = vocab.get(left) else {
                continue;
            };
            let Some(&right) = vocab.get(right) else {
                continue;
            };
            let left_chars = left_chars as u32;
            candidates.push(Candidate {
                score,
                left_chars,
                right_chars: chars - left_chars,
                piece: id,
                left,
                right,
            });
        }
    }
    candidates.sort_unstable_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
            .then(a.piece.cmp(&b.piece))
            .then(a.left.cmp(&b.left))
            .then(a.right.cmp(&b.right))
    });
    candidates
        .into_iter()
        .map(|c| {
            (
                pieces[c.left as usize].to_string(),
                pieces[c.right as usize].to_string(),
            )
        })
        .collect()
}

/// Token string -> id; with duplicate strings the last id wins, as in llama.cpp.
fn vocab_map<'a>(tokens: impl ExactSizeIterator<Item = &'a str>) -> Vocab {
    let mut vocab = Vocab::with_capacity(tokens.len());
    let mut duplicates = 0usize;
    for (id, token) in tokens.enumerate() {
        // `as u32` fits: the vocabulary is capped at MAX_VOCAB.
        if vocab.insert(token.to_string(), id as u32).is_some() {
            duplicates += 1;
        }
    }
    if duplicates > 0 {
        tracing::warn!(
            duplicates,
            "gguf vocabulary repeats token strings; the last id of each wins"
        );
    }
    vocab
}

/// Registers control and unknown tokens as special added tokens, user-defined ones as plain
/// added tokens (as Hugging Face does, so `skip_special_tokens` keeps them); all are matched
/// whole in the raw text, before normalization.
fn add_added_tokens<'a>(
    tokenizer: &mut Tokenizer,
    contents: impl Iterator<Item = Cow<'a, str>>,
    kinds: &[TokenKind],
) -> Result<()> {
    let mut special = Vec::new();
    let mut user_defined = Vec::new();
    for (content, kind) in contents.zip(kinds) {
        match kind {
            TokenKind::Control | TokenKind::Unknown => {
                special.push(AddedToken::from(content.into_owned(), true).normalized(false))
            }
            TokenKind::UserDefined => {
                user_defined.push(AddedToken::from(content.into_owned(), false).normalized(false))
            }
            TokenKind::Normal | TokenKind::Unused | TokenKind::Byte => {}
        }
    }
    if !special.is_empty() {
        tokenizer.add_special_tokens(special).map_err(assemble)?;
    }
    if !user_defined.is_empty() {
        tokenizer.add_tokens(user_defined).map_err(assemble)?;
    }
    Ok(())
}

fn required<'a>(md: &'a Metadata, key: &'static str) -> Result<&'a Value> {
    md.get(key).ok_or(GgufTokenizerError::MissingKey(key))
}

fn as_str<'a>(key: &str, v: &'a Value) -> Result<&'a str> {
    match v {
        Value::String(s) => Ok(s),
        other => Err(wrong_type(key, "a string", other)),
    }
}

fn array<'a>(key: &str, v: &'a Value, max: usize) -> Result<&'a [Value]> {
    match v {
        Value::Array(a) if a.len() > max => Err(malformed(format!(
            "{key} has {} entries, more than {max}",
            a.len()
        ))),
        Value::Array(a) => Ok(a),
        other => Err(wrong_type(key, "an array", other)),
    }
}

fn string_array<'a>(key: &str, v: &'a Value, max: usize) -> Result<Vec<&'a str>> {
    array(key, v, max)?
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) if s.len() > MAX_TOKEN_BYTES => Err(malformed(format!(
                "{key}[{i}] is {} bytes long, more than {MAX_TOKEN_BYTES}",
                s.len()
            ))),
            Value::String(s) => Ok(s.as_str()),
            other => Err(wrong_type(format!("{key}[{i}]"), "a string", other)),
        })
        .collect()
}

fn int(v: &Value) -> Option<i64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::I8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::U64(x) => i64::try_from(x).ok().or(Some(i64::MAX)),
        Value::I64(x) => Some(x),
        _ => None,
    }
}

/// An integer metadata value that must index the vocabulary.
fn token_id(key: &str, v: &Value, vocab_len: usize) -> Result<usize> {
    let id = int(v).ok_or_else(|| wrong_type(key, "an integer", v))?;
    usize::try_from(id)
        .ok()
        .filter(|id| *id < vocab_len)
        .ok_or_else(|| {
            malformed(format!(
                "{key} = {id} is outside the vocabulary of {vocab_len} tokens"
            ))
        })
}

fn check_len(key: &str, len: usize, vocab_len: usize) -> Result<()> {
    if len == vocab_len {
        Ok(())
    } else {
        Err(malformed(format!(
            "{key} has {len} entries but tokenizer.ggml.tokens has {vocab_len}"
        )))
    }
}

fn wrong_type(key: impl Into<String>, expected: &'static str, found: &Value) -> GgufTokenizerError {
    GgufTokenizerError::WrongType {
        key: key.into(),
        expected,
        found: format!("{:?}", found.value_type()),
    }
}

fn malformed(msg: impl Into<String>) -> GgufTokenizerError {
    GgufTokenizerError::Malformed(msg.into())
}

fn assemble(e: impl std::fmt::Display) -> GgufTokenizerError {
    GgufTokenizerError::Assemble(e.to_string())
}
