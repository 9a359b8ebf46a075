//! `POST /v1/chat/completions` and `POST /v1/completions`: parse, resolve the model, queue on
//! the scheduler, then answer as OpenAI does, whole or as SSE (`data: {chunk}` ... `[DONE]`).
//! The HTTP status is chosen once the first token (or an error) is known, so a prompt that is
//! too long or a full queue is a proper 4xx/5xx even when streaming; later errors go in-band.
//! Dropping the response (the client left) drops the `GenerationStream`, which cancels.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use super::error::ApiError;
use super::request::{self, Endpoint};
use super::scheduler::{GenerationStream, StreamEvent};
use super::App;
use crate::engine::{FinishReason, GenerationRequest, Usage};

pub async fn chat_completions(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    complete(app, body, Endpoint::Chat).await
}

pub async fn completions(State(app): State<Arc<App>>, body: Bytes) -> Result<Response, ApiError> {
    complete(app, body, Endpoint::Completions).await
}

async fn complete(app: Arc<App>, body: Bytes, endpoint: Endpoint) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let req = request::parse(&body, endpoint)?;
    let model = app.resolve(req.model.as_deref()).await?;
    let generation = GenerationRequest { prompt: req.prompt, sampling: req.sampling, max_tokens: req.max_tokens, stop: req.stop };
    let mut events = app.scheduler.submit(model.clone(), generation, arrived);
    let mut reply = Reply::new(endpoint, model.id, arrived, req.include_usage);
    let first = loop {
        match events.next().await {
            Some(StreamEvent::Started { queued }) => reply.queued = queued,
            Some(StreamEvent::Failed(e)) => return Err(e),
            Some(event) => break event,
            None => return Err(ApiError::ShuttingDown),
        }
    };
    reply.first_token = Some(arrived.elapsed());
    app.metrics.time_to_first_token.observe(arrived.elapsed().as_secs_f64());
    if req.stream {
        return Ok(stream(app, events, reply, first));
    }
    let mut text = String::new();
    let mut event = Some(first);
    loop {
        match event {
            Some(StreamEvent::Token(piece)) => text.push_str(&piece),
            Some(StreamEvent::Done { finish, usage }) => return Ok(Json(reply.whole(&text, finish, &usage)).into_response()),
            Some(StreamEvent::Failed(e)) => return Err(e),
            Some(StreamEvent::Started { .. }) => {}
            None => return Err(ApiError::ShuttingDown),
        }
        event = events.next().await;
    }
}

/// The SSE body. It owns the `GenerationStream`: when hyper drops the body because the client
/// went away, the stream is dropped too and the generation is cancelled.
fn stream(app: Arc<App>, events: GenerationStream, reply: Reply, first: StreamEvent) -> Response {
    let mut pending = VecDeque::new();
    if reply.endpoint == Endpoint::Chat {
        pending.push_back(reply.chunk(json!({"role": "assistant", "content": ""}), None, None));
    }
    let mut state = SseState { app, events, reply, pending, finished: false };
    state.translate(first);
    let body = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(event), s));
            }
            if s.finished {
                return None;
            }
            let next = s.events.next().await;
            s.translate_or_end(next);
        }
    });
    Sse::new(body).into_response()
}

struct SseState {
    app: Arc<App>,
    events: GenerationStream,
    reply: Reply,
    /// SSE events ready to send, in order.
    pending: VecDeque<Event>,
    /// `[DONE]` has been queued; nothing follows.
    finished: bool,
}

impl SseState {
    fn translate_or_end(&mut self, event: Option<StreamEvent>) {
        match event {
            Some(e) => self.translate(e),
            None => self.fail(ApiError::ShuttingDown),
        }
    }

    fn translate(&mut self, event: StreamEvent) {
        let r = &self.reply;
        match event {
            StreamEvent::Started { .. } => {}
            StreamEvent::Token(text) if text.is_empty() => {}
            StreamEvent::Token(text) => {
                let piece = if r.endpoint == Endpoint::Chat { json!({"content": text}) } else { json!(text) };
                self.pending.push_back(r.chunk(piece, None, None));
            }
            StreamEvent::Done { finish, usage } => {
                let empty = if r.endpoint == Endpoint::Chat { json!({}) } else { json!("") };
                self.pending.push_back(r.chunk(empty, Some(finish), Some(&usage)));
                if r.include_usage {
                    let mut last = r.envelope();
                    last["choices"] = json!([]);
                    last["usage"] = usage_json(&usage);
                    self.pending.push_back(sse(&last));
                }
                self.done();
            }
            StreamEvent::Failed(e) => self.fail(e),
        }
    }

    fn fail(&mut self, e: ApiError) {
        self.app.metrics.errors.with_label_values(&[e.code()]).inc();
        self.pending.push_back(sse(&e.body()));
        self.done();
    }

    fn done(&mut self) {
        self.pending.push_back(Event::default().data("[DONE]"));
        self.finished = true;
    }
}

fn sse(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// What every response or chunk of one request shares.
struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    arrived: Instant,
    include_usage: bool,
    queued: Duration,
    first_token: Option<Duration>,
}

impl Reply {
    fn new(endpoint: Endpoint, model: String, arrived: Instant, include_usage: bool) -> Self {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
        let id = format!("{prefix}-{:x}{:08x}", now.as_micros(), rand::random::<u32>());
        Reply { endpoint, id, created: now.as_secs(), model, arrived, include_usage, queued: Duration::ZERO, first_token: None }
    }

    fn envelope(&self) -> Value {
        let object = if self.endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model});
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// A stream chunk carrying `piece` (a chat delta or completion text); the last one also
    /// carries the finish reason and the `shoal` timings.
    fn chunk(&self, piece: Value, finish: Option<FinishReason>, usage: Option<&Usage>) -> Event {
        let mut v = self.envelope();
        let mut choice = json!({"index": 0, "logprobs": null, "finish_reason": finish.map(finish_reason)});
        choice[if self.endpoint == Endpoint::Chat { "delta" } else { "text" }] = piece;
        v["choices"] = json!([choice]);
        if let Some(u) = usage {
            v["shoal"] = self.timings(u);
        }
        sse(&v)
    }

    /// The non-streamed response.
    fn whole(&self, text: &str, finish: FinishReason, usage: &Usage) -> Value {
        let (object, choice) = match self.endpoint {
            Endpoint::Chat => ("chat.completion", json!({"index": 0, "message": {"role": "assistant", "content": text, "refusal": null}, "logprobs": null, "finish_reason": finish_reason(finish)})),
            Endpoint::Completions => ("text_completion", json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(finish)})),
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice], "usage": usage_json(usage), "shoal": self.timings(usage)})
    }

    fn timings(&self, u: &Usage) -> Value {
        json!({
            "time_to_first_token_s": self.first_token.unwrap_or_else(|| self.arrived.elapsed()).as_secs_f64(),
            "queued_s": self.queued.as_secs_f64(),
            "prefill_tok_s": u.prefill_tok_s,
            "decode_tok_s": u.decode_tok_s,
        })
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens})
}

/// OpenAI's names. A cancelled generation only reaches a client that is still there when the
/// node stops it, which also sends an error event; "stop" is the closest OpenAI value.
fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}
