//! In-process links: two threads of one process joined by channels, and `local_group`, which
//! builds a whole tensor-parallel group of N members for one process (tests, and a machine
//! running every member itself). Closing either end is seen by both, like a real link.
//! It does not cross a process boundary (`shm` and `tcp` do).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use crate::engine::tp::AllReduceError;

use super::{Frame, Link, LinkError, LinkGroup, Transport};

/// One end of an in-process link.
pub struct ChannelLink {
    /// To the peer's receiver; dropped by the peer when its end goes away.
    tx: Sender<Frame>,
    rx: Receiver<Frame>,
    /// Shared by both ends: set by `close` on either.
    closed: Arc<AtomicBool>,
}

/// Two connected ends.
pub fn channel_pair() -> (ChannelLink, ChannelLink) {
    let (a_tx, b_rx) = channel();
    let (b_tx, a_rx) = channel();
    let closed = Arc::new(AtomicBool::new(false));
    (ChannelLink { tx: a_tx, rx: a_rx, closed: closed.clone() }, ChannelLink { tx: b_tx, rx: b_rx, closed })
}

impl Link for ChannelLink {
    fn transport(&self) -> Transport {
        Transport::Local
    }

    fn send(&mut self, frame: &Frame) -> Result<(), LinkError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(LinkError::Closed(Transport::Local));
        }
        self.tx.send(frame.clone()).map_err(|_| LinkError::Closed(Transport::Local))
    }

    fn recv(&mut self, wait: Duration) -> Result<Option<Frame>, LinkError> {
        // Frames sent before the peer closed are still delivered, as a socket or ring would.
        if let Ok(f) = self.rx.try_recv() {
            return Ok(Some(f));
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(LinkError::Closed(Transport::Local));
        }
        match self.rx.recv_timeout(wait) {
            Ok(f) => Ok(Some(f)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(LinkError::Closed(Transport::Local)),
        }
    }

    fn is_closed(&mut self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn close(&mut self) {
        self.closed.store(true, Ordering::Release);
    }

    fn capacity(&self) -> usize {
        usize::MAX
    }
}

/// A group of `n` members in one process, fully connected by channels; that many more channel
/// links per pair (`fallbacks`) are kept behind the first.
pub fn local_group(n: usize, fallbacks: usize, deadline: Duration) -> Result<Vec<Arc<LinkGroup>>, AllReduceError> {
    let mut links: Vec<Vec<Vec<Box<dyn Link>>>> = (0..n).map(|_| (0..n).map(|_| Vec::new()).collect()).collect();
    for a in 0..n {
        for b in a + 1..n {
            for _ in 0..=fallbacks {
                let (x, y) = channel_pair();
                links[a][b].push(Box::new(x));
                links[b][a].push(Box::new(y));
            }
        }
    }
    links.into_iter().enumerate().map(|(rank, l)| LinkGroup::new(rank, l, deadline).map(Arc::new)).collect()
}
