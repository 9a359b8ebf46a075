//! The swarm's decisions as pure state machines: membership from adverts and connections,
//! the deterministic leader, epoch-stamped plans, and placement. No I/O, no async, no
//! clocks (time is an input), no libp2p, tokio or candle: the `net` layer feeds inputs and
//! carries outputs, and a seeded simulator drives the same code in tests.

pub mod cost;
pub mod placement;
pub mod state;
pub mod tensor;

pub use placement::{place, place_all, Capacity, ModelFootprint, Placement, PlacementError, Stage, Strategy};
pub use tensor::TpUnits;
pub use state::{ClusterConfig, ClusterEvent, ClusterState, Epoch, GpuAdvert, Input, NodeAdvert, Output, Plan};

/// A node's stable identity (its libp2p PeerId in text form).
pub type NodeId = String;

/// Milliseconds on the caller's monotonic clock.
pub type Millis = u64;
