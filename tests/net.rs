//! The `net` swarm actor with real libp2p swarms on 127.0.0.1: static `--peer`-style
//! addresses, mDNS always off (tests never multicast on the host network). Each node runs an
//! observer task that records what it sees, answers RPCs by echoing, and gossips its advert
//! every 200 ms. Every wait has a deadline; measured figures are printed (`--nocapture`).
//! A dead link is simulated by a TCP relay that goes silent (no FIN, no RST); QUIC is checked
//! beside TCP (it is on only without a cluster key).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use shoal::cluster::NodeAdvert;
use shoal::net::{self, rpc, NetConfig, NetCounters, NetError, NetEvent, NetHandle, NetTimers, PreSharedKey};
use shoal_proto::v1::{self, control_request, control_response, forward_request, forward_response};
use tokio_util::sync::CancellationToken;

/// A request with this id is held unanswered (to test deadlines and disconnects).
const HOLD: u64 = 999;

#[derive(Default)]
struct Seen {
    connected: HashSet<PeerId>,
    adverts: HashMap<PeerId, usize>,
    disconnected_at: HashMap<PeerId, Instant>,
    connected_at: HashMap<PeerId, Instant>,
}

struct Node {
    handle: NetHandle,
    addr: Multiaddr,
    seen: Arc<Mutex<Seen>>,
    cancel: CancellationToken,
}

impl Node {
    fn id(&self) -> PeerId {
        self.handle.local_peer_id()
    }
    fn seen<T>(&self, f: impl FnOnce(&Seen) -> T) -> T {
        f(&self.seen.lock().unwrap())
    }
}

fn advert(id: PeerId) -> NodeAdvert {
    NodeAdvert {
        id: id.to_string(),
        name: "test".into(),
        priority: 0,
        memory_total: 1 << 30,
        memory_offered: 1 << 29,
        mem_bandwidth: 1e10,
        flops: 1e11,
        backend: "cpu".into(),
        gpu: None,
        decode_bandwidth: 0.0,
        addresses: vec![],
        models: vec![],
        wants: vec![],
        plan: None,
    }
}

fn loopback_config(peers: Vec<Multiaddr>, cluster_key: Option<PreSharedKey>) -> NetConfig {
    NetConfig { listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()], peers, cluster_key, mdns: false, timers: NetTimers::TEST }
}

fn echo(request: v1::ControlRequest) -> v1::ControlResponse {
    match request.body {
        Some(control_request::Body::Forward(f)) => {
            let output = match f.input {
                Some(forward_request::Input::Tokens(t)) => forward_response::Output::Token(t.ids.iter().sum()),
                Some(forward_request::Input::Hidden(h)) => forward_response::Output::Hidden(h),
                None => unreachable!("net checks that a forward has an input"),
            };
            let forward = v1::ForwardResponse { version: shoal_proto::WIRE_VERSION, request_id: f.request_id, output: Some(output) };
            rpc::response(control_response::Body::Forward(forward))
        }
        Some(control_request::Body::Release(_)) => rpc::response(control_response::Body::Released(v1::Released { known: false })),
        Some(control_request::Body::Frame(_)) => rpc::response(control_response::Body::FrameAck(v1::GroupAck {})),
        Some(control_request::Body::Invite(i)) => rpc::response(control_response::Body::Answer(v1::LinkAnswer { established: i.transports })),
        None => unreachable!("net checks that a request has a body"),
    }
}

/// Starts a node on loopback TCP with its observer, and waits for its listen address.
async fn start(peers: Vec<Multiaddr>, cluster_key: Option<PreSharedKey>) -> Node {
    start_with(loopback_config(peers, cluster_key)).await
}

/// Starts a node with its observer, and waits for its first listen address.
async fn start_with(config: NetConfig) -> Node {
    let key = Keypair::generate_ed25519();
    let cancel = CancellationToken::new();
    let (handle, mut events) = net::spawn(key, config, cancel.clone()).expect("net starts");
    let addr = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            if let Some(NetEvent::Listening(addr)) = events.recv().await {
                return addr;
            }
        }
    })
    .await
    .expect("a listen address within 2 s")
    .with(Protocol::P2p(handle.local_peer_id()));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (record, publisher) = (seen.clone(), handle.clone());
    let held = Arc::new(Mutex::new(Vec::new()));
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            let mut s = record.lock().unwrap();
            match event {
                NetEvent::Connected(p) => {
                    s.connected.insert(p);
                    s.connected_at.insert(p, Instant::now());
                }
                NetEvent::Disconnected(p) => {
                    s.connected.remove(&p);
                    s.disconnected_at.insert(p, Instant::now());
                }
                NetEvent::Advert { from, advert } => {
                    assert_eq!(advert.id, from.to_string(), "net delivers only adverts about their signer");
                    *s.adverts.entry(from).or_default() += 1;
                }
                NetEvent::Request { request, reply, .. } => match &request.body {
                    Some(control_request::Body::Forward(f)) if f.request_id == HOLD => held.lock().unwrap().push(reply),
                    _ => {
                        let _ = reply.send(echo(request));
                    }
                },
                NetEvent::Rtt { .. } | NetEvent::Listening(_) => {}
            }
        }
    });
    let me = advert(handle.local_peer_id());
    let stop = cancel.clone();
    tokio::spawn(async move {
        while !stop.is_cancelled() {
            let _ = publisher.publish_advert(&me).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    Node { handle, addr, seen, cancel }
}

/// Polls `done` every 10 ms until it holds or `limit` passes; returns the time it took.
async fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if done() {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

fn forward(request_id: u64, input: forward_request::Input) -> v1::ControlRequest {
    let forward = v1::ForwardRequest { version: shoal_proto::WIRE_VERSION, request_id, model: "m".into(), input: Some(input), ..Default::default() };
    rpc::request(control_request::Body::Forward(forward))
}

fn tokens(ids: &[u32]) -> forward_request::Input {
    forward_request::Input::Tokens(v1::Tokens { ids: ids.to_vec() })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_connect_and_exchange_adverts_within_3s() {
    let started = Instant::now();
    let a = start(vec![], None).await;
    let b = start(vec![a.addr.clone()], None).await;
    let c = start(vec![a.addr.clone(), b.addr.clone()], None).await;
    let nodes = [&a, &b, &c];
    let mesh = wait_until(Duration::from_secs(3), || nodes.iter().all(|n| n.seen(|s| s.connected.len() == 2))).await;
    let mesh = mesh.unwrap_or_else(|| panic!("full mesh within 3 s; connected: {:?}", nodes.map(|n| n.seen(|s| s.connected.len()))));
    let gossip = wait_until(Duration::from_secs(3), || {
        nodes.iter().all(|n| nodes.iter().filter(|m| m.id() != n.id()).all(|m| n.seen(|s| s.adverts.contains_key(&m.id()))))
    })
    .await
    .expect("every node has an advert from both others within 3 s");
    let connect = c.seen(|s| s.connected_at.values().max().copied()).unwrap();
    eprintln!("net: 3 nodes: full mesh {mesh:?} after the third started, adverts both ways {gossip:?} later, total {:?}", started.elapsed());
    eprintln!("net: the last connection came up {:?} after the first node started", connect.duration_since(started));
    wait_until(Duration::from_secs(2), || false).await; // let a few pings run
    let peers = a.handle.connected_peers().await.unwrap();
    assert_eq!(peers.len(), 2);
    for (peer, rtt) in &peers {
        let rtt = rtt.expect("a ping round-trip time after 2 s");
        eprintln!("net: ping rtt a -> {peer}: {rtt:?}");
        assert!(rtt < Duration::from_millis(500));
    }
    assert_eq!(NetCounters::get(&a.handle.counters().malformed_gossip), 0);
}

/// Peer exchange: nodes each given only the first node as `--peer` (a star) learn of each other
/// from the adverts the hub relays, dial each other, and end as a full mesh, so every node
/// sees the same members (and elects the same leader).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_given_only_a_hub_as_peer_learn_each_other_from_gossip_and_form_a_full_mesh() {
    let hub = start(vec![], None).await;
    let leaves = [start(vec![hub.addr.clone()], None).await, start(vec![hub.addr.clone()], None).await, start(vec![hub.addr.clone()], None).await];
    let mesh = wait_until(Duration::from_secs(10), || leaves.iter().all(|n| n.seen(|s| s.connected.len() == 3))).await;
    let mesh = mesh.unwrap_or_else(|| panic!("each leaf connected to the hub and both other leaves; connected: {:?}", leaves.each_ref().map(|n| n.seen(|s| s.connected.len()))));
    eprintln!("net: a star of 1 hub and 3 leaves became a full mesh in {mesh:?}");
    for leaf in &leaves {
        for other in leaves.iter().filter(|o| o.id() != leaf.id()) {
            assert!(leaf.seen(|s| s.connected.contains(&other.id())), "leaf {} connected to leaf {}", leaf.id(), other.id());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_end_by_response_deadline_or_disconnect() {
    let a = start(vec![], None).await;
    let b = start(vec![a.addr.clone()], None).await;
    wait_until(Duration::from_secs(3), || a.seen(|s| s.connected.contains(&b.id()))).await.expect("connected within 3 s");

    let reply = a.handle.request(b.id(), forward(1, tokens(&[1, 2, 3])), Duration::from_secs(2)).await.expect("a response");
    assert!(matches!(reply.body, Some(control_response::Body::Forward(v1::ForwardResponse { output: Some(forward_response::Output::Token(6)), .. }))));
    let rounds = 200;
    let t = Instant::now();
    for i in 0..rounds {
        a.handle.request(b.id(), forward(i, tokens(&[1])), Duration::from_secs(2)).await.expect("a response");
    }
    eprintln!("net: small request round trip {:?} (mean of {rounds})", t.elapsed() / rounds as u32);

    // 4 MiB of hidden states out and back, checked bit for bit.
    let values: Vec<f32> = (0..1 << 20).map(|i| i as f32 * 0.5).collect();
    let hidden = rpc::hidden_from_f32(256, 4096, &values).unwrap();
    let t = Instant::now();
    let reply = a.handle.request(b.id(), forward(2, forward_request::Input::Hidden(hidden)), Duration::from_secs(5)).await.unwrap();
    let elapsed = t.elapsed();
    let Some(control_response::Body::Forward(v1::ForwardResponse { output: Some(forward_response::Output::Hidden(back)), .. })) = reply.body else {
        panic!("hidden states back, got {reply:?}")
    };
    assert_eq!(rpc::hidden_to_f32(&back).unwrap(), values);
    eprintln!("net: 4 MiB hidden states there and back {elapsed:?}");

    // A request that is not our wire version is answered with an error and counted.
    let mut old = forward(3, tokens(&[1]));
    old.version = 0;
    let reply = a.handle.request(b.id(), old, Duration::from_secs(2)).await.unwrap();
    let Some(control_response::Body::Error(e)) = reply.body else { panic!("an error reply, got {reply:?}") };
    assert_eq!(e.code, v1::ErrorCode::UnsupportedVersion as i32);
    assert_eq!(NetCounters::get(&b.handle.counters().bad_frames), 1);

    // Deadline: b holds the request; a gives up at its deadline, not later.
    let t = Instant::now();
    let err = a.handle.request(b.id(), forward(HOLD, tokens(&[1])), Duration::from_millis(300)).await.unwrap_err();
    assert!(matches!(err, NetError::Timeout { .. }), "{err}");
    assert!((Duration::from_millis(300)..Duration::from_millis(1_500)).contains(&t.elapsed()), "gave up after {:?}", t.elapsed());

    // Disconnect: b dies while holding a request with a long deadline.
    let pending = {
        let handle = a.handle.clone();
        let peer = b.id();
        tokio::spawn(async move { handle.request(peer, forward(HOLD, tokens(&[1])), Duration::from_secs(8)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    b.cancel.cancel();
    let err = tokio::time::timeout(Duration::from_secs(3), pending).await.expect("ends within 3 s of the drop").unwrap().unwrap_err();
    eprintln!("net: a request in flight to a peer that died failed after {:?}: {err}", t.elapsed());
    assert!(matches!(err, NetError::Disconnected { .. } | NetError::Stream { .. }), "{err}");

    // And a new request to the dead peer fails within its deadline.
    let t = Instant::now();
    let err = a.handle.request(b.id(), forward(4, tokens(&[1])), Duration::from_secs(2)).await.unwrap_err();
    eprintln!("net: a request to a dead peer failed after {:?}: {err}", t.elapsed());
    assert!(t.elapsed() <= Duration::from_millis(2_200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_another_cluster_key_never_connects() {
    let key = |byte| PreSharedKey::new([byte; 32]);
    let a = start(vec![], Some(key(1))).await;
    let b = start(vec![a.addr.clone()], Some(key(1))).await;
    let stranger = start(vec![a.addr.clone(), b.addr.clone()], Some(key(2))).await;
    wait_until(Duration::from_secs(3), || a.seen(|s| s.adverts.contains_key(&b.id())) && b.seen(|s| s.adverts.contains_key(&a.id())))
        .await
        .expect("same-key nodes connect and gossip within 3 s");
    tokio::time::sleep(Duration::from_secs(3)).await;
    for n in [&a, &b] {
        assert!(!n.seen(|s| s.connected_at.contains_key(&stranger.id()) || s.adverts.contains_key(&stranger.id())), "the stranger got in");
    }
    assert!(stranger.seen(|s| s.connected_at.is_empty() && s.adverts.is_empty()), "the stranger connected");
    assert!(stranger.handle.connected_peers().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_gossip_is_rejected_and_counted_and_honest_adverts_still_arrive() {
    let a = start(vec![], None).await;
    let b = start(vec![a.addr.clone()], None).await;
    // The rogue: a real swarm speaking our protocols, publishing garbage on the advert topic
    // and a well-formed advert about somebody else.
    let rogue_key = Keypair::generate_ed25519();
    let mut rogue = net::build_swarm(&rogue_key, &loopback_config(vec![], None)).unwrap();
    rogue.dial(a.addr.clone()).unwrap();
    let topic = libp2p::gossipsub::IdentTopic::new(net::ADVERT_TOPIC);
    let foreign = shoal::net::wire::encode_advert(&advert(b.id()));
    let rogue_task = tokio::spawn(async move {
        use libp2p::futures::StreamExt;
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let mut sent = 0;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let payload = if sent % 2 == 0 { vec![0xde, 0xad, 0xbe, 0xef, 0xff] } else { foreign.clone() };
                    if rogue.behaviour_mut().gossipsub.publish(topic.clone(), payload).is_ok() {
                        sent += 1;
                    }
                }
                _ = rogue.select_next_some() => {}
            }
        }
    });
    let counters = a.handle.counters();
    wait_until(Duration::from_secs(3), || NetCounters::get(&counters.malformed_gossip) >= 4 && NetCounters::get(&counters.foreign_adverts) >= 2)
        .await
        .expect("garbage and foreign adverts counted within 3 s");
    let before = a.seen(|s| s.adverts.get(&b.id()).copied().unwrap_or(0));
    wait_until(Duration::from_secs(2), || a.seen(|s| s.adverts.get(&b.id()).copied().unwrap_or(0) > before + 2))
        .await
        .expect("honest adverts keep arriving");
    assert!(!a.seen(|s| s.adverts.contains_key(&rogue_key.public().to_peer_id())), "no advert delivered from the rogue");
    assert!(a.handle.connected_peers().await.is_ok(), "the node is still up");
    eprintln!("net: rejected {} malformed gossip messages ({} foreign adverts)", NetCounters::get(&counters.malformed_gossip), NetCounters::get(&counters.foreign_adverts));
    rogue_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_is_disconnected_within_3s() {
    let a = start(vec![], None).await;
    let b = start(vec![a.addr.clone()], None).await;
    wait_until(Duration::from_secs(3), || a.seen(|s| s.connected.contains(&b.id()))).await.expect("connected within 3 s");
    let t = Instant::now();
    b.cancel.cancel();
    b.handle.stopped().await;
    wait_until(Duration::from_secs(3), || a.seen(|s| s.disconnected_at.contains_key(&b.id()))).await.expect("Disconnected within 3 s");
    let took = a.seen(|s| s.disconnected_at[&b.id()]).duration_since(t);
    eprintln!("net: a killed peer was reported disconnected {took:?} after the kill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_carries_adverts_and_requests_without_a_cluster_key() {
    let quic_and_tcp = |peers| NetConfig {
        listen: vec!["/ip4/127.0.0.1/udp/0/quic-v1".parse().unwrap(), "/ip4/127.0.0.1/tcp/0".parse().unwrap()],
        ..loopback_config(peers, None)
    };
    let a = start_with(quic_and_tcp(vec![])).await;
    // Each listener reports its address when it is up, the UDP one not necessarily first.
    let quic = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            let addrs = a.handle.listen_addrs().await.unwrap();
            if let Some(quic) = addrs.into_iter().find(|addr| addr.iter().any(|p| matches!(p, Protocol::QuicV1))) {
                break quic;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a QUIC listen address within 3 s");
    let t = Instant::now();
    let b = start_with(quic_and_tcp(vec![quic.with(Protocol::P2p(a.id()))])).await;
    wait_until(Duration::from_secs(3), || a.seen(|s| s.connected.contains(&b.id()))).await.expect("connected over QUIC within 3 s");
    let connected = a.seen(|s| s.connected_at[&b.id()]).duration_since(t);
    wait_until(Duration::from_secs(3), || a.seen(|s| s.adverts.contains_key(&b.id()))).await.expect("an advert over QUIC within 3 s");
    let rounds = 100;
    let started = Instant::now();
    for i in 0..rounds {
        b.handle.request(a.id(), forward(i, tokens(&[2])), Duration::from_secs(2)).await.expect("a response over QUIC");
    }
    eprintln!("net: QUIC: connected {connected:?} after the dialler started, small request round trip {:?} (mean of {rounds})", started.elapsed() / rounds as u32);
}

/// A TCP relay to `target` that can go silent: while `cut`, it keeps every socket open but
/// forwards nothing, as a pulled cable does (no FIN, no RST).
async fn silent_relay(target: std::net::SocketAddr, cut: Arc<AtomicBool>) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = listener.accept().await {
            let Ok(outbound) = tokio::net::TcpStream::connect(target).await else { continue };
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            for (mut from, mut to) in [(ri, wo), (ro, wi)].map(|(r, w)| (Box::new(r) as Box<dyn tokio::io::AsyncRead + Send + Unpin>, w)) {
                let cut = cut.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        match from.read(&mut buf).await {
                            Ok(0) | Err(_) if cut.load(Ordering::SeqCst) => std::future::pending::<()>().await,
                            Ok(0) | Err(_) => break,
                            Ok(_) if cut.load(Ordering::SeqCst) => continue,
                            Ok(n) => {
                                if to.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                });
            }
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_link_is_closed_by_the_ping_watchdog_and_redialled_when_it_returns() {
    let a = start(vec![], None).await;
    let a_port = a.addr.iter().find_map(|p| if let Protocol::Tcp(port) = p { Some(port) } else { None }).unwrap();
    let cut = Arc::new(AtomicBool::new(false));
    let relay = silent_relay(([127, 0, 0, 1], a_port).into(), cut.clone()).await;
    let via_relay: Multiaddr = format!("/ip4/127.0.0.1/tcp/{relay}/p2p/{}", a.id()).parse().unwrap();
    let b = start(vec![via_relay], None).await;
    wait_until(Duration::from_secs(3), || a.seen(|s| s.connected.contains(&b.id())) && b.seen(|s| s.connected.contains(&a.id())))
        .await
        .expect("connected through the relay within 3 s");
    tokio::time::sleep(Duration::from_secs(1)).await;

    cut.store(true, Ordering::SeqCst);
    let limit = NetTimers::TEST.ping_watchdog + Duration::from_secs(1);
    let both = wait_until(limit, || a.seen(|s| !s.connected.contains(&b.id())) && b.seen(|s| !s.connected.contains(&a.id()))).await;
    let both = both.unwrap_or_else(|| panic!("both sides see the cut within {limit:?}"));
    let closes = NetCounters::get(&a.handle.counters().watchdog_closes) + NetCounters::get(&b.handle.counters().watchdog_closes);
    assert!(closes >= 1, "the watchdog closed the connection");
    eprintln!("net: a silent link was reported disconnected on both sides {both:?} after the cut ({closes} watchdog closes)");

    tokio::time::sleep(Duration::from_secs(1)).await; // redials meanwhile hang in the handshake and time out
    cut.store(false, Ordering::SeqCst);
    let back = wait_until(Duration::from_secs(6), || a.seen(|s| s.connected.contains(&b.id())) && b.seen(|s| s.connected.contains(&a.id())))
        .await
        .expect("redialled within 6 s of the link's return");
    eprintln!("net: reconnected {back:?} after the link returned");
}

/// mDNS discovery, run only inside a network namespace whose one real interface is `eth0`
/// (`scripts/netns.sh up 1 && scripts/netns.sh exec 1 -- <suite binary> net::mdns --ignored`):
/// anywhere else it refuses to start nodes, so it never multicasts on the host network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a network namespace: see its doc comment"]
async fn mdns_discovers_a_full_mesh_inside_a_namespace() {
    let dev = std::fs::read_to_string("/proc/net/dev").unwrap();
    let mut interfaces: Vec<&str> = dev.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    interfaces.sort();
    // A host may have just lo and eth0 too: also require that eth0 is on the namespaces' subnet.
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").and_then(|s| s.connect("10.77.0.254:9").and_then(|()| s.local_addr()));
    let on_subnet = matches!(probe, Ok(std::net::SocketAddr::V4(a)) if a.ip().octets()[..3] == [10, 77, 0]);
    assert!(interfaces == ["eth0", "lo"] && on_subnet, "not inside a scripts/netns.sh namespace: refusing to multicast");
    let mdns = || NetConfig { listen: vec!["/ip4/0.0.0.0/tcp/0".parse().unwrap()], mdns: true, ..loopback_config(vec![], None) };
    let t = Instant::now();
    let nodes = [start_with(mdns()).await, start_with(mdns()).await, start_with(mdns()).await];
    let mesh = wait_until(Duration::from_secs(3), || nodes.iter().all(|n| n.seen(|s| s.connected.len() == 2))).await;
    let mesh = mesh.unwrap_or_else(|| panic!("full mesh by mDNS within 3 s; connected: {:?}", nodes.each_ref().map(|n| n.seen(|s| s.connected.len()))));
    eprintln!("net: mDNS full mesh of 3 {mesh:?} after the last started ({:?} in all)", t.elapsed());
}
