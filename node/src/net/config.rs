//! The swarm's configuration: listen and static peer addresses, the optional cluster key,
//! discovery on or off, and the timers (named presets `LAN` and `TEST`). A plain struct passed
//! to `net::spawn`; parsing the command line is the binary's job, not this file's.
//! The cluster key is read from libp2p's pnet key file; only its fingerprint is ever logged
//! (`PreSharedKey`'s `Debug` prints the fingerprint; its `Display` would print the key).

use std::path::Path;
use std::time::Duration;

use libp2p::pnet::PreSharedKey;
use libp2p::Multiaddr;

use super::NetError;

/// The well-known port a node listens on by default (TCP, and UDP for QUIC).
pub const DEFAULT_PORT: u16 = 52416;

/// Everything `net::spawn` needs besides the node key and the cancellation token.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Where to listen; see `NetConfig::default_listen`.
    pub listen: Vec<Multiaddr>,
    /// Static peers (`--peer`), dialled at start and redialled with back-off while unconnected.
    /// A `/p2p/<id>` suffix is optional; without it the peer id is learned on connection.
    pub peers: Vec<Multiaddr>,
    /// Pre-shared key: when set, only nodes with the same key can connect, and QUIC is off
    /// (pnet protects TCP only).
    pub cluster_key: Option<PreSharedKey>,
    /// mDNS discovery on every interface. Tests keep it off (it multicasts on the host network).
    pub mdns: bool,
    pub timers: NetTimers,
}

impl NetConfig {
    /// A node on the well-known port with mDNS on, as `shoal` starts by default.
    pub fn lan(cluster_key: Option<PreSharedKey>) -> Self {
        NetConfig { listen: Self::default_listen(cluster_key.is_some()), peers: Vec::new(), cluster_key, mdns: true, timers: NetTimers::LAN }
    }

    /// All interfaces on `DEFAULT_PORT`: TCP always, QUIC too when there is no cluster key.
    pub fn default_listen(has_cluster_key: bool) -> Vec<Multiaddr> {
        let mut listen = vec![format!("/ip4/0.0.0.0/tcp/{DEFAULT_PORT}")];
        if !has_cluster_key {
            listen.push(format!("/ip4/0.0.0.0/udp/{DEFAULT_PORT}/quic-v1"));
        }
        // Both strings are well-formed multiaddrs: the parse cannot fail.
        listen.iter().map(|a| a.parse().expect("a well-formed default multiaddr")).collect()
    }
}

/// The swarm's timers. libp2p's own defaults (mDNS every 5 minutes, ping failures after
/// ~13 s, 10 s dials) are far too slow for a LAN swarm; see shared/NETWORKING.md.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetTimers {
    /// How often each connection is pinged.
    pub ping_interval: Duration,
    /// How long one ping may take before it counts as failed.
    pub ping_timeout: Duration,
    /// A connection with no successful ping for this long is closed by the watchdog.
    pub ping_watchdog: Duration,
    /// How often mDNS queries the network.
    pub mdns_query: Duration,
    /// How long an mDNS record lives without being refreshed.
    pub mdns_ttl: Duration,
    /// The deadline a caller should use for a control RPC when it has no better one.
    pub rpc_deadline: Duration,
    /// The longest any RPC may take, inbound or outbound; longer deadlines are cut to it.
    pub rpc_max: Duration,
    /// First back-off of the loop that redials known, unconnected peers.
    pub redial: Duration,
    /// Longest back-off of the redial loop (the back-off doubles after each failed dial).
    pub redial_max: Duration,
    /// A dial (transport, pnet, noise and yamux handshakes) that takes longer fails.
    pub dial_timeout: Duration,
    /// Gossipsub's heartbeat (mesh maintenance).
    pub gossip_heartbeat: Duration,
    /// How often the event loop runs its watchdog and redial checks.
    pub housekeeping: Duration,
}

impl NetTimers {
    /// Users' LAN defaults.
    pub const LAN: NetTimers = NetTimers {
        ping_interval: Duration::from_secs(1),
        ping_timeout: Duration::from_secs(2),
        ping_watchdog: Duration::from_secs(3),
        mdns_query: Duration::from_secs(1),
        mdns_ttl: Duration::from_secs(10),
        rpc_deadline: Duration::from_secs(2),
        rpc_max: Duration::from_secs(120),
        redial: Duration::from_secs(1),
        redial_max: Duration::from_secs(30),
        dial_timeout: Duration::from_secs(5),
        gossip_heartbeat: Duration::from_secs(1),
        housekeeping: Duration::from_millis(250),
    };

    /// Fast timers for tests: failures are seen within about 3 s.
    pub const TEST: NetTimers = NetTimers {
        ping_interval: Duration::from_millis(500),
        ping_timeout: Duration::from_secs(1),
        ping_watchdog: Duration::from_millis(2_500),
        mdns_query: Duration::from_secs(1),
        mdns_ttl: Duration::from_secs(5),
        rpc_deadline: Duration::from_secs(2),
        rpc_max: Duration::from_secs(10),
        redial: Duration::from_millis(250),
        redial_max: Duration::from_secs(2),
        dial_timeout: Duration::from_secs(2),
        gossip_heartbeat: Duration::from_millis(500),
        housekeeping: Duration::from_millis(100),
    };
}

/// Reads a cluster key from a libp2p pnet key file (`/key/swarm/psk/1.0.0/`, `/base16/`,
/// 64 hex digits) and logs its fingerprint, never the key.
pub fn load_cluster_key(path: &Path) -> Result<PreSharedKey, NetError> {
    let text = std::fs::read_to_string(path).map_err(|e| NetError::ClusterKey { path: path.to_path_buf(), reason: e.to_string() })?;
    let key: PreSharedKey = text.parse().map_err(|e: libp2p::pnet::KeyParseError| NetError::ClusterKey { path: path.to_path_buf(), reason: e.to_string() })?;
    tracing::info!(target: "shoal::net", fingerprint = %key.fingerprint(), "cluster key loaded");
    Ok(key)
}

/// A fresh random cluster key in the key file format (for `shoal` to write on request).
pub fn new_cluster_key_file() -> String {
    PreSharedKey::new(rand::random()).to_key_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_key_file_reads_back_and_a_bad_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.key");
        let text = new_cluster_key_file();
        std::fs::write(&path, &text).unwrap();
        let key = load_cluster_key(&path).unwrap();
        assert_eq!(key.to_key_file(), text);
        assert!(!format!("{key:?}").contains(text.lines().nth(2).unwrap()), "Debug must not print the key");
        std::fs::write(&path, "/key/swarm/psk/1.0.0/\n/base16/\nzz\n").unwrap();
        assert!(matches!(load_cluster_key(&path), Err(NetError::ClusterKey { .. })));
    }

    #[test]
    fn quic_is_listened_on_only_without_a_key() {
        assert_eq!(NetConfig::default_listen(false).len(), 2);
        assert_eq!(NetConfig::default_listen(true).len(), 1);
    }
}
