//! The catalogue: models shoal knows before anything is downloaded (id, family, layers,
//! hidden size, context, bytes per format, and where each format lives on the hub), for
//! placement, the UI and `shoal models pull <id>`. Only the families the engine runs.
//! Sizes are as published on the hub, rounded (exact for the two registry-packaged models,
//! whose sha256 is pinned); the hub could not be reached from where this list was written,
//! so repo and file names are unverified here. It does not look at the disk or the network.

use serde::Serialize;

/// How a format's weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Gguf,
    Safetensors,
}

/// One way to get a model: a format and quantization, its size, and its hub files.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Variant {
    pub format: Format,
    /// `Q4_K_M`, `Q8_0`, `bf16`, ...
    pub quant: &'static str,
    /// Bytes of weights.
    pub bytes: u64,
    pub repo: &'static str,
    /// GGUF: the one file. Safetensors: empty, meaning every `*.safetensors` of the repo
    /// (or, for a stage, those holding its layers) plus configs and tokenizer.
    pub file: &'static str,
    /// The file's sha256 where it is pinned (registry-packaged copies).
    pub sha256: Option<&'static str>,
}

/// A model the catalogue knows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KnownModel {
    pub id: &'static str,
    /// The engine's family name (`llama`, `mistral`, `qwen2`, `qwen3`, `gemma3`).
    pub family: &'static str,
    pub layers: u32,
    pub hidden_size: u32,
    /// The model's own context window, tokens.
    pub context: u32,
    /// The first variant is the default for `shoal models pull <id>`.
    pub variants: &'static [Variant],
}

impl KnownModel {
    pub fn default_variant(&self) -> &Variant {
        &self.variants[0]
    }

    /// Bytes of the smallest variant: what placement should assume before a download.
    pub fn smallest_bytes(&self) -> u64 {
        self.variants.iter().map(|v| v.bytes).min().unwrap_or(0)
    }
}

const fn gguf(quant: &'static str, bytes: u64, repo: &'static str, file: &'static str) -> Variant {
    Variant { format: Format::Gguf, quant, bytes, repo, file, sha256: None }
}

const fn st(bytes: u64, repo: &'static str) -> Variant {
    Variant { format: Format::Safetensors, quant: "bf16", bytes, repo, file: "", sha256: None }
}

const GB: u64 = 1_000_000_000;
const MB: u64 = 1_000_000;

/// Every known model, smallest families first.
pub const MODELS: &[KnownModel] = &[
    KnownModel {
        id: "gemma3-270m",
        family: "gemma3",
        layers: 18,
        hidden_size: 640,
        context: 32_768,
        variants: &[
            Variant {
                format: Format::Gguf,
                quant: "Q4_K_M",
                bytes: 253_113_024,
                repo: "unsloth/gemma-3-270m-GGUF",
                file: "gemma-3-270m-Q4_K_M.gguf",
                sha256: Some("a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
            },
            st(536 * MB, "google/gemma-3-270m"),
        ],
    },
    KnownModel {
        id: "gemma3-1b",
        family: "gemma3",
        layers: 26,
        hidden_size: 1152,
        context: 32_768,
        variants: &[gguf("Q4_K_M", 806 * MB, "unsloth/gemma-3-1b-it-GGUF", "gemma-3-1b-it-Q4_K_M.gguf"), st(2 * GB, "google/gemma-3-1b-it")],
    },
    KnownModel {
        id: "qwen2.5-0.5b",
        family: "qwen2",
        layers: 24,
        hidden_size: 896,
        context: 32_768,
        variants: &[gguf("Q4_K_M", 491 * MB, "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf"), st(988 * MB, "Qwen/Qwen2.5-0.5B-Instruct")],
    },
    KnownModel {
        id: "qwen2.5-1.5b",
        family: "qwen2",
        layers: 28,
        hidden_size: 1536,
        context: 32_768,
        variants: &[gguf("Q4_K_M", 1_120 * MB, "Qwen/Qwen2.5-1.5B-Instruct-GGUF", "qwen2.5-1.5b-instruct-q4_k_m.gguf"), st(3_090 * MB, "Qwen/Qwen2.5-1.5B-Instruct")],
    },
    KnownModel {
        id: "qwen2.5-coder-1.5b",
        family: "qwen2",
        layers: 28,
        hidden_size: 1536,
        context: 32_768,
        variants: &[
            Variant {
                format: Format::Gguf,
                quant: "Q4_K_M",
                bytes: 1_117_320_768,
                repo: "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                sha256: Some("cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
            },
            st(3_090 * MB, "Qwen/Qwen2.5-Coder-1.5B-Instruct"),
        ],
    },
    KnownModel {
        id: "qwen2.5-7b",
        family: "qwen2",
        layers: 28,
        hidden_size: 3584,
        context: 32_768,
        variants: &[gguf("Q4_K_M", 4_680 * MB, "Qwen/Qwen2.5-7B-Instruct-GGUF", "qwen2.5-7b-instruct-q4_k_m.gguf"), st(15_230 * MB, "Qwen/Qwen2.5-7B-Instruct")],
    },
    KnownModel {
        id: "qwen3-0.6b",
        family: "qwen3",
        layers: 28,
        hidden_size: 1024,
        context: 40_960,
        variants: &[gguf("Q8_0", 639 * MB, "Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf"), st(1_500 * MB, "Qwen/Qwen3-0.6B")],
    },
    KnownModel {
        id: "qwen3-1.7b",
        family: "qwen3",
        layers: 28,
        hidden_size: 2048,
        context: 40_960,
        variants: &[gguf("Q8_0", 1_830 * MB, "Qwen/Qwen3-1.7B-GGUF", "Qwen3-1.7B-Q8_0.gguf"), st(4_060 * MB, "Qwen/Qwen3-1.7B")],
    },
    KnownModel {
        id: "qwen3-4b",
        family: "qwen3",
        layers: 36,
        hidden_size: 2560,
        context: 40_960,
        variants: &[gguf("Q4_K_M", 2_500 * MB, "Qwen/Qwen3-4B-GGUF", "Qwen3-4B-Q4_K_M.gguf"), st(8_050 * MB, "Qwen/Qwen3-4B")],
    },
    KnownModel {
        id: "qwen3-8b",
        family: "qwen3",
        layers: 36,
        hidden_size: 4096,
        context: 40_960,
        variants: &[gguf("Q4_K_M", 5_030 * MB, "Qwen/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf"), st(16_380 * MB, "Qwen/Qwen3-8B")],
    },
    KnownModel {
        id: "smollm2-135m",
        family: "llama",
        layers: 30,
        hidden_size: 576,
        context: 8_192,
        variants: &[st(269 * MB, "HuggingFaceTB/SmolLM2-135M-Instruct")],
    },
    KnownModel {
        id: "smollm2-360m",
        family: "llama",
        layers: 32,
        hidden_size: 960,
        context: 8_192,
        variants: &[st(724 * MB, "HuggingFaceTB/SmolLM2-360M-Instruct")],
    },
    KnownModel {
        id: "smollm2-1.7b",
        family: "llama",
        layers: 24,
        hidden_size: 2048,
        context: 8_192,
        variants: &[st(3_420 * MB, "HuggingFaceTB/SmolLM2-1.7B-Instruct")],
    },
    KnownModel {
        id: "tinyllama-1.1b",
        family: "llama",
        layers: 22,
        hidden_size: 2048,
        context: 2_048,
        variants: &[gguf("Q4_K_M", 669 * MB, "TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF", "tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf"), st(2_200 * MB, "TinyLlama/TinyLlama-1.1B-Chat-v1.0")],
    },
    KnownModel {
        id: "llama3.2-1b",
        family: "llama",
        layers: 16,
        hidden_size: 2048,
        context: 131_072,
        variants: &[gguf("Q4_K_M", 808 * MB, "bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q4_K_M.gguf"), st(2_470 * MB, "meta-llama/Llama-3.2-1B-Instruct")],
    },
    KnownModel {
        id: "llama3.2-3b",
        family: "llama",
        layers: 28,
        hidden_size: 3072,
        context: 131_072,
        variants: &[gguf("Q4_K_M", 2_020 * MB, "bartowski/Llama-3.2-3B-Instruct-GGUF", "Llama-3.2-3B-Instruct-Q4_K_M.gguf"), st(6_430 * MB, "meta-llama/Llama-3.2-3B-Instruct")],
    },
    KnownModel {
        id: "llama3.1-8b",
        family: "llama",
        layers: 32,
        hidden_size: 4096,
        context: 131_072,
        variants: &[gguf("Q4_K_M", 4_920 * MB, "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF", "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf"), st(16_060 * MB, "meta-llama/Llama-3.1-8B-Instruct")],
    },
    KnownModel {
        id: "mistral-7b",
        family: "mistral",
        layers: 32,
        hidden_size: 4096,
        context: 32_768,
        variants: &[gguf("Q4_K_M", 4_370 * MB, "bartowski/Mistral-7B-Instruct-v0.3-GGUF", "Mistral-7B-Instruct-v0.3-Q4_K_M.gguf"), st(14_500 * MB, "mistralai/Mistral-7B-Instruct-v0.3")],
    },
];

/// The known model `id`, if any.
pub fn find(id: &str) -> Option<&'static KnownModel> {
    MODELS.iter().find(|m| m.id == id)
}

/// The known model and variant that a hub repo and file are, if the catalogue has them.
pub fn find_by_source(repo: &str, file: Option<&str>) -> Option<(&'static KnownModel, &'static Variant)> {
    MODELS.iter().find_map(|m| {
        m.variants.iter().find(|v| v.repo.eq_ignore_ascii_case(repo) && file.is_none_or(|f| v.file == f)).map(|v| (m, v))
    })
}

/// The pinned sha256 of a file of model `id`, if the catalogue pins one.
pub fn pinned_sha256(id: &str, format: Format) -> Option<&'static str> {
    find(id)?.variants.iter().find(|v| v.format == format).and_then(|v| v.sha256)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_consistent_and_every_engine_family_is_covered() {
        let mut ids: Vec<&str> = MODELS.iter().map(|m| m.id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), MODELS.len(), "ids are unique");
        for m in MODELS {
            assert!(crate::models::id::is_valid_id(m.id));
            assert!(!m.variants.is_empty() && m.layers > 0 && m.hidden_size > 0 && m.context > 0, "{}", m.id);
            for v in m.variants {
                assert!(v.repo.contains('/') && v.bytes > 0, "{}", m.id);
                assert_eq!(v.format == Format::Gguf, v.file.ends_with(".gguf"), "{}: a GGUF names its file", m.id);
            }
        }
        for family in ["llama", "mistral", "qwen2", "qwen3", "gemma3"] {
            assert!(MODELS.iter().filter(|m| m.family == family).count() >= 1, "{family}");
        }
        for registry in ["gemma3-270m", "qwen2.5-coder-1.5b"] {
            assert!(find(registry).unwrap().default_variant().sha256.is_some());
        }
        assert_eq!(find_by_source("qwen/qwen2.5-coder-1.5b-instruct-gguf", None).unwrap().0.id, "qwen2.5-coder-1.5b");
    }
}
