//! The local pool's index: which object each pool slot holds, found by key, in LRU order.
//!
//! Every pool slot holds at most one object, so the index is a table with one record per
//! slot (the object's key, length, readers and its place in the LRU list) and a hash
//! index from the key's 64-bit hash to the slot (the directory's open-addressing index,
//! whose 32-bit tags tolerate collisions: a match is confirmed on the stored key). The
//! LRU order is a doubly linked list threaded through the records. Nothing here allocates
//! per object once a slot has held a key of the same length: a put copies the key into
//! the slot's own buffer, a get moves the record to the list's tail, an eviction hands
//! the key's buffer over to the evicted log. The key hashes are computed by the caller
//! before it takes the lock ([`key_hash`]).
//!
//! The replaced design (a `HashMap<Arc<str>, _>` with SipHash and a `BTreeMap` for the
//! LRU order) allocated a key and hashed its string twice per object under the lock;
//! at 64 KiB objects that showed as a tenth of a host→pool batch.

use std::collections::VecDeque;

use crate::directory::index::PageIndex;
use crate::tier::host::SlotId;

use super::slots::SlotTable;

/// Keys evicted by the pool are kept for the manager until taken, up to this many; beyond
/// that the oldest are dropped and the overflow flag says a resync is due.
const EVICTED_LOG_MAX: usize = 1 << 20;

/// No slot (the end of the LRU list).
const NIL: u32 = u32::MAX;

/// The 64-bit hash of a key, as the index files it. Cheap enough to take per object,
/// and taken outside the lock.
pub(super) fn key_hash(key: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key.as_bytes())
}

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not in the index: free, or reserved by a put that has not published it yet.
    Unindexed,
    /// The object of its key.
    Live,
    /// Removed or replaced while readers copy out of it; freed when the last one leaves.
    Draining,
}

#[derive(Debug)]
struct Record {
    /// The key (valid while `Live`); its buffer is reused by the next object in the slot.
    key: String,
    hash: u64,
    len: usize,
    /// Readers copying out of the slot right now; it is not reused until they leave.
    readers: u32,
    state: State,
    /// Neighbours in the LRU list (towards the least and the most recently used).
    prev: u32,
    next: u32,
}

impl Default for Record {
    fn default() -> Self {
        Self {
            key: String::new(),
            hash: 0,
            len: 0,
            readers: 0,
            state: State::Unindexed,
            prev: NIL,
            next: NIL,
        }
    }
}

/// Whether a slot, let go by the index, may go back to the free list now.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Freed {
    /// Free it.
    Now,
    /// A reader still copies out of it; the last reader's [`Index::unfence`] frees it.
    Later,
}

/// The index of the local pool; the pool keeps it behind one mutex.
#[derive(Debug, Default)]
pub(super) struct Index {
    table: PageIndex,
    records: Vec<Record>,
    /// Least recently used live object, and most recently used.
    head: u32,
    tail: u32,
    live: usize,
    used_bytes: u64,
    evicted: VecDeque<String>,
    overflow: bool,
    /// The persistent record of each slot's object, written in step with the index.
    slots: Option<SlotTable>,
}

impl Index {
    /// An index for a pool of `slots` slots.
    pub fn new(slots: u32) -> Self {
        let mut records = Vec::new();
        records.resize_with(slots as usize, Record::default);
        Self {
            records,
            head: NIL,
            tail: NIL,
            ..Self::default()
        }
    }

    /// Keeps every slot's object in `table` from now on ([`SlotTable`]).
    pub fn attach(&mut self, table: SlotTable) {
        self.slots = Some(table);
    }

    /// Objects whose key was too long for the slot table (lost on a restart).
    pub fn unrecorded(&self) -> u64 {
        self.slots.as_ref().map_or(0, |t| t.unrecorded)
    }

    /// Objects in the index.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    fn find(&self, key: &str, hash: u64) -> Option<u32> {
        self.table.find(hash, |s| {
            let r = &self.records[s as usize];
            r.hash == hash && r.key == key
        })
    }

    /// Whether `key` (hashed by [`key_hash`]) is in the pool.
    pub fn contains(&self, key: &str, hash: u64) -> bool {
        self.find(key, hash).is_some()
    }

    fn unlink_lru(&mut self, s: u32) {
        let (prev, next) = {
            let r = &self.records[s as usize];
            (r.prev, r.next)
        };
        match prev {
            NIL => self.head = next,
            p => self.records[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.records[n as usize].prev = prev,
        }
    }

    fn push_lru(&mut self, s: u32) {
        let tail = self.tail;
        {
            let r = &mut self.records[s as usize];
            r.prev = tail;
            r.next = NIL;
        }
        match tail {
            NIL => self.head = s,
            t => self.records[t as usize].next = s,
        }
        self.tail = s;
    }

    /// Takes the live object in slot `s` out of the index and the LRU order.
    fn drop_live(&mut self, s: u32) -> Freed {
        self.unlink_lru(s);
        if let Some(t) = self.slots.as_mut() {
            t.clear(s);
        }
        let r = &mut self.records[s as usize];
        let hash = r.hash;
        self.used_bytes -= r.len as u64;
        self.live -= 1;
        let freed = if r.readers > 0 {
            r.state = State::Draining;
            Freed::Later
        } else {
            r.state = State::Unindexed;
            Freed::Now
        };
        self.table.remove(hash, s);
        freed
    }

    /// Removes `key`. `None` when it is not in the pool; otherwise its slot and whether
    /// the slot may be freed now.
    pub fn remove(&mut self, key: &str, hash: u64) -> Option<(SlotId, Freed)> {
        let s = self.find(key, hash)?;
        Some((SlotId(s), self.drop_live(s)))
    }

    /// Evicts the least recently used object that no reader holds, logs its key for
    /// [`Self::take_evicted`], and returns its slot (free to reuse at once).
    pub fn evict_lru(&mut self) -> Option<SlotId> {
        let mut s = self.head;
        while s != NIL && self.records[s as usize].readers > 0 {
            s = self.records[s as usize].next;
        }
        if s == NIL {
            return None;
        }
        let freed = self.drop_live(s);
        debug_assert_eq!(freed, Freed::Now, "an idle object frees its slot at once");
        if self.evicted.len() >= EVICTED_LOG_MAX {
            self.evicted.pop_front();
            self.overflow = true;
        }
        // The key's buffer goes to the log; the slot's next key gets a fresh one.
        let key = std::mem::take(&mut self.records[s as usize].key);
        self.evicted.push_back(key);
        Some(SlotId(s))
    }

    /// Makes a written slot the object of `key`, replacing any older one. Returns the
    /// older object's slot when it may be freed now (one still being read is freed by its
    /// last reader). The new slot's record is written before the old one's is cleared, so
    /// a crash between the two keeps one of them.
    ///
    /// The key comes owned, built by the caller before it took the index lock: a slot
    /// whose object was evicted has lent its key's buffer to the evicted log, so copying
    /// the key in here would allocate under the lock, on every put into a full pool.
    pub fn publish(&mut self, key: String, hash: u64, slot: SlotId, len: usize) -> Option<SlotId> {
        if let Some(t) = self.slots.as_mut() {
            t.set(slot.0, &key, len);
        }
        self.restore(key, hash, slot, len)
    }

    /// [`Self::publish`] without writing the slot table: an object read back from it.
    pub fn restore(&mut self, key: String, hash: u64, slot: SlotId, len: usize) -> Option<SlotId> {
        let old = self
            .find(&key, hash)
            .filter(|&s| s != slot.0)
            .and_then(|s| (self.drop_live(s) == Freed::Now).then_some(SlotId(s)));
        let s = slot.0;
        if s as usize >= self.records.len() {
            self.records.resize_with(s as usize + 1, Record::default);
        }
        let r = &mut self.records[s as usize];
        debug_assert_eq!(r.state, State::Unindexed, "a put publishes only a slot it reserved");
        r.key = key;
        r.hash = hash;
        r.len = len;
        r.readers = 0;
        r.state = State::Live;
        self.push_lru(s);
        self.table.insert(hash, s);
        self.used_bytes += len as u64;
        self.live += 1;
        old
    }

    /// Fences `key`'s slot for reading into a buffer of `room` bytes and marks it the
    /// most recently used. Returns the slot and the object's length.
    pub fn fence(&mut self, key: &str, hash: u64, room: usize) -> Result<(SlotId, usize), super::PoolError> {
        let s = self.find(key, hash).ok_or(super::PoolError::NotFound)?;
        let len = self.records[s as usize].len;
        if room < len {
            return Err(super::PoolError::BufferTooSmall { got: room, need: len });
        }
        self.records[s as usize].readers += 1;
        self.unlink_lru(s);
        self.push_lru(s);
        Ok((SlotId(s), len))
    }

    /// Drops a reader fence taken by [`Self::fence`]. Returns the slot when it was the
    /// last reader of an object removed meanwhile, so the slot may be freed now.
    pub fn unfence(&mut self, slot: SlotId) -> Option<SlotId> {
        let r = self.records.get_mut(slot.0 as usize)?;
        r.readers = r.readers.saturating_sub(1);
        if r.readers == 0 && r.state == State::Draining {
            r.state = State::Unindexed;
            return Some(slot);
        }
        None
    }

    /// Whether evicted keys were lost because nobody took them in time.
    pub fn overflowed(&self) -> bool {
        self.overflow
    }

    /// Keys evicted since the last call, oldest first.
    pub fn take_evicted(&mut self) -> Vec<String> {
        self.overflow = false;
        std::mem::take(&mut self.evicted).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(ix: &mut Index, key: &str, slot: u32, len: usize) -> Option<SlotId> {
        ix.publish(key.to_owned(), key_hash(key), SlotId(slot), len)
    }

    #[test]
    fn lru_order_follows_puts_and_reads_and_skips_held_slots() {
        let mut ix = Index::new(4);
        for (i, k) in ["a", "b", "c", "d"].iter().enumerate() {
            assert_eq!(put(&mut ix, k, i as u32, 10 + i), None);
        }
        assert_eq!((ix.len(), ix.used_bytes()), (4, 10 + 11 + 12 + 13));
        // Read "a": "b" becomes the least recently used; hold "b" with a reader, so the
        // first eviction takes "c".
        let (sa, la) = ix.fence("a", key_hash("a"), 64).unwrap();
        assert_eq!((sa, la), (SlotId(0), 10));
        assert_eq!(ix.unfence(sa), None);
        let (sb, _) = ix.fence("b", key_hash("b"), 64).unwrap();
        assert_eq!(ix.evict_lru(), Some(SlotId(2)));
        assert_eq!(ix.evict_lru(), Some(SlotId(3)));
        assert_eq!(ix.evict_lru(), Some(SlotId(0)));
        assert_eq!(ix.evict_lru(), None, "the only object left is being read");
        assert_eq!(ix.take_evicted(), vec!["c".to_string(), "d".into(), "a".into()]);
        assert_eq!(ix.unfence(sb), None, "still live: the slot stays the object's");
        assert_eq!(ix.evict_lru(), Some(SlotId(1)));
        assert_eq!((ix.len(), ix.used_bytes()), (0, 0));
    }

    #[test]
    fn replacing_or_removing_a_read_object_frees_its_slot_after_the_last_reader() {
        let mut ix = Index::new(4);
        assert_eq!(put(&mut ix, "k", 0, 8), None);
        let (s, _) = ix.fence("k", key_hash("k"), 8).unwrap();
        let (s2, _) = ix.fence("k", key_hash("k"), 8).unwrap();
        assert_eq!(s, s2);
        // Replaced while two readers hold slot 0: the new object lives in slot 1, slot 0
        // drains.
        assert_eq!(put(&mut ix, "k", 1, 9), None);
        assert_eq!(ix.fence("k", key_hash("k"), 64), Ok((SlotId(1), 9)));
        assert_eq!(ix.unfence(SlotId(1)), None);
        assert_eq!(ix.unfence(s), None);
        assert_eq!(ix.unfence(s), Some(SlotId(0)), "the last reader frees it");
        // Removing an idle object frees at once.
        assert_eq!(ix.remove("k", key_hash("k")), Some((SlotId(1), Freed::Now)));
        assert_eq!(ix.remove("k", key_hash("k")), None);
        assert!(!ix.contains("k", key_hash("k")));
        assert_eq!(ix.fence("k", key_hash("k"), 8), Err(super::super::PoolError::NotFound));
    }

    #[test]
    fn keys_whose_hashes_collide_stay_apart() {
        let mut ix = Index::new(2);
        // Same hash, different keys: the stored key decides.
        assert_eq!(ix.publish("x".into(), 42, SlotId(0), 1), None);
        assert_eq!(ix.publish("y".into(), 42, SlotId(1), 2), None);
        assert_eq!(ix.fence("x", 42, 8), Ok((SlotId(0), 1)));
        assert_eq!(ix.fence("y", 42, 8), Ok((SlotId(1), 2)));
        assert!(!ix.contains("z", 42));
    }
}
