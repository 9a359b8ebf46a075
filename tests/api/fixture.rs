//! The API tests' fixture: a real `shoal serve` process on 127.0.0.1 with a kernel-chosen
//! port (read back from its start-up line), a temporary data dir, the fetch script's model
//! cache as its local models, and helpers for HTTP (reqwest), curl and the OpenAI SDK.
//! Every wait has a deadline; dropping a `Node` kills the process.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::{real_model, repo_root, shoal_bin};

pub const GEMMA: &str = "gemma3-270m";
pub const QWEN: &str = "qwen2.5-coder-1.5b";

pub fn gemma_path() -> String {
    real_model(GEMMA).join("model.gguf").to_string_lossy().into_owned()
}

pub struct Node {
    child: Child,
    pub port: u16,
    pub id: String,
    /// Everything the node wrote to stderr so far, filled by a reader thread.
    stderr: Arc<Mutex<String>>,
    _data: tempfile::TempDir,
}

impl Node {
    /// Starts `shoal <args> --host 127.0.0.1 --api-port 0 --no-discovery --listen <loopback> --data-dir <tmp>` and waits for its
    /// start-up lines (and, when `--model` is among `args`, for the model to be loaded).
    pub fn start(args: &[&str]) -> Node {
        let data = tempfile::tempdir().expect("a temp dir");
        // The fetch script's cache holds both real models: the node sees them as local models.
        let cache = real_model(GEMMA).parent().expect("the cache dir").to_path_buf();
        let mut child = Command::new(shoal_bin())
            .args(args)
            // Discovery off and the swarm on loopback: a test node never joins the host's network.
            .args(["--host", "127.0.0.1", "--api-port", "0", "--no-discovery", "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir"])
            .arg(data.path())
            .env("SHOAL_MODEL_CACHE", &cache)
            .env_remove("SHOAL_MODELS")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("shoal starts");
        let stderr = Arc::new(Mutex::new(String::new()));
        let pipe = child.stderr.take().expect("stderr is piped");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let mut node = Node { child, port: 0, id: String::new(), stderr, _data: data };
        let (id, port) = node.wait_for("the start-up lines", Duration::from_secs(30), |log| {
            let id = log.lines().find_map(|l| l.strip_prefix("shoal node "))?.to_string();
            let url = log.lines().find_map(|l| l.strip_prefix("web UI and API: http://127.0.0.1:"))?;
            Some((id, url.trim_end_matches('/').parse::<u16>().ok()?))
        });
        (node.id, node.port) = (id, port);
        if args.contains(&"--model") {
            node.wait_until_loaded();
        }
        node
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls `check` on the node's stderr until it yields, failing after `deadline`.
    fn wait_for<T>(&mut self, what: &str, deadline: Duration, check: impl Fn(&str) -> Option<T>) -> T {
        let started = Instant::now();
        loop {
            if let Some(found) = check(&self.stderr()) {
                return found;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("shoal exited ({status}) before {what}; stderr:\n{}", self.stderr());
            }
            assert!(started.elapsed() < deadline, "no {what} within {deadline:?}; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `/v1/cluster` shows a plan (a model is loaded).
    pub fn wait_until_loaded(&self) {
        let started = Instant::now();
        loop {
            // Loaded: placed by the swarm, and this node's stage of it ready.
            let (status, body) = block_on(get(&self.url("/v1/models")));
            if status == 200 && body["data"].as_array().is_some_and(|m| m.iter().any(|m| m["shoal"]["loaded"] == true)) {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(120), "no model loaded within 120 s: {body}; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits for the process to exit by itself within `deadline`.
    pub fn wait_exit(&mut self, deadline: Duration) -> std::process::ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait works") {
                return status;
            }
            assert!(started.elapsed() < deadline, "shoal did not exit within {deadline:?}; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The value of one Prometheus sample line (`name{labels}`), 0 when absent.
    pub fn metric(&self, sample: &str) -> f64 {
        // On a thread of its own, so that async tests may call it too.
        let url = self.url("/metrics");
        let text = std::thread::spawn(move || block_on(async { reqwest::get(url).await.unwrap().text().await.unwrap() })).join().expect("the metrics request");
        text.lines().find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.trim().parse().ok())).unwrap_or(0.0)
    }

    /// Polls a metric until `check` holds, failing after `deadline`.
    pub fn wait_metric(&self, sample: &str, deadline: Duration, check: impl Fn(f64) -> bool) -> f64 {
        let started = Instant::now();
        loop {
            let v = self.metric(sample);
            if check(v) {
                return v;
            }
            assert!(started.elapsed() < deadline, "{sample} stayed at {v} for {deadline:?}; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a future on a fresh runtime (tests are plain `#[test]`s). Two workers, so that
/// reqwest's connection tasks and spawned requests progress while a test blocks in a wait.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a runtime").block_on(f)
}

pub async fn get(url: &str) -> (u16, Value) {
    let r = reqwest::get(url).await.expect("GET works");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

pub async fn post(url: &str, body: &str) -> (u16, Value) {
    let r = reqwest::Client::new().post(url).header("content-type", "application/json").body(body.to_string()).send().await.expect("POST works");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `curl -sS -N` POSTing `body`: (HTTP status, raw body).
pub fn curl(url: &str, body: &str) -> (u16, String) {
    let out = run_with_deadline(
        Command::new("curl").args(["-sS", "-N", "--max-time", "120", "-H", "content-type: application/json", "-w", "\n%{http_code}", "-d", body, url]),
        Duration::from_secs(130),
    );
    assert!(out.status.success(), "curl failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).expect("utf-8 body");
    let (body, code) = text.rsplit_once('\n').expect("curl wrote the status last");
    (code.trim().parse().expect("a status code"), body.to_string())
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:"))).map(str::to_string).collect()
}

/// The OpenAI SDK's Python, from `.venv-api` (created on first use by tests/api/setup-venv.sh).
pub fn sdk_python() -> PathBuf {
    let out = run_with_deadline(Command::new(repo_root().join("tests/api/setup-venv.sh")).stderr(Stdio::inherit()), Duration::from_secs(240));
    assert!(out.status.success(), "tests/api/setup-venv.sh failed: the SDK tests need PyPI's openai package");
    PathBuf::from(String::from_utf8(out.stdout).expect("utf-8 path").trim())
}

pub fn run_with_deadline(cmd: &mut Command, deadline: Duration) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).spawn().expect("the command starts");
    let started = Instant::now();
    // Drain stdout on a thread so that a chatty child never blocks on a full pipe.
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut stdout, &mut buf).map(|_| buf).unwrap_or_default()
    });
    loop {
        if child.try_wait().expect("wait works").is_some() {
            let mut out = child.wait_with_output().expect("output is collected");
            out.stdout = reader.join().expect("the reader thread ends");
            return out;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            panic!("{cmd:?} did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
