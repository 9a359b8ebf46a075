//! Download and peer-copy throughput, each against a baseline on the same machine:
//! shoal's hub client vs `curl` fetching the same file from the same local hub server
//! (`tests/models/hub_server.rs`), and a peer copy between two libp2p swarms on 127.0.0.1 vs the
//! same bytes over a raw TCP socket on loopback. Both sides of each pair write the file to disk;
//! shoal's side also hashes it (sha256) as it arrives, the baselines do not.
//! Run: `cargo run --release --example models_bench [-- FILE]` (default: the gemma3-270m GGUF
//! of the fetch script's cache). Prints MB/s and ratios; asserts nothing.

#[path = "../tests/models/hub_server.rs"]
#[allow(dead_code)] // the tests use more of the fake hub than the benchmark
mod hub_server;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use shoal::models::hub::{HubClient, HubConfig, RemoteFile};
use shoal::models::peer::PeerSource;
use shoal::models::{Phase, Progress, Store};
use shoal::net::{self, NetConfig, NetTimers};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const RUNS: usize = 3;

fn best(times: &[f64]) -> f64 {
    times.iter().cloned().fold(f64::INFINITY, f64::min)
}

fn main() -> anyhow::Result<()> {
    let file = match std::env::args().nth(1) {
        Some(f) => PathBuf::from(f),
        None => dirs::home_dir().unwrap().join(".cache/shoal/models/gemma3-270m/model.gguf"),
    };
    anyhow::ensure!(file.is_file(), "{}: no such file (run scripts/fetch-model.sh gemma3-270m, or pass a file)", file.display());
    let size = std::fs::metadata(&file)?.len();
    let mb = size as f64 / 1e6;
    let work = tempfile::tempdir()?;
    println!("file: {} ({mb:.1} MB), best of {RUNS} runs each", file.display());

    // Hub download vs curl, same server, same file.
    let hub = hub_server::FakeHub::start();
    let name = "model.gguf";
    let files = hub.add_repo("bench/model", false, &[(name, &file)]);
    let sha256 = files[0].sha256.clone();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut ours = Vec::new();
    for i in 0..RUNS {
        let dest = work.path().join(format!("hub-{i}.gguf"));
        let part = work.path().join(format!("hub-{i}.part"));
        let mut config = HubConfig::from_env();
        config.endpoint = hub.url();
        let client = HubClient::new(config)?;
        let remote = RemoteFile { name: name.into(), size: Some(size), sha256: Some(sha256.clone()) };
        let progress = Progress::default();
        let t = progress.start("bench", Phase::Downloading, "hub", Some(size));
        let start = Instant::now();
        rt.block_on(client.download("bench/model", "main", &remote, &part, &dest, &t, &CancellationToken::new()))?;
        ours.push(start.elapsed().as_secs_f64());
        std::fs::remove_file(&dest)?;
    }
    let mut curl = Vec::new();
    let url = format!("{}/bench/model/resolve/main/{name}", hub.url());
    for i in 0..RUNS {
        let dest = work.path().join(format!("curl-{i}.gguf"));
        let start = Instant::now();
        let status = std::process::Command::new("curl").args(["-sf", "-o"]).arg(&dest).arg(&url).status()?;
        curl.push(start.elapsed().as_secs_f64());
        anyhow::ensure!(status.success() && std::fs::metadata(&dest)?.len() == size, "curl failed");
        std::fs::remove_file(&dest)?;
    }
    let (o, c) = (mb / best(&ours), mb / best(&curl));
    println!("hub download: shoal {o:.0} MB/s (with sha256), curl {c:.0} MB/s; ratio shoal/curl {:.2}", o / c);
    drop(hub);

    // Peer copy over libp2p vs raw TCP on loopback.
    let (p, r) = rt.block_on(peer_vs_tcp(&file, size, work.path()))?;
    println!("peer copy: libp2p {:.0} MB/s (TCP+noise+yamux, {} KiB chunks, {} in flight, with sha256), raw TCP {:.0} MB/s; ratio {:.2}", mb / p.0, p.1 >> 10, p.2, mb / r, r / p.0);
    Ok(())
}

async fn peer_vs_tcp(file: &Path, size: u64, work: &Path) -> anyhow::Result<((f64, u32, usize), f64)> {
    let cancel = CancellationToken::new();
    let serve_dir = work.join("a");
    std::fs::create_dir_all(serve_dir.join("models/bench-model"))?;
    let linked = serve_dir.join("models/bench-model/model.gguf");
    if std::fs::hard_link(file, &linked).is_err() {
        std::fs::copy(file, &linked)?;
    }
    let store = Arc::new(Store::with_roots(serve_dir.join("models"), vec![], vec![]));
    let record = tokio::task::spawn_blocking({
        let store = store.clone();
        move || store.servable("bench-model")
    })
    .await??
    .manifest
    .files
    .into_iter()
    .find(|f| f.path == "model.gguf")
    .unwrap();
    let listen = || NetConfig { listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()], peers: vec![], cluster_key: None, mdns: false, timers: NetTimers::LAN };
    let (a, mut a_events) = net::spawn(Keypair::generate_ed25519(), listen(), cancel.child_token())?;
    tokio::spawn(async move { while a_events.recv().await.is_some() {} });
    tokio::spawn(shoal::models::peer::serve(a.clone(), store, cancel.child_token()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let a_addr = a.listen_addrs().await?.into_iter().next().unwrap().with(Protocol::P2p(a.local_peer_id()));
    let mut config = listen();
    config.peers = vec![a_addr];
    let (b, mut b_events) = net::spawn(Keypair::generate_ed25519(), config, cancel.child_token())?;
    tokio::spawn(async move { while b_events.recv().await.is_some() {} });
    while !b.connected_peers().await?.iter().any(|(p, _)| *p == a.local_peer_id()) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut source = PeerSource::new(b.clone(), vec![a.local_peer_id()]);
    // Tuning knobs for experiments: chunk bytes and requests in flight.
    if let Some(c) = std::env::var("BENCH_CHUNK").ok().and_then(|v| v.parse().ok()) {
        source.chunk = c;
    }
    if let Some(w) = std::env::var("BENCH_WINDOW").ok().and_then(|v| v.parse().ok()) {
        source.window = w;
    }
    let mut peer = Vec::new();
    for i in 0..RUNS {
        let dest = work.join(format!("peer-{i}.gguf"));
        let part = work.join(format!("peer-{i}.part"));
        let progress = Progress::default();
        let t = progress.start("bench", Phase::Copying, "peer", Some(size));
        let start = Instant::now();
        source.copy_file(a.local_peer_id(), "bench-model", &record, &part, &dest, &t, &cancel).await?;
        peer.push(start.elapsed().as_secs_f64());
        std::fs::remove_file(&dest)?;
    }
    let mut raw = Vec::new();
    for i in 0..RUNS {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let path = file.to_path_buf();
        let sender = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await?;
            let mut f = tokio::fs::File::open(path).await?;
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = f.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                socket.write_all(&buf[..n]).await?;
            }
            socket.shutdown().await?;
            anyhow::Ok(())
        });
        let dest = work.join(format!("tcp-{i}.gguf"));
        let start = Instant::now();
        let mut socket = tokio::net::TcpStream::connect(addr).await?;
        let mut out = tokio::fs::File::create(&dest).await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        loop {
            let n = socket.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n]).await?;
            got += n as u64;
        }
        out.flush().await?;
        raw.push(start.elapsed().as_secs_f64());
        sender.await??;
        anyhow::ensure!(got == size, "raw TCP moved {got} of {size} bytes");
        std::fs::remove_file(&dest)?;
    }
    cancel.cancel();
    Ok(((best(&peer), source.chunk, source.window), best(&raw)))
}
