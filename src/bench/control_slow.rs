//! The slow-pool row of `kvtier bench control`: lookup latency while another connection
//! changes the phase of a session whose 1,000 pages go to a pool that answers in 200 ms,
//! next to the idle lookup latency measured in the same run, in the same placement.
//!
//! The daemon runs with a local pool wrapped in `pool.fault_delay_ms` (every pool batch
//! call waits first). A second client owns session `slow`: 1,000 stored pages, one
//! request end (the session's chain), then phase changes in a loop: `paused` demotes the
//! chain to the pool and drops the host copies, `reasoning` stages it back. The figure is
//! the loaded p99 over the idle p99: the phase changes' pool I/O must not run where
//! lookups are answered. The row checks that the pages did move (the policy's move
//! counter on `/metrics`).
//!
//! Like the round-trip rows, the row runs once per placement ([`super::placement`]): the
//! timing client and the daemon (every thread of it: the control thread, the transfer
//! workers, the blocking pool) both on one core, then on two. The mover, another engine,
//! is left to the scheduler. Within a placement the phases alternate (idle, loaded,
//! loaded, idle, …) so both meet the same machine, and an idle phase lasts as long as the
//! longest loaded phase before it (and at least as many lookups): the two sides see the
//! same stretch of time, not 2,000 lookups against five seconds. Unpinned, whether a
//! lookup's wake-up stays on the client's core or crosses to the other decided the
//! figure (on a 2-vCPU VM a crossing wake-up cost 80-160 µs against 16 µs on one core),
//! and the scheduler placed the idle and the loaded phases differently. Each placement's
//! ratio is reported; `slow_pool_phase_ratio_p99` is the larger.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::control::{ControlArgs, percentile, sorted, time_us};
use super::daemon::DaemonChild;
use super::placement::{self, Placement};
use crate::client::{Client, ClientConfig};
use crate::layout::LayoutSpec;
use crate::page::{Namespace, PageHash};
use crate::protocol::{Identity, SessionPhase};
use crate::tier::device::EmulatedDevice;

/// Pages of the session whose phase changes.
pub const SLOW_PAGES: usize = 1_000;
/// The pool's injected answer time.
pub const SLOW_POOL_MS: u64 = 200;
/// Longest one admin request may take.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// Lookup latencies (microseconds) without and with phase changes on a slow pool, in
/// one placement.
pub(crate) struct Placed {
    pub placement: Placement,
    pub idle_p50: f64,
    pub idle_p99: f64,
    pub loaded_p50: f64,
    pub loaded_p99: f64,
    pub loaded_max: f64,
    pub idle_lookups: usize,
    pub loaded_lookups: usize,
    /// Seconds of idle and of loaded phases.
    pub idle_s: f64,
    pub loaded_s: f64,
}

impl Placed {
    pub fn ratio_p99(&self) -> f64 {
        self.loaded_p99 / self.idle_p99.max(1e-9)
    }

    pub fn json(&self) -> serde_json::Value {
        let p = &self.placement;
        serde_json::json!({
            "placement": p.name, "client_core": p.client_core, "server_core": p.server_core,
            "idle_lookup_p50_us": self.idle_p50, "idle_lookup_p99_us": self.idle_p99,
            "phase_lookup_p50_us": self.loaded_p50, "phase_lookup_p99_us": self.loaded_p99,
            "phase_lookup_max_us": self.loaded_max, "ratio_p99": self.ratio_p99(),
            "idle_lookups": self.idle_lookups, "phase_lookups": self.loaded_lookups,
            "idle_seconds": self.idle_s, "phase_seconds": self.loaded_s,
        })
    }
}

/// The row: every placement, and what the mover did over all of them.
pub(crate) struct SlowPool {
    pub placed: Vec<Placed>,
    /// Pause-and-resume cycles the mover finished during the loaded phases.
    pub cycles: usize,
    /// Policy calls whose pool moves were carried out (`/metrics`).
    pub moves_done: u64,
}

impl SlowPool {
    /// The placement with the larger ratio: the row's figure.
    pub fn worst(&self) -> &Placed {
        self.placed
            .iter()
            .max_by(|a, b| a.ratio_p99().total_cmp(&b.ratio_p99()))
            .expect("measure returns at least one placement")
    }

    pub fn ratio_p99(&self) -> f64 {
        self.worst().ratio_p99()
    }
}

fn identity(instance: &str) -> Identity {
    Identity {
        instance: instance.into(),
        namespace: Namespace::model("bench"),
        tp_size: 1,
        pp_size: 1,
        ..Identity::default()
    }
}

fn store_all(client: &Client, hashes: &[PageHash], session: &str) -> anyhow::Result<()> {
    for chunk in hashes.chunks(64) {
        let slots: Vec<u32> = (0..chunk.len() as u32).collect();
        client.store(chunk, &slots, session)?;
    }
    Ok(())
}

/// The daemon's count of policy calls whose moves are done.
fn moves_done(admin: &Path) -> anyhow::Result<u64> {
    let answer = crate::cli::client::request(admin, "GET", "/metrics", None, Some(HTTP_TIMEOUT))?;
    let body = answer.body()?;
    let text = String::from_utf8_lossy(&body);
    text.lines()
        .find_map(|l| l.strip_prefix("kvtier_policy_moves_total{outcome=\"done\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .context("no kvtier_policy_moves_total{outcome=\"done\"} on /metrics")
}

pub(crate) fn measure(args: &ControlArgs, exe: &Path) -> anyhow::Result<SlowPool> {
    let spec = LayoutSpec::mha(1, 1, 64, 2, 16);
    let layout = spec.clone().build()?;
    let pages = (SLOW_PAGES + args.pages + 1024) as u64;
    let arena = (pages * layout.page_bytes()).max(64 << 20);
    let pool_args: Vec<String> = [
        "--set".to_owned(),
        format!("pool.bytes={}", (arena * 2).max(256 << 20)),
        "--set".to_owned(),
        format!("pool.fault_delay_ms={SLOW_POOL_MS}"),
    ]
    .into();
    let daemon = DaemonChild::start_with(exe, arena, layout.max_object_bytes(), &pool_args)?;

    let lookuper = Client::connect(ClientConfig::new(
        daemon.socket(),
        identity("bench-lookup"),
        spec.clone(),
    ))?;
    lookuper.register_device(std::sync::Arc::new(EmulatedDevice::new(&layout, 0, 64)))?;
    let mover = Client::connect(ClientConfig::new(daemon.socket(), identity("bench-mover"), spec))?;
    mover.register_device(std::sync::Arc::new(EmulatedDevice::new(&layout, 0, 64)))?;

    let lookup: Vec<PageHash> = (0..args.pages as u64)
        .map(|i| PageHash::from_u64(0x510_0000 + i))
        .collect();
    store_all(&lookuper, &lookup, "")?;
    let slow: Vec<PageHash> = (0..SLOW_PAGES as u64)
        .map(|i| PageHash::from_u64(0x510_8000_0000 + i))
        .collect();
    mover.session("slow", None, SessionPhase::Reasoning)?;
    store_all(&mover, &slow, "slow")?;
    mover.request_end("slow", None, SLOW_PAGES as u64 * 16, 1, &slow)?;
    if lookuper.lookup_remote(&lookup)?.total() != lookup.len() {
        bail!("the lookup pages did not become host hits");
    }
    let done_before = moves_done(&daemon.admin_socket())?;

    let allowed = placement::allowed_cores()?;
    let cores: Vec<usize> = if args.cores.is_empty() {
        allowed.iter().copied().take(2).collect()
    } else {
        args.cores.clone()
    };
    let daemon_pid = daemon.pid().context("the daemon child has no pid")?;
    let cycles = AtomicUsize::new(0);
    let failures = AtomicUsize::new(0);
    let phases = args.slow_phases.max(1);
    let mut placed = Vec::new();
    for p in placement::placements(&cores) {
        placement::pin(0, &[p.client_core]).with_context(|| format!("pinning the client: {p}"))?;
        placement::pin_process(daemon_pid, &[p.server_core]).with_context(|| format!("pinning the daemon: {p}"))?;
        let (mut idle, mut loaded) = (Vec::new(), Vec::new());
        let (mut idle_t, mut loaded_t) = (Duration::ZERO, Duration::ZERO);
        let mut longest = Duration::ZERO;
        for phase in 0..2 * phases {
            let under_load = (phase % 4 == 1) || (phase % 4 == 2);
            let t = Instant::now();
            if !under_load {
                let mut n = 0usize;
                while n < args.admin_lookups || t.elapsed() < longest {
                    idle.push(time_us(&mut || {
                        lookuper.lookup_remote(&lookup).map(drop).map_err(Into::into)
                    })?);
                    n += 1;
                }
                idle_t += t.elapsed();
                continue;
            }
            let stop = AtomicBool::new(false);
            let start = cycles.load(Ordering::Relaxed);
            let took = std::thread::scope(|s| -> anyhow::Result<Duration> {
                s.spawn(|| {
                    // Another engine: where the scheduler puts it.
                    if placement::pin(0, &allowed).is_err() {
                        failures.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    while !stop.load(Ordering::Relaxed) {
                        let ok = mover.session("slow", None, SessionPhase::Paused).is_ok()
                            && mover.session("slow", None, SessionPhase::Reasoning).is_ok();
                        if ok {
                            cycles.fetch_add(1, Ordering::Relaxed);
                        } else {
                            failures.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    }
                });
                let mut n = 0usize;
                let r = loop {
                    if n >= args.admin_lookups && cycles.load(Ordering::Relaxed) > start {
                        break Ok(());
                    }
                    if failures.load(Ordering::Relaxed) > 0 {
                        break Ok(());
                    }
                    match time_us(&mut || lookuper.lookup_remote(&lookup).map(drop).map_err(Into::into)) {
                        Ok(t) => loaded.push(t),
                        Err(e) => break Err(e),
                    }
                    n += 1;
                };
                // The timed stretch only: the mover's last cycle ends after it, untimed.
                let took = t.elapsed();
                stop.store(true, Ordering::Relaxed);
                r.map(|()| took)
            })?;
            loaded_t += took;
            longest = longest.max(took);
        }
        let (idle, loaded) = (sorted(idle), sorted(loaded));
        placed.push(Placed {
            placement: p,
            idle_p50: percentile(&idle, 0.5),
            idle_p99: percentile(&idle, 0.99),
            loaded_p50: percentile(&loaded, 0.5),
            loaded_p99: percentile(&loaded, 0.99),
            loaded_max: loaded.last().copied().unwrap_or(0.0),
            idle_lookups: idle.len(),
            loaded_lookups: loaded.len(),
            idle_s: idle_t.as_secs_f64(),
            loaded_s: loaded_t.as_secs_f64(),
        });
        if failures.load(Ordering::Relaxed) > 0 {
            break;
        }
    }
    placement::pin(0, &allowed)?;
    placement::pin_process(daemon_pid, &allowed)?;
    if placed.is_empty() {
        bail!("no core to run the slow-pool row on");
    }
    if failures.load(Ordering::Relaxed) > 0 {
        bail!("a phase change failed");
    }
    let cycles = cycles.into_inner();
    // Each cycle is a demotion and a staging: both must have reached the pool. The last
    // cycle's moves run on a transfer worker after its phase change answered, so wait
    // for them (bounded by the pool's delay many times over) before counting.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let moves = loop {
        let m = moves_done(&daemon.admin_socket())?.saturating_sub(done_before);
        if m as usize >= cycles || std::time::Instant::now() >= deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if (moves as usize) < cycles {
        bail!("{cycles} pause/resume cycles but only {moves} policy move batches done");
    }
    Ok(SlowPool {
        placed,
        cycles,
        moves_done: moves,
    })
}
