//! The actor that owns the `Swarm`: a `select!` over (biased, in this order) cancellation,
//! commands from handles, the application's answers to inbound RPCs, RPC deadlines (control
//! RPCs, then peer-copy file calls, whose book is `files::FileRpcs`), the
//! housekeeping tick (ping watchdog, redial) and swarm events. Every pending RPC ends exactly
//! once: by its response, a failure, a closed connection (libp2p fails the request) or its
//! deadline. It never awaits anything but its `select!`, so control is always served.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use libp2p::futures::future::BoxFuture;
use libp2p::futures::stream::{FuturesUnordered, StreamExt};
use libp2p::gossipsub::{self, MessageAcceptance, PublishError, TopicHash};
use libp2p::request_response::{self as rr, InboundRequestId, OutboundFailure, OutboundRequestId, ResponseChannel};
use libp2p::swarm::SwarmEvent;
use libp2p::{mdns, ping, Multiaddr, PeerId, Swarm};
use shoal_proto::v1::{ControlRequest, ControlResponse, ErrorCode};
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::behaviour::{advert_topic, Behaviour, BehaviourEvent};
use super::dialer::{Redial, Watchdog};
use super::files::FileRpcs;
use super::handle::{Command, NetCounters};
use super::{rpc, wire, NetConfig, NetError, NetEvent, NetTimers, WireError};

/// An RPC we sent, waiting for its end.
struct Outbound {
    peer: PeerId,
    deadline: Duration,
    /// To the caller of `NetHandle::request`, who awaits it.
    reply: oneshot::Sender<Result<ControlResponse, NetError>>,
}

pub(super) struct EventLoop {
    swarm: Swarm<Behaviour>,
    timers: NetTimers,
    /// From every `NetHandle`; closed (every handle dropped) means shut down.
    commands: mpsc::Receiver<Command>,
    /// To the application. Full: the event is dropped and counted (the loop never waits on
    /// it). Closed: nobody listens, and events are discarded.
    events: mpsc::Sender<NetEvent>,
    /// Shared with the handles, which read them.
    counters: Arc<NetCounters>,
    /// The node's shutdown token for this subsystem: cancelled means stop now.
    cancel: CancellationToken,
    /// Cancelled as this loop exits (a drop guard, so a panic cancels it too).
    stopped: CancellationToken,
    /// RPCs awaiting their response.
    outbound: HashMap<OutboundRequestId, Outbound>,
    /// When each outbound RPC gives up, soonest first; entries already ended are skipped.
    deadlines: BinaryHeap<Reverse<(Instant, OutboundRequestId)>>,
    /// Inbound RPCs awaiting the application's answer: libp2p's channel back to the caller.
    inbound: HashMap<InboundRequestId, ResponseChannel<ControlResponse>>,
    /// The application's answers; `None` when it dropped its sender or exceeded `rpc_max`.
    answers: FuturesUnordered<BoxFuture<'static, (InboundRequestId, Option<ControlResponse>)>>,
    /// Last ping round-trip time of each connected peer.
    rtt: HashMap<PeerId, Duration>,
    redial: Redial,
    watchdog: Watchdog,
    topic: TopicHash,
    /// Peer-copy calls, both ways, and the registered file server.
    files: FileRpcs,
    /// The addresses the swarm listens on (one per interface), gossiped in our adverts.
    listening: Vec<Multiaddr>,
}

impl EventLoop {
    pub(super) fn new(
        swarm: Swarm<Behaviour>,
        config: &NetConfig,
        commands: mpsc::Receiver<Command>,
        events: mpsc::Sender<NetEvent>,
        counters: Arc<NetCounters>,
        cancel: CancellationToken,
        stopped: CancellationToken,
    ) -> Self {
        let t = config.timers;
        let redial = Redial::new(*swarm.local_peer_id(), &config.peers, t.redial, t.redial_max, Instant::now());
        EventLoop {
            swarm,
            timers: t,
            commands,
            events,
            counters,
            cancel,
            stopped,
            outbound: HashMap::new(),
            deadlines: BinaryHeap::new(),
            inbound: HashMap::new(),
            answers: FuturesUnordered::new(),
            rtt: HashMap::new(),
            redial,
            watchdog: Watchdog::default(),
            topic: advert_topic().hash(),
            files: FileRpcs::default(),
            listening: Vec::new(),
        }
    }

    pub(super) async fn run(mut self) {
        let _stopped = self.stopped.clone().drop_guard();
        let mut housekeeping = tokio::time::interval(self.timers.housekeeping);
        housekeeping.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let next_deadline = self.deadlines.peek().map(|Reverse((at, _))| *at);
            let next_file_deadline = self.files.next_deadline();
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break,
                command = self.commands.recv() => match command {
                    Some(command) => self.on_command(command),
                    None => break,
                },
                Some((id, answer)) = self.answers.next(), if !self.answers.is_empty() => self.on_answer(id, answer),
                _ = tokio::time::sleep_until(next_deadline.unwrap_or_else(Instant::now)), if next_deadline.is_some() => self.expire(),
                Some((id, answer)) = self.files.answers.next(), if !self.files.answers.is_empty() => self.files.on_answer(&mut self.swarm.behaviour_mut().files, id, answer),
                _ = tokio::time::sleep_until(next_file_deadline.unwrap_or_else(Instant::now)), if next_file_deadline.is_some() => self.files.expire(),
                _ = housekeeping.tick() => self.housekeeping(),
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
            }
        }
        tracing::debug!(target: "shoal::net", pending = self.outbound.len(), "network stopped");
    }

    fn emit(&self, event: NetEvent) {
        if let Err(mpsc::error::TrySendError::Full(event)) = self.events.try_send(event) {
            NetCounters::bump(&self.counters.dropped_events);
            tracing::warn!(target: "shoal::net", ?event, "event dropped: the application is not reading");
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Publish { advert, reply } => {
                let payload = wire::encode_advert_from(&advert, &self.listening);
                let result = match self.swarm.behaviour_mut().gossipsub.publish(self.topic.clone(), payload) {
                    Ok(_) | Err(PublishError::NoPeersSubscribedToTopic) => Ok(()),
                    Err(e) => Err(NetError::Publish(e.to_string())),
                };
                let _ = reply.send(result); // the caller may have given up: nothing to do
            }
            Command::Request { peer, request, deadline, reply } => {
                let deadline = deadline.min(self.timers.rpc_max);
                let id = self.swarm.behaviour_mut().rpc.send_request(&peer, request);
                self.outbound.insert(id, Outbound { peer, deadline, reply });
                self.deadlines.push(Reverse((Instant::now() + deadline, id)));
            }
            Command::FileRequest { peer, request, deadline, reply } => {
                let deadline = deadline.min(self.timers.rpc_max);
                self.files.send(&mut self.swarm.behaviour_mut().files, peer, request, deadline, reply);
            }
            Command::ServeFiles { sink, reply } => {
                self.files.set_sink(sink);
                let _ = reply.send(());
            }
            Command::ListenAddrs { reply } => {
                let _ = reply.send(self.swarm.listeners().cloned().collect());
            }
            Command::ConnectedPeers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().map(|p| (*p, self.rtt.get(p).copied())).collect());
            }
        }
    }

    fn finish(&mut self, id: OutboundRequestId, result: impl FnOnce(&Outbound) -> Result<ControlResponse, NetError>) {
        if let Some(pending) = self.outbound.remove(&id) {
            let result = result(&pending);
            let _ = pending.reply.send(result); // the caller may have given up
        }
    }

    fn expire(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, id))) = self.deadlines.peek().copied() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            self.finish(id, |p| Err(NetError::Timeout { peer: p.peer, deadline: p.deadline }));
        }
    }

    fn on_answer(&mut self, id: InboundRequestId, answer: Option<ControlResponse>) {
        let Some(channel) = self.inbound.remove(&id) else { return }; // the caller is gone
        let response = answer.unwrap_or_else(|| rpc::error_response(ErrorCode::Internal, "the node did not answer"));
        // Err: the connection closed meanwhile; libp2p reports it as an inbound failure.
        let _ = self.swarm.behaviour_mut().rpc.send_response(channel, response);
    }

    fn housekeeping(&mut self) {
        let now = Instant::now();
        for connection in self.watchdog.stale(now, self.timers.ping_watchdog) {
            tracing::info!(target: "shoal::net", %connection, "closing a connection with no successful ping");
            NetCounters::bump(&self.counters.watchdog_closes);
            self.swarm.close_connection(connection);
        }
        let swarm = &self.swarm;
        for opts in self.redial.due(now, |p| swarm.is_connected(p)) {
            let id = opts.connection_id();
            if let Err(e) = self.swarm.dial(opts) {
                tracing::debug!(target: "shoal::net", error = %e, "dial not started");
                self.redial.dial_failed(id);
            }
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::Behaviour(BehaviourEvent::Mdns(mdns::Event::Discovered(found))) => {
                let now = Instant::now();
                for (peer, addr) in found {
                    tracing::debug!(target: "shoal::net", %peer, %addr, "discovered");
                    self.swarm.add_peer_address(peer, addr.clone());
                    let _ = self.redial.discovered(peer, addr, now);
                }
                self.housekeeping(); // dial the new ones now, not at the next tick
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message { propagation_source, message_id, message })) => {
                let verdict = match message.source {
                    Some(signer) if message.topic == self.topic => wire::decode_advert_from(&message.data, &signer).map(|(advert, addrs)| {
                        self.learn(signer, addrs);
                        (signer, advert)
                    }),
                    Some(_) => Err(WireError::Missing("the advert topic")),
                    None => Err(WireError::Missing("message source")),
                };
                let acceptance = match verdict {
                    Ok((from, advert)) => {
                        self.emit(NetEvent::Advert { from, advert });
                        MessageAcceptance::Accept
                    }
                    Err(e) => {
                        NetCounters::bump(&self.counters.malformed_gossip);
                        if matches!(e, WireError::NotSigner { .. }) {
                            NetCounters::bump(&self.counters.foreign_adverts);
                        }
                        tracing::debug!(target: "shoal::net", from = %propagation_source, error = %e, "gossip rejected");
                        MessageAcceptance::Reject
                    }
                };
                self.swarm.behaviour_mut().gossipsub.report_message_validation_result(&message_id, &propagation_source, acceptance);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Ping(ping::Event { peer, connection, result: Ok(rtt) })) => {
                self.watchdog.pong(connection, Instant::now());
                self.rtt.insert(peer, rtt);
                self.emit(NetEvent::Rtt { peer, rtt });
            }
            SwarmEvent::Behaviour(BehaviourEvent::Rpc(event)) => self.on_rpc(event),
            SwarmEvent::Behaviour(BehaviourEvent::Files(event)) => self.files.on_event(&mut self.swarm.behaviour_mut().files, event, &self.counters, self.timers.rpc_max),
            SwarmEvent::ConnectionEstablished { peer_id, connection_id, num_established, endpoint, .. } => {
                tracing::debug!(target: "shoal::net", peer = %peer_id, addr = %endpoint.get_remote_address(), "connected");
                self.watchdog.opened(connection_id, Instant::now());
                self.redial.established(peer_id, connection_id);
                if num_established.get() == 1 {
                    self.emit(NetEvent::Connected(peer_id));
                }
            }
            SwarmEvent::ConnectionClosed { peer_id, connection_id, num_established, cause, .. } => {
                tracing::debug!(target: "shoal::net", peer = %peer_id, cause = ?cause, "connection closed");
                self.watchdog.closed(connection_id);
                if num_established == 0 {
                    self.rtt.remove(&peer_id);
                    self.emit(NetEvent::Disconnected(peer_id));
                }
            }
            SwarmEvent::OutgoingConnectionError { connection_id, peer_id, error } => {
                tracing::debug!(target: "shoal::net", peer = ?peer_id, %error, "dial failed");
                self.redial.dial_failed(connection_id);
            }
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(target: "shoal::net", %address, "listening");
                if !self.listening.contains(&address) {
                    self.listening.push(address.clone());
                }
                self.emit(NetEvent::Listening(address));
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => self.listening.retain(|a| *a != address),
            _ => {}
        }
    }

    /// Peer exchange: a member heard of through gossip (its advert relayed by a peer we share)
    /// is dialled at the addresses it advertises, like an mDNS discovery, so that nodes each
    /// given one `--peer` still form a full mesh and agree on who is alive.
    fn learn(&mut self, peer: PeerId, addrs: Vec<Multiaddr>) {
        if peer == *self.swarm.local_peer_id() || self.swarm.is_connected(&peer) || addrs.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut new = false;
        for addr in addrs {
            new |= self.redial.discovered(peer, addr.clone(), now);
            self.swarm.add_peer_address(peer, addr);
        }
        if new {
            tracing::debug!(target: "shoal::net", %peer, "learnt from gossip");
            self.housekeeping();
        }
    }

    fn on_rpc(&mut self, event: rr::Event<ControlRequest, ControlResponse>) {
        match event {
            rr::Event::Message { peer, message: rr::Message::Request { request_id, request, channel }, .. } => self.on_request(peer, request_id, request, channel),
            rr::Event::Message { message: rr::Message::Response { request_id, response }, .. } => {
                let checked = rpc::check_response(&response);
                if checked.is_err() {
                    NetCounters::bump(&self.counters.bad_frames);
                }
                self.finish(request_id, |_| checked.map(|()| response).map_err(NetError::Invalid));
            }
            rr::Event::OutboundFailure { peer, request_id, error, .. } => {
                if matches!(&error, OutboundFailure::Io(e) if e.kind() == std::io::ErrorKind::InvalidData) {
                    NetCounters::bump(&self.counters.bad_frames);
                }
                self.finish(request_id, |p| Err(NetError::from_outbound(peer, error, p.deadline)));
            }
            rr::Event::InboundFailure { peer, request_id, error, .. } => {
                if matches!(&error, rr::InboundFailure::Io(e) if e.kind() == std::io::ErrorKind::InvalidData) {
                    NetCounters::bump(&self.counters.bad_frames);
                }
                tracing::debug!(target: "shoal::net", %peer, %error, "inbound request failed");
                self.inbound.remove(&request_id);
            }
            rr::Event::ResponseSent { .. } => {}
        }
    }

    fn on_request(&mut self, from: PeerId, id: InboundRequestId, request: ControlRequest, channel: ResponseChannel<ControlResponse>) {
        if let Err(e) = rpc::check_request(&request) {
            NetCounters::bump(&self.counters.bad_frames);
            tracing::debug!(target: "shoal::net", %from, error = %e, "request refused");
            let code = if matches!(e, WireError::Version { .. }) { ErrorCode::UnsupportedVersion } else { ErrorCode::BadRequest };
            let _ = self.swarm.behaviour_mut().rpc.send_response(channel, rpc::error_response(code, e.to_string()));
            return;
        }
        let (reply, answer) = oneshot::channel();
        if let Err(e) = self.events.try_send(NetEvent::Request { from, request, reply }) {
            NetCounters::bump(&self.counters.dropped_events);
            let reason = if matches!(e, mpsc::error::TrySendError::Full(_)) { "busy" } else { "not serving requests" };
            let _ = self.swarm.behaviour_mut().rpc.send_response(channel, rpc::error_response(ErrorCode::Busy, reason));
            return;
        }
        self.inbound.insert(id, channel);
        let limit = self.timers.rpc_max;
        self.answers.push(Box::pin(async move { (id, tokio::time::timeout(limit, answer).await.ok().and_then(Result::ok)) }));
    }
}
