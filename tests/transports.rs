//! The data plane's transports: negotiation picks shared memory between members on one host
//! and TCP otherwise (RDMA offered by both, forced or forged, fails setup on a host without a
//! device, in builds with and without the `rdma` feature, and drops out); shared-memory and TCP
//! links carry frames larger than their buffers; a link broken mid-call or mid-request falls
//! back to the next transport and the all-reduce (and the generation) completes with the same
//! result; `shoal tp-member` processes on loopback choose shared memory, survive a broken link,
//! and between network namespaces (root) use TCP.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use shoal::dataplane::connect::{join, Inviter};
use shoal::dataplane::local::local_group;
use shoal::dataplane::negotiate::{host_id, local_offer};
use shoal::dataplane::shm::ShmLink;
use shoal::dataplane::{negotiate, Link, LinkGroup, Offer, Transport};
use shoal::engine::model::ModelSource;
use shoal::engine::sampler::argmax;
use shoal::engine::tp::{AllReduce, TpMember, TpSlice};
use shoal::engine::{LayerRange, Shard, ShardInput, ShardOutput};

use crate::util::{fixture, reference, repo_root, shoal_bin};

fn offer(host: &str, transports: &[Transport]) -> Offer {
    Offer { host_id: host.into(), transports: transports.to_vec() }
}

#[test]
fn negotiation_prefers_shared_memory_on_one_host_and_tcp_across_hosts() {
    let all = [Transport::Rdma, Transport::Libp2p, Transport::Tcp, Transport::Shm];
    assert_eq!(negotiate(&offer("a", &all), &offer("a", &all)), vec![Transport::Rdma, Transport::Shm, Transport::Tcp, Transport::Libp2p]);
    assert_eq!(negotiate(&offer("a", &all), &offer("b", &all)), vec![Transport::Rdma, Transport::Tcp, Transport::Libp2p]);
    assert_eq!(negotiate(&offer("", &all), &offer("", &all)), vec![Transport::Rdma, Transport::Tcp, Transport::Libp2p], "unknown hosts never share memory");
    assert_eq!(negotiate(&offer("a", &[Transport::Shm, Transport::Libp2p]), &offer("a", &[Transport::Tcp, Transport::Libp2p])), vec![Transport::Libp2p]);
    assert!(!host_id().is_empty(), "this host has an id");
    assert!(local_offer().transports.contains(&Transport::Shm), "this Linux host has /dev/shm");
}

/// Sets up the links between two members through `Inviter` and `join`, as the control plane would.
fn pair(inviter_offer: &Offer, joiner_offer: &Offer) -> (Vec<Box<dyn Link>>, Vec<Box<dyn Link>>, Vec<Transport>) {
    let inviter = Inviter::new(inviter_offer, "127.0.0.1".parse().unwrap());
    let (joined, established) = join(inviter.invite(), joiner_offer);
    let invited = inviter.finish(&established, Duration::from_secs(5));
    (invited, joined, established)
}

fn sum_check(groups: &[Arc<LinkGroup>], values: usize, calls: usize, mid_call: impl Fn(usize) + Sync) {
    std::thread::scope(|s| {
        for g in groups {
            let mid_call = &mid_call;
            s.spawn(move || {
                for call in 0..calls {
                    if g.rank() == 0 {
                        mid_call(call);
                    }
                    let mut buf: Vec<f32> = (0..values).map(|i| (i % 7) as f32 + g.rank() as f32 * 0.5).collect();
                    g.all_reduce(&mut buf).expect("all-reduce completes");
                    let n = g.size() as f32;
                    for (i, v) in buf.iter().enumerate() {
                        let want = (i % 7) as f32 * n + 0.5 * n * (n - 1.0) / 2.0;
                        assert_eq!(*v, want, "member {} call {call} value {i}", g.rank());
                    }
                }
            });
        }
    });
}

/// A well-formed RDMA endpoint (48 bytes: magic, RoCE, MTU 4096, QPN 0x1234, PSN 1, 64 data
/// and 8 credit slots of 64 KiB, an IPv4-mapped GID), as hex: what an inviter with a device
/// would put in its invite.
fn forged_rdma_endpoint() -> String {
    let mut b = b"shoalRD1".to_vec();
    b.extend_from_slice(&[2, 5, 0, 0]);
    for v in [0x1234u32, 1, 64, 8, 65536] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1]);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn offered_but_failing_rdma_falls_back_to_shared_memory_then_tcp() {
    // This host has no RDMA device (CI and the machines this was written on): RDMA offered by
    // both ends, as `--dataplane rdma,shm,tcp` forces, fails setup and drops out.
    #[cfg(feature = "rdma")]
    assert!(!shoal::dataplane::rdma::detect().usable(), "this test expects a host without an RDMA device");
    assert!(!local_offer().transports.contains(&Transport::Rdma), "no device: RDMA is not offered unasked");
    let here = host_id();
    let both = offer(&here, &[Transport::Rdma, Transport::Shm, Transport::Tcp]);
    let inviter = Inviter::new(&both, "127.0.0.1".parse().unwrap());
    // With the feature the inviter finds no device and leaves RDMA out of its invite; without
    // it the offer stands and the joiner fails to set it up.
    assert_eq!(inviter.invite().offer.transports.contains(&Transport::Rdma), cfg!(not(feature = "rdma")));
    assert!(inviter.invite().rdma_addr.is_none() && inviter.invite().rdma_endpoint.is_empty());
    let (b, established) = join(inviter.invite(), &both);
    let a = inviter.finish(&established, Duration::from_secs(5));
    assert_eq!(established, vec![Transport::Shm, Transport::Tcp], "RDMA was offered but cannot be set up here");
    assert_eq!(a.iter().map(|l| l.transport()).collect::<Vec<_>>(), established);
    assert_eq!(b.iter().map(|l| l.transport()).collect::<Vec<_>>(), established);
    // The request completes over what was set up, and over TCP once shared memory breaks.
    let deadline = Duration::from_secs(10);
    let groups = vec![Arc::new(LinkGroup::new(0, vec![Vec::new(), a], deadline).unwrap()), Arc::new(LinkGroup::new(1, vec![b, Vec::new()], deadline).unwrap())];
    sum_check(&groups, 1536, 6, |call| if call == 3 { groups[0].break_link(1) });
    assert_eq!(groups[1].transports(), vec![(0, Some(Transport::Tcp))]);

    // An invite that does carry an RDMA endpoint and bootstrap address (as a peer with a device
    // sends): the joiner without a device fails RDMA setup and takes shared memory, then TCP.
    let inviter = Inviter::new(&offer(&here, &[Transport::Shm, Transport::Tcp]), "127.0.0.1".parse().unwrap());
    let bootstrap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut forged = inviter.invite().clone();
    forged.offer.transports.insert(0, Transport::Rdma);
    forged.rdma_addr = Some(bootstrap.local_addr().unwrap());
    forged.rdma_endpoint = forged_rdma_endpoint();
    let (b, established) = join(&forged, &both);
    assert_eq!(established, vec![Transport::Shm, Transport::Tcp]);
    let a = inviter.finish(&established, Duration::from_secs(5));
    let groups = vec![Arc::new(LinkGroup::new(0, vec![Vec::new(), a], deadline).unwrap()), Arc::new(LinkGroup::new(1, vec![b, Vec::new()], deadline).unwrap())];
    sum_check(&groups, 100_000, 2, |_| {});
    // A hostile endpoint never sets up either (with the feature it is refused before any
    // device is looked for).
    forged.rdma_endpoint = "00".repeat(48);
    let (links, established) = join(&forged, &offer(&here, &[Transport::Rdma]));
    assert!(links.is_empty() && established.is_empty());

    let other_host = offer("elsewhere", &[Transport::Shm, Transport::Tcp]);
    let (_, _, established) = pair(&both, &other_host);
    assert_eq!(established, vec![Transport::Tcp], "members on different hosts use TCP");
}

#[test]
fn a_shared_memory_link_broken_mid_sequence_falls_back_to_tcp() {
    let here = host_id();
    let both = offer(&here, &[Transport::Shm, Transport::Tcp]);
    let (a, b, _) = pair(&both, &both);
    let deadline = Duration::from_secs(10);
    let groups = vec![Arc::new(LinkGroup::new(0, vec![Vec::new(), a], deadline).unwrap()), Arc::new(LinkGroup::new(1, vec![b, Vec::new()], deadline).unwrap())];
    assert_eq!(groups[0].transports(), vec![(1, Some(Transport::Shm))]);
    // Decode-sized and prompt-sized buffers (the latter larger than TCP's assumed buffer).
    sum_check(&groups, 1536, 20, |call| if call == 10 { groups[0].break_link(1) });
    sum_check(&groups, 200_000, 3, |_| {});
    assert_eq!(groups[0].transports(), vec![(1, Some(Transport::Tcp))]);
    assert_eq!(groups[1].transports(), vec![(0, Some(Transport::Tcp))]);
    assert_eq!(groups[0].fallbacks() + groups[1].fallbacks(), 2, "each end failed over once");
}

#[test]
fn frames_larger_than_a_shared_memory_ring_stream_through_it() {
    let (mut a, path) = ShmLink::create(4096).expect("shared file");
    let b = ShmLink::open(&path).expect("peer maps it");
    a.wait_attached(Duration::from_secs(1)).expect("attached");
    assert!(!path.exists(), "the file is unlinked once both ends mapped it");
    let groups = vec![
        Arc::new(LinkGroup::new(0, vec![Vec::new(), vec![Box::new(a) as Box<dyn Link>]], Duration::from_secs(10)).unwrap()),
        Arc::new(LinkGroup::new(1, vec![vec![Box::new(b) as Box<dyn Link>], Vec::new()], Duration::from_secs(10)).unwrap()),
    ];
    sum_check(&groups, 100_000, 3, |_| {});
}

#[test]
fn four_members_survive_a_broken_link_in_doubling_and_ring() {
    let groups = local_group(4, 1, Duration::from_secs(10)).expect("group");
    sum_check(&groups, 1000, 12, |call| if call == 4 { groups[0].break_link(1) });
    sum_check(&groups, 100_003, 4, |call| if call == 1 { groups[0].break_link(3) });
    assert!(groups[0].fallbacks() >= 2);
    let groups3 = local_group(3, 0, Duration::from_secs(10)).expect("group");
    sum_check(&groups3, 999, 5, |_| {});
    let lone = local_group(2, 0, Duration::from_secs(2)).expect("group");
    lone[0].break_link(1);
    let mut buf = vec![1.0f32; 8];
    assert!(lone[0].all_reduce(&mut buf).is_err(), "no link left: an error, not a hang");
}

/// A real link that holds back frames of one step for a while (a slow peer).
struct SlowStep<L: Link> {
    inner: L,
    step: u32,
    delay: Duration,
}

impl<L: Link> Link for SlowStep<L> {
    fn transport(&self) -> Transport {
        self.inner.transport()
    }
    fn send(&mut self, frame: &shoal::dataplane::Frame) -> Result<(), shoal::dataplane::LinkError> {
        if frame.step == self.step {
            std::thread::sleep(self.delay);
        }
        self.inner.send(frame)
    }
    fn recv(&mut self, wait: Duration) -> Result<Option<shoal::dataplane::Frame>, shoal::dataplane::LinkError> {
        self.inner.recv(wait)
    }
    fn is_closed(&mut self) -> bool {
        self.inner.is_closed()
    }
    fn close(&mut self) {
        self.inner.close()
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
}

/// A member that finished the last call and went away (its links closed) must not break the
/// call its peers are still finishing with someone else: in a group of 4 (recursive doubling),
/// member 0 is done after its two exchanges while member 1 still waits for member 3.
#[test]
fn a_member_leaving_after_its_last_call_does_not_break_the_peers_still_in_it() {
    use shoal::dataplane::local::channel_pair;
    let n = 4;
    let mut links: Vec<Vec<Vec<Box<dyn Link>>>> = (0..n).map(|_| (0..n).map(|_| Vec::new()).collect()).collect();
    for a in 0..n {
        for b in a + 1..n {
            let (x, y) = channel_pair();
            links[a][b].push(Box::new(x));
            if (a, b) == (1, 3) {
                links[b][a].push(Box::new(SlowStep { inner: y, step: 1, delay: Duration::from_millis(300) }));
            } else {
                links[b][a].push(Box::new(y));
            }
        }
    }
    let groups: Vec<LinkGroup> = links.into_iter().enumerate().map(|(rank, l)| LinkGroup::new(rank, l, Duration::from_secs(10)).unwrap()).collect();
    std::thread::scope(|s| {
        for g in &groups {
            s.spawn(move || {
                let mut buf = vec![g.rank() as f32 + 1.0; 64];
                g.all_reduce(&mut buf).unwrap_or_else(|e| panic!("member {}: {e}", g.rank()));
                assert!(buf.iter().all(|v| *v == 10.0), "member {} got the sum", g.rank());
                if g.rank() == 0 {
                    (1..n).for_each(|p| g.break_link(p)); // as its exit would
                }
            });
        }
    });
    let mut buf = vec![1.0f32; 4];
    let err = groups[1].all_reduce(&mut buf).expect_err("the next call needs the member that left");
    assert!(err.to_string().contains("member 0"), "{err}");
}

#[test]
fn a_generation_whose_shared_memory_link_breaks_completes_over_tcp_with_the_same_tokens() {
    let source = ModelSource::open(&fixture("qwen2")).expect("fixture");
    let prompt = reference("qwen2").prompt_ids;
    let whole = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("whole");
    let greedy = |shard: &Shard, break_at: Option<(usize, &LinkGroup)>| {
        let mut cache = shard.new_cache();
        let mut input = prompt.clone();
        let mut out = Vec::new();
        for step in 0..16 {
            if let Some((at, g)) = break_at {
                if at == step {
                    g.break_link(1);
                }
            }
            let ShardOutput::Logits(l) = shard.forward(ShardInput::Tokens(&input), &mut cache, false).expect("forward") else { panic!("logits") };
            let next = argmax(&l.squeeze(0).unwrap().to_vec1::<f32>().unwrap());
            out.push(next);
            input = vec![next];
        }
        out
    };
    let want = greedy(&whole, None);
    let here = host_id();
    let both = offer(&here, &[Transport::Shm, Transport::Tcp]);
    let (a, b, _) = pair(&both, &both);
    let deadline = Duration::from_secs(10);
    let groups = [Arc::new(LinkGroup::new(0, vec![Vec::new(), a], deadline).unwrap()), Arc::new(LinkGroup::new(1, vec![b, Vec::new()], deadline).unwrap())];
    let shards: Vec<Shard> = (0..2)
        .map(|rank| {
            let m = TpMember { slice: TpSlice { rank, size: 2 }, reduce: groups[rank].clone() };
            Shard::load_tp(&source.weights, &source.spec, LayerRange::full(source.spec.num_layers), &Device::Cpu, Some(m)).expect("slice")
        })
        .collect();
    let got = std::thread::scope(|s| {
        let h0 = s.spawn(|| greedy(&shards[0], Some((6, &groups[0]))));
        let h1 = s.spawn(|| greedy(&shards[1], None));
        [h0.join().unwrap(), h1.join().unwrap()]
    });
    assert_eq!(got[0], want);
    assert_eq!(got[1], want);
    assert_eq!(groups[1].transports(), vec![(0, Some(Transport::Tcp))], "the request finished over TCP");
}

/// Runs `n` `shoal tp-member` processes (each wrapped by `wrap(rank)`) on one rendezvous
/// directory; returns each one's JSON line.
fn members(n: usize, extra: &[&str], wrap: impl Fn(usize) -> Vec<String>) -> Vec<serde_json::Value> {
    let dir = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..n)
        .map(|rank| {
            let w = wrap(rank);
            let mut cmd = if w.is_empty() { Command::new(shoal_bin()) } else { let mut c = Command::new(&w[0]); c.args(&w[1..]).arg(shoal_bin()); c };
            cmd.args(["tp-member", "--rank", &rank.to_string(), "--size", &n.to_string(), "--threads", "1", "--rendezvous"])
                .arg(dir.path())
                .args(extra)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("shoal tp-member starts")
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = wait_with_deadline(c, Duration::from_secs(120));
            assert!(out.status.success(), "tp-member failed: {}", String::from_utf8_lossy(&out.stderr));
            serde_json::from_slice(&out.stdout).expect("one JSON line")
        })
        .collect()
}

fn wait_with_deadline(mut child: std::process::Child, deadline: Duration) -> std::process::Output {
    let started = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > deadline {
            let _ = child.kill();
            panic!("tp-member did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn single_node_tokens(model: &Path, prompt: &[u32]) -> Vec<u64> {
    let source = ModelSource::open(model).expect("model");
    let whole = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("whole");
    let mut cache = whole.new_cache();
    let mut input = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..16 {
        let ShardOutput::Logits(l) = whole.forward(ShardInput::Tokens(&input), &mut cache, false).expect("forward") else { panic!("logits") };
        let next = argmax(&l.squeeze(0).unwrap().to_vec1::<f32>().unwrap());
        out.push(next as u64);
        input = vec![next];
    }
    out
}

fn tokens(v: &serde_json::Value) -> Vec<u64> {
    v["tokens"].as_array().expect("tokens").iter().map(|t| t.as_u64().unwrap()).collect()
}

#[test]
fn member_processes_on_one_host_use_shared_memory_and_survive_its_failure() {
    for name in ["qwen2", "gemma3"] {
        let model = fixture(name);
        let prompt = reference(name).prompt_ids;
        let ids = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let want = single_node_tokens(&model, &prompt);
        let model_arg = model.display().to_string();
        for n in [2, 4] {
            let outs = members(n, &["--model", &model_arg, "--prompt-ids", &ids, "--steps", "16"], |_| Vec::new());
            for o in &outs {
                assert_eq!(tokens(o), want, "{name}: TP {n} processes differ from one node");
                assert!(o["transports"].as_array().unwrap().iter().all(|t| t[1] == "shm"), "{name}: shared memory on one host: {o}");
            }
        }
        let outs = members(2, &["--model", &model_arg, "--prompt-ids", &ids, "--steps", "16", "--break-link-after", "5"], |_| Vec::new());
        for o in &outs {
            assert_eq!(tokens(o), want, "{name}: the request completed with the same tokens after the link broke");
            assert_eq!(o["transports"][0][1], "tcp", "{name}: fell back to TCP: {o}");
            assert_eq!(o["fallbacks"], 1);
        }
        assert_eq!(outs[0]["transports_before_break"][0][1], "shm");
    }
}

#[test]
fn member_processes_forced_to_offer_rdma_without_a_device_generate_over_shared_memory() {
    let model = fixture("qwen2");
    let prompt = reference("qwen2").prompt_ids;
    let ids = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let want = single_node_tokens(&model, &prompt);
    let model_arg = model.display().to_string();
    let outs = members(2, &["--model", &model_arg, "--prompt-ids", &ids, "--steps", "16", "--transports", "rdma,shm,tcp"], |_| Vec::new());
    for o in &outs {
        assert_eq!(tokens(o), want, "the generation completed with one node's tokens");
        assert_eq!(o["transports"][0][1], "shm", "RDMA failed setup and shared memory took over: {o}");
        assert_eq!(o["fallbacks"], 0, "RDMA never became a link, so nothing failed over");
    }
}

#[test]
fn member_processes_in_two_network_namespaces_use_tcp() {
    let is_root = Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false);
    if !is_root {
        eprintln!("skipped: network namespaces need root");
        return;
    }
    let prefix = format!("tp{}", std::process::id() % 100_000);
    let script = repo_root().join("scripts/netns.sh");
    let status = Command::new(&script).args(["up", "2", &prefix]).stdout(Stdio::null()).status().expect("netns.sh");
    assert!(status.success(), "scripts/netns.sh up failed");
    struct Down(std::path::PathBuf, String);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = Command::new(&self.0).args(["down", &self.1]).status();
        }
    }
    let _down = Down(script, prefix.clone());
    let model = fixture("qwen2");
    let prompt = reference("qwen2").prompt_ids;
    let ids = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let want = single_node_tokens(&model, &prompt);
    let model_arg = model.display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new("ip")
                .args(["netns", "exec", &format!("{prefix}-{}", rank + 1)])
                .arg(shoal_bin())
                .args(["tp-member", "--rank", &rank.to_string(), "--size", "2", "--threads", "1", "--ip", &format!("10.77.0.{}", rank + 1)])
                .args(["--model", &model_arg, "--prompt-ids", &ids, "--steps", "16", "--rendezvous"])
                .arg(dir.path())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("ip netns exec")
        })
        .collect();
    for c in children {
        let out = wait_with_deadline(c, Duration::from_secs(60));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(tokens(&v), want);
        assert_eq!(v["transports"][0][1], "tcp", "namespaces do not share memory: {v}");
    }
}
