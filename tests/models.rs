//! Models: pulls from a local server that speaks the Hugging Face hub's API shape and serves
//! real files (`models/hub_server.rs`), and peer copies between real libp2p swarms on
//! 127.0.0.1 (static peers, mDNS off). Covers resume after a killed `shoal models pull`,
//! corrupt downloads and corrupt files fetched again, 503 retries, 401/404 messages, a stage
//! that fetches only its shards, a second node that copies from the first with the hub seeing
//! zero requests, and a peer that serves wrong bytes. Every wait has a deadline.

pub mod hub_server;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};
use shoal::models::hub::{HubClient, HubConfig};
use shoal::models::peer::PeerSource;
use shoal::models::store::{read_manifest, sha256_file};
use shoal::models::{self, ModelsError, Progress, PullRequest, Sources, Store};
use shoal::net::{self, NetConfig, NetHandle, NetTimers};
use shoal_proto::v1::{self, file_request, file_response};
use tokio_util::sync::CancellationToken;

use crate::util::{fixture, real_model, shoal_bin};
use hub_server::{FakeHub, TOKEN};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn hub_client(hub: &FakeHub, token: Option<&str>) -> HubClient {
    let mut config = HubConfig::from_env();
    config.endpoint = hub.url();
    config.token = token.map(str::to_string);
    config.backoff = Duration::from_millis(20);
    config.max_backoff = Duration::from_millis(200);
    config.read_timeout = Duration::from_secs(10);
    HubClient::new(config).unwrap()
}

fn store(dir: &Path) -> Store {
    let models = dir.join("models");
    std::fs::create_dir_all(&models).unwrap();
    Store::with_roots(models, vec![], vec![])
}

fn hub_only(hub: &FakeHub) -> Sources {
    Sources { hub: Some(hub_client(hub, None)), peers: None }
}

fn pull(store: &Store, req: &PullRequest, sources: &Sources) -> Result<models::PullOutcome, ModelsError> {
    runtime().block_on(async {
        let (progress, cancel) = (Progress::default(), CancellationToken::new());
        let run = models::pull(store, req, sources, &progress, &cancel);
        tokio::time::timeout(Duration::from_secs(60), run).await.expect("a pull finishes within 60 s")
    })
}

/// `shoal <args>` with the hub at `hub` and a clean Hugging Face environment, killed after 60 s.
fn shoal(args: &[&str], hub: &FakeHub, data: &Path, token: Option<&str>) -> Output {
    let mut cmd = Command::new(shoal_bin());
    cmd.args(args).arg("--data-dir").arg(data).env("HF_ENDPOINT", hub.url()).env("HF_HOME", data.join("hf-home"));
    cmd.env_remove("HF_TOKEN").env_remove("HUGGING_FACE_HUB_TOKEN").env_remove("SHOAL_MODELS").env("SHOAL_MODEL_CACHE", data.join("no-cache"));
    if let Some(t) = token {
        cmd.env("HF_TOKEN", t);
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("shoal starts");
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("shoal {args:?} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn wait_until(what: &str, deadline: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_interrupted_pull_resumes_and_fetches_only_what_was_missing() {
    let gguf = real_model("gemma3-270m").join("model.gguf");
    let size = std::fs::metadata(&gguf).unwrap().len();
    let hub = FakeHub::start();
    // The catalogue's gemma3-270m lives in this repo under this name.
    let remote = "gemma-3-270m-Q4_K_M.gguf";
    hub.add_repo("unsloth/gemma-3-270m-GGUF", false, &[(remote, &gguf)]);
    hub.knobs(|k| k.rate = Some(50_000_000));
    let data = tempfile::tempdir().unwrap();

    // First pull: killed (SIGKILL, no clean-up) once about a quarter has crossed the wire.
    let mut child = Command::new(shoal_bin())
        .args(["models", "pull", "gemma3-270m", "--data-dir"])
        .arg(data.path())
        .env("HF_ENDPOINT", hub.url())
        .env("HF_HOME", data.path().join("hf-home"))
        .env_remove("HF_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until("a quarter of the file to be sent", Duration::from_secs(30), || hub.file_bytes(remote) >= size / 4);
    child.kill().unwrap();
    child.wait().unwrap();
    let incomplete = data.path().join("models/gemma3-270m/.shoal/incomplete");
    let parts: Vec<PathBuf> = std::fs::read_dir(&incomplete).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(parts.len(), 1, "one partial file: {parts:?}");
    let have = std::fs::metadata(&parts[0]).unwrap().len();
    assert!(have > 0 && have < size, "a partial download of {have} of {size} bytes");
    assert!(!data.path().join("models/gemma3-270m/model.gguf").exists(), "nothing unverified is in place");

    // Second pull: resumes with a Range request and fetches exactly what was missing.
    hub.knobs(|k| k.rate = None);
    hub.reset_counters();
    let out = shoal(&["models", "pull", "gemma3-270m"], &hub, data.path(), None);
    assert!(out.status.success(), "{}", stderr(&out));
    let second = hub.file_bytes(remote);
    println!("first pull left {have} of {size} bytes; the second fetched {second} (missing: {})", size - have);
    assert_eq!(second, size - have, "the second pull fetched only the missing bytes");
    assert!(hub.log().iter().any(|l| l.contains(&format!("bytes={have}-"))), "a Range request from the partial length: {:?}", hub.log());
    let manifest = read_manifest(&data.path().join("models/gemma3-270m")).unwrap();
    let pinned = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
    assert_eq!(manifest.file("model.gguf").unwrap().sha256, pinned, "verified against the catalogue's pin");
    assert!(!incomplete.exists() || std::fs::read_dir(&incomplete).unwrap().next().is_none(), "no partial file is left");

    // Third pull: everything is in place and verified; no file bytes cross the wire.
    hub.reset_counters();
    let out = shoal(&["models", "pull", "gemma3-270m"], &hub, data.path(), None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(hub.bytes(), 0);
    let listed = shoal(&["models", "list"], &hub, data.path(), None);
    let listed = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.lines().any(|l| l.starts_with("gemma3-270m") && l.contains("gemma3") && l.contains("18")), "{listed}");
}

#[test]
fn corrupt_downloads_and_corrupt_files_are_fetched_again_and_503s_are_retried() {
    let hub = FakeHub::start();
    let files = hub.add_dir("test/tiny-qwen2", &fixture("qwen2"));
    let weights = files.iter().find(|f| f.name == "model.safetensors").unwrap().clone();
    let data = tempfile::tempdir().unwrap();
    let store = store(data.path());
    let req = PullRequest::new("test/tiny-qwen2");

    // The hub flips a byte in the first download, and answers the first two requests with 503.
    hub.knobs(|k| {
        k.corrupt_next.insert(weights.name.clone());
        k.fail_next = 2;
    });
    let outcome = pull(&store, &req, &hub_only(&hub)).unwrap();
    assert_eq!(outcome.model.id, "tiny-qwen2");
    assert_eq!(hub.file_bytes(&weights.name), 2 * weights.size, "the corrupt download was detected and fetched again");
    let local = outcome.dir.join("model.safetensors");
    assert_eq!(sha256_file(&local).unwrap(), weights.sha256);
    assert!(!outcome.dir.join("reference.json").exists(), "only the model's files are fetched");

    // A file corrupted on disk (same size) is found by its hash and fetched again; the others stay.
    let mut bytes = std::fs::read(&local).unwrap();
    bytes[1000] ^= 0x55;
    std::fs::write(&local, &bytes).unwrap();
    hub.reset_counters();
    let outcome = pull(&store, &req, &hub_only(&hub)).unwrap();
    assert_eq!(hub.file_bytes(&weights.name), weights.size);
    assert_eq!(hub.file_bytes("config.json"), 0, "intact files are not fetched again");
    assert_eq!(outcome.reused, std::fs::metadata(outcome.dir.join("config.json")).unwrap().len());
    assert_eq!(sha256_file(&local).unwrap(), weights.sha256);

    // A hub that keeps failing is given up on with the status in the message.
    hub.knobs(|k| k.fail_next = 100);
    let other = tempfile::tempdir().unwrap();
    let err = pull(&self::store(other.path()), &req, &hub_only(&hub)).unwrap_err();
    assert!(matches!(err, ModelsError::Http { status: 503, .. }), "{err}");
    hub.knobs(|k| k.fail_next = 0);
}

#[test]
fn gated_and_missing_models_get_clear_messages() {
    let hub = FakeHub::start();
    hub.add_repo("acme/gated-model", true, &[("config.json", &fixture("qwen2").join("config.json")), ("model.safetensors", &fixture("qwen2").join("model.safetensors"))]);
    let data = tempfile::tempdir().unwrap();

    let out = shoal(&["models", "pull", "acme/gated-model"], &hub, data.path(), None);
    assert!(!out.status.success());
    let msg = stderr(&out);
    assert!(msg.contains("401") && msg.contains("gated") && msg.contains("set HF_TOKEN"), "{msg}");

    let out = shoal(&["models", "pull", "acme/gated-model"], &hub, data.path(), Some("hf_wrong"));
    let msg = stderr(&out);
    assert!(!out.status.success() && msg.contains("HF_TOKEN is set but does not grant access"), "{msg}");

    let out = shoal(&["models", "pull", "acme/gated-model"], &hub, data.path(), Some(TOKEN));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "gated-model");

    let out = shoal(&["models", "pull", "acme/no-such-model"], &hub, data.path(), None);
    let msg = stderr(&out);
    assert!(!out.status.success() && msg.contains("acme/no-such-model") && msg.contains("not found on the hub"), "{msg}");

    let out = shoal(&["models", "pull", "acme/gated-model:q8_0"], &hub, data.path(), Some(TOKEN));
    let msg = stderr(&out);
    assert!(!out.status.success() && msg.contains("q8_0") && msg.contains("not found"), "{msg}");

    let out = shoal(&["models", "pull", "no-such-thing"], &hub, data.path(), None);
    let msg = stderr(&out);
    assert!(!out.status.success() && msg.contains("unknown model") && msg.contains("gemma3-270m"), "{msg}");

    // rm deletes what pull wrote; import brings a folder in under its own name.
    let out = shoal(&["models", "rm", "gated-model"], &hub, data.path(), None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!data.path().join("models/gated-model").exists());
    let out = shoal(&["models", "import", fixture("llama").to_str().unwrap()], &hub, data.path(), None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "llama");
    assert!(read_manifest(&data.path().join("models/llama")).unwrap().file("model-00002-of-00003.safetensors").is_some());
}

#[test]
fn a_stage_fetches_only_the_files_holding_its_layers() {
    let hub = FakeHub::start();
    hub.add_dir("test/tiny-llama", &fixture("llama"));
    let data = tempfile::tempdir().unwrap();
    let store = store(data.path());
    let shards = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"];

    // The first stage of four layers holds layer 0 and the embedding: the first shard only.
    let first = PullRequest { layers: Some((0, 1)), ..PullRequest::new("test/tiny-llama") };
    let outcome = pull(&store, &first, &hub_only(&hub)).unwrap();
    let fetched: Vec<&str> = shards.iter().copied().filter(|s| hub.file_bytes(s) > 0).collect();
    assert_eq!(fetched, [shards[0]], "log: {:?}", hub.log());
    assert!(hub.file_bytes("config.json") > 0 && hub.file_bytes("model.safetensors.index.json") > 0);
    assert_eq!(hub.file_bytes("reference.json"), 0);
    assert_eq!(read_manifest(&outcome.dir).unwrap().layers, Some(vec![(0, 1)]));
    // The stage loads from what it fetched.
    let source = shoal::engine::model::ModelSource::open(&outcome.dir).unwrap();
    source.load_shard(shoal::engine::shard::LayerRange { start: 0, end: 1 }, &candle_core::Device::Cpu).unwrap();

    // The last stage (layer 3, the final norm and the head) needs the second and third shards.
    hub.reset_counters();
    let last = PullRequest { layers: Some((3, 4)), ..PullRequest::new("test/tiny-llama") };
    let outcome = pull(&store, &last, &hub_only(&hub)).unwrap();
    let fetched: Vec<&str> = shards.iter().copied().filter(|s| hub.file_bytes(s) > 0).collect();
    assert_eq!(fetched, [shards[1], shards[2]]);
    assert_eq!(read_manifest(&outcome.dir).unwrap().layers, Some(vec![(0, 1), (3, 4)]));
    assert_eq!(read_manifest(&outcome.dir).unwrap().files.len(), 5, "the manifest keeps the first stage's files");
}

/// A real swarm on 127.0.0.1 with static peers and no mDNS.
struct Peer {
    net: NetHandle,
    addr: Multiaddr,
    cancel: CancellationToken,
}

impl Peer {
    async fn start(peers: Vec<Multiaddr>) -> Peer {
        let cancel = CancellationToken::new();
        let config = NetConfig { listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()], peers, cluster_key: None, mdns: false, timers: NetTimers::TEST };
        let (net, mut events) = net::spawn(Keypair::generate_ed25519(), config, cancel.child_token()).unwrap();
        // Nobody here answers control RPCs: drain the events so that the swarm never blocks.
        tokio::spawn(async move { while events.recv().await.is_some() {} });
        let addr = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if let Some(a) = net.listen_addrs().await.unwrap().into_iter().next() {
                    return a;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the swarm listens within 5 s");
        let addr = addr.with(libp2p::multiaddr::Protocol::P2p(net.local_peer_id()));
        Peer { net, addr, cancel }
    }

    fn id(&self) -> PeerId {
        self.net.local_peer_id()
    }

    async fn connected_to(&self, peers: &[PeerId]) {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let connected: Vec<PeerId> = self.net.connected_peers().await.unwrap().into_iter().map(|(p, _)| p).collect();
                if peers.iter().all(|p| connected.contains(p)) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("peers connect within 10 s");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A peer that lists a real model's true hashes but flips a byte in every chunk it serves.
async fn serve_lies(net: NetHandle, store: Arc<Store>, model: String) {
    let mut requests = net.serve_files(64).await.unwrap();
    let servable = store.servable(&model).unwrap();
    while let Some(r) = requests.recv().await {
        let body = match r.request.body {
            Some(file_request::Body::List(_)) => file_response::Body::List(v1::FileList {
                model: model.clone(),
                repo: String::new(),
                revision: String::new(),
                files: servable.manifest.files.iter().map(|f| v1::FileEntry { path: f.path.clone(), size: f.size, sha256: f.sha256.clone() }).collect(),
            }),
            Some(file_request::Body::Read(read)) => {
                let bytes = std::fs::read(servable.base.join(&read.path)).unwrap();
                let end = (read.offset + u64::from(read.length)).min(bytes.len() as u64) as usize;
                let mut data = bytes[read.offset as usize..end].to_vec();
                data[0] ^= 0x01;
                file_response::Body::Chunk(v1::FileChunk { offset: read.offset, data })
            }
            None => unreachable!("net checks that a request has a body"),
        };
        let _ = r.reply.send(v1::FileResponse { version: shoal_proto::WIRE_VERSION, body: Some(body) });
    }
}

/// A peer that lists a real model and then vanishes (its swarm stops) at the first read.
async fn serve_then_vanish(net: NetHandle, store: Arc<Store>, model: String, vanish: CancellationToken) {
    let mut requests = net.serve_files(64).await.unwrap();
    let servable = store.servable(&model).unwrap();
    while let Some(r) = requests.recv().await {
        match r.request.body {
            Some(file_request::Body::List(_)) => {
                let files = servable.manifest.files.iter().map(|f| v1::FileEntry { path: f.path.clone(), size: f.size, sha256: f.sha256.clone() }).collect();
                let list = v1::FileList { model: model.clone(), repo: String::new(), revision: String::new(), files };
                let _ = r.reply.send(v1::FileResponse { version: shoal_proto::WIRE_VERSION, body: Some(file_response::Body::List(list)) });
            }
            _ => {
                vanish.cancel();
                return;
            }
        }
    }
}

#[test]
fn a_second_node_copies_from_the_first_without_the_hub_and_a_lying_peer_is_detected() {
    let hub = FakeHub::start();
    let hub_files = hub.add_dir("test/tiny-llama", &fixture("llama"));
    let rt = runtime();
    let deadline = Duration::from_secs(60);
    rt.block_on(async {
        tokio::time::timeout(deadline, async {
            // Node A pulls from the hub and serves its store to peers.
            let dir_a = tempfile::tempdir().unwrap();
            let store_a = Arc::new(store(dir_a.path()));
            let req = PullRequest::new("test/tiny-llama");
            let progress = Progress::default();
            let cancel = CancellationToken::new();
            let a_outcome = models::pull(&store_a, &req, &hub_only(&hub), &progress, &cancel).await.unwrap();
            let a = Peer::start(vec![]).await;
            tokio::spawn(models::peer::serve(a.net.clone(), store_a.clone(), a.cancel.child_token()));
            // A liar that claims A's true hashes but corrupts what it sends.
            let liar = Peer::start(vec![]).await;
            tokio::spawn(serve_lies(liar.net.clone(), store_a.clone(), a_outcome.model.id.clone()));

            // Node B asks the liar first, then A; the hub is configured but must not be touched.
            let b = Peer::start(vec![liar.addr.clone(), a.addr.clone()]).await;
            b.connected_to(&[liar.id(), a.id()]).await;
            hub.reset_counters();
            let dir_b = tempfile::tempdir().unwrap();
            let store_b = store(dir_b.path());
            let mut peers = PeerSource::new(b.net.clone(), vec![liar.id(), a.id()]);
            peers.chunk = 64 << 10; // many chunks per file, several in flight
            let sources = Sources { hub: Some(hub_client(&hub, None)), peers: Some(peers) };
            let outcome = models::pull(&store_b, &req, &sources, &progress, &cancel).await.unwrap();
            assert_eq!(hub.requests(), 0, "the hub saw no request: {:?}", hub.log());
            assert_eq!(outcome.from_hub, 0);
            assert_eq!(outcome.peers_used, vec![a.id()], "only the honest peer's copies were kept");
            let total: u64 = outcome.files.iter().map(|f| f.size).sum();
            assert_eq!(outcome.from_peers, total);
            for f in &hub_files {
                if f.name == "reference.json" {
                    continue;
                }
                assert_eq!(sha256_file(&outcome.dir.join(&f.name)).unwrap(), f.sha256, "{} is the hub's file", f.name);
            }

            // Node C can reach only the liar: every file fails its hash and comes from the hub.
            let c = Peer::start(vec![liar.addr.clone()]).await;
            c.connected_to(&[liar.id()]).await;
            hub.reset_counters();
            let dir_c = tempfile::tempdir().unwrap();
            let store_c = store(dir_c.path());
            let sources = Sources { hub: Some(hub_client(&hub, None)), peers: Some(PeerSource::new(c.net.clone(), vec![liar.id()])) };
            let outcome = models::pull(&store_c, &req, &sources, &progress, &cancel).await.unwrap();
            assert_eq!(outcome.from_peers, 0);
            assert_eq!(outcome.from_hub, total);
            for f in &outcome.files {
                assert_eq!(sha256_file(&outcome.dir.join(&f.path)).unwrap(), f.sha256);
            }

            // Node E asks a peer that vanishes mid-copy, then A: the copy completes from A.
            let vanishing = Peer::start(vec![]).await;
            tokio::spawn(serve_then_vanish(vanishing.net.clone(), store_a.clone(), a_outcome.model.id.clone(), vanishing.cancel.clone()));
            let e = Peer::start(vec![vanishing.addr.clone(), a.addr.clone()]).await;
            e.connected_to(&[vanishing.id(), a.id()]).await;
            hub.reset_counters();
            let dir_e = tempfile::tempdir().unwrap();
            let sources = Sources { hub: Some(hub_client(&hub, None)), peers: Some(PeerSource::new(e.net.clone(), vec![vanishing.id(), a.id()])) };
            let outcome = models::pull(&store(dir_e.path()), &req, &sources, &progress, &cancel).await.unwrap();
            assert_eq!((outcome.from_peers, outcome.from_hub, hub.requests()), (total, 0, 0));
            assert_eq!(outcome.peers_used, vec![a.id()]);

            // With the liar only and no hub, the pull fails and says why.
            let dir_d = tempfile::tempdir().unwrap();
            let sources = Sources { hub: None, peers: Some(PeerSource::new(c.net.clone(), vec![liar.id()])) };
            let err = models::pull(&store(dir_d.path()), &req, &sources, &progress, &cancel).await.unwrap_err();
            assert!(matches!(&err, ModelsError::NoSource { reason, .. } if reason.contains("sha256")), "{err}");

            // The progress registry saw peer copies and hub downloads, and ended each.
            let seen = progress.snapshot();
            assert!(seen.iter().any(|t| t.phase == models::Phase::Done && t.bytes_done == total), "{seen:?}");
            assert!(seen.iter().any(|t| t.phase == models::Phase::Failed), "{seen:?}");
        })
        .await
        .expect("the peer-copy test finishes within 60 s");
    });
}

/// Reads the API port from `shoal serve`'s start-up line on stderr.
fn api_port(child: &mut std::process::Child) -> u16 {
    use std::io::BufRead;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("http://").nth(1) {
                let port = rest.trim_end_matches('/').rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
                if let Some(p) = port {
                    let _ = tx.send(p);
                }
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30)).expect("shoal serve prints its address within 30 s")
}

#[test]
fn a_pull_through_the_api_shows_its_progress_in_the_cluster_view() {
    let hub = FakeHub::start();
    let files = hub.add_dir("test/tiny-qwen2", &fixture("qwen2"));
    hub.add_repo("acme/gated-model", true, &[("config.json", &fixture("qwen2").join("config.json"))]);
    let total: u64 = files.iter().filter(|f| f.name != "reference.json").map(|f| f.size).sum();
    // Slow enough (a few seconds) that a poll sees the download half-way.
    hub.knobs(|k| k.rate = Some(400_000));
    let data = tempfile::tempdir().unwrap();
    let mut child = Command::new(shoal_bin())
        .args(["serve", "--host", "127.0.0.1", "--api-port", "0", "--data-dir"])
        .arg(data.path())
        .env("HF_ENDPOINT", hub.url())
        .env("HF_HOME", data.path().join("hf-home"))
        .env_remove("HF_TOKEN")
        .env_remove("SHOAL_MODELS")
        .env("SHOAL_MODEL_CACHE", data.path().join("no-cache"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let port = api_port(&mut child);
    let _child = Kill(child);
    let base = format!("http://127.0.0.1:{port}");
    runtime().block_on(async {
        let client = reqwest::Client::new();
        let post = |model: &str| client.post(format!("{base}/v1/models/pull")).body(format!(r#"{{"model": "{model}"}}"#)).send();
        let r = post("test/tiny-qwen2").await.unwrap();
        assert_eq!(r.status().as_u16(), 202);
        let r = post("acme/gated-model").await.unwrap();
        assert_eq!(r.status().as_u16(), 202);
        let bad = client.post(format!("{base}/v1/models/pull")).body(r#"{"model": 3}"#).send().await.unwrap();
        assert_eq!(bad.status().as_u16(), 400);
        let (mut half_way, mut done, mut failed) = (false, false, false);
        let start = Instant::now();
        while !(done && failed) {
            assert!(start.elapsed() < Duration::from_secs(30), "the pulls did not end within 30 s (half-way seen: {half_way})");
            let cluster: serde_json::Value = client.get(format!("{base}/v1/cluster")).send().await.unwrap().json().await.unwrap();
            for d in cluster["downloads"].as_array().expect("downloads is an array") {
                match (d["model"].as_str(), d["phase"].as_str()) {
                    (Some("tiny-qwen2"), Some("downloading")) => half_way |= d["fraction"].as_f64().is_some_and(|f| f > 0.0 && f < 1.0) && d["source"] == "hub",
                    (Some("tiny-qwen2"), Some("done")) => {
                        assert_eq!((d["bytes_done"].as_u64(), d["bytes_total"].as_u64(), d["fraction"].as_f64()), (Some(total), Some(total), Some(1.0)));
                        done = true;
                    }
                    (Some("gated-model"), Some("failed")) => {
                        assert!(d["error"].as_str().unwrap().contains("HF_TOKEN"), "{d}");
                        failed = true;
                    }
                    (_, Some("failed")) => panic!("unexpected failure: {d}"),
                    _ => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(half_way, "a poll saw the download part-way with its fraction");
        let models: serde_json::Value = client.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
        assert!(models["data"].as_array().unwrap().iter().any(|m| m["id"] == "tiny-qwen2"), "{models}");
        let catalogue: serde_json::Value = client.get(format!("{base}/v1/catalogue")).send().await.unwrap().json().await.unwrap();
        let gemma = catalogue["data"].as_array().unwrap().iter().find(|m| m["id"] == "gemma3-270m").expect("the catalogue lists gemma3-270m");
        assert_eq!((gemma["layers"].as_u64(), gemma["local"].as_bool(), gemma["variants"][0]["format"].as_str()), (Some(18), Some(false), Some("gguf")));
    });
}

#[test]
fn a_running_node_serves_its_models_to_a_pulling_process() {
    let hub = FakeHub::start();
    let data_a = tempfile::tempdir().unwrap();
    let data_b = tempfile::tempdir().unwrap();
    let out = shoal(&["models", "import", fixture("qwen2").to_str().unwrap()], &hub, data_a.path(), None);
    assert!(out.status.success(), "{}", stderr(&out));
    // Node A: a real `shoal serve` on loopback, discovery off.
    let mut child = Command::new(shoal_bin())
        .args(["serve", "--host", "127.0.0.1", "--api-port", "0", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-discovery", "--data-dir"])
        .arg(data_a.path())
        .env("SHOAL_MODEL_CACHE", data_a.path().join("no-cache"))
        .env_remove("SHOAL_MODELS")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr_pipe = child.stderr.take().unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Kill(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr_pipe).lines().map_while(Result::ok) {
            if let Some(addr) = line.strip_prefix("swarm listening on ") {
                let _ = tx.send(addr.trim().to_string());
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(30)).expect("shoal serve prints its swarm address within 30 s");
    // B pulls the imported model by its id from A; the hub is configured and must stay untouched.
    let out = shoal(&["models", "pull", "qwen2", "--peer", &addr], &hub, data_b.path(), None);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(hub.requests(), 0, "{:?}", hub.log());
    for f in ["config.json", "model.safetensors"] {
        assert_eq!(sha256_file(&data_b.path().join("models/qwen2").join(f)).unwrap(), sha256_file(&fixture("qwen2").join(f)).unwrap(), "{f}");
    }
    assert!(stderr(&out).contains("from 1 peer(s)"), "{}", stderr(&out));
}
