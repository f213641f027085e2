//! What wakes the daemon's upkeep: the next timer deadline, and watermark crossings.
//!
//! Upkeep (`Manager::tick`) has work to do at two kinds of moments: when a pin or retain
//! expires (a deadline known in advance, [`Manager::next_deadline_ms`]) and when host or
//! pool usage reaches its high watermark (eviction becomes due). A store or a stage that
//! pushes usage across the high watermark calls the waker the daemon registered with
//! [`Manager::set_upkeep_waker`], once per crossing, outside every manager lock, so the
//! daemon's upkeep can sleep until one of the two instead of polling.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::Manager;
use crate::policy::Watermarks;

/// A callback that wakes the upkeep task. It must return quickly and must not call back
/// into the manager synchronously (it runs on the thread that crossed the watermark).
pub type UpkeepWaker = Arc<dyn Fn() + Send + Sync>;

/// Crossing state per watched tier and the waker.
#[derive(Default)]
pub(crate) struct Upkeep {
    /// Whether host (0) and pool (1) usage was at or above its high watermark when last
    /// looked at; a wake fires on a change from below to above.
    above: [AtomicBool; 2],
    /// Taken alone and only to clone the Arc out, never while calling it.
    waker: Mutex<Option<UpkeepWaker>>,
}

/// Whether `used` of `capacity` is at or above the high watermark.
fn over(w: &Watermarks, used: u64, capacity: u64) -> bool {
    capacity > 0 && used as f64 >= w.high * capacity as f64
}

impl Manager {
    /// Registers the callback that wakes the upkeep task when a store or a stage pushes
    /// host or pool usage across its high watermark. Replaces any earlier one. The waker
    /// is called outside every manager lock.
    pub fn set_upkeep_waker(&self, waker: Arc<dyn Fn() + Send + Sync>) {
        *self.inner.upkeep.waker.lock() = Some(waker);
    }

    /// The earliest pin or retain expiry (clock milliseconds), if any: when `tick` next
    /// has timer work to do.
    pub fn next_deadline_ms(&self) -> Option<u64> {
        self.timers().next_deadline()
    }

    /// Looks at host and pool usage after they may have grown; on a crossing of a high
    /// watermark from below, calls the upkeep waker. Call with no manager lock held.
    pub(crate) fn usage_grew(&self) {
        if self.refresh_crossings() {
            let waker = self.inner.upkeep.waker.lock().clone();
            if let Some(w) = waker {
                w();
            }
        }
    }

    /// Updates the crossing state of host and pool; true if one went from below to above.
    pub(crate) fn refresh_crossings(&self) -> bool {
        let tun = self.tunables();
        let host = self
            .arena()
            .is_some_and(|a| over(&tun.host_watermarks, a.used() as u64, a.slots() as u64));
        let pool = self.pool().is_some_and(|p| {
            let u = p.usage();
            over(&tun.pool_watermarks, u.used_bytes, u.capacity_bytes)
        });
        let mut crossed = false;
        for (flag, now) in self.inner.upkeep.above.iter().zip([host, pool]) {
            let was = flag.swap(now, Ordering::AcqRel);
            crossed |= now && !was;
        }
        crossed
    }
}
