//! `NetHandle`: what the rest of the node holds to use the network. Each call sends one
//! `Command` to the event loop and awaits its oneshot reply; the handle never touches the
//! swarm. Counters of refused input are shared atomics, read without a round trip.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use libp2p::{Multiaddr, PeerId};
use shoal_proto::v1::{ControlRequest, ControlResponse, FileRequest, FileResponse};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::files::InboundFile;
use super::{wire, NetError};
use crate::cluster::NodeAdvert;

/// What a handle asks of the event loop. Every variant carries the oneshot on which the loop
/// answers exactly once; a dropped sender (the loop gone) reads as `NetError::Shutdown`.
#[derive(Debug)]
pub(super) enum Command {
    /// Gossip this node's advert on the advert topic, with the addresses the swarm listens on.
    Publish { advert: Box<NodeAdvert>, reply: oneshot::Sender<Result<(), NetError>> },
    /// Send one RPC; answered by its response, a failure, or the deadline, whichever is first.
    Request { peer: PeerId, request: ControlRequest, deadline: Duration, reply: oneshot::Sender<Result<ControlResponse, NetError>> },
    /// Send one peer-copy call; ends like `Request`.
    FileRequest { peer: PeerId, request: FileRequest, deadline: Duration, reply: oneshot::Sender<Result<FileResponse, NetError>> },
    /// Route inbound file requests to `sink` from now on (replacing any earlier sink).
    ServeFiles { sink: mpsc::Sender<InboundFile>, reply: oneshot::Sender<()> },
    ListenAddrs { reply: oneshot::Sender<Vec<Multiaddr>> },
    ConnectedPeers { reply: oneshot::Sender<Vec<(PeerId, Option<Duration>)>> },
}

/// Refused or lost input since start, for tests and metrics.
#[derive(Debug, Default)]
pub struct NetCounters {
    /// Gossip that did not decode or validate (including adverts not about their signer).
    pub malformed_gossip: AtomicU64,
    /// Adverts whose id was not the peer that signed them (also counted in `malformed_gossip`).
    pub foreign_adverts: AtomicU64,
    /// RPC frames that failed to decode, were too large, or had a bad envelope, inbound or outbound.
    pub bad_frames: AtomicU64,
    /// Events dropped because the application did not read them fast enough.
    pub dropped_events: AtomicU64,
    /// Connections closed by the ping watchdog.
    pub watchdog_closes: AtomicU64,
}

impl NetCounters {
    pub(super) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A cloneable handle on the swarm actor. Dropping every clone shuts the actor down.
#[derive(Debug, Clone)]
pub struct NetHandle {
    local_peer_id: PeerId,
    /// To the event loop, which holds the receiver; closed when the loop has stopped.
    commands: mpsc::Sender<Command>,
    /// Shared with the event loop, which bumps them.
    counters: Arc<NetCounters>,
    /// Cancelled by the event loop as it exits (also on panic, through a drop guard).
    stopped: CancellationToken,
}

impl NetHandle {
    pub(super) fn new(local_peer_id: PeerId, commands: mpsc::Sender<Command>, counters: Arc<NetCounters>, stopped: CancellationToken) -> Self {
        NetHandle { local_peer_id, commands, counters, stopped }
    }

    pub fn local_peer_id(&self) -> PeerId {
        self.local_peer_id
    }

    /// Counters of refused input.
    pub fn counters(&self) -> &NetCounters {
        &self.counters
    }

    /// Resolves once the event loop has stopped and the swarm is dropped.
    pub async fn stopped(&self) {
        self.stopped.cancelled().await
    }

    async fn call<T>(&self, command: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, NetError> {
        let (reply, rx) = oneshot::channel();
        self.commands.send(command(reply)).await.map_err(|_| NetError::Shutdown)?;
        rx.await.map_err(|_| NetError::Shutdown)
    }

    /// Gossips `advert`, which must be about this node. A node with no subscribed peer yet
    /// publishes nothing and succeeds: adverts repeat, and the next one finds the peers.
    pub async fn publish_advert(&self, advert: &NodeAdvert) -> Result<(), NetError> {
        // Check here what every receiver will check, so that a bad advert fails loudly at home.
        wire::decode_advert(&wire::encode_advert(advert), &self.local_peer_id)?;
        let advert = Box::new(advert.clone());
        self.call(|reply| Command::Publish { advert, reply }).await?
    }

    /// Sends `request` to `peer` (dialling it if needed) and waits for its response, at most
    /// `deadline` (cut to `NetTimers::rpc_max`).
    pub async fn request(&self, peer: PeerId, request: ControlRequest, deadline: Duration) -> Result<ControlResponse, NetError> {
        self.call(|reply| Command::Request { peer, request, deadline, reply }).await?
    }

    /// Sends a peer-copy call (`/shoal/files/1`) to `peer` and waits for its response, at
    /// most `deadline` (cut to `NetTimers::rpc_max`). The request is checked before it leaves.
    pub async fn file_request(&self, peer: PeerId, request: FileRequest, deadline: Duration) -> Result<FileResponse, NetError> {
        super::files::check_request(&request)?;
        self.call(|reply| Command::FileRequest { peer, request, deadline, reply }).await?
    }

    /// Starts serving peers' file requests: each arrives on the returned channel (at most
    /// `capacity` waiting; beyond that peers are told BUSY). Dropping the receiver stops
    /// serving (requests are refused as NOT_SERVING); a second call replaces the first.
    pub async fn serve_files(&self, capacity: usize) -> Result<mpsc::Receiver<InboundFile>, NetError> {
        let (sink, requests) = mpsc::channel(capacity.max(1));
        self.call(|reply| Command::ServeFiles { sink, reply }).await?;
        Ok(requests)
    }

    /// The addresses the swarm listens on now.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NetError> {
        self.call(|reply| Command::ListenAddrs { reply }).await
    }

    /// Connected peers and the last ping round-trip time to each (none before the first ping).
    pub async fn connected_peers(&self) -> Result<Vec<(PeerId, Option<Duration>)>, NetError> {
        self.call(|reply| Command::ConnectedPeers { reply }).await
    }
}
