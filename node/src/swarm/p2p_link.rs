//! The data plane's last resort: a `Link` whose frames travel as `DataFrame` RPCs on the
//! control plane's own libp2p connection, for group members that share no faster transport
//! or whose faster links all failed. Sending queues the frame for a task that sends frames one
//! at a time (each waits for the peer's acknowledgement, so order holds); received frames come
//! from `FrameRoutes`, where inbound `DataFrame`s are delivered by pair. One round trip per
//! frame: correct and slow, never the first choice.
//! It does not open connections (net keeps the peers connected) and does not retry a frame:
//! a failed send closes the link.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::Duration;

use libp2p::PeerId;
use shoal_proto::v1;
use tokio::sync::mpsc;

use super::tp_group::PairKey;
use crate::dataplane::{Frame, Link, LinkError, Transport, MAX_FRAME_VALUES};
use crate::net::NetHandle;

/// How long one frame's RPC may take before the link counts as failed.
const FRAME_DEADLINE: Duration = Duration::from_secs(10);

/// Where inbound frames go, by (pair, direction): `PairKey` with `from_rank` the sender.
/// Entries live as long as their link; a frame for no entry is refused, which closes the
/// sender's link.
#[derive(Clone, Default)]
pub struct FrameRoutes {
    routes: Arc<Mutex<HashMap<PairKey, std_mpsc::Sender<Frame>>>>,
}

impl FrameRoutes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PairKey, std_mpsc::Sender<Frame>>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands an inbound frame to its link; `Err` when no link of ours takes it.
    pub fn deliver(&self, f: v1::DataFrame) -> Result<(), String> {
        if f.data.len() % 4 != 0 || f.data.len() / 4 > MAX_FRAME_VALUES {
            return Err(format!("a data frame of {} bytes", f.data.len()));
        }
        let key = PairKey { model: f.model, epoch: crate::cluster::Epoch { round: f.epoch_round, leader: f.epoch_leader }, from_rank: f.from_rank as usize, to_rank: f.to_rank as usize };
        let data = f.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let frame = Frame { seq: f.seq, step: f.step, data };
        let mut routes = self.lock();
        match routes.get(&key) {
            Some(tx) if tx.send(frame).is_ok() => Ok(()),
            Some(_) => {
                routes.remove(&key);
                Err("that link is closed".into())
            }
            None => Err("no such data-plane link here".into()),
        }
    }
}

/// One end of a libp2p link between ranks `me` and `peer` of a group.
pub struct P2pLink {
    out: mpsc::UnboundedSender<Frame>,
    inbox: std_mpsc::Receiver<Frame>,
    closed: Arc<AtomicBool>,
    routes: FrameRoutes,
    inbound_key: PairKey,
}

impl P2pLink {
    /// Opens our end: registers the inbox and starts the sending task (on the current runtime).
    /// `pair` names the pair with `from_rank` = us, `to_rank` = the peer.
    pub fn open(net: NetHandle, peer: PeerId, pair: PairKey, routes: FrameRoutes) -> P2pLink {
        let inbound_key = PairKey { from_rank: pair.to_rank, to_rank: pair.from_rank, ..pair.clone() };
        let (tx, inbox) = std_mpsc::channel();
        routes.lock().insert(inbound_key.clone(), tx);
        let (out, mut frames) = mpsc::unbounded_channel::<Frame>();
        let closed = Arc::new(AtomicBool::new(false));
        let flag = closed.clone();
        tokio::spawn(async move {
            // Ends when the link is dropped (the channel closes) or a frame fails.
            while let Some(frame) = frames.recv().await {
                if flag.load(Ordering::Acquire) {
                    break;
                }
                let body = v1::DataFrame {
                    version: shoal_proto::WIRE_VERSION,
                    model: pair.model.clone(),
                    epoch_round: pair.epoch.round,
                    epoch_leader: pair.epoch.leader.clone(),
                    // Ranks are below the group size, far below u32::MAX.
                    from_rank: u32::try_from(pair.from_rank).unwrap_or(u32::MAX),
                    to_rank: u32::try_from(pair.to_rank).unwrap_or(u32::MAX),
                    seq: frame.seq,
                    step: frame.step,
                    data: frame.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                };
                let request = v1::ControlRequest { version: shoal_proto::WIRE_VERSION, body: Some(v1::control_request::Body::Frame(body)) };
                match net.request(peer, request, FRAME_DEADLINE).await {
                    Ok(v1::ControlResponse { body: Some(v1::control_response::Body::FrameAck(_)), .. }) => {}
                    other => {
                        tracing::warn!(target: "shoal::dataplane", "libp2p data frame failed: {other:?}");
                        flag.store(true, Ordering::Release);
                        break;
                    }
                }
            }
        });
        P2pLink { out, inbox, closed, routes, inbound_key }
    }
}

impl Link for P2pLink {
    fn transport(&self) -> Transport {
        Transport::Libp2p
    }

    fn send(&mut self, frame: &Frame) -> Result<(), LinkError> {
        if self.is_closed() || self.out.send(frame.clone()).is_err() {
            return Err(LinkError::Closed(Transport::Libp2p));
        }
        Ok(())
    }

    fn recv(&mut self, wait: Duration) -> Result<Option<Frame>, LinkError> {
        match self.inbox.recv_timeout(wait) {
            Ok(f) => Ok(Some(f)),
            Err(std_mpsc::RecvTimeoutError::Timeout) if !self.is_closed() => Ok(None),
            Err(_) => Err(LinkError::Closed(Transport::Libp2p)),
        }
    }

    fn is_closed(&mut self) -> bool {
        self.closed.load(Ordering::Acquire) || self.out.is_closed()
    }

    fn close(&mut self) {
        // The peer learns of it when its next frame is refused.
        self.closed.store(true, Ordering::Release);
        self.routes.lock().remove(&self.inbound_key);
    }

    fn capacity(&self) -> usize {
        // Sending only queues: any frame fits without the peer reading.
        usize::MAX
    }
}

impl Drop for P2pLink {
    fn drop(&mut self) {
        self.close();
    }
}
