//! The `kvtier replay` subcommand: flags, workload loading, the run, and its output.

use std::fs::File;
use std::io::{BufReader, BufWriter, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::engine::{Capacity, CostModel, EngineConfig, PolicyKind, run_policy, run_policy_logged};
use super::export::request_traces;
use super::generate::{AgenticSpec, agentic};
use super::report::{Report, replay};
use super::workload::{MAX_REQUESTS, Workload};
use crate::layout::LayoutSpec;
use crate::session::pressure::PressureConfig;
use crate::session::trace::TraceWriter;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Generator {
    /// Agent sessions with shared system prompts, tool waits and subagents.
    Agentic,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolArg {
    None,
    Local,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyArg {
    DeviceLru,
    WriteThrough,
    ExclusiveLru,
    SessionAware,
    /// Told of each tool's end `--tool-end-lead-ms` early: an oracle, for comparison.
    SessionAwareLookahead,
    SessionAwareNoLineage,
    SessionAwareNoPhases,
    SessionAwareNoPressure,
    SessionAwareNoEnded,
}

impl From<PolicyArg> for PolicyKind {
    fn from(p: PolicyArg) -> Self {
        match p {
            PolicyArg::DeviceLru => PolicyKind::DeviceLru,
            PolicyArg::WriteThrough => PolicyKind::WriteThrough,
            PolicyArg::ExclusiveLru => PolicyKind::ExclusiveLru,
            PolicyArg::SessionAware => PolicyKind::SessionAware,
            PolicyArg::SessionAwareLookahead => PolicyKind::SessionAwareLookahead,
            PolicyArg::SessionAwareNoLineage => PolicyKind::NoLineage,
            PolicyArg::SessionAwareNoPhases => PolicyKind::NoPhases,
            PolicyArg::SessionAwareNoPressure => PolicyKind::NoPressure,
            PolicyArg::SessionAwareNoEnded => PolicyKind::NoEnded,
        }
    }
}

/// Replays a workload against device-lru, write-through and session-aware, with the
/// infinite-cache and Belady bounds.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// A trace in the Mooncake format (timestamp, input_length, output_length, hash_ids).
    #[arg(long, conflicts_with_all = ["request_traces", "generate"])]
    pub trace: Option<PathBuf>,
    /// kvtier request traces (JSON lines).
    #[arg(long, conflicts_with = "generate")]
    pub request_traces: Option<PathBuf>,
    /// Generate a workload instead of reading one.
    #[arg(long, value_enum)]
    pub generate: Option<Generator>,
    /// Tokens per block of a Mooncake trace (and of generated workloads).
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u32,
    /// Read at most this many requests.
    #[arg(long, default_value_t = MAX_REQUESTS)]
    pub max_requests: usize,

    /// Device capacity in pages.
    #[arg(long, conflicts_with = "device_frac")]
    pub device_pages: Option<usize>,
    /// Device capacity as a fraction of the workload's distinct blocks.
    #[arg(long, default_value_t = 0.10)]
    pub device_frac: f64,
    /// Host capacity in pages.
    #[arg(long, conflicts_with = "host_ratio")]
    pub host_pages: Option<usize>,
    /// Host capacity as a multiple of the device's.
    #[arg(long, default_value_t = 2.0)]
    pub host_ratio: f64,
    /// The shared pool tier.
    #[arg(long, value_enum, default_value = "none")]
    pub pool: PoolArg,
    /// Pool capacity in pages with `--pool local` (default: 4 times the host).
    #[arg(long)]
    pub pool_pages: Option<usize>,

    /// Top-level sessions of the generated workload.
    #[arg(long, default_value_t = 64)]
    pub sessions: usize,
    /// Top-level sessions running at once in the generated workload.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Chance that a generated turn forks subagents.
    #[arg(long, default_value_t = 0.15)]
    pub subagent_chance: f64,
    /// Seed of the generator.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,

    /// Model layers (page bytes: 2 x layers x kv heads x head dim x dtype bytes x block tokens).
    #[arg(long, default_value_t = 32)]
    pub layers: u32,
    #[arg(long, default_value_t = 8)]
    pub kv_heads: u32,
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
    #[arg(long, default_value_t = 2)]
    pub dtype_bytes: u32,

    /// Prefill speed for recomputed tokens, tokens/s.
    #[arg(long, default_value_t = 20_000.0)]
    pub prefill_tps: f64,
    /// Decode time per output token, ms.
    #[arg(long, default_value_t = 20.0)]
    pub decode_ms_per_token: f64,
    /// Host to device copy bandwidth, GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub host_device_gbps: f64,
    /// Pool to host copy bandwidth, GB/s.
    #[arg(long, default_value_t = 10.0)]
    pub pool_host_gbps: f64,
    /// Sessions idle this long end (seconds).
    #[arg(long, default_value_t = 300)]
    pub idle_timeout_s: u64,
    /// How long before a tool wait ends `session-aware-lookahead` hears of it, ms (the
    /// other policies hear of it when it ends).
    #[arg(long, default_value_t = 500)]
    pub tool_end_lead_ms: u64,

    /// Policies to run (default: every one but `session-aware-lookahead`).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub policies: Vec<PolicyArg>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also sweep device capacity (x1/4 .. x4) and draw the result to this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write the request traces of the session-aware run (JSON lines) to this file.
    #[arg(long)]
    pub write_traces: Option<PathBuf>,
    /// Write the session-aware run's page moves between host and pool (JSON lines:
    /// `at_ms`, `page` in hex, `from`, `to`; the first 1,000,000) to this file, to set
    /// beside the moves a daemon made (its `/v1/events`) for the same requests.
    #[arg(long)]
    pub write_moves: Option<PathBuf>,
}

/// Most moves `--write-moves` writes.
const MAX_LOGGED_MOVES: usize = 1_000_000;

fn load(args: &ReplayArgs) -> anyhow::Result<Workload> {
    if args.block_tokens == 0 {
        bail!("--block-tokens must be positive");
    }
    if let Some(path) = &args.trace {
        let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        return Ok(Workload::from_mooncake(
            BufReader::new(f),
            args.block_tokens,
            args.max_requests,
        )?);
    }
    if let Some(path) = &args.request_traces {
        let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        return Ok(Workload::from_request_traces(BufReader::new(f), args.max_requests)?);
    }
    match args.generate {
        Some(Generator::Agentic) => Ok(agentic(&AgenticSpec {
            sessions: args.sessions,
            concurrency: args.concurrency,
            subagent_chance: args.subagent_chance,
            block_tokens: args.block_tokens,
            seed: args.seed,
            decode_ms_per_token: args.decode_ms_per_token,
            ..AgenticSpec::default()
        })),
        None => bail!("give a workload: --trace FILE, --request-traces FILE or --generate agentic"),
    }
}

fn config(args: &ReplayArgs, w: &Workload) -> anyhow::Result<EngineConfig> {
    let device = match args.device_pages {
        Some(n) => n,
        None => {
            if !(args.device_frac > 0.0 && args.device_frac.is_finite()) {
                bail!("--device-frac must be positive");
            }
            (w.distinct_blocks() as f64 * args.device_frac).ceil() as usize
        }
    };
    let host = match args.host_pages {
        Some(n) => n,
        None => {
            if !(args.host_ratio >= 0.0 && args.host_ratio.is_finite()) {
                bail!("--host-ratio must be zero or more");
            }
            (device as f64 * args.host_ratio).round() as usize
        }
    };
    let pool = match args.pool {
        PoolArg::None => 0,
        PoolArg::Local => args.pool_pages.unwrap_or(host.saturating_mul(4)),
    };
    let layout = LayoutSpec::mha(
        args.layers,
        args.kv_heads,
        args.head_dim,
        args.dtype_bytes,
        w.block_tokens,
    )
    .build()
    .context("model geometry")?;
    Ok(EngineConfig {
        capacity: Capacity {
            device_pages: device.max(1),
            host_pages: host,
            pool_pages: pool,
        },
        page_bytes: layout.page_bytes(),
        page_layout: format!(
            "MHA, {} layers, {} KV heads, head dim {}, {} bytes a value, {} tokens a page",
            args.layers, args.kv_heads, args.head_dim, args.dtype_bytes, w.block_tokens
        ),
        cost: CostModel {
            prefill_tokens_per_s: args.prefill_tps,
            decode_ms_per_token: args.decode_ms_per_token,
            host_device_gbps: args.host_device_gbps,
            pool_host_gbps: args.pool_host_gbps,
        },
        pressure: PressureConfig::default(),
        idle_timeout_ms: args.idle_timeout_s.saturating_mul(1000),
        tool_end_lead_ms: args.tool_end_lead_ms,
    })
}

fn progress_bar(total: u64) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} requests ({eta})") {
        bar.set_style(style);
    }
    bar.set_message("replay");
    bar
}

fn print_text(r: &Report, out: &mut impl Write) -> std::io::Result<()> {
    let w = &r.workload;
    writeln!(
        out,
        "{}: {} requests, {} sessions, {} distinct blocks of {} tokens, {} input tokens",
        w.name, w.requests, w.sessions, w.distinct_blocks, w.block_tokens, w.input_tokens
    )?;
    let c = &r.capacity;
    writeln!(
        out,
        "capacity: device {} pages, host {}, pool {} ({} MiB a page)",
        c.device_pages,
        c.host_pages,
        c.pool_pages,
        r.page_bytes >> 20
    )?;
    writeln!(
        out,
        "bounds: infinite {} hit tokens, Belady ({} pages) {}",
        r.bounds.infinite_hit_tokens, r.bounds.belady_capacity_pages, r.bounds.belady_hit_tokens
    )?;
    writeln!(
        out,
        "{:<26} {:>12} {:>12} {:>8} {:>8} {:>12} {:>12} {:>7} {:>6}",
        "policy", "hit tokens", "recomputed", "/belady", "/inf", "p50 sess s", "p99 sess s", "jain", "pauses"
    )?;
    for (name, p) in &r.policies {
        writeln!(
            out,
            "{:<26} {:>12} {:>12} {:>8.3} {:>8.3} {:>12.1} {:>12.1} {:>7.3} {:>6}",
            name,
            p.hit_tokens,
            p.recomputed_tokens,
            p.hit_fraction_of_belady,
            p.hit_fraction_of_infinite,
            p.session_completion_ms.p50 / 1e3,
            p.session_completion_ms.p99 / 1e3,
            p.fairness_jain,
            p.pauses.count
        )?;
    }
    if let Some(g) = &r.goals {
        writeln!(
            out,
            "goals: session-aware at {:.1}% of Belady (goal 90%), {:.1}% fewer recomputed tokens than write-through (goal 20%)",
            g.session_aware_fraction_of_belady * 100.0,
            g.recompute_reduction_vs_write_through * 100.0
        )?;
        if let Some(ex) = g.recompute_reduction_vs_exclusive_lru {
            writeln!(
                out,
                "       {:.1}% fewer recomputed tokens than exclusive-lru, the same tiers without session signals (goal 10% on agentic)",
                ex * 100.0
            )?;
        }
    }
    Ok(())
}

/// Runs the subcommand.
pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let w = load(&args)?;
    if w.requests.is_empty() {
        bail!("the workload has no requests");
    }
    let cfg = config(&args, &w)?;
    let policies: Vec<PolicyKind> = if args.policies.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        args.policies.iter().map(|&p| p.into()).collect()
    };
    const SWEEP: [f64; 5] = [0.25, 0.5, 1.0, 2.0, 4.0];
    // The plot draws the policies, not the ablation rows (those are in the report).
    let plotted: Vec<PolicyKind> = policies
        .iter()
        .copied()
        .filter(|p| !p.name().starts_with("session-aware-no-"))
        .collect();
    let runs = policies.len()
        + if args.plot.is_some() {
            SWEEP.len() * plotted.len()
        } else {
            0
        };
    let runs = runs + usize::from(args.write_traces.is_some()) + usize::from(args.write_moves.is_some());
    let bar = progress_bar((w.requests.len() * runs) as u64);
    let mut tick = || bar.inc(1);
    let report = replay(&w, &cfg, &policies, &mut tick)?;
    if let Some(path) = &args.plot {
        let mut sweep = Vec::with_capacity(SWEEP.len());
        for m in SWEEP {
            let scale = |n: usize| ((n as f64 * m).round() as usize).max(1);
            let mut c = cfg.clone();
            c.capacity = Capacity {
                device_pages: scale(cfg.capacity.device_pages),
                host_pages: if cfg.capacity.host_pages == 0 {
                    0
                } else {
                    scale(cfg.capacity.host_pages)
                },
                pool_pages: if cfg.capacity.pool_pages == 0 {
                    0
                } else {
                    scale(cfg.capacity.pool_pages)
                },
            };
            sweep.push(replay(&w, &c, &plotted, &mut tick)?);
        }
        let title = format!("kvtier replay: {} ({} requests)", w.name, w.requests.len());
        super::plot::draw(path, &title, &sweep)?;
    }
    if let Some(path) = &args.write_traces {
        let run = run_policy(&w, &cfg, PolicyKind::SessionAware, &mut tick)?;
        let f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut out = TraceWriter::new(BufWriter::new(f));
        for rec in request_traces(&w, &run) {
            out.write(&rec)?;
        }
        out.into_inner().flush()?;
    }
    if let Some(path) = &args.write_moves {
        let run = run_policy_logged(&w, &cfg, PolicyKind::SessionAware, MAX_LOGGED_MOVES, &mut tick)?;
        let f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut out = BufWriter::new(f);
        for m in &run.moves {
            serde_json::to_writer(&mut out, m)?;
            writeln!(out)?;
        }
        out.flush()?;
    }
    bar.finish_and_clear();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        print_text(&report, &mut out)?;
    }
    Ok(())
}
