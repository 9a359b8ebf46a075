//! The data plane: how tensor-parallel members (and, later, pipeline hops) move f32 buffers,
//! apart from the libp2p control plane. One interface (`Link`: frames to one peer, blocking,
//! with deadlines) over several transports, fastest first: same-host shared memory (`shm`),
//! direct TCP with no-delay (`tcp`), in-process channels (`local`, for tests and one-process
//! groups); the libp2p stream, the last resort, is a `Link` in `swarm::p2p_link` (only the swarm
//! holds the network). `negotiate` picks the order from both sides' offers; `group::LinkGroup` runs the
//! all-reduce over the links and falls back to the next transport when one fails mid-call.
//! With the cargo feature `rdma`, `rdma` adds a verbs link (an RC queue pair, libibverbs
//! opened at run time), offered first when a device has an active port; without it an RDMA
//! offer from a peer fails setup and drops out. The verbs link has not run on RDMA hardware.
//! It does not decide who is in a group (placement does) nor carry control messages (net does).

pub mod connect;
pub mod group;
pub mod local;
pub mod negotiate;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;
pub mod tcp;

use std::time::Duration;

pub use group::LinkGroup;
pub use negotiate::{negotiate, Offer, Transport};

/// One message between two members: which all-reduce call (`seq`) and which step of it
/// (`step`) it belongs to, and the values.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub seq: u64,
    pub step: u32,
    pub data: Vec<f32>,
}

impl Frame {
    /// Bytes of the header every transport writes before the values: seq, step, length.
    pub const HEADER_BYTES: usize = 16;

    pub fn key(&self) -> (u64, u32) {
        (self.seq, self.step)
    }

    /// The frame as byte-stream transports write it: the header (seq u64, step u32, value count
    /// u32, little-endian), then the values as little-endian f32.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(Frame::HEADER_BYTES + self.data.len() * 4);
        bytes.extend_from_slice(&self.seq.to_le_bytes());
        bytes.extend_from_slice(&self.step.to_le_bytes());
        bytes.extend_from_slice(&(self.data.len() as u32).to_le_bytes());
        for v in &self.data {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        bytes
    }

    /// Reads a header written by `to_bytes`: (seq, step, value count), or `None` when the count
    /// is over `MAX_FRAME_VALUES` (corrupt input: the caller closes the link).
    pub fn parse_header(header: &[u8; Frame::HEADER_BYTES]) -> Option<(u64, u32, usize)> {
        let seq = u64::from_le_bytes(header[0..8].try_into().expect("8 bytes"));
        let step = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(header[12..16].try_into().expect("4 bytes")) as usize;
        (len <= MAX_FRAME_VALUES).then_some((seq, step, len))
    }

    /// Values written by `to_bytes`, from their bytes.
    pub fn values(raw: &[u8]) -> Vec<f32> {
        raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect()
    }
}

/// Largest frame any link accepts (64 Mi values, 256 MiB): a bigger length in a header is
/// corrupt input and closes the link instead of allocating.
pub const MAX_FRAME_VALUES: usize = 64 << 20;

/// Why a link operation failed; every failure closes the link for both ends.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// The peer or this side closed the link (or the peer process went away).
    #[error("{0} link closed")]
    Closed(Transport),
    /// The transport failed (socket error, bad frame, mapping error).
    #[error("{transport} link: {message}")]
    Failed { transport: Transport, message: String },
    /// Setting up the link failed (the caller tries the next transport).
    #[error("{transport} link could not be set up: {message}")]
    Setup { transport: Transport, message: String },
}

/// A point-to-point, in-order, reliable frame channel to one peer. Blocking calls for the
/// engine thread; `recv` waits at most `wait` so that a caller can watch several links.
pub trait Link: Send {
    fn transport(&self) -> Transport;
    /// Sends one frame; may block while the peer has not read earlier ones (see `capacity`).
    fn send(&mut self, frame: &Frame) -> Result<(), LinkError>;
    /// The next frame, or `None` when none arrived within `wait`.
    fn recv(&mut self, wait: Duration) -> Result<Option<Frame>, LinkError>;
    /// Whether the link is known to be closed (by either end), without blocking.
    fn is_closed(&mut self) -> bool;
    /// Closes the link so that the peer's next (or current) operation fails too.
    fn close(&mut self);
    /// Bytes a `send` can leave in flight without the peer reading; larger frames need the two
    /// ends to take turns (the group orders them by rank).
    fn capacity(&self) -> usize;
}
