//! The swarm runtime of one node: the coordinator actor that joins the pure `cluster` state
//! machine to the `net` actor and to this node's pipeline stages, and the entry side that runs
//! a generation across the plan's stages. It owns no sockets (only `net` does) and computes
//! nothing itself (only `engine` does); it never speaks HTTP.

mod coordinator;
mod entry;
mod forward;
mod p2p_link;
mod tp_group;

pub use coordinator::{spawn, ClusterSnapshot, StageState, StageStatus, SwarmConfig, SwarmHandle};
pub use entry::{GenerateRequest, TokenEvent};

/// Why a swarm call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SwarmError {
    /// The coordinator has stopped.
    #[error("the swarm runtime has shut down")]
    ShutDown,
    /// The model's files could not be read to size it.
    #[error("model `{model}`: {reason}")]
    Model { model: String, reason: String },
    /// The swarm cannot hold the model, or no plan came in time.
    #[error("{0}")]
    NoPlan(String),
}
