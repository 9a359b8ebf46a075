//! The libp2p swarm actor: one `EventLoop` task owns the `Swarm`; the rest of the node holds a
//! cloneable `NetHandle` (commands with oneshot replies) and reads `NetEvent`s from a channel.
//! It discovers peers (mDNS, static addresses), keeps them connected (redial with back-off,
//! ping watchdog), gossips adverts and carries control RPCs, data-plane forwards and peer
//! copies of model files (`files`).
//! It decides nothing about the cluster: adverts go in and out as `cluster::NodeAdvert`, and
//! the meaning of each RPC belongs to whoever answers `NetEvent::Request`.

mod behaviour;
mod codec;
mod config;
mod dialer;
mod event_loop;
pub mod files;
mod handle;
pub mod round;
pub mod rpc;
pub mod wire;

use std::path::PathBuf;
use std::time::Duration;

use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};
use shoal_proto::v1::{ControlRequest, ControlResponse};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

pub use behaviour::{build_swarm, Behaviour, ADVERT_TOPIC};
pub use codec::{ProstCodec, RPC_PROTOCOL};
pub use files::{InboundFile, FILES_PROTOCOL};
pub use config::{load_cluster_key, new_cluster_key_file, NetConfig, NetTimers, DEFAULT_PORT};
pub use handle::{NetCounters, NetHandle};
pub use libp2p::pnet::PreSharedKey;
pub use wire::WireError;

use crate::cluster::NodeAdvert;

/// How many events wait for the application before new ones are dropped (and counted).
const EVENT_BUFFER: usize = 1024;
/// How many commands wait for the event loop before senders wait.
const COMMAND_BUFFER: usize = 256;

/// What the network tells the rest of the node.
#[derive(Debug)]
pub enum NetEvent {
    /// The first connection to a peer is up.
    Connected(PeerId),
    /// The last connection to a peer closed.
    Disconnected(PeerId),
    /// A validated advert, signed by `from` and about `from`.
    Advert { from: PeerId, advert: NodeAdvert },
    /// A control RPC to answer. Send exactly one response on `reply`; dropping it (or taking
    /// longer than `NetTimers::rpc_max`) fails the call at the requester.
    Request { from: PeerId, request: ControlRequest, reply: oneshot::Sender<ControlResponse> },
    /// A successful ping and its round-trip time.
    Rtt { peer: PeerId, rtt: Duration },
    /// A new local listen address.
    Listening(Multiaddr),
}

/// Why the network or one of its calls failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// The transport or a behaviour could not be built.
    #[error("building the swarm: {0}")]
    Transport(String),
    /// A listen address was refused.
    #[error("cannot listen on {addr}: {reason}")]
    Listen { addr: Multiaddr, reason: String },
    /// The cluster key file could not be read or parsed.
    #[error("cluster key {path}: {reason}")]
    ClusterKey { path: PathBuf, reason: String },
    /// The event loop has stopped (cancelled, or every handle dropped).
    #[error("the network has shut down")]
    Shutdown,
    /// No response came before the deadline.
    #[error("no response from {peer} within {deadline:?}")]
    Timeout { peer: PeerId, deadline: Duration },
    /// The peer could not be dialled.
    #[error("cannot reach {peer}")]
    Unreachable { peer: PeerId },
    /// The connection closed before the response arrived.
    #[error("connection to {peer} closed before its response")]
    Disconnected { peer: PeerId },
    /// The peer does not speak the RPC protocol.
    #[error("{peer} does not speak {}", RPC_PROTOCOL)]
    Unsupported { peer: PeerId },
    /// The stream failed (reset, or a frame that did not decode or was too large).
    #[error("stream to {peer} failed: {reason}")]
    Stream { peer: PeerId, reason: String },
    /// A message to or from the wire was refused by validation.
    #[error("invalid message: {0}")]
    Invalid(#[from] WireError),
    /// Gossipsub refused to publish.
    #[error("publishing failed: {0}")]
    Publish(String),
}

impl NetError {
    /// A failed outbound request-response call (control RPC or file read), as the caller sees it.
    pub(crate) fn from_outbound(peer: PeerId, error: libp2p::request_response::OutboundFailure, deadline: Duration) -> NetError {
        use libp2p::request_response::OutboundFailure;
        match error {
            OutboundFailure::DialFailure => NetError::Unreachable { peer },
            OutboundFailure::Timeout => NetError::Timeout { peer, deadline },
            OutboundFailure::ConnectionClosed => NetError::Disconnected { peer },
            OutboundFailure::UnsupportedProtocols => NetError::Unsupported { peer },
            OutboundFailure::Io(e) => NetError::Stream { peer, reason: e.to_string() },
        }
    }
}

/// Starts the swarm actor on the current tokio runtime: listens on `config.listen`, dials
/// `config.peers`, and runs until `cancel` fires or every handle is dropped.
pub fn spawn(key: Keypair, config: NetConfig, cancel: CancellationToken) -> Result<(NetHandle, mpsc::Receiver<NetEvent>), NetError> {
    let mut swarm = build_swarm(&key, &config)?;
    for addr in &config.listen {
        swarm.listen_on(addr.clone()).map_err(|e| NetError::Listen { addr: addr.clone(), reason: e.to_string() })?;
    }
    if let Some(psk) = &config.cluster_key {
        tracing::info!(target: "shoal::net", fingerprint = %psk.fingerprint(), "private swarm: TCP with the cluster key only");
    }
    let (commands_tx, commands_rx) = mpsc::channel(COMMAND_BUFFER);
    let (events_tx, events_rx) = mpsc::channel(EVENT_BUFFER);
    let counters = std::sync::Arc::new(NetCounters::default());
    let stopped = CancellationToken::new();
    let handle = NetHandle::new(*swarm.local_peer_id(), commands_tx, counters.clone(), stopped.clone());
    let event_loop = event_loop::EventLoop::new(swarm, &config, commands_rx, events_tx, counters, cancel, stopped);
    tokio::spawn(event_loop.run());
    Ok((handle, events_rx))
}
