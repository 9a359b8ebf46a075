//! `LinkGroup`: one member's all-reduce over links to the other members of its group.
//! Two members make one exchange (each sends its partial, each adds); a power-of-two group with
//! a small buffer uses recursive doubling (log2 N exchanges of the whole buffer, the latency
//! choice); anything else a ring (reduce-scatter then all-gather, 2(N-1) steps of N-th chunks).
//! Every member ends with bit-identical sums (additions are commutative pairwise, and a ring
//! reduces each chunk once along one chain), so replicated sampling agrees.
//! Each peer has its links fastest first; when the active one fails (either end closes it,
//! a socket errors, a frame is corrupt) the group closes it, moves to the next, resends the
//! frames of the current and previous call that the peer may have missed, and the call goes
//! on: the request never notices. Receivers drop frames they already have, by (call, step).
//! It does not open links (the transports do) and never waits past the call's deadline.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::engine::tp::{AllReduce, AllReduceError};

use super::{Frame, Link, LinkError, Transport};

/// Buffers up to this many bytes use recursive doubling in power-of-two groups; larger ones the
/// ring, which moves 2(N-1)/N of the buffer per member instead of log2 N whole buffers.
const DOUBLING_MAX_BYTES: usize = 64 * 1024;

/// How long one `recv` waits before the group looks at its other links.
const POLL: Duration = Duration::from_millis(2);

/// The links to one peer, the active one first.
struct PeerLinks {
    peer: usize,
    links: VecDeque<Box<dyn Link>>,
    /// Frames sent in the current and previous call, resent on a new link after a failure.
    retained: Vec<Frame>,
    /// Frames that arrived ahead of the one asked for.
    early: Vec<Frame>,
    /// How many links to this peer failed (for tests and the cluster view).
    fallbacks: usize,
    /// Bytes of frames sent to this peer (headers included, resends included).
    bytes_sent: u64,
}

impl PeerLinks {
    fn front(&mut self) -> Result<&mut Box<dyn Link>, AllReduceError> {
        let peer = self.peer;
        self.links.front_mut().ok_or_else(|| AllReduceError::Broken(format!("no link to member {peer} is left")))
    }

    /// Drops the active link and resends the retained frames on the next one (and the next,
    /// while sending fails).
    fn fail_over(&mut self, why: &LinkError) -> Result<(), AllReduceError> {
        loop {
            let Some(mut dead) = self.links.pop_front() else {
                return Err(AllReduceError::Broken(format!("no link to member {} is left (last: {why})", self.peer)));
            };
            dead.close();
            self.fallbacks += 1;
            tracing::warn!(target: "shoal::dataplane", peer = self.peer, failed = %dead.transport(), next = ?self.links.front().map(|l| l.transport()), "data-plane link failed over: {why}");
            let Some(next) = self.links.front_mut() else {
                return Err(AllReduceError::Broken(format!("no link to member {} is left (last: {why})", self.peer)));
            };
            if self.retained.iter().try_for_each(|f| next.send(f)).is_ok() {
                return Ok(());
            }
        }
    }

    fn send(&mut self, frame: Frame) -> Result<(), AllReduceError> {
        let seq = frame.seq;
        self.retained.retain(|f| f.seq + 1 >= seq);
        self.bytes_sent += (Frame::HEADER_BYTES + frame.data.len() * 4) as u64;
        self.retained.push(frame);
        let frame = self.retained.last().expect("just pushed");
        let result = self.links.front_mut().map(|l| l.send(frame));
        match result {
            Some(Ok(())) => Ok(()),
            // `fail_over` resends every retained frame, this one included.
            Some(Err(e)) => self.fail_over(&e),
            None => Err(AllReduceError::Broken(format!("no link to member {} is left", self.peer))),
        }
    }
}

struct Inner {
    seq: u64,
    /// Indexed by rank; `None` at our own rank.
    peers: Vec<Option<PeerLinks>>,
}

/// One member's side of an all-reduce group.
pub struct LinkGroup {
    rank: usize,
    size: usize,
    deadline: Duration,
    inner: Mutex<Inner>,
    /// Nanoseconds spent inside `all_reduce` (waiting for peers included), for benchmarks.
    reduce_nanos: std::sync::atomic::AtomicU64,
}

impl LinkGroup {
    /// `links[r]` are the links to rank `r`, fastest first (empty at `rank`); each call must
    /// finish within `deadline`.
    pub fn new(rank: usize, links: Vec<Vec<Box<dyn Link>>>, deadline: Duration) -> Result<LinkGroup, AllReduceError> {
        let size = links.len();
        if rank >= size {
            return Err(AllReduceError::Broken(format!("rank {rank} is outside a group of {size}")));
        }
        let mut peers = Vec::with_capacity(size);
        for (peer, l) in links.into_iter().enumerate() {
            if peer == rank {
                peers.push(None);
            } else if l.is_empty() {
                return Err(AllReduceError::Broken(format!("no link to member {peer}")));
            } else {
                peers.push(Some(PeerLinks { peer, links: l.into(), retained: Vec::new(), early: Vec::new(), fallbacks: 0, bytes_sent: 0 }));
            }
        }
        Ok(LinkGroup { rank, size, deadline, inner: Mutex::new(Inner { seq: 0, peers }), reduce_nanos: Default::default() })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The transport in use to each peer (`None` when every link to it failed).
    pub fn transports(&self) -> Vec<(usize, Option<Transport>)> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.peers.iter().flatten().map(|p| (p.peer, p.links.front().map(|l| l.transport()))).collect()
    }

    /// How many times a link of this member failed over.
    pub fn fallbacks(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.peers.iter().flatten().map(|p| p.fallbacks).sum()
    }

    /// Time this member has spent inside all-reduce calls: sending, receiving and waiting for
    /// slower peers.
    pub fn reduce_time(&self) -> Duration {
        Duration::from_nanos(self.reduce_nanos.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Bytes this member has sent to all peers.
    pub fn bytes_sent(&self) -> u64 {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.peers.iter().flatten().map(|p| p.bytes_sent).sum()
    }

    /// Closes the active link to `peer` as a failure would (the peer sees it closed too); the
    /// next call falls back. For tests and for an operator dropping a bad link.
    pub fn break_link(&self, peer: usize) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(Some(p)) = inner.peers.get_mut(peer) {
            if let Some(l) = p.links.front_mut() {
                l.close();
            }
        }
    }

    fn reduce(&self, buf: &mut [f32]) -> Result<(), AllReduceError> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.seq += 1;
        let mut call = Call { rank: self.rank, size: self.size, seq: inner.seq, until: Instant::now() + self.deadline, peers: &mut inner.peers };
        let bytes = std::mem::size_of_val(buf);
        if self.size == 2 {
            let peer = 1 - self.rank;
            let theirs = call.exchange(peer, 0, buf)?;
            add(buf, &theirs)
        } else if self.size.is_power_of_two() && bytes <= DOUBLING_MAX_BYTES {
            let mut step = 0;
            let mut dist = 1;
            while dist < self.size {
                let theirs = call.exchange(self.rank ^ dist, step, buf)?;
                add(buf, &theirs)?;
                step += 1;
                dist <<= 1;
            }
            Ok(())
        } else {
            call.ring(buf)
        }
    }
}

impl AllReduce for LinkGroup {
    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), AllReduceError> {
        if self.size == 1 {
            return Ok(());
        }
        let started = Instant::now();
        let result = self.reduce(buf);
        self.reduce_nanos.fetch_add(started.elapsed().as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
        result
    }
}


fn add(buf: &mut [f32], theirs: &[f32]) -> Result<(), AllReduceError> {
    if theirs.len() != buf.len() {
        return Err(AllReduceError::Length(format!("got {} values, have {}", theirs.len(), buf.len())));
    }
    for (a, b) in buf.iter_mut().zip(theirs) {
        *a += b;
    }
    Ok(())
}

/// One all-reduce call's view of the peers.
struct Call<'a> {
    rank: usize,
    size: usize,
    seq: u64,
    until: Instant,
    peers: &'a mut [Option<PeerLinks>],
}

impl Call<'_> {
    fn peer(&mut self, r: usize) -> Result<&mut PeerLinks, AllReduceError> {
        self.peers.get_mut(r).and_then(Option::as_mut).ok_or_else(|| AllReduceError::Broken(format!("no member {r}")))
    }

    fn send(&mut self, to: usize, step: u32, data: &[f32]) -> Result<(), AllReduceError> {
        let seq = self.seq;
        self.peer(to)?.send(Frame { seq, step, data: data.to_vec() })
    }

    /// Waits for frame `(seq, step)` from `from`, watching the other links while it waits so
    /// that a link a peer closed is failed over even when we are not reading it.
    fn recv(&mut self, from: usize, step: u32) -> Result<Vec<f32>, AllReduceError> {
        let key = (self.seq, step);
        let until = self.until;
        loop {
            let p = self.peer(from)?;
            if let Some(i) = p.early.iter().position(|f| f.key() == key) {
                return Ok(p.early.swap_remove(i).data);
            }
            let wait = POLL.min(until.saturating_duration_since(Instant::now()));
            let got = p.front()?.recv(wait);
            match got {
                Ok(Some(f)) if f.key() == key => return Ok(f.data),
                Ok(Some(f)) if f.key() < key => {} // a resent frame we already have
                Ok(Some(f)) => p.early.push(f),
                Ok(None) => {
                    // A peer this step does not need may have closed its link to fail over (it
                    // waits for our resends on the next one) or because it finished and exited:
                    // move on for it, but a peer with no link left breaks only a call that
                    // needs it, not this one.
                    for other in self.peers.iter_mut().flatten() {
                        if other.peer != from && other.links.front_mut().is_some_and(|l| l.is_closed()) {
                            let why = LinkError::Closed(other.links.front().map_or(Transport::Libp2p, |l| l.transport()));
                            if let Err(e) = other.fail_over(&why) {
                                tracing::debug!(target: "shoal::dataplane", peer = other.peer, "{e}");
                            }
                        }
                    }
                    if Instant::now() >= until {
                        return Err(AllReduceError::Timeout(from));
                    }
                }
                Err(e) => p.fail_over(&e)?,
            }
        }
    }

    /// Sends ours to `peer` and returns theirs. When the buffer does not fit the link's
    /// capacity the lower rank sends first, so that two blocking sends never wait on each other.
    fn exchange(&mut self, peer: usize, step: u32, data: &[f32]) -> Result<Vec<f32>, AllReduceError> {
        let capacity = self.peer(peer)?.front()?.capacity();
        if std::mem::size_of_val(data) + Frame::HEADER_BYTES <= capacity || self.rank < peer {
            self.send(peer, step, data)?;
            self.recv(peer, step)
        } else {
            let theirs = self.recv(peer, step)?;
            self.send(peer, step, data)?;
            Ok(theirs)
        }
    }

    /// Ring all-reduce: reduce-scatter, then all-gather. With chunks larger than a link's
    /// capacity rank 0 receives before it sends, which breaks the cycle of blocking sends.
    fn ring(&mut self, buf: &mut [f32]) -> Result<(), AllReduceError> {
        let n = self.size;
        let chunks = chunk_ranges(buf.len(), n);
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        let biggest = chunks.iter().map(Range::len).max().unwrap_or(0) * 4 + Frame::HEADER_BYTES;
        let capacity = self.peer(next)?.front()?.capacity();
        let recv_first = self.rank == 0 && biggest > capacity;
        let idx = |k: isize| ((k % n as isize + n as isize) % n as isize) as usize;
        let r = self.rank as isize;
        for s in 0..n - 1 {
            let (out, inn) = (chunks[idx(r - s as isize)].clone(), chunks[idx(r - s as isize - 1)].clone());
            let theirs = self.step(next, prev, s as u32, &buf[out], recv_first)?;
            add(&mut buf[inn], &theirs)?;
        }
        for s in 0..n - 1 {
            let (out, inn) = (chunks[idx(r + 1 - s as isize)].clone(), chunks[idx(r - s as isize)].clone());
            let theirs = self.step(next, prev, (n - 1 + s) as u32, &buf[out], recv_first)?;
            if theirs.len() != inn.len() {
                return Err(AllReduceError::Length(format!("got {} values for a chunk of {}", theirs.len(), inn.len())));
            }
            buf[inn].copy_from_slice(&theirs);
        }
        Ok(())
    }

    fn step(&mut self, next: usize, prev: usize, step: u32, out: &[f32], recv_first: bool) -> Result<Vec<f32>, AllReduceError> {
        if recv_first {
            let theirs = self.recv(prev, step)?;
            self.send(next, step, out)?;
            Ok(theirs)
        } else {
            self.send(next, step, out)?;
            self.recv(prev, step)
        }
    }
}

/// `len` values in `n` contiguous chunks, the first `len % n` one longer.
fn chunk_ranges(len: usize, n: usize) -> Vec<Range<usize>> {
    let (base, extra) = (len / n, len % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let l = base + usize::from(i < extra);
            start += l;
            start - l..start
        })
        .collect()
}
