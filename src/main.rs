//! The `kvtier` binary: a thin dispatcher over the library's subcommands.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "kvtier", version, about = "Per-node KV-cache tier manager")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a trace or a generated agentic workload against the cache policies.
    Replay(kvtier::replay::cli::ReplayArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Replay(args) => kvtier::replay::cli::run(args),
    }
}
