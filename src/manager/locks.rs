//! The manager's locks and the one order they nest in.
//!
//! The manager's state is split by who touches it (see docs/ARCHITECTURE.md, "Locks"):
//! the directory behind a read-mostly lock, the grant table, the timer heap, the advice
//! and deferred-hint queues, the session table, the tunables and the device maps each
//! behind their own. Every lock has a [`Rank`]; a thread may only take a lock whose rank
//! is above every rank it already holds. `Manager`'s lock helpers (`read`, `write`,
//! `grants`, …) are the only way the manager takes these locks, and in test builds each
//! helper checks the rule on the calling thread, so an out-of-order nesting fails the
//! first test that reaches it instead of deadlocking one day in production.

use std::ops::{Deref, DerefMut};

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
}

#[cfg(test)]
thread_local! {
    /// Ranks of the manager locks this thread holds, one bit each.
    static HELD: std::cell::Cell<u16> = const { std::cell::Cell::new(0) };
}

/// A lock guard that knows its rank. In test builds, creating one asserts that the thread
/// holds no lock of the same or a later rank, and dropping it clears the mark.
pub(crate) struct Ordered<G> {
    guard: G,
    #[cfg(test)]
    rank: Rank,
}

impl<G> Ordered<G> {
    /// Takes a lock of rank `rank` through `take`, after checking the order (tests).
    pub(crate) fn take(rank: Rank, take: impl FnOnce() -> G) -> Self {
        #[cfg(test)]
        HELD.with(|held| {
            let h = held.get();
            assert!(
                h >> rank as u16 == 0,
                "lock order violated: taking {rank:?} while holding ranks {h:#b}"
            );
            held.set(h | 1 << rank as u16);
        });
        #[cfg(not(test))]
        let _ = rank;
        Self {
            guard: take(),
            #[cfg(test)]
            rank,
        }
    }
}

impl<G> Drop for Ordered<G> {
    fn drop(&mut self) {
        #[cfg(test)]
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
