//! The models on this node's disk. The writable store is `<data dir>/models/<id>/`; each
//! `SHOAL_MODELS` directory and the fetch script's cache (`~/.cache/shoal/models`, or
//! `SHOAL_MODEL_CACHE`) are read-only roots that are listed and served but never changed.
//! A model's files and their verified sizes and sha256 live in `<model dir>/.shoal/manifest.json`;
//! a model without one (imported by hand, or in a read-only root) gets its hashes computed on
//! first use and cached by (path, size, mtime). It does not download: `pull` and `hub` do.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::id::{is_valid_id, model_id};
use super::ModelsError;
use crate::engine::model::{ModelSource, WeightFormat};

/// Where a model directory keeps shoal's own files (manifest, partial downloads).
pub const META_DIR: &str = ".shoal";
const MANIFEST: &str = "manifest.json";

/// One model found on disk.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalModel {
    pub id: String,
    /// The path the engine opens: a GGUF file or an HF directory.
    pub path: PathBuf,
    pub format: WeightFormat,
    /// Bytes of weights on disk.
    pub size_bytes: u64,
}

impl LocalModel {
    /// The directory whose files make up the model: the HF directory, or the GGUF's folder
    /// when it is the model's own (`<id>/model.gguf`); `None` for a loose GGUF file.
    pub fn dir(&self) -> Option<&Path> {
        if self.path.is_dir() {
            return Some(&self.path);
        }
        let parent = self.path.parent()?;
        (parent.file_name().map(|n| n.to_string_lossy()) == Some(self.id.as_str().into())).then_some(parent)
    }
}

/// What a model's header says; `None` fields where the header could not be read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelDetails {
    pub family: Option<String>,
    pub layers: Option<usize>,
    /// What placing it takes, with the KV cache reserved for the store's context limit.
    pub footprint: Option<crate::cluster::ModelFootprint>,
}

/// One file of a model, as verified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Relative to the model's directory, `/`-separated.
    pub path: String,
    pub size: u64,
    /// Lowercase hex.
    pub sha256: String,
}

/// What a model directory holds and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub id: String,
    /// The hub repository it was pulled from, if any.
    #[serde(default)]
    pub repo: Option<String>,
    /// The commit it was pulled at, if known.
    #[serde(default)]
    pub revision: Option<String>,
    /// The layer ranges (`[start, end)`, sorted, merged) this directory was fetched for;
    /// `None`: the whole model.
    #[serde(default)]
    pub layers: Option<Vec<(u32, u32)>>,
    pub files: Vec<FileRecord>,
}

impl Manifest {
    pub fn file(&self, path: &str) -> Option<&FileRecord> {
        self.files.iter().find(|f| f.path == path)
    }
}

/// A model's files ready to be served: the manifest and the directory they are relative to.
#[derive(Debug, Clone)]
pub struct Servable {
    pub manifest: Manifest,
    pub base: PathBuf,
}

type FileKey = (PathBuf, u64, Option<SystemTime>);

/// The writable store, the read-only roots, and caches of header details and file hashes.
pub struct Store {
    models_dir: PathBuf,
    read_only: Vec<PathBuf>,
    /// Models named on the command line, listed even when outside every root.
    extra: Vec<PathBuf>,
    details: Mutex<HashMap<FileKey, ModelDetails>>,
    hashes: Mutex<HashMap<FileKey, String>>,
    /// The node's `--context`: the KV cache a model's footprint reserves is sized for it.
    context_limit: Option<usize>,
}

impl Store {
    /// The store of a node whose data directory is `data_dir`, with the standard read-only
    /// roots (`SHOAL_MODELS`, the fetch script's cache).
    pub fn open(data_dir: &Path, extra: Vec<PathBuf>) -> Self {
        let mut read_only = Vec::new();
        if let Some(dirs) = std::env::var_os("SHOAL_MODELS") {
            read_only.extend(std::env::split_paths(&dirs).filter(|p| !p.as_os_str().is_empty()));
        }
        match std::env::var_os("SHOAL_MODEL_CACHE") {
            Some(cache) => read_only.push(PathBuf::from(cache)),
            None => read_only.extend(dirs::home_dir().map(|h| h.join(".cache/shoal/models"))),
        }
        Self::with_roots(data_dir.join("models"), read_only, extra)
    }

    /// A store with explicit roots and nothing from the environment (tests, tools).
    pub fn with_roots(models_dir: PathBuf, read_only: Vec<PathBuf>, extra: Vec<PathBuf>) -> Self {
        Store { models_dir, read_only, extra, details: Mutex::new(HashMap::new()), hashes: Mutex::new(HashMap::new()), context_limit: None }
    }

    /// The same store for a node serving with `--context` (see `ModelDetails::footprint`).
    pub fn with_context_limit(mut self, context_limit: Option<usize>) -> Self {
        self.context_limit = context_limit;
        self
    }

    /// `<data dir>/models`, where pulls and imports go.
    pub fn models_dir(&self) -> &Path {
        &self.models_dir
    }

    /// Every model found now; the first path wins when two share an id (command line, then
    /// the data dir, then the read-only roots in order). Blocking file I/O.
    pub fn scan(&self) -> Vec<LocalModel> {
        let mut found: Vec<LocalModel> = Vec::new();
        let roots = std::iter::once(&self.models_dir).chain(&self.read_only);
        let candidates = self.extra.iter().cloned().chain(roots.flat_map(|root| {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(root).into_iter().flatten().filter_map(|e| e.ok().map(|e| e.path())).collect();
            entries.retain(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')));
            entries.sort();
            entries
        }));
        for path in candidates {
            if let Some(model) = inspect(&path) {
                if !found.iter().any(|m| m.id == model.id || m.path == model.path) {
                    found.push(model);
                }
            }
        }
        found
    }

    /// The ids of every model on disk, for `NodeAdvert::models`. Blocking file I/O.
    pub fn held(&self) -> Vec<String> {
        self.scan().into_iter().map(|m| m.id).collect()
    }

    /// The model `id` names, if it is on disk.
    pub fn find(&self, id: &str) -> Option<LocalModel> {
        self.scan().into_iter().find(|m| m.id == id)
    }

    /// Whether `model` lives in the writable store (and so may be removed or completed).
    pub fn is_writable(&self, model: &LocalModel) -> bool {
        model.path.starts_with(&self.models_dir)
    }

    /// Family and layer count from the header (cached). Blocking file I/O.
    pub fn details(&self, model: &LocalModel) -> ModelDetails {
        let key = file_key(&model.path, model.size_bytes);
        if let Some(d) = lock(&self.details).get(&key) {
            return d.clone();
        }
        let details = match ModelSource::open(&model.path) {
            Ok(source) => ModelDetails { family: Some(source.spec.family.name().to_string()), layers: Some(source.spec.num_layers), footprint: Some(super::footprint(&model.id, &source, self.context_limit)) },
            Err(e) => {
                tracing::warn!(path = %model.path.display(), error = %e, "model header unreadable");
                ModelDetails::default()
            }
        };
        lock(&self.details).insert(key, details.clone());
        details
    }

    /// The writable directory of model `id` (which need not exist yet).
    pub fn model_dir(&self, id: &str) -> Result<PathBuf, ModelsError> {
        if !is_valid_id(id) {
            return Err(ModelsError::Invalid(format!("`{id}` cannot name a model directory")));
        }
        Ok(self.models_dir.join(id))
    }

    /// Deletes model `id` from the writable store; a model in a read-only root is refused.
    pub fn remove(&self, id: &str) -> Result<PathBuf, ModelsError> {
        let model = self.find(id).ok_or_else(|| ModelsError::UnknownModel { id: id.into(), hint: "not on this node (see `shoal models list`)".into() })?;
        if !self.is_writable(&model) {
            return Err(ModelsError::Invalid(format!("{id} lives in a read-only directory ({}); remove it there", model.path.display())));
        }
        let target = model.dir().map(Path::to_path_buf).unwrap_or_else(|| model.path.clone());
        let result = if target.is_dir() { std::fs::remove_dir_all(&target) } else { std::fs::remove_file(&target) };
        result.map_err(|source| ModelsError::Io { path: target.clone(), source })?;
        Ok(target)
    }

    /// Copies (hard-links where it can) a GGUF file or a safetensors folder into the store;
    /// its id is the folder's name or the file's stem. Hashes every file into the manifest.
    pub fn import(&self, source: &Path) -> Result<LocalModel, ModelsError> {
        let model = inspect(source).ok_or_else(|| ModelsError::Invalid(format!("{}: neither a GGUF file nor a folder with config.json and safetensors", source.display())))?;
        let dir = self.model_dir(&model.id)?;
        if dir.exists() {
            return Err(ModelsError::Invalid(format!("{} is already in the store ({}); `shoal models rm {}` first", model.id, dir.display(), model.id)));
        }
        let files: Vec<(PathBuf, String)> = match source.is_dir() {
            true => model_files(source).into_iter().map(|rel| (source.join(&rel), rel)).collect(),
            // A loose file keeps its name inside its new folder (the folder's one GGUF).
            false => vec![(model.path.clone(), model.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model.gguf".into()))],
        };
        let staging = self.models_dir.join(format!(".import-{}", model.id));
        let _ = std::fs::remove_dir_all(&staging);
        let mut records = Vec::new();
        for (from, rel) in &files {
            let to = staging.join(rel);
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent).map_err(|source| ModelsError::Io { path: parent.to_path_buf(), source })?;
            }
            if std::fs::hard_link(from, &to).is_err() {
                std::fs::copy(from, &to).map_err(|source| ModelsError::Io { path: to.clone(), source })?;
            }
            let size = std::fs::metadata(&to).map_err(|source| ModelsError::Io { path: to.clone(), source })?.len();
            records.push(FileRecord { path: rel.clone(), size, sha256: self.sha256_of(&to)? });
        }
        write_manifest(&staging, &Manifest { id: model.id.clone(), repo: None, revision: None, layers: None, files: records })?;
        std::fs::rename(&staging, &dir).map_err(|source| ModelsError::Io { path: dir.clone(), source })?;
        inspect(&dir).ok_or_else(|| ModelsError::Invalid(format!("{}: imported but not readable as a model", dir.display())))
    }

    /// Model `id`'s files with their sizes and hashes, for peers: the stored manifest where
    /// every listed file is still on disk with its recorded size, else hashes computed now
    /// (cached). Blocking file I/O; the first call on a large model reads every byte.
    pub fn servable(&self, id: &str) -> Result<Servable, ModelsError> {
        let model = self.find(id).ok_or_else(|| ModelsError::UnknownModel { id: id.into(), hint: "not on this node".into() })?;
        let Some(base) = model.dir().map(Path::to_path_buf) else {
            let name = model.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let record = FileRecord { path: name, size: model.size_bytes, sha256: self.sha256_of(&model.path)? };
            let base = model.path.parent().map(Path::to_path_buf).unwrap_or_default();
            return Ok(Servable { manifest: Manifest { id: model.id, repo: None, revision: None, layers: None, files: vec![record] }, base });
        };
        if let Some(manifest) = read_manifest(&base) {
            let intact = manifest.files.iter().all(|f| std::fs::metadata(base.join(&f.path)).is_ok_and(|m| m.len() == f.size));
            if intact && manifest.id == model.id {
                return Ok(Servable { manifest, base });
            }
        }
        let mut files = Vec::new();
        for rel in model_files(&base) {
            let path = base.join(&rel);
            let size = std::fs::metadata(&path).map_err(|source| ModelsError::Io { path: path.clone(), source })?.len();
            files.push(FileRecord { path: rel, size, sha256: self.sha256_of(&path)? });
        }
        Ok(Servable { manifest: Manifest { id: model.id, repo: None, revision: None, layers: None, files }, base })
    }

    /// The sha256 of a file, cached by (path, size, mtime). Blocking file I/O.
    pub fn sha256_of(&self, path: &Path) -> Result<String, ModelsError> {
        let size = std::fs::metadata(path).map_err(|source| ModelsError::Io { path: path.to_path_buf(), source })?.len();
        let key = file_key(path, size);
        if let Some(h) = lock(&self.hashes).get(&key) {
            return Ok(h.clone());
        }
        let hash = sha256_file(path)?;
        lock(&self.hashes).insert(key, hash.clone());
        Ok(hash)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding a cache lock leaves a usable cache: recover it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn file_key(path: &Path, size: u64) -> FileKey {
    (path.to_path_buf(), size, std::fs::metadata(path).and_then(|m| m.modified()).ok())
}

/// Lowercase hex sha256 of a whole file.
pub fn sha256_file(path: &Path) -> Result<String, ModelsError> {
    let io = |source| ModelsError::Io { path: path.to_path_buf(), source };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `path` (from a peer or a hub listing) may name a file inside a model directory:
/// relative, `/`-separated plain names, none empty, hidden (`.x`, so never `..`) or odd.
pub fn is_safe_relative(path: &str) -> bool {
    !path.is_empty() && path.len() <= 1024 && path.split('/').all(|part| !part.is_empty() && !part.starts_with('.') && !part.contains(['\\', ':']) && !part.chars().any(char::is_control))
}

/// The manifest of a model directory, if it has a readable one.
pub fn read_manifest(dir: &Path) -> Option<Manifest> {
    let text = std::fs::read_to_string(dir.join(META_DIR).join(MANIFEST)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Writes a model directory's manifest (atomically: a temporary file, then a rename).
pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), ModelsError> {
    let meta = dir.join(META_DIR);
    std::fs::create_dir_all(&meta).map_err(|source| ModelsError::Io { path: meta.clone(), source })?;
    let tmp = meta.join(format!("{MANIFEST}.tmp"));
    let text = serde_json::to_string_pretty(manifest).map_err(|e| ModelsError::Invalid(e.to_string()))?;
    std::fs::write(&tmp, text).map_err(|source| ModelsError::Io { path: tmp.clone(), source })?;
    std::fs::rename(&tmp, meta.join(MANIFEST)).map_err(|source| ModelsError::Io { path: meta.join(MANIFEST), source })
}

/// The files that make up a model directory: every regular file, recursively, except hidden
/// ones (and so except `.shoal/`), as `/`-separated relative paths in sorted order.
pub fn model_files(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            match entry.file_type() {
                Ok(t) if t.is_dir() => walk(root, &path, out),
                Ok(_) if path.is_file() => {
                    if let Ok(rel) = path.strip_prefix(root) {
                        out.push(rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/"));
                    }
                }
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// A path → the model it holds: a `.gguf` file, a directory with `config.json` and
/// safetensors, or a directory holding exactly one `.gguf`.
pub fn inspect(path: &Path) -> Option<LocalModel> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_file() {
        if path.extension()? != "gguf" {
            return None;
        }
        return Some(LocalModel { id: model_id(path), path: path.to_path_buf(), format: WeightFormat::Gguf, size_bytes: meta.len() });
    }
    let files: Vec<PathBuf> = std::fs::read_dir(path).ok()?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    let with_ext = |ext: &str| files.iter().filter(|p| p.extension().is_some_and(|x| x == ext)).collect::<Vec<_>>();
    let safetensors = with_ext("safetensors");
    if path.join("config.json").is_file() && !safetensors.is_empty() {
        let size_bytes = safetensors.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
        return Some(LocalModel { id: model_id(path), path: path.to_path_buf(), format: WeightFormat::Safetensors, size_bytes });
    }
    match with_ext("gguf").as_slice() {
        [one] => inspect(one),
        _ => None,
    }
}

/// Any existing path the engine may open (it checks the GGUF magic, not the extension).
pub fn any_model_path(path: &Path) -> Option<LocalModel> {
    let meta = std::fs::metadata(path).ok()?;
    meta.is_file().then(|| LocalModel { id: model_id(path), path: path.to_path_buf(), format: WeightFormat::Gguf, size_bytes: meta.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_and_directories_are_named_as_the_engine_names_them() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join("models");
        std::fs::create_dir_all(models.join("tiny-llama-1.1b")).unwrap();
        std::fs::write(models.join("tiny-llama-1.1b/model.gguf"), b"GGUF....").unwrap();
        std::fs::write(models.join("solo.gguf"), b"GGUF").unwrap();
        std::fs::create_dir_all(models.join("hf-model")).unwrap();
        std::fs::write(models.join("hf-model/config.json"), b"{}").unwrap();
        std::fs::write(models.join("hf-model/model.safetensors"), b"12345").unwrap();
        std::fs::write(models.join("notes.txt"), b"not a model").unwrap();
        let store = Store::with_roots(models.clone(), vec![], vec![]);
        let ids: Vec<(String, u64)> = store.scan().into_iter().map(|m| (m.id, m.size_bytes)).collect();
        assert_eq!(ids, vec![("hf-model".into(), 5), ("solo".into(), 4), ("tiny-llama-1.1b".into(), 8)]);
        assert_eq!(store.find("tiny-llama-1.1b").unwrap().path, models.join("tiny-llama-1.1b/model.gguf"));
        assert_eq!(store.find("tiny-llama-1.1b").unwrap().dir(), Some(models.join("tiny-llama-1.1b").as_path()));
        assert_eq!(store.find("solo").unwrap().dir(), None);
        // An unreadable header gives empty details, not an error.
        assert_eq!(store.details(&store.find("solo").unwrap()), ModelDetails::default());
    }

    #[test]
    fn import_hashes_every_file_and_rm_deletes_only_writable_models() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside/my-model");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("config.json"), b"{}").unwrap();
        std::fs::write(outside.join("model.safetensors"), b"abc").unwrap();
        let ro = dir.path().join("ro");
        std::fs::create_dir_all(&ro).unwrap();
        std::fs::write(ro.join("frozen.gguf"), b"GGUF").unwrap();
        let store = Store::with_roots(dir.path().join("models"), vec![ro.clone()], vec![]);
        std::fs::create_dir_all(store.models_dir()).unwrap();
        let imported = store.import(&outside).unwrap();
        assert_eq!(imported.id, "my-model");
        let servable = store.servable("my-model").unwrap();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(servable.manifest.file("model.safetensors").unwrap().sha256, abc);
        assert!(store.import(&outside).is_err(), "a second import of the same id is refused");
        for bad in ["", "/etc/passwd", "../x.gguf", "a/../../b", ".shoal/manifest.json", "a//b", "c:\\x", "a\\..\\b"] {
            assert!(!is_safe_relative(bad), "{bad:?}");
        }
        assert!(is_safe_relative("model.gguf") && is_safe_relative("sub/model-00001-of-00002.safetensors"));
        assert!(store.remove("frozen").is_err(), "read-only roots are never changed");
        assert!(ro.join("frozen.gguf").exists());
        store.remove("my-model").unwrap();
        assert!(store.find("my-model").is_none());
        assert!(outside.join("model.safetensors").exists(), "the source of an import is untouched");
    }
}
