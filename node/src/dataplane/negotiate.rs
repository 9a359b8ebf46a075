//! Which transport two members use: each side offers what it has (shared memory only to a
//! peer on the same host, identified by a host id; TCP at an address with a token; the libp2p
//! stream always), and both sort the common ones fastest first, so both ends try the same
//! transport first and fall back in the same order. Pure: no sockets, no files.
//! It does not open links (`shm`, `tcp` do) and does not carry the offers (the control plane does).

use serde::{Deserialize, Serialize};

/// Data-plane transports, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// RDMA verbs over an RC queue pair (cargo feature `rdma`; offered when a device has an
    /// active port).
    Rdma,
    /// A shared-memory ring between two processes of one host.
    Shm,
    /// Threads of one process.
    Local,
    /// A direct TCP connection with TCP_NODELAY.
    Tcp,
    /// The libp2p request-response stream of the control plane.
    Libp2p,
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Rdma => "rdma",
            Transport::Shm => "shm",
            Transport::Local => "local",
            Transport::Tcp => "tcp",
            Transport::Libp2p => "libp2p",
        })
    }
}

/// What one member can offer a peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// Same value on every process of one boot of one machine (`host_id`).
    pub host_id: String,
    pub transports: Vec<Transport>,
}

/// The transports both offers share, fastest first. Shared memory needs the same host id on
/// both sides; an empty host id never matches.
pub fn negotiate(local: &Offer, remote: &Offer) -> Vec<Transport> {
    let same_host = !local.host_id.is_empty() && local.host_id == remote.host_id;
    let mut common: Vec<Transport> = local
        .transports
        .iter()
        .copied()
        .filter(|t| remote.transports.contains(t))
        .filter(|t| !matches!(t, Transport::Shm | Transport::Local) || same_host)
        .collect();
    common.sort();
    common.dedup();
    common
}

/// Which processes can share memory: on Linux `/etc/machine-id`, the kernel's boot id and the
/// mount namespace (processes that see different /dev/shm mounts, such as containers or
/// `ip netns exec` shells, differ), else the host name. Empty when nothing can be read, which
/// disables shared memory.
pub fn host_id() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    let machine = read("/etc/machine-id");
    let boot = read("/proc/sys/kernel/random/boot_id");
    if !machine.is_empty() || !boot.is_empty() {
        let mnt = std::fs::read_link("/proc/self/ns/mnt").map(|p| p.display().to_string()).unwrap_or_default();
        return format!("{machine}/{boot}/{mnt}");
    }
    std::env::var("HOSTNAME").unwrap_or_default()
}

/// What this build can offer right now: RDMA (with the `rdma` feature) when a device has an
/// active port, shared memory where a writable shared-memory directory exists, TCP and the
/// libp2p stream always.
pub fn local_offer() -> Offer {
    let mut transports = Vec::new();
    #[cfg(feature = "rdma")]
    if super::rdma::detect().usable() {
        transports.push(Transport::Rdma);
    }
    if super::shm::shm_dir().is_some() {
        transports.push(Transport::Shm);
    }
    transports.push(Transport::Tcp);
    transports.push(Transport::Libp2p);
    Offer { host_id: host_id(), transports }
}
