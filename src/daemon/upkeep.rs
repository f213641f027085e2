//! The backend's upkeep as a tokio task: eviction by watermark, TTL expiry, deferred
//! hints, manifest upkeep (`Backend::tick`).
//!
//! The task sleeps until one of three things: the manager says eviction became due (a
//! store or a stage crossed a high watermark; it calls the waker from
//! [`Shared::upkeep_waker`], which notifies this task), the earliest pin or retain
//! expiry passes, the coarse periodic tick passes (deferred hints and pool self-evictions
//! have no event to wake on), or shutdown. The tick itself
//! may make room and do pool I/O, so it runs on the blocking pool with a deadline; wakes
//! that arrive while it runs coalesce into one more run. A run that finds the control
//! sockets quiet after a burst also gives the allocator's free memory back
//! ([`super::memory`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::connection::Shared;
use super::memory::{self, QUIET, Quiet};

/// How long one upkeep run is awaited before it is reported as slow.
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// Runs upkeep until `shutdown`; returns after the run in progress (if any) ended or
/// passed its deadline.
pub async fn run(shared: Arc<Shared>, tick: Duration, shutdown: CancellationToken) {
    let mut runs = 0u64;
    let mut quiet = Quiet::new(QUIET, Instant::now());
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = shared.upkeep.notified() => tracing::trace!("upkeep woken"),
            _ = tokio::time::sleep(next_sleep(&shared, tick)) => {}
        }
        let backend = shared.backend.clone();
        let trim = quiet.due(Quiet::frames(), Instant::now());
        let mut task = tokio::task::spawn_blocking(move || {
            let _blocking = crate::pool::io_guard::allow_blocking();
            backend.tick();
            if let Some(frames) = trim {
                memory::trim(frames);
            }
        });
        // Never two runs at once: a slow run is waited for (and reported each deadline)
        // unless shutdown comes first.
        loop {
            match tokio::time::timeout(RUN_LIMIT, &mut task).await {
                Ok(Ok(())) => runs += 1,
                Ok(Err(e)) => tracing::warn!(error = %e, "upkeep run failed"),
                Err(_) => {
                    tracing::warn!(limit = ?RUN_LIMIT, "an upkeep run is taking longer than its deadline");
                    if !shutdown.is_cancelled() {
                        continue;
                    }
                }
            }
            break;
        }
    }
    tracing::debug!(runs, "upkeep stopped");
}

/// Until the earliest pin or retain expiry, but never longer than the fallback `tick`
/// (pool self-evictions, deferred hints and device advice have no deadline to wake on).
fn next_sleep(shared: &Shared, tick: Duration) -> Duration {
    shared.backend.next_deadline().map_or(tick, |d| d.min(tick))
}
