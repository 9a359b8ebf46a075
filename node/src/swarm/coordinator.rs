//! The coordinator actor: feeds connections and adverts from `net` into `ClusterState`,
//! gossips our advert every `advert_every` (and at once when we publish a plan), persists the
//! highest round, loads and unloads this node's stages as plans change (unchanged ranges keep
//! their weights), answers inbound pipeline steps, and starts generations for the API.
//! A tensor-parallel stage is formed afresh under each plan: its data-plane links are set up
//! over the control plane (`tp_group`), then its slice loads on the stage thread.
//! Its loop serves cancellation first, then commands, then network events, then the timer.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p::PeerId;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::entry::{self, GenerateRequest, TokenEvent};
use super::forward::{self, HopContext};
use super::tp_group::{self, DataplaneConfig, GroupOrder, LinkBook};
use super::SwarmError;
use crate::cluster::{ClusterConfig, ClusterEvent, ClusterState, Epoch, Input, ModelFootprint, NodeAdvert, Output, Plan, Strategy};
use crate::dataplane::LinkGroup;
use crate::engine::tp::{TpMember, TpSlice};
use crate::engine::model::ModelSource;
use crate::engine::stage_host::StageHost;
use crate::engine::LayerRange;
use crate::net::{NetEvent, NetHandle};

pub struct SwarmConfig {
    pub data_dir: PathBuf,
    /// Our advert's figures (memory honours --memory-limit).
    pub advert: NodeAdvert,
    /// Model id → local file or directory this node can load stages from.
    pub models: BTreeMap<String, PathBuf>,
    pub cluster: ClusterConfig,
    pub advert_every: Duration,
    /// Deadline of one pipeline hop (a long prefill takes longer than a decode step).
    pub hop_deadline: Duration,
    /// Where this node's stages compute (the CPU, or a GPU).
    pub device: crate::engine::device::ComputeDevice,
    /// The strategy this node's operator pinned for the models it asks for (`None`: auto).
    pub strategy: Option<Strategy>,
    /// Where this node's data-plane TCP listeners bind (its address towards its peers).
    pub dataplane_ip: std::net::IpAddr,
    /// Offer only these data-plane transports (tests and diagnosis); `None`: all this host has.
    pub dataplane_transports: Option<Vec<crate::dataplane::Transport>>,
}

/// Longest wait of one all-reduce of a tensor group in `serve` (at most the hop deadline).
const ALL_REDUCE_DEADLINE: Duration = Duration::from_secs(30);

/// How long forming a group's links may take (peers may still be applying the plan).
const FORM_WAIT: Duration = Duration::from_secs(60);

/// What this node runs of one model: a layer range, alone or as a member of a tensor group.
#[derive(Debug, Clone, PartialEq)]
struct StageKey {
    range: LayerRange,
    /// For a group: the plan that formed it, our rank and every member in rank order.
    group: Option<(Epoch, usize, Vec<String>)>,
}

/// What `/v1/cluster` shows.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClusterSnapshot {
    pub me: String,
    pub leader: String,
    pub members: Vec<NodeAdvert>,
    pub plan: Option<Plan>,
    pub rtt_ms: BTreeMap<String, f64>,
    /// This node's stages by model: their layers and how their load went.
    pub stages: BTreeMap<String, StageStatus>,
}

/// One of this node's stages, as loaded (or loading) under the plan in force.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StageStatus {
    pub start: usize,
    pub end: usize,
    pub state: StageState,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StageState {
    Loading,
    Ready,
    Failed(String),
}

enum Command {
    Generate { request: GenerateRequest, events: mpsc::Sender<TokenEvent> },
    ServeOnly { path: PathBuf, footprint: ModelFootprint },
    Snapshot { reply: oneshot::Sender<ClusterSnapshot> },
}

/// Cloneable access to the coordinator; when every handle is dropped it shuts down.
#[derive(Clone)]
pub struct SwarmHandle {
    /// Commands to the coordinator loop; a closed channel means it has stopped.
    commands: mpsc::Sender<Command>,
}

impl SwarmHandle {
    /// Starts a generation; tokens (then `Done` or `Error`) arrive on the returned channel.
    /// Dropping the receiver cancels the generation at its next step.
    pub async fn generate(&self, request: GenerateRequest) -> Result<mpsc::Receiver<TokenEvent>, SwarmError> {
        let (events, rx) = mpsc::channel(64);
        self.commands.send(Command::Generate { request, events }).await.map_err(|_| SwarmError::ShutDown)?;
        Ok(rx)
    }

    /// Makes `model` (files at `path` on this node) the one model this node asks the swarm to
    /// place, letting go of any other it asked for; also advertises that we hold its files.
    /// `context_limit` (this node's `--context`) bounds the KV cache placement reserves for it.
    /// Reading the model's header to size it happens here, on the blocking pool, never in the
    /// coordinator's loop.
    pub async fn serve_only(&self, model: &str, path: PathBuf, context_limit: Option<usize>) -> Result<(), SwarmError> {
        let footprint = {
            let (id, path) = (model.to_string(), path.clone());
            tokio::task::spawn_blocking(move || footprint(&id, &path, context_limit)).await.map_err(|e| SwarmError::Model { model: model.to_string(), reason: e.to_string() })??
        };
        self.commands.send(Command::ServeOnly { path, footprint }).await.map_err(|_| SwarmError::ShutDown)?;
        Ok(())
    }

    pub async fn snapshot(&self) -> Result<ClusterSnapshot, SwarmError> {
        let (reply, rx) = oneshot::channel();
        self.commands.send(Command::Snapshot { reply }).await.map_err(|_| SwarmError::ShutDown)?;
        rx.await.map_err(|_| SwarmError::ShutDown)
    }
}

/// Starts the coordinator on the current tokio runtime.
pub fn spawn(config: SwarmConfig, net: NetHandle, mut net_events: mpsc::Receiver<NetEvent>, cancel: CancellationToken) -> SwarmHandle {
    let (commands, mut inbox) = mpsc::channel::<Command>(64);
    let highest_round = crate::net::round::load_highest_round(&config.data_dir).unwrap_or(0);
    let state = ClusterState::new(config.advert.clone(), config.cluster, highest_round);
    // The plan in force, read by pipeline tasks without a round trip through the loop.
    let (plan_tx, plan_rx) = watch::channel::<Option<Arc<Plan>>>(None);
    // Stage loads report back here from the stage thread.
    let (stage_done_tx, mut stage_done) = mpsc::unbounded_channel::<(String, StageKey, Result<(), String>)>();
    let mut offer = crate::dataplane::negotiate::local_offer();
    #[cfg(feature = "rdma")]
    tracing::info!(target: "shoal::dataplane", event = "rdma_detected", found = ?crate::dataplane::rdma::detect(), offered = offer.transports.contains(&crate::dataplane::Transport::Rdma));
    if let Some(only) = &config.dataplane_transports {
        // Exactly these, even one detection did not find: it then fails setup and falls back.
        offer.transports = only.clone();
        offer.transports.sort();
        offer.transports.dedup();
    }
    let dataplane = DataplaneConfig { offer, ip: config.dataplane_ip };
    let hop = HopContext {
        me: config.advert.id.clone(),
        net: net.clone(),
        stages: StageHost::spawn(config.device.clone()),
        plan: plan_rx,
        hop_deadline: config.hop_deadline,
        links: LinkBook::default(),
        frames: Default::default(),
        order: GroupOrder::default(),
        dataplane,
    };
    let mut actor = Coordinator { config, state, net, hop, plan_tx, loaded: HashMap::new(), stage_done_tx, rtt: BTreeMap::new(), started: Instant::now(), persisted_round: highest_round };
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(actor.config.advert_every);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                command = inbox.recv() => match command {
                    Some(c) => actor.command(c),
                    None => break,
                },
                event = net_events.recv() => match event {
                    Some(e) => actor.net_event(e),
                    None => break,
                },
                Some((model, key, result)) = stage_done.recv() => actor.stage_loaded(model, key, result),
                _ = ticker.tick() => {
                    actor.input(Input::Tick);
                    actor.publish_advert();
                }
            }
        }
    });
    SwarmHandle { commands }
}

struct Coordinator {
    config: SwarmConfig,
    state: ClusterState,
    net: NetHandle,
    hop: HopContext,
    /// Publishes each new plan in force to pipeline tasks (`HopContext::plan`).
    plan_tx: watch::Sender<Option<Arc<Plan>>>,
    /// What is loaded (or loading) per model on this node, and how its load went.
    loaded: HashMap<String, (StageKey, StageState)>,
    /// Load (and group formation) results, back from their tasks and the stage thread.
    stage_done_tx: mpsc::UnboundedSender<(String, StageKey, Result<(), String>)>,
    rtt: BTreeMap<String, f64>,
    started: Instant,
    persisted_round: u64,
}

impl Coordinator {
    fn now(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Generate { request, events } => {
                // The entry waits for a plan that places the model (`serve_only` asked for it).
                tokio::spawn(entry::run(self.hop.clone(), request, events));
            }
            Command::ServeOnly { path, mut footprint } => {
                footprint.strategy = self.config.strategy;
                self.config.models.insert(footprint.model.clone(), path);
                let now = self.now();
                let mut out = self.state.set_local_models(self.config.models.keys().cloned().collect(), now);
                out.extend(self.state.set_wants(vec![footprint], now));
                self.outputs(out);
            }
            Command::Snapshot { reply } => {
                let members = self.state.alive().iter().filter_map(|id| self.state.advert_of(id).cloned()).collect();
                let stages = self.loaded.iter().map(|(m, (k, st))| (m.clone(), StageStatus { start: k.range.start, end: k.range.end, state: st.clone() })).collect();
                let _ = reply.send(ClusterSnapshot {
                    me: self.state.id().clone(),
                    leader: self.state.leader().clone(),
                    members,
                    plan: self.state.plan().cloned(),
                    rtt_ms: self.rtt.clone(),
                    stages,
                });
            }
        }
    }

    fn net_event(&mut self, event: NetEvent) {
        match event {
            NetEvent::Connected(peer) => self.input(Input::Connected(peer.to_string())),
            NetEvent::Disconnected(peer) => {
                self.rtt.remove(&peer.to_string());
                self.input(Input::Disconnected(peer.to_string()))
            }
            NetEvent::Advert { advert, .. } => self.input(Input::Advert(advert)),
            NetEvent::Rtt { peer, rtt } => {
                self.rtt.insert(peer.to_string(), rtt.as_secs_f64() * 1e3);
                let mut rtts: Vec<f64> = self.rtt.values().copied().collect();
                rtts.sort_by(f64::total_cmp);
                self.input(Input::LinkRtt(rtts[rtts.len() / 2] / 1e3));
            }
            NetEvent::Request { from, request, reply } => {
                let hop = self.hop.clone();
                tokio::spawn(async move {
                    let _ = reply.send(forward::serve(&hop, from, request).await);
                });
            }
            NetEvent::Listening(_) => {}
        }
    }

    fn input(&mut self, input: Input) {
        let now = self.now();
        let out = self.state.handle(input, now);
        self.outputs(out);
    }

    fn outputs(&mut self, out: Vec<Output>) {
        let mut published = false;
        for o in out {
            match o {
                Output::Publish(plan) => {
                    tracing::info!(target: "shoal::cluster", event = "plan_published", round = plan.epoch.round, leader = %plan.epoch.leader, members = plan.members.len());
                    published = true;
                }
                Output::Event(ClusterEvent::MemberJoined(id)) => tracing::info!(target: "shoal::cluster", event = "member_joined", node = %id),
                Output::Event(ClusterEvent::MemberLeft(id)) => tracing::info!(target: "shoal::cluster", event = "member_left", node = %id),
                Output::Event(ClusterEvent::LeaderChanged(id)) => tracing::info!(target: "shoal::cluster", event = "leader_changed", leader = %id),
                Output::Event(ClusterEvent::PlanAccepted(e)) => tracing::info!(target: "shoal::cluster", event = "plan_accepted", round = e.round, leader = %e.leader),
                Output::Event(ClusterEvent::PlanRefused { epoch, reason }) => tracing::debug!(target: "shoal::cluster", event = "plan_refused", round = epoch.round, reason),
            }
        }
        let round = self.state.highest_round();
        if round > self.persisted_round {
            // Persist before gossiping: a restarted leader must never reuse a round.
            if let Err(e) = crate::net::round::store_highest_round(&self.config.data_dir, round) {
                tracing::warn!(target: "shoal::cluster", "cannot persist the cluster round: {e}");
            }
            self.persisted_round = round;
        }
        self.apply_plan();
        if published {
            self.publish_advert();
        }
    }

    /// Loads the stages the plan in force gives this node and drops the others.
    fn apply_plan(&mut self) {
        let plan = self.state.plan().cloned();
        let changed = self.plan_tx.borrow().as_deref() != plan.as_ref();
        if !changed {
            return;
        }
        let mut mine: HashMap<String, StageKey> = HashMap::new();
        if let Some(plan) = &plan {
            for (model, placement) in &plan.placements {
                let Some(p) = placement.as_ref().ok() else { continue };
                if let Some((index, rank)) = p.stage_of(self.state.id()) {
                    let stage = &p.stages[index];
                    let group = (stage.tp_size() > 1).then(|| (plan.epoch.clone(), rank, stage.members().cloned().collect()));
                    mine.insert(model.clone(), StageKey { range: LayerRange::new(stage.start, stage.end), group });
                }
            }
        }
        // Unload first: the stage thread runs jobs in order, so old weights go before new ones come.
        let gone: Vec<String> = self.loaded.keys().filter(|m| !mine.contains_key(*m)).cloned().collect();
        for model in gone {
            self.hop.stages.unload(model.clone());
            self.loaded.remove(&model);
        }
        for (model, key) in &mine {
            if self.loaded.get(model).is_some_and(|(k, _)| k == key) {
                continue;
            }
            let Some(path) = self.config.models.get(model).cloned() else {
                tracing::warn!(target: "shoal::cluster", %model, "the plan gives this node a stage of a model it does not have");
                continue;
            };
            let range = key.range;
            tracing::info!(target: "shoal::cluster", event = "stage_loading", %model, start = range.start, end = range.end, group = ?key.group.as_ref().map(|g| (g.1, g.2.len())));
            let (label, key_done, done) = (model.clone(), key.clone(), self.stage_done_tx.clone());
            let reply: Box<dyn FnOnce(crate::engine::Result<()>) + Send> = Box::new(move |r| {
                let _ = done.send((label, key_done, r.map_err(|e| e.to_string())));
            });
            match &key.group {
                None => self.hop.stages.load(model.clone(), path, range, None, reply),
                Some((epoch, rank, members)) => {
                    // The old slice's group is gone: steps fail fast until the new one loads.
                    self.hop.stages.unload(model.clone());
                    let (hop, model, epoch, rank, members) = (self.hop.clone(), model.clone(), epoch.clone(), *rank, members.clone());
                    let deadline = self.config.hop_deadline.min(ALL_REDUCE_DEADLINE);
                    tokio::spawn(async move {
                        let links = match tp_group::form(&hop, &model, &epoch, rank, &members, FORM_WAIT).await {
                            Ok(l) => l,
                            Err(e) => return reply(Err(crate::engine::EngineError::Shard(format!("forming the tensor group: {e}")))),
                        };
                        let group = match LinkGroup::new(rank, links, deadline) {
                            Ok(g) => Arc::new(g),
                            Err(e) => return reply(Err(crate::engine::EngineError::Shard(e.to_string()))),
                        };
                        tracing::info!(target: "shoal::dataplane", event = "group_formed", %model, rank, size = members.len(), transports = ?group.transports());
                        let member = TpMember { slice: TpSlice { rank, size: members.len() }, reduce: group };
                        hop.stages.load(model, path, range, Some(member), reply);
                    });
                }
            }
            self.loaded.insert(model.clone(), (key.clone(), StageState::Loading));
        }
        self.plan_tx.send_replace(plan.map(Arc::new));
    }

    fn stage_loaded(&mut self, model: String, key: StageKey, result: Result<(), String>) {
        let Some((current, state)) = self.loaded.get_mut(&model) else { return };
        if *current != key {
            return; // a later plan moved this stage while it loaded
        }
        let range = key.range;
        match result {
            Ok(()) => {
                tracing::info!(target: "shoal::cluster", event = "stage_ready", %model, start = range.start, end = range.end);
                if let Some((epoch, 0, members)) = &key.group {
                    self.hop.order.leader_ready(&model, &tp_group::group_id(epoch, members));
                }
                *state = StageState::Ready;
            }
            Err(e) => {
                tracing::warn!(target: "shoal::cluster", event = "stage_failed", %model, error = %e);
                *state = StageState::Failed(e);
            }
        }
    }

    fn publish_advert(&self) {
        let advert = self.state.advert();
        let net = self.net.clone();
        tokio::spawn(async move {
            // Publishing fails harmlessly while no peer is subscribed yet.
            let _ = net.publish_advert(&advert).await;
        });
    }
}

/// What placing `model` (files at `path`) takes, read from its header, with the KV cache it
/// reserves when served with `context_limit`.
fn footprint(model: &str, path: &std::path::Path, context_limit: Option<usize>) -> Result<ModelFootprint, SwarmError> {
    let source = ModelSource::open(path).map_err(|e| SwarmError::Model { model: model.to_string(), reason: e.to_string() })?;
    Ok(crate::models::footprint(model, &source, context_limit))
}

pub(super) fn peer_of(node: &str) -> Option<PeerId> {
    node.parse().ok()
}
