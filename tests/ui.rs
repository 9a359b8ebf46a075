//! The web UI in a real headless browser: starts `shoal serve` on loopback with the Qwen model,
//! waits for /health, then runs `tests/browser/chat.mjs` (Debian chromium driven by
//! playwright-core) against it; screenshots land in `target/ui-test-output/`. Also holds the
//! loopback HTTP and process helpers that the launcher tests share. It needs /usr/bin/chromium
//! and `npm ci --prefix tests/browser` (scripts/test.sh installs both) and fails, not skips,
//! without them. The API's own behaviour is tested elsewhere; this is the page as a user sees it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::util::{real_model, repo_root, shoal_bin};

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind a loopback port").local_addr().expect("local addr").port()
}

/// `GET path` on 127.0.0.1:port over HTTP/1.1; the status and the raw body.
pub fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

/// True when a node answers `/health` with `{"status": "ok"}` on the port.
pub fn healthy(port: u16) -> bool {
    matches!(http_get(port, "/health"), Ok((200, body)) if body.contains("\"ok\""))
}

/// Waits for `/health`; fails early when `child` exits first.
pub fn wait_healthy(port: u16, deadline: Duration, mut child: Option<&mut Child>) -> Result<Duration, String> {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if healthy(port) {
            return Ok(start.elapsed());
        }
        if let Some(c) = child.as_deref_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                return Err(format!("the node exited ({status}) before /health answered"));
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("/health on port {port} did not answer within {deadline:?}"))
}

/// Waits until nothing answers on the port any more.
pub fn wait_down(port: u16, deadline: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if http_get(port, "/health").is_err() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// A child process that is killed when the test ends, passing or not.
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for a child with a deadline; kills it and says so when the deadline passes.
pub fn wait_with_deadline(child: &mut Child, deadline: Duration) -> Result<std::process::ExitStatus, String> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            return Ok(status);
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("still running after {deadline:?}; killed"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The page loads from a real node, lists it in the cluster view, streams a chat reply, renders
/// it as markdown with TTFT and tok/s, keeps it across a reload, and a screenshot is saved.
#[test]
fn browser_chat_against_a_real_node() {
    let root = repo_root();
    let chromium = Path::new("/usr/bin/chromium");
    assert!(chromium.exists(), "/usr/bin/chromium is missing: scripts/test.sh installs it (apt-get install chromium)");
    assert!(
        root.join("tests/browser/node_modules/playwright-core").exists(),
        "tests/browser/node_modules is missing: run `npm ci --prefix tests/browser` (scripts/test.sh does)"
    );
    let model = real_model("qwen2.5-coder-1.5b").join("model.gguf");
    assert!(model.exists(), "{} is missing", model.display());

    let out = root.join("target/ui-test-output");
    std::fs::create_dir_all(&out).expect("create target/ui-test-output");
    for stale in ["ui-chat.png", "ui-narrow-cluster.png", "ui-failure.png", "chat-summary.json"] {
        let _ = std::fs::remove_file(out.join(stale));
    }
    let data_dir = tempfile::tempdir().expect("temp data dir");
    let server_log = out.join("shoal-serve.log");
    let log_file = std::fs::File::create(&server_log).expect("create the server log");
    let port = free_port();
    let started = Instant::now();
    let mut server = ChildGuard(
        Command::new(shoal_bin())
            .args(["serve", "--host", "127.0.0.1", "--api-port", &port.to_string(), "--no-discovery", "--listen", "/ip4/127.0.0.1/tcp/0"])
            .arg("--model")
            .arg(&model)
            .arg("--data-dir")
            .arg(data_dir.path())
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log handle"))
            .stderr(log_file)
            .spawn()
            .expect("shoal serve starts"),
    );
    if let Err(e) = wait_healthy(port, Duration::from_secs(90), Some(&mut server.0)) {
        panic!("{e}; server log:\n{}", tail(&server_log, 30));
    }
    eprintln!("[ui] node healthy on port {port} after {:?}", started.elapsed());

    let mut browser = ChildGuard(
        Command::new("node")
            .arg(root.join("tests/browser/chat.mjs"))
            .args(["--url", &format!("http://127.0.0.1:{port}/")])
            .arg("--out")
            .arg(&out)
            .args(["--timeout-s", "170"])
            .current_dir(&root)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("node runs tests/browser/chat.mjs"),
    );
    let status = wait_with_deadline(&mut browser.0, Duration::from_secs(185));
    let mut summary = String::new();
    if let Some(mut stdout) = browser.0.stdout.take() {
        let _ = stdout.read_to_string(&mut summary);
    }
    let ok = matches!(status, Ok(s) if s.success());
    assert!(
        ok,
        "the browser test failed ({status:?}); summary:\n{summary}\nserver log tail:\n{}",
        tail(&server_log, 30)
    );
    let shot = out.join("ui-chat.png");
    let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
    assert!(size > 10_000, "screenshot {} missing or empty ({size} bytes)", shot.display());
    let parsed: serde_json::Value = serde_json::from_str(&summary).expect("chat.mjs prints a JSON summary");
    assert_eq!(parsed["ok"], serde_json::Value::Bool(true), "summary does not report success:\n{summary}");
    eprintln!("[ui] passed in {:?}; screenshot {}", started.elapsed(), shot.display());
}
