//! The scheduler actor: the one owner of this node's engine thread and loaded model. Requests
//! wait in a bounded FIFO queue and run one at a time; a request naming another local model
//! loads it first (one model is loaded at a time). Each queued request ends by exactly one of:
//! its reply, an error, its client leaving (`GenerationStream` dropped) or its queue deadline.
//! It never blocks its task: model loads run on the blocking pool, generations on the engine thread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{Command, LoadedInfo, SchedulerConfig, SchedulerState, StreamEvent};
use crate::models::LocalModel;
use crate::api::error::ApiError;
use crate::api::metrics::Metrics;
use crate::engine::runtime::EngineHandle;
use crate::engine::{FinishReason, GenerationEvent, GenerationRequest, LoadedModel, Usage};

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

/// The generation on the engine now.
struct Running {
    id: u64,
    /// Read by the engine thread's sink before every token; set to stop the generation.
    cancel: Arc<AtomicBool>,
    events: mpsc::UnboundedSender<StreamEvent>,
}

struct Engine {
    model: LocalModel,
    /// The engine thread's inbox; dropping it lets the thread exit after its job.
    handle: EngineHandle,
    thread: std::thread::JoinHandle<()>,
    layers: usize,
    context: usize,
}

/// An engine job's end, sent by its completion callback on the engine thread.
struct Finished {
    result: Result<Usage, ApiError>,
    finish: Option<FinishReason>,
}

pub(super) struct Scheduler {
    config: SchedulerConfig,
    inbox: mpsc::UnboundedReceiver<Command>,
    /// Cloned into each job's completion callback; the actor holds one, so it never closes.
    finished_tx: mpsc::UnboundedSender<Finished>,
    finished: mpsc::UnboundedReceiver<Finished>,
    /// Cloned into each blocking load task; the actor holds one, so it never closes.
    loaded_tx: mpsc::UnboundedSender<(LocalModel, crate::engine::Result<LoadedModel>)>,
    loaded: mpsc::UnboundedReceiver<(LocalModel, crate::engine::Result<LoadedModel>)>,
    queue: VecDeque<Entry>,
    running: Option<Running>,
    engine: Option<Engine>,
    loading: Option<LocalModel>,
    last_error: Option<String>,
    last_decode_tok_s: Option<f64>,
    /// The only writer of the published state.
    state: watch::Sender<SchedulerState>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
}

impl Scheduler {
    pub(super) fn new(config: SchedulerConfig, inbox: mpsc::UnboundedReceiver<Command>, state: watch::Sender<SchedulerState>, metrics: Arc<Metrics>, shutdown: CancellationToken) -> Self {
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
            engine: None,
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
                    running.cancel.store(true, Ordering::Relaxed);
                }
            }
            Command::Load { model } => {
                let known = |m: Option<&LocalModel>| m.is_some_and(|m| m.path == model.path);
                if !known(self.engine.as_ref().map(|e| &e.model)) && !known(self.loading.as_ref()) && !self.queue.iter().any(|e| matches!(e, Entry::Load(m) if m.path == model.path)) {
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
            if self.engine.as_ref().map(|e| &e.model.path) != Some(&front.model().path) {
                let model = front.model().clone();
                self.start_load(model);
                return;
            }
            if let Some(Entry::Generate { id, request, arrived, events, .. }) = self.queue.pop_front() {
                self.dispatch(id, request, arrived, events);
            }
        }
    }

    fn start_load(&mut self, model: LocalModel) {
        let old = self.engine.take();
        let options = self.config.load_options.clone();
        let done = self.loaded_tx.clone();
        self.loading = Some(model.clone());
        tracing::info!(model = %model.id, path = %model.path.display(), "loading model");
        tokio::task::spawn_blocking(move || {
            // Free the old model first: its thread exits once its inbox (the handle) is gone.
            if let Some(Engine { handle, thread, .. }) = old {
                drop(handle);
                let _ = thread.join();
            }
            let result = LoadedModel::load(&model.path, &options);
            let _ = done.send((model, result));
        });
    }

    fn loaded(&mut self, model: LocalModel, result: crate::engine::Result<LoadedModel>) {
        self.loading = None;
        match result {
            Ok(loaded) => {
                tracing::info!(model = %model.id, "model loaded");
                let (layers, context) = (loaded.spec.num_layers, loaded.spec.context_length);
                let (handle, thread) = EngineHandle::spawn(loaded);
                self.engine = Some(Engine { model, handle, thread, layers, context });
                self.last_error = None;
            }
            Err(e) => {
                let error = ApiError::ModelLoad { model: model.id.clone(), reason: e.to_string() };
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
        // pump() only dispatches when the front's model is the loaded one.
        let engine = self.engine.as_ref().expect("dispatch runs with the request's model loaded");
        let cancel = Arc::new(AtomicBool::new(false));
        let finish = Arc::new(Mutex::new(None));
        let _ = events.send(StreamEvent::Started { queued: arrived.elapsed() });
        let (sink_events, sink_cancel, sink_finish) = (events.clone(), cancel.clone(), finish.clone());
        let sink = Box::new(move |event: GenerationEvent| {
            if sink_cancel.load(Ordering::Relaxed) {
                return false;
            }
            match event {
                // Held-back text: nothing to send, but a client that left still cancels.
                GenerationEvent::Token { text, .. } if text.is_empty() => !sink_events.is_closed(),
                GenerationEvent::Token { text, .. } => sink_events.send(StreamEvent::Token(text)).is_ok(),
                GenerationEvent::Done { finish, usage } => {
                    *sink_finish.lock().unwrap_or_else(|p| p.into_inner()) = Some(finish);
                    let _ = sink_events.send(StreamEvent::Done { finish, usage });
                    true
                }
            }
        });
        let (done_events, finished) = (events.clone(), self.finished_tx.clone());
        let done = Box::new(move |result: crate::engine::Result<Usage>| {
            let result = result.map_err(ApiError::from);
            if let Err(e) = &result {
                let _ = done_events.send(StreamEvent::Failed(e.clone()));
            }
            let finish = *finish.lock().unwrap_or_else(|p| p.into_inner());
            let _ = finished.send(Finished { result, finish });
        });
        engine.handle.generate(request, sink, done);
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
            loaded: self.engine.as_ref().map(|e| LoadedInfo { model: e.model.clone(), layers: e.layers, context: e.context }),
            loading: self.loading.clone(),
            queue_depth: waiting,
            running: self.running.is_some(),
            last_error: self.last_error.clone(),
            last_decode_tok_s: self.last_decode_tok_s,
        });
    }

    /// Shutdown: every waiting request gets 503, the running one is told and stopped, and the
    /// engine thread is joined (it exits after the token in progress).
    async fn stop(mut self) {
        for entry in self.queue.drain(..) {
            if let Entry::Generate { events, .. } = entry {
                let _ = events.send(StreamEvent::Failed(ApiError::ShuttingDown));
            }
        }
        if let Some(running) = self.running.take() {
            let _ = running.events.send(StreamEvent::Failed(ApiError::ShuttingDown));
            running.cancel.store(true, Ordering::Relaxed);
        }
        if let Some(Engine { handle, thread, .. }) = self.engine.take() {
            drop(handle);
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

