//! One generation on a single node: prompt → tokens, prefill, then sample / decode until a
//! stop token, a stop string, the token budget or the context ends, streaming text pieces to a
//! caller-supplied sink that can cancel. Stop strings are never emitted, even in part.

use std::time::Instant;

use super::chained::ChainedDecode;
use super::model::LoadedModel;
use super::sampler::{Sampler, SamplingParams};
use super::shard::{ShardInput, ShardOutput};
use super::text::{ChatMessage, IncrementalDecoder, TextCodec};
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
    let context = model.spec.context_length;
    let prompt_ids = prompt_ids(&model.text, &req.prompt, context)?;
    let mut sampler = Sampler::new(req.sampling.clone())?;
    let budget = req.max_tokens.unwrap_or(usize::MAX).min(context - prompt_ids.len());
    let mut cache = model.shard.new_cache();
    let mut history = prompt_ids.clone();
    let mut stream = TextStream::new(&model.text, &req.stop, prompt_ids.len(), started);
    let mut input: Vec<u32> = prompt_ids;
    // After the prompt, where the GPU can pick the tokens itself (`ChainedDecode`).
    let mut chained: Option<ChainedDecode> = None;
    let finish = loop {
        let done = stream.usage.completion_tokens;
        if done >= budget {
            break FinishReason::Length;
        }
        let id = match &mut chained {
            Some(c) => c.next(input[0], done + 1 < budget, &mut cache, &mut sampler)?,
            None => {
                let ShardOutput::Logits(logits) = model.shard.forward(ShardInput::Tokens(&input), &mut cache, false)? else {
                    return Err(EngineError::Shard("a single-node model must end with logits".into()));
                };
                let id = sampler.sample_logits(&logits.squeeze(0)?, &history)?;
                if done == 0 {
                    chained = ChainedDecode::new(&model.shard, &sampler)?;
                }
                id
            }
        };
        history.push(id);
        match stream.token(id)? {
            TokenText::StopToken => break FinishReason::Stop,
            TokenText::Piece { text, stop_hit } => {
                if !sink(GenerationEvent::Token { id, text }) {
                    break FinishReason::Cancelled;
                }
                if stop_hit {
                    break FinishReason::Stop;
                }
            }
        }
        input = vec![id];
    };
    if let Some(c) = chained {
        c.finish(&mut cache);
    }
    let (tail, usage) = stream.finish(finish)?;
    if !tail.is_empty() {
        sink(GenerationEvent::Token { id: u32::MAX, text: tail });
    }
    sink(GenerationEvent::Done { finish, usage: usage.clone() });
    Ok(usage)
}

/// The prompt's token ids (a chat rendered with the model's template), checked to be non-empty
/// and to leave room for at least one new token in `context`.
pub fn prompt_ids(text: &TextCodec, prompt: &Prompt, context: usize) -> Result<Vec<u32>> {
    let ids = match prompt {
        Prompt::Text(t) => text.encode_prompt(t)?,
        Prompt::Chat(messages) => text.encode_prompt(&text.render_chat(messages)?)?,
        Prompt::Tokens(ids) => ids.clone(),
    };
    if ids.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    if ids.len() >= context {
        return Err(EngineError::PromptTooLong { prompt_tokens: ids.len(), context });
    }
    Ok(ids)
}

/// What one sampled token means as text.
#[derive(Debug, PartialEq)]
pub enum TokenText {
    /// One of the model's stop tokens: the generation ends, and the token shows no text.
    StopToken,
    /// Text that is safe to emit now (possibly empty while held back), and whether a stop
    /// string completed with it (then the generation ends after this text).
    Piece { text: String, stop_hit: bool },
}

/// The text side of a generation, wherever its tokens come from (this node's engine or a
/// pipeline across the swarm): incremental UTF-8-safe decoding, stop tokens and stop strings,
/// and the usage figures (time to first token, prefill and decode speed).
pub struct TextStream<'a> {
    decoder: IncrementalDecoder<'a>,
    stops: StopMatcher<'a>,
    stop_ids: &'a [u32],
    started: Instant,
    decode_started: Option<Instant>,
    pub usage: Usage,
}

impl<'a> TextStream<'a> {
    /// `started` is when the request began (before tokenizing), for time to first token.
    pub fn new(text: &'a TextCodec, stop: &'a [String], prompt_tokens: usize, started: Instant) -> Self {
        TextStream {
            decoder: text.incremental_decoder(),
            stops: StopMatcher::new(stop),
            stop_ids: text.stop_ids(),
            started,
            decode_started: None,
            usage: Usage { prompt_tokens, ..Default::default() },
        }
    }

    /// Takes the next sampled token.
    pub fn token(&mut self, id: u32) -> Result<TokenText> {
        if self.usage.completion_tokens == 0 {
            self.usage.time_to_first_token_s = self.started.elapsed().as_secs_f64();
            self.usage.prefill_tok_s = self.usage.prompt_tokens as f64 / self.usage.time_to_first_token_s.max(1e-9);
            self.decode_started = Some(Instant::now());
        }
        self.usage.completion_tokens += 1;
        if self.stop_ids.contains(&id) {
            return Ok(TokenText::StopToken);
        }
        let piece = self.decoder.push(id)?;
        let (text, stop_hit) = self.stops.push(&piece);
        Ok(TokenText::Piece { text, stop_hit })
    }

    /// Ends the stream: the text still held back (none after a stop or a cancel) and the usage.
    pub fn finish(&mut self, finish: FinishReason) -> Result<(String, Usage)> {
        let tail = if finish != FinishReason::Cancelled && finish != FinishReason::Stop { self.stops.flush(&self.decoder.finish()?) } else { String::new() };
        if let Some(t) = self.decode_started {
            let steps = self.usage.completion_tokens.saturating_sub(1);
            self.usage.decode_tok_s = steps as f64 / t.elapsed().as_secs_f64().max(1e-9);
        }
        Ok((tail, self.usage.clone()))
    }
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
