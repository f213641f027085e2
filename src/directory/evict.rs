//! Eviction order kept as it changes, so victims come out without a scan.
//!
//! Per evictable tier (host, pool) there is one intrusive doubly linked list per eviction
//! bucket, threaded through the directory's record slots by index (`prev`/`next` arrays
//! beside the 56-byte records, which stay as they are). A bucket is (idle-session class,
//! retain priority): idle sessions' pages first, then retain -128 up to 127. Within a
//! bucket the list is in the order pages entered it or were last touched (a touch moves a
//! page to the tail), so the head is the least recently used. A bitmap of non-empty
//! buckets finds the first victim in eight word tests. A page is linked in a tier's lists
//! exactly while it is complete there, not pinned there, not in flight anywhere and not
//! protected; every directory call that changes one of those relinks the page in O(1).
//!
//! Why lists and not CLOCK or S3-FIFO: the order is not recency alone but classes first
//! (idle sessions, retain priority) and recency within them; exact per-class LRU falls
//! out of one list per class, and the victim walk is a read-only pointer chase that can
//! run under the directory's read lock. CLOCK would need a sweep past protected classes,
//! and S3-FIFO's ghost queue answers a question (admission) the directory does not ask.

/// No record: the end of a list.
pub(super) const NIL: u32 = u32::MAX;
/// Not in any list.
const UNLINKED: u16 = u16::MAX;
/// Retain levels (i8).
const LEVELS: usize = 256;
/// Buckets per tier: idle-session pages by retain, then the others by retain.
const BUCKETS: usize = 2 * LEVELS;

/// The bucket of a page: idle-session pages before all others, then low retain first.
pub(super) fn bucket(idle: bool, retain: i8) -> u16 {
    (usize::from(!idle) * LEVELS + (retain as i16 + 128) as usize) as u16
}

/// One tier's lists.
#[derive(Debug)]
pub(super) struct Lists {
    prev: Vec<u32>,
    next: Vec<u32>,
    bucket: Vec<u16>,
    head: Box<[u32]>,
    tail: Box<[u32]>,
    nonempty: [u64; BUCKETS / 64],
    len: usize,
}

impl Default for Lists {
    fn default() -> Self {
        Self {
            prev: Vec::new(),
            next: Vec::new(),
            bucket: Vec::new(),
            head: vec![NIL; BUCKETS].into_boxed_slice(),
            tail: vec![NIL; BUCKETS].into_boxed_slice(),
            nonempty: [0; BUCKETS / 64],
            len: 0,
        }
    }
}

impl Lists {
    /// Makes room for record slot `i`.
    pub fn ensure(&mut self, slots: usize) {
        if self.bucket.len() < slots {
            self.prev.resize(slots, NIL);
            self.next.resize(slots, NIL);
            self.bucket.resize(slots, UNLINKED);
        }
    }

    /// The bucket slot `i` is linked in, if any.
    pub fn bucket_of(&self, i: u32) -> Option<u16> {
        match self.bucket.get(i as usize) {
            Some(&b) if b != UNLINKED => Some(b),
            _ => None,
        }
    }

    /// Pages linked (evictable in this tier).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Appends slot `i` (not linked) at the tail of bucket `b`.
    pub fn push_back(&mut self, i: u32, b: u16) {
        self.ensure(i as usize + 1);
        let bi = b as usize;
        let t = self.tail[bi];
        self.prev[i as usize] = t;
        self.next[i as usize] = NIL;
        if t == NIL {
            self.head[bi] = i;
            self.nonempty[bi / 64] |= 1 << (bi % 64);
        } else {
            self.next[t as usize] = i;
        }
        self.tail[bi] = i;
        self.bucket[i as usize] = b;
        self.len += 1;
    }

    /// Puts slot `i` (not linked) at the head of bucket `b`: the next victim of it.
    pub fn push_front(&mut self, i: u32, b: u16) {
        self.ensure(i as usize + 1);
        let bi = b as usize;
        let h = self.head[bi];
        self.prev[i as usize] = NIL;
        self.next[i as usize] = h;
        if h == NIL {
            self.tail[bi] = i;
            self.nonempty[bi / 64] |= 1 << (bi % 64);
        } else {
            self.prev[h as usize] = i;
        }
        self.head[bi] = i;
        self.bucket[i as usize] = b;
        self.len += 1;
    }

    /// Takes slot `i` out of its list, if it is in one.
    pub fn unlink(&mut self, i: u32) {
        let Some(b) = self.bucket_of(i) else { return };
        let bi = b as usize;
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            self.head[bi] = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail[bi] = p;
        } else {
            self.prev[n as usize] = p;
        }
        if self.head[bi] == NIL {
            self.nonempty[bi / 64] &= !(1 << (bi % 64));
        }
        self.prev[i as usize] = NIL;
        self.next[i as usize] = NIL;
        self.bucket[i as usize] = UNLINKED;
        self.len -= 1;
    }

    /// The first non-empty bucket at or after `from`.
    fn first_bucket(&self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        if w >= self.nonempty.len() {
            return None;
        }
        let mut bits = self.nonempty[w] & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w >= self.nonempty.len() {
                return None;
            }
            bits = self.nonempty[w];
        }
    }

    /// Slots in eviction order: buckets in order, each from head (least recently used)
    /// to tail. Lazy: taking `k` items costs O(k) plus at most eight bitmap words.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut b = self.first_bucket(0);
        let mut cur = b.map_or(NIL, |b| self.head[b]);
        std::iter::from_fn(move || {
            while cur == NIL {
                b = self.first_bucket(b? + 1);
                cur = self.head[b?];
            }
            let out = cur;
            cur = self.next[cur as usize];
            Some(out)
        })
    }

    /// Heap bytes of the per-slot arrays.
    pub fn heap_bytes(&self) -> usize {
        self.prev.capacity() * 4 + self.next.capacity() * 4 + self.bucket.capacity() * 2 + BUCKETS * 8
    }
}

/// Pages of one session, threaded through the record slots like [`Lists`], so a session
/// changing class touches only its own pages.
#[derive(Debug, Default)]
pub(super) struct SessionLists {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Session → (head, pages).
    heads: std::collections::HashMap<u32, (u32, usize)>,
}

impl SessionLists {
    fn ensure(&mut self, slots: usize) {
        if self.prev.len() < slots {
            self.prev.resize(slots, NIL);
            self.next.resize(slots, NIL);
        }
    }

    /// Adds slot `i` to `session`'s pages (at the head; order does not matter here).
    pub fn add(&mut self, session: u32, i: u32) {
        if session == 0 {
            return;
        }
        self.ensure(i as usize + 1);
        let e = self.heads.entry(session).or_insert((NIL, 0));
        let h = e.0;
        self.prev[i as usize] = NIL;
        self.next[i as usize] = h;
        if h != NIL {
            self.prev[h as usize] = i;
        }
        *e = (i, e.1 + 1);
    }

    /// Removes slot `i` from `session`'s pages (it must be there).
    pub fn remove(&mut self, session: u32, i: u32) {
        if session == 0 {
            return;
        }
        let Some(e) = self.heads.get_mut(&session) else { return };
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p == NIL {
            e.0 = n;
        } else {
            self.next[p as usize] = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        }
        e.1 -= 1;
        if e.1 == 0 {
            self.heads.remove(&session);
        }
        self.prev[i as usize] = NIL;
        self.next[i as usize] = NIL;
    }

    /// The slots of `session`'s pages: O(pages of the session).
    pub fn pages(&self, session: u32) -> Vec<u32> {
        let Some(&(mut cur, n)) = self.heads.get(&session) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(n);
        while cur != NIL {
            out.push(cur);
            cur = self.next[cur as usize];
        }
        out
    }

    pub fn heap_bytes(&self) -> usize {
        self.prev.capacity() * 4 + self.next.capacity() * 4 + self.heads.capacity() * 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_yield_buckets_in_order_and_lru_within() {
        let mut l = Lists::default();
        l.push_back(5, bucket(false, 0));
        l.push_back(2, bucket(true, 3));
        l.push_back(9, bucket(false, -1));
        l.push_back(7, bucket(false, 0));
        l.push_back(1, bucket(true, 3));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![2, 1, 9, 5, 7]);
        // A touch: to the tail of its bucket.
        l.unlink(5);
        l.push_back(5, bucket(false, 0));
        l.unlink(2);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 9, 7, 5]);
        l.unlink(7);
        l.push_front(7, bucket(false, 0));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 9, 7, 5]);
        l.unlink(5);
        l.push_front(5, bucket(false, 0));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 9, 5, 7]);
        assert_eq!(l.len(), 4);
        for i in [1, 9, 7, 5] {
            l.unlink(i);
        }
        assert_eq!(l.iter().count(), 0);
        assert_eq!(l.first_bucket(0), None);
        l.unlink(5);
        assert_eq!(l.len(), 0);
    }

    #[test]
    fn session_lists_hold_exactly_their_pages() {
        let mut s = SessionLists::default();
        for i in 0..10 {
            s.add(1 + i % 2, i);
        }
        s.remove(1, 4);
        s.remove(2, 9);
        let mut a = s.pages(1);
        a.sort();
        assert_eq!(a, vec![0, 2, 6, 8]);
        assert_eq!(s.pages(2).len(), 4);
        for i in [1, 3, 5, 7] {
            s.remove(2, i);
        }
        assert!(s.pages(2).is_empty());
        assert!(!s.heads.contains_key(&2));
    }
}
