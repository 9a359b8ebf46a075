//! The thread that owns this node's pipeline stages (one `StageService` per model) and runs
//! their steps one at a time, reached through a cloneable `StageHost` over a std channel.
//! Replies go through callbacks so that async callers can bridge with any channel; the thread
//! never awaits. Loading a range that is already loaded keeps its weights. A tensor-parallel
//! slice always loads afresh (its group is new) and ends with a one-value all-reduce, a barrier:
//! its load completes only once every member of the group has loaded, so no step of the group
//! runs while a member is still loading.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use super::device::ComputeDevice;
use super::model::ModelSource;
use super::shard::LayerRange;
use super::shard::Shard;
use super::stage::{StageService, Step, StepOutput};
use super::tp::TpMember;
use super::{EngineError, Result};

type Reply<T> = Box<dyn FnOnce(Result<T>) + Send>;

enum Job {
    /// Load `range` of the model at `path` under `model`, replacing another range of it.
    Load { model: String, path: PathBuf, range: LayerRange, tp: Option<TpMember>, reply: Reply<()> },
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
                        Job::Load { model, path, range, tp, reply } => {
                            if tp.is_none() && stages.get(&model).is_some_and(|s| s.shard().range == range && s.shard().tp().is_none()) {
                                reply(Ok(()));
                                continue;
                            }
                            stages.remove(&model);
                            let loaded = match tp {
                                None => ModelSource::open(&path).and_then(|src| src.load_shard(range, device.candle())),
                                Some(member) => load_slice(&path, range, device.candle(), member),
                            };
                            reply(loaded.map(|shard| {
                                stages.insert(model, StageService::new(shard, MAX_SESSIONS, IDLE_TIMEOUT));
                            }));
                        }
                        Job::Unload { model } => {
                            stages.remove(&model);
                            #[cfg(feature = "cuda")]
                            if stages.is_empty() {
                                super::cuda_decode::release_dequant_scratch();
                            }
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

    /// Loads `range` of the model at `path`: the whole layers, or `tp`'s slice of them.
    pub fn load(&self, model: String, path: PathBuf, range: LayerRange, tp: Option<TpMember>, reply: Reply<()>) {
        if let Err(Job::Load { reply, .. }) = self.send(Job::Load { model, path, range, tp, reply }) {
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

/// Loads a tensor-parallel slice, then waits (bounded by the group's deadline) for every other
/// member to load theirs.
fn load_slice(path: &std::path::Path, range: LayerRange, device: &candle_core::Device, member: TpMember) -> Result<Shard> {
    let reduce = member.reduce.clone();
    let src = ModelSource::open(path)?;
    let shard = Shard::load_tp(&src.weights, &src.spec, range, device, Some(member))?;
    let mut one = [1.0f32];
    reduce.all_reduce(&mut one).map_err(|e| EngineError::Shard(format!("the tensor group did not load together: {e}")))?;
    Ok(shard)
}
