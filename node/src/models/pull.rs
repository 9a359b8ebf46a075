//! `pull`: a model named by the user (catalogue id, hub repo, `repo:quant`, or the id of a
//! model a peer holds) becomes a verified directory in the store. Peers that hold the model
//! are asked first; the hub is contacted only for what no peer could provide (and never when
//! peers provide everything). For a stage only the configs, tokenizer and the weight files
//! holding its layers are fetched. Files already on disk with the expected hash are kept;
//! corrupt ones are fetched again; a file whose download fails verification is fetched once
//! more from scratch before giving up.
//! It does not load the model, and it never writes outside `<data dir>/models/<id>/`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::stream::{self, StreamExt};
use libp2p::PeerId;
use tokio_util::sync::CancellationToken;

use super::catalogue::{self, Format};
use super::hub::{HubClient, RemoteFile, RepoInfo};
use super::id::is_valid_id;
use super::peer::{PeerList, PeerSource};
use super::progress::{Phase, Progress, Transfer};
use super::select::{self, INDEX_FILE};
use super::store::{inspect, is_safe_relative, read_manifest, sha256_file, write_manifest, FileRecord, LocalModel, Manifest, Store, META_DIR};
use super::ModelsError;

/// The local name of a model's one GGUF file: a directory named by the id holding
/// `model.gguf` is what the id rule (`id::model_id`) names by the directory.
pub const GGUF_NAME: &str = "model.gguf";

/// What to pull.
#[derive(Debug, Clone)]
pub struct PullRequest {
    /// A catalogue id (`qwen2.5-0.5b`), a hub repo id (`Qwen/Qwen2.5-0.5B-Instruct`), or a
    /// GGUF repo with a quantization (`Qwen/Qwen2.5-0.5B-Instruct-GGUF:q8_0`).
    pub name: String,
    /// The GGUF file to take from a repo holding several.
    pub file: Option<String>,
    /// Branch, tag or commit on the hub.
    pub revision: String,
    /// Only the layers `[start, end)` (a pipeline stage); `None`: the whole model.
    pub layers: Option<(u32, u32)>,
    /// For a catalogue id: which format to take (default: the catalogue's first).
    pub format: Option<Format>,
}

impl PullRequest {
    pub fn new(name: &str) -> Self {
        PullRequest { name: name.into(), file: None, revision: "main".into(), layers: None, format: None }
    }
}

/// Where files may come from; either may be absent.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub hub: Option<HubClient>,
    pub peers: Option<PeerSource>,
}

/// What a pull did.
#[derive(Debug, Clone)]
pub struct PullOutcome {
    pub model: LocalModel,
    pub dir: PathBuf,
    pub files: Vec<FileRecord>,
    /// Bytes that came from the hub, from peers, and that were already on disk (verified).
    pub from_hub: u64,
    pub from_peers: u64,
    pub reused: u64,
    /// Peers that sent at least one file.
    pub peers_used: Vec<PeerId>,
}

/// The model a name resolves to, before any file is listed.
#[derive(Debug, Clone)]
struct Target {
    id: String,
    repo: String,
    /// The GGUF file to take, when known before listing.
    gguf_file: Option<String>,
    /// The quantization asked for (`repo:quant`).
    quant: Option<String>,
    /// The sha256 the catalogue pins for the GGUF file.
    pinned: Option<&'static str>,
}

fn resolve(req: &PullRequest) -> Result<Target, ModelsError> {
    if let Some(known) = catalogue::find(&req.name) {
        let variant = match req.format {
            Some(f) => known.variants.iter().find(|v| v.format == f).ok_or_else(|| ModelsError::Invalid(format!("{} has no {f:?} variant in the catalogue", known.id)))?,
            None => known.default_variant(),
        };
        let gguf = variant.format == Format::Gguf;
        return Ok(Target { id: known.id.into(), repo: variant.repo.into(), gguf_file: gguf.then(|| variant.file.to_string()), quant: None, pinned: variant.sha256.filter(|_| gguf) });
    }
    let Some((owner_name, quant)) = req.name.contains('/').then(|| match req.name.rsplit_once(':') {
        Some((repo, q)) if !q.is_empty() && !q.contains('/') => (repo.to_string(), Some(q.to_ascii_lowercase())),
        _ => (req.name.clone(), None),
    }) else {
        // A plain id (an imported model, say): only a peer that holds it can provide it.
        if !is_valid_id(&req.name) {
            return Err(ModelsError::Invalid(format!("`{}` is neither a model id nor a hub repo id (owner/name)", req.name)));
        }
        return Ok(Target { id: req.name.clone(), repo: String::new(), gguf_file: req.file.clone(), quant: None, pinned: None });
    };
    let segments: Vec<&str> = owner_name.split('/').collect();
    if segments.len() != 2 || segments.iter().any(|s| s.is_empty() || *s == "." || *s == ".." || s.contains(['\\', '?', '#', '%'])) {
        return Err(ModelsError::Invalid(format!("`{owner_name}` is not a hub repo id (owner/name)")));
    }
    if quant.is_none() && req.file.is_none() {
        if let Some((known, variant)) = catalogue::find_by_source(&owner_name, None) {
            let gguf = variant.format == Format::Gguf;
            return Ok(Target { id: known.id.into(), repo: owner_name, gguf_file: gguf.then(|| variant.file.to_string()), quant: None, pinned: variant.sha256.filter(|_| gguf) });
        }
    }
    let mut id = segments[1].to_ascii_lowercase();
    let chosen = req.file.as_deref().and_then(select::quant_of).map(str::to_string).or_else(|| quant.clone());
    if let Some(q) = &chosen {
        id = format!("{}-{q}", id.trim_end_matches("-gguf"));
    } else if let Some(f) = &req.file {
        id = format!("{}-{}", id.trim_end_matches("-gguf"), f.to_ascii_lowercase().trim_end_matches(".gguf"));
    }
    if !is_valid_id(&id) {
        return Err(ModelsError::Invalid(format!("`{id}` cannot name a model directory")));
    }
    Ok(Target { id, repo: owner_name, gguf_file: req.file.clone(), quant, pinned: None })
}

/// One file to have, by its name in the model's directory.
#[derive(Debug, Clone)]
struct Wanted {
    local: String,
    /// Its name in the hub repo.
    remote: String,
    size: Option<u64>,
    sha256: Option<String>,
}

/// Everything one pull shares between its files.
struct Puller<'a> {
    target: Target,
    revision: String,
    sources: &'a Sources,
    dir: PathBuf,
    holders: Vec<PeerList>,
    /// The hub's listing, fetched on first need: (commit, info).
    hub: tokio::sync::OnceCell<(String, RepoInfo)>,
    transfer: Transfer,
    cancel: &'a CancellationToken,
    /// Bytes of every file chosen so far, for the progress total.
    total: AtomicU64,
    /// Local name → (record, where it came from), for each file in place.
    done: std::sync::Mutex<HashMap<String, (FileRecord, Origin)>>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Origin {
    Disk,
    Hub(u64),
    Peer(PeerId, u64),
}

/// Pulls `req` into `store` from `sources`, reporting on `progress`.
pub async fn pull(store: &Store, req: &PullRequest, sources: &Sources, progress: &Progress, cancel: &CancellationToken) -> Result<PullOutcome, ModelsError> {
    let target = resolve(req)?;
    let dir = store.model_dir(&target.id)?;
    let transfer = progress.start(&target.id, Phase::Downloading, "", None);
    let holders = match &sources.peers {
        Some(peers) => peers.holders(&target.id).await,
        None => Vec::new(),
    };
    tracing::info!(target: "shoal::models", id = %target.id, repo = %target.repo, holders = holders.len(), "pulling");
    let puller = Puller { target, revision: req.revision.clone(), sources, dir, holders, hub: tokio::sync::OnceCell::new(), transfer, cancel, total: AtomicU64::new(0), done: Default::default() };
    match puller.run(req.layers).await {
        Ok(outcome) => {
            puller.transfer.finish();
            Ok(outcome)
        }
        Err(e) => {
            puller.transfer.fail(&e.to_string());
            Err(e)
        }
    }
}

impl Puller<'_> {
    async fn run(&self, layers: Option<(u32, u32)>) -> Result<PullOutcome, ModelsError> {
        let listing = self.listing().await?;
        let names: Vec<&str> = listing.iter().map(|w| w.local.as_str()).collect();
        let weights: Vec<Wanted> = if names.iter().any(|n| n.ends_with(".gguf")) {
            // A GGUF model is one file (and, from a peer, the tokenizer.json beside it).
            listing.iter().filter(|w| w.local.ends_with(".gguf") || w.local == "tokenizer.json").cloned().collect()
        } else if select::is_safetensors_repo(&names) {
            let support: Vec<Wanted> = select::support_files(&names).iter().filter_map(|n| listing.iter().find(|w| &w.local == n).cloned()).collect();
            self.add_total(&support);
            self.fetch_all(support).await?;
            let wanted = match layers {
                Some((start, end)) if names.contains(&INDEX_FILE) => {
                    let index = read_text(&self.dir.join(INDEX_FILE))?;
                    let config = read_text(&self.dir.join("config.json"))?;
                    let n = select::layers_in_config(&config).ok_or_else(|| ModelsError::Invalid(format!("{}: config.json has no num_hidden_layers", self.target.id)))?;
                    select::files_for_layers(&index, start, end, n)?
                }
                _ => select::all_weight_files(&names),
            };
            // A weight file no listing names (a peer holding other layers) is looked up on the hub.
            wanted.iter().map(|n| listing.iter().find(|w| &w.local == n).cloned().unwrap_or_else(|| Wanted { local: n.clone(), remote: n.clone(), size: None, sha256: None })).collect()
        } else {
            return Err(ModelsError::Invalid(format!("{}: neither a GGUF file nor config.json with safetensors weights", self.target.repo)));
        };
        self.add_total(&weights);
        self.fetch_all(weights).await?;
        self.finish(layers)
    }

    fn add_total(&self, files: &[Wanted]) {
        let more: u64 = files.iter().filter_map(|w| w.size).sum();
        let total = self.total.fetch_add(more, Ordering::Relaxed) + more;
        self.transfer.set_total(Some(total));
    }

    /// The model's files: from the peers that hold it (each file's hash the one most of them
    /// claim, or the catalogue's pin), else from the hub.
    async fn listing(&self) -> Result<Vec<Wanted>, ModelsError> {
        if !self.holders.is_empty() {
            let mut claims: HashMap<&str, HashMap<(&str, u64), usize>> = HashMap::new();
            for list in &self.holders {
                for f in &list.files {
                    *claims.entry(f.path.as_str()).or_default().entry((f.sha256.as_str(), f.size)).or_default() += 1;
                }
            }
            let mut files: Vec<Wanted> = claims
                .into_iter()
                .map(|(path, votes)| {
                    let ((sha, size), _) = votes.into_iter().max_by_key(|(k, n)| (*n, std::cmp::Reverse(*k))).expect("a claimed path has a claim");
                    let pinned = self.target.pinned.filter(|_| path.ends_with(".gguf"));
                    let remote = if path == GGUF_NAME { self.target.gguf_file.clone().unwrap_or_else(|| path.to_string()) } else { path.to_string() };
                    Wanted { local: path.to_string(), remote, size: Some(size), sha256: Some(pinned.unwrap_or(sha).to_string()) }
                })
                .collect();
            files.sort_by(|a, b| a.local.cmp(&b.local));
            return Ok(files);
        }
        let (_, info) = self.hub_info().await?;
        let names: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
        let wanted = |remote: &str, local: &str| {
            let sibling = info.siblings.iter().find(|s| s.rfilename == remote);
            Wanted { local: local.into(), remote: remote.into(), size: sibling.and_then(|s| s.size()), sha256: sibling.and_then(|s| s.sha256()).map(|h| h.to_ascii_lowercase()) }
        };
        if select::is_safetensors_repo(&names) && self.target.gguf_file.is_none() && self.target.quant.is_none() {
            return Ok(names.iter().filter(|n| !n.contains('/')).map(|n| wanted(n, n)).collect());
        }
        let file = select::choose_gguf(&self.target.repo, &names, self.target.gguf_file.as_deref(), self.target.quant.as_deref())?;
        let mut w = wanted(&file, GGUF_NAME);
        if let Some(pin) = self.target.pinned {
            w.sha256 = Some(pin.to_string());
        }
        Ok(vec![w])
    }

    /// The hub's listing (fetched once): the commit the revision resolved to, and the files.
    async fn hub_info(&self) -> Result<&(String, RepoInfo), ModelsError> {
        if self.target.repo.is_empty() {
            let known: Vec<&str> = catalogue::MODELS.iter().map(|m| m.id).collect();
            return Err(ModelsError::UnknownModel { id: self.target.id.clone(), hint: format!("no peer holds it, and it is neither in the catalogue ({}) nor a hub repo id (owner/name)", known.join(", ")) });
        }
        let hub = self.sources.hub.as_ref().ok_or_else(|| ModelsError::NoSource { file: self.target.id.clone(), reason: "no peer holds it and the hub is not in use".into() })?;
        self.hub
            .get_or_try_init(|| async {
                let info = hub.info(&self.target.repo, &self.revision, self.cancel).await?;
                let commit = info.sha.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| self.revision.clone());
                Ok((commit, info))
            })
            .await
    }

    async fn fetch_all(&self, files: Vec<Wanted>) -> Result<(), ModelsError> {
        let parallel = self.sources.hub.as_ref().map_or(4, |h| h.config().parallel).max(1);
        let results: Vec<Result<(), ModelsError>> = stream::iter(files).map(|w| self.fetch_one(w)).buffer_unordered(parallel).collect().await;
        results.into_iter().collect()
    }

    fn part_path(&self, w: &Wanted) -> PathBuf {
        let key = w.sha256.as_deref().map_or_else(|| "unverified".to_string(), |h| h[..16.min(h.len())].to_string());
        self.dir.join(META_DIR).join("incomplete").join(format!("{}.{key}.part", w.local.replace('/', "_")))
    }

    /// Puts one file in place: kept if already there with the expected hash, else copied from a
    /// peer that lists it, else downloaded from the hub (once more from scratch if the first
    /// download fails verification).
    async fn fetch_one(&self, w: Wanted) -> Result<(), ModelsError> {
        if self.done.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&w.local) {
            return Ok(());
        }
        // Names come from peers and the hub: never let one point outside the model's directory.
        if !is_safe_relative(&w.local) {
            return Err(ModelsError::Invalid(format!("{}: not a file name inside a model directory", w.local)));
        }
        let dest = self.dir.join(&w.local);
        if let Some(record) = self.verified_on_disk(&w, &dest).await? {
            self.transfer.add(record.size);
            return self.record(record, Origin::Disk);
        }
        let mut failures = Vec::new();
        if let Some(peers) = &self.sources.peers {
            for list in self.holders.iter().filter(|l| l.files.iter().any(|f| f.path == w.local && Some(&f.sha256) == w.sha256.as_ref() && Some(f.size) == w.size)) {
                let expected = FileRecord { path: w.local.clone(), size: w.size.unwrap_or(0), sha256: w.sha256.clone().unwrap_or_default() };
                self.transfer.set_phase(Phase::Copying, &format!("peer {}", list.peer));
                self.transfer.set_file(Some(&w.local));
                match peers.copy_file(list.peer, &self.target.id, &expected, &self.part_path(&w), &dest, &self.transfer, self.cancel).await {
                    Ok(bytes) => return self.record(expected, Origin::Peer(list.peer, bytes)),
                    Err(ModelsError::Cancelled) => return Err(ModelsError::Cancelled),
                    Err(e) => {
                        tracing::warn!(target: "shoal::models", peer = %list.peer, file = %w.local, error = %e, "peer copy failed; trying the next source");
                        failures.push(e.to_string());
                    }
                }
            }
        }
        if self.sources.hub.is_none() {
            let reason = if failures.is_empty() { "no peer holds it and the hub is not in use".to_string() } else { failures.join("; ") };
            return Err(ModelsError::NoSource { file: w.local.clone(), reason });
        }
        let (commit, info) = self.hub_info().await?;
        let hub = self.sources.hub.as_ref().expect("checked above");
        let mut remote_name = w.remote.clone();
        if w.local == GGUF_NAME && !info.siblings.iter().any(|s| s.rfilename == remote_name) {
            // Listed by peers under its local name: find the repo's own file for it.
            let names: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
            remote_name = select::choose_gguf(&self.target.repo, &names, self.target.gguf_file.as_deref(), self.target.quant.as_deref())?;
        }
        let sibling = info.siblings.iter().find(|s| s.rfilename == remote_name).ok_or_else(|| ModelsError::NotFound { what: format!("{remote_name} in {}", self.target.repo), url: format!("{}/{}", hub.config().endpoint, self.target.repo) })?;
        // The hub's own hash wins over a peer's claim; the catalogue's pin wins over both.
        let sha256 = self.target.pinned.filter(|_| w.local == GGUF_NAME).map(str::to_string).or_else(|| sibling.sha256().map(|h| h.to_ascii_lowercase()));
        let remote = RemoteFile { name: remote_name, size: sibling.size(), sha256: sha256.clone() };
        let part = self.part_path(&Wanted { sha256: sha256.clone(), ..w.clone() });
        self.transfer.set_phase(Phase::Downloading, "hub");
        self.transfer.set_file(Some(&w.local));
        let mut attempt = 0;
        loop {
            match hub.download(&self.target.repo, commit, &remote, &part, &dest, &self.transfer, self.cancel).await {
                Ok(f) => return self.record(FileRecord { path: w.local.clone(), size: f.size, sha256: f.sha256 }, Origin::Hub(f.transferred)),
                Err(e @ (ModelsError::HashMismatch { .. } | ModelsError::SizeMismatch { .. })) if attempt == 0 => {
                    tracing::warn!(target: "shoal::models", file = %w.local, error = %e, "download failed verification; fetching it again");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The file at `dest`, if it is there and matches what is wanted (by sha256 when known,
    /// else by size). A file that does not match is deleted.
    async fn verified_on_disk(&self, w: &Wanted, dest: &Path) -> Result<Option<FileRecord>, ModelsError> {
        let Ok(meta) = tokio::fs::metadata(dest).await else { return Ok(None) };
        let size_ok = w.size.is_none_or(|s| s == meta.len());
        if size_ok {
            self.transfer.set_phase(Phase::Verifying, "disk");
            self.transfer.set_file(Some(&w.local));
        }
        let sha = if size_ok {
            // Hashing a large file is blocking work: off the async threads.
            let path = dest.to_path_buf();
            Some(tokio::task::spawn_blocking(move || sha256_file(&path)).await.map_err(|e| ModelsError::Invalid(format!("hashing {}: {e}", dest.display())))??)
        } else {
            None
        };
        match sha {
            Some(sha) if w.sha256.as_ref().is_none_or(|h| *h == sha) => Ok(Some(FileRecord { path: w.local.clone(), size: meta.len(), sha256: sha })),
            _ => {
                tracing::warn!(target: "shoal::models", file = %dest.display(), "file on disk does not match; fetching it again");
                tokio::fs::remove_file(dest).await.map_err(|source| ModelsError::Io { path: dest.to_path_buf(), source })?;
                Ok(None)
            }
        }
    }

    fn record(&self, record: FileRecord, origin: Origin) -> Result<(), ModelsError> {
        self.done.lock().unwrap_or_else(|p| p.into_inner()).insert(record.path.clone(), (record, origin));
        Ok(())
    }

    /// Writes the manifest (this pull's files, plus files of earlier pulls still on disk) and
    /// reads the model back from the store.
    fn finish(&self, layers: Option<(u32, u32)>) -> Result<PullOutcome, ModelsError> {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut files: Vec<FileRecord> = done.values().map(|(r, _)| r.clone()).collect();
        let earlier = read_manifest(&self.dir);
        if let Some(m) = &earlier {
            for f in &m.files {
                let present = std::fs::metadata(self.dir.join(&f.path)).is_ok_and(|md| md.len() == f.size);
                if present && !done.contains_key(&f.path) {
                    files.push(f.clone());
                }
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        // The layers this directory now holds: the whole model once any pull took all of it.
        let layers = match (layers, earlier.as_ref().map(|m| m.layers.clone())) {
            (None, _) | (_, Some(None)) => None,
            (Some(range), Some(Some(held))) => Some(merge_ranges(held, range)),
            (Some(range), None) => Some(vec![range]),
        };
        let repo = Some(self.target.repo.clone()).filter(|r| !r.is_empty()).or_else(|| self.holders.iter().find_map(|h| h.repo.clone()));
        let (repo, revision) = (repo, self.hub.get().map(|(c, _)| c.clone()).or_else(|| self.holders.iter().find_map(|h| h.revision.clone())));
        write_manifest(&self.dir, &Manifest { id: self.target.id.clone(), repo, revision, layers, files: files.clone() })?;
        let _ = std::fs::remove_dir(self.dir.join(META_DIR).join("incomplete"));
        let model = inspect(&self.dir).ok_or_else(|| ModelsError::Invalid(format!("{}: pulled but not readable as a model", self.dir.display())))?;
        let (mut from_hub, mut from_peers, mut reused, mut peers_used) = (0, 0, 0, Vec::new());
        for (record, origin) in done.values() {
            match origin {
                Origin::Disk => reused += record.size,
                Origin::Hub(n) => from_hub += n,
                Origin::Peer(p, n) => {
                    from_peers += n;
                    if !peers_used.contains(p) {
                        peers_used.push(*p);
                    }
                }
            }
        }
        Ok(PullOutcome { model, dir: self.dir.clone(), files, from_hub, from_peers, reused, peers_used })
    }
}

/// `held` plus `range`, sorted, with overlapping or touching ranges merged.
fn merge_ranges(mut held: Vec<(u32, u32)>, range: (u32, u32)) -> Vec<(u32, u32)> {
    held.push(range);
    held.sort_unstable();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for (s, e) in held {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

fn read_text(path: &Path) -> Result<String, ModelsError> {
    std::fs::read_to_string(path).map_err(|source| ModelsError::Io { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_to_catalogue_entries_or_repos() {
        let t = resolve(&PullRequest::new("gemma3-270m")).unwrap();
        assert_eq!((t.id.as_str(), t.gguf_file.is_some(), t.pinned.is_some()), ("gemma3-270m", true, true));
        let t = resolve(&PullRequest::new("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF")).unwrap();
        assert_eq!(t.id, "qwen2.5-coder-1.5b", "a catalogued repo keeps the catalogue's id");
        let t = resolve(&PullRequest::new("Some/Model-GGUF:Q8_0")).unwrap();
        assert_eq!((t.id.as_str(), t.quant.as_deref()), ("model-q8_0", Some("q8_0")));
        let t = resolve(&PullRequest::new("Some/Model")).unwrap();
        assert_eq!(t.id, "model");
        assert_eq!(merge_ranges(vec![(0, 1)], (3, 4)), [(0, 1), (3, 4)]);
        assert_eq!(merge_ranges(vec![(0, 1), (3, 4)], (1, 3)), [(0, 4)]);
        assert_eq!(resolve(&PullRequest::new("my-import")).unwrap().repo, "", "a plain id is for peers only");
        for bad in ["a/b/c", "../x", "a/..", ".hidden"] {
            assert!(resolve(&PullRequest::new(bad)).is_err(), "{bad}");
        }
    }
}
