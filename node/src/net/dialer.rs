//! Who to dial and which connections to close, as plain state driven by the event loop:
//! `Redial` keeps static peers and mDNS-discovered peers connected (dial on discovery, then a
//! loop with doubling back-off), and `Watchdog` names connections with no successful ping for
//! too long. Neither touches the swarm: they return `DialOpts` and connection ids.
//! Only the smaller PeerId of a pair dials a discovered peer (simultaneous dials from both
//! sides fail the handshake on both), and every dial takes a fresh port for the same reason.

use std::collections::HashMap;
use std::time::Duration;

use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use tokio::time::Instant;

/// Most peers kept to dial (static and discovered), and most addresses kept per peer.
const MAX_TARGETS: usize = 512;
const MAX_ADDRS: usize = 16;

/// One peer to keep connected and its dial state.
#[derive(Debug)]
struct Target {
    /// Known once the address carries `/p2p/<id>` or a dial to it succeeded.
    peer: Option<PeerId>,
    addrs: Vec<Multiaddr>,
    next_try: Instant,
    backoff: Duration,
    /// The dial in flight, if any: no second dial starts while it runs.
    dialing: Option<ConnectionId>,
}

/// Keeps static and discovered peers connected.
#[derive(Debug)]
pub struct Redial {
    local: PeerId,
    first: Duration,
    max: Duration,
    /// Static peers first (in configuration order), then discovered peers.
    targets: Vec<Target>,
}

impl Redial {
    /// `statics` are dialled at the first `due` call.
    pub fn new(local: PeerId, statics: &[Multiaddr], first: Duration, max: Duration, now: Instant) -> Self {
        let targets = statics
            .iter()
            .map(|addr| {
                let peer = addr.iter().find_map(|p| if let Protocol::P2p(peer) = p { Some(peer) } else { None });
                Target { peer, addrs: vec![addr.clone()], next_try: now, backoff: first, dialing: None }
            })
            .collect();
        Redial { local, first, max, targets }
    }

    /// A peer found by mDNS or heard of through gossip: remember the address; whether to dial
    /// is decided by `due`. Returns whether the address is new. At most `MAX_TARGETS` peers
    /// and `MAX_ADDRS` addresses each are kept, so hostile gossip cannot grow this without bound.
    pub fn discovered(&mut self, peer: PeerId, addr: Multiaddr, now: Instant) -> bool {
        if self.local > peer {
            return false; // the other side (the smaller id) dials
        }
        if let Some(t) = self.targets.iter_mut().find(|t| t.peer == Some(peer)) {
            let new = !t.addrs.contains(&addr) && t.addrs.len() < MAX_ADDRS;
            if new {
                t.addrs.push(addr);
            }
            return new;
        }
        if self.targets.len() >= MAX_TARGETS {
            return false;
        }
        self.targets.push(Target { peer: Some(peer), addrs: vec![addr], next_try: now, backoff: self.first, dialing: None });
        true
    }

    /// Dials to start now: targets that are unconnected, not being dialled, and past their
    /// back-off. Each returned dial doubles its target's back-off.
    pub fn due(&mut self, now: Instant, connected: impl Fn(&PeerId) -> bool) -> Vec<DialOpts> {
        let mut dials = Vec::new();
        for t in &mut self.targets {
            if t.dialing.is_some() || t.peer.as_ref().is_some_and(&connected) || now < t.next_try {
                continue;
            }
            let opts = match t.peer {
                Some(peer) => DialOpts::peer_id(peer).addresses(t.addrs.clone()).condition(PeerCondition::DisconnectedAndNotDialing).allocate_new_port().build(),
                // Only static peers lack an id, and they have exactly one address.
                None => DialOpts::unknown_peer_id().address(t.addrs[0].clone()).allocate_new_port().build(),
            };
            t.dialing = Some(opts.connection_id());
            t.next_try = now + t.backoff;
            t.backoff = (t.backoff * 2).min(self.max);
            dials.push(opts);
        }
        dials
    }

    /// A connection to `peer` is up (`connection` may be one of our dials): learn the peer id
    /// of a static address and start the back-off afresh for the next outage.
    pub fn established(&mut self, peer: PeerId, connection: ConnectionId) {
        for t in &mut self.targets {
            if t.dialing == Some(connection) {
                t.dialing = None;
                t.peer.get_or_insert(peer);
            }
            if t.peer == Some(peer) {
                t.backoff = self.first;
            }
        }
    }

    /// A dial failed (or was refused by its condition): the target waits for its back-off.
    pub fn dial_failed(&mut self, connection: ConnectionId) {
        for t in self.targets.iter_mut().filter(|t| t.dialing == Some(connection)) {
            t.dialing = None;
        }
    }
}

/// Connections and the time of their last successful ping.
#[derive(Debug, Default)]
pub struct Watchdog {
    last_ok: HashMap<ConnectionId, Instant>,
}

impl Watchdog {
    /// A new connection counts as pinged when it opens.
    pub fn opened(&mut self, connection: ConnectionId, now: Instant) {
        self.last_ok.insert(connection, now);
    }

    pub fn pong(&mut self, connection: ConnectionId, now: Instant) {
        if let Some(t) = self.last_ok.get_mut(&connection) {
            *t = now;
        }
    }

    pub fn closed(&mut self, connection: ConnectionId) {
        self.last_ok.remove(&connection);
    }

    /// Connections silent for longer than `limit`; each is named once (it is forgotten here).
    pub fn stale(&mut self, now: Instant, limit: Duration) -> Vec<ConnectionId> {
        let stale: Vec<_> = self.last_ok.iter().filter(|(_, t)| now.duration_since(**t) > limit).map(|(c, _)| *c).collect();
        for c in &stale {
            self.last_ok.remove(c);
        }
        stale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_static_peer_is_redialled_with_doubling_back_off_until_connected() {
        let t0 = Instant::now();
        let addr: Multiaddr = "/ip4/127.0.0.1/tcp/1".parse().unwrap();
        let mut r = Redial::new(PeerId::random(), &[addr], S, 4 * S, t0);
        let first = r.due(t0, |_| false);
        assert_eq!(first.len(), 1);
        assert!(r.due(t0 + 10 * S, |_| false).is_empty(), "no second dial while one is in flight");
        r.dial_failed(first[0].connection_id());
        assert!(r.due(t0 + S / 2, |_| false).is_empty(), "back-off");
        let second = r.due(t0 + S, |_| false);
        assert_eq!(second.len(), 1);
        r.dial_failed(second[0].connection_id());
        assert!(r.due(t0 + 2 * S, |_| false).is_empty(), "back-off doubled to 2 s");
        let third = r.due(t0 + 3 * S, |_| false);
        let peer = PeerId::random();
        r.established(peer, third[0].connection_id());
        assert!(r.due(t0 + 100 * S, |p| *p == peer).is_empty(), "connected: nothing to do");
        let again = r.due(t0 + 100 * S, |_| false);
        assert_eq!(again.len(), 1, "disconnected: redial");
        assert_eq!(again[0].get_peer_id(), Some(peer), "by its learned id");
    }

    #[test]
    fn only_the_smaller_peer_id_dials_a_discovery() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let (small, large) = if a < b { (a, b) } else { (b, a) };
        let t0 = Instant::now();
        let addr: Multiaddr = "/ip4/10.0.0.2/tcp/1".parse().unwrap();
        let mut at_large = Redial::new(large, &[], S, S, t0);
        at_large.discovered(small, addr.clone(), t0);
        assert!(at_large.due(t0, |_| false).is_empty());
        let mut at_small = Redial::new(small, &[], S, S, t0);
        at_small.discovered(large, addr, t0);
        assert_eq!(at_small.due(t0, |_| false).len(), 1);
    }

    #[test]
    fn the_watchdog_names_silent_connections_once() {
        let t0 = Instant::now();
        let (quiet, lively) = (ConnectionId::new_unchecked(1), ConnectionId::new_unchecked(2));
        let mut w = Watchdog::default();
        w.opened(quiet, t0);
        w.opened(lively, t0);
        w.pong(lively, t0 + 2 * S);
        assert!(w.stale(t0 + 2 * S, 3 * S).is_empty());
        assert_eq!(w.stale(t0 + 4 * S, 3 * S), vec![quiet]);
        assert!(w.stale(t0 + 4 * S, 3 * S).is_empty());
        w.closed(lively);
        assert!(w.stale(t0 + 100 * S, 3 * S).is_empty());
    }
}
