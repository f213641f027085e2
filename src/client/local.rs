//! Lookups answered in the engine, from the daemon's lookup file
//! ([`crate::directory::shared`]): no socket round trip, no daemon wake-up.
//!
//! The answer is the daemon's, or shorter, never longer:
//! - Device and host credit is the directory view's contiguous prefix, read with the
//!   same lock-free code the daemon runs.
//! - On a shared pool with discovery, the engine answers only while the daemon says its
//!   pool index is in sync, the pool healthy and the pool page table whole. Past device
//!   and host, up to the discovery budget, a page counts when the directory has it on
//!   device or host, or the pool page table has every object of it for this namespace's
//!   layout. A page the daemon would credit from its directory alone (one it wrote to the
//!   pool itself) counts here only once the index has it too: shorter, not wrong.
//! - Otherwise (no lookup file, a daemon not done setting it up, an index out of sync)
//!   [`LocalLookup::lookup`] answers `None` and the caller asks the daemon.
//!
//! The daemon's latency histogram does not see lookups answered here; its lookup and hit
//! counters do, from the client's reports ([`EngineLookups`]).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::directory::DirView;
use crate::directory::shared::{self, LookupFile};
use crate::page::{NamespaceId, PageHash};
use crate::wire::{LookupTally, PrefixHit};

/// How often the lookups answered here are reported to the daemon, at most.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// The lookups a client answered itself: counted, and reported to the daemon at most
/// every [`REPORT_EVERY`] (by the lookup that finds a report due, or at once with
/// [`super::Client::report_lookups`]), so that the daemon's lookup and hit counters
/// include them. A report that fails is kept for the next one.
#[derive(Default)]
pub struct EngineLookups {
    answered: AtomicU64,
    unsent: Mutex<(LookupTally, Option<Instant>)>,
}

impl EngineLookups {
    /// Lookups this client answered itself since it connected.
    pub fn answered(&self) -> u64 {
        self.answered.load(Relaxed)
    }

    /// Counts a lookup of `pages` pages answered here with `hit`; the tally to report now,
    /// when one is due.
    pub(super) fn add(&self, pages: usize, hit: &PrefixHit) -> Option<LookupTally> {
        self.answered.fetch_add(1, Relaxed);
        let mut u = self.unsent.lock();
        u.0.add(pages, hit);
        let since = *u.1.get_or_insert_with(Instant::now);
        (since.elapsed() >= REPORT_EVERY).then(|| Self::take_locked(&mut u))
    }

    /// Everything not reported yet (`None`: nothing).
    pub(super) fn take(&self) -> Option<LookupTally> {
        let mut u = self.unsent.lock();
        (u.0.lookups > 0).then(|| Self::take_locked(&mut u))
    }

    fn take_locked(u: &mut (LookupTally, Option<Instant>)) -> LookupTally {
        u.1 = Some(Instant::now());
        std::mem::take(&mut u.0)
    }

    /// A report of `t` failed: it goes with the next one.
    pub(super) fn keep(&self, t: &LookupTally) {
        self.unsent.lock().0.merge(t);
    }
}

/// Pages of the first part of a window walked together, and the most of any part.
const PART_MIN: usize = 8;
const PART_MAX: usize = 64;

/// A rank's mapping of the daemon's lookup file.
pub(super) struct LocalLookup {
    file: LookupFile,
    dir: DirView,
    pool: DirView,
    ns: NamespaceId,
}

impl LocalLookup {
    /// Maps the lookup file at `path` for namespace `ns` (the caller checked its owner and
    /// mode). `None` when it is not a lookup file of this format.
    pub(super) fn open(path: &Path, ns: u16) -> std::io::Result<Option<Self>> {
        Ok(LookupFile::open(path)?.map(|(file, dir, pool)| Self {
            file,
            dir,
            pool,
            ns: NamespaceId(ns),
        }))
    }

    /// The daemon's answer for `hashes`, or a shorter one; `None` when it must be asked.
    pub(super) fn lookup(&self, hashes: &[PageHash]) -> Option<PrefixHit> {
        let flags = self.file.flags();
        // A batch past the daemon's limit is the daemon's to refuse.
        if flags & shared::LIVE == 0 || !self.dir.knows(self.ns) || hashes.len() > self.file.max_batch() {
            return None;
        }
        let hit = self.dir.lookup_prefix(self.ns, hashes);
        if flags & shared::REMOTE == 0 {
            return Some(hit);
        }
        // An unhealthy pool (or one not yet checked since the daemon started), or an index
        // not in sync: the daemon decides.
        if !self.file.pool_healthy() || !self.file.pool_indexed() {
            return None;
        }
        let start = hit.device + hit.host;
        let end = hashes.len().min(start + self.file.budget_pages());
        let window = hashes.get(start..end).unwrap_or_default();
        let complete = crate::directory::COMPLETE;
        // Table hashes of the window in parts of growing size, each part's pool entries
        // prefetched together: a window whose first page misses costs a few probes, one
        // that hits overlaps its misses instead of waiting on each in turn.
        let mut table_hashes = [0u64; PART_MAX];
        let mut pool = 0;
        let mut part = PART_MIN;
        'walk: while pool < window.len() {
            let pages = &window[pool..(pool + part).min(window.len())];
            let hs = &mut table_hashes[..pages.len()];
            for (h, hash) in hs.iter_mut().zip(pages) {
                *h = hash.table_hash(self.ns);
            }
            self.pool.prefetch_cells(hs);
            for (&h, hash) in hs.iter().zip(pages) {
                // In the pool for this layout, or complete on device or on host here (the
                // directory state's first two tier fields).
                let counts = self.pool.find(self.ns, hash, h).is_some()
                    || self
                        .dir
                        .find(self.ns, hash, h)
                        .is_some_and(|(_, s)| s & 3 == complete || (s >> 2) & 3 == complete);
                if !counts {
                    break 'walk;
                }
                pool += 1;
            }
            part = (part * 2).min(PART_MAX);
        }
        // The file may have changed under the walk: believe it only if the pool table was
        // trusted throughout.
        if !self.file.pool_indexed() {
            return None;
        }
        Some(PrefixHit { pool, ..hit })
    }
}
