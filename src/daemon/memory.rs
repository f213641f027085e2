//! Giving the allocator's free memory back once the daemon goes quiet.
//!
//! Under load the daemon's heap grows to what its busiest moment held: frames and answers
//! in flight, the buffers of commands on the blocking pool, the allocator arenas of its
//! threads. glibc keeps what is freed for reuse, so the daemon's resident memory stayed at
//! that high-water mark long after the load had gone (a 10-minute soak on a busy 2-core
//! machine ended at 58 MB against 49 MB measured late in its load), beside engines that
//! want the node's memory for themselves. So once no frame has reached any control socket
//! of this process for [`QUIET`], the upkeep task asks the allocator once
//! (`malloc_trim`) to return its free pages to the system; the next burst faults in what
//! it needs again. One trim per quiet spell: a daemon that stays idle is not trimmed again.
//!
//! `/v1/status` shows `memory.trims`, the frames served so far (`memory.frames`) and the
//! count the last trim followed (`memory.trimmed_after_frames`), so a caller can wait for
//! the trim that follows its own last request. Where the C library is not glibc nothing is
//! trimmed and `trims` stays 0.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::admin::MemoryReport;

/// How long no frame may arrive before the free memory is given back.
pub const QUIET: Duration = Duration::from_secs(1);

/// Frames read from every control connection of this process (the allocator is the
/// process's, so its quiet is every daemon instance's in it).
static FRAMES: AtomicU64 = AtomicU64::new(0);
static TRIMS: AtomicU64 = AtomicU64::new(0);
static TRIMMED_AFTER: AtomicU64 = AtomicU64::new(0);

/// Counts one frame read from a control connection.
pub(crate) fn frame_read() {
    FRAMES.fetch_add(1, Relaxed);
}

/// The counters `/v1/status` shows under `memory`.
pub fn report() -> MemoryReport {
    // The counters are read one by one: a trim recorded between the reads must not show
    // a `trimmed_after_frames` past `frames`.
    let trims = TRIMS.load(Relaxed);
    let trimmed_after_frames = TRIMMED_AFTER.load(Relaxed);
    MemoryReport {
        frames: FRAMES.load(Relaxed).max(trimmed_after_frames),
        trims,
        trimmed_after_frames,
    }
}

/// When a quiet spell has lasted long enough for a trim. Fed the frame count at each
/// upkeep wake; says yes once per spell, after the count has stood still for `quiet`
/// and only if it moved since the last trim.
#[derive(Debug)]
pub(crate) struct Quiet {
    quiet: Duration,
    seen: u64,
    since: Instant,
    trimmed: u64,
}

impl Quiet {
    pub(crate) fn new(quiet: Duration, now: Instant) -> Self {
        Self {
            quiet,
            seen: 0,
            since: now,
            trimmed: 0,
        }
    }

    /// Whether to trim now, given the frames read so far; `Some(frames)` to record with
    /// the trim.
    pub(crate) fn due(&mut self, frames: u64, now: Instant) -> Option<u64> {
        if frames != self.seen {
            self.seen = frames;
            self.since = now;
            return None;
        }
        if frames == self.trimmed || now.saturating_duration_since(self.since) < self.quiet {
            return None;
        }
        self.trimmed = frames;
        Some(frames)
    }

    /// The frames read so far, for [`Quiet::due`].
    pub(crate) fn frames() -> u64 {
        FRAMES.load(Relaxed)
    }
}

/// Asks the allocator to return its free pages, and records the trim as following
/// `after_frames`. Blocks for as long as the allocator walks its arenas (run it off the
/// control thread).
pub(crate) fn trim(after_frames: u64) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` takes no pointer and locks each arena itself; any thread
        // may call it while others allocate.
        unsafe { libc::malloc_trim(0) };
        TRIMMED_AFTER.fetch_max(after_frames, Relaxed);
        TRIMS.fetch_add(1, Relaxed);
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = after_frames;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trim_follows_each_quiet_spell_once_and_never_an_idle_start() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut q = Quiet::new(Duration::from_millis(1000), t0);
        // Idle from the start: nothing was freed by a load, nothing to trim.
        assert_eq!(q.due(0, at(5_000)), None);
        // Frames arrive: no trim while they keep coming.
        assert_eq!(q.due(10, at(5_100)), None);
        assert_eq!(q.due(20, at(5_900)), None);
        // Standing still, but not for the whole quiet yet.
        assert_eq!(q.due(20, at(6_800)), None);
        // A whole quiet since the count last moved (5.9 s): one trim.
        assert_eq!(q.due(20, at(6_900)), Some(20));
        // Still quiet: not again.
        assert_eq!(q.due(20, at(9_000)), None);
        assert_eq!(q.due(20, at(60_000)), None);
        // A new burst and its own quiet: one more.
        assert_eq!(q.due(21, at(60_100)), None);
        assert_eq!(q.due(21, at(60_500)), None);
        assert_eq!(q.due(21, at(61_100)), Some(21));
        assert_eq!(q.due(21, at(62_100)), None);
    }

    #[test]
    fn the_report_never_shows_a_trim_past_the_frames() {
        frame_read();
        let before = report();
        let frames = Quiet::frames();
        trim(frames);
        let after = report();
        assert!(after.trimmed_after_frames <= after.frames, "{after:?}");
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            assert!(after.trims > before.trims, "{before:?} {after:?}");
            assert!(after.trimmed_after_frames >= frames, "{after:?} after {frames} frames");
        }
    }
}
