//! Setting up the links between two members, whatever carries the two messages: the lower rank
//! (`Inviter`) prepares every transport it has (a shared file, a TCP listener with a token) and
//! sends an `Invite`; the higher rank (`join`) negotiates against its own offer and sets up the
//! common transports fastest first, skipping any that fail to set up, and answers with the list
//! it established; the inviter then completes exactly those. Both ends end with the same links
//! in the same order. A transport offered but failing (a shared file that cannot be mapped, a
//! refused connection, RDMA without a device) simply drops out of the list. With the `rdma`
//! feature the invite also carries the inviter's queue-pair endpoint and a bootstrap address
//! (see `rdma::link`); without it an RDMA offer is kept and fails at the joiner.
//! It does not carry the invite or the answer (the control plane or a rendezvous does).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::shm::{ShmLink, DEFAULT_CAPACITY};
use super::tcp::{self, TcpAcceptor, TOKEN_BYTES};
use super::{negotiate, Link, LinkError, Offer, Transport};

/// What the inviting member tells its peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Invite {
    pub offer: Offer,
    pub shm_path: Option<PathBuf>,
    pub tcp_addr: Option<SocketAddr>,
    /// Hex of the TCP token (also presented on the RDMA bootstrap connection).
    pub token: String,
    /// Where the joiner hands over its RDMA endpoint (feature `rdma`; absent otherwise).
    #[serde(default)]
    pub rdma_addr: Option<SocketAddr>,
    /// Hex of the inviter's RDMA endpoint (`rdma::wire::Endpoint`); empty when not offered.
    #[serde(default)]
    pub rdma_endpoint: String,
}

/// The inviting side between sending its invite and hearing which transports the peer set up.
pub struct Inviter {
    invite: Invite,
    shm: Option<ShmLink>,
    tcp: Option<TcpAcceptor>,
    #[cfg(feature = "rdma")]
    rdma: Option<super::rdma::Offered>,
    token: [u8; TOKEN_BYTES],
}

impl Inviter {
    /// Prepares every transport of `offer`: TCP listens on `tcp_ip`.
    pub fn new(offer: &Offer, tcp_ip: IpAddr) -> Inviter {
        let token = tcp::new_token();
        let mut invite = Invite { offer: offer.clone(), shm_path: None, tcp_addr: None, token: hex(&token), rdma_addr: None, rdma_endpoint: String::new() };
        let mut shm = None;
        let mut tcp = None;
        #[cfg(feature = "rdma")]
        let mut rdma = None;
        for t in &offer.transports {
            match t {
                Transport::Shm => match ShmLink::create(DEFAULT_CAPACITY) {
                    Ok((link, path)) => {
                        invite.shm_path = Some(path);
                        shm = Some(link);
                    }
                    Err(e) => tracing::info!(target: "shoal::dataplane", "not offering shared memory: {e}"),
                },
                Transport::Tcp => match TcpAcceptor::bind(tcp_ip).and_then(|a| Ok((a.addr()?, a))) {
                    Ok((addr, acceptor)) => {
                        invite.tcp_addr = Some(addr);
                        tcp = Some(acceptor);
                    }
                    Err(e) => tracing::info!(target: "shoal::dataplane", "not offering TCP: {e}"),
                },
                #[cfg(feature = "rdma")]
                Transport::Rdma => match super::rdma::Offered::new(tcp_ip) {
                    Ok((offered, addr, endpoint)) => {
                        invite.rdma_addr = Some(addr);
                        invite.rdma_endpoint = endpoint;
                        rdma = Some(offered);
                    }
                    Err(e) => tracing::info!(target: "shoal::dataplane", "not offering RDMA: {e}"),
                },
                _ => {}
            }
        }
        invite.offer.transports.retain(|t| match t {
            Transport::Shm => invite.shm_path.is_some(),
            Transport::Tcp => invite.tcp_addr.is_some(),
            // Without the feature the offer stands and fails at the joiner, as a peer's would.
            Transport::Rdma => cfg!(not(feature = "rdma")) || invite.rdma_addr.is_some(),
            _ => true,
        });
        Inviter {
            invite,
            shm,
            tcp,
            #[cfg(feature = "rdma")]
            rdma,
            token,
        }
    }

    pub fn invite(&self) -> &Invite {
        &self.invite
    }

    /// Completes the transports the peer established (in its order); one that fails here is
    /// left out, and the peer learns of it when its end sees the link closed.
    pub fn finish(mut self, established: &[Transport], wait: Duration) -> Vec<Box<dyn Link>> {
        let mut links: Vec<Box<dyn Link>> = Vec::new();
        for t in established {
            let link: Result<Box<dyn Link>, LinkError> = match t {
                Transport::Shm => match self.shm.take() {
                    Some(mut l) => l.wait_attached(wait).map(|()| Box::new(l) as Box<dyn Link>),
                    None => Err(LinkError::Setup { transport: *t, message: "not prepared".into() }),
                },
                Transport::Tcp => match &self.tcp {
                    Some(a) => a.accept(&self.token, wait).map(|l| Box::new(l) as Box<dyn Link>),
                    None => Err(LinkError::Setup { transport: *t, message: "not prepared".into() }),
                },
                #[cfg(feature = "rdma")]
                Transport::Rdma => match self.rdma.take() {
                    Some(r) => r.accept(&self.token, wait).map(|l| Box::new(l) as Box<dyn Link>),
                    None => Err(LinkError::Setup { transport: *t, message: "not prepared".into() }),
                },
                other => Err(LinkError::Setup { transport: *other, message: "set up by the caller".into() }),
            };
            match link {
                Ok(l) => links.push(l),
                Err(e) => tracing::warn!(target: "shoal::dataplane", "{e}"),
            }
        }
        links
    }
}

/// The joining side: sets up the transports common to `invite` and `local`, fastest first,
/// skipping those that fail. Returns the links and the transports to report back.
pub fn join(invite: &Invite, local: &Offer) -> (Vec<Box<dyn Link>>, Vec<Transport>) {
    let mut links: Vec<Box<dyn Link>> = Vec::new();
    let mut established = Vec::new();
    for t in negotiate(local, &invite.offer) {
        let link: Result<Box<dyn Link>, LinkError> = match t {
            Transport::Shm => match &invite.shm_path {
                Some(p) => ShmLink::open(p).map(|l| Box::new(l) as Box<dyn Link>),
                None => Err(LinkError::Setup { transport: t, message: "no shared file offered".into() }),
            },
            Transport::Tcp => match (invite.tcp_addr, unhex(&invite.token)) {
                (Some(addr), Some(token)) => tcp::connect(addr, &token).map(|l| Box::new(l) as Box<dyn Link>),
                _ => Err(LinkError::Setup { transport: t, message: "no address or token offered".into() }),
            },
            #[cfg(feature = "rdma")]
            Transport::Rdma => match (invite.rdma_addr, unhex(&invite.token)) {
                (Some(addr), Some(token)) => super::rdma::join(addr, &token, &invite.rdma_endpoint).map(|l| Box::new(l) as Box<dyn Link>),
                _ => Err(LinkError::Setup { transport: t, message: "no bootstrap address or token offered".into() }),
            },
            other => Err(LinkError::Setup { transport: other, message: "not available in this build".into() }),
        };
        match link {
            Ok(l) => {
                links.push(l);
                established.push(t);
            }
            Err(e) => tracing::info!(target: "shoal::dataplane", "falling back: {e}"),
        }
    }
    (links, established)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; TOKEN_BYTES]> {
    if s.len() != TOKEN_BYTES * 2 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; TOKEN_BYTES];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}
