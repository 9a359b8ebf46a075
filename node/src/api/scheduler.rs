//! The way in to the scheduler actor (`scheduler/actor.rs`), the one queue of this node's API
//! and the owner of the model it serves through the swarm: `SchedulerHandle` queues
//! generations and loads, each request's events come back on its `GenerationStream` (dropping
//! it cancels), and the actor publishes its state for the model list and cluster view. It
//! knows no HTTP.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::models::LocalModel;
use super::error::ApiError;
use super::metrics::Metrics;
use crate::engine::{FinishReason, GenerationRequest, Usage};
use crate::swarm::SwarmHandle;

mod actor;

/// What a queued request's client sees, in order: `Started`, then `Token`s, then `Done` or
/// `Failed` (`Failed` may also come first, e.g. a full queue or a prompt that is too long).
#[derive(Debug)]
pub enum StreamEvent {
    Started { queued: Duration },
    Token(String),
    Done { finish: FinishReason, usage: Usage },
    Failed(ApiError),
}

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Requests allowed to wait behind the running one; beyond it they get 503.
    pub max_queue: usize,
    /// How long a request may wait in the queue before it gets 503.
    pub queue_timeout: Duration,
    /// Caps each model's context window (tokens) below its own.
    pub context_limit: Option<usize>,
}

/// The scheduler's published view, for `/v1/models`, `/v1/cluster` and model resolution.
#[derive(Debug, Clone, Default)]
pub struct SchedulerState {
    pub loaded: Option<LoadedInfo>,
    pub loading: Option<LocalModel>,
    pub queue_depth: usize,
    pub running: bool,
    /// The last model-load failure, cleared by the next successful load.
    pub last_error: Option<String>,
    /// Decode speed of the last finished generation.
    pub last_decode_tok_s: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct LoadedInfo {
    pub model: LocalModel,
    pub layers: usize,
    pub context: usize,
}

enum Command {
    Submit { id: u64, model: LocalModel, request: GenerationRequest, arrived: Instant, events: mpsc::UnboundedSender<StreamEvent> },
    /// The client's stream was dropped: leave the queue, or stop generating.
    Abandon { id: u64 },
    Load { model: LocalModel },
}

/// A cloneable way in to the scheduler.
#[derive(Clone)]
pub struct SchedulerHandle {
    /// Commands to the actor. Unbounded so that `GenerationStream::drop` never blocks; the
    /// actor drains it at once (the queue bound is enforced there). When every handle and
    /// stream is gone, the channel closes and the actor shuts down.
    commands: mpsc::UnboundedSender<Command>,
    /// The actor's latest published state; it is the only writer.
    state: watch::Receiver<SchedulerState>,
    next_id: Arc<AtomicU64>,
}

/// One request's events. Dropping it before the end cancels the request.
pub struct GenerationStream {
    id: u64,
    /// Written by the actor (queue events) and the engine thread (tokens, completion); closed
    /// when the request has ended and the actor and engine dropped their senders.
    events: mpsc::UnboundedReceiver<StreamEvent>,
    commands: mpsc::UnboundedSender<Command>,
    ended: bool,
}

impl GenerationStream {
    /// The next event; `None` after `Done`/`Failed` (or if the scheduler is gone).
    pub async fn next(&mut self) -> Option<StreamEvent> {
        if self.ended {
            return None;
        }
        let event = self.events.recv().await;
        self.ended = matches!(event, None | Some(StreamEvent::Done { .. } | StreamEvent::Failed(_)));
        event
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        if !self.ended {
            // A closed inbox means the actor is gone, and with it the request.
            let _ = self.commands.send(Command::Abandon { id: self.id });
        }
    }
}

impl SchedulerHandle {
    /// Starts the actor; it stops when `shutdown` is cancelled or every handle is dropped.
    pub fn spawn(config: SchedulerConfig, swarm: SwarmHandle, metrics: Arc<Metrics>, shutdown: CancellationToken) -> (SchedulerHandle, tokio::task::JoinHandle<()>) {
        let (commands, inbox) = mpsc::unbounded_channel();
        let (state_tx, state) = watch::channel(SchedulerState::default());
        let actor = actor::Scheduler::new(config, swarm, inbox, state_tx, metrics, shutdown);
        (SchedulerHandle { commands, state, next_id: Arc::new(AtomicU64::new(1)) }, tokio::spawn(actor.run()))
    }

    /// Queues a generation on `model` (loading it first if another is loaded).
    pub fn submit(&self, model: LocalModel, request: GenerationRequest, arrived: Instant) -> GenerationStream {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events_tx, events) = mpsc::unbounded_channel();
        // If the actor is gone, `events_tx` is dropped with the command and the stream ends at once.
        let _ = self.commands.send(Command::Submit { id, model, request, arrived, events: events_tx });
        GenerationStream { id, events, commands: self.commands.clone(), ended: false }
    }

    /// Queues loading `model`, unless it is already loaded or on its way.
    pub fn load(&self, model: LocalModel) {
        let _ = self.commands.send(Command::Load { model });
    }

    pub fn state(&self) -> SchedulerState {
        self.state.borrow().clone()
    }
}
