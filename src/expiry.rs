//! One expiry heap: keys with a deadline each, earliest first, for everything in the core
//! that ends at a time (the directory's protection of staged pages, the manager's pins and
//! retains).
//!
//! The map holds the one live deadline (and a value) of each key; the heap holds every
//! deadline ever scheduled. Replacing a key's deadline pushes a new entry and leaves the
//! old one behind; an entry whose deadline no longer matches the map is stale and is
//! skipped when it reaches the top (lazy invalidation). Taking k due keys costs
//! O(k log n) instead of a scan, and the earliest deadline is a peek, so upkeep can sleep
//! until it. Stale entries are bounded: when they outnumber the live ones by more than a
//! margin, the heap is rebuilt from the map (amortised O(1) per push).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;

/// Keys with deadlines (milliseconds on the owner's clock) and a value each.
#[derive(Debug)]
pub struct ExpiryHeap<K, V = ()> {
    live: HashMap<K, (u64, V)>,
    heap: BinaryHeap<Reverse<(u64, K)>>,
}

impl<K, V> Default for ExpiryHeap<K, V> {
    fn default() -> Self {
        Self {
            live: HashMap::new(),
            heap: BinaryHeap::new(),
        }
    }
}

impl<K: Copy + Ord + Hash, V> ExpiryHeap<K, V> {
    /// Sets `key` to expire at `at_ms` with `value`, replacing its deadline and value if
    /// it had one. Returns the old deadline and value.
    pub fn insert(&mut self, key: K, at_ms: u64, value: V) -> Option<(u64, V)> {
        let old = self.live.insert(key, (at_ms, value));
        self.push(at_ms, key);
        old
    }

    /// Moves the deadline of a live `key` to `at_ms`, keeping its value. Returns whether
    /// the key was live.
    pub fn reschedule(&mut self, key: K, at_ms: u64) -> bool {
        match self.live.get_mut(&key) {
            Some(e) => {
                e.0 = at_ms;
                self.push(at_ms, key);
                true
            }
            None => false,
        }
    }

    /// The live deadline and value of `key`.
    pub fn get(&self, key: &K) -> Option<&(u64, V)> {
        self.live.get(key)
    }

    /// Whether `key` has a live deadline.
    pub fn contains(&self, key: &K) -> bool {
        self.live.contains_key(key)
    }

    /// Cancels `key`'s deadline. Its heap entries become stale.
    pub fn remove(&mut self, key: &K) -> Option<(u64, V)> {
        let out = self.live.remove(key);
        if self.live.is_empty() {
            self.heap.clear();
        }
        out
    }

    /// Live keys.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no key is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// The earliest deadline in the heap without dropping stale entries: early (a stale
    /// entry's), never late.
    pub fn peek_deadline(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// The earliest live deadline. Drops the stale entries it finds on top.
    pub fn next_deadline(&mut self) -> Option<u64> {
        while let Some(&Reverse((at, key))) = self.heap.peek() {
            if self.live.get(&key).map(|e| e.0) == Some(at) {
                return Some(at);
            }
            self.heap.pop();
        }
        None
    }

    /// Removes and returns the next key due at `now_ms` (earliest first), with its
    /// deadline and value; `None` when nothing is due.
    pub fn pop_due(&mut self, now_ms: u64) -> Option<(K, u64, V)> {
        while let Some(&Reverse((at, key))) = self.heap.peek() {
            if at > now_ms {
                return None;
            }
            self.heap.pop();
            if self.live.get(&key).map(|e| e.0) == Some(at) {
                let (at, value) = self.live.remove(&key)?;
                if self.live.is_empty() {
                    self.heap.clear();
                }
                return Some((key, at, value));
            }
        }
        None
    }

    /// Heap entries, live and stale (the heap stays bounded).
    pub fn heap_len(&self) -> usize {
        self.heap.len()
    }

    fn push(&mut self, at_ms: u64, key: K) {
        self.heap.push(Reverse((at_ms, key)));
        if self.heap.len() > 2 * self.live.len() + 64 {
            self.heap = self.live.iter().map(|(&k, e)| Reverse((e.0, k))).collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_due_earliest_first_and_stale_entries_are_skipped() {
        let mut h: ExpiryHeap<u32, &str> = ExpiryHeap::default();
        assert_eq!(h.insert(1, 30, "a"), None);
        h.insert(2, 10, "b");
        h.insert(3, 20, "c");
        // Moved later: its entry at 10 is stale.
        assert!(h.reschedule(2, 40));
        assert!(!h.reschedule(9, 5));
        assert_eq!(h.peek_deadline(), Some(10), "a peek may be early");
        assert_eq!(h.next_deadline(), Some(20));
        h.remove(&3);
        assert_eq!(h.pop_due(25), None, "3 was cancelled, 1 is not due");
        assert_eq!(h.pop_due(35), Some((1, 30, "a")));
        assert_eq!(h.pop_due(35), None);
        assert_eq!(h.get(&2), Some(&(40, "b")));
        assert_eq!(h.pop_due(u64::MAX), Some((2, 40, "b")));
        assert!(h.is_empty());
        assert_eq!(h.heap_len(), 0, "an empty heap keeps nothing stale");
    }

    #[test]
    fn a_key_rescheduled_again_and_again_keeps_the_heap_bounded() {
        let mut h: ExpiryHeap<u32> = ExpiryHeap::default();
        h.insert(7, 1, ());
        for at in 2..100_000 {
            h.reschedule(7, at);
        }
        assert!(h.heap_len() <= 2 + 64, "heap of {} entries for one key", h.heap_len());
        assert_eq!(h.next_deadline(), Some(99_999));
        assert_eq!(h.len(), 1);
    }
}
