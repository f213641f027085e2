//! The `kvtier` binary: one command with subcommands. Thin: each subcommand's code lives
//! in the library.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "kvtier",
    version,
    about = "Per-node KV-cache tier manager for LLM inference engines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the per-node daemon.
    Serve(kvtier::daemon::cli::ServeArgs),
    /// Replay a trace or a generated agentic workload against the cache policies.
    Replay(Box<kvtier::replay::cli::ReplayArgs>),
    /// Measure kvtier against a physical reference taken in the same run.
    #[command(subcommand)]
    Bench(Bench),
    #[command(flatten)]
    Admin(kvtier::cli::AdminCommand),
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Page-move throughput between tiers against memcpy of the same bytes on the same cores.
    Transfer(kvtier::bench::transfer::TransferArgs),
    /// Prefix-lookup throughput and directory bytes per page.
    Index(kvtier::bench::index::IndexArgs),
    /// Host arena mapping time with parallel first touch against one thread.
    Arena(kvtier::bench::arena::ArenaArgs),
    /// Control-socket round trips against a raw Unix-socket echo.
    Control(kvtier::bench::control::ControlArgs),
    /// Put and get throughput of the shared pool against the backend's raw client.
    Pool(kvtier::bench::pool::PoolBenchArgs),
    /// Page events per second delivered to and decoded by a live vLLM-format subscriber.
    Events(kvtier::bench::events::EventsBenchArgs),
    /// Eviction per victim over a directory at its high watermark, and lookup latency
    /// during eviction against idle.
    Evict(kvtier::bench::evict::EvictArgs),
    /// Time to first token of a real vLLM (its CPU build) recomputing, hitting its own
    /// prefix cache, and loading from kvtier's host and pool tiers, round by round.
    Engine(kvtier::bench::engine::EngineBenchArgs),
    /// Time for a restarted daemon to recover its host arena from the manifest (100,000
    /// pages by default) against reading the manifest file alone.
    Recovery(kvtier::bench::recovery::RecoveryArgs),
}

fn main() -> anyhow::Result<()> {
    // `serve` logs at info by default; the other commands only warn.
    let default = match std::env::args().nth(1).as_deref() {
        Some("serve") => "info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .init();
    // Usage errors exit 64, so that 2 and 3 keep their admin meanings (unreachable, refused).
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            std::process::exit(if e.use_stderr() { kvtier::cli::EXIT_USAGE } else { 0 });
        }
    };
    match cli.command {
        Command::Serve(a) => kvtier::daemon::cli::run(a),
        Command::Replay(a) => kvtier::replay::cli::run(*a),
        Command::Bench(Bench::Transfer(a)) => kvtier::bench::transfer::run(a),
        Command::Bench(Bench::Index(a)) => kvtier::bench::index::run(a),
        Command::Bench(Bench::Arena(a)) => kvtier::bench::arena::run(a),
        Command::Bench(Bench::Control(a)) => kvtier::bench::control::run(a),
        Command::Bench(Bench::Pool(a)) => kvtier::bench::pool::run(a),
        Command::Bench(Bench::Events(a)) => kvtier::bench::events::run(a),
        Command::Bench(Bench::Evict(a)) => kvtier::bench::evict::run(a),
        Command::Bench(Bench::Engine(a)) => kvtier::bench::engine::run(a),
        Command::Bench(Bench::Recovery(a)) => kvtier::bench::recovery::run(a),
        Command::Admin(cmd) => std::process::exit(kvtier::cli::run(cmd)?),
    }
}
