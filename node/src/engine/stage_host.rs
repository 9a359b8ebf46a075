//! The thread that owns this node's pipeline stages (one `StageService` per model) and runs
//! their steps one at a time, reached through a cloneable `StageHost` over a std channel.
//! Replies go through callbacks so that async callers can bridge with any channel; the thread
//! never awaits. Loading a range that is already loaded keeps its weights.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use super::device::ComputeDevice;
use super::model::ModelSource;
use super::shard::LayerRange;
use super::stage::{StageService, Step, StepOutput};
use super::{EngineError, Result};

type Reply<T> = Box<dyn FnOnce(Result<T>) + Send>;

enum Job {
    /// Load `range` of the model at `path` under `model`, replacing another range of it.
    Load { model: String, path: PathBuf, range: LayerRange, reply: Reply<()> },
    Unload { model: String },
    Step { model: String, step: Step, reply: Reply<StepOutput> },
    Release { model: String, request_id: u64 },
}

/// Submits work to the stage thread. When every handle is dropped the thread exits.
#[derive(Clone)]
pub struct StageHost {
    inbox: mpsc::Sender<Job>,
}

const MAX_SESSIONS: usize = 32;
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

impl StageHost {
    /// Starts the stage thread; every stage it loads computes on `device`.
    pub fn spawn(device: ComputeDevice) -> StageHost {
        let (inbox, jobs) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("shoal-stages".into())
            .spawn(move || {
                let mut stages: HashMap<String, StageService> = HashMap::new();
                for job in jobs {
                    match job {
                        Job::Load { model, path, range, reply } => {
                            if stages.get(&model).is_some_and(|s| s.shard().range == range) {
                                reply(Ok(()));
                                continue;
                            }
                            stages.remove(&model);
                            let loaded = ModelSource::open(&path).and_then(|src| src.load_shard(range, device.candle()));
                            reply(loaded.map(|shard| {
                                stages.insert(model, StageService::new(shard, MAX_SESSIONS, IDLE_TIMEOUT));
                            }));
                        }
                        Job::Unload { model } => {
                            stages.remove(&model);
                        }
                        Job::Step { model, step, reply } => match stages.get_mut(&model) {
                            Some(stage) => reply(stage.step(step)),
                            None => reply(Err(EngineError::Shard(format!("no stage of {model} is loaded here")))),
                        },
                        Job::Release { model, request_id } => {
                            if let Some(stage) = stages.get_mut(&model) {
                                stage.release(request_id);
                            }
                        }
                    }
                }
            })
            .expect("spawning a thread only fails when the OS is out of resources");
        StageHost { inbox }
    }

    fn send(&self, job: Job) -> std::result::Result<(), Job> {
        self.inbox.send(job).map_err(|mpsc::SendError(job)| job)
    }

    pub fn load(&self, model: String, path: PathBuf, range: LayerRange, reply: Reply<()>) {
        if let Err(Job::Load { reply, .. }) = self.send(Job::Load { model, path, range, reply }) {
            reply(Err(EngineError::ShutDown));
        }
    }

    pub fn unload(&self, model: String) {
        let _ = self.send(Job::Unload { model });
    }

    pub fn step(&self, model: String, step: Step, reply: Reply<StepOutput>) {
        if let Err(Job::Step { reply, .. }) = self.send(Job::Step { model, step, reply }) {
            reply(Err(EngineError::ShutDown));
        }
    }

    pub fn release(&self, model: String, request_id: u64) {
        let _ = self.send(Job::Release { model, request_id });
    }
}
