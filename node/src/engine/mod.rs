//! The compute engine: model families on candle, layer-range shards, weights, KV cache,
//! sampling, tokenizer and chat template, and the thread that runs generations.
//! It never awaits and never sees the network: callers reach it over a channel
//! (`runtime::EngineHandle`) and get events back through a synchronous sink.

pub mod bench;
pub mod cache;
pub mod chained;
#[cfg(feature = "cuda")]
pub mod cuda_decode;
mod cuda_plan;
pub mod op_timing;
pub mod device;
pub mod families;
pub mod generate;
pub mod gguf_tokenizer;
pub mod kernels;
pub mod layers;
pub mod model;
pub mod probe;
pub mod quantize;
pub mod runtime;
pub mod sampler;
pub mod shard;
pub mod spec;
pub mod stage;
pub mod stage_host;
pub mod text;
pub mod tp;
pub mod weights;
mod weights_part;

pub use generate::{FinishReason, GenerationEvent, GenerationRequest, Usage};
pub use model::{LoadOptions, LoadedModel};
pub use sampler::SamplingParams;
pub use shard::{LayerRange, Shard, ShardInput, ShardOutput};
pub use spec::{Family, ModelSpec};

/// Everything that can go wrong inside the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A file or directory the model needs does not exist.
    #[error("{path}: no such file or directory")]
    MissingFile { path: std::path::PathBuf },
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io { path: std::path::PathBuf, source: std::io::Error },
    /// The weights name an architecture this engine does not implement.
    #[error("unsupported architecture `{found}` (supported: {})", spec::SUPPORTED_ARCHITECTURES.join(", "))]
    UnsupportedArchitecture { found: String },
    /// The weights file or its configuration is corrupt, truncated or inconsistent.
    #[error("invalid model files: {0}")]
    InvalidModel(String),
    /// A tensor the shard needs is absent from the weights.
    #[error("tensor `{0}` not found in the weights")]
    MissingTensor(String),
    /// The tokenizer could not be loaded or failed on the input.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template is missing or failed to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The prompt does not fit in the model's context window.
    #[error("prompt of {prompt_tokens} tokens does not fit the context of {context} tokens")]
    PromptTooLong { prompt_tokens: usize, context: usize },
    /// A request carried parameters outside their valid range.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A shard was asked to do something its layer range does not allow.
    #[error("shard: {0}")]
    Shard(String),
    /// The engine thread has stopped.
    #[error("the engine has shut down")]
    ShutDown,
    /// The compute device could not be opened or used.
    #[error("device: {0}")]
    Device(String),
    /// A tensor operation failed.
    #[error("compute: {0}")]
    Compute(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, EngineError>;

impl From<gguf_tokenizer::GgufTokenizerError> for EngineError {
    fn from(e: gguf_tokenizer::GgufTokenizerError) -> Self {
        EngineError::Tokenizer(e.to_string())
    }
}
