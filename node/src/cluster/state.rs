//! One node's view of the swarm: who is alive (fresh advert and a live connection), who leads
//! (highest priority, then smallest id, among the alive), and which plan is in force. The leader
//! publishes a plan when membership or wanted models change, stamped with an epoch
//! `(round, leader)` above every epoch it has seen, so no two leaders ever share an epoch.
//! Nodes accept only newer epochs and serve only stages of the plan in force that are theirs.
//! Plans ride in adverts, so a lost message is repaired by the next advert.
//! The highest round seen must survive a restart (the node persists `highest_round()` in its
//! data dir and passes it back to `new`), or a restarted leader could reuse an epoch.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::cost::LinkCost;
use super::placement::{place_all, ModelFootprint, Placement, Stage};
use super::{Millis, NodeId};

/// A plan's stamp: compared by round, then by leader (the smaller id wins a tie).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Epoch {
    pub round: u64,
    pub leader: NodeId,
}

impl Ord for Epoch {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.round.cmp(&other.round).then_with(|| other.leader.cmp(&self.leader))
    }
}

impl PartialOrd for Epoch {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The leader's decision for one epoch: the members it saw and where each wanted model runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub epoch: Epoch,
    pub members: Vec<NodeId>,
    /// Per model: its placement, or why the swarm cannot hold it.
    pub placements: BTreeMap<String, Result<Placement, String>>,
}

/// What each node gossips about itself about every second.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeAdvert {
    pub id: NodeId,
    pub name: String,
    /// Higher priority leads; equal priorities fall back to the smallest id.
    pub priority: i32,
    pub memory_total: u64,
    pub memory_offered: u64,
    pub mem_bandwidth: f64,
    pub flops: f64,
    pub backend: String,
    pub addresses: Vec<String>,
    /// Ids of the models whose files this node has: stages are placed only on holders.
    pub models: Vec<String>,
    /// Models this node's API has been asked for: the leader places them.
    pub wants: Vec<ModelFootprint>,
    /// The plan this node has in force, so that plans spread even when messages are lost.
    pub plan: Option<Plan>,
    /// The GPU this node computes on; then `memory_offered`, `mem_bandwidth` and `flops`
    /// describe the GPU, so placement weighs it by what it can really do.
    #[serde(default)]
    pub gpu: Option<GpuAdvert>,
    /// Measured weight bytes/s of the node's decode kernel (0 when unknown).
    #[serde(default)]
    pub decode_bandwidth: f64,
}

impl NodeAdvert {
    /// The rate decode streams weights at on this node: the lower of its memory bandwidth and
    /// its decode kernel's measured rate (the memory bandwidth alone when the latter is unknown).
    pub fn decode_rate(&self) -> f64 {
        if self.decode_bandwidth > 0.0 {
            self.decode_bandwidth.min(self.mem_bandwidth)
        } else {
            self.mem_bandwidth
        }
    }
}

/// A GPU as adverts carry it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GpuAdvert {
    pub name: String,
    pub memory_total: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct ClusterConfig {
    /// A member whose last advert is older than this is gone.
    pub advert_ttl: Millis,
}

impl ClusterConfig {
    /// Fast timers for tests (adverts every ~1 s).
    pub const TEST: ClusterConfig = ClusterConfig { advert_ttl: 3_000 };
    /// Users' LAN defaults.
    pub const LAN: ClusterConfig = ClusterConfig { advert_ttl: 5_000 };
}

pub enum Input {
    /// An advert from a peer (or our own, refreshed: then only `wants` and figures change).
    Advert(NodeAdvert),
    Connected(NodeId),
    Disconnected(NodeId),
    /// Time passed; expire stale members.
    Tick,
    /// The median round-trip time to our peers now, seconds (measured by the network's pings).
    LinkRtt(f64),
}

#[derive(Debug, Clone, PartialEq)]
pub enum ClusterEvent {
    MemberJoined(NodeId),
    MemberLeft(NodeId),
    LeaderChanged(NodeId),
    PlanAccepted(Epoch),
    PlanRefused { epoch: Epoch, reason: &'static str },
}

#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// A new plan made here as leader; gossip it (it also rides in our next advert).
    Publish(Plan),
    Event(ClusterEvent),
}

struct Member {
    advert: NodeAdvert,
    last_seen: Millis,
    connected: bool,
}

pub struct ClusterState {
    me: NodeAdvert,
    config: ClusterConfig,
    members: BTreeMap<NodeId, Member>,
    alive: BTreeSet<NodeId>,
    leader: NodeId,
    /// Highest round seen anywhere (plans and adverts), so a new leader goes above it.
    highest_round: u64,
    plan: Option<Plan>,
    /// The link figures placement predicts with: `LinkCost::LAN` until an RTT is measured, then
    /// the measured one, changed only when a new measurement is off by more than 2× (so that
    /// jitter does not flip placements).
    link: LinkCost,
}

impl ClusterState {
    /// `highest_round` is the value `highest_round()` had before this node last stopped (0 the first time).
    pub fn new(me: NodeAdvert, config: ClusterConfig, highest_round: u64) -> Self {
        let id = me.id.clone();
        ClusterState { me, config, members: BTreeMap::new(), alive: BTreeSet::from([id.clone()]), leader: id, highest_round, plan: None, link: LinkCost::LAN }
    }

    /// The highest round seen or made here: persist it whenever it grows.
    pub fn highest_round(&self) -> u64 {
        self.highest_round
    }

    pub fn id(&self) -> &NodeId {
        &self.me.id
    }

    pub fn leader(&self) -> &NodeId {
        &self.leader
    }

    pub fn plan(&self) -> Option<&Plan> {
        self.plan.as_ref()
    }

    pub fn alive(&self) -> &BTreeSet<NodeId> {
        &self.alive
    }

    pub fn advert_of(&self, id: &str) -> Option<&NodeAdvert> {
        if id == self.me.id {
            Some(&self.me)
        } else {
            self.members.get(id).map(|m| &m.advert)
        }
    }

    /// Our advert as it should be gossiped now (carrying the plan in force).
    pub fn advert(&self) -> NodeAdvert {
        NodeAdvert { plan: self.plan.clone(), ..self.me.clone() }
    }

    /// Asks the swarm to place a model (gossiped in our adverts until the leader plans it).
    pub fn want(&mut self, model: ModelFootprint, now: Millis) -> Vec<Output> {
        if !self.me.wants.iter().any(|w| w.model == model.model) {
            self.me.wants.push(model);
        }
        self.reconcile(now)
    }

    /// Replaces the models we ask the swarm to place (a node that serves one model at a time
    /// lets go of the last one when it switches).
    pub fn set_wants(&mut self, wants: Vec<ModelFootprint>, now: Millis) -> Vec<Output> {
        self.me.wants = wants;
        self.reconcile(now)
    }

    /// Replaces the list of models whose files we hold (after a download or a removal).
    pub fn set_local_models(&mut self, models: Vec<String>, now: Millis) -> Vec<Output> {
        self.me.models = models;
        self.reconcile(now)
    }

    /// Our stage of `model` in the plan in force, if we have one: the only work we may serve.
    pub fn my_stage(&self, model: &str) -> Option<&Stage> {
        let placement = self.plan.as_ref()?.placements.get(model)?.as_ref().ok()?;
        placement.stages.iter().find(|s| s.rank_of(&self.me.id).is_some())
    }

    pub fn handle(&mut self, input: Input, now: Millis) -> Vec<Output> {
        let mut out = Vec::new();
        match input {
            Input::Advert(advert) if advert.id == self.me.id => {}
            Input::Advert(advert) => {
                if let Some(plan) = advert.plan.clone() {
                    self.consider_plan(plan, &mut out);
                }
                let id = advert.id.clone();
                let member = self.members.entry(id).or_insert(Member { advert: advert.clone(), last_seen: now, connected: false });
                member.advert = advert;
                member.last_seen = now;
            }
            Input::Connected(id) => {
                if let Some(m) = self.members.get_mut(&id) {
                    m.connected = true;
                } else if id != self.me.id {
                    // Connected before the first advert: alive once an advert arrives.
                    self.members.insert(id.clone(), Member { advert: placeholder(&id), last_seen: 0, connected: true });
                }
            }
            Input::Disconnected(id) => {
                if let Some(m) = self.members.get_mut(&id) {
                    m.connected = false;
                }
            }
            Input::Tick => {}
            Input::LinkRtt(rtt_s) => {
                let ratio = rtt_s / self.link.rtt_s;
                if rtt_s.is_finite() && rtt_s > 0.0 && !(0.5..=2.0).contains(&ratio) {
                    self.link.rtt_s = rtt_s;
                }
            }
        }
        out.extend(self.reconcile(now));
        out
    }

    fn consider_plan(&mut self, plan: Plan, out: &mut Vec<Output>) {
        self.highest_round = self.highest_round.max(plan.epoch.round);
        match &self.plan {
            Some(current) if plan.epoch <= current.epoch => {
                if plan.epoch < current.epoch {
                    out.push(Output::Event(ClusterEvent::PlanRefused { epoch: plan.epoch, reason: "older than the plan in force" }));
                }
            }
            _ => {
                out.push(Output::Event(ClusterEvent::PlanAccepted(plan.epoch.clone())));
                self.plan = Some(plan);
            }
        }
    }

    fn reconcile(&mut self, now: Millis) -> Vec<Output> {
        let mut out = Vec::new();
        let ttl = self.config.advert_ttl;
        let alive: BTreeSet<NodeId> = self
            .members
            .iter()
            .filter(|(_, m)| m.connected && m.last_seen > 0 && now.saturating_sub(m.last_seen) <= ttl)
            .map(|(id, _)| id.clone())
            .chain(std::iter::once(self.me.id.clone()))
            .collect();
        for id in alive.difference(&self.alive) {
            out.push(Output::Event(ClusterEvent::MemberJoined(id.clone())));
        }
        for id in self.alive.difference(&alive) {
            out.push(Output::Event(ClusterEvent::MemberLeft(id.clone())));
        }
        // Forget members long gone so the map stays bounded.
        self.members.retain(|_, m| m.connected || now.saturating_sub(m.last_seen) <= 10 * ttl);
        self.alive = alive;
        for m in self.members.values().filter(|m| self.alive.contains(&m.advert.id)) {
            if let Some(p) = &m.advert.plan {
                self.highest_round = self.highest_round.max(p.epoch.round);
            }
        }

        let leader = self
            .alive
            .iter()
            .filter_map(|id| self.advert_of(id))
            .max_by(|a, b| a.priority.cmp(&b.priority).then_with(|| b.id.cmp(&a.id)))
            .map(|a| a.id.clone())
            .unwrap_or_else(|| self.me.id.clone());
        if leader != self.leader {
            self.leader = leader;
            out.push(Output::Event(ClusterEvent::LeaderChanged(self.leader.clone())));
        }
        if self.leader == self.me.id {
            let members: Vec<NodeId> = self.alive.iter().cloned().collect();
            let placements = self.placements();
            let current = self.plan.as_ref();
            let stale = match current {
                None => !placements.is_empty() || members.len() > 1,
                Some(p) => p.epoch.leader != self.me.id || p.members != members || p.placements != placements,
            };
            if stale {
                self.highest_round += 1;
                let plan = Plan { epoch: Epoch { round: self.highest_round, leader: self.me.id.clone() }, members, placements };
                out.push(Output::Event(ClusterEvent::PlanAccepted(plan.epoch.clone())));
                out.push(Output::Publish(plan.clone()));
                self.plan = Some(plan);
            }
        }
        out
    }

    /// Placements for every model wanted by an alive member, over the alive members.
    fn placements(&self) -> BTreeMap<String, Result<Placement, String>> {
        let adverts: Vec<&NodeAdvert> = self.alive.iter().filter_map(|id| self.advert_of(id)).collect();
        place_all(&adverts, self.link)
    }
}

fn placeholder(id: &str) -> NodeAdvert {
    NodeAdvert {
        id: id.to_string(),
        name: String::new(),
        priority: i32::MIN,
        memory_total: 0,
        memory_offered: 0,
        mem_bandwidth: 0.0,
        flops: 0.0,
        backend: String::new(),
        addresses: vec![],
        models: vec![],
        wants: vec![],
        plan: None,
        gpu: None,
        decode_bandwidth: 0.0,
    }
}
