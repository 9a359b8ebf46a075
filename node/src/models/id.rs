//! The one rule that names a model on disk, used by the store, the API and the engine alike:
//! a Hugging Face directory, or a directory holding a `model.gguf` (or exactly one `.gguf`),
//! is named by the directory's whole name (`qwen2.5-coder-1.5b`, dots kept); a loose GGUF
//! file by its file name without `.gguf`. A pure function of the path's shape: it reads the
//! file system only to tell a directory from a file, and never opens a model.

use std::path::Path;

/// The model id of `path`: see the module doc.
pub fn model_id(path: &Path) -> String {
    let in_own_dir = path.file_name().is_some_and(|n| n == "model.gguf");
    let dir = if in_own_dir { path.parent() } else { path.is_dir().then_some(path) };
    let name = match dir {
        Some(d) => d.file_name(),
        None => path.file_stem(),
    };
    name.map(|s| s.to_string_lossy().into_owned()).filter(|s| !s.is_empty()).unwrap_or_else(|| "model".into())
}

/// Whether `id` may name a directory of the store: non-empty, no path separators, not `.`
/// or `..`, no leading dot (hidden), printable ASCII or any non-control character.
pub fn is_valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 200
        && !id.starts_with('.')
        && !id.contains(['/', '\\'])
        && !id.chars().any(|c| c.is_control())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_keep_their_whole_name_and_files_lose_the_extension() {
        let dir = tempfile::tempdir().unwrap();
        let model_dir = dir.path().join("qwen2.5-coder-1.5b");
        std::fs::create_dir_all(&model_dir).unwrap();
        assert_eq!(model_id(&model_dir), "qwen2.5-coder-1.5b");
        assert_eq!(model_id(&model_dir.join("model.gguf")), "qwen2.5-coder-1.5b");
        assert_eq!(model_id(&dir.path().join("solo.q4_k_m.gguf")), "solo.q4_k_m");
        assert!(is_valid_id("qwen2.5-coder-1.5b"));
        for bad in ["", ".", "..", ".hidden", "a/b", "a\\b", "x\ny"] {
            assert!(!is_valid_id(bad), "{bad:?}");
        }
    }
}
