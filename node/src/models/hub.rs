//! A client of the Hugging Face hub's HTTP API (`HF_ENDPOINT`, default huggingface.co;
//! `HF_TOKEN` as a bearer token): model info with the file list, sizes and LFS sha256
//! (`GET /api/models/{repo}/revision/{rev}?blobs=true`), and one file's download
//! (`GET /{repo}/resolve/{rev}/{file}`) into a `.part` file that survives interruption and is
//! resumed with a Range request, retried with back-off on 429, 5xx and broken transfers,
//! checked for size and sha256, then renamed into place. It decides nothing about which files
//! to fetch (`select` does) and keeps no state between calls but its HTTP connection pool.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reqwest::header::{HeaderMap, AUTHORIZATION, CONTENT_RANGE, RANGE, RETRY_AFTER};
use reqwest::StatusCode;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::progress::Transfer;
use super::store::hex;
use super::ModelsError;

pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where the hub is and how patient to be with it.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// Base URL, no trailing slash.
    pub endpoint: String,
    pub token: Option<String>,
    /// Files downloaded at once.
    pub parallel: usize,
    /// Extra attempts after a 429, a 5xx or a broken transfer.
    pub retries: u32,
    /// First back-off; it doubles per attempt up to `max_backoff` (a `Retry-After` is honoured
    /// up to `max_backoff` too).
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Connection set-up limit (a transfer itself may take as long as it needs).
    pub connect_timeout: Duration,
    /// A transfer that delivers no byte for this long is broken (and retried).
    pub read_timeout: Duration,
}

impl HubConfig {
    /// `HF_ENDPOINT` and `HF_TOKEN` (or `HUGGING_FACE_HUB_TOKEN`, or the token file that
    /// `huggingface-cli login` writes under `HF_HOME`) from the environment.
    pub fn from_env() -> Self {
        let endpoint = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()).unwrap_or_else(|| DEFAULT_ENDPOINT.into());
        let token = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"].iter().find_map(|k| std::env::var(k).ok()).or_else(|| {
            let home = std::env::var_os("HF_HOME").map(std::path::PathBuf::from).or_else(|| dirs::home_dir().map(|h| h.join(".cache/huggingface")))?;
            std::fs::read_to_string(home.join("token")).ok()
        });
        HubConfig {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token: token.map(|t| t.trim().to_string()).filter(|t| !t.is_empty()),
            parallel: 4,
            retries: 5,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(60),
        }
    }
}

/// What the hub says about a repo at a revision.
#[derive(Debug, Clone, Deserialize)]
pub struct RepoInfo {
    /// The commit the revision resolved to.
    #[serde(default)]
    pub sha: Option<String>,
    #[serde(default)]
    pub siblings: Vec<Sibling>,
}

/// One file of a repo.
#[derive(Debug, Clone, Deserialize)]
pub struct Sibling {
    pub rfilename: String,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub lfs: Option<Lfs>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Lfs {
    pub sha256: String,
    pub size: u64,
}

impl Sibling {
    pub fn size(&self) -> Option<u64> {
        self.lfs.as_ref().map(|l| l.size).or(self.size)
    }
    pub fn sha256(&self) -> Option<&str> {
        self.lfs.as_ref().map(|l| l.sha256.as_str())
    }
}

/// One file to download and what it must be.
#[derive(Debug, Clone)]
pub struct RemoteFile {
    /// Path inside the repo.
    pub name: String,
    pub size: Option<u64>,
    pub sha256: Option<String>,
}

/// A downloaded, checked file.
#[derive(Debug, Clone)]
pub struct Fetched {
    pub size: u64,
    pub sha256: String,
    /// Bytes that came over the network this time (less than `size` after a resume).
    pub transferred: u64,
}

/// The hub client; clones share the connection pool.
#[derive(Debug, Clone)]
pub struct HubClient {
    config: HubConfig,
    http: reqwest::Client,
}

enum Attempt {
    /// Stop retrying with this error.
    Fatal(ModelsError),
    /// Retry after the back-off (or the server's `Retry-After`).
    Retry { error: ModelsError, after: Option<Duration> },
}

impl HubClient {
    pub fn new(config: HubConfig) -> Result<Self, ModelsError> {
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .read_timeout(config.read_timeout)
            .user_agent(concat!("shoal/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ModelsError::Transport { url: config.endpoint.clone(), reason: e.to_string() })?;
        Ok(HubClient { config, http })
    }

    pub fn config(&self) -> &HubConfig {
        &self.config
    }

    fn headers(&self) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(t) = &self.config.token {
            if let Ok(v) = format!("Bearer {t}").parse() {
                h.insert(AUTHORIZATION, v);
            }
        }
        h
    }

    fn backoff(&self, attempt: u32, after: Option<Duration>) -> Duration {
        let exp = self.config.backoff.saturating_mul(1u32 << attempt.min(16));
        after.unwrap_or(exp).min(self.config.max_backoff)
    }

    /// The error for a status that is not success, and whether retrying may help.
    fn classify(&self, status: StatusCode, headers: &HeaderMap, url: &str, repo: &str, what: &str, attempt: u32) -> Attempt {
        match status.as_u16() {
            401 | 403 => Attempt::Fatal(ModelsError::Unauthorized { repo: repo.into(), status: status.as_u16(), token_set: self.config.token.is_some() }),
            404 => Attempt::Fatal(ModelsError::NotFound { what: what.into(), url: url.into() }),
            429 | 500..=599 => {
                let after = headers.get(RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(|s| s.trim().parse::<u64>().ok()).map(Duration::from_secs);
                Attempt::Retry { error: ModelsError::Http { url: url.into(), status: status.as_u16(), retried: attempt > 0 }, after }
            }
            s => Attempt::Fatal(ModelsError::Http { url: url.into(), status: s, retried: attempt > 0 }),
        }
    }

    /// Runs `once` until it succeeds, fails fatally, runs out of retries or is cancelled.
    async fn with_retries<T, F, Fut>(&self, cancel: &CancellationToken, mut once: F) -> Result<T, ModelsError>
    where
        F: FnMut(u32) -> Fut,
        Fut: std::future::Future<Output = Result<T, Attempt>>,
    {
        let mut attempt = 0;
        loop {
            let result = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Err(ModelsError::Cancelled),
                r = once(attempt) => r,
            };
            match result {
                Ok(v) => return Ok(v),
                Err(Attempt::Fatal(e)) => return Err(e),
                Err(Attempt::Retry { error, after }) => {
                    if attempt >= self.config.retries {
                        return Err(error);
                    }
                    let wait = self.backoff(attempt, after);
                    tracing::info!(target: "shoal::models", error = %error, ?wait, attempt, "retrying");
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => return Err(ModelsError::Cancelled),
                        _ = tokio::time::sleep(wait) => {}
                    }
                    attempt += 1;
                }
            }
        }
    }

    /// The file list (with sizes and LFS hashes) of `repo` at `revision`.
    pub async fn info(&self, repo: &str, revision: &str, cancel: &CancellationToken) -> Result<RepoInfo, ModelsError> {
        let url = format!("{}/api/models/{repo}/revision/{revision}?blobs=true", self.config.endpoint);
        self.with_retries(cancel, |attempt| {
            let url = url.clone();
            async move {
                let response = self.http.get(&url).headers(self.headers()).send().await.map_err(|e| transport(&url, e))?;
                let status = response.status();
                if !status.is_success() {
                    return Err(self.classify(status, response.headers(), &url, repo, &format!("model {repo} at revision {revision}"), attempt));
                }
                let body = response.bytes().await.map_err(|e| transport(&url, e))?;
                serde_json::from_slice::<RepoInfo>(&body).map_err(|e| Attempt::Fatal(ModelsError::BadAnswer { url: url.clone(), reason: e.to_string() }))
            }
        })
        .await
    }

    /// Downloads `file` of `repo` at `revision` to `dest`, through `part` (kept on failure so
    /// that the next call resumes from its length). Verifies the size and, when known, the
    /// sha256; a mismatch deletes the part file and is an error (the caller may fetch again).
    pub async fn download(&self, repo: &str, revision: &str, file: &RemoteFile, part: &Path, dest: &Path, transfer: &Transfer, cancel: &CancellationToken) -> Result<Fetched, ModelsError> {
        let url = format!("{}/{repo}/resolve/{revision}/{}", self.config.endpoint, file.name);
        if let Some(dir) = part.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(|source| ModelsError::Io { path: dir.to_path_buf(), source })?;
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ModelsError::Io { path, source }
        };
        // Bytes that came over the network, and bytes of this file counted in `transfer` (which
        // several files share): shared references, so that every attempt's future can use them.
        let transferred = AtomicU64::new(0);
        let counted = AtomicU64::new(0);
        // What the file's own response headers say (`X-Linked-Etag` is an LFS file's sha256,
        // `X-Linked-Size` its size): used where the listing gave no hash or size.
        let learned: std::sync::Mutex<(Option<String>, Option<u64>)> = Default::default();
        let recount = |have: u64| {
            let before = counted.swap(have, Ordering::Relaxed);
            if have >= before { transfer.add(have - before) } else { transfer.sub(before - have) }
        };
        let hasher = self
            .with_retries(cancel, |attempt| {
                let url = url.clone();
                let (transferred, recount, learned) = (&transferred, &recount, &learned);
                async move {
                    let fatal_io = |e: ModelsError| Attempt::Fatal(e);
                    let (mut hasher, mut have) = hash_prefix(part).await.map_err(fatal_io)?;
                    if file.size.is_some_and(|s| have > s) {
                        truncate(part).await.map_err(fatal_io)?;
                        (hasher, have) = (Sha256::new(), 0);
                    }
                    recount(have);
                    if file.size == Some(have) {
                        return Ok(hasher);
                    }
                    let mut request = self.http.get(&url).headers(self.headers());
                    if have > 0 {
                        request = request.header(RANGE, format!("bytes={have}-"));
                    }
                    let mut response = request.send().await.map_err(|e| transport(&url, e))?;
                    let status = response.status();
                    match status {
                        StatusCode::PARTIAL_CONTENT => {
                            let start = response.headers().get(CONTENT_RANGE).and_then(|v| v.to_str().ok()).and_then(range_start);
                            if start != Some(have) {
                                truncate(part).await.map_err(fatal_io)?;
                                return Err(Attempt::Retry { error: ModelsError::BadAnswer { url: url.clone(), reason: format!("asked for bytes from {have}, got a range from {start:?}") }, after: Some(Duration::ZERO) });
                            }
                        }
                        StatusCode::OK if have > 0 => {
                            // The server ignored the Range: start over from its first byte.
                            truncate(part).await.map_err(fatal_io)?;
                            (hasher, have) = (Sha256::new(), 0);
                            recount(0);
                        }
                        StatusCode::OK => {}
                        StatusCode::RANGE_NOT_SATISFIABLE => {
                            truncate(part).await.map_err(fatal_io)?;
                            return Err(Attempt::Retry { error: ModelsError::Http { url: url.clone(), status: 416, retried: attempt > 0 }, after: Some(Duration::ZERO) });
                        }
                        s => return Err(self.classify(s, response.headers(), &url, repo, &format!("{} in {repo} at revision {revision}", file.name), attempt)),
                    }
                    *learned.lock().unwrap_or_else(|p| p.into_inner()) = linked(response.headers());
                    let mut out = tokio::fs::OpenOptions::new().create(true).append(true).open(part).await.map_err(|e| Attempt::Fatal(io(part)(e)))?;
                    loop {
                        match response.chunk().await {
                            Ok(Some(bytes)) => {
                                out.write_all(&bytes).await.map_err(|e| Attempt::Fatal(io(part)(e)))?;
                                hasher.update(&bytes);
                                have += bytes.len() as u64;
                                transferred.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                                recount(have);
                                if file.size.is_some_and(|s| have > s) {
                                    break; // longer than promised: the size check below reports it
                                }
                            }
                            Ok(None) => break,
                            Err(e) => {
                                let _ = out.flush().await;
                                return Err(transport(&url, e));
                            }
                        }
                    }
                    out.flush().await.map_err(|e| Attempt::Fatal(io(part)(e)))?;
                    if file.size.is_some_and(|s| have < s) {
                        return Err(Attempt::Retry { error: ModelsError::Transport { url: url.clone(), reason: format!("transfer ended after {have} bytes") }, after: None });
                    }
                    Ok(hasher)
                }
            })
            .await?;
        // An empty file never got a body written: make sure its part file exists.
        tokio::fs::OpenOptions::new().create(true).append(true).open(part).await.map_err(io(part))?;
        let size = tokio::fs::metadata(part).await.map_err(io(part))?.len();
        let sha256 = hex(&hasher.finalize());
        let (linked_sha, linked_size) = learned.into_inner().unwrap_or_else(|p| p.into_inner());
        let expected_sha = file.sha256.clone().or(linked_sha);
        if let Some(expected) = file.size.or(linked_size).filter(|s| *s != size) {
            let _ = tokio::fs::remove_file(part).await;
            recount(0);
            return Err(ModelsError::SizeMismatch { file: file.name.clone(), expected, got: size });
        }
        if let Some(expected) = expected_sha.filter(|h| !h.eq_ignore_ascii_case(&sha256)) {
            let _ = tokio::fs::remove_file(part).await;
            recount(0);
            return Err(ModelsError::HashMismatch { file: file.name.clone(), expected, got: sha256 });
        }
        if let Some(dir) = dest.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
        }
        tokio::fs::rename(part, dest).await.map_err(io(dest))?;
        Ok(Fetched { size, sha256, transferred: transferred.into_inner() })
    }
}

fn transport(url: &str, e: reqwest::Error) -> Attempt {
    Attempt::Retry { error: ModelsError::Transport { url: url.into(), reason: error_chain(&e) }, after: None }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// The sha256 and size an LFS file's response announces (`X-Linked-Etag`, `X-Linked-Size`;
/// the hub's `ETag` of a non-LFS file is a git hash, not a sha256, and is ignored).
fn linked(headers: &HeaderMap) -> (Option<String>, Option<u64>) {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let sha = text("x-linked-etag").map(|e| e.trim().trim_start_matches("W/").trim_matches('"').to_ascii_lowercase()).filter(|e| e.len() == 64 && e.bytes().all(|b| b.is_ascii_hexdigit()));
    (sha, text("x-linked-size").and_then(|s| s.trim().parse().ok()))
}

/// `bytes 100-199/1000` → 100.
fn range_start(v: &str) -> Option<u64> {
    v.strip_prefix("bytes ")?.split('-').next()?.trim().parse().ok()
}

async fn truncate(part: &Path) -> Result<(), ModelsError> {
    match tokio::fs::remove_file(part).await {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ModelsError::Io { path: part.to_path_buf(), source }),
    }
}

/// The hash and length of what a part file already holds (nothing when it does not exist).
pub(super) async fn hash_prefix(part: &Path) -> Result<(Sha256, u64), ModelsError> {
    let io = |source| ModelsError::Io { path: part.to_path_buf(), source };
    let mut hasher = Sha256::new();
    let mut f = match tokio::fs::File::open(part).await {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((hasher, 0)),
        Err(e) => return Err(io(e)),
    };
    let mut buf = vec![0u8; 1 << 20];
    let mut n_total = 0u64;
    loop {
        let n = f.read(&mut buf).await.map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        n_total += n as u64;
    }
    Ok((hasher, n_total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_range_and_backoff() {
        assert_eq!(range_start("bytes 100-199/1000"), Some(100));
        assert_eq!(range_start("bytes */1000"), None);
        let mut h = HeaderMap::new();
        h.insert("x-linked-etag", format!("\"{}\"", "AB".repeat(32)).parse().unwrap());
        h.insert("x-linked-size", "123".parse().unwrap());
        assert_eq!(linked(&h), (Some("ab".repeat(32)), Some(123)));
        h.insert("x-linked-etag", "\"abc\"".parse().unwrap());
        assert_eq!(linked(&h).0, None, "a git hash is not a sha256");
        let mut config = HubConfig::from_env();
        config.backoff = Duration::from_millis(100);
        config.max_backoff = Duration::from_secs(1);
        let client = HubClient::new(config).unwrap();
        assert_eq!(client.backoff(0, None), Duration::from_millis(100));
        assert_eq!(client.backoff(2, None), Duration::from_millis(400));
        assert_eq!(client.backoff(9, None), Duration::from_secs(1));
        assert_eq!(client.backoff(0, Some(Duration::from_secs(120))), Duration::from_secs(1));
    }
}
