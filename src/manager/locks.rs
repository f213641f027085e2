//! The manager's locks and the one order they nest in.
//!
//! The manager's state is split by who touches it (see docs/ARCHITECTURE.md, "Locks"):
//! the directory behind a read-mostly lock, the grant table, the timer heap, the advice
//! and deferred-hint queues, the session table, the tunables and the device maps each
//! behind their own. Every lock has a [`Rank`]; a thread may only take a lock whose rank
//! is above every rank it already holds. `Manager`'s lock helpers (`read`, `write`,
//! `grants`, …) are the only way the manager takes these locks, and in test and debug builds
//! (every `cargo build` and `cargo test` without `--release`, the daemon and the integration
//! tests included) each helper checks the rule on the calling thread, so an out-of-order nesting fails the
//! first test that reaches it instead of deadlocking one day in production.
//!
//! Prefix lookups take none of these locks: [`Manager::view_lookup`] reads the
//! directory's lock-free view (`directory/view.rs`), which the directory's writer keeps
//! current under the `Dir` write lock, so a store or an eviction round never delays one.

use std::ops::{Deref, DerefMut};

use parking_lot::{MutexGuard, RwLockReadGuard};

use super::grants::GrantTable;
use super::state::{DirState, DirWrite};
use super::{Manager, ManagerError};
use crate::directory::{DirectoryError, PageId, PageInfo};
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::wire::PrefixHit;

/// Position of a lock in the nesting order: take them in increasing rank only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    /// Creation of the arena and the pool (taken alone, before any other).
    Init = 0,
    /// The directory, key schemes and host slot map (read-mostly).
    Dir = 1,
    /// Open grants and host-slot leases.
    Grants = 2,
    /// Pin and retain expiries.
    Timers = 3,
    /// Advice and deferred hints.
    Queues = 4,
    /// Interned sessions and which are idle.
    Sessions = 5,
    /// Runtime tunables.
    Tunables = 6,
    /// Attached device regions and their page counts.
    Devices = 7,
    /// The session-aware policy (`manager::policy`); taken alone.
    Policy = 8,
    /// Cached pool existence answers and page origins (shared pools only).
    Remote = 9,
}

#[cfg(any(test, debug_assertions))]
thread_local! {
    /// Ranks of the manager locks this thread holds, one bit each.
    static HELD: std::cell::Cell<u16> = const { std::cell::Cell::new(0) };
}

/// A lock guard that knows its rank. In test and debug builds, creating one asserts that the thread
/// holds no lock of the same or a later rank, and dropping it clears the mark.
pub(crate) struct Ordered<G> {
    guard: G,
    #[cfg(any(test, debug_assertions))]
    rank: Rank,
}

impl<G> Ordered<G> {
    /// Takes a lock of rank `rank` through `take`, after checking the order (test and debug builds).
    pub(crate) fn take(rank: Rank, take: impl FnOnce() -> G) -> Self {
        #[cfg(any(test, debug_assertions))]
        HELD.with(|held| {
            let h = held.get();
            assert!(
                h >> rank as u16 == 0,
                "lock order violated: taking {rank:?} while holding ranks {h:#b}"
            );
            held.set(h | 1 << rank as u16);
        });
        #[cfg(not(any(test, debug_assertions)))]
        let _ = rank;
        Self {
            guard: take(),
            #[cfg(any(test, debug_assertions))]
            rank,
        }
    }
}

impl<G> Drop for Ordered<G> {
    fn drop(&mut self) {
        #[cfg(any(test, debug_assertions))]
        HELD.with(|held| held.set(held.get() & !(1 << self.rank as u16)));
    }
}

impl<G: Deref> Deref for Ordered<G> {
    type Target = G::Target;

    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: DerefMut> DerefMut for Ordered<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

/// Records per chunk when a walk over the directory lets go of its lock between chunks.
const WALK_CHUNK: usize = 16 * 1024;

// The lock helpers, one per lock, in rank order. Nothing else takes these locks.
impl Manager {
    pub(super) fn init_lock(&self) -> Ordered<MutexGuard<'_, ()>> {
        Ordered::take(Rank::Init, || self.inner.init.lock())
    }

    /// A contiguous-prefix lookup through the directory's lock-free view. It takes no
    /// lock, so it has no rank and may run while this thread or any other holds any
    /// lock, `dir` included: a store or an eviction round never delays it.
    pub(super) fn view_lookup(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<PrefixHit, ManagerError> {
        if !self.inner.view.knows(ns) {
            return Err(DirectoryError::UnknownNamespace(ns.0).into());
        }
        Ok(self.inner.view.lookup_prefix(ns, hashes))
    }

    /// Shared access to the directory state: readers other than prefix lookups.
    pub(super) fn read(&self) -> Ordered<RwLockReadGuard<'_, DirState>> {
        Ordered::take(Rank::Dir, || self.inner.dir.read())
    }

    /// Exclusive access to the directory state; publishes its events when dropped.
    pub(super) fn write(&self) -> DirWrite<'_> {
        let g = Ordered::take(Rank::Dir, || self.inner.dir.write());
        DirWrite::new(g, &self.inner.events, &self.inner.clock)
    }

    pub(super) fn grants(&self) -> Ordered<MutexGuard<'_, GrantTable>> {
        Ordered::take(Rank::Grants, || self.inner.grants.lock())
    }

    /// Holds the lock of `rank` until the returned value is dropped (tests: proving that
    /// an operation does not need that lock).
    #[cfg(test)]
    pub(crate) fn hold_for_test(&self, rank: Rank) -> Box<dyn Held + '_> {
        match rank {
            Rank::Init => Box::new(self.init_lock()),
            Rank::Dir => Box::new(self.write()),
            Rank::Grants => Box::new(self.grants()),
            Rank::Timers => Box::new(self.inner.upkeep.timers()),
            Rank::Queues => Box::new(self.inner.queues.lock()),
            Rank::Sessions => Box::new(self.inner.sessions.lock()),
            Rank::Tunables => Box::new(Ordered::take(Rank::Tunables, || self.inner.tun.write())),
            Rank::Devices => self.inner.devices.hold(),
            Rank::Policy => self.inner.policy.hold(),
            Rank::Remote => Box::new(self.remote_cache()),
        }
    }

    /// Walks the directory in chunks of [`WALK_CHUNK`] records under the read lock,
    /// released between chunks, so lookups and writers never wait for a whole walk.
    /// `f` sees each chunk's state and range. Pages may change between chunks: callers
    /// re-check what they act on under the lock that acts.
    pub(super) fn walk_dir(&self, mut f: impl FnMut(&DirState, std::ops::Range<usize>)) {
        let mut start = 0;
        loop {
            let st = self.read();
            let end = st.dir.order().record_slots().min(start + WALK_CHUNK);
            if start >= end {
                return;
            }
            f(&st, start..end);
            start = end;
        }
    }

    /// Eviction candidates of `tier` that `keep` accepts, gathered in chunks (the
    /// directory lock is let go between them).
    pub(super) fn candidates(
        &self,
        tier: TierKind,
        keep: impl Fn(&DirState, PageId, &PageInfo) -> bool,
    ) -> Vec<(PageId, PageInfo)> {
        let mut out = Vec::new();
        self.walk_dir(|st, range| {
            out.extend(
                st.dir
                    .order()
                    .eviction_candidates_in(tier, range)
                    .into_iter()
                    .filter(|(id, i)| keep(st, *id, i)),
            );
        });
        out
    }
}

/// Anything held for its `Drop` (a guard kept alive by a test).
#[cfg(test)]
pub(crate) trait Held {}

#[cfg(test)]
impl<T> Held for T {}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;

    #[test]
    fn taking_locks_in_rank_order_passes_and_out_of_order_panics() {
        let (a, b) = (Mutex::new(1), Mutex::new(2));
        {
            let ga = Ordered::take(Rank::Dir, || a.lock());
            let gb = Ordered::take(Rank::Grants, || b.lock());
            assert_eq!(*ga + *gb, 3);
        }
        // Both released: the marks are cleared, so the same order works again.
        let gb = Ordered::take(Rank::Grants, || b.lock());
        let wrong = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ga = Ordered::take(Rank::Dir, || a.lock());
        }));
        assert!(wrong.is_err(), "Dir after Grants must be refused");
        drop(gb);
        let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _gb = Ordered::take(Rank::Grants, || b.lock());
            let _gb2 = Ordered::take(Rank::Grants, || a.lock());
        }));
        assert!(again.is_err(), "two locks of one rank must be refused");
    }
}
