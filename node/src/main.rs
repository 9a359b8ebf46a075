//! The `shoal` binary: parses the command line and hands typed options to the library.
//! It holds no logic of its own beyond printing and signal wiring; `run` writes only generated
//! text to stdout; `serve` (the default with no subcommand) starts the node's HTTP API and UI;
//! `bench` sizes the compute pools and prints `engine::bench`'s measurement.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use shoal::engine::generate::Prompt;
use shoal::engine::runtime::EngineHandle;
use shoal::engine::text::ChatMessage;
use shoal::api::{ApiConfig, NodeInfo, Server, ServerParts};
use shoal::engine::{GenerationEvent, GenerationRequest, LoadOptions, LoadedModel, SamplingParams};
use tokio_util::sync::CancellationToken;

mod models_cmd;
mod tp_cmd;

#[derive(Parser)]
#[command(name = "shoal", version, about = "peer-to-peer LLM inference swarm")]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Where the node keeps its key and models (default: the platform's data dir + /shoal).
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    /// With no subcommand, `shoal [options]` is `shoal serve [options]`.
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt on this machine and print it.
    Run(RunArgs),
    /// Start the node: the OpenAI-compatible API and the web UI on one port (the default).
    Serve(ServeArgs),
    /// Measure prompt processing and decode speed of a model on this machine.
    Bench(BenchArgs),
    /// List, pull, remove and import models; share them with peers.
    Models(models_cmd::ModelsArgs),
    /// One member of a tensor-parallel group as a process (tests and benchmarks).
    #[command(hide = true)]
    TpMember(tp_cmd::TpMemberArgs),
}

/// `--device`, shared by run, serve and bench.
#[derive(clap::Args)]
struct DeviceArg {
    /// Compute device: auto (a CUDA GPU when this build has CUDA and the machine a GPU, else the
    /// CPU), cpu, cuda or cuda:N.
    #[arg(long = "device", value_name = "DEVICE", default_value = "auto")]
    choice: shoal::engine::device::DeviceChoice,
}

#[derive(clap::Args)]
struct BenchArgs {
    /// A model id from the cache (`~/.cache/shoal/models/<id>`), a GGUF file or a model directory.
    #[arg(long)]
    model: String,
    /// Compute threads (default: every core).
    #[arg(long)]
    threads: Option<usize>,
    /// Tokens in the prompt whose processing is timed.
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Tokens generated (greedy) in each timed decode run.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Timed runs of each phase; the median is reported.
    #[arg(long, default_value_t = 3)]
    repetitions: usize,
    /// Tokens of context before each timed decode run (llama-bench's `-d`; 0: a 4-token prompt):
    /// decode then also reads that much KV cache, which the roofline counts.
    #[arg(long, default_value_t = 0)]
    depth: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    device: DeviceArg,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Port for the API and the web UI.
    #[arg(long, default_value_t = 52415)]
    api_port: u16,
    /// Address to listen on (0.0.0.0: every interface).
    #[arg(long, default_value = "0.0.0.0")]
    host: std::net::IpAddr,
    /// A model (GGUF file or model directory) to load at start.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Cap the memory this node offers: bytes, or with a unit (500MB, 8GiB).
    #[arg(long, value_parser = parse_bytes)]
    memory_limit: Option<u64>,
    /// Require `Authorization: Bearer <key>` on every /v1 request.
    #[arg(long)]
    api_key: Option<String>,
    /// Cap each model's context window (tokens) below its own.
    #[arg(long)]
    context: Option<usize>,
    /// Requests that may wait behind the running one; more get 503 with Retry-After.
    #[arg(long, default_value_t = 16)]
    max_queue: usize,
    /// Seconds a request may wait in the queue before it gets 503.
    #[arg(long, default_value_t = 600)]
    queue_timeout: u64,
    /// Swarm listen address (repeatable); default: every interface on port 52416 (TCP, and QUIC
    /// without a cluster key), or a free port when that one is taken.
    #[arg(long, value_name = "MULTIADDR")]
    listen: Vec<libp2p::Multiaddr>,
    /// A peer to dial, for networks without multicast (repeatable), e.g. /ip4/10.0.0.2/tcp/52416.
    #[arg(long, value_name = "MULTIADDR")]
    peer: Vec<libp2p::Multiaddr>,
    /// A libp2p pre-shared key file (pnet): only nodes with the same key can connect.
    #[arg(long, value_name = "FILE")]
    cluster_key: Option<PathBuf>,
    /// Do not discover peers by mDNS (only --peer addresses are dialled).
    #[arg(long)]
    no_discovery: bool,
    #[command(flatten)]
    device: DeviceArg,
    /// How the swarm runs the models this node asks for: auto (the cost model's best), single,
    /// pipeline, tensor or hybrid; a pinned strategy that cannot place the model is an error.
    #[arg(long, default_value = "auto", value_parser = parse_strategy)]
    strategy: StrategyArg,
    /// Offer exactly these data-plane transports to tensor-group peers (rdma, shm, tcp, libp2p),
    /// even ones not detected (rdma then fails setup and falls back), for tests.
    #[arg(long, hide = true, value_delimiter = ',', value_parser = parse_transport)]
    dataplane: Vec<shoal::dataplane::Transport>,
}

fn parse_transport(s: &str) -> Result<shoal::dataplane::Transport, String> {
    use shoal::dataplane::Transport;
    Ok(match s {
        "shm" => Transport::Shm,
        "tcp" => Transport::Tcp,
        "libp2p" => Transport::Libp2p,
        "rdma" => Transport::Rdma,
        other => return Err(format!("`{other}` is not one of shm, tcp, libp2p, rdma")),
    })
}

/// `--strategy`: `None` is auto.
#[derive(Clone, Copy, Debug)]
struct StrategyArg(Option<shoal::cluster::Strategy>);

fn parse_strategy(s: &str) -> Result<StrategyArg, String> {
    use shoal::cluster::Strategy;
    Ok(StrategyArg(match s {
        "auto" => None,
        "single" => Some(Strategy::Single),
        "pipeline" => Some(Strategy::Pipeline),
        "tensor" => Some(Strategy::Tensor),
        "hybrid" => Some(Strategy::Hybrid),
        other => return Err(format!("`{other}` is not one of auto, single, pipeline, tensor, hybrid")),
    }))
}

/// The address data-plane TCP listeners bind to: the first concrete IP among the swarm's
/// listen addresses, else 0.0.0.0 (every interface).
fn dataplane_ip(listen: &[libp2p::Multiaddr]) -> std::net::IpAddr {
    use libp2p::multiaddr::Protocol;
    listen
        .iter()
        .flat_map(|a| a.iter())
        .find_map(|p| match p {
            Protocol::Ip4(ip) if !ip.is_unspecified() => Some(std::net::IpAddr::V4(ip)),
            Protocol::Ip6(ip) if !ip.is_unspecified() => Some(std::net::IpAddr::V6(ip)),
            _ => None,
        })
        .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED))
}

#[derive(clap::Args)]
struct RunArgs {
    /// A GGUF file, a Hugging Face model directory, or the id of a model in the store.
    #[arg(long)]
    model: PathBuf,
    /// The prompt text.
    #[arg(long, required_unless_present = "prompt_file", conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from this file (`-` for standard input).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Cap the context window (tokens) below the model's own.
    #[arg(long)]
    context: Option<usize>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this string appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Apply the model's chat template to the prompt as one user message.
    #[arg(long)]
    chat: bool,
    #[command(flatten)]
    device: DeviceArg,
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SHOAL_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Run(args)) => run(args, cli.data_dir),
        Some(Command::Serve(args)) => serve(args, cli.data_dir),
        Some(Command::Models(args)) => data_dir(cli.data_dir).and_then(|d| models_cmd::run(args, &d)),
        Some(Command::Bench(args)) => bench(args),
        Some(Command::TpMember(args)) => tp_cmd::run(args),
        None => serve(cli.serve, cli.data_dir),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(mut args: RunArgs, data_dir_flag: Option<PathBuf>) -> anyhow::Result<()> {
    let t0 = std::time::Instant::now();
    let prompt_text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) if f.as_os_str() == "-" => std::io::read_to_string(std::io::stdin()).context("reading the prompt from stdin")?,
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("reading the prompt from {}", f.display()))?,
        (None, None) => anyhow::bail!("give --prompt or --prompt-file"),
    };
    if !args.model.exists() {
        // Not a path: a model id of this node's store.
        let id = args.model.to_string_lossy().into_owned();
        let store = shoal::models::Store::open(&data_dir(data_dir_flag)?, vec![]);
        args.model = store.find(&id).map(|m| m.path).with_context(|| format!("{id}: no such file, and no model with this id here (see `shoal models list`)"))?;
    }
    models_cmd::read_with_progress(&args.model);
    let device = shoal::engine::device::ComputeDevice::open(args.device.choice)?;
    let opts = LoadOptions { context_limit: args.context, device, ..LoadOptions::default() };
    let model = LoadedModel::load(&args.model, &opts).with_context(|| format!("loading {}", args.model.display()))?;
    eprintln!(
        "loaded {} ({} {}, {} layers) in {:.2}s",
        model.name,
        model.spec.family.name(),
        match model.format { shoal::engine::model::WeightFormat::Gguf => "gguf", _ => "safetensors" },
        model.spec.num_layers,
        t0.elapsed().as_secs_f64()
    );
    let prompt = if args.chat { Prompt::Chat(vec![ChatMessage { role: "user".into(), content: prompt_text }]) } else { Prompt::Text(prompt_text) };
    let request = GenerationRequest {
        prompt,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repeat_penalty,
            seed: args.seed,
            ..SamplingParams::default()
        },
        max_tokens: Some(args.max_tokens),
        stop: args.stop,
    };
    let (engine, _thread) = EngineHandle::spawn(model);
    let usage = engine.generate_blocking(
        request,
        Box::new(|event| {
            if let GenerationEvent::Token { text, .. } = event {
                let mut out = std::io::stdout().lock();
                // A closed stdout (e.g. `| head`) cancels the generation.
                return out.write_all(text.as_bytes()).and_then(|_| out.flush()).is_ok();
            }
            true
        }),
    )?;
    println!();
    eprintln!(
        "prompt {} tokens at {:.1} tok/s, generated {} tokens at {:.1} tok/s, first token after {:.3}s",
        usage.prompt_tokens, usage.prefill_tok_s, usage.completion_tokens, usage.decode_tok_s, usage.time_to_first_token_s
    );
    if let Some(bytes) = shoal::engine::bench::peak_rss_bytes() {
        eprintln!("peak RSS {} MB", bytes / 1_000_000);
    }
    Ok(())
}

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    // Both pools are sized before any model code runs: shoal's kernels and candle's rayon ops.
    shoal::engine::kernels::pool::init(threads);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("sizing the rayon pool")?;
    let path = {
        let p = PathBuf::from(&args.model);
        let cached = dirs::home_dir().map(|h| h.join(".cache/shoal/models").join(&args.model));
        match cached {
            Some(c) if !p.exists() && c.is_dir() => c,
            _ => p,
        }
    };
    let device = shoal::engine::device::ComputeDevice::open(args.device.choice)?;
    let model = LoadedModel::load(&path, &LoadOptions { device: device.clone(), ..LoadOptions::default() }).with_context(|| format!("loading {}", path.display()))?;
    let opts = shoal::engine::bench::BenchOptions { prompt_tokens: args.prompt_tokens, gen_tokens: args.gen_tokens, repetitions: args.repetitions, depth: args.depth, threads, device: Some(device) };
    let r = shoal::engine::bench::run(&model, &opts)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!("model {} on {} ({} threads)", r.model, r.device, r.threads);
        println!("prompt processing  {:8.1} tok/s  ({} tokens, median of {})", r.prefill_tok_s, r.prompt_tokens, r.prefill_runs.len());
        println!("decode             {:8.1} tok/s  ({} tokens after {}, median of {})", r.decode_tok_s, r.gen_tokens, r.depth, r.decode_runs.len());
        println!("peak RSS           {:8.0} MB", r.rss_bytes as f64 / 1e6);
        if r.device == "cpu" {
            println!("memory read        {:8.1} GB/s ({} threads, median of {} probes beside the decode runs)", r.mem_bw_bytes_s / 1e9, r.threads, r.mem_bw_runs.len());
        } else {
            println!("device copy        {:8.1} GB/s (read + write)", r.mem_bw_bytes_s / 1e9);
        }
        println!("bytes per token    {:8.1} MB (and {:.1} MB of KV cache)", r.bytes_per_token as f64 / 1e6, r.kv_bytes_per_token as f64 / 1e6);
        println!("decode roofline    {:8.2}", r.roofline_fraction);
    }
    Ok(())
}

/// `--data-dir`, or the platform's data directory + `/shoal`.
fn data_dir(flag: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match flag {
        Some(d) => Ok(d),
        None => Ok(dirs::data_dir().context("no platform data directory: pass --data-dir")?.join("shoal")),
    }
}

fn serve(args: ServeArgs, data_dir_flag: Option<PathBuf>) -> anyhow::Result<()> {
    let data_dir = data_dir(data_dir_flag)?;
    let key = shoal::identity::load_or_create(&data_dir)?;
    let cluster_key = args.cluster_key.as_deref().map(shoal::net::load_cluster_key).transpose()?;
    let device = shoal::engine::device::ComputeDevice::open(args.device.choice)?;
    let cores = format!("{} {} cores", std::env::consts::ARCH, std::thread::available_parallelism().map_or(1, |n| n.get()));
    let node = NodeInfo {
        id: shoal::identity::node_id(&key),
        name: sysinfo::System::host_name().unwrap_or_else(|| "shoal".into()),
        device: match device.gpu() {
            Some(g) => format!("{} ({:.0} GB) + {cores}", g.name, g.memory_total as f64 / 1e9),
            None => cores,
        },
    };
    let config = ApiConfig {
        listen: std::net::SocketAddr::new(args.host, args.api_port),
        data_dir: data_dir.clone(),
        preload: args.model,
        memory_limit: args.memory_limit,
        api_key: args.api_key.filter(|k| !k.is_empty()),
        context: args.context,
        max_queue: args.max_queue,
        queue_timeout: std::time::Duration::from_secs(args.queue_timeout),
        shutdown_timeout: std::time::Duration::from_secs(5),
    };
    let (store, preload) = shoal::api::open_store(&config)?;
    let local: std::collections::BTreeMap<String, PathBuf> = store.scan().into_iter().map(|m| (m.id, m.path)).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name("shoal-io").enable_all().build()?;
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        let id = node.id.clone();
        let listener = Server::bind_listener(config.listen).await?;
        let api_addresses = Server::reachable_addresses(&listener).await;
        let probed = device.clone();
        let machine = tokio::task::spawn_blocking(move || shoal::engine::probe::measure_device(&probed)).await?.context("probing this machine")?;
        // A GPU node offers GPU memory: its shards live there.
        let (memory_total, memory_offered) = match device.gpu() {
            Some(g) => {
                let free = device.gpu_memory_free().unwrap_or(g.memory_free);
                (g.memory_total, shoal::engine::device::gpu_offer(free, g.memory_total, config.memory_limit))
            }
            None => shoal::api::node_view::offered_memory(config.memory_limit, 0),
        };
        let advert = shoal::cluster::NodeAdvert {
            id: id.clone(),
            name: node.name.clone(),
            priority: 0,
            memory_total,
            // With --memory-limit the node offers all of it; without, what is free at start (on a
            // GPU, less `GPU_WORKSPACE`).
            memory_offered: if config.memory_limit.is_some() && device.gpu().is_none() { memory_total } else { memory_offered },
            mem_bandwidth: machine.mem_bandwidth,
            decode_bandwidth: machine.decode_bandwidth,
            flops: machine.flops,
            backend: device.label(),
            gpu: device.gpu().map(|g| shoal::cluster::GpuAdvert { name: g.name.clone(), memory_total: g.memory_total }),
            addresses: api_addresses,
            models: local.keys().cloned().collect(),
            wants: vec![],
            plan: None,
        };
        let dataplane_ip = dataplane_ip(&args.listen);
        let (net, net_events) = start_net(key, args.listen, args.peer, cluster_key, !args.no_discovery, &shutdown)?;
        let swarm = shoal::swarm::spawn(
            shoal::swarm::SwarmConfig {
                data_dir: data_dir.clone(),
                advert,
                models: local,
                cluster: shoal::cluster::ClusterConfig::LAN,
                advert_every: std::time::Duration::from_secs(1),
                hop_deadline: std::time::Duration::from_secs(120),
                device: device.clone(),
                strategy: args.strategy.0,
                dataplane_ip,
                dataplane_transports: (!args.dataplane.is_empty()).then_some(args.dataplane),
            },
            net.clone(),
            net_events,
            shutdown.child_token(),
        );
        // Peers copy model files from this node's store (`shoal models pull --peer`, or a
        // peer's `/v1/models/pull`), and this node's pulls copy from its peers.
        tokio::spawn(shoal::models::peer::serve(net.clone(), store.clone(), shutdown.child_token()));
        let parts = ServerParts { store, preload, machine, swarm };
        let server = Server::bind(listener, config, node, parts, &shutdown).await?;
        server.attach_net(net.clone());
        let addr = server.local_addr();
        eprintln!("shoal node {id}");
        match device.gpu() {
            Some(g) => eprintln!("computing on {} (cuda:{}): measured {:.1} TFLOP/s f16, {:.0} GB/s device copy", g.name, g.index, machine.flops / 1e12, machine.mem_bandwidth / 1e9),
            None => eprintln!("measured {:.1} GFLOP/s f32, {:.1} GB/s memory read, {:.1} GB/s Q4_K decode", machine.flops / 1e9, machine.mem_bandwidth / 1e9, machine.decode_bandwidth / 1e9),
        }
        // The listener reports its address shortly after start: wait for it (at most 2 s).
        let mut listening = Vec::new();
        for _ in 0..40 {
            listening = net.listen_addrs().await.unwrap_or_default();
            if !listening.is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        for a in listening {
            eprintln!("swarm listening on {a}/p2p/{id}");
        }
        let ui_host = if addr.ip().is_unspecified() { "127.0.0.1".to_string() } else { addr.ip().to_string() };
        eprintln!("web UI and API: http://{}/", std::net::SocketAddr::new(ui_host.parse()?, addr.port()));
        tokio::spawn(stop_on_signal(shutdown.clone()));
        server.run(shutdown).await?;
        eprintln!("shoal stopped");
        Ok(())
    })
}

/// Starts the libp2p actor. Without `--listen`, the well-known port is tried first and a free
/// port taken when another node on this machine already has it.
fn start_net(
    key: libp2p::identity::Keypair,
    listen: Vec<libp2p::Multiaddr>,
    peers: Vec<libp2p::Multiaddr>,
    cluster_key: Option<libp2p::pnet::PreSharedKey>,
    mdns: bool,
    shutdown: &CancellationToken,
) -> anyhow::Result<(shoal::net::NetHandle, tokio::sync::mpsc::Receiver<shoal::net::NetEvent>)> {
    use shoal::net::{NetConfig, NetTimers};
    let has_key = cluster_key.is_some();
    let config = |listen| NetConfig { listen, peers: peers.clone(), cluster_key, mdns, timers: NetTimers::LAN };
    if !listen.is_empty() {
        return Ok(shoal::net::spawn(key, config(listen), shutdown.child_token())?);
    }
    match shoal::net::spawn(key.clone(), config(NetConfig::default_listen(has_key)), shutdown.child_token()) {
        Ok(started) => Ok(started),
        Err(shoal::net::NetError::Listen { .. }) => {
            let any_port = NetConfig::default_listen(has_key).into_iter().map(|a| a.to_string().replace(&shoal::net::DEFAULT_PORT.to_string(), "0").parse().expect("a well-formed multiaddr")).collect();
            Ok(shoal::net::spawn(key, config(any_port), shutdown.child_token())?)
        }
        Err(e) => Err(e.into()),
    }
}

/// Cancels `shutdown` on the first SIGINT or SIGTERM; a second one exits at once.
async fn stop_on_signal(shutdown: CancellationToken) {
    async fn signal() {
        #[cfg(unix)]
        {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("installing a SIGTERM handler");
            tokio::select! { _ = tokio::signal::ctrl_c() => {}, _ = term.recv() => {} }
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
    signal().await;
    eprintln!("shutting down (again to exit at once)");
    shutdown.cancel();
    signal().await;
    std::process::exit(130);
}

/// `8GiB`, `500MB`, `1.5G`, `123456` → bytes. K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of 1024.
fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| format!("`{text}` is not a size: use bytes or a unit, e.g. 500MB, 8GiB"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().trim_end_matches('b') {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "ki" => 1024.0,
        "mi" => 1024.0 * 1024.0,
        "gi" => 1024.0 * 1024.0 * 1024.0,
        "ti" => 1024.0f64.powi(4),
        other => return Err(format!("unknown size unit `{other}` in `{text}`: use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")),
    };
    let bytes = value * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("`{text}` is not a usable memory size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn memory_sizes_parse_with_and_without_units() {
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("500MB"), Ok(500_000_000));
        assert_eq!(parse_bytes("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("123456"), Ok(123_456));
        assert_eq!(parse_bytes("2 gib"), Ok(2 << 30));
        assert!(parse_bytes("8 parsecs").is_err());
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("GiB").is_err());
    }
}
