//! A local HTTP server that speaks the Hugging Face hub's API shape and serves real files from
//! disk: `GET /api/models/{owner}/{name}[/revision/{rev}]` (siblings; sizes and LFS sha256 with
//! `?blobs=true`), `GET|HEAD /{owner}/{name}/resolve/{rev}/{file}` with Range requests and the
//! hub's `ETag`, `X-Linked-Etag`, `X-Linked-Size` and `X-Repo-Commit` headers. Gated repos want
//! a bearer token (401 otherwise); unknown repos and files are 404. Knobs for tests: a byte-rate
//! limit, a number of 503s to answer first, and files to corrupt in their next response.
//! Counters of requests and body bytes per file let tests say what crossed the wire.
//! Shared by the tests and `examples/models_bench.rs`; it knows nothing of shoal's code.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sha2::{Digest, Sha256};

pub const TOKEN: &str = "hf_test_token";
/// Files at least this large are served as LFS files (with a sha256), like the hub's weights.
const LFS_MIN: u64 = 1024;
const CHUNK: usize = 256 << 10;

#[derive(Clone)]
pub struct HubFile {
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    pub sha256: String,
}

struct Repo {
    commit: String,
    gated: bool,
    files: Vec<HubFile>,
}

#[derive(Default)]
pub struct Knobs {
    /// Body bytes per second for every download; `None`: as fast as it goes.
    pub rate: Option<u64>,
    /// Answer this many next requests (of any kind) with 503 and `Retry-After: 0`.
    pub fail_next: u32,
    /// Files whose next download has one byte flipped.
    pub corrupt_next: HashSet<String>,
}

#[derive(Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub bytes: AtomicU64,
    /// Body bytes per file name (the path inside the repo).
    pub file_bytes: Mutex<HashMap<String, u64>>,
    /// "METHOD /path [range]" of every request, in order.
    pub log: Mutex<Vec<String>>,
}

#[derive(Default)]
struct Hub {
    repos: Mutex<HashMap<String, Repo>>,
    knobs: Mutex<Knobs>,
    counters: Counters,
}

/// A running fake hub. Dropping it stops the server.
pub struct FakeHub {
    pub addr: SocketAddr,
    hub: Arc<Hub>,
    _runtime: Option<tokio::runtime::Runtime>,
    stop: tokio_util::sync::CancellationToken,
}

fn sha256_file(path: &Path) -> String {
    let mut f = std::fs::File::open(path).expect("a served file opens");
    let mut h = Sha256::new();
    let mut buf = vec![0; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

impl FakeHub {
    /// Starts the server on 127.0.0.1 on its own runtime thread.
    pub fn start() -> FakeHub {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let hub = Arc::new(Hub::default());
        let stop = tokio_util::sync::CancellationToken::new();
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/api/models/{owner}/{name}", get(info))
            .route("/api/models/{owner}/{name}/revision/{rev}", get(info_rev))
            .route("/{owner}/{name}/resolve/{rev}/{*file}", get(resolve).head(resolve))
            .with_state(hub.clone());
        let token = stop.clone();
        runtime.spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(token.cancelled_owned()).await;
        });
        FakeHub { addr, hub, _runtime: Some(runtime), stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serves `files` (name in the repo, file on disk) as `repo`.
    pub fn add_repo(&self, repo: &str, gated: bool, files: &[(&str, &Path)]) -> Vec<HubFile> {
        let files: Vec<HubFile> = files
            .iter()
            .map(|(name, path)| HubFile { name: name.to_string(), path: path.to_path_buf(), size: std::fs::metadata(path).unwrap().len(), sha256: sha256_file(path) })
            .collect();
        let commit = format!("{:040x}", self.hub.repos.lock().unwrap().len() + 0xabc);
        self.hub.repos.lock().unwrap().insert(repo.to_string(), Repo { commit, gated, files: files.clone() });
        files
    }

    /// Serves every regular file of `dir` as `repo`.
    pub fn add_dir(&self, repo: &str, dir: &Path) -> Vec<HubFile> {
        let mut names: Vec<String> = std::fs::read_dir(dir).unwrap().flatten().filter(|e| e.path().is_file()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        let paths: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
        let pairs: Vec<(&str, &Path)> = names.iter().map(String::as_str).zip(paths.iter().map(PathBuf::as_path)).collect();
        self.add_repo(repo, false, &pairs)
    }

    pub fn knobs<T>(&self, f: impl FnOnce(&mut Knobs) -> T) -> T {
        f(&mut self.hub.knobs.lock().unwrap())
    }

    pub fn requests(&self) -> u64 {
        self.hub.counters.requests.load(Ordering::SeqCst)
    }

    pub fn bytes(&self) -> u64 {
        self.hub.counters.bytes.load(Ordering::SeqCst)
    }

    pub fn file_bytes(&self, name: &str) -> u64 {
        self.hub.counters.file_bytes.lock().unwrap().get(name).copied().unwrap_or(0)
    }

    pub fn log(&self) -> Vec<String> {
        self.hub.counters.log.lock().unwrap().clone()
    }

    /// Zeroes every counter and the log.
    pub fn reset_counters(&self) {
        let c = &self.hub.counters;
        c.requests.store(0, Ordering::SeqCst);
        c.bytes.store(0, Ordering::SeqCst);
        c.file_bytes.lock().unwrap().clear();
        c.log.lock().unwrap().clear();
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(rt) = self._runtime.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

fn note(hub: &Hub, line: String) -> Option<Response> {
    hub.counters.requests.fetch_add(1, Ordering::SeqCst);
    hub.counters.log.lock().unwrap().push(line);
    let mut knobs = hub.knobs.lock().unwrap();
    if knobs.fail_next > 0 {
        knobs.fail_next -= 1;
        return Some((StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "0")], "busy").into_response());
    }
    None
}

fn authorised(repo: &Repo, headers: &HeaderMap) -> bool {
    !repo.gated || headers.get("authorization").and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, [("x-error-message", message.to_string())], axum::Json(serde_json::json!({ "error": message }))).into_response()
}

async fn info(State(hub): State<Arc<Hub>>, UrlPath((owner, name)): UrlPath<(String, String)>, Query(q): Query<HashMap<String, String>>, headers: HeaderMap) -> Response {
    info_rev(State(hub), UrlPath((owner, name, "main".into())), Query(q), headers).await
}

async fn info_rev(State(hub): State<Arc<Hub>>, UrlPath((owner, name, rev)): UrlPath<(String, String, String)>, Query(q): Query<HashMap<String, String>>, headers: HeaderMap) -> Response {
    if let Some(r) = note(&hub, format!("GET /api/models/{owner}/{name}/revision/{rev}")) {
        return r;
    }
    let repos = hub.repos.lock().unwrap();
    let Some(repo) = repos.get(&format!("{owner}/{name}")) else { return error(StatusCode::NOT_FOUND, "Repository not found") };
    if !authorised(repo, &headers) {
        return error(StatusCode::UNAUTHORIZED, "Access to this model is restricted: you must be authenticated");
    }
    if rev != "main" && rev != repo.commit {
        return error(StatusCode::NOT_FOUND, "Invalid rev id");
    }
    let blobs = q.get("blobs").is_some_and(|v| v == "true" || v == "1");
    let siblings: Vec<serde_json::Value> = repo
        .files
        .iter()
        .map(|f| match (blobs, f.size >= LFS_MIN) {
            (false, _) => serde_json::json!({ "rfilename": f.name }),
            (true, true) => serde_json::json!({ "rfilename": f.name, "size": f.size, "blobId": "0", "lfs": { "sha256": f.sha256, "size": f.size, "pointerSize": 134 } }),
            (true, false) => serde_json::json!({ "rfilename": f.name, "size": f.size, "blobId": "0" }),
        })
        .collect();
    axum::Json(serde_json::json!({ "id": format!("{owner}/{name}"), "modelId": format!("{owner}/{name}"), "sha": repo.commit, "private": false, "gated": repo.gated, "siblings": siblings })).into_response()
}

/// `bytes=A-` or `bytes=A-B` → (A, B inclusive) within `size`.
fn parse_range(v: &str, size: u64) -> Option<(u64, u64)> {
    let spec = v.strip_prefix("bytes=")?;
    let (a, b) = spec.split_once('-')?;
    let start: u64 = a.parse().ok()?;
    let end: u64 = if b.is_empty() { size.checked_sub(1)? } else { b.parse::<u64>().ok()?.min(size.checked_sub(1)?) };
    (start <= end).then_some((start, end))
}

async fn resolve(State(hub): State<Arc<Hub>>, method: Method, UrlPath((owner, name, rev, file)): UrlPath<(String, String, String, String)>, headers: HeaderMap) -> Response {
    let range_header = headers.get("range").and_then(|v| v.to_str().ok()).map(str::to_string);
    if let Some(r) = note(&hub, format!("{method} /{owner}/{name}/resolve/{rev}/{file} {}", range_header.as_deref().unwrap_or(""))) {
        return r;
    }
    let (entry, commit) = {
        let repos = hub.repos.lock().unwrap();
        let Some(repo) = repos.get(&format!("{owner}/{name}")) else { return error(StatusCode::NOT_FOUND, "Repository not found") };
        if !authorised(repo, &headers) {
            return error(StatusCode::UNAUTHORIZED, "Access to this model is restricted: you must be authenticated");
        }
        if rev != "main" && rev != repo.commit {
            return error(StatusCode::NOT_FOUND, "Invalid rev id");
        }
        let Some(f) = repo.files.iter().find(|f| f.name == file) else { return error(StatusCode::NOT_FOUND, "Entry not found") };
        (f.clone(), repo.commit.clone())
    };
    let lfs = entry.size >= LFS_MIN;
    let etag = if lfs { format!("\"{}\"", entry.sha256) } else { format!("\"{}\"", &entry.sha256[..40]) };
    let (status, start, end) = match range_header.as_deref() {
        Some(r) => match parse_range(r, entry.size) {
            Some((s, e)) => (StatusCode::PARTIAL_CONTENT, s, e),
            None => return (StatusCode::RANGE_NOT_SATISFIABLE, [("content-range", format!("bytes */{}", entry.size))]).into_response(),
        },
        None => (StatusCode::OK, 0, entry.size.saturating_sub(1)),
    };
    let len = if entry.size == 0 { 0 } else { end - start + 1 };
    let mut builder = Response::builder()
        .status(status)
        .header("accept-ranges", "bytes")
        .header("content-length", len.to_string())
        .header("etag", etag.clone())
        .header("x-repo-commit", commit);
    if lfs {
        builder = builder.header("x-linked-etag", etag).header("x-linked-size", entry.size.to_string());
    }
    if status == StatusCode::PARTIAL_CONTENT {
        builder = builder.header("content-range", format!("bytes {start}-{end}/{}", entry.size));
    }
    if method == Method::HEAD {
        return builder.body(Body::empty()).unwrap();
    }
    let (rate, corrupt) = {
        let mut k = hub.knobs.lock().unwrap();
        (k.rate, k.corrupt_next.remove(&entry.name))
    };
    let state = (hub.clone(), entry, start, start + len, corrupt, rate);
    let stream = futures_util::stream::unfold(state, |(hub, entry, pos, end, corrupt, rate)| async move {
        if pos >= end {
            return None;
        }
        let n = ((end - pos) as usize).min(CHUNK);
        let path = entry.path.clone();
        let read = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
            let mut f = std::fs::File::open(path)?;
            f.seek(SeekFrom::Start(pos))?;
            let mut buf = vec![0; n];
            f.read_exact(&mut buf)?;
            Ok(buf)
        })
        .await
        .unwrap();
        let mut buf = match read {
            Ok(b) => b,
            Err(e) => return Some((Err(e), (hub, entry, end, end, corrupt, rate))),
        };
        if corrupt && pos == 0 {
            buf[n / 2] ^= 0xff;
        }
        if let Some(rate) = rate {
            tokio::time::sleep(Duration::from_secs_f64(n as f64 / rate as f64)).await;
        }
        hub.counters.bytes.fetch_add(n as u64, Ordering::SeqCst);
        *hub.counters.file_bytes.lock().unwrap().entry(entry.name.clone()).or_default() += n as u64;
        Some((Ok::<Bytes, std::io::Error>(Bytes::from(buf)), (hub, entry, pos + n as u64, end, corrupt, rate)))
    });
    builder.body(Body::from_stream(stream)).unwrap()
}
