//! Forming a tensor-parallel group's data plane over the control plane: each member invites
//! every higher rank with a `LinkInvite` RPC (its offer, a prepared shared-memory file, a TCP
//! listener and token, with RDMA its queue-pair endpoint), the invited member sets up the
//! common transports fastest first and answers with what it set up, and both keep those links,
//! the fastest active, the rest as
//! fallbacks. Links a member sets up on an invite wait in the `LinkBook` until its own
//! formation takes them (or they expire). When both offer it, each pair also gets a libp2p link
//! (`p2p_link`), last in the list; its frame route is registered before the invite or answer
//! goes out, so no frame arrives before its route. Blocking set-up (mapping, connecting, accepting)
//! runs on the blocking pool. Also the order of a group's steps: the leader numbers them and
//! every follower submits them to its stage thread in that order (`GroupOrder`), so every
//! member's all-reduces meet in the same sequence. The leader numbers none until its own slice
//! has loaded (and with it, through the load's barrier, every member's): a step numbered while
//! the group still formed would fail at the leader but wait in a follower's queue, and there
//! hold an all-reduce that no partner ever joins.
//! It does not run layers (the stage thread does) nor decide who is in a group (placement does).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shoal_proto::v1;
use tokio::sync::oneshot;

use super::forward::HopContext;
use crate::cluster::Epoch;
use super::p2p_link::P2pLink;
use crate::dataplane::connect::{join, Invite, Inviter};
use crate::dataplane::{negotiate, Link, Offer, Transport};

/// How long links set up on an invite wait for their member's own formation to take them.
const BOOK_TTL: Duration = Duration::from_secs(120);

/// Which pair of which group a set of links joins.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PairKey {
    pub model: String,
    pub epoch: Epoch,
    pub from_rank: usize,
    pub to_rank: usize,
}

enum Slot {
    /// Links set up on an invite, not yet taken.
    Ready(Vec<Box<dyn Link>>, Instant),
    /// A formation waiting for this pair's invite; dropped (closing its receiver) on expiry.
    Waiting(oneshot::Sender<Vec<Box<dyn Link>>>, Instant),
}

/// Links set up on inbound invites, until the local formation takes them. Cloneable; entries
/// end by being taken, or expire after `BOOK_TTL` (their links closed when dropped).
#[derive(Clone, Default)]
pub struct LinkBook {
    slots: Arc<Mutex<HashMap<PairKey, Slot>>>,
}

impl LinkBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PairKey, Slot>> {
        // A panic while holding the lock leaves only plain data behind: keep using it.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn purge(slots: &mut HashMap<PairKey, Slot>) {
        slots.retain(|_, s| match s {
            Slot::Ready(_, t) | Slot::Waiting(_, t) => t.elapsed() < BOOK_TTL,
        });
    }

    fn put(&self, key: PairKey, links: Vec<Box<dyn Link>>) {
        let mut slots = self.lock();
        Self::purge(&mut slots);
        match slots.remove(&key) {
            Some(Slot::Waiting(tx, _)) => {
                // A formation that gave up dropped its receiver: the links close on drop.
                let _ = tx.send(links);
            }
            _ => {
                slots.insert(key, Slot::Ready(links, Instant::now()));
            }
        }
    }

    async fn take(&self, key: PairKey, wait: Duration) -> Option<Vec<Box<dyn Link>>> {
        let rx = {
            let mut slots = self.lock();
            Self::purge(&mut slots);
            if let Some(Slot::Ready(links, _)) = slots.remove(&key) {
                return Some(links);
            }
            let (tx, rx) = oneshot::channel();
            slots.insert(key.clone(), Slot::Waiting(tx, Instant::now()));
            rx
        };
        let got = tokio::time::timeout(wait, rx).await.ok().and_then(Result::ok);
        if got.is_none() {
            self.lock().remove(&key);
        }
        got
    }
}

/// What this node offers its group peers and where its TCP listeners bind.
#[derive(Debug, Clone)]
pub struct DataplaneConfig {
    pub offer: Offer,
    pub ip: IpAddr,
}

fn transport_name(t: Transport) -> String {
    t.to_string()
}

fn transport_from(name: &str) -> Option<Transport> {
    Some(match name {
        "rdma" => Transport::Rdma,
        "shm" => Transport::Shm,
        "local" => Transport::Local,
        "tcp" => Transport::Tcp,
        "libp2p" => Transport::Libp2p,
        _ => return None,
    })
}

fn invite_to_proto(key: &PairKey, invite: &Invite) -> v1::LinkInvite {
    v1::LinkInvite {
        version: shoal_proto::WIRE_VERSION,
        model: key.model.clone(),
        epoch_round: key.epoch.round,
        epoch_leader: key.epoch.leader.clone(),
        // Ranks are below the group size, far below u32::MAX.
        from_rank: u32::try_from(key.from_rank).unwrap_or(u32::MAX),
        to_rank: u32::try_from(key.to_rank).unwrap_or(u32::MAX),
        host_id: invite.offer.host_id.clone(),
        transports: invite.offer.transports.iter().map(|t| transport_name(*t)).collect(),
        shm_path: invite.shm_path.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
        tcp_addr: invite.tcp_addr.map(|a| a.to_string()).unwrap_or_default(),
        token: invite.token.clone(),
        rdma_addr: invite.rdma_addr.map(|a| a.to_string()).unwrap_or_default(),
        rdma_endpoint: invite.rdma_endpoint.clone(),
    }
}

/// Checks an inbound invite (sizes, names) and turns it into the pair and the invite.
fn invite_from_proto(i: v1::LinkInvite) -> Result<(PairKey, Invite), String> {
    const MAX: usize = 1024;
    if [&i.model, &i.epoch_leader, &i.host_id, &i.shm_path, &i.tcp_addr, &i.token, &i.rdma_addr, &i.rdma_endpoint].iter().any(|s| s.len() > MAX) || i.transports.len() > 8 {
        return Err("an oversized link invite".into());
    }
    if i.from_rank >= i.to_rank {
        return Err(format!("a link invite from rank {} to rank {}", i.from_rank, i.to_rank));
    }
    let shm_path = (!i.shm_path.is_empty()).then(|| std::path::PathBuf::from(&i.shm_path));
    // Shared memory only in the shared-memory directory: an invite never names another file.
    if let Some(p) = &shm_path {
        let dir = crate::dataplane::shm::shm_dir();
        if dir.as_deref() != p.parent() {
            return Err(format!("a shared-memory path outside the shared-memory directory: {}", p.display()));
        }
    }
    let tcp_addr = if i.tcp_addr.is_empty() { None } else { Some(i.tcp_addr.parse().map_err(|_| format!("a bad TCP address `{}`", i.tcp_addr))?) };
    // The endpoint itself is validated by the RDMA link before any device is touched.
    let rdma_addr = if i.rdma_addr.is_empty() { None } else { Some(i.rdma_addr.parse().map_err(|_| format!("a bad RDMA bootstrap address `{}`", i.rdma_addr))?) };
    let offer = Offer { host_id: i.host_id, transports: i.transports.iter().filter_map(|t| transport_from(t)).collect() };
    let key = PairKey { model: i.model, epoch: Epoch { round: i.epoch_round, leader: i.epoch_leader }, from_rank: i.from_rank as usize, to_rank: i.to_rank as usize };
    Ok((key, Invite { offer, shm_path, tcp_addr, token: i.token, rdma_addr, rdma_endpoint: i.rdma_endpoint }))
}

/// Answers an inbound invite: sets up the common transports and books the links.
pub async fn answer_invite(hop: &HopContext, from: libp2p::PeerId, invite: v1::LinkInvite) -> Result<v1::LinkAnswer, String> {
    let (key, invite) = invite_from_proto(invite)?;
    let offer = hop.dataplane.offer.clone();
    let p2p = negotiate(&offer, &invite.offer).contains(&Transport::Libp2p);
    let (mut links, mut established) = tokio::task::spawn_blocking(move || {
        let mut invite = invite;
        invite.offer.transports.retain(|t| *t != Transport::Libp2p);
        join(&invite, &offer)
    })
    .await
    .map_err(|e| e.to_string())?;
    if p2p {
        let pair = PairKey { from_rank: key.to_rank, to_rank: key.from_rank, ..key.clone() };
        links.push(Box::new(P2pLink::open(hop.net.clone(), from, pair, hop.frames.clone())));
        established.push(Transport::Libp2p);
    }
    tracing::info!(target: "shoal::dataplane", event = "links_joined", model = %key.model, from = key.from_rank, to = key.to_rank, transports = ?established);
    hop.links.put(key, links);
    Ok(v1::LinkAnswer { established: established.into_iter().map(transport_name).collect() })
}

/// Sets up this member's links to every other member of its group (`members` in rank order,
/// us at `rank`), within `wait`. One `Vec` of links per rank, fastest first (ours empty).
pub async fn form(hop: &HopContext, model: &str, epoch: &Epoch, rank: usize, members: &[String], wait: Duration) -> Result<Vec<Vec<Box<dyn Link>>>, String> {
    let until = tokio::time::Instant::now() + wait;
    let mut outgoing = Vec::new();
    for (to, peer) in members.iter().enumerate().skip(rank + 1) {
        let key = PairKey { model: model.to_string(), epoch: epoch.clone(), from_rank: rank, to_rank: to };
        let (hop, peer) = (hop.clone(), peer.clone());
        outgoing.push((to, tokio::spawn(async move { invite(&hop, key, &peer, until).await })));
    }
    let mut links: BTreeMap<usize, Vec<Box<dyn Link>>> = BTreeMap::new();
    for from in 0..rank {
        let key = PairKey { model: model.to_string(), epoch: epoch.clone(), from_rank: from, to_rank: rank };
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        match hop.links.take(key, left).await {
            Some(l) if !l.is_empty() => {
                links.insert(from, l);
            }
            Some(_) => return Err(format!("no data-plane transport to member {from} could be set up")),
            None => return Err(format!("member {from} did not invite us within {wait:?}")),
        }
    }
    for (to, task) in outgoing {
        let l = task.await.map_err(|e| e.to_string())??;
        if l.is_empty() {
            return Err(format!("no data-plane transport to member {to} could be set up"));
        }
        links.insert(to, l);
    }
    Ok((0..members.len()).map(|r| links.remove(&r).unwrap_or_default()).collect())
}

/// Invites `peer` (rank `key.to_rank`) until it answers or `until`; then completes the links.
async fn invite(hop: &HopContext, key: PairKey, peer: &str, until: tokio::time::Instant) -> Result<Vec<Box<dyn Link>>, String> {
    let Some(peer_id) = super::coordinator::peer_of(peer) else { return Err(format!("`{peer}` is not a peer id")) };
    let (offer, ip) = (hop.dataplane.offer.clone(), hop.dataplane.ip);
    // Registered before the invite goes out; dropped (unregistered) unless the peer takes it.
    let p2p = offer.transports.contains(&Transport::Libp2p).then(|| P2pLink::open(hop.net.clone(), peer_id, key.clone(), hop.frames.clone()));
    let inviter = tokio::task::spawn_blocking(move || Inviter::new(&offer, ip)).await.map_err(|e| e.to_string())?;
    let request = v1::ControlRequest { version: shoal_proto::WIRE_VERSION, body: Some(v1::control_request::Body::Invite(invite_to_proto(&key, inviter.invite()))) };
    let answer = loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(format!("member {} did not answer our link invite", key.to_rank));
        }
        match hop.net.request(peer_id, request.clone(), left.min(Duration::from_secs(10))).await {
            Ok(v1::ControlResponse { body: Some(v1::control_response::Body::Answer(a)), .. }) => break a,
            Ok(other) => tracing::debug!(target: "shoal::dataplane", "link invite answered with {other:?}"),
            Err(e) => tracing::debug!(target: "shoal::dataplane", "link invite failed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let established: Vec<Transport> = answer.established.iter().filter_map(|t| transport_from(t)).collect();
    tracing::info!(target: "shoal::dataplane", event = "links_invited", model = %key.model, from = key.from_rank, to = key.to_rank, transports = ?established);
    let direct: Vec<Transport> = established.iter().copied().filter(|t| *t != Transport::Libp2p).collect();
    let mut links = tokio::task::spawn_blocking(move || inviter.finish(&direct, Duration::from_secs(10))).await.map_err(|e| e.to_string())?;
    if let (Some(link), true) = (p2p, established.contains(&Transport::Libp2p)) {
        links.push(Box::new(link) as Box<dyn Link>);
    }
    Ok(links)
}

/// Names one group of one plan (its epoch and members in rank order), as `GroupOrder` keys it.
pub fn group_id<'a>(epoch: &Epoch, members: impl IntoIterator<Item = &'a String>) -> String {
    let members: Vec<&str> = members.into_iter().map(String::as_str).collect();
    format!("{}/{}/{}", epoch.round, epoch.leader, members.join(","))
}

/// The order of one group's steps. The leader numbers steps (`lead`) once its slice is loaded
/// (`leader_ready`); a follower runs step n only after steps 1..n (`follow`). A step that waits
/// past its deadline for a missing predecessor fails; the counters restart with each new group.
#[derive(Clone, Default)]
pub struct GroupOrder {
    inner: Arc<Mutex<HashMap<String, OrderState>>>,
}

struct OrderState {
    /// Identifies the group (`group_id`); a different one restarts the counters.
    group: String,
    /// The leader's last number given / the follower's next number to run.
    next: u64,
    /// Followers' steps that arrived ahead of their turn, with what submits them.
    waiting: BTreeMap<u64, Box<dyn FnOnce() + Send>>,
    /// The leader's slice of `group` has loaded: steps may be numbered.
    leader_ready: bool,
}

impl GroupOrder {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, OrderState>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The leader's slice of `group` has loaded (the coordinator says so): numbering starts.
    pub fn leader_ready(&self, model: &str, group: &str) {
        self.lock().insert(model.to_string(), OrderState { group: group.to_string(), next: 0, waiting: BTreeMap::new(), leader_ready: true });
    }

    /// The leader: numbers the step and runs `submit` under the lock, so the stage thread
    /// receives steps in number order. `None` (and `submit` not run) while this node's slice of
    /// `group` has not loaded.
    pub fn lead(&self, model: &str, group: &str, submit: impl FnOnce()) -> Option<u64> {
        let mut all = self.lock();
        let st = all.get_mut(model).filter(|st| st.group == group && st.leader_ready)?;
        st.next += 1;
        submit();
        Some(st.next)
    }

    /// A follower: runs `submit` when step `seq` is next (now, or once its predecessors ran).
    /// Returns false when `seq` is already past (a replay), without running it.
    pub fn follow(&self, model: &str, group: &str, seq: u64, submit: Box<dyn FnOnce() + Send>) -> bool {
        let mut all = self.lock();
        let st = all.entry(model.to_string()).or_insert_with(|| OrderState { group: group.to_string(), next: 1, waiting: BTreeMap::new(), leader_ready: false });
        if st.group != group {
            *st = OrderState { group: group.to_string(), next: 1, waiting: BTreeMap::new(), leader_ready: false };
        }
        if seq < st.next {
            return false;
        }
        st.waiting.insert(seq, submit);
        while let Some(run) = st.waiting.remove(&st.next) {
            run();
            st.next += 1;
        }
        true
    }

    /// Gives up on the steps before `seq` (their predecessor never came): runs what waits up
    /// to and including `seq` in order.
    pub fn skip_to(&self, model: &str, group: &str, seq: u64) {
        let mut all = self.lock();
        let Some(st) = all.get_mut(model) else { return };
        if st.group != group || seq < st.next {
            return;
        }
        let ready: Vec<u64> = st.waiting.range(..=seq).map(|(k, _)| *k).collect();
        for k in ready {
            if let Some(run) = st.waiting.remove(&k) {
                run();
            }
        }
        st.next = seq + 1;
        while let Some(run) = st.waiting.remove(&st.next) {
            run();
            st.next += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_leader_numbers_no_step_before_its_slice_has_loaded() {
        let order = GroupOrder::default();
        let submitted = Arc::new(AtomicUsize::new(0));
        let submit = || {
            let s = submitted.clone();
            move || {
                s.fetch_add(1, Ordering::SeqCst);
            }
        };
        let epoch = Epoch { round: 3, leader: "a".into() };
        let members = ["a".to_string(), "b".to_string()];
        let group = group_id(&epoch, &members);
        assert_eq!(order.lead("m", &group, submit()), None, "still loading: no number, nothing submitted");
        order.leader_ready("m", &group);
        assert_eq!(order.lead("m", &group, submit()), Some(1));
        assert_eq!(order.lead("m", &group, submit()), Some(2));
        let next_plan = group_id(&Epoch { round: 4, leader: "a".into() }, &members);
        assert_eq!(order.lead("m", &next_plan, submit()), None, "a later plan's group waits for its own load");
        assert_eq!(submitted.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_follower_runs_steps_in_the_leaders_order() {
        let order = GroupOrder::default();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let step = |n: u64| {
            let ran = ran.clone();
            Box::new(move || ran.lock().unwrap().push(n)) as Box<dyn FnOnce() + Send>
        };
        assert!(order.follow("m", "g", 2, step(2)));
        assert!(ran.lock().unwrap().is_empty(), "step 2 waits for step 1");
        assert!(order.follow("m", "g", 1, step(1)));
        assert!(!order.follow("m", "g", 1, step(1)), "a replayed number is refused");
        assert!(order.follow("m", "g", 4, step(4)));
        order.skip_to("m", "g", 4);
        assert_eq!(*ran.lock().unwrap(), vec![1, 2, 4]);
    }
}
