//! shoal's integration tests: one binary, one module per area. Model-running tests need a
//! release build (`scripts/test.sh` runs them so); every test is bounded in time by nextest.
//! - fidelity: logits of each family vs Hugging Face transformers on committed fixtures
//! - sharding: layer-range shards chained equal the whole model
//! - gguf_quant: GGUF loading of every supported tensor type, written from fixtures
//! - kernels: shoal's quantized matmul kernels and activation quantization vs their references
//! - real_models: the registry-packaged GGUFs against llama.cpp's greedy output
//! - bad_input: corrupt, missing and unsupported files; over-long prompts; via the CLI
//! - gguf_tokenizer: tokenizers built from GGUF metadata vs the reference tokenizer.json
//! - text: chat templates, stop tokens, sampling determinism
//! - api: `shoal serve` over HTTP with the OpenAI SDK, curl and reqwest: streaming, errors,
//!   queueing, cancellation, the cluster view and the embedded UI
//! - ui: the web UI in headless chromium against a real `shoal serve` (tests/browser/chat.mjs)
//! - launchers: the macOS bundle, .command and Linux .desktop from scripts/make-launchers.sh, run
//! - pipeline: layer-range stages chained through wire-format hidden states equal one node
//! - net: the libp2p swarm actor on loopback (static peers, no mDNS): mesh, adverts, RPCs,
//!   cluster keys, malformed gossip, dead peers and silent links
//! - models: pulls from a local server speaking the hub's API (resume, verification, 401/404,
//!   stage-only fetch) and peer copies between real swarms (hub untouched, lying peer caught)
//! - swarm: real libp2p swarms on loopback run a pipeline across nodes and survive a lost stage
//! - netns: real `shoal serve` processes in network namespaces, mDNS only: split, kill, cluster key
//! - serve_tp: `shoal serve` processes pinned to a tensor group of two equal one node
//! - tensor_parallel: tensor-parallel slices joined by an in-process all-reduce equal one node
//! - transports: data-plane negotiation, shared memory and TCP links, fallback mid-request, member processes
//! - simulator: seeded churn over the cluster state machines, invariants every step

mod util;

mod api;
mod bad_input;
mod fidelity;
mod gguf_quant;
mod gguf_tokenizer;
mod kernels;
mod pipeline;
mod launchers;
mod models;
mod net;
mod real_models;
mod sharding;
mod sampler;
mod simulator;
mod netns;
mod serve_tp;
mod swarm;
mod tensor_parallel;
mod transports;
mod text;
mod ui;
