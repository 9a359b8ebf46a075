//! The swarm runtime over real libp2p swarms on 127.0.0.1 (static peers, no mDNS): nodes whose
//! memory limits force a split agree on one leader and one pipeline plan, and a generation sent
//! to a node that holds no layers equals the single-node output token for token. When a middle
//! stage dies mid-stream, the entry node re-plans, re-prefills and continues with the same tokens.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::Multiaddr;
use shoal::cluster::{ClusterConfig, NodeAdvert, Strategy};
use shoal::engine::generate::Prompt;
use shoal::engine::{LoadOptions, LoadedModel, SamplingParams};
use shoal::net::{NetConfig, NetTimers};
use shoal::swarm::{self, GenerateRequest, SwarmConfig, SwarmHandle, TokenEvent};
use tokio_util::sync::CancellationToken;

use crate::util::{generate_ids, real_model};

const MB: u64 = 1_000_000;
const MODEL: &str = "gemma3-270m";

struct TestNode {
    handle: SwarmHandle,
    addr: Multiaddr,
    cancel: CancellationToken,
    _dir: tempfile::TempDir,
}

async fn start_node(name: &str, memory_offered: u64, peers: Vec<Multiaddr>, model: &Path) -> TestNode {
    let key = Keypair::generate_ed25519();
    let id = key.public().to_peer_id();
    let cancel = CancellationToken::new();
    let config = NetConfig { listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()], peers, cluster_key: None, mdns: false, timers: NetTimers::TEST };
    let (net, events) = shoal::net::spawn(key, config, cancel.child_token()).expect("swarm starts");
    let addr = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(a) = net.listen_addrs().await.expect("listen addrs").into_iter().next() {
                return a;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("listening within 5 s");
    let dir = tempfile::tempdir().unwrap();
    let advert = NodeAdvert {
        id: id.to_string(),
        name: name.into(),
        priority: 0,
        memory_total: memory_offered,
        memory_offered,
        mem_bandwidth: 20e9,
        flops: 100e9,
        backend: "cpu".into(),
        gpu: None,
        decode_bandwidth: 0.0,
        addresses: vec![addr.to_string()],
        models: vec![MODEL.to_string()],
        wants: vec![],
        plan: None,
    };
    let config = SwarmConfig {
        data_dir: dir.path().to_path_buf(),
        advert,
        models: BTreeMap::from([(MODEL.to_string(), model.to_path_buf())]),
        cluster: ClusterConfig::TEST,
        advert_every: Duration::from_millis(500),
        hop_deadline: Duration::from_secs(10),
        device: shoal::engine::device::ComputeDevice::cpu(),
        strategy: None,
        dataplane_ip: "127.0.0.1".parse().unwrap(),
        dataplane_transports: None,
    };
    let handle = swarm::spawn(config, net, events, cancel.clone());
    TestNode { handle, addr, cancel, _dir: dir }
}

/// Three 300 MB stage nodes (the model needs ~430 MB with its tied head on the last stage, and
/// 151 MB of KV cache reserved for 4,096 positions)
/// and a 1 MB entry node that can hold no layer; every node dials every earlier one.
async fn start_swarm(model: &Path) -> Vec<TestNode> {
    let mut nodes: Vec<TestNode> = Vec::new();
    for (name, memory) in [("entry", MB), ("a", 300 * MB), ("b", 300 * MB), ("c", 300 * MB)] {
        let peers = nodes.iter().map(|n| n.addr.clone()).collect();
        nodes.push(start_node(name, memory, peers, model).await);
    }
    nodes
}

/// The prompt's ids and one node's greedy continuation of `n` tokens, from one load.
fn single_node_reference(path: &Path, n: usize) -> (Vec<u32>, Vec<u32>) {
    let model = LoadedModel::load(path, &LoadOptions::default()).expect("loads");
    let prompt = model.text.encode_prompt("Once upon a time").unwrap();
    let expected = generate_ids(&model, Prompt::Tokens(prompt.clone()), &SamplingParams::greedy(), n);
    (prompt, expected)
}

fn request(prompt: &[u32], n: usize) -> GenerateRequest {
    GenerateRequest { model: MODEL.into(), prompt: prompt.to_vec(), sampling: SamplingParams::greedy(), max_tokens: n, stop_ids: vec![], plan_wait: Duration::from_secs(20), failover_wait: Duration::from_secs(20) }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

async fn agreed_pipeline(nodes: &[TestNode]) -> swarm::ClusterSnapshot {
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let mut snaps = Vec::new();
            for n in nodes {
                snaps.push(n.handle.snapshot().await.expect("snapshot"));
            }
            let first = &snaps[0];
            let same = snaps.iter().all(|s| s.leader == first.leader && s.plan.as_ref().map(|p| &p.epoch) == first.plan.as_ref().map(|p| &p.epoch));
            let placed = first.plan.as_ref().and_then(|p| p.placements.get(MODEL)).is_some_and(|p| p.is_ok());
            if same && placed && first.members.len() == nodes.len() {
                return first.clone();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("all nodes agree on leader, epoch and a plan within 20 s")
}

#[test]
fn pipeline_across_three_nodes_equals_one_node() {
    let path = real_model(MODEL).join("model.gguf");
    let (prompt, expected) = single_node_reference(&path, 16);
    runtime().block_on(async {
        let nodes = start_swarm(&path).await;
        nodes[0].handle.serve_only(MODEL, path.clone(), None).await.expect("the entry node has the model file");
        let snap = agreed_pipeline(&nodes).await;
        let placement = snap.plan.as_ref().unwrap().placements[MODEL].clone().unwrap();
        assert_eq!(placement.strategy, Strategy::Pipeline);
        assert_eq!(placement.stages.len(), 3, "{placement:?}");
        let entry_id = snap.members.iter().find(|m| m.name == "entry").unwrap().id.clone();
        assert!(placement.stages.iter().all(|s| s.node != entry_id), "the 1 MB entry node holds no layer");

        let mut rx = nodes[0].handle.generate(request(&prompt, 16)).await.expect("starts");
        let mut got = Vec::new();
        let end = tokio::time::timeout(Duration::from_secs(120), async {
            while let Some(e) = rx.recv().await {
                match e {
                    TokenEvent::Token(t) => got.push(t),
                    other => return other,
                }
            }
            TokenEvent::Error("the stream ended without Done".into())
        })
        .await
        .expect("the generation ends within 120 s");
        assert_eq!(end, TokenEvent::Done(shoal::engine::FinishReason::Length));
        assert_eq!(got, expected, "the pipeline's greedy output differs from one node's");
        for n in &nodes {
            n.cancel.cancel();
        }
    });
}

#[test]
fn a_middle_stage_lost_mid_stream_is_replaced_and_the_stream_continues() {
    let path = real_model(MODEL).join("model.gguf");
    let (prompt, expected) = single_node_reference(&path, 24);
    runtime().block_on(async {
        let nodes = start_swarm(&path).await;
        nodes[0].handle.serve_only(MODEL, path.clone(), None).await.unwrap();
        let snap = agreed_pipeline(&nodes).await;
        let placement = snap.plan.as_ref().unwrap().placements[MODEL].clone().unwrap();
        let middle = &placement.stages[1].node;
        let mut rx = nodes[0].handle.generate(request(&prompt, 24)).await.unwrap();
        let mut got = Vec::new();
        let mut killed = false;
        let end = tokio::time::timeout(Duration::from_secs(180), async {
            while let Some(e) = rx.recv().await {
                match e {
                    TokenEvent::Token(t) => {
                        got.push(t);
                        if got.len() == 6 && !killed {
                            // Stop the middle stage's node entirely (swarm and network).
                            for n in &nodes {
                                if n.handle.snapshot().await.map(|s| &s.me == middle).unwrap_or(false) {
                                    n.cancel.cancel();
                                }
                            }
                            killed = true;
                        }
                    }
                    other => return other,
                }
            }
            TokenEvent::Error("the stream ended without Done".into())
        })
        .await
        .expect("the stream ends within 180 s");
        assert!(killed);
        assert_eq!(end, TokenEvent::Done(shoal::engine::FinishReason::Length), "got {got:?}");
        assert_eq!(got, expected, "the continued stream must equal one node's greedy output");
        for n in &nodes {
            n.cancel.cancel();
        }
    });
}
