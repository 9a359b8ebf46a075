//! The `shoal` binary: parses the command line and hands typed options to the library.
//! It holds no logic of its own beyond printing; `run` writes only generated text to stdout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use shoal::engine::generate::Prompt;
use shoal::engine::runtime::EngineHandle;
use shoal::engine::text::ChatMessage;
use shoal::engine::{GenerationEvent, GenerationRequest, LoadOptions, LoadedModel, SamplingParams};

#[derive(Parser)]
#[command(name = "shoal", version, about = "peer-to-peer LLM inference swarm")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt on this machine and print it.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// A GGUF file or a Hugging Face model directory.
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
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SHOAL_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    let t0 = std::time::Instant::now();
    let prompt_text = match (&args.prompt, &args.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) if f.as_os_str() == "-" => std::io::read_to_string(std::io::stdin()).context("reading the prompt from stdin")?,
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("reading the prompt from {}", f.display()))?,
        (None, None) => anyhow::bail!("give --prompt or --prompt-file"),
    };
    let opts = LoadOptions { context_limit: args.context, ..LoadOptions::default() };
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
    if let Some(bytes) = peak_rss_bytes() {
        eprintln!("peak RSS {} MB", bytes / 1_000_000);
    }
    Ok(())
}

/// The process's peak resident set size, where the OS reports it (Linux `VmHWM`).
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
