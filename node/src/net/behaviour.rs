//! The libp2p pieces of a node: the transport (TCP with pnet when there is a cluster key, then
//! noise and yamux, every handshake under one dial timeout; QUIC only without a key) and the
//! composed behaviour (mDNS, gossipsub, identify, ping, request-response for control RPCs and
//! for peer copy of model files). Only builds them:
//! `event_loop` drives the swarm. `build_swarm` is public so that tests can stand up a rogue
//! peer that speaks the same protocols; nothing else in the program should call it.

use std::time::Duration;

use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Boxed, Transport};
use libp2p::core::upgrade::Version;
use libp2p::futures::{AsyncRead, AsyncWrite};
use libp2p::gossipsub::{self, IdentTopic, MessageAuthenticity, ValidationMode};
use libp2p::identity::Keypair;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{identify, mdns, noise, ping, quic, tcp, yamux, PeerId, Swarm, SwarmBuilder};

use super::codec::{ProstCodec, RPC_PROTOCOL};
use super::files::{FileCodec, FILES_PROTOCOL};
use super::{NetConfig, NetError, NetTimers};

/// The gossipsub topic of adverts; the version is in the name so that a new wire format can
/// run beside the old one during an upgrade.
pub const ADVERT_TOPIC: &str = "shoal/adverts/1";

/// Identify's protocol version string: peers that announce another are still served.
pub const IDENTIFY_PROTOCOL: &str = "/shoal/1.0.0";

/// How long a connection with no open streams lives: long, since the ping watchdog closes
/// dead ones and adverts need standing connections.
const IDLE_CONNECTION: Duration = Duration::from_secs(3600);

/// Every protocol of a node, driven by one swarm.
#[derive(NetworkBehaviour)]
pub struct Behaviour {
    pub mdns: Toggle<mdns::tokio::Behaviour>,
    pub gossipsub: gossipsub::Behaviour,
    pub identify: identify::Behaviour,
    pub ping: ping::Behaviour,
    pub rpc: request_response::Behaviour<ProstCodec>,
    /// Peer copy of model files (`files.rs`).
    pub files: request_response::Behaviour<FileCodec>,
}

impl Behaviour {
    fn new(key: &Keypair, config: &NetConfig) -> Result<Self, NetError> {
        let t = &config.timers;
        let local = key.public().to_peer_id();
        let mdns = if config.mdns {
            let mdns_config = mdns::Config { ttl: t.mdns_ttl, query_interval: t.mdns_query, enable_ipv6: false };
            Some(mdns::tokio::Behaviour::new(mdns_config, local).map_err(|e| NetError::Transport(format!("mdns: {e}")))?)
        } else {
            None
        };
        let mut gossipsub = gossipsub::Behaviour::new(MessageAuthenticity::Signed(key.clone()), gossipsub_config(t)?)
            .map_err(|e| NetError::Transport(format!("gossipsub: {e}")))?;
        gossipsub.subscribe(&IdentTopic::new(ADVERT_TOPIC)).map_err(|e| NetError::Transport(format!("gossipsub subscribe: {e}")))?;
        Ok(Behaviour {
            mdns: mdns.into(),
            gossipsub,
            identify: identify::Behaviour::new(identify::Config::new(IDENTIFY_PROTOCOL.into(), key.public())),
            ping: ping::Behaviour::new(ping::Config::new().with_interval(t.ping_interval).with_timeout(t.ping_timeout)),
            rpc: request_response::Behaviour::with_codec(
                ProstCodec::default(),
                [(RPC_PROTOCOL, ProtocolSupport::Full)],
                request_response::Config::default().with_request_timeout(t.rpc_max),
            ),
            files: request_response::Behaviour::with_codec(
                FileCodec,
                [(FILES_PROTOCOL, ProtocolSupport::Full)],
                request_response::Config::default().with_request_timeout(t.rpc_max),
            ),
        })
    }
}

/// Signed messages only, strictly validated (by us, before anything is forwarded), and no
/// message over `shoal_proto::MAX_GOSSIP_BYTES`.
fn gossipsub_config(t: &NetTimers) -> Result<gossipsub::Config, NetError> {
    gossipsub::ConfigBuilder::default()
        .validation_mode(ValidationMode::Strict)
        .validate_messages()
        .max_transmit_size(shoal_proto::MAX_GOSSIP_BYTES)
        .heartbeat_interval(t.gossip_heartbeat)
        .build()
        .map_err(|e| NetError::Transport(format!("gossipsub config: {e}")))
}

/// TCP (+ pnet) + noise + yamux, and QUIC when there is no cluster key.
fn transport(key: &Keypair, cluster_key: Option<PreSharedKey>, dial_timeout: Duration) -> Result<Boxed<(PeerId, StreamMuxerBox)>, NetError> {
    let noise = noise::Config::new(key).map_err(|e| NetError::Transport(format!("noise: {e}")))?;
    let tcp = tcp::tokio::Transport::new(tcp::Config::default().nodelay(true));
    let Some(psk) = cluster_key else {
        let mut quic_config = quic::Config::new(key);
        quic_config.handshake_timeout = dial_timeout;
        let quic = quic::tokio::Transport::new(quic_config).map(|(peer, conn), _| (peer, StreamMuxerBox::new(conn)));
        return Ok(secure(tcp, noise, dial_timeout).or_transport(quic).map(|either, _| either.into_inner()).boxed());
    };
    Ok(secure(tcp.and_then(move |socket, _| PnetConfig::new(psk).handshake(socket)), noise, dial_timeout))
}

/// Noise and yamux over a byte stream transport, all handshakes within `timeout`.
fn secure<T>(base: T, noise: noise::Config, timeout: Duration) -> Boxed<(PeerId, StreamMuxerBox)>
where
    T: Transport + Send + Unpin + 'static,
    T::Output: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T::Error: Send + Sync + 'static,
    T::Dial: Send + 'static,
    T::ListenerUpgrade: Send + 'static,
{
    base.upgrade(Version::V1Lazy)
        .authenticate(noise)
        .multiplex(yamux::Config::default())
        .timeout(timeout)
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
        .boxed()
}

/// The swarm of one node, not yet listening or dialling.
pub fn build_swarm(key: &Keypair, config: &NetConfig) -> Result<Swarm<Behaviour>, NetError> {
    let transport = transport(key, config.cluster_key, config.timers.dial_timeout)?;
    let behaviour = Behaviour::new(key, config)?;
    Ok(SwarmBuilder::with_existing_identity(key.clone())
        .with_tokio()
        .with_other_transport(|_| transport)
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_behaviour(|_| behaviour)
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(IDLE_CONNECTION))
        .build())
}

/// The advert topic's hash, as gossipsub events name it.
pub fn advert_topic() -> IdentTopic {
    IdentTopic::new(ADVERT_TOPIC)
}
