//! The scheduler actor: the one queue of this node's API. Requests wait in a bounded FIFO
//! queue and run one at a time through the swarm (which runs the model on this node, across a
//! pipeline of nodes, or on another node, as the plan in force says); a request naming another
//! local model switches to it first (this node asks the swarm for one model at a time). Each
//! queued request ends by exactly one of: its reply, an error, its client leaving
//! (`GenerationStream` dropped) or its queue deadline. Tokenizing and detokenizing happen here
//! (the entry node's job); the model's layers run wherever the plan puts them.
//! It never blocks its task: opening a model runs on the blocking pool, generations on tasks.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{Command, LoadedInfo, SchedulerConfig, SchedulerState, StreamEvent};
use crate::models::LocalModel;
use crate::api::error::ApiError;
use crate::api::metrics::Metrics;
use crate::engine::generate::{prompt_ids, TextStream, TokenText};
use crate::engine::model::ModelSource;
use crate::engine::text::TextCodec;
use crate::engine::{FinishReason, GenerationRequest, Usage};
use crate::swarm::{GenerateRequest, StageState, SwarmHandle, TokenEvent};

enum Entry {
    Generate { id: u64, model: LocalModel, request: GenerationRequest, arrived: Instant, deadline: Instant, events: mpsc::UnboundedSender<StreamEvent> },
    Load(LocalModel),
}

impl Entry {
    fn model(&self) -> &LocalModel {
        match self {
            Entry::Generate { model, .. } | Entry::Load(model) => model,
        }
    }
}

/// The generation running now.
struct Running {
    id: u64,
    /// Cancelled to stop the generation (client gone, shutdown).
    cancel: CancellationToken,
    events: mpsc::UnboundedSender<StreamEvent>,
}

/// The model this node serves: its text side is here, its layers wherever the plan says.
struct Served {
    model: LocalModel,
    text: Arc<TextCodec>,
    layers: usize,
    context: usize,
}

/// A generation's end, sent by its task.
struct Finished {
    result: Result<Usage, ApiError>,
    finish: Option<FinishReason>,
}

type LoadResult = Result<Served, ApiError>;

pub(super) struct Scheduler {
    config: SchedulerConfig,
    inbox: mpsc::UnboundedReceiver<Command>,
    /// Cloned into each job's completion callback; the actor holds one, so it never closes.
    finished_tx: mpsc::UnboundedSender<Finished>,
    finished: mpsc::UnboundedReceiver<Finished>,
    /// Cloned into each load task; the actor holds one, so it never closes.
    loaded_tx: mpsc::UnboundedSender<(LocalModel, LoadResult)>,
    loaded: mpsc::UnboundedReceiver<(LocalModel, LoadResult)>,
    queue: VecDeque<Entry>,
    running: Option<Running>,
    served: Option<Served>,
    swarm: SwarmHandle,
    loading: Option<LocalModel>,
    last_error: Option<String>,
    last_decode_tok_s: Option<f64>,
    /// The only writer of the published state.
    state: watch::Sender<SchedulerState>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
}

impl Scheduler {
    pub(super) fn new(
        config: SchedulerConfig,
        swarm: SwarmHandle,
        inbox: mpsc::UnboundedReceiver<Command>,
        state: watch::Sender<SchedulerState>,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
    ) -> Self {
        let (finished_tx, finished) = mpsc::unbounded_channel();
        let (loaded_tx, loaded) = mpsc::unbounded_channel();
        Scheduler {
            config,
            inbox,
            finished_tx,
            finished,
            loaded_tx,
            loaded,
            queue: VecDeque::new(),
            running: None,
            served: None,
            swarm,
            loading: None,
            last_error: None,
            last_decode_tok_s: None,
            state,
            metrics,
            shutdown,
        }
    }

    pub(super) async fn run(mut self) {
        loop {
            let deadline = self.queue.iter().filter_map(|e| if let Entry::Generate { deadline, .. } = e { Some(*deadline) } else { None }).min();
            tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => break,
                command = self.inbox.recv() => match command {
                    Some(c) => self.command(c),
                    None => break,
                },
                Some(done) = self.finished.recv() => self.finished(done),
                Some((model, result)) = self.loaded.recv() => self.loaded(model, result),
                _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now).into()), if deadline.is_some() => self.expire(),
            }
            self.pump();
            self.publish();
        }
        self.stop().await;
    }

    fn waiting(&self) -> usize {
        self.queue.iter().filter(|e| matches!(e, Entry::Generate { .. })).count()
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Submit { id, model, request, arrived, events } => {
                let waiting = self.waiting();
                if waiting >= self.config.max_queue {
                    self.metrics.queue_rejected.inc();
                    let _ = events.send(StreamEvent::Failed(ApiError::QueueFull { waiting }));
                    return;
                }
                let deadline = arrived + self.config.queue_timeout;
                self.queue.push_back(Entry::Generate { id, model, request, arrived, deadline, events });
            }
            Command::Abandon { id } => {
                if let Some(at) = self.queue.iter().position(|e| matches!(e, Entry::Generate { id: queued, .. } if *queued == id)) {
                    self.queue.remove(at);
                    self.metrics.queue_abandoned.inc();
                } else if let Some(running) = self.running.as_ref().filter(|r| r.id == id) {
                    running.cancel.cancel();
                }
            }
            Command::Load { model } => {
                let known = |m: Option<&LocalModel>| m.is_some_and(|m| m.path == model.path);
                if !known(self.served.as_ref().map(|e| &e.model)) && !known(self.loading.as_ref()) && !self.queue.iter().any(|e| matches!(e, Entry::Load(m) if m.path == model.path)) {
                    self.queue.push_back(Entry::Load(model));
                }
            }
        }
    }

    /// Starts the next piece of work when the engine is idle: a load, or the next generation.
    fn pump(&mut self) {
        while self.running.is_none() && self.loading.is_none() {
            let Some(front) = self.queue.front() else { return };
            if let Entry::Generate { events, .. } = front {
                if events.is_closed() {
                    self.queue.pop_front();
                    self.metrics.queue_abandoned.inc();
                    continue;
                }
            }
            if self.served.as_ref().map(|e| &e.model.path) != Some(&front.model().path) {
                let model = front.model().clone();
                self.start_load(model);
                return;
            }
            if let Some(Entry::Generate { id, request, arrived, events, .. }) = self.queue.pop_front() {
                self.dispatch(id, request, arrived, events);
            }
        }
    }

    /// Opens the model's text side (tokenizer, template) here and asks the swarm to place it;
    /// done when the plan in force places it and our own stage of it (if any) has loaded.
    fn start_load(&mut self, model: LocalModel) {
        let context_limit = self.config.context_limit;
        let (swarm, done) = (self.swarm.clone(), self.loaded_tx.clone());
        self.loading = Some(model.clone());
        tracing::info!(model = %model.id, path = %model.path.display(), "asking the swarm to place the model");
        tokio::spawn(async move {
            let result = prepare(&swarm, &model, context_limit).await;
            let _ = done.send((model, result));
        });
    }

    fn loaded(&mut self, model: LocalModel, result: LoadResult) {
        self.loading = None;
        match result {
            Ok(served) => {
                tracing::info!(model = %model.id, "model placed and ready");
                self.served = Some(served);
                self.last_error = None;
            }
            Err(error) => {
                tracing::error!(%error, "model load failed");
                for entry in std::mem::take(&mut self.queue) {
                    match entry {
                        Entry::Generate { events, model: m, .. } if m.path == model.path => {
                            let _ = events.send(StreamEvent::Failed(error.clone()));
                        }
                        Entry::Load(m) if m.path == model.path => {}
                        other => self.queue.push_back(other),
                    }
                }
                self.last_error = Some(error.to_string());
            }
        }
    }

    fn dispatch(&mut self, id: u64, request: GenerationRequest, arrived: Instant, events: mpsc::UnboundedSender<StreamEvent>) {
        // pump() only dispatches when the front's model is the one served.
        let served = self.served.as_ref().expect("dispatch runs with the request's model served");
        let cancel = CancellationToken::new();
        let _ = events.send(StreamEvent::Started { queued: arrived.elapsed() });
        let job = Job { swarm: self.swarm.clone(), model: served.model.id.clone(), text: served.text.clone(), context: served.context, request, events: events.clone(), cancel: cancel.clone() };
        let finished = self.finished_tx.clone();
        tokio::spawn(async move {
            let done = job.run().await;
            let _ = finished.send(done);
        });
        self.running = Some(Running { id, cancel, events });
    }

    fn finished(&mut self, done: Finished) {
        if self.running.take().is_none() {
            return;
        }
        match (&done.result, done.finish) {
            // The client sees the error (and the metrics count it) through its stream.
            (Err(_), _) => self.metrics.generation_finished("error", None),
            (Ok(usage), finish) => {
                // The engine's own finish reason: `Cancelled` exactly when the sink said stop.
                let outcome = match finish {
                    Some(FinishReason::Stop) => "stop",
                    Some(FinishReason::Length) => "length",
                    Some(FinishReason::Cancelled) | None => "cancelled",
                };
                self.metrics.generation_finished(outcome, Some(usage));
                if usage.completion_tokens > 1 {
                    self.last_decode_tok_s = Some(usage.decode_tok_s);
                }
            }
        }
    }

    fn expire(&mut self) {
        let now = Instant::now();
        let metrics = self.metrics.clone();
        self.queue.retain(|e| match e {
            Entry::Generate { deadline, arrived, events, .. } if *deadline <= now => {
                metrics.queue_expired.inc();
                let _ = events.send(StreamEvent::Failed(ApiError::QueueTimeout { waited_s: arrived.elapsed().as_secs_f64() }));
                false
            }
            _ => true,
        });
    }

    fn publish(&self) {
        let waiting = self.waiting();
        self.metrics.queue_depth.set(waiting as i64);
        self.metrics.running.set(self.running.is_some() as i64);
        self.state.send_replace(SchedulerState {
            loaded: self.served.as_ref().map(|e| LoadedInfo { model: e.model.clone(), layers: e.layers, context: e.context }),
            loading: self.loading.clone(),
            queue_depth: waiting,
            running: self.running.is_some(),
            last_error: self.last_error.clone(),
            last_decode_tok_s: self.last_decode_tok_s,
        });
    }

    /// Shutdown: every waiting request gets 503, and the running one is told and stopped.
    async fn stop(mut self) {
        for entry in self.queue.drain(..) {
            if let Entry::Generate { events, .. } = entry {
                let _ = events.send(StreamEvent::Failed(ApiError::ShuttingDown));
            }
        }
        if let Some(running) = self.running.take() {
            let _ = running.events.send(StreamEvent::Failed(ApiError::ShuttingDown));
            running.cancel.cancel();
        }
    }
}

/// How long a model may take to be placed and its stages loaded before its requests fail.
const PLACE_DEADLINE: Duration = Duration::from_secs(180);
/// How long a generation waits for a usable plan before its first token.
const PLAN_WAIT: Duration = Duration::from_secs(60);
/// After tokens have reached the client, how long a failed pipeline may take to be rebuilt
/// before the client gets an error instead (a stream never stalls longer than this).
const FAILOVER_WAIT: Duration = Duration::from_millis(1500);

async fn prepare(swarm: &SwarmHandle, model: &LocalModel, context_limit: Option<usize>) -> LoadResult {
    let path = model.path.clone();
    let load_error = |reason: String| ApiError::ModelLoad { model: model.id.clone(), reason };
    let opened = tokio::task::spawn_blocking(move || -> crate::engine::Result<(usize, usize, TextCodec)> {
        let source = ModelSource::open(&path)?;
        let context = source.spec.context_length.min(context_limit.unwrap_or(usize::MAX)).max(1);
        Ok((source.spec.num_layers, context, source.load_text()?))
    })
    .await
    .map_err(|e| load_error(e.to_string()))?
    .map_err(|e| load_error(e.to_string()))?;
    let (layers, context, text) = opened;
    swarm.serve_only(&model.id, model.path.clone(), context_limit).await.map_err(|e| load_error(e.to_string()))?;
    // Wait for a plan that places the model and for our own stage of it to load.
    let started = Instant::now();
    loop {
        let snapshot = swarm.snapshot().await.map_err(|e| load_error(e.to_string()))?;
        let placement = snapshot.plan.as_ref().and_then(|p| p.placements.get(&model.id));
        match placement {
            Some(Err(reason)) => return Err(ApiError::ModelTooLarge { model: model.id.clone(), reason: reason.clone() }),
            Some(Ok(p)) => {
                let mine = p.stages.iter().any(|s| s.node == snapshot.me);
                match snapshot.stages.get(&model.id).map(|s| &s.state) {
                    Some(StageState::Failed(reason)) => return Err(load_error(reason.clone())),
                    Some(StageState::Ready) => break,
                    _ if !mine => break,
                    _ => {}
                }
            }
            None => {}
        }
        if started.elapsed() > PLACE_DEADLINE {
            return Err(load_error(format!("the swarm did not place it within {}s", PLACE_DEADLINE.as_secs())));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Served { model: model.clone(), text: Arc::new(text), layers, context })
}

/// One generation: tokenize here, run the steps through the swarm, detokenize here.
struct Job {
    swarm: SwarmHandle,
    model: String,
    text: Arc<TextCodec>,
    context: usize,
    request: GenerationRequest,
    events: mpsc::UnboundedSender<StreamEvent>,
    cancel: CancellationToken,
}

impl Job {
    async fn run(self) -> Finished {
        let result = self.stream().await;
        if let Err(e) = &result {
            let _ = self.events.send(StreamEvent::Failed(e.clone()));
        }
        match result {
            Ok((finish, usage)) => Finished { result: Ok(usage), finish: Some(finish) },
            Err(e) => Finished { result: Err(e), finish: None },
        }
    }

    async fn stream(&self) -> Result<(FinishReason, Usage), ApiError> {
        let started = Instant::now();
        let (text, prompt, context) = (self.text.clone(), self.request.prompt.clone(), self.context);
        let prompt = tokio::task::spawn_blocking(move || prompt_ids(&text, &prompt, context)).await.map_err(|e| ApiError::Internal(e.to_string()))??;
        let budget = self.request.max_tokens.unwrap_or(usize::MAX).min(self.context - prompt.len());
        let mut stream = TextStream::new(&self.text, &self.request.stop, prompt.len(), started);
        let mut tokens = self
            .swarm
            .generate(GenerateRequest {
                model: self.model.clone(),
                prompt,
                sampling: self.request.sampling.clone(),
                max_tokens: budget,
                // Stop tokens are the text side's to judge (they end the stream without text).
                stop_ids: vec![],
                plan_wait: PLAN_WAIT,
                failover_wait: FAILOVER_WAIT,
            })
            .await
            .map_err(|e| ApiError::Swarm(e.to_string()))?;
        let finish = loop {
            let event = tokio::select! {
                _ = self.cancel.cancelled() => break FinishReason::Cancelled,
                event = tokens.recv() => event,
            };
            match event {
                Some(TokenEvent::Token(id)) => match stream.token(id)? {
                    TokenText::StopToken => break FinishReason::Stop,
                    TokenText::Piece { text, stop_hit } => {
                        if !text.is_empty() && self.events.send(StreamEvent::Token(text)).is_err() {
                            break FinishReason::Cancelled;
                        }
                        if stop_hit {
                            break FinishReason::Stop;
                        }
                    }
                },
                Some(TokenEvent::Done(finish)) => break finish,
                Some(TokenEvent::Error(e)) => return Err(ApiError::Swarm(e)),
                None => return Err(ApiError::Swarm("the swarm runtime stopped".into())),
            }
        };
        // Dropping `tokens` ends the pipeline's request at its next step.
        drop(tokens);
        let (tail, usage) = stream.finish(finish)?;
        if !tail.is_empty() {
            let _ = self.events.send(StreamEvent::Token(tail));
        }
        let _ = self.events.send(StreamEvent::Done { finish, usage: usage.clone() });
        Ok((finish, usage))
    }
}
