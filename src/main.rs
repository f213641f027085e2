//! The `kvtier` binary: a thin dispatcher over the library's subcommands.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvtier",
    version,
    about = "Per-node KV-cache tier manager for LLM inference engines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the per-node daemon.
    Serve(kvtier::daemon::cli::ServeArgs),
    /// Measure.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Control-socket round trips against a raw Unix-socket echo.
    Control(kvtier::bench::control::ControlArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(args) => kvtier::daemon::cli::run(args),
        Command::Bench { which } => match which {
            BenchCommand::Control(args) => kvtier::bench::control::run(args),
        },
    }
}
