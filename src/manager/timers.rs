//! Pin and retain expiries, in the core's one expiry heap (`crate::expiry`).
//!
//! Each pin (page, tier) and retain (page) has one live expiry, with the hash of the page
//! it was set on; a re-pin that extends a TTL moves the deadline, a retain replaces it.
//! Expiring k items costs O(k log n), and the earliest deadline is a peek, so upkeep can
//! sleep until it. Live pins are counted per tier, so the pin budget and stats are O(1).

use crate::expiry::ExpiryHeap;
use crate::page::PageHash;
use crate::tier::TierKind;

/// What an expiry refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum TimerKey {
    /// A pin of page (record index) in tier (index).
    Pin(u32, u8),
    /// A retain priority of page (record index).
    Retain(u32),
}

/// A live expiry: when, and the hash of the page it was set on (a record index may be
/// reused by another page by the time it expires).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Expiry {
    pub at_ms: u64,
    pub hash: PageHash,
}

/// Pins and retains with their expiries.
#[derive(Debug, Default)]
pub(crate) struct Timers {
    expiries: ExpiryHeap<TimerKey, PageHash>,
    /// Live pins per tier.
    pinned: [usize; 3],
}

impl Timers {
    /// Pins `page` in `tier` until `at_ms`, or extends an existing pin to the later of
    /// its expiry and `at_ms`. Returns whether the pin is new.
    pub fn pin(&mut self, page: u32, tier: TierKind, hash: PageHash, at_ms: u64) -> bool {
        let key = TimerKey::Pin(page, tier as u8);
        match self.expiries.get(&key) {
            Some(&(at, _)) if at >= at_ms => false,
            Some(_) => {
                self.expiries.reschedule(key, at_ms);
                false
            }
            None => {
                self.expiries.insert(key, at_ms, hash);
                self.pinned[tier.index()] += 1;
                true
            }
        }
    }

    /// Whether `page` has a live pin in `tier`.
    pub fn is_pinned(&self, page: u32, tier: TierKind) -> bool {
        self.expiries.contains(&TimerKey::Pin(page, tier as u8))
    }

    /// Sets (replaces) the retain expiry of `page`.
    pub fn retain(&mut self, page: u32, hash: PageHash, at_ms: u64) {
        self.expiries.insert(TimerKey::Retain(page), at_ms, hash);
    }

    /// Live pins in `tier`.
    pub fn pins_in(&self, tier: TierKind) -> usize {
        self.pinned[tier.index()]
    }

    /// The earliest live expiry, if any.
    pub fn next_deadline(&mut self) -> Option<u64> {
        self.expiries.next_deadline()
    }

    /// Removes and returns every pin and retain due at `now_ms`, earliest first.
    pub fn expire(&mut self, now_ms: u64) -> Vec<(TimerKey, Expiry)> {
        let mut out = Vec::new();
        while let Some((key, at_ms, hash)) = self.expiries.pop_due(now_ms) {
            if let TimerKey::Pin(_, t) = key {
                self.pinned[usize::from(t)] -= 1;
            }
            out.push((key, Expiry { at_ms, hash }));
        }
        out
    }

    /// Heap entries, live and stale (tests: the heap stays bounded).
    #[cfg(test)]
    pub fn heap_len(&self) -> usize {
        self.expiries.heap_len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u64) -> PageHash {
        PageHash::from_u64(i)
    }

    #[test]
    fn expiries_come_out_earliest_first_and_only_when_due() {
        let mut t = Timers::default();
        assert!(t.pin(1, TierKind::Host, h(1), 300));
        assert!(t.pin(2, TierKind::Host, h(2), 100));
        t.retain(3, h(3), 200);
        assert!(t.pin(4, TierKind::Pool, h(4), 250));
        assert_eq!(t.next_deadline(), Some(100));
        assert_eq!((t.pins_in(TierKind::Host), t.pins_in(TierKind::Pool)), (2, 1));
        assert!(t.expire(99).is_empty());
        let got: Vec<_> = t.expire(260).into_iter().map(|(k, e)| (k, e.at_ms, e.hash)).collect();
        assert_eq!(
            got,
            vec![
                (TimerKey::Pin(2, TierKind::Host as u8), 100, h(2)),
                (TimerKey::Retain(3), 200, h(3)),
                (TimerKey::Pin(4, TierKind::Pool as u8), 250, h(4)),
            ]
        );
        assert_eq!((t.pins_in(TierKind::Host), t.pins_in(TierKind::Pool)), (1, 0));
        assert_eq!(t.next_deadline(), Some(300));
        assert!(t.is_pinned(1, TierKind::Host) && !t.is_pinned(2, TierKind::Host));
    }

    #[test]
    fn repin_extends_a_ttl_and_never_shortens_it() {
        let mut t = Timers::default();
        assert!(t.pin(7, TierKind::Host, h(7), 100));
        assert!(!t.pin(7, TierKind::Host, h(7), 500), "an extension is not a new pin");
        assert!(
            !t.pin(7, TierKind::Host, h(7), 200),
            "a shorter TTL does not shorten it"
        );
        assert_eq!(t.pins_in(TierKind::Host), 1);
        // The entry for 100 is stale now: nothing is due at 100 or at 499.
        assert_eq!(t.next_deadline(), Some(500));
        assert!(t.expire(499).is_empty());
        assert!(t.is_pinned(7, TierKind::Host));
        let got = t.expire(500);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1.at_ms, 500);
        assert_eq!(t.pins_in(TierKind::Host), 0);
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn a_retain_is_replaced_not_extended() {
        let mut t = Timers::default();
        t.retain(1, h(1), 900);
        t.retain(1, h(1), 300);
        assert_eq!(t.next_deadline(), Some(300));
        assert_eq!(t.expire(300).len(), 1);
        assert!(t.expire(1000).is_empty(), "the replaced expiry at 900 is stale");
    }

    #[test]
    fn stale_entries_are_bounded() {
        let mut t = Timers::default();
        for at in 1..=10_000u64 {
            t.pin(1, TierKind::Host, h(1), at);
        }
        assert!(t.heap_len() <= 2 + 64 + 1, "heap holds {} entries", t.heap_len());
        assert_eq!(t.next_deadline(), Some(10_000));
    }
}
