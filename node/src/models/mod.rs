//! Models: which exist (`catalogue`), which this node has (`store`), and how to get the rest:
//! from peers that hold them (`peer`, over `net`'s file protocol) and then from the Hugging
//! Face hub (`hub`), fetching only the files a node needs (`select`), verified by size and
//! sha256, resumable, with progress (`progress`); `pull` ties them together.
//! It never loads weights (the engine does) and knows no HTTP of our own API (`api` does);
//! `id` holds the one naming rule that the engine and the API share.

pub mod catalogue;
pub mod footprint;
pub mod hub;
pub mod id;
pub mod peer;
pub mod progress;
pub mod pull;
pub mod select;
pub mod store;

use std::path::PathBuf;

pub use progress::{Phase, Progress, Transfer, TransferView};
pub use pull::{pull, PullOutcome, PullRequest, Sources};
pub use footprint::footprint;
pub use store::{LocalModel, Manifest, ModelDetails, Store};

/// Why finding, fetching or storing a model failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelsError {
    /// The hub refused access: a gated or private repo (401/403).
    #[error("{repo}: the hub refused access (HTTP {status}); {}", if *.token_set { "HF_TOKEN is set but does not grant access: accept the model's terms on the hub with that account, or use another token" } else { "it is gated or private: accept its terms on the hub and set HF_TOKEN to an access token" })]
    Unauthorized { repo: String, status: u16, token_set: bool },
    /// The hub has no such repo, revision or file (404).
    #[error("{what}: not found on the hub ({url})")]
    NotFound { what: String, url: String },
    /// The hub answered with an unexpected status, after retries where retrying made sense.
    #[error("{url}: HTTP {status}{}", if *.retried { " (after retries)" } else { "" })]
    Http { url: String, status: u16, retried: bool },
    /// The hub could not be reached, or a transfer broke, after retries.
    #[error("{url}: {reason}")]
    Transport { url: String, reason: String },
    /// The hub's answer was not what its API promises.
    #[error("{url}: unexpected answer: {reason}")]
    BadAnswer { url: String, reason: String },
    /// A file's bytes did not have the expected size.
    #[error("{file}: {got} bytes, expected {expected}")]
    SizeMismatch { file: String, expected: u64, got: u64 },
    /// A file's bytes did not have the expected sha256.
    #[error("{file}: sha256 {got} does not match the expected {expected}")]
    HashMismatch { file: String, expected: String, got: String },
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// Neither this node, the catalogue nor the name's shape says what the model is.
    #[error("unknown model `{id}`: {hint}")]
    UnknownModel { id: String, hint: String },
    /// A repo holds several GGUF files and none was chosen.
    #[error("{repo} holds several GGUF files ({choices}); choose one with --file or `{repo}:<quant>`")]
    AmbiguousFile { repo: String, choices: String },
    /// No peer and no hub could provide a file.
    #[error("no source could provide {file}: {reason}")]
    NoSource { file: String, reason: String },
    /// A peer failed or sent something wrong.
    #[error("peer {peer}: {reason}")]
    Peer { peer: String, reason: String },
    /// A name, path or argument that cannot be used.
    #[error("{0}")]
    Invalid(String),
    /// The pull was cancelled.
    #[error("cancelled")]
    Cancelled,
}
