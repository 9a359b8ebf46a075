//! `RdmaLink`: frames over one RC queue pair with SEND/RECV. Each end posts receives for frame
//! parts and for credit messages; a frame is cut into messages of at most one slot (`wire`),
//! sent only against the peer's credits, and re-assembled in order; a consumed receive is
//! re-posted and granted back on the next message (or a credit message). Setting up rides the invite: the inviter
//! (`Offered`) puts its endpoint and a bootstrap TCP listener in the invite; the joiner
//! connects its queue pair to it, then dials the listener with the invite's token and sends its
//! own endpoint; the inviter connects and answers one ready byte. That TCP connection stays
//! open as the link's close signal: either end closing (or dying) shows as end of stream.
//! Any verbs error is a `LinkError`, so the group falls back to the next transport.
//! It does not use RDMA WRITE or READ (no remote keys leave the process) and does not encrypt.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::verbs::{Channel, Completion};
use super::wire::{self, Credits, Endpoint, Kind, Reassembly, CHUNK_HEADER_BYTES, CREDIT_SLOTS, DATA_SLOTS, ENDPOINT_BYTES, SEND_SLOTS, SLOT_BYTES};
use crate::dataplane::shm::Waiter;
use crate::dataplane::tcp::{TcpAcceptor, TOKEN_BYTES};
use crate::dataplane::{Frame, Link, LinkError, Transport, MAX_FRAME_VALUES};

/// How long a bootstrap exchange, a ready byte or a send waiting for credits may take.
const SETUP: Duration = Duration::from_secs(5);
/// The inviter's answer once its queue pair is ready to receive.
const READY: u8 = b'R';

fn failed(message: impl ToString) -> LinkError {
    LinkError::Failed { transport: Transport::Rdma, message: message.to_string() }
}

fn setup(message: impl ToString) -> LinkError {
    LinkError::Setup { transport: Transport::Rdma, message: message.to_string() }
}

/// The operator's device and GID index (`SHOAL_RDMA_DEVICE`, `SHOAL_RDMA_GID_INDEX`).
fn open_channel() -> Result<Channel, LinkError> {
    let device = std::env::var("SHOAL_RDMA_DEVICE").ok().filter(|d| !d.trim().is_empty());
    let gid_index = wire::gid_index_override(std::env::var("SHOAL_RDMA_GID_INDEX").ok().as_deref()).map_err(setup)?;
    Channel::open(device.as_deref().map(str::trim), gid_index, (DATA_SLOTS, CREDIT_SLOTS), SEND_SLOTS, SLOT_BYTES).map_err(setup)
}

/// The inviting side: a queue pair in INIT with its receives posted, and the listener the
/// joiner dials to hand over its endpoint.
pub struct Offered {
    channel: Channel,
    acceptor: TcpAcceptor,
}

impl Offered {
    /// Prepares a queue pair and a bootstrap listener on `ip`; returns them with the listener's
    /// address and our endpoint (hex) for the invite. Fails cleanly without a device.
    pub fn new(ip: IpAddr) -> Result<(Offered, SocketAddr, String), LinkError> {
        let channel = open_channel()?;
        let acceptor = TcpAcceptor::bind(ip).map_err(|e| setup(format!("bootstrap listener: {e}")))?;
        let addr = acceptor.addr().map_err(|e| setup(format!("bootstrap listener: {e}")))?;
        let endpoint = channel.local().to_hex();
        Ok((Offered { channel, acceptor }, addr, endpoint))
    }

    /// Waits (at most `wait`) for the joiner's bootstrap connection with `token`, connects the
    /// queue pair to its endpoint, and answers ready.
    pub fn accept(mut self, token: &[u8; TOKEN_BYTES], wait: Duration) -> Result<RdmaLink, LinkError> {
        let mut stream = self.acceptor.accept_stream(token, wait).map_err(|e| setup(format!("bootstrap: {e}")))?;
        stream.set_read_timeout(Some(SETUP)).map_err(setup)?;
        let mut raw = [0u8; ENDPOINT_BYTES];
        stream.read_exact(&mut raw).map_err(|e| setup(format!("reading the peer's endpoint: {e}")))?;
        let remote = Endpoint::decode(&raw).map_err(setup)?;
        self.channel.connect(&remote).map_err(setup)?;
        stream.write_all(&[READY]).map_err(|e| setup(format!("answering ready: {e}")))?;
        RdmaLink::new(self.channel, &remote, stream, true)
    }
}

/// The joining side: connects a new queue pair to the inviter's `endpoint` (hex), then hands
/// ours over the bootstrap connection to `addr` with `token`. The link's first send waits for
/// the inviter's ready byte.
pub fn join(addr: SocketAddr, token: &[u8; TOKEN_BYTES], endpoint: &str) -> Result<RdmaLink, LinkError> {
    // The peer's description is checked before any device is touched.
    let remote = Endpoint::from_hex(endpoint).map_err(setup)?;
    let mut channel = open_channel()?;
    channel.connect(&remote).map_err(setup)?;
    let mut stream = TcpStream::connect_timeout(&addr, SETUP).map_err(|e| setup(format!("bootstrap connection to {addr}: {e}")))?;
    let mut hello = token.to_vec();
    hello.extend_from_slice(&channel.local().encode());
    stream.write_all(&hello).map_err(|e| setup(format!("sending our endpoint: {e}")))?;
    RdmaLink::new(channel, &remote, stream, false)
}

/// One end of an RDMA link.
pub struct RdmaLink {
    channel: Channel,
    credits: Credits,
    /// Bytes of a frame per message: the smaller slot of the two ends, less the header.
    payload: usize,
    /// The peer's receives for frame parts.
    peer_slots: u32,
    /// Send slots without an outstanding send.
    free_sends: Vec<u32>,
    /// Receive slots holding frame parts not yet consumed, in arrival order: (slot, kind, length).
    arrived: VecDeque<(u32, Kind, u32)>,
    assembly: Reassembly,
    /// The bootstrap connection, kept as the close signal (non-blocking).
    side: TcpStream,
    /// Whether the peer's queue pair is known to be ready to receive (the inviter's always is
    /// once the joiner has connected; the joiner learns it from the ready byte).
    peer_ready: bool,
    closed: bool,
    completions: Vec<Completion>,
}

impl RdmaLink {
    fn new(channel: Channel, remote: &Endpoint, side: TcpStream, peer_ready: bool) -> Result<RdmaLink, LinkError> {
        side.set_nonblocking(true).map_err(setup)?;
        let _ = side.set_nodelay(true);
        let slot = channel.slot_bytes.min(remote.slot_bytes) as usize;
        let payload = slot - CHUNK_HEADER_BYTES;
        let free_sends = (0..channel.send_slots).rev().collect();
        let local = channel.local();
        let credits = Credits::new((remote.data_slots, remote.credit_slots), (local.data_slots, local.credit_slots));
        Ok(RdmaLink { channel, credits, payload, peer_slots: remote.data_slots, free_sends, arrived: VecDeque::new(), assembly: Reassembly::default(), side, peer_ready, closed: false, completions: Vec::new() })
    }

    fn fail(&mut self, e: LinkError) -> LinkError {
        self.close();
        e
    }

    /// Reads completions of both queues without waiting: frees finished send slots, applies
    /// the grants of arrived messages, re-posts credit messages at once and queues frame parts.
    /// Returns whether anything happened.
    fn progress(&mut self) -> Result<bool, LinkError> {
        let mut done = std::mem::take(&mut self.completions);
        done.clear();
        self.channel.poll(true, &mut done).map_err(failed)?;
        let sends = done.len();
        for c in &done {
            if !c.ok {
                return Err(failed(format!("a send completed with {}", self.channel.status_name(c.status))));
            }
            self.free_sends.push(c.wr_id as u32);
        }
        done.clear();
        self.channel.poll(false, &mut done).map_err(failed)?;
        let recvs = done.len();
        for c in &done {
            if !c.ok {
                return Err(failed(format!("a receive completed with {}", self.channel.status_name(c.status))));
            }
            // Our own wr_id: always a slot we posted.
            let slot = c.wr_id as u32;
            let (kind, grant, _) = wire::decode_header(self.channel.recv_slot(slot, c.byte_len)).map_err(failed)?;
            self.credits.granted(grant).map_err(failed)?;
            if kind == Kind::Credit {
                self.channel.post_recv(slot).map_err(failed)?;
                self.credits.reposted(kind);
            } else {
                self.arrived.push_back((slot, kind, c.byte_len));
            }
        }
        self.completions = done;
        Ok(sends + recvs > 0)
    }

    /// Sends one message from a free send slot: header (kind, our pending grant), then `fill`.
    fn post(&mut self, kind: Kind, fill: impl FnOnce(&mut [u8]) -> usize) -> Result<(), LinkError> {
        let slot = self.free_sends.pop().ok_or_else(|| failed("no free send slot"))?;
        let grant = if kind == Kind::Credit { self.credits.spend_credit() } else { self.credits.spend_data() };
        let payload = self.payload;
        let buf = self.channel.send_slot(slot);
        buf[..CHUNK_HEADER_BYTES].copy_from_slice(&wire::encode_header(kind, grant));
        let n = fill(&mut buf[CHUNK_HEADER_BYTES..CHUNK_HEADER_BYTES + payload]);
        self.channel.post_send(slot, (CHUNK_HEADER_BYTES + n) as u32).map_err(failed)
    }

    /// Sends a credit message when one is due and a send slot is free.
    fn grant(&mut self, blocked: bool) -> Result<(), LinkError> {
        if self.credits.credit_due(blocked) && !self.free_sends.is_empty() {
            self.post(Kind::Credit, |_| 0)?;
        }
        Ok(())
    }

    /// Whether the side connection says the peer closed (end of stream or an error); reads the
    /// ready byte on the way.
    fn side_closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        loop {
            if !self.peer_ready {
                match self.side.read(&mut b) {
                    Ok(0) => return true,
                    Ok(_) if b[0] == READY => {
                        self.peer_ready = true;
                        continue;
                    }
                    Ok(_) => return true,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => return true,
                }
            }
            // Nothing more is ever sent on it: any byte or end of stream means closed.
            return match self.side.peek(&mut b) {
                Ok(_) => true,
                Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
            };
        }
    }

    fn consume(&mut self) -> Result<Option<Frame>, LinkError> {
        while let Some((slot, kind, len)) = self.arrived.pop_front() {
            let msg = self.channel.recv_slot(slot, len);
            let (_, _, payload) = wire::decode_header(msg).map_err(failed)?;
            let frame = self.assembly.push(kind, payload).map_err(failed)?;
            self.channel.post_recv(slot).map_err(failed)?;
            self.credits.reposted(kind);
            self.grant(false)?;
            if frame.is_some() {
                return Ok(frame);
            }
        }
        Ok(None)
    }

    fn recv_inner(&mut self, wait: Duration) -> Result<Option<Frame>, LinkError> {
        let until = Instant::now() + wait;
        let mut waiter = Waiter::new(wait);
        let mut last_side_check = Instant::now();
        loop {
            self.grant(false)?;
            if let Some(f) = self.consume()? {
                return Ok(Some(f));
            }
            if self.progress()? {
                waiter = Waiter::new(until.saturating_duration_since(Instant::now()));
                continue;
            }
            if last_side_check.elapsed() >= Duration::from_millis(1) || Instant::now() >= until {
                last_side_check = Instant::now();
                if self.side_closed() {
                    return Err(LinkError::Closed(Transport::Rdma));
                }
            }
            if !waiter.wait() || Instant::now() >= until {
                return Ok(None);
            }
        }
    }

    fn send_inner(&mut self, frame: &Frame) -> Result<(), LinkError> {
        if frame.data.len() > MAX_FRAME_VALUES {
            return Err(failed(format!("a frame of {} values is over the limit", frame.data.len())));
        }
        let mut waiter = Waiter::new(SETUP);
        while !self.peer_ready {
            if self.side_closed() {
                return Err(LinkError::Closed(Transport::Rdma));
            }
            if !self.peer_ready && !waiter.wait() {
                return Err(failed("the peer did not say ready in time"));
            }
        }
        let total = wire::frame_bytes(frame);
        let mut offset = 0;
        let mut first = true;
        while first || offset < total {
            let mut waiter = Waiter::new(SETUP);
            loop {
                self.progress()?;
                if self.credits.can_send_data() && !self.free_sends.is_empty() {
                    break;
                }
                // Blocked: grants we hold go out now, so the peer's credits can come back.
                self.grant(true)?;
                if self.side_closed() {
                    return Err(LinkError::Closed(Transport::Rdma));
                }
                if !waiter.wait() {
                    return Err(failed(format!("no credit from the peer for {SETUP:?} (it is not reading)")));
                }
            }
            let kind = if first { Kind::Start } else { Kind::More };
            let at = offset;
            let mut wrote = 0;
            self.post(kind, |dst| {
                wrote = wire::fill(frame, at, dst);
                wrote
            })?;
            offset += wrote;
            first = false;
        }
        Ok(())
    }
}

impl Link for RdmaLink {
    fn transport(&self) -> Transport {
        Transport::Rdma
    }

    fn send(&mut self, frame: &Frame) -> Result<(), LinkError> {
        if self.closed {
            return Err(LinkError::Closed(Transport::Rdma));
        }
        self.send_inner(frame).map_err(|e| self.fail(e))
    }

    fn recv(&mut self, wait: Duration) -> Result<Option<Frame>, LinkError> {
        if self.closed {
            return Err(LinkError::Closed(Transport::Rdma));
        }
        self.recv_inner(wait).map_err(|e| self.fail(e))
    }

    fn is_closed(&mut self) -> bool {
        if self.closed {
            return true;
        }
        if self.progress().is_err() || self.side_closed() {
            self.close();
        }
        self.closed
    }

    fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        let _ = self.side.shutdown(std::net::Shutdown::Both);
        self.channel.set_error();
    }

    fn capacity(&self) -> usize {
        wire::capacity(self.peer_slots, self.payload)
    }
}
