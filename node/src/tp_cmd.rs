//! `shoal tp-member` (hidden): one member of a tensor-parallel group as its own process, for
//! tests and benchmarks. Members meet through a rendezvous directory (invites and answers as
//! JSON files, written by rename) instead of the control plane, set up their data-plane links
//! (RDMA where built and offered, shared memory, TCP, fastest first), load their slice and run a greedy generation, or time
//! the all-reduce alone. Prints one JSON line. It is not how `serve` forms groups.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use candle_core::Device;
use shoal::cluster::cost;
use shoal::dataplane::connect::{join, Invite, Inviter};
use shoal::dataplane::negotiate::local_offer;
use shoal::dataplane::{Link, LinkGroup, Transport};
use shoal::engine::model::ModelSource;
use shoal::engine::sampler::argmax;
use shoal::engine::tp::{AllReduce, TpMember, TpSlice};
use shoal::engine::{LayerRange, Shard, ShardInput, ShardOutput};

#[derive(clap::Args)]
pub struct TpMemberArgs {
    /// A GGUF file or model directory (not needed with --allreduce-values).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    rank: usize,
    #[arg(long, default_value_t = 1)]
    size: usize,
    /// Directory the members of one group share for their invites and answers.
    #[arg(long)]
    rendezvous: Option<PathBuf>,
    /// Transports to offer, comma-separated (shm, tcp, rdma); default: all this host has.
    #[arg(long)]
    transports: Option<String>,
    /// Address this member's TCP listeners bind to (its address on the link to the others).
    #[arg(long, default_value = "127.0.0.1")]
    ip: IpAddr,
    /// Compute threads for this member.
    #[arg(long)]
    threads: Option<usize>,
    /// Prompt token ids, comma-separated.
    #[arg(long, default_value = "1,2,3,4,5,6,7,8")]
    prompt_ids: String,
    /// Greedy tokens to generate.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Rank 0 breaks its fastest link after this many steps (fault injection for tests).
    #[arg(long)]
    break_link_after: Option<usize>,
    /// Instead of a model: time all-reduces of this many f32 values (and a one-value ping-pong).
    #[arg(long)]
    allreduce_values: Option<usize>,
    #[arg(long, default_value_t = 200)]
    iterations: usize,
}

pub fn run(args: TpMemberArgs) -> anyhow::Result<()> {
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    shoal::engine::kernels::pool::init(threads);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().context("sizing the rayon pool")?;
    if args.rank >= args.size {
        bail!("rank {} is outside a group of {}", args.rank, args.size);
    }
    let mut offer = local_offer();
    if let Some(list) = &args.transports {
        let wanted: Vec<&str> = list.split(',').map(str::trim).collect();
        offer.transports = ["rdma", "shm", "tcp"].iter().filter(|t| wanted.contains(t)).map(|t| match *t {
            "rdma" => Transport::Rdma,
            "shm" => Transport::Shm,
            _ => Transport::Tcp,
        }).collect();
    }
    let links = match (&args.rendezvous, args.size) {
        (_, 1) => vec![Vec::new()],
        (Some(dir), _) => meet(dir, args.rank, args.size, &offer, args.ip)?,
        (None, _) => bail!("a group of {} needs --rendezvous", args.size),
    };
    let group = Arc::new(LinkGroup::new(args.rank, links, Duration::from_secs(30))?);
    if let Some(values) = args.allreduce_values {
        return time_allreduce(&group, values, args.iterations);
    }
    // The cost model's inputs, measured here: this member's memory bandwidth and Q4_K decode rate with its threads
    // and the data plane's one-value all-reduce (half a round trip).
    let mem_bw = shoal::engine::bench::read_bandwidth(threads, 256 << 20, Duration::from_millis(300));
    let decode_bw = shoal::engine::probe::q4k_decode_bandwidth(64 << 20, Duration::from_millis(300))?;
    let mut hops = Vec::new();
    for _ in 0..if args.size > 1 { 50 } else { 0 } {
        let mut one = [0f32];
        let t = Instant::now();
        group.all_reduce(&mut one)?;
        hops.push(t.elapsed().as_secs_f64());
    }
    hops.sort_by(f64::total_cmp);
    let rtt_s = hops.get(hops.len() / 2).map_or(0.0, |h| 2.0 * h);
    let model = args.model.as_deref().context("--model is needed")?;
    let source = ModelSource::open(model).with_context(|| format!("opening {}", model.display()))?;
    let range = LayerRange::full(source.spec.num_layers);
    let shard = if args.size == 1 {
        Shard::load(&source.weights, &source.spec, range, &Device::Cpu)?
    } else {
        let member = TpMember { slice: TpSlice { rank: args.rank, size: args.size }, reduce: group.clone() };
        Shard::load_tp(&source.weights, &source.spec, range, &Device::Cpu, Some(member))?
    };
    let footprint = shoal::models::footprint(&source.name(), &source, None);
    let speed = cost::Speed { node: String::new(), mem_bandwidth: mem_bw.min(decode_bw), flops: f64::MAX, memory_offered: u64::MAX, gpu: false };
    let speeds: Vec<&cost::Speed> = (0..args.size).map(|_| &speed).collect();
    let link = cost::LinkCost { rtt_s, bytes_per_s: 5e9 };
    let predicted_tok_s = cost::predict_stages(&footprint, &[(speeds, source.spec.num_layers)], link).0;
    let prompt: Vec<u32> = args.prompt_ids.split(',').map(|s| s.trim().parse()).collect::<Result<_, _>>().context("--prompt-ids")?;
    let mut cache = shard.new_cache();
    let mut input = prompt.clone();
    let mut tokens = Vec::new();
    let started = Instant::now();
    let mut prefill = Duration::ZERO;
    let mut used = Vec::new();
    let mut reduce_at_prefill = Duration::ZERO;
    for step in 0..args.steps {
        if args.break_link_after == Some(step) && args.rank == 0 {
            used = group.transports();
            group.break_link(1);
        }
        let ShardOutput::Logits(l) = shard.forward(ShardInput::Tokens(&input), &mut cache, false)? else { bail!("a whole-range shard returns logits") };
        let next = argmax(&l.squeeze(0)?.to_vec1::<f32>()?);
        tokens.push(next);
        input = vec![next];
        if step == 0 {
            prefill = started.elapsed();
            reduce_at_prefill = group.reduce_time();
        }
    }
    let decode = started.elapsed() - prefill;
    let decode_tok_s = if args.steps > 1 { (args.steps - 1) as f64 / decode.as_secs_f64() } else { 0.0 };
    let allreduce_ms_per_token = (group.reduce_time() - reduce_at_prefill).as_secs_f64() * 1e3 / args.steps.saturating_sub(1).max(1) as f64;
    let (transports, fallbacks, bytes_sent) = (group.transports(), group.fallbacks(), group.bytes_sent());
    // A last one-value call, so that no member exits (closing its links) while a peer is still
    // in the generation's last call; its outcome no longer matters to the figures above.
    if let Err(e) = group.all_reduce(&mut [0f32]) {
        tracing::debug!(target: "shoal::dataplane", "closing call: {e}");
    }
    let out = serde_json::json!({
        "rank": args.rank,
        "size": args.size,
        "threads": threads,
        "tokens": tokens,
        "prefill_ms": prefill.as_secs_f64() * 1e3,
        "decode_tok_s": decode_tok_s,
        "allreduce_ms_per_token": allreduce_ms_per_token,
        "transports_before_break": used,
        "transports": transports,
        "fallbacks": fallbacks,
        "bytes_sent": bytes_sent,
        "hidden": source.spec.hidden_size,
        "predicted_tok_s": predicted_tok_s,
        "mem_bw": mem_bw,
        "decode_bw": decode_bw,
        "dataplane_rtt_us": rtt_s * 1e6,
        "layers": source.spec.num_layers,
    });
    println!("{out}");
    Ok(())
}

/// Sets up links to every other member through files in `dir`: invites go from the lower rank
/// to the higher, answers back.
fn meet(dir: &Path, rank: usize, size: usize, offer: &shoal::dataplane::Offer, ip: IpAddr) -> anyhow::Result<Vec<Vec<Box<dyn Link>>>> {
    let wait = Duration::from_secs(60);
    let mut inviters = Vec::new();
    for peer in rank + 1..size {
        let inviter = Inviter::new(offer, ip);
        write_json(&dir.join(format!("invite-{rank}-{peer}.json")), inviter.invite())?;
        inviters.push((peer, inviter));
    }
    let mut links: Vec<Vec<Box<dyn Link>>> = (0..size).map(|_| Vec::new()).collect();
    for peer in 0..rank {
        let invite: Invite = read_json(&dir.join(format!("invite-{peer}-{rank}.json")), wait)?;
        let (l, established) = join(&invite, offer);
        write_json(&dir.join(format!("answer-{peer}-{rank}.json")), &established)?;
        links[peer] = l;
    }
    for (peer, inviter) in inviters {
        let established: Vec<Transport> = read_json(&dir.join(format!("answer-{rank}-{peer}.json")), wait)?;
        links[peer] = inviter.finish(&established, Duration::from_secs(10));
    }
    Ok(links)
}

fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(value)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path, wait: Duration) -> anyhow::Result<T> {
    let until = Instant::now() + wait;
    loop {
        if let Ok(bytes) = std::fs::read(path) {
            return Ok(serde_json::from_slice(&bytes)?);
        }
        if Instant::now() > until {
            bail!("{} did not appear within {wait:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Median microseconds of an all-reduce of `values` and of a one-value ping-pong with member 1.
fn time_allreduce(group: &LinkGroup, values: usize, iterations: usize) -> anyhow::Result<()> {
    let mut buf = vec![1.0f32; values];
    for _ in 0..10 {
        group.all_reduce(&mut buf)?;
    }
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        buf.fill(1.0);
        let t = Instant::now();
        group.all_reduce(&mut buf)?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    if buf.iter().any(|v| *v != group.size() as f32) {
        bail!("the all-reduce summed wrongly");
    }
    times.sort_by(f64::total_cmp);
    let out = serde_json::json!({
        "rank": group.rank(),
        "size": group.size(),
        "values": values,
        "transports": group.transports(),
        "allreduce_us_median": times[times.len() / 2],
        "allreduce_us_p90": times[times.len() * 9 / 10],
    });
    println!("{out}");
    Ok(())
}
