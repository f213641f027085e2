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
//! Prefix lookups take none of these locks: `Pages::lookup` (`pages.rs`) reads the
//! directory's lock-free view (`directory/view.rs`), which the directory's writer keeps
//! current under the `Dir` write lock, so a store or an eviction round never delays one.

use std::ops::{Deref, DerefMut};

use parking_lot::{MutexGuard, RwLockReadGuard};

use super::Manager;
use super::grants::GrantTable;
use super::state::{DirState, DirWrite};

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

// The lock helpers, one per lock, in rank order. Nothing else takes these locks.
impl Manager {
    /// Shared access to the directory state: readers other than prefix lookups.
    pub(super) fn read(&self) -> Ordered<RwLockReadGuard<'_, DirState>> {
        self.inner.pages.read()
    }

    /// Exclusive access to the directory state; publishes its events when dropped.
    pub(super) fn write(&self) -> DirWrite<'_> {
        self.inner.pages.write()
    }

    pub(super) fn grants(&self) -> Ordered<MutexGuard<'_, GrantTable>> {
        self.inner.grants.lock()
    }

    /// Holds the lock of `rank` until the returned value is dropped (tests: proving that
    /// an operation does not need that lock).
    #[cfg(test)]
    pub(crate) fn hold_for_test(&self, rank: Rank) -> Box<dyn Held + '_> {
        match rank {
            Rank::Init => self.inner.stores.hold(),
            Rank::Dir => Box::new(self.write()),
            Rank::Grants => Box::new(self.grants()),
            Rank::Timers => Box::new(self.inner.upkeep.timers()),
            Rank::Queues => Box::new(self.inner.queues.lock()),
            Rank::Sessions => Box::new(self.inner.sessions.lock()),
            Rank::Tunables => Box::new(self.inner.tun.hold()),
            Rank::Devices => self.inner.devices.hold(),
            Rank::Policy => self.inner.policy.hold(),
            Rank::Remote => Box::new(self.discovery().cache()),
        }
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
