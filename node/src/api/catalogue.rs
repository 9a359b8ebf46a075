//! The model files on this node's disk: GGUF files and Hugging Face directories under the
//! data dir's `models/`, each `SHOAL_MODELS` dir, and the fetch script's cache, named as the
//! engine names them (`ModelSource::name`: the file stem, or the directory of a `model.gguf`).
//! Family and layer count come from the file's header, read once per file version and cached.
//! It does not download, copy or delete models; the planned `models` layer will own this.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use crate::engine::model::{ModelSource, WeightFormat};

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

/// What a model's header says; `None` fields where the header could not be read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModelDetails {
    pub family: Option<String>,
    pub layers: Option<usize>,
}

/// Where to look for models, plus a cache of header details keyed by path, size and mtime.
pub struct Catalogue {
    roots: Vec<PathBuf>,
    /// Models named on the command line, listed even when outside every root.
    extra: Vec<PathBuf>,
    details: Mutex<HashMap<(PathBuf, u64, Option<SystemTime>), ModelDetails>>,
}

impl Catalogue {
    /// The standard roots for a node whose data directory is `data_dir`.
    pub fn new(data_dir: &Path, extra: Vec<PathBuf>) -> Self {
        let mut roots = vec![data_dir.join("models")];
        if let Some(dirs) = std::env::var_os("SHOAL_MODELS") {
            roots.extend(std::env::split_paths(&dirs).filter(|p| !p.as_os_str().is_empty()));
        }
        match std::env::var_os("SHOAL_MODEL_CACHE") {
            Some(cache) => roots.push(PathBuf::from(cache)),
            None => roots.extend(dirs::home_dir().map(|h| h.join(".cache/shoal/models"))),
        }
        Catalogue { roots, extra, details: Mutex::new(HashMap::new()) }
    }

    /// Every model found now, first name wins when two paths share an id. Blocking file I/O.
    pub fn scan(&self) -> Vec<LocalModel> {
        let mut found: Vec<LocalModel> = Vec::new();
        let candidates = self.extra.iter().cloned().chain(self.roots.iter().flat_map(|root| {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(root).into_iter().flatten().filter_map(|e| e.ok().map(|e| e.path())).collect();
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

    /// The model a request's `model` names, if it is on disk.
    pub fn find(&self, id: &str) -> Option<LocalModel> {
        self.scan().into_iter().find(|m| m.id == id)
    }

    /// Family and layer count from the header (cached). Blocking file I/O.
    pub fn details(&self, model: &LocalModel) -> ModelDetails {
        let mtime = std::fs::metadata(&model.path).and_then(|m| m.modified()).ok();
        let key = (model.path.clone(), model.size_bytes, mtime);
        if let Some(d) = self.details.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
            return d.clone();
        }
        let details = match ModelSource::open(&model.path) {
            Ok(source) => ModelDetails { family: Some(source.spec.family.name().to_string()), layers: Some(source.spec.num_layers) },
            Err(e) => {
                tracing::warn!(path = %model.path.display(), error = %e, "model header unreadable");
                ModelDetails::default()
            }
        };
        self.details.lock().unwrap_or_else(|p| p.into_inner()).insert(key, details.clone());
        details
    }
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

/// A model's id: the file stem, or the directory's whole name for a directory or a
/// `model.gguf` inside one (`ModelSource::name`'s rule, except that a directory keeps the
/// dots in its name: `qwen2.5-coder-1.5b`).
pub fn model_id(path: &Path) -> String {
    let dir = if path.file_name().is_some_and(|n| n == "model.gguf") { path.parent() } else { path.is_dir().then_some(path) };
    let name = match dir {
        Some(d) => d.file_name(),
        None => path.file_stem(),
    };
    name.map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
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
        let catalogue = Catalogue { roots: vec![models.clone()], extra: vec![], details: Mutex::new(HashMap::new()) };
        let ids: Vec<(String, u64)> = catalogue.scan().into_iter().map(|m| (m.id, m.size_bytes)).collect();
        assert_eq!(ids, vec![("hf-model".into(), 5), ("solo".into(), 4), ("tiny-llama-1.1b".into(), 8)]);
        assert_eq!(catalogue.find("tiny-llama-1.1b").unwrap().path, models.join("tiny-llama-1.1b/model.gguf"));
        // An unreadable header gives empty details, not an error.
        assert_eq!(catalogue.details(&catalogue.find("solo").unwrap()), ModelDetails::default());
    }
}
