//! The admin row of `kvtier bench control`: lookup latency while an operator's tooling
//! renders the admin socket's `/v1/pages` and `/v1/sessions` in a loop, next to the idle
//! lookup latency measured in the same run.
//!
//! Phases alternate (idle, loaded, loaded, idle, …) so both meet the same machine; in a
//! loaded phase one thread issues `GET /v1/sessions` and `GET /v1/pages?prefix=…` back to
//! back over the admin Unix socket while this thread times lookups. The figure is the
//! loaded p99 over the idle p99: renders walk the daemon's tables, and lookups must not
//! queue behind them.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;

use super::control::{ControlArgs, percentile, sorted, time_us};
use super::daemon::http_get;
use crate::client::Client;
use crate::page::PageHash;

/// Hashes named by one `/v1/pages?prefix=` render: the request line stays well under the
/// admin socket's header limit.
const PREFIX_HASHES: usize = 512;
/// Longest one admin request may take before the row fails.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// Lookup latencies (microseconds) without and with concurrent admin renders.
pub(crate) struct AdminLoad {
    pub idle_p50: f64,
    pub idle_p99: f64,
    pub loaded_p50: f64,
    pub loaded_p99: f64,
    /// The longest single lookup: what a render delayed a lookup by at worst.
    pub idle_max: f64,
    pub loaded_max: f64,
    pub renders_per_sec: f64,
}

pub(crate) fn measure(
    client: &Client,
    lookup: &[PageHash],
    stored: &[PageHash],
    admin: &Path,
    args: &ControlArgs,
) -> anyhow::Result<AdminLoad> {
    let prefix: Vec<String> = stored.iter().take(PREFIX_HASHES).map(PageHash::to_hex).collect();
    let pages_path = format!("/v1/pages?prefix={}", prefix.join(","));
    // The renders must do their work, not answer an error page quickly.
    for path in ["/v1/sessions", pages_path.as_str()] {
        let (status, len) = http_get(admin, path, HTTP_TIMEOUT)?;
        if status != 200 || len < 1000 {
            bail!(
                "admin GET {} answered {status} with {len} bytes",
                &path[..path.len().min(40)]
            );
        }
    }
    let (mut idle, mut loaded) = (Vec::new(), Vec::new());
    let (renders, failures) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let mut loaded_secs = 0.0;
    for phase in 0..2 * args.admin_phases.max(1) {
        // idle, loaded, loaded, idle, idle, loaded, …
        let under_load = (phase % 4 == 1) || (phase % 4 == 2);
        if !under_load {
            for _ in 0..args.admin_lookups {
                idle.push(time_us(&mut || {
                    client.lookup_remote(lookup).map(drop).map_err(Into::into)
                })?);
            }
            continue;
        }
        let stop = AtomicBool::new(false);
        let t = Instant::now();
        std::thread::scope(|s| -> anyhow::Result<()> {
            s.spawn(|| {
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let path = if n.is_multiple_of(2) {
                        "/v1/sessions"
                    } else {
                        pages_path.as_str()
                    };
                    match http_get(admin, path, HTTP_TIMEOUT) {
                        Ok((200, _)) => renders.fetch_add(1, Ordering::Relaxed),
                        _ => failures.fetch_add(1, Ordering::Relaxed),
                    };
                    n += 1;
                }
            });
            let r = (0..args.admin_lookups).try_for_each(|_| {
                loaded.push(time_us(&mut || {
                    client.lookup_remote(lookup).map(drop).map_err(Into::into)
                })?);
                Ok(())
            });
            stop.store(true, Ordering::Relaxed);
            r
        })?;
        loaded_secs += t.elapsed().as_secs_f64();
    }
    let failed = failures.load(Ordering::Relaxed);
    if failed > 0 {
        bail!("{failed} admin renders failed");
    }
    let (idle, loaded) = (sorted(idle), sorted(loaded));
    Ok(AdminLoad {
        idle_p50: percentile(&idle, 0.5),
        idle_p99: percentile(&idle, 0.99),
        loaded_p50: percentile(&loaded, 0.5),
        loaded_p99: percentile(&loaded, 0.99),
        idle_max: idle.last().copied().unwrap_or(0.0),
        loaded_max: loaded.last().copied().unwrap_or(0.0),
        renders_per_sec: renders.load(Ordering::Relaxed) as f64 / loaded_secs.max(1e-9),
    })
}
