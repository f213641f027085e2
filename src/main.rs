//! The `kvtier` binary: a thin command line over the library.

mod bench;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kvtier", version, about = "Per-node KV-cache tier manager")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Measure kvtier against a reference in the same run.
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Put and get throughput of the shared pool against the backend's raw client.
    Pool(bench::pool::PoolBenchArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Bench(BenchCmd::Pool(args)) => bench::pool::run(args),
    }
}
