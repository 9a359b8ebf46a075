//! One generation on a single node: prompt → tokens, prefill, then sample / decode until a
//! stop token, a stop string, the token budget or the context ends, streaming text pieces to a
//! caller-supplied sink that can cancel. Stop strings are never emitted, even in part.

use std::time::Instant;

use super::model::LoadedModel;
use super::sampler::{Sampler, SamplingParams};
use super::shard::{ShardInput, ShardOutput};
use super::text::ChatMessage;
use super::{EngineError, Result};

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Prompt {
    Text(String),
    Chat(Vec<ChatMessage>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// At most this many new tokens; `None` means until a stop or the context ends.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context window.
    Length,
    /// The sink asked to stop (client went away).
    Cancelled,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Time from start to the first sampled token, in seconds.
    pub time_to_first_token_s: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

#[derive(Debug, Clone)]
pub enum GenerationEvent {
    /// A sampled token and the text it completed (possibly empty while held back).
    Token { id: u32, text: String },
    Done { finish: FinishReason, usage: Usage },
}

/// Runs `req` to completion. The sink returns `false` to cancel.
pub fn generate(model: &LoadedModel, req: &GenerationRequest, sink: &mut dyn FnMut(GenerationEvent) -> bool) -> Result<Usage> {
    let started = Instant::now();
    let prompt_ids = match &req.prompt {
        Prompt::Text(t) => model.text.encode_prompt(t)?,
        Prompt::Chat(messages) => model.text.encode_prompt(&model.text.render_chat(messages)?)?,
        Prompt::Tokens(ids) => ids.clone(),
    };
    if prompt_ids.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    let context = model.spec.context_length;
    if prompt_ids.len() >= context {
        return Err(EngineError::PromptTooLong { prompt_tokens: prompt_ids.len(), context });
    }
    let mut sampler = Sampler::new(req.sampling.clone())?;
    let budget = req.max_tokens.unwrap_or(usize::MAX).min(context - prompt_ids.len());
    let mut cache = model.shard.new_cache();
    let mut history = prompt_ids.clone();
    let mut decoder = model.text.incremental_decoder();
    let mut stops = StopMatcher::new(&req.stop);
    let stop_ids = model.text.stop_ids();

    let mut usage = Usage { prompt_tokens: prompt_ids.len(), ..Default::default() };
    let mut input: Vec<u32> = prompt_ids;
    let mut decode_started = None;
    let finish = loop {
        if usage.completion_tokens >= budget {
            break FinishReason::Length;
        }
        let ShardOutput::Logits(logits) = model.shard.forward(ShardInput::Tokens(&input), &mut cache, false)? else {
            return Err(EngineError::Shard("a single-node model must end with logits".into()));
        };
        let mut logits = logits.squeeze(0)?.to_vec1::<f32>()?;
        let id = sampler.sample(&mut logits, &history);
        if usage.completion_tokens == 0 {
            usage.time_to_first_token_s = started.elapsed().as_secs_f64();
            usage.prefill_tok_s = usage.prompt_tokens as f64 / usage.time_to_first_token_s.max(1e-9);
            decode_started = Some(Instant::now());
        }
        usage.completion_tokens += 1;
        history.push(id);
        if stop_ids.contains(&id) {
            break FinishReason::Stop;
        }
        let piece = decoder.push(id)?;
        let (text, hit) = stops.push(&piece);
        if !sink(GenerationEvent::Token { id, text }) {
            break FinishReason::Cancelled;
        }
        if hit {
            break FinishReason::Stop;
        }
        input = vec![id];
    };
    if finish != FinishReason::Cancelled && finish != FinishReason::Stop {
        let tail = stops.flush(&decoder.finish()?);
        if !tail.is_empty() {
            sink(GenerationEvent::Token { id: u32::MAX, text: tail });
        }
    }
    if let Some(t) = decode_started {
        let steps = usage.completion_tokens.saturating_sub(1);
        usage.decode_tok_s = steps as f64 / t.elapsed().as_secs_f64().max(1e-9);
    }
    sink(GenerationEvent::Done { finish, usage: usage.clone() });
    Ok(usage)
}

/// Holds back text that could be the start of a stop string; reports when one completes.
struct StopMatcher<'a> {
    stops: Vec<&'a str>,
    pending: String,
}

impl<'a> StopMatcher<'a> {
    fn new(stops: &'a [String]) -> Self {
        StopMatcher { stops: stops.iter().map(String::as_str).filter(|s| !s.is_empty()).collect(), pending: String::new() }
    }

    /// Adds a piece; returns the text safe to emit and whether a stop string was reached.
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s)).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(|&n| s.is_char_boundary(n) && self.pending.ends_with(&s[..n])).take(1))
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    fn flush(&mut self, tail: &str) -> String {
        let (mut out, hit) = self.push(tail);
        if !hit {
            out.push_str(&std::mem::take(&mut self.pending));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let stops = vec!["</end>".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hello <"), ("hello ".to_string(), false));
        assert_eq!(m.push("/e"), (String::new(), false));
        assert_eq!(m.push("x"), ("</ex".to_string(), false));
        assert_eq!(m.push("ab</en"), ("ab".to_string(), false));
        assert_eq!(m.push("d> tail"), (String::new(), true));
    }
}
