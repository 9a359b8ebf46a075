//! The engine thread: owns loaded models and runs generation jobs one at a time, reached
//! through a cloneable `EngineHandle` over a std channel. It never awaits; results flow back
//! through the job's sink and completion callback, so async callers can bridge with any channel.

use std::sync::mpsc;
use std::thread::JoinHandle;

use super::generate::{generate, GenerationEvent, GenerationRequest, Usage};
use super::model::LoadedModel;
use super::{EngineError, Result};

type Sink = Box<dyn FnMut(GenerationEvent) -> bool + Send>;
type Completion = Box<dyn FnOnce(Result<Usage>) + Send>;

enum Job {
    Generate { request: GenerationRequest, sink: Sink, done: Completion },
}

/// A cloneable way to submit work to the engine thread. When every handle is dropped the
/// thread's inbox closes and it exits after the job in progress.
#[derive(Clone)]
pub struct EngineHandle {
    inbox: mpsc::Sender<Job>,
}

impl EngineHandle {
    /// Starts the engine thread owning `model`.
    pub fn spawn(model: LoadedModel) -> (EngineHandle, JoinHandle<()>) {
        let (inbox, jobs) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("shoal-engine".into())
            .spawn(move || {
                for job in jobs {
                    match job {
                        Job::Generate { request, mut sink, done } => done(generate(&model, &request, &mut *sink)),
                    }
                }
            })
            .expect("spawning a thread only fails when the OS is out of resources");
        (EngineHandle { inbox }, thread)
    }

    /// Queues a generation. `sink` sees every event and returns `false` to cancel; `done`
    /// gets the final result exactly once (also when the engine stopped before running it).
    pub fn generate(&self, request: GenerationRequest, sink: Sink, done: Completion) {
        if let Err(mpsc::SendError(Job::Generate { done, .. })) = self.inbox.send(Job::Generate { request, sink, done }) {
            done(Err(EngineError::ShutDown));
        }
    }

    /// Runs a generation and blocks the calling (non-async) thread until it ends.
    pub fn generate_blocking(&self, request: GenerationRequest, sink: Sink) -> Result<Usage> {
        let (tx, rx) = mpsc::channel();
        self.generate(request, sink, Box::new(move |r| {
            let _ = tx.send(r);
        }));
        rx.recv().unwrap_or(Err(EngineError::ShutDown))
    }
}
