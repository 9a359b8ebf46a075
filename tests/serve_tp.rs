//! Tensor parallelism in `shoal serve`: real processes on loopback (static peers, no mDNS)
//! pinned to `--strategy tensor` place a model as one group of two, set up their data plane
//! over the control plane (shared memory on this host), and serve a greedy completion equal to
//! the same split computed in this process (`engine::tp` over an in-process group: the same slices
//! and summation order); `/v1/cluster` shows the group and the cost model's prediction beside the
//! measurement. A pinned strategy the swarm cannot honour is a clear error, not a hang. With
//! only the libp2p stream offered (`--dataplane libp2p`), frames travel as control RPCs and the
//! text is the same. Four processes pinned to `--strategy hybrid` chain two groups of two.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "api/fixture.rs"]
#[allow(dead_code)]
mod fixture;

use fixture::{block_on, get, post, Node, GEMMA};
use shoal::engine::model::ModelSource;

use crate::tensor_parallel::run_tp;
use crate::util::real_model;

/// Gemma's greedy continuation of `prompt` from a tensor-parallel split of two computed in this
/// process: what a serve group of two (or a pipeline of such groups: stage boundaries carry f32
/// hidden states exactly) must produce token for token. One node's text is not the reference: the
/// slices sum partial products in another order, and Gemma's int8-quantized activations turn that
/// rounding into logit moves large enough to flip a near-tie (tensor_parallel's Gemma test), so
/// any kernel change could move the comparison onto one.
fn split_of_two_greedy_text(prompt: &str, steps: usize) -> String {
    let source = ModelSource::open(&real_model(GEMMA).join("model.gguf")).expect("gemma opens");
    let text = source.load_text().expect("text");
    let ids = text.encode_prompt(prompt).expect("encodes");
    let (_, tokens) = run_tp(&source, 2, &ids, steps).swap_remove(0);
    text.decode(&tokens).expect("decodes")
}

/// The node's swarm address with its peer id, from its start-up lines.
fn swarm_addr(node: &Node) -> String {
    let started = Instant::now();
    loop {
        if let Some(a) = node.stderr().lines().find_map(|l| l.strip_prefix("swarm listening on ").map(str::to_string)) {
            return a;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no swarm address; stderr:\n{}", node.stderr());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn complete(node: &Node, prompt: &str, n: usize) -> (u16, Value) {
    let body = json!({"model": GEMMA, "prompt": prompt, "max_tokens": n, "temperature": 0}).to_string();
    block_on(post(&node.url("/v1/completions"), &body))
}

/// `complete` on `entry` every 500 ms until it answers 200 (the swarm may still be placing and
/// loading the model), failing with every node's log after `limit`.
fn complete_once_placed(entry: &Node, others: &[&Node], prompt: &str, n: usize, limit: Duration) -> Value {
    let started = Instant::now();
    loop {
        let (status, got) = complete(entry, prompt, n);
        if status == 200 {
            return got;
        }
        if started.elapsed() > limit {
            let logs: Vec<String> = others.iter().map(|o| o.stderr()).collect();
            panic!("no completion in {limit:?}: {got}\nentry:\n{}\nothers:\n{}", entry.stderr(), logs.join("\n---\n"));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn a_pinned_tensor_group_of_two_serve_processes_equals_the_in_process_split() {
    // nextest runs each test in its own process: the nodes inherit this and log their links.
    std::env::set_var("SHOAL_LOG", "warn,shoal::dataplane=info");
    let prompt = "The capital of France is";
    let want = split_of_two_greedy_text(prompt, 16);

    // A single pinned-tensor node cannot place the model: a clear error, not a hang.
    let a = Node::start(&["serve", "--strategy", "tensor"]);
    let (status, err) = complete(&a, prompt, 4);
    assert_ne!(status, 200, "{err}");
    assert!(err["error"]["message"].as_str().unwrap_or("").contains("at least 2 nodes"), "{err}");

    let b = Node::start(&["serve", "--strategy", "tensor", "--peer", &swarm_addr(&a)]);
    // Until B has joined and the group has loaded, the plan may still be the old error.
    let got = complete_once_placed(&a, &[&b], prompt, 16, Duration::from_secs(120));
    assert_eq!(got["choices"][0]["text"], want.as_str(), "a tensor group of two gives the in-process split's greedy text");
    assert_eq!(got["usage"]["completion_tokens"], 16);

    let (_, cluster) = block_on(get(&a.url("/v1/cluster")));
    let plan = cluster["plans"].as_array().and_then(|p| p.iter().find(|p| p["model"] == GEMMA)).unwrap_or_else(|| panic!("no plan for {GEMMA}: {cluster}"));
    assert_eq!(plan["strategy"], "tensor", "{cluster}");
    assert!(plan["predicted_tok_s"].as_f64().is_some_and(|t| t > 0.0) && plan["measured_tok_s"].as_f64().is_some_and(|t| t > 0.0), "prediction beside measurement: {plan}");
    let stage = &plan["stages"][0];
    let mut members = vec![stage["node"].as_str().unwrap().to_string(), stage["group"][0].as_str().unwrap_or_default().to_string()];
    members.sort();
    let mut ids = vec![a.id.clone(), b.id.clone()];
    ids.sort();
    assert_eq!(members, ids, "both nodes are members of the group: {cluster}");
    // Both members set up shared memory (same host), fastest first.
    for node in [&a, &b] {
        let log = node.stderr();
        let formed = log.lines().find(|l| l.contains("group_formed")).unwrap_or_else(|| panic!("no group_formed event:\n{log}"));
        assert!(formed.contains("Shm"), "shared memory is the group's first transport on one host: {formed}");
    }
}

#[test]
fn a_tensor_group_whose_only_common_transport_is_the_libp2p_stream_still_equals_the_in_process_split() {
    std::env::set_var("SHOAL_LOG", "warn,shoal::dataplane=info");
    let prompt = "The capital of France is";
    let want = split_of_two_greedy_text(prompt, 16);

    let a = Node::start(&["serve", "--strategy", "tensor", "--dataplane", "libp2p"]);
    let b = Node::start(&["serve", "--strategy", "tensor", "--dataplane", "libp2p", "--peer", &swarm_addr(&a)]);
    let got = complete_once_placed(&a, &[&b], prompt, 16, Duration::from_secs(120));
    assert_eq!(got["choices"][0]["text"], want.as_str(), "frames over the control plane's stream give the in-process split's greedy text");
    for node in [&a, &b] {
        let log = node.stderr();
        let formed = log.lines().find(|l| l.contains("group_formed")).unwrap_or_else(|| panic!("no group_formed event:\n{log}"));
        assert!(formed.contains("Libp2p") && !formed.contains("Shm") && !formed.contains("Tcp"), "only the libp2p stream was offered: {formed}");
    }
}

#[test]
fn a_pinned_hybrid_plan_of_two_groups_of_two_equals_the_in_process_split() {
    // The nodes' plan, load and group events, in the failure message if it comes to that.
    std::env::set_var("SHOAL_LOG", "warn,shoal::cluster=info,shoal::dataplane=info");
    let prompt = "The capital of France is";
    let want = split_of_two_greedy_text(prompt, 12);

    // Members count only over direct connections: every node dials every earlier one.
    let a = Node::start(&["serve", "--strategy", "hybrid"]);
    let mut peers = vec![swarm_addr(&a)];
    let mut others: Vec<Node> = Vec::new();
    for _ in 0..3 {
        let mut args = vec!["serve", "--strategy", "hybrid"];
        for p in &peers {
            args.extend(["--peer", p.as_str()]);
        }
        let node = Node::start(&args);
        peers.push(swarm_addr(&node));
        others.push(node);
    }
    let got = complete_once_placed(&a, &others.iter().collect::<Vec<_>>(), prompt, 12, Duration::from_secs(150));
    assert_eq!(got["choices"][0]["text"], want.as_str(), "two tensor groups chained as a pipeline give the in-process split's greedy text");
    let (_, cluster) = block_on(get(&a.url("/v1/cluster")));
    let plan = cluster["plans"].as_array().and_then(|p| p.iter().find(|p| p["model"] == GEMMA)).unwrap_or_else(|| panic!("no plan: {cluster}"));
    assert_eq!(plan["strategy"], "hybrid", "{cluster}");
    let stages = plan["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{plan}");
    assert!(stages.iter().all(|s| s["group"].as_array().map(Vec::len) == Some(1)), "two groups of two: {plan}");
    assert_eq!(stages[0]["end"], stages[1]["start"], "{plan}");
}
