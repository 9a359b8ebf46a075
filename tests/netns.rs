//! Real `shoal serve` processes in Linux network namespaces on one bridge (made here with
//! `scripts/netns.sh`, as root), finding each other by mDNS alone (no `--peer`): they agree on a
//! leader, split Gemma 3 270M across the nodes whose `--memory-limit` lets them hold layers,
//! and serve a streamed completion sent to a node that holds none, equal to one node's output.
//! A middle stage SIGKILLed mid-stream: the client sees the continuation (or an error) within
//! 2 s, a new plan comes within 5 s and the next request succeeds. A node with another
//! `--cluster-key` never appears in anyone's membership. Every node lives in a namespace the
//! test made, so nothing multicasts on the host's own network.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::util::{real_model, repo_root, shoal_bin};

/// Gemma's registry GGUF ships no chat template: plain completions.
const PROMPT: &str = "Once upon a time, a little fish";

/// Namespaces `<prefix>-1..n` on a bridge, removed on drop (with every process inside).
struct Namespaces {
    prefix: String,
}

impl Namespaces {
    fn up(n: usize) -> Namespaces {
        let prefix = format!("sh{}", std::process::id() % 100_000);
        let status = Command::new(repo_root().join("scripts/netns.sh")).args(["up", &n.to_string(), &prefix]).stdout(Stdio::null()).status().expect("scripts/netns.sh runs");
        assert!(status.success(), "scripts/netns.sh up failed: this test needs root and iproute2");
        Namespaces { prefix }
    }

    fn name(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        let _ = Command::new(repo_root().join("scripts/netns.sh")).args(["down", &self.prefix]).status();
    }
}

/// One `shoal serve` inside namespace `i` (address 10.77.0.i), its stderr collected.
struct Node {
    ns: String,
    ip: String,
    child: Child,
    log: Arc<Mutex<String>>,
    _data: tempfile::TempDir,
}

impl Node {
    fn start(nets: &Namespaces, i: usize, extra: &[&str]) -> Node {
        let data = tempfile::tempdir().unwrap();
        let ns = nets.name(i);
        let mut child = Command::new("ip")
            .args(["netns", "exec", &ns])
            .arg(shoal_bin())
            .args(["serve", "--host", "0.0.0.0", "--data-dir"])
            .arg(data.path())
            // These tests are about pipelines; `auto` may pick a tensor group when measured
            // figures (noisy on a loaded machine) predict one faster.
            .args(["--strategy", "pipeline"])
            .args(extra)
            .env("SHOAL_LOG", "warn,shoal::cluster=info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("ip netns exec shoal starts");
        let log = Arc::new(Mutex::new(String::new()));
        let (stderr, sink) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Node { ns, ip: format!("10.77.0.{i}"), child, log, _data: data }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits for the start-up lines; returns the node id.
    fn wait_started(&mut self) -> String {
        let started = Instant::now();
        loop {
            let log = self.log();
            if log.contains("web UI and API:") {
                return log.lines().find_map(|l| l.strip_prefix("shoal node ")).expect("the node prints its id").to_string();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("node in {} exited at start ({status}): {log}", self.ns);
            }
            assert!(started.elapsed() < Duration::from_secs(60), "node in {} did not start within 60 s: {log}", self.ns);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `curl` inside our namespace against our API.
    fn curl(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, "curl", "-sS", "--max-time", "120"]).args(args);
        c
    }

    fn get(&self, path: &str) -> Option<Value> {
        let out = self.curl(&["--max-time", "5", &format!("http://{}:52415{path}", self.ip)]).output().ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    fn cluster(&self) -> Value {
        self.get("/v1/cluster").unwrap_or(Value::Null)
    }

    fn complete(&self, max_tokens: usize) -> (u16, Value) {
        let body = json!({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).to_string();
        let out = self
            .curl(&["-H", "content-type: application/json", "-w", "\n%{http_code}", "-d", &body, &format!("http://{}:52415/v1/completions", self.ip)])
            .output()
            .expect("curl runs");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or((&text, "0"));
        (code.trim().parse().unwrap_or(0), serde_json::from_str(body).unwrap_or(Value::Null))
    }

    /// A streamed completion; its SSE `data:` lines arrive on the channel with their arrival time.
    fn complete_stream(&self, max_tokens: usize) -> (Child, mpsc::Receiver<(Instant, String)>) {
        self.stream("/v1/completions", json!({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": true}))
    }

    /// POSTs `body` to `path` with `curl -N`; each SSE `data:` payload (or any other line as it
    /// is, e.g. an error body that is not SSE) arrives on the channel with its arrival time.
    fn stream(&self, path: &str, body: Value) -> (Child, mpsc::Receiver<(Instant, String)>) {
        let url = format!("http://{}:52415{path}", self.ip);
        let mut child = self.curl(&["-N", "-H", "content-type: application/json", "-d", &body.to_string(), &url]).stdout(Stdio::piped()).spawn().expect("curl runs");
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok).filter(|l| !l.is_empty()) {
                let data = line.strip_prefix("data: ").unwrap_or(&line).to_string();
                if tx.send((Instant::now(), data)).is_err() {
                    break;
                }
            }
        });
        (child, rx)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_until<T>(deadline: Duration, mut check: impl FnMut() -> Option<T>) -> Option<(T, Duration)> {
    let started = Instant::now();
    while started.elapsed() < deadline {
        if let Some(v) = check() {
            return Some((v, started.elapsed()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// The greedy answer of one node without any network (`shoal run`).
fn single_node_answer(model: &str, max_tokens: usize) -> String {
    single_node_run(&["run", "--model", model, "--prompt", PROMPT, "--max-tokens", &max_tokens.to_string()])
}

fn single_node_run(args: &[&str]) -> String {
    let out = crate::util::run_shoal(args, Duration::from_secs(180));
    assert!(out.status.success(), "shoal run: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

/// (leader, epoch, plan stages of the model) as node `n` reports them.
fn view(c: &Value) -> (String, u64, Value) {
    let stages = c["plans"].as_array().and_then(|p| p.first()).map(|p| p["stages"].clone()).unwrap_or(Value::Null);
    (c["leader"].as_str().unwrap_or("").to_string(), c["epoch"].as_u64().unwrap_or(0), stages)
}

fn member_ids(c: &Value) -> Vec<String> {
    let mut ids: Vec<String> = c["nodes"].as_array().map(|n| n.iter().filter_map(|n| n["id"].as_str().map(String::from)).collect()).unwrap_or_default();
    ids.sort();
    ids
}

#[test]
fn mdns_swarm_in_namespaces_splits_a_model_survives_a_killed_stage_and_keeps_strangers_out() {
    let gemma = real_model("gemma3-270m").join("model.gguf").display().to_string();
    let reference = single_node_answer(&gemma, 24);
    let long_reference = single_node_answer(&gemma, 48);
    let nets = Namespaces::up(5);
    let key_dir = tempfile::tempdir().unwrap();
    let (key, stranger_key) = (key_dir.path().join("cluster.key"), key_dir.path().join("other.key"));
    for path in [&key, &stranger_key] {
        std::fs::write(path, shoal::net::new_cluster_key_file()).unwrap();
    }
    let key_arg = key.display().to_string();

    // Node 1 may hold no layer; nodes 2 and 3 only half the model each (it needs ~430 MB, and
    // 151 MB of KV cache reserved for 4,096 positions).
    let common = ["--model", gemma.as_str(), "--cluster-key", key_arg.as_str()];
    let limits = ["1MB", "300MB", "300MB"];
    let mut nodes: Vec<Node> = limits.iter().enumerate().map(|(i, l)| Node::start(&nets, i + 1, &[&common[..], &["--memory-limit", l]].concat())).collect();
    let ids: Vec<String> = nodes.iter_mut().map(Node::wait_started).collect();
    let mut sorted = ids.clone();
    sorted.sort();

    // 1. Discovery by mDNS and one leader, agreed by all three.
    let (_, joined) = wait_until(Duration::from_secs(3), || {
        let views: Vec<Value> = nodes.iter().map(Node::cluster).collect();
        let leaders: Vec<&str> = views.iter().map(|c| c["leader"].as_str().unwrap_or("")).collect();
        (views.iter().all(|c| member_ids(c) == sorted) && leaders.iter().all(|l| *l == leaders[0] && !l.is_empty())).then_some(())
    })
    .unwrap_or_else(|| panic!("3 nodes agree within 3 s; views: {:?}", nodes.iter().map(Node::cluster).collect::<Vec<_>>()));
    eprintln!("netns: 3 nodes discovered each other and agreed on the leader {joined:?} after the last started");

    // 2. A chat sent to the node with no layers equals one node's answer.
    let t = Instant::now();
    let (status, answer) = nodes[0].complete(24);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["text"].as_str(), Some(reference.as_str()), "pipeline answer vs one node");
    eprintln!("netns: 2-stage chat of 24 tokens answered in {:?} (incl. placing and loading)", t.elapsed());
    let views: Vec<(String, u64, Value)> = nodes.iter().map(|n| view(&n.cluster())).collect();
    assert!(views.iter().all(|v| *v == views[0]), "every node shows the same leader, epoch and plan: {views:?}");
    let stages = views[0].2.as_array().cloned().unwrap_or_default();
    assert_eq!(stages.len(), 2, "a pipeline over nodes 2 and 3: {stages:?}");
    assert!(stages.iter().all(|s| s["node"] != ids[0].as_str()), "the 1 MB node holds no layer: {stages:?}");

    // 3. A node with another cluster key is discovered by mDNS but never joins.
    let stranger_arg = stranger_key.display().to_string();
    let mut stranger = Node::start(&nets, 5, &["--model", &gemma, "--cluster-key", &stranger_arg, "--memory-limit", "2GB"]);
    let stranger_id = stranger.wait_started();
    // A fourth node with the right key makes room for losing a stage.
    nodes.push(Node::start(&nets, 4, &[&common[..], &["--memory-limit", "300MB"]].concat()));
    let fourth = nodes[3].wait_started();
    let mut four = sorted.clone();
    four.push(fourth);
    four.sort();
    wait_until(Duration::from_secs(5), || nodes.iter().all(|n| member_ids(&n.cluster()) == four).then_some(())).expect("the fourth node joins within 5 s");
    for n in &nodes {
        assert!(!member_ids(&n.cluster()).contains(&stranger_id), "a node with another cluster key joined");
    }
    assert_eq!(member_ids(&stranger.cluster()), vec![stranger_id.clone()], "the stranger sees only itself");

    // 4. Kill the middle stage of a 3-stage plan mid-stream.
    let (plan, _) = wait_until(Duration::from_secs(10), || {
        let (_, _, stages) = view(&nodes[0].cluster());
        stages.as_array().filter(|s| s.len() == 3).cloned()
    })
    .expect("a 3-stage plan over the three 300 MB nodes");
    let middle = plan[1]["node"].as_str().unwrap().to_string();
    let victim = ids.iter().chain(std::iter::once(&four.iter().find(|id| !ids.contains(id)).unwrap().clone())).position(|id| *id == middle).unwrap();
    let victim = if victim < 3 { victim } else { 3 };
    let epoch_before = view(&nodes[0].cluster()).1;
    let (mut curl, events) = nodes[0].complete_stream(48);
    let mut content = String::new();
    let mut chunks = 0;
    let mut killed_at = None;
    let mut gap_after_kill = None;
    let mut error = None;
    loop {
        let (at, data) = events.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|e| panic!("the stream ended without [DONE] or stalled for 60 s ({e}); so far: {content:?}; entry log: {}", nodes[0].log()));
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&data).unwrap_or_else(|_| panic!("not an SSE event: {data}"));
        assert!(killed_at.is_some() || v.get("error").is_none(), "an error before the kill: {v}");
        if let (Some(k), None) = (killed_at, gap_after_kill) {
            gap_after_kill = Some(at.duration_since(k));
        }
        if v.get("error").is_some() {
            error = Some(v);
            continue;
        }
        if let Some(piece) = v["choices"][0]["text"].as_str() {
            content.push_str(piece);
            chunks += 1;
            if chunks == 6 && killed_at.is_none() {
                nodes[victim].child.kill().unwrap();
                killed_at = Some(Instant::now());
            }
        }
    }
    let _ = curl.wait();
    let gap = gap_after_kill.expect("the stream went on after the kill");
    assert!(gap <= Duration::from_secs(2), "continuation or error within 2 s of the kill, got {gap:?}");
    match &error {
        None => assert_eq!(content, long_reference, "the continuation equals one node's answer"),
        Some(e) => eprintln!("netns: the stream ended with an error after the kill: {e}"),
    }
    let (_, replanned) = wait_until(Duration::from_secs(5), || {
        let (_, epoch, stages) = view(&nodes[0].cluster());
        (epoch > epoch_before && stages.as_array().is_some_and(|s| !s.is_empty() && s.iter().all(|s| s["node"] != middle.as_str()))).then_some(())
    })
    .expect("a new plan without the killed node within 5 s");
    eprintln!("netns: killed the middle stage after 6 chunks: next event after {gap:?}, error: {}, new plan after {replanned:?}", error.is_some());
    let (status, answer) = nodes[0].complete(24);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["choices"][0]["text"].as_str(), Some(reference.as_str()), "the next request succeeds, equal to one node");
    drop(stranger);
}

/// Qwen2.5-Coder-1.5B (1.1 GB) over two 800 MB nodes, found by mDNS, as a streamed chat sent to
/// a third node that holds no layer: the text equals one node's `shoal run --chat`.
#[test]
fn mdns_swarm_in_namespaces_streams_a_qwen_chat_from_a_node_without_layers() {
    const QUESTION: &str = "Write a Python function that reverses a string.";
    let qwen = real_model("qwen2.5-coder-1.5b").join("model.gguf").display().to_string();
    let reference = single_node_run(&["run", "--model", &qwen, "--chat", "--prompt", QUESTION, "--max-tokens", "12"]);
    let nets = Namespaces::up(3);
    let mut nodes: Vec<Node> = ["1MB", "800MB", "800MB"].iter().enumerate().map(|(i, l)| Node::start(&nets, i + 1, &["--model", &qwen, "--memory-limit", l])).collect();
    let ids: Vec<String> = nodes.iter_mut().map(Node::wait_started).collect();
    let (mut curl, events) = nodes[0].stream("/v1/chat/completions", json!({"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0, "stream": true}));
    let mut content = String::new();
    loop {
        let (_, data) = events.recv_timeout(Duration::from_secs(150)).unwrap_or_else(|e| panic!("the stream ended without [DONE] ({e}); so far {content:?}; entry log: {}", nodes[0].log()));
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(&data).unwrap_or_else(|_| panic!("not an SSE event: {data}"));
        assert!(v.get("error").is_none(), "{v}");
        content.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    let _ = curl.wait();
    assert_eq!(content, reference, "the streamed pipeline chat equals one node's");
    let (_, _, stages) = view(&nodes[0].cluster());
    let stages = stages.as_array().cloned().unwrap_or_default();
    assert_eq!(stages.len(), 2, "{stages:?}");
    assert!(stages.iter().all(|s| s["node"] != ids[0].as_str()), "the 1 MB node holds no layer: {stages:?}");
}
