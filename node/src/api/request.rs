//! OpenAI request bodies (chat completions and legacy completions) → one `ParsedRequest`:
//! fields are checked one by one so that an unknown field, or a known one shoal cannot honour
//! (`n > 1`, `logprobs`, `tools`, non-text `response_format`...), gets a 400 naming it instead
//! of being silently ignored. JSON `null` counts as absent. It does not resolve the model.

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::engine::generate::Prompt;
use crate::engine::text::ChatMessage;
use crate::engine::SamplingParams;

/// Which OpenAI endpoint a body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// A validated request, ready to be queued.
#[derive(Debug, Clone)]
pub struct ParsedRequest {
    /// The `model` field; `None` means "the loaded model".
    pub model: Option<String>,
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
}

/// Fields OpenAI defines that have no effect on a single local answer; accepted and ignored.
const IGNORED: &[&str] = &["user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls"];

/// OpenAI's default sampling temperature (the engine's own default is lower).
const OPENAI_DEFAULT_TEMPERATURE: f32 = 1.0;

pub fn parse(body: &[u8], endpoint: Endpoint) -> Result<ParsedRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| ApiError::InvalidJson(e.to_string()))?;
    let Value::Object(fields) = value else { return Err(ApiError::InvalidJson("the body must be a JSON object".into())) };
    let mut req = ParsedRequest {
        model: None,
        prompt: Prompt::Text(String::new()),
        sampling: SamplingParams { temperature: OPENAI_DEFAULT_TEMPERATURE, ..SamplingParams::default() },
        max_tokens: None,
        stop: Vec::new(),
        stream: false,
        include_usage: false,
    };
    let mut prompt = None;
    let mut stream_options = None;
    for (key, v) in fields.iter().filter(|(_, v)| !v.is_null()) {
        let k = key.as_str();
        let s = &mut req.sampling;
        match (k, endpoint) {
            ("model", _) => req.model = Some(string(k, v)?),
            ("messages", Endpoint::Chat) => prompt = Some(Prompt::Chat(messages(v)?)),
            ("prompt", Endpoint::Completions) => prompt = Some(completion_prompt(v)?),
            ("stream", _) => req.stream = boolean(k, v)?,
            ("stream_options", _) => stream_options = Some(v),
            ("max_tokens", _) | ("max_completion_tokens", Endpoint::Chat) => {
                let n = integer(k, v, 1, u32::MAX as i64)? as usize;
                // When both are given the newer `max_completion_tokens` wins.
                if k == "max_completion_tokens" || !fields.get("max_completion_tokens").is_some_and(|m| !m.is_null()) {
                    req.max_tokens = Some(n);
                }
            }
            ("temperature", _) => s.temperature = number(k, v, 0.0, 2.0)?,
            // top_p = 0 keeps only the most likely token, as OpenAI treats it.
            ("top_p", _) => s.top_p = number(k, v, 0.0, 1.0)?.max(f32::MIN_POSITIVE),
            // 0 and -1 both mean "no top-k", as in llama.cpp and vLLM.
            ("top_k", _) => s.top_k = Some(integer(k, v, -1, u32::MAX as i64)?).filter(|k| *k > 0).map(|k| k as usize),
            ("min_p", _) => s.min_p = number(k, v, 0.0, 1.0)?,
            ("repetition_penalty", _) => s.repetition_penalty = number(k, v, 0.0, 10.0)?,
            ("presence_penalty", _) => s.presence_penalty = number(k, v, -2.0, 2.0)?,
            ("frequency_penalty", _) => s.frequency_penalty = number(k, v, -2.0, 2.0)?,
            ("seed", _) => s.seed = Some(integer(k, v, i64::MIN, i64::MAX)? as u64),
            ("stop", _) => req.stop = stop(v)?,
            ("n", _) if v.as_i64() == Some(1) => {}
            ("n", _) => return Err(ApiError::unsupported(k, "n must be 1: shoal returns one choice per request (send several requests instead)")),
            ("best_of", Endpoint::Completions) if v.as_i64() == Some(1) => {}
            ("logprobs", Endpoint::Chat) if v == &Value::Bool(false) => {}
            ("echo", Endpoint::Completions) if v == &Value::Bool(false) => {}
            ("suffix", Endpoint::Completions) if v.as_str() == Some("") => {}
            ("logit_bias", _) if v.as_object().is_some_and(Map::is_empty) => {}
            ("tools" | "functions", Endpoint::Chat) if v.as_array().is_some_and(Vec::is_empty) => {}
            ("tool_choice", Endpoint::Chat) if v.as_str() == Some("none") || v.as_str() == Some("auto") => {}
            ("response_format", Endpoint::Chat) if v.get("type").and_then(Value::as_str) == Some("text") => {}
            ("modalities", Endpoint::Chat) if v.as_array().is_some_and(|m| m.iter().all(|x| x.as_str() == Some("text"))) => {}
            ("logprobs" | "top_logprobs", _) => return Err(ApiError::unsupported(k, format!("{k} is not supported by shoal yet"))),
            ("best_of" | "echo" | "suffix" | "logit_bias", Endpoint::Completions) | ("logit_bias", Endpoint::Chat) => {
                return Err(ApiError::unsupported(k, format!("{k} is not supported by shoal")))
            }
            ("tools" | "tool_choice" | "functions" | "function_call", Endpoint::Chat) => {
                return Err(ApiError::unsupported(k, format!("{k}: tool and function calling is not supported by shoal")))
            }
            ("response_format", Endpoint::Chat) => return Err(ApiError::unsupported(k, "only response_format {\"type\": \"text\"} is supported")),
            ("modalities" | "audio" | "prediction" | "reasoning_effort" | "web_search_options", Endpoint::Chat) => {
                return Err(ApiError::unsupported(k, format!("{k} is not supported by shoal")))
            }
            _ if IGNORED.contains(&k) => {}
            _ => return Err(ApiError::UnknownParameter(key.clone())),
        }
    }
    req.prompt = match (prompt, endpoint) {
        (Some(p), _) => p,
        (None, Endpoint::Chat) => return Err(ApiError::invalid("messages", "messages is required")),
        (None, Endpoint::Completions) => return Err(ApiError::invalid("prompt", "prompt is required")),
    };
    if let Some(options) = stream_options {
        if !req.stream {
            return Err(ApiError::invalid("stream_options", "stream_options is only allowed when stream is true"));
        }
        let Value::Object(o) = options else { return Err(ApiError::invalid("stream_options", "stream_options must be an object")) };
        for (k, v) in o.iter().filter(|(_, v)| !v.is_null()) {
            match k.as_str() {
                "include_usage" => req.include_usage = boolean("stream_options.include_usage", v)?,
                "include_obfuscation" => {}
                _ => return Err(ApiError::UnknownParameter(format!("stream_options.{k}"))),
            }
        }
    }
    req.sampling.validate().map_err(|e| ApiError::InvalidRequest { message: e.to_string(), param: None })?;
    Ok(req)
}

fn messages(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let list = v.as_array().ok_or_else(|| ApiError::invalid("messages", "messages must be an array"))?;
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "messages must hold at least one message"));
    }
    list.iter().enumerate().map(|(i, m)| message(i, m)).collect()
}

fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(fields) = m else { return Err(ApiError::invalid(format!("messages[{i}]"), "each message must be an object")) };
    let role = match fields.get("role").and_then(Value::as_str) {
        Some(r @ ("system" | "user" | "assistant")) => r.to_string(),
        // OpenAI's newer name for system instructions.
        Some("developer") => "system".to_string(),
        Some(r @ ("tool" | "function")) => return Err(ApiError::unsupported(at("role"), format!("messages with role `{r}` are not supported (no tool calling)"))),
        Some(r) => return Err(ApiError::invalid(at("role"), format!("unknown role `{r}`: use system, user or assistant"))),
        None => return Err(ApiError::invalid(at("role"), "each message needs a string role")),
    };
    for (k, v) in fields.iter().filter(|(_, v)| !v.is_null()) {
        match k.as_str() {
            "role" | "content" | "name" | "refusal" => {}
            "tool_calls" if v.as_array().is_some_and(Vec::is_empty) => {}
            "tool_calls" | "function_call" => return Err(ApiError::unsupported(at(k), "tool calls are not supported")),
            _ => return Err(ApiError::UnknownParameter(at(k))),
        }
    }
    let content = match fields.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(text)) => Ok(text),
                (Some("text"), None) => Err(ApiError::invalid(format!("messages[{i}].content[{j}].text"), "a text part needs a string `text`")),
                (Some(other), _) => Err(ApiError::unsupported(format!("messages[{i}].content[{j}].type"), format!("messages[{i}].content[{j}]: content parts of type `{other}` are not supported: send text"))),
                (None, _) => Err(ApiError::invalid(format!("messages[{i}].content[{j}].type"), "each content part needs a `type`")),
            })
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
        None | Some(Value::Null) if role == "assistant" => String::new(),
        _ => return Err(ApiError::invalid(at("content"), "content must be a string or an array of text parts")),
    };
    Ok(ChatMessage { role, content })
}

fn completion_prompt(v: &Value) -> Result<Prompt, ApiError> {
    let several = || ApiError::unsupported("prompt", "one prompt per request: send several requests instead of an array of prompts");
    let tokens = |items: &[Value]| -> Result<Prompt, ApiError> {
        let ids = items.iter().map(|t| t.as_u64().filter(|id| *id <= u32::MAX as u64).map(|id| id as u32)).collect::<Option<Vec<u32>>>();
        ids.map(Prompt::Tokens).ok_or_else(|| ApiError::invalid("prompt", "a token prompt must be an array of token ids"))
    };
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => match items.as_slice() {
            [] => Err(ApiError::invalid("prompt", "prompt must not be empty")),
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(ids)] => tokens(ids),
            [Value::Number(_), ..] => tokens(items),
            [Value::String(_) | Value::Array(_), ..] => Err(several()),
            _ => Err(ApiError::invalid("prompt", "prompt must be a string, an array of token ids, or a one-element array of either")),
        },
        _ => Err(ApiError::invalid("prompt", "prompt must be a string")),
    }
}

fn stop(v: &Value) -> Result<Vec<String>, ApiError> {
    let list = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items.iter().map(|s| s.as_str().map(str::to_string)).collect::<Option<Vec<_>>>().ok_or_else(|| ApiError::invalid("stop", "stop must be a string or an array of strings"))?,
        _ => return Err(ApiError::invalid("stop", "stop must be a string or an array of strings")),
    };
    if list.len() > 16 {
        return Err(ApiError::invalid("stop", "at most 16 stop strings"));
    }
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

fn string(k: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid(k, format!("{k} must be a string")))
}

fn boolean(k: &str, v: &Value) -> Result<bool, ApiError> {
    v.as_bool().ok_or_else(|| ApiError::invalid(k, format!("{k} must be true or false")))
}

fn number(k: &str, v: &Value, min: f32, max: f32) -> Result<f32, ApiError> {
    let x = v.as_f64().ok_or_else(|| ApiError::invalid(k, format!("{k} must be a number")))? as f32;
    if !(min..=max).contains(&x) {
        return Err(ApiError::invalid(k, format!("{k} must be between {min} and {max}, got {x}")));
    }
    Ok(x)
}

fn integer(k: &str, v: &Value, min: i64, max: i64) -> Result<i64, ApiError> {
    let x = v.as_i64().or_else(|| v.as_u64().map(|u| u as i64)).ok_or_else(|| ApiError::invalid(k, format!("{k} must be an integer")))?;
    if !(min..=max).contains(&x) {
        return Err(ApiError::invalid(k, format!("{k} must be between {min} and {max}, got {x}")));
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ParsedRequest, ApiError> {
        parse(body.as_bytes(), Endpoint::Chat)
    }

    #[test]
    fn content_parts_and_strings_are_both_accepted() {
        let r = chat(r#"{"model":"m","messages":[{"role":"developer","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"stop":"x","n":1,"user":"u"}"#).unwrap();
        let Prompt::Chat(m) = r.prompt else { panic!("a chat prompt") };
        assert_eq!(m[0], ChatMessage { role: "system".into(), content: "be brief".into() });
        assert_eq!(m[1].content, "a\nb");
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert_eq!(r.sampling.temperature, 1.0);
    }

    #[test]
    fn unsupported_and_unknown_fields_are_named() {
        let cases = [
            (r#"{"messages":[{"role":"user","content":"x"}],"n":2}"#, "n"),
            (r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true}"#, "logprobs"),
            (r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#, "tools"),
            (r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}"#, "response_format"),
            (r#"{"messages":[{"role":"user","content":"x"}],"frobnicate":1}"#, "frobnicate"),
            (r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#, "messages[0].content[0].type"),
            (r#"{"messages":[{"role":"user","content":"x"}],"temperature":7}"#, "temperature"),
            (r#"{"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}"#, "stream_options"),
        ];
        for (body, param) in cases {
            let e = chat(body).unwrap_err();
            assert_eq!(e.body()["error"]["param"], param, "{body}: {e}");
            assert!(e.to_string().contains(param.split('[').next().unwrap()), "{body}: the message names the field: {e}");
        }
        assert!(matches!(chat("{not json"), Err(ApiError::InvalidJson(_))));
        assert!(matches!(chat("[]"), Err(ApiError::InvalidJson(_))));
    }

    #[test]
    fn completion_prompts_and_token_limits() {
        let r = parse(br#"{"prompt":["hi"],"max_tokens":5,"top_k":0,"top_p":0}"#, Endpoint::Completions).unwrap();
        assert!(matches!(r.prompt, Prompt::Text(ref t) if t == "hi"));
        assert_eq!((r.max_tokens, r.sampling.top_k), (Some(5), None));
        let r = parse(br#"{"prompt":[1,2,3]}"#, Endpoint::Completions).unwrap();
        assert!(matches!(r.prompt, Prompt::Tokens(ref t) if t == &[1, 2, 3]));
        assert!(parse(br#"{"prompt":["a","b"]}"#, Endpoint::Completions).is_err());
        let r = chat(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":9,"max_completion_tokens":3}"#).unwrap();
        assert_eq!(r.max_tokens, Some(3));
    }
}
