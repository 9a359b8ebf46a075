//! Seeded simulation of the `cluster` state machines: 3-7 nodes under random crashes,
//! restarts, partitions, message loss and delay, checked after every step. Invariants:
//! an epoch names exactly one plan (so one leader per epoch); a node's plan in force never
//! goes back; a published plan covers only members alive in its leader's view and every layer
//! once; a node claims only stages that are its own. After the churn stops and links heal,
//! every node agrees on the leader and the plan within a bound. A failing seed replays with
//! `SHOAL_SIM_SEED=<seed> cargo nextest run --release simulator -- --nocapture`.

use std::collections::{BTreeSet, HashMap};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal::cluster::{place_all, ClusterConfig, ClusterState, Epoch, Input, ModelFootprint, NodeAdvert, Output, Plan};

const STEP_MS: u64 = 100;
const CHURN_MS: u64 = 40_000;
const SETTLE_MS: u64 = 15_000;
const ADVERT_EVERY_MS: u64 = 1_000;

fn footprint(name: &str, layers: usize) -> ModelFootprint {
    ModelFootprint { model: name.into(), layers, bytes_per_layer: 100, embedding_bytes: 50, head_bytes: 50, ..Default::default() }
}

fn advert(i: usize, rng: &mut StdRng) -> NodeAdvert {
    NodeAdvert {
        id: format!("n{i}"),
        name: format!("node {i}"),
        priority: if rng.random_bool(0.2) { 1 } else { 0 },
        memory_total: 4_000,
        memory_offered: rng.random_range(800..3_000),
        mem_bandwidth: rng.random_range(10.0..40.0),
        flops: 1.0,
        backend: "cpu".into(),
        gpu: None,
        decode_bandwidth: 0.0,
        addresses: vec![],
        models: vec!["small".into(), "large".into()],
        wants: vec![],
        plan: None,
    }
}

struct Node {
    state: Option<ClusterState>,
    /// What the node persists in its data dir: survives crashes.
    persisted_round: u64,
    base: NodeAdvert,
    next_advert: u64,
    last_epoch: Option<Epoch>,
}

struct Message {
    at: u64,
    to: usize,
    input: Input,
    /// A disconnect is about one connection: dropped if the pair reconnected meanwhile.
    unless_linked_with: Option<usize>,
}

struct Sim {
    rng: StdRng,
    now: u64,
    nodes: Vec<Node>,
    group: Vec<usize>,
    queue: Vec<Message>,
    loss: f64,
    published: HashMap<Epoch, Plan>,
    trace: bool,
}

impl Sim {
    fn new(seed: u64, trace: bool) -> Sim {
        let mut rng = StdRng::seed_from_u64(seed);
        let n = rng.random_range(3..=7);
        let nodes = (0..n)
            .map(|i| {
                let base = advert(i, &mut rng);
                Node { state: Some(ClusterState::new(base.clone(), ClusterConfig::TEST, 0)), persisted_round: 0, base, next_advert: rng.random_range(0..ADVERT_EVERY_MS), last_epoch: None }
            })
            .collect();
        let loss = rng.random_range(0.0..0.3);
        // Everyone starts in one group; the links come up (and are announced) at time 0.
        let mut sim = Sim { rng, now: 0, nodes, group: (0..n).collect(), queue: Vec::new(), loss, published: HashMap::new(), trace };
        sim.change(|s| s.group = vec![0; n]);
        sim
    }

    fn linked(&self, a: usize, b: usize) -> bool {
        a != b && self.group[a] == self.group[b] && self.nodes[a].state.is_some() && self.nodes[b].state.is_some()
    }

    fn links(&self) -> BTreeSet<(usize, usize)> {
        let n = self.nodes.len();
        (0..n).flat_map(|a| (0..n).map(move |b| (a, b))).filter(|&(a, b)| self.linked(a, b)).collect()
    }

    /// Applies a topology change, telling each node about connections that came or went.
    fn change(&mut self, f: impl FnOnce(&mut Sim)) {
        let before = self.links();
        f(self);
        let after = self.links();
        for &(a, b) in after.difference(&before) {
            self.deliver(a, Input::Connected(format!("n{b}")));
        }
        for &(a, b) in before.difference(&after) {
            if self.nodes[a].state.is_some() {
                // Failure detection takes up to a few seconds (ping interval + timeout).
                let at = self.now + self.rng.random_range(0..3_000);
                self.queue.push(Message { at, to: a, input: Input::Disconnected(format!("n{b}")), unless_linked_with: Some(b) });
            }
        }
    }

    fn churn(&mut self) {
        let n = self.nodes.len();
        let r: f64 = self.rng.random();
        if r < 0.004 {
            let i = self.rng.random_range(0..n);
            if self.trace {
                eprintln!("{:>6} crash n{i}", self.now);
            }
            self.change(|s| s.nodes[i].state = None);
            self.nodes[i].last_epoch = None;
        } else if r < 0.008 {
            let i = self.rng.random_range(0..n);
            if self.nodes[i].state.is_none() {
                if self.trace {
                    eprintln!("{:>6} restart n{i}", self.now);
                }
                let (base, round) = (self.nodes[i].base.clone(), self.nodes[i].persisted_round);
                self.change(|s| s.nodes[i].state = Some(ClusterState::new(base, ClusterConfig::TEST, round)));
            }
        } else if r < 0.011 {
            let groups = self.rng.random_range(1..=3);
            let split: Vec<usize> = (0..n).map(|_| self.rng.random_range(0..groups)).collect();
            if self.trace {
                eprintln!("{:>6} partition {split:?}", self.now);
            }
            self.change(|s| s.group = split);
        } else if r < 0.013 {
            let i = self.rng.random_range(0..n);
            let model = if self.rng.random_bool(0.5) { footprint("small", 8) } else { footprint("large", 40) };
            if let Some(state) = self.nodes[i].state.as_mut() {
                if self.trace {
                    eprintln!("{:>6} n{i} wants {}", self.now, model.model);
                }
                let now = self.now;
                let out = state.want(model, now);
                self.outputs(i, out);
            }
        }
    }

    fn deliver(&mut self, to: usize, input: Input) {
        let now = self.now;
        if let Some(state) = self.nodes[to].state.as_mut() {
            let out = state.handle(input, now);
            self.outputs(to, out);
        }
    }

    fn outputs(&mut self, from: usize, out: Vec<Output>) {
        for o in out {
            if let Output::Publish(plan) = o {
                self.check_published(from, &plan);
            }
        }
    }

    fn check_published(&mut self, from: usize, plan: &Plan) {
        let state = self.nodes[from].state.as_ref().expect("a live node published");
        assert_eq!(plan.epoch.leader, format!("n{from}"), "a plan names its publisher as leader");
        for m in &plan.members {
            assert!(state.alive().contains(m), "plan {:?} includes {m}, not alive in the leader's view", plan.epoch);
        }
        for (model, placement) in &plan.placements {
            let Ok(p) = placement else { continue };
            let mut next = 0;
            for s in &p.stages {
                assert!(plan.members.contains(&s.node), "{model}: stage on non-member {}", s.node);
                assert!(s.start == next && s.end > s.start, "{model}: stages must tile the layers: {p:?}");
                next = s.end;
            }
        }
        if let Some(previous) = self.published.insert(plan.epoch.clone(), plan.clone()) {
            assert_eq!(&previous, plan, "two different plans under epoch {:?}", plan.epoch);
        }
        if self.trace {
            eprintln!("{:>6} n{from} publishes {:?} members {:?}", self.now, plan.epoch, plan.members);
        }
    }

    fn step(&mut self, churn: bool) {
        self.now += STEP_MS;
        if churn {
            self.churn();
        }
        // Adverts: each live node broadcasts to the nodes it is linked with.
        for i in 0..self.nodes.len() {
            if self.nodes[i].state.is_none() || self.now < self.nodes[i].next_advert {
                continue;
            }
            self.nodes[i].next_advert = self.now + ADVERT_EVERY_MS + self.rng.random_range(0..200);
            let advert = self.nodes[i].state.as_ref().expect("checked above").advert();
            for j in 0..self.nodes.len() {
                if self.linked(i, j) && !(churn && self.rng.random_bool(self.loss)) {
                    let at = self.now + self.rng.random_range(0..400);
                    self.queue.push(Message { at, to: j, input: Input::Advert(advert.clone()), unless_linked_with: None });
                }
            }
        }
        let now = self.now;
        let (due, later): (Vec<Message>, Vec<Message>) = std::mem::take(&mut self.queue).into_iter().partition(|m| m.at <= now);
        self.queue = later;
        for m in due {
            if m.unless_linked_with.is_some_and(|peer| self.linked(m.to, peer)) {
                continue;
            }
            self.deliver(m.to, m.input);
        }
        for i in 0..self.nodes.len() {
            self.deliver(i, Input::Tick);
        }
        self.check_states();
    }

    fn check_states(&mut self) {
        for (i, node) in self.nodes.iter_mut().enumerate() {
            let Some(state) = node.state.as_ref() else { continue };
            node.persisted_round = state.highest_round();
            if let Some(plan) = state.plan() {
                if let Some(last) = &node.last_epoch {
                    assert!(&plan.epoch >= last, "n{i}'s plan went back from {last:?} to {:?}", plan.epoch);
                }
                node.last_epoch = Some(plan.epoch.clone());
                for (model, placement) in &plan.placements {
                    let mine = placement.as_ref().ok().and_then(|p| p.stages.iter().find(|s| s.node == format!("n{i}")));
                    assert_eq!(state.my_stage(model), mine, "n{i} claims a stage that is not its own");
                }
            }
        }
    }

    /// After churn: heal, then every live node must agree within `SETTLE_MS`.
    fn settle(&mut self) {
        self.change(|s| s.group = vec![0; s.nodes.len()]);
        let deadline = self.now + SETTLE_MS;
        loop {
            self.step(false);
            if self.agreed() {
                return;
            }
            if self.now >= deadline {
                let views: Vec<String> = self
                    .nodes
                    .iter()
                    .enumerate()
                    .filter_map(|(i, n)| n.state.as_ref().map(|s| format!("n{i}: leader {} alive {:?} plan {:?}", s.leader(), s.alive(), s.plan().map(|p| (&p.epoch, &p.members, p.placements.keys().collect::<Vec<_>>())))))
                    .collect();
                panic!("no agreement {SETTLE_MS} ms after the churn stopped:\n{}", views.join("\n"));
            }
        }
    }

    fn agreed(&self) -> bool {
        let live: Vec<(usize, &ClusterState)> = self.nodes.iter().enumerate().filter_map(|(i, n)| n.state.as_ref().map(|s| (i, s))).collect();
        let Some((_, first)) = live.first() else { return true };
        let ids: Vec<String> = live.iter().map(|(i, _)| format!("n{i}")).collect();
        let expected_leader = live.iter().map(|(i, _)| &self.nodes[*i].base).max_by(|a, b| a.priority.cmp(&b.priority).then_with(|| b.id.cmp(&a.id))).map(|a| a.id.clone());
        let same = live.iter().all(|(_, s)| s.leader() == first.leader() && s.plan().map(|p| &p.epoch) == first.plan().map(|p| &p.epoch));
        let Some(plan) = first.plan() else { return same && live.len() == 1 };
        // The plan covers exactly the live nodes, with the placements they would compute.
        let adverts: Vec<NodeAdvert> = live.iter().map(|(_, s)| s.advert()).collect();
        let placements_ok = plan.placements == place_all(&adverts.iter().collect::<Vec<_>>(), shoal::cluster::cost::LinkCost::LAN);
        same && Some(first.leader().clone()) == expected_leader && plan.members == ids && placements_ok
    }
}

fn run_seed(seed: u64, trace: bool) {
    let mut sim = Sim::new(seed, trace);
    while sim.now < CHURN_MS {
        sim.step(true);
    }
    // Bring every crashed node back so that convergence covers all of them.
    for i in 0..sim.nodes.len() {
        if sim.nodes[i].state.is_none() {
            let (base, round) = (sim.nodes[i].base.clone(), sim.nodes[i].persisted_round);
            sim.change(|s| s.nodes[i].state = Some(ClusterState::new(base, ClusterConfig::TEST, round)));
        }
    }
    sim.settle();
}

#[test]
fn a_thousand_seeds_keep_the_invariants_and_converge() {
    if let Ok(seed) = std::env::var("SHOAL_SIM_SEED") {
        run_seed(seed.parse().expect("SHOAL_SIM_SEED is a number"), true);
        return;
    }
    let seeds: u64 = std::env::var("SHOAL_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(1_000);
    for seed in 0..seeds {
        if let Err(panic) = std::panic::catch_unwind(|| run_seed(seed, false)) {
            eprintln!("seed {seed} failed; replay with SHOAL_SIM_SEED={seed}");
            std::panic::resume_unwind(panic);
        }
    }
}

/// The leader's auto placement uses the link it measured: on a slow link (10 ms) a 7B-sized model
/// stays on one node, on a fast one (20 µs) it becomes a tensor group of two; RTT jitter within 2×
/// changes nothing (no plan churn).
#[test]
fn auto_placement_follows_the_measured_link_and_ignores_jitter() {
    use shoal::cluster::{Strategy, TpUnits};
    let node = |id: &str, wants: Vec<ModelFootprint>| NodeAdvert {
        id: id.into(),
        name: id.into(),
        priority: 0,
        memory_total: 64 << 30,
        memory_offered: 64 << 30,
        mem_bandwidth: 20e9,
        flops: 1e12,
        backend: "cpu".into(),
        gpu: None,
        decode_bandwidth: 0.0,
        addresses: vec![],
        models: vec!["7b".into()],
        wants,
        plan: None,
    };
    let seven_b = ModelFootprint { model: "7b".into(), layers: 28, bytes_per_layer: 233 << 20, kv_bytes_per_layer: 0, dense_half: false, quantized: false, embedding_bytes: 545 << 20, head_bytes: 545 << 20, tp: TpUnits { heads: 4, ffn: 8 }, strategy: None };
    let mut a = ClusterState::new(node("a", vec![]), ClusterConfig::TEST, 0);
    let mut now = 1_000;
    a.handle(Input::Connected("b".into()), now);
    a.handle(Input::Advert(node("b", vec![])), now);
    a.set_wants(vec![seven_b], now);
    let strategy = |s: &ClusterState| s.plan().and_then(|p| p.placements["7b"].as_ref().ok()).map(|p| p.strategy);
    let published = |out: &[Output]| out.iter().any(|o| matches!(o, Output::Publish(_)));
    now += 100;
    a.handle(Input::LinkRtt(10e-3), now);
    assert_eq!(strategy(&a), Some(Strategy::Single), "10 ms between the nodes: one node");
    now += 100;
    let out = a.handle(Input::LinkRtt(20e-6), now);
    assert!(published(&out));
    assert_eq!(strategy(&a), Some(Strategy::Tensor), "20 µs: a tensor group");
    now += 100;
    assert!(!published(&a.handle(Input::LinkRtt(35e-6), now)), "jitter within 2× re-plans nothing");
    assert_eq!(strategy(&a), Some(Strategy::Tensor));
}
