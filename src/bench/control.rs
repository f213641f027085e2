//! `kvtier bench control`: control-socket round trips against a raw Unix-socket echo.
//!
//! A real daemon (`kvtier serve`, a child process on a scratch directory) and an echo
//! server that returns each frame as it came (thread per connection, reading through the
//! same frame reader) take turns request by request: a lookup to the echo, the same
//! lookup to the daemon through the client library (`Client::lookup_remote`: this bench
//! times the control socket, so its lookups never take the engine's own answer from the
//! lookup file), a hint to each, and so on, with the order flipped every round. Each round gives a ratio of medians; the figure is the
//! median of those per-round ratios and its spread (p10, p90), so a burst of machine
//! noise moves a few rounds, not the result.
//!
//! The rounds run once per placement (see [`super::placement`]): client and server on
//! one named core (`same_core`), then on two (`cross_core`). The bench's thread is the
//! client of both the daemon and the echo; every thread of the daemon process, and the
//! echo's connection thread, are pinned to the server core. Where the scheduler put the
//! threads used to move the echo's p50 fourfold between runs; pinned, both sides meet the
//! same placement and each placement's ratio is reported (`placements`), `ratio_p50`
//! being the larger. The batched and admin rows run unpinned afterwards.
//! Batched throughput pipelines `depth` lookups per write.
//! The admin row is in [`super::admin_load`].

use std::io::BufReader;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

use super::admin_load::{self, AdminLoad};
use super::daemon::DaemonChild;
use super::placement::{self, Placement};
use crate::client::{Client, ClientConfig};
use crate::hints::{Hint, HintTarget};
use crate::layout::LayoutSpec;
use crate::page::{Namespace, PageHash};
use crate::protocol::{Identity, Request, SessionPhase, frame, read_frame};
use crate::tier::device::EmulatedDevice;

#[derive(Args, Debug, Clone)]
pub struct ControlArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Round trips per side (echo and daemon), split evenly over the rounds.
    #[arg(long, default_value_t = 20_000)]
    pub iters: usize,
    /// Alternating rounds; each gives one daemon/echo ratio.
    #[arg(long, default_value_t = 50)]
    pub rounds: usize,
    /// Requests in flight per write in the batched run.
    #[arg(long, default_value_t = 64)]
    pub depth: usize,
    /// Batches in the batched run.
    #[arg(long, default_value_t = 4_000)]
    pub batches: usize,
    /// Page hashes per lookup request.
    #[arg(long, default_value_t = 16)]
    pub pages: usize,
    /// Pages stored in the daemon for the admin row (besides the lookup's own).
    #[arg(long, default_value_t = 16_384)]
    pub admin_pages: usize,
    /// Sessions the admin row's pages belong to.
    #[arg(long, default_value_t = 1_024)]
    pub sessions: usize,
    /// Bytes of each admin-row session id (long ids make `/v1/sessions` renders heavy:
    /// 1,000 rows of 1,000 bytes is a megabyte per render).
    #[arg(long, default_value_t = 1_000)]
    pub session_id_bytes: usize,
    /// Phase pairs (idle, under admin renders) of the admin row.
    #[arg(long, default_value_t = 10)]
    pub admin_phases: usize,
    /// Lookups timed per admin-row phase.
    #[arg(long, default_value_t = 2_000)]
    pub admin_lookups: usize,
    /// The two cores the rounds are pinned to: `same_core` puts client and server on the
    /// first, `cross_core` the client on the first and the server on the second.
    /// Default: the first two CPUs this process may run on.
    #[arg(long, value_delimiter = ',')]
    pub cores: Vec<usize>,
    /// Phase pairs (idle, under phase changes on a slow pool) of the slow-pool row; 0
    /// skips the row.
    #[arg(long, default_value_t = 3)]
    pub slow_phases: usize,
    /// The `kvtier` executable to run as the daemon. Default: this executable.
    #[arg(long, value_name = "PATH")]
    pub kvtier: Option<PathBuf>,
}

/// One frame per call over a raw socket, as the echo and the batched run need.
pub(super) struct Raw {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    body: Vec<u8>,
}

impl Raw {
    pub(super) fn connect(path: &Path) -> anyhow::Result<Self> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let reader = BufReader::with_capacity(64 << 10, stream.try_clone()?);
        Ok(Self {
            stream,
            reader,
            body: Vec::new(),
        })
    }

    pub(super) fn round_trip(&mut self, frame_bytes: &[u8], n: usize) -> anyhow::Result<u8> {
        frame::write_all(&mut self.stream, frame_bytes)?;
        let mut kind = 0;
        for _ in 0..n {
            kind = read_frame(&mut self.reader, 1 << 20, &mut self.body)?.kind;
        }
        Ok(kind)
    }
}

/// An echo server whose connection threads each pin themselves to the core `core` names
/// when the connection is accepted (`usize::MAX`: unpinned).
pub(super) fn echo_server(listener: UnixListener, core: Arc<AtomicUsize>) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { return };
        let at = core.load(Ordering::SeqCst);
        std::thread::spawn(move || {
            if at != usize::MAX && placement::pin(0, &[at]).is_err() {
                return;
            }
            let Ok(read_half) = stream.try_clone() else { return };
            let mut reader = BufReader::with_capacity(64 << 10, read_half);
            let mut writer = &stream;
            let (mut body, mut out) = (Vec::new(), Vec::with_capacity(64 << 10));
            while let Ok(h) = read_frame(&mut reader, 1 << 20, &mut body) {
                out.extend_from_slice(&h.encode());
                out.extend_from_slice(&body);
                if reader.buffer().is_empty() {
                    if frame::write_all(&mut writer, &out).is_err() {
                        return;
                    }
                    out.clear();
                }
            }
        });
    }
}

/// The value at quantile `p` of an ascending slice (nearest rank); 0 when empty.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub(crate) fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Microseconds one call of `f` takes.
pub(crate) fn time_us(f: &mut impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_nanos() as f64 / 1000.0)
}

/// What the round-by-round comparison measured, in microseconds.
struct Rounds {
    echo: Vec<f64>,
    lookup: Vec<f64>,
    hint: Vec<f64>,
    /// Per round: the daemon's median over the echo's median.
    ratios: Vec<f64>,
}

pub fn run(args: ControlArgs) -> anyhow::Result<()> {
    let exe = match &args.kvtier {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("locating this executable")?,
    };
    let (placed, ops, admin) = measure(&args, &exe)?;
    let per_placement: Vec<serde_json::Value> = placed
        .iter()
        .map(|(p, r)| {
            let (e, l, h, ratios) = (
                sorted(r.echo.clone()),
                sorted(r.lookup.clone()),
                sorted(r.hint.clone()),
                sorted(r.ratios.clone()),
            );
            serde_json::json!({
                "placement": p.name, "client_core": p.client_core, "server_core": p.server_core,
                "echo_p50_us": percentile(&e, 0.5), "echo_p99_us": percentile(&e, 0.99),
                "lookup_p50_us": percentile(&l, 0.5), "hint_p50_us": percentile(&h, 0.5),
                "ratio_p50": percentile(&ratios, 0.5),
                "ratio_p10": percentile(&ratios, 0.1), "ratio_p90": percentile(&ratios, 0.9),
                "rounds": ratios.len(),
            })
        })
        .collect();
    let worst = per_placement
        .iter()
        .filter_map(|p| p["ratio_p50"].as_f64())
        .fold(0.0, f64::max);
    let r = Rounds {
        echo: placed.iter().flat_map(|(_, r)| r.echo.iter().copied()).collect(),
        lookup: placed.iter().flat_map(|(_, r)| r.lookup.iter().copied()).collect(),
        hint: placed.iter().flat_map(|(_, r)| r.hint.iter().copied()).collect(),
        ratios: placed.iter().flat_map(|(_, r)| r.ratios.iter().copied()).collect(),
    };
    let slow = (args.slow_phases > 0)
        .then(|| super::control_slow::measure(&args, &exe))
        .transpose()?;
    let daemon: Vec<f64> = sorted(r.lookup.iter().chain(&r.hint).copied().collect());
    let (echo, lookup, hint, ratios) = (sorted(r.echo), sorted(r.lookup), sorted(r.hint), sorted(r.ratios));
    // Each placement must meet the goal: the figure is the worse of the two.
    let ratio_p50 = worst;
    let pass = ratio_p50 <= 2.0 && ops >= 200_000.0;
    let admin_ratio = admin.loaded_p99 / admin.idle_p99.max(1e-9);
    let mut json = serde_json::json!({
        "echo_p50_us": percentile(&echo, 0.5), "echo_p99_us": percentile(&echo, 0.99),
        "p50_us": percentile(&daemon, 0.5), "p99_us": percentile(&daemon, 0.99),
        "lookup_p50_us": percentile(&lookup, 0.5), "lookup_p99_us": percentile(&lookup, 0.99),
        "hint_p50_us": percentile(&hint, 0.5), "hint_p99_us": percentile(&hint, 0.99),
        "ratio_p50": ratio_p50,
        "ratio_p10": percentile(&ratios, 0.1), "ratio_p90": percentile(&ratios, 0.9),
        "rounds": ratios.len(),
        "placements": per_placement,
        "batched_ops_per_sec": ops,
        "admin_idle_lookup_p50_us": admin.idle_p50, "admin_idle_lookup_p99_us": admin.idle_p99,
        "admin_loaded_lookup_p50_us": admin.loaded_p50, "admin_loaded_lookup_p99_us": admin.loaded_p99,
        "admin_ratio_p99": admin_ratio,
        "admin_idle_lookup_max_us": admin.idle_max, "admin_loaded_lookup_max_us": admin.loaded_max,
        "goal_admin_loaded_lookup_max_us": 10_000, "admin_session_id_bytes": args.session_id_bytes,
        "admin_renders_per_sec": admin.renders_per_sec,
        "admin_pages": args.admin_pages, "admin_sessions": args.sessions,
        "batch_depth": args.depth, "pages_per_lookup": args.pages, "iters": args.iters,
        "cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "goal_ratio_p50": 2.0, "goal_batched_ops_per_sec": 200_000, "goal_admin_ratio_p99": 2.0,
        "pass": pass, "admin_pass": admin_ratio <= 2.0,
    });
    if let Some(s) = &slow {
        // The figures of the placement with the larger ratio; every placement's below.
        let w = s.worst();
        let extra = serde_json::json!({
            "slow_pool_idle_lookup_p50_us": w.idle_p50, "slow_pool_idle_lookup_p99_us": w.idle_p99,
            "slow_pool_phase_lookup_p50_us": w.loaded_p50, "slow_pool_phase_lookup_p99_us": w.loaded_p99,
            "slow_pool_phase_lookup_max_us": w.loaded_max, "slow_pool_placement": w.placement.name,
            "slow_pool_placements": s.placed.iter().map(|p| p.json()).collect::<Vec<_>>(),
            "slow_pool_phase_ratio_p99": s.ratio_p99(), "goal_slow_pool_phase_ratio_p99": 2.0,
            "slow_pool_phase_pass": s.ratio_p99() <= 2.0,
            "slow_pool_pages": super::control_slow::SLOW_PAGES, "slow_pool_delay_ms": super::control_slow::SLOW_POOL_MS,
            "slow_pool_cycles": s.cycles, "slow_pool_move_batches": s.moves_done,
        });
        if let (Some(o), serde_json::Value::Object(e)) = (json.as_object_mut(), extra) {
            o.extend(e);
        }
    }
    if args.json {
        println!("{json}");
    } else {
        for (p, v) in placed.iter().map(|(p, _)| p).zip(&per_placement) {
            println!(
                "{p}: echo p50 {:.1} us | lookup p50 {:.1} us | hint p50 {:.1} us | ratio p50 {:.2} (p10 {:.2}, p90 {:.2})",
                v["echo_p50_us"].as_f64().unwrap_or(0.0),
                v["lookup_p50_us"].as_f64().unwrap_or(0.0),
                v["hint_p50_us"].as_f64().unwrap_or(0.0),
                v["ratio_p50"].as_f64().unwrap_or(0.0),
                v["ratio_p10"].as_f64().unwrap_or(0.0),
                v["ratio_p90"].as_f64().unwrap_or(0.0),
            );
        }
        println!(
            "echo p50 {:.1} us | daemon p50 {:.1} us p99 {:.1} us | ratio p50 {:.2} (p10 {:.2}, p90 {:.2}, {} rounds) | batched {:.0} ops/s | {}",
            percentile(&echo, 0.5),
            percentile(&daemon, 0.5),
            percentile(&daemon, 0.99),
            ratio_p50,
            percentile(&ratios, 0.1),
            percentile(&ratios, 0.9),
            ratios.len(),
            ops,
            if pass { "goals met" } else { "goals NOT met" }
        );
        println!(
            "lookup p99 idle {:.1} us | while rendering /v1/pages and /v1/sessions {:.1} us ({:.0} renders/s) | ratio {:.2} (goal <= 2) | max {:.0} us idle, {:.0} us rendering (goal <= 10000)",
            admin.idle_p99, admin.loaded_p99, admin.renders_per_sec, admin_ratio, admin.idle_max, admin.loaded_max
        );
        if let Some(s) = &slow {
            for p in &s.placed {
                println!(
                    "{}: lookup p99 idle {:.1} us | while a {}-page session pauses and resumes on a pool answering in {} ms {:.1} us | ratio {:.2} | max {:.0} us",
                    p.placement,
                    p.idle_p99,
                    super::control_slow::SLOW_PAGES,
                    super::control_slow::SLOW_POOL_MS,
                    p.loaded_p99,
                    p.ratio_p99(),
                    p.loaded_max
                );
            }
            println!(
                "slow pool: ratio p99 {:.2} ({}; goal <= 2) | {} pause/resume cycles",
                s.ratio_p99(),
                s.worst().placement.name,
                s.cycles
            );
        }
    }
    Ok(())
}

/// The rounds of every placement, the batched throughput and the admin row.
type Measured = (Vec<(Placement, Rounds)>, f64, AdminLoad);

fn measure(args: &ControlArgs, exe: &Path) -> anyhow::Result<Measured> {
    anyhow::ensure!(
        args.pages > 0 && args.rounds > 0 && args.depth > 0,
        "pages, rounds and depth must be positive"
    );
    // Small pages (two 2 KiB objects) so many of them fit a small arena.
    let spec = LayoutSpec::mha(1, 1, 64, 2, 16);
    let layout = spec.clone().build()?;
    let pages = args.pages + args.admin_pages;
    let arena = ((pages as u64 + 1024) * layout.page_bytes()).max(64 << 20);
    let daemon = DaemonChild::start(exe, arena, layout.max_object_bytes())?;
    let echo_path = daemon.scratch("echo.sock");
    let echo_listener = UnixListener::bind(&echo_path)?;
    let echo_core = Arc::new(AtomicUsize::new(usize::MAX));
    let ec = echo_core.clone();
    std::thread::spawn(move || echo_server(echo_listener, ec));
    let allowed = placement::allowed_cores()?;
    let cores = if args.cores.is_empty() {
        allowed.iter().copied().take(2).collect()
    } else {
        args.cores.clone()
    };
    let daemon_pid = daemon.pid().context("the daemon child has no pid")?;

    let identity = Identity {
        instance: "bench".into(),
        namespace: Namespace::model("bench"),
        tp_size: 1,
        pp_size: 1,
        ..Identity::default()
    };
    let client = Client::connect(ClientConfig::new(daemon.socket(), identity.clone(), spec.clone()))?;
    let dev = Arc::new(EmulatedDevice::new(&layout, 0, 64));
    client.register_device(dev.clone())?;
    let hashes: Vec<PageHash> = (0..args.pages as u64)
        .map(|i| PageHash::from_u64(0xbe7c_0000 + i))
        .collect();
    for chunk in hashes.chunks(64) {
        let slots: Vec<u32> = (0..chunk.len() as u32).collect();
        client.store(chunk, &slots, "")?;
    }
    if client.lookup_remote(&hashes)?.total() != hashes.len() {
        bail!("bench pages did not become host hits");
    }
    let admin_hashes = populate(&client, args)?;

    let hint = Hint::Retain {
        target: HintTarget::Pages(hashes.clone()),
        priority: 1,
        ttl_ms: 60_000,
    };
    let mut lookup_frame = Vec::new();
    Request::Lookup { hashes: hashes.clone() }.encode(1, &mut lookup_frame);
    let mut hint_frame = Vec::new();
    Request::Hint(hint.clone()).encode(1, &mut hint_frame);

    let per = (args.iters / args.rounds).max(2) / 2;
    let mut placed = Vec::new();
    for p in placement::placements(&cores) {
        placement::pin(0, &[p.client_core]).with_context(|| format!("pinning the client: {p}"))?;
        placement::pin_process(daemon_pid, &[p.server_core]).with_context(|| format!("pinning the daemon: {p}"))?;
        echo_core.store(p.server_core, Ordering::SeqCst);
        // A fresh echo connection, so its thread starts on the server core.
        let mut echo = Raw::connect(&echo_path)?;
        let req = Requests {
            client: &client,
            hashes: &hashes,
            hint: &hint,
            lookup_frame: &lookup_frame,
            hint_frame: &hint_frame,
        };
        let r = rounds(args, &req, &mut echo, per)?;
        placed.push((p, r));
    }
    // The batched and admin rows run as before: unpinned.
    placement::pin(0, &allowed)?;
    placement::pin_process(daemon_pid, &allowed)?;
    echo_core.store(usize::MAX, Ordering::SeqCst);

    // Batched: a raw connected session pipelining `depth` lookups per write.
    let mut raw = Raw::connect(&daemon.socket())?;
    let mut hello = Vec::new();
    Request::Connect { identity, layout: spec }.encode(1, &mut hello);
    raw.round_trip(&hello, 1).context("batched session connect")?;
    let mut batch = Vec::new();
    for i in 0..args.depth {
        Request::Lookup { hashes: hashes.clone() }.encode(i as u64 + 1, &mut batch);
    }
    let t = Instant::now();
    for _ in 0..args.batches {
        let kind = raw.round_trip(&batch, args.depth)?;
        if kind != crate::protocol::kind::R_LOOKUP {
            bail!("batched lookup answered with kind {kind:#x}");
        }
    }
    let ops = (args.batches * args.depth) as f64 / t.elapsed().as_secs_f64();
    drop(raw);

    let admin = admin_load::measure(&client, &hashes, &admin_hashes, &daemon.admin_socket(), args)?;
    drop(client);
    drop(daemon);
    Ok((placed, ops, admin))
}

/// What the rounds send: the lookup and the hint, through the client and as raw frames.
struct Requests<'a> {
    client: &'a Client,
    hashes: &'a [PageHash],
    hint: &'a Hint,
    lookup_frame: &'a [u8],
    hint_frame: &'a [u8],
}

/// `args.rounds` rounds of `per` lookups and `per` hints to each side, taking turns.
fn rounds(args: &ControlArgs, req: &Requests<'_>, echo: &mut Raw, per: usize) -> anyhow::Result<Rounds> {
    let Requests {
        client,
        hashes,
        hint,
        lookup_frame,
        hint_frame,
    } = *req;
    let mut r = Rounds {
        echo: Vec::new(),
        lookup: Vec::new(),
        hint: Vec::new(),
        ratios: Vec::new(),
    };
    for round in 0..args.rounds {
        let (mut e, mut d) = (Vec::with_capacity(2 * per), Vec::with_capacity(2 * per));
        // Request by request, echo and daemon take turns (who goes first alternates by
        // round), so both meet the same scheduler state: on a small shared machine, where
        // a wake-up lands (same core or not) drifts over milliseconds and moves both
        // sides' latency far more than the daemon's own work does.
        for _ in 0..per {
            for frame_bytes in [lookup_frame, hint_frame] {
                let mut echo_once = || time_us(&mut || echo.round_trip(frame_bytes, 1).map(drop));
                let is_lookup = std::ptr::eq(frame_bytes, lookup_frame);
                let daemon_once = || {
                    if is_lookup {
                        time_us(&mut || client.lookup_remote(hashes).map(drop).map_err(Into::into))
                    } else {
                        time_us(&mut || client.hint(hint.clone()).map(drop).map_err(Into::into))
                    }
                };
                let (te, td) = if round % 2 == 0 {
                    let te = echo_once()?;
                    (te, daemon_once()?)
                } else {
                    let td = daemon_once()?;
                    (echo_once()?, td)
                };
                e.push(te);
                d.push(td);
                if is_lookup { r.lookup.push(td) } else { r.hint.push(td) }
            }
        }
        let (e, d) = (sorted(e), sorted(d));
        r.ratios.push(percentile(&d, 0.5) / percentile(&e, 0.5).max(1e-9));
        r.echo.extend(e);
    }
    Ok(r)
}

/// Stores `admin_pages` pages spread over `sessions` sessions, so the admin renders have
/// real work. Returns the pages' hashes.
fn populate(client: &Client, args: &ControlArgs) -> anyhow::Result<Vec<PageHash>> {
    let sessions = args.sessions.max(1);
    let name = |s: usize| {
        let head = format!("bench-s{s}-");
        format!("{head}{}", "x".repeat(args.session_id_bytes.saturating_sub(head.len())))
    };
    for s in 0..sessions {
        client.session(&name(s), None, SessionPhase::Reasoning)?;
    }
    let hashes: Vec<PageHash> = (0..args.admin_pages as u64)
        .map(|i| PageHash::from_u64(0xad31_0000_0000 + i))
        .collect();
    for (i, chunk) in hashes.chunks(64).enumerate() {
        let slots: Vec<u32> = (0..chunk.len() as u32).collect();
        client.store(chunk, &slots, &name(i % sessions))?;
    }
    let last = &hashes[hashes.len().saturating_sub(64)..];
    let hit = client.lookup_remote(last)?.total();
    anyhow::ensure!(hit == last.len(), "admin-row pages did not become host hits ({hit})");
    Ok(hashes)
}
