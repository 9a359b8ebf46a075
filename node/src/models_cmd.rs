//! `shoal models ...`: list, pull (peers first, then the hub, with a progress bar), rm, import,
//! and share (serve this node's models to peers until interrupted). Thin wiring over
//! `shoal::models`; it prints to the terminal and holds no logic of its own beyond that.
//! The progress bar redraws one stderr line on a terminal, and prints a line every few
//! seconds otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use shoal::models::catalogue::{self, Format};
use shoal::models::hub::{HubClient, HubConfig};
use shoal::models::peer::PeerSource;
use shoal::models::{self, Progress, PullRequest, Sources, Store};
use shoal::net::{self, NetConfig, NetTimers};
use tokio_util::sync::CancellationToken;

#[derive(clap::Args)]
pub struct ModelsArgs {
    #[command(subcommand)]
    command: ModelsCommand,
}

#[derive(clap::Subcommand)]
enum ModelsCommand {
    /// The models on this node; with --all, also the catalogue's models not downloaded.
    List {
        #[arg(long)]
        all: bool,
    },
    /// Fetch a model: a catalogue id, a hub repo (owner/name) or a GGUF repo with a
    /// quantization (owner/name:q8_0). Peers given with --peer are asked first.
    Pull(PullArgs),
    /// Delete a model from this node's data directory.
    Rm { id: String },
    /// Copy a GGUF file or a safetensors folder into the store; its id is its name.
    Import { path: PathBuf },
    /// Quantize a safetensors model (llama, mistral, qwen2, qwen3) into a GGUF in the store.
    Quantize {
        /// A model directory, or the id of a safetensors model in the store.
        source: String,
        /// q4_k_m (default), q8_0 or f16.
        #[arg(long = "type", default_value = "q4_k_m")]
        kind: shoal::engine::quantize::QuantKind,
        /// Output directory (default: the store, as `<id>-<type>`).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Serve this node's models to peers (peer copy) until interrupted.
    Share {
        /// Where to listen for peers (a libp2p multiaddr).
        #[arg(long, default_value = "/ip4/0.0.0.0/tcp/52417")]
        listen: Multiaddr,
    },
}

#[derive(clap::Args)]
struct PullArgs {
    name: String,
    /// The GGUF file to take from a repo holding several.
    #[arg(long)]
    file: Option<String>,
    /// Branch, tag or commit on the hub.
    #[arg(long, default_value = "main")]
    revision: String,
    /// Only the files holding layers START..END (a pipeline stage), e.g. 0..14.
    #[arg(long, value_parser = parse_layers)]
    layers: Option<(u32, u32)>,
    /// For a catalogue id: gguf or safetensors (default: the catalogue's first).
    #[arg(long, value_parser = parse_format)]
    format: Option<Format>,
    /// A peer to copy from before going to the hub (a multiaddr ending in /p2p/<id>); repeatable.
    #[arg(long)]
    peer: Vec<Multiaddr>,
    /// Never contact the hub: peers only.
    #[arg(long)]
    no_hub: bool,
    /// Files downloaded at once.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
}

fn parse_layers(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once("..").ok_or_else(|| format!("`{s}`: use START..END, e.g. 0..14"))?;
    let (a, b): (u32, u32) = (a.trim().parse().map_err(|_| format!("`{a}` is not a layer number"))?, b.trim().parse().map_err(|_| format!("`{b}` is not a layer number"))?);
    if a >= b {
        return Err(format!("`{s}` is an empty range"));
    }
    Ok((a, b))
}

fn parse_format(s: &str) -> Result<Format, String> {
    match s.to_ascii_lowercase().as_str() {
        "gguf" => Ok(Format::Gguf),
        "safetensors" => Ok(Format::Safetensors),
        _ => Err(format!("`{s}`: use gguf or safetensors")),
    }
}

pub fn run(args: ModelsArgs, data_dir: &Path) -> anyhow::Result<()> {
    let store = Store::open(data_dir, vec![]);
    match args.command {
        ModelsCommand::List { all } => list(&store, all),
        ModelsCommand::Rm { id } => {
            let removed = store.remove(&id)?;
            eprintln!("removed {id} ({})", removed.display());
            Ok(())
        }
        ModelsCommand::Import { path } => {
            std::fs::create_dir_all(store.models_dir()).with_context(|| format!("creating {}", store.models_dir().display()))?;
            let model = store.import(&path)?;
            println!("{}", model.id);
            eprintln!("imported {} as {} ({})", path.display(), model.id, model.path.display());
            Ok(())
        }
        ModelsCommand::Quantize { source, kind, out } => {
            let src = match PathBuf::from(&source) {
                p if p.exists() => p,
                _ => store.find(&source).map(|m| m.path).with_context(|| format!("{source}: no such directory, and no model with this id here"))?,
            };
            let id = shoal::models::id::model_id(&src);
            let out = out.unwrap_or_else(|| store.models_dir().join(format!("{id}-{}", kind.name())));
            let t0 = std::time::Instant::now();
            let report = shoal::engine::quantize::quantize_hf_dir(&src, &out, kind).with_context(|| format!("quantizing {}", src.display()))?;
            eprintln!("wrote {} tensors, {:.1} MB, in {:.1}s", report.tensors, report.bytes as f64 / 1e6, t0.elapsed().as_secs_f64());
            println!("{}", out.display());
            Ok(())
        }
        ModelsCommand::Pull(args) => runtime()?.block_on(pull(store, args)),
        ModelsCommand::Share { listen } => runtime()?.block_on(share(store, listen)),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("shoal-io").enable_all().build()?)
}

fn list(store: &Store, all: bool) -> anyhow::Result<()> {
    let local = store.scan();
    println!("{:<28} {:<12} {:>7} {:>10}  {}", "ID", "FAMILY", "LAYERS", "SIZE", "PATH");
    for m in &local {
        let d = store.details(m);
        let layers = d.layers.map_or("?".to_string(), |l| l.to_string());
        // A stage's directory holds some layers only: say which.
        let part = m.dir().and_then(shoal::models::store::read_manifest).and_then(|man| man.layers).map_or(String::new(), |ranges| {
            let ranges: Vec<String> = ranges.iter().map(|(s, e)| format!("{s}..{e}")).collect();
            format!(" (layers {} only)", ranges.join(", "))
        });
        println!("{:<28} {:<12} {:>7} {:>10}  {}{part}", m.id, d.family.as_deref().unwrap_or("?"), layers, human(m.size_bytes), m.path.display());
    }
    if all {
        println!();
        println!("{:<28} {:<12} {:>7} {:>10}  {}", "CATALOGUE", "FAMILY", "LAYERS", "SIZE", "SOURCE");
        for k in catalogue::MODELS.iter().filter(|k| !local.iter().any(|m| m.id == k.id)) {
            let v = k.default_variant();
            let source = if v.file.is_empty() { v.repo.to_string() } else { format!("{} ({})", v.repo, v.quant) };
            println!("{:<28} {:<12} {:>7} {:>10}  {}", k.id, k.family, k.layers, human(v.bytes), source);
        }
    }
    Ok(())
}

async fn pull(store: Store, args: PullArgs) -> anyhow::Result<()> {
    let cancel = CancellationToken::new();
    let progress = Progress::default();
    let mut sources = Sources::default();
    if !args.no_hub {
        let mut config = HubConfig::from_env();
        config.parallel = args.parallel.max(1);
        sources.hub = Some(HubClient::new(config)?);
    }
    let net_cancel = cancel.child_token();
    if !args.peer.is_empty() {
        sources.peers = Some(connect_peers(&args.peer, net_cancel.clone()).await?);
    } else if args.no_hub {
        anyhow::bail!("--no-hub needs at least one --peer");
    }
    std::fs::create_dir_all(store.models_dir()).with_context(|| format!("creating {}", store.models_dir().display()))?;
    let req = PullRequest { name: args.name.clone(), file: args.file, revision: args.revision, layers: args.layers, format: args.format };
    let bar = tokio::spawn(draw_progress(progress.clone(), cancel.child_token()));
    let interrupted = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            interrupted.cancel();
        }
    });
    let started = Instant::now();
    let result = models::pull(&store, &req, &sources, &progress, &cancel).await;
    cancel.cancel();
    let _ = bar.await;
    let outcome = result?;
    let secs = started.elapsed().as_secs_f64();
    let fetched = outcome.from_hub + outcome.from_peers;
    eprintln!(
        "{}: {} files in {} ({} from the hub, {} from {} peer(s), {} already here) in {secs:.1}s{}",
        outcome.model.id,
        outcome.files.len(),
        outcome.dir.display(),
        human(outcome.from_hub),
        human(outcome.from_peers),
        outcome.peers_used.len(),
        human(outcome.reused),
        if fetched > 0 { format!(", {}/s", human((fetched as f64 / secs.max(1e-3)) as u64)) } else { String::new() },
    );
    println!("{}", outcome.model.id);
    Ok(())
}

/// Starts a throwaway network identity, dials `addrs` and waits (briefly) for the connections.
async fn connect_peers(addrs: &[Multiaddr], cancel: CancellationToken) -> anyhow::Result<PeerSource> {
    let mut peers = Vec::new();
    for a in addrs {
        match a.iter().last() {
            Some(Protocol::P2p(id)) => peers.push(id),
            _ => anyhow::bail!("--peer {a}: end it with /p2p/<peer id> (the id `shoal models share` prints)"),
        }
    }
    let config = NetConfig { listen: vec![], peers: addrs.to_vec(), cluster_key: None, mdns: false, timers: NetTimers::LAN };
    let (net, _events) = net::spawn(Keypair::generate_ed25519(), config, cancel)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let connected: Vec<PeerId> = net.connected_peers().await?.into_iter().map(|(p, _)| p).collect();
        if peers.iter().all(|p| connected.contains(p)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(PeerSource::new(net, peers))
}

async fn share(store: Store, listen: Multiaddr) -> anyhow::Result<()> {
    let cancel = CancellationToken::new();
    // A throwaway identity: a `shoal serve` on the same data dir keeps the node's own, and two
    // processes must never share a peer id. The printed address carries this one.
    let key = Keypair::generate_ed25519();
    let config = NetConfig { listen: vec![listen], peers: vec![], cluster_key: None, mdns: false, timers: NetTimers::LAN };
    let (net, _events) = net::spawn(key, config, cancel.child_token())?;
    let id = net.local_peer_id();
    tokio::time::sleep(Duration::from_millis(200)).await;
    for addr in net.listen_addrs().await? {
        println!("{}", addr.with(Protocol::P2p(id)));
    }
    let models: Vec<String> = store.scan().into_iter().map(|m| m.id).collect();
    eprintln!("sharing {} model(s): {} (Ctrl-C to stop)", models.len(), models.join(", "));
    let server = tokio::spawn(models::peer::serve(net, Arc::new(store), cancel.child_token()));
    tokio::signal::ctrl_c().await?;
    cancel.cancel();
    let _ = server.await;
    Ok(())
}

/// On a terminal, reads a model's files once with a progress bar before the engine maps them
/// (loading from a cold disk is then visible, and the page cache makes the load itself quick).
/// Elsewhere it does nothing. Read errors are left for the engine to report.
pub fn read_with_progress(path: &Path) {
    use std::io::Read;
    if !std::io::stderr().is_terminal() {
        return;
    }
    let files: Vec<PathBuf> = if path.is_dir() {
        shoal::models::store::model_files(path).into_iter().map(|f| path.join(f)).filter(|f| f.extension().is_some_and(|e| e == "safetensors" || e == "gguf")).collect()
    } else {
        vec![path.to_path_buf()]
    };
    let total: u64 = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    let progress = Progress::default();
    let transfer = progress.start(&shoal::models::id::model_id(path), models::Phase::Loading, "disk", Some(total));
    let mut buf = vec![0u8; 4 << 20];
    let mut last = Instant::now();
    for f in files {
        let Ok(mut file) = std::fs::File::open(&f) else { continue };
        while let Ok(n) = file.read(&mut buf) {
            if n == 0 {
                break;
            }
            transfer.add(n as u64);
            if last.elapsed() > Duration::from_millis(100) {
                if let Some(t) = progress.snapshot().first() {
                    eprint!("\r\x1b[2K{}", bar_line(t));
                }
                last = Instant::now();
            }
        }
    }
    eprint!("\r\x1b[2K");
    transfer.finish();
}

/// Redraws the progress of every transfer until `stop` fires.
async fn draw_progress(progress: Progress, stop: CancellationToken) {
    let tty = std::io::stderr().is_terminal();
    let mut last_line = Instant::now();
    let mut drawn = false;
    loop {
        let stopped = tokio::select! {
            _ = stop.cancelled() => true,
            _ = tokio::time::sleep(Duration::from_millis(200)) => false,
        };
        // A failed pull's error is printed once, by the caller: no final bar for it.
        for t in progress.snapshot().into_iter().filter(|t| !(stopped && t.phase == models::Phase::Failed)) {
            let line = bar_line(&t);
            if tty {
                eprint!("\r\x1b[2K{line}");
                drawn = true;
            } else if stopped || last_line.elapsed() > Duration::from_secs(5) {
                eprintln!("{line}");
                last_line = Instant::now();
            }
        }
        let _ = std::io::stderr().flush();
        if stopped {
            if drawn {
                eprintln!();
            }
            return;
        }
    }
}

fn bar_line(t: &models::TransferView) -> String {
    const WIDTH: usize = 30;
    let filled = t.fraction.map_or(0, |f| (f * WIDTH as f64).round() as usize).min(WIDTH);
    let total = t.bytes_total.map_or("?".into(), human);
    let phase = format!("{:?}", t.phase).to_lowercase();
    let source = if t.source.is_empty() { String::new() } else { format!(" from {}", t.source) };
    format!(
        "{} {phase}{source} [{}{}] {:>5} {}/{} {}/s",
        t.model,
        "#".repeat(filled),
        "-".repeat(WIDTH - filled),
        t.fraction.map_or("".into(), |f| format!("{:.0}%", f * 100.0)),
        human(t.bytes_done),
        total,
        human(t.bytes_per_s as u64),
    )
}

/// 1234567 → "1.2 MB".
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..=999 => format!("{bytes} B"),
        1_000..=999_999 => format!("{:.1} kB", b / 1e3),
        1_000_000..=999_999_999 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.2} GB", b / 1e9),
    }
}
