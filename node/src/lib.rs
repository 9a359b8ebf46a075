//! shoal: a peer-to-peer LLM inference swarm node.
//! This crate holds every layer of a node (see ARCHITECTURE.md); the binary in `main.rs`
//! only parses the command line and wires the layers together.

pub mod api;
pub mod cluster;
pub mod dataplane;
pub mod engine;
pub mod identity;
pub mod models;
pub mod net;
pub mod swarm;
