//! Which files of a repo a node fetches: the one GGUF (named with `--file`, `repo:quant`, or
//! a sensible default quantization), or a safetensors model's configs, tokenizer and weight
//! files — for a pipeline stage only the shards that hold its layers, read from
//! `model.safetensors.index.json`. Pure functions of file lists and index text: no I/O.

use std::collections::BTreeSet;

use super::ModelsError;

/// Quantizations in order of preference when a repo holds several GGUF files: a good balance
/// of size and quality first (what llama.cpp's users pick by default), then larger, then smaller.
const QUANT_PREFERENCE: &[&str] = &["q4_k_m", "q4_k_s", "q5_k_m", "q4_0", "q5_0", "q6_k", "q8_0", "q3_k_m", "q3_k_l", "iq4_xs", "q2_k", "f16", "bf16", "f32"];

/// Small files of a safetensors model that every node needs, fetched when the repo has them.
pub const SUPPORT_FILES: &[&str] = &["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "chat_template.json"];

pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The quantization tag in a GGUF file name (`...-Q4_K_M.gguf` → `q4_k_m`), if any.
pub fn quant_of(file: &str) -> Option<&'static str> {
    let lower = file.to_ascii_lowercase();
    let stem = lower.strip_suffix(".gguf")?;
    // Longest tags first, so that `q4_k_m` is not read as `q4_k`.
    let mut tags: Vec<&'static str> = QUANT_PREFERENCE.to_vec();
    tags.sort_by_key(|t| std::cmp::Reverse(t.len()));
    tags.into_iter().find(|t| stem.ends_with(t) && stem[..stem.len() - t.len()].ends_with(['-', '.', '_']))
}

/// The GGUF file to fetch among `files`: the one named by `file`, else the one whose
/// quantization is `quant`, else the only one, else the most preferred quantization.
/// Split GGUFs (`-00001-of-00003.gguf`) are not supported and are never chosen.
pub fn choose_gguf(repo: &str, files: &[&str], file: Option<&str>, quant: Option<&str>) -> Result<String, ModelsError> {
    let ggufs: Vec<&str> = files.iter().copied().filter(|f| f.to_ascii_lowercase().ends_with(".gguf") && !f.contains("-of-")).collect();
    if let Some(f) = file {
        return ggufs.iter().find(|g| **g == f).map(|g| g.to_string()).ok_or_else(|| ModelsError::NotFound { what: format!("{f} in {repo}"), url: format!("(the repo has: {})", list(&ggufs)) });
    }
    if let Some(q) = quant {
        let q = q.to_ascii_lowercase();
        let matching: Vec<&str> = ggufs.iter().copied().filter(|g| quant_of(g) == Some(q.as_str()) || g.to_ascii_lowercase().trim_end_matches(".gguf").ends_with(&q)).collect();
        return match matching.as_slice() {
            [one] => Ok(one.to_string()),
            [] => Err(ModelsError::NotFound { what: format!("a {q} GGUF in {repo}"), url: format!("(the repo has: {})", list(&ggufs)) }),
            _ => Err(ModelsError::AmbiguousFile { repo: repo.into(), choices: list(&matching) }),
        };
    }
    match ggufs.as_slice() {
        [] => Err(ModelsError::NotFound { what: format!("a GGUF file in {repo}"), url: "(none listed)".into() }),
        [one] => Ok(one.to_string()),
        several => {
            for q in QUANT_PREFERENCE {
                let hits: Vec<&str> = several.iter().copied().filter(|g| quant_of(g) == Some(*q)).collect();
                if let [one] = hits.as_slice() {
                    return Ok(one.to_string());
                }
                if hits.len() > 1 {
                    return Err(ModelsError::AmbiguousFile { repo: repo.into(), choices: list(&hits) });
                }
            }
            Err(ModelsError::AmbiguousFile { repo: repo.into(), choices: list(several) })
        }
    }
}

fn list(files: &[&str]) -> String {
    if files.is_empty() { "none".into() } else { files.join(", ") }
}

/// Whether `files` describe a safetensors model.
pub fn is_safetensors_repo(files: &[&str]) -> bool {
    files.iter().any(|f| f.ends_with(".safetensors")) && files.contains(&"config.json")
}

/// The support files present in the repo.
pub fn support_files(files: &[&str]) -> Vec<String> {
    SUPPORT_FILES.iter().filter(|s| files.contains(s)).map(|s| s.to_string()).chain(files.contains(&INDEX_FILE).then(|| INDEX_FILE.to_string())).collect()
}

/// Every weight file of a safetensors repo (top level only).
pub fn all_weight_files(files: &[&str]) -> Vec<String> {
    files.iter().filter(|f| f.ends_with(".safetensors") && !f.contains('/')).map(|f| f.to_string()).collect()
}

/// The weight files that hold layers `[start, end)` of a model with `num_layers` layers,
/// from the text of its `model.safetensors.index.json`: every file with a tensor of one of
/// those layers, the embedding's file for the first stage, and the final norm's and LM
/// head's (or, with tied embeddings, the embedding's) for the last.
pub fn files_for_layers(index_json: &str, start: u32, end: u32, num_layers: u32) -> Result<Vec<String>, ModelsError> {
    if start >= end || end > num_layers {
        return Err(ModelsError::Invalid(format!("layers {start}..{end} are not a range of this model's {num_layers} layers")));
    }
    let index: serde_json::Value = serde_json::from_str(index_json).map_err(|e| ModelsError::Invalid(format!("{INDEX_FILE}: {e}")))?;
    let map = index.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelsError::Invalid(format!("{INDEX_FILE}: no weight_map")))?;
    let first = start == 0;
    let last = end == num_layers;
    let has_head = map.keys().any(|k| k == "lm_head.weight" || k.ends_with(".lm_head.weight"));
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else { continue };
        if file.contains('/') || file.starts_with('.') {
            return Err(ModelsError::Invalid(format!("{INDEX_FILE}: {file} is not a file of the repo's top level")));
        }
        let needed = match layer_of(tensor) {
            Some(l) => l >= start && l < end,
            None if tensor.contains("embed_tokens") => first || (last && !has_head),
            None => last, // final norm, LM head, and anything else outside the layers
        };
        if needed {
            files.insert(file.to_string());
        }
    }
    Ok(files.into_iter().collect())
}

/// `model.layers.12.mlp.up_proj.weight` → 12.
fn layer_of(tensor: &str) -> Option<u32> {
    let rest = tensor.split("layers.").nth(1)?;
    rest.split('.').next()?.parse().ok()
}

/// `num_hidden_layers` from a `config.json` text (also under `text_config`).
pub fn layers_in_config(config_json: &str) -> Option<u32> {
    let v: serde_json::Value = serde_json::from_str(config_json).ok()?;
    let n = v.get("num_hidden_layers").or_else(|| v.get("text_config")?.get("num_hidden_layers"))?;
    n.as_u64().and_then(|n| u32::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sensible_gguf_is_chosen() {
        let files = ["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-f16.gguf", "big-Q4_K_M-00001-of-00002.gguf"];
        assert_eq!(choose_gguf("r", &files, None, None).unwrap(), "m-Q4_K_M.gguf");
        assert_eq!(choose_gguf("r", &files, None, Some("Q8_0")).unwrap(), "m-Q8_0.gguf");
        assert_eq!(choose_gguf("r", &files, Some("m-f16.gguf"), None).unwrap(), "m-f16.gguf");
        assert!(matches!(choose_gguf("r", &files, None, Some("q2_k")), Err(ModelsError::NotFound { .. })));
        assert_eq!(choose_gguf("r", &["only.gguf"], None, None).unwrap(), "only.gguf");
        assert!(matches!(choose_gguf("r", &["a.gguf", "b.gguf"], None, None), Err(ModelsError::AmbiguousFile { .. })));
        assert_eq!(quant_of("qwen2.5-0.5b-instruct-q4_k_m.gguf"), Some("q4_k_m"));
        assert_eq!(quant_of("tinyllama.Q4_K_S.gguf"), Some("q4_k_s"));
    }

    #[test]
    fn a_stage_fetches_only_the_shards_holding_its_layers() {
        let index = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/llama/model.safetensors.index.json")).unwrap();
        let config = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/llama/config.json")).unwrap();
        let n = layers_in_config(&config).unwrap();
        let all = files_for_layers(&index, 0, n, n).unwrap();
        assert_eq!(all.len(), 3);
        let first = files_for_layers(&index, 0, 1, n).unwrap();
        assert!(first.contains(&"model-00001-of-00003.safetensors".to_string()));
        assert!(!first.contains(&"model-00003-of-00003.safetensors".to_string()), "{first:?}");
        let last = files_for_layers(&index, n - 1, n, n).unwrap();
        assert!(last.contains(&"model-00003-of-00003.safetensors".to_string()));
        assert!(files_for_layers(&index, 2, 1, n).is_err());
        assert!(files_for_layers(r#"{"weight_map": {"a": "../../etc/passwd"}}"#, 0, 1, 1).is_err());
    }
}
