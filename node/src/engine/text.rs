//! Text in and out of a model: the tokenizer (tokenizer.json beside the weights, or built
//! from GGUF metadata), BOS and stop tokens from the model's metadata, the model's own chat
//! template rendered with minijinja, and UTF-8-safe incremental detokenization for streaming.
//! It does not sample or run the model.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value as GgufValue;
use serde_json::Value;
use tokenizers::Tokenizer;

use super::weights::read_to_string;
use super::{EngineError, Result};

/// Token strings that end a turn in common chat formats (llama.cpp treats the same as end of generation).
const END_OF_TURN_TOKENS: &[&str] = &["<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "<|end_of_text|>"];

/// One message of a chat, as OpenAI and chat templates name them.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct TextCodec {
    tokenizer: Tokenizer,
    bos: Option<(u32, String)>,
    eos_text: Option<String>,
    add_bos: bool,
    stop_ids: Vec<u32>,
    chat_template: Option<String>,
}

impl TextCodec {
    /// For a GGUF file: `tokenizer.json` beside it when present, else the GGUF's own vocabulary.
    pub fn for_gguf(path: &Path, md: &HashMap<String, GgufValue>) -> Result<Self> {
        let beside = path.parent().map(|d| d.join("tokenizer.json"));
        let tokenizer = match beside {
            Some(p) if p.exists() => load_tokenizer_json(&p)?,
            _ => super::gguf_tokenizer::tokenizer_from_gguf(md)?,
        };
        let get_u32 = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        let is_spm = md.get("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).map(|s| s == "llama").unwrap_or(false);
        let add_bos = md.get("tokenizer.ggml.add_bos_token").and_then(|v| v.to_bool().ok()).unwrap_or(is_spm);
        let mut stop_ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"].iter().filter_map(|k| get_u32(k)).collect();
        let bos = get_u32("tokenizer.ggml.bos_token_id").and_then(|id| tokenizer.id_to_token(id).map(|t| (id, t)));
        let eos_text = get_u32("tokenizer.ggml.eos_token_id").and_then(|id| tokenizer.id_to_token(id));
        add_end_of_turn_tokens(&tokenizer, &mut stop_ids);
        let chat_template = md.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned();
        Ok(TextCodec { tokenizer, bos, eos_text, add_bos, stop_ids, chat_template })
    }

    /// For an HF model directory: tokenizer.json, tokenizer_config.json, generation_config.json.
    pub fn for_hf_dir(dir: &Path, config: &Value) -> Result<Self> {
        let tokenizer = load_tokenizer_json(&dir.join("tokenizer.json"))?;
        let tok_cfg = read_json_if_present(&dir.join("tokenizer_config.json"))?;
        let gen_cfg = read_json_if_present(&dir.join("generation_config.json"))?;
        let token_text = |v: Option<&Value>| -> Option<String> {
            match v? {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
                _ => None,
            }
        };
        let bos_text = token_text(tok_cfg.get("bos_token"));
        let bos = bos_text
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t).map(|id| (id, t.to_string())))
            .or_else(|| config.get("bos_token_id").and_then(Value::as_u64).and_then(|id| tokenizer.id_to_token(id as u32).map(|t| (id as u32, t))));
        let family_adds_bos = matches!(config.get("model_type").and_then(Value::as_str), Some("llama" | "mistral" | "gemma3" | "gemma3_text"));
        let add_bos = tok_cfg.get("add_bos_token").and_then(Value::as_bool).unwrap_or(family_adds_bos) && bos.is_some();
        let mut stop_ids = Vec::new();
        for src in [gen_cfg.get("eos_token_id"), config.get("eos_token_id")] {
            match src {
                Some(Value::Number(n)) => stop_ids.extend(n.as_u64().map(|x| x as u32)),
                Some(Value::Array(a)) => stop_ids.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32)),
                _ => {}
            }
        }
        let eos_text = token_text(tok_cfg.get("eos_token"));
        if let Some(id) = eos_text.as_deref().and_then(|t| tokenizer.token_to_id(t)) {
            stop_ids.push(id);
        }
        add_end_of_turn_tokens(&tokenizer, &mut stop_ids);
        let chat_template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(t) => Some(t),
            Err(_) => match tok_cfg.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                _ => None,
            },
        };
        Ok(TextCodec { tokenizer, bos, eos_text, add_bos, stop_ids, chat_template })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn stop_ids(&self) -> &[u32] {
        &self.stop_ids
    }

    /// The GGUF keys `for_gguf` reads back (BOS, EOS, whether to add BOS, the chat template), for
    /// writing a GGUF whose tokenizer.json lies beside it.
    pub fn gguf_metadata(&self) -> Vec<(String, GgufValue)> {
        let mut md = vec![("tokenizer.ggml.add_bos_token".to_string(), GgufValue::Bool(self.add_bos))];
        if let Some((id, _)) = &self.bos {
            md.push(("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(*id)));
        }
        if let Some(id) = self.eos_text.as_deref().and_then(|t| self.tokenizer.token_to_id(t)).or_else(|| self.stop_ids.first().copied()) {
            md.push(("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(id)));
        }
        if let Some(t) = &self.chat_template {
            md.push(("tokenizer.chat_template".into(), GgufValue::String(t.clone())));
        }
        md
    }

    /// Tokenizes a prompt; special-token strings in it map to their ids; BOS is prepended
    /// when the model wants it and the text does not already start with it.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode_fast(text, false).map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if let (true, Some((bos_id, bos_text))) = (self.add_bos, &self.bos) {
            if !text.starts_with(bos_text.as_str()) {
                ids.push(*bos_id);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, true).map_err(|e| EngineError::Tokenizer(e.to_string()))
    }

    /// Renders the model's chat template for `messages`, ending with the assistant's turn opened.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        let source = self.chat_template.as_deref().ok_or_else(|| EngineError::ChatTemplate("this model ships no chat template; send a plain prompt instead".into()))?;
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> String { "26 Jul 2024".to_string() });
        let template = env.template_from_str(source).map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos.as_ref().map(|b| b.1.clone()).unwrap_or_default(),
            eos_token => self.eos_text.clone().unwrap_or_default(),
        };
        template.render(ctx).map_err(|e| EngineError::ChatTemplate(e.to_string()))
    }

    pub fn incremental_decoder(&self) -> IncrementalDecoder<'_> {
        IncrementalDecoder { tokenizer: &self.tokenizer, ids: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }
}

fn add_end_of_turn_tokens(tokenizer: &Tokenizer, stop_ids: &mut Vec<u32>) {
    stop_ids.extend(END_OF_TURN_TOKENS.iter().filter_map(|t| tokenizer.token_to_id(t)));
    stop_ids.sort_unstable();
    stop_ids.dedup();
}

fn load_tokenizer_json(path: &Path) -> Result<Tokenizer> {
    if !path.exists() {
        return Err(EngineError::MissingFile { path: path.to_path_buf() });
    }
    let tokenizer = Tokenizer::from_file(path).map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())));
    return_freed_heap_to_os();
    tokenizer
}

/// Parsing a large tokenizer.json (Gemma's is 33 MB) leaves ~190 MB of freed heap that glibc
/// keeps mapped; the weights loaded next are separate mappings and never reuse it.
fn return_freed_heap_to_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: malloc_trim only releases free pages of glibc's own heap; it has no preconditions.
        unsafe {
            malloc_trim(0);
        }
    }
}

fn read_json_if_present(path: &Path) -> Result<Value> {
    if !path.exists() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&read_to_string(path)?).map_err(|e| EngineError::InvalidModel(format!("{}: {e}", path.display())))
}

/// Turns a stream of token ids into text pieces, never splitting a UTF-8 character or a
/// word-boundary marker: it re-decodes a short window and emits only what became stable.
pub struct IncrementalDecoder<'a> {
    tokenizer: &'a Tokenizer,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder<'_> {
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let dec = |ids: &[u32]| self.tokenizer.decode(ids, true).map_err(|e| EngineError::Tokenizer(e.to_string()));
        let prefix = dec(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = dec(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(full[prefix.len()..].to_string())
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back at the end of a stream (e.g. an incomplete character).
    pub fn finish(&mut self) -> Result<String> {
        let dec = |ids: &[u32]| self.tokenizer.decode(ids, true).map_err(|e| EngineError::Tokenizer(e.to_string()));
        let prefix = dec(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = dec(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or("").to_string())
    }
}
