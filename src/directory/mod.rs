//! The page directory: which objects of which page are present, in flight or missing, in
//! which tier.
//!
//! A page is complete in a tier iff every object its layout requires is present there.
//! The directory emits an event only when that changes (became complete / stopped being
//! complete), each exactly once, numbered in one sequence. It answers contiguous-prefix
//! lookups over a hash sequence with per-tier credit that never counts a page twice.
//!
//! Memory per page is kept small: a fixed 56-byte record, a 4-byte slot in an open
//! addressing index, and side tables only for the rare pages that are partial or in flight.

mod bitset;
pub(crate) mod index;

use serde::Serialize;

pub use bitset::ObjectSet;

use crate::events::{PageEvent, PageEventKind};
use crate::layout::Layout;
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::tier::TierKind;
use index::PageIndex;

const ABSENT: u8 = 0;
const PARTIAL: u8 = 1;
const COMPLETE: u8 = 2;

/// Index of a page's record. Valid while the page has any state in any tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub u32);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DirectoryError {
    #[error("namespace {0:?} is registered with a different layout")]
    LayoutMismatch(Namespace),
    #[error("unknown namespace id {0}")]
    UnknownNamespace(u16),
    #[error("too many namespaces (at most {0})")]
    TooManyNamespaces(usize),
    #[error("object index {index} is outside the page's {count} objects")]
    ObjectOutOfRange { index: usize, count: usize },
    #[error("the directory is full ({0} pages)")]
    Full(usize),
}

/// Per-tier credit of a contiguous-prefix lookup, in pages. Each page is credited to the
/// nearest tier that holds it complete, and only while every earlier page is a hit too:
/// `device + host + pool` is the length of the reusable prefix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefixHit {
    pub device: usize,
    pub host: usize,
    pub pool: usize,
}

impl PrefixHit {
    pub fn total(&self) -> usize {
        self.device + self.host + self.pool
    }

    pub fn get(&self, tier: TierKind) -> usize {
        match tier {
            TierKind::Device => self.device,
            TierKind::Host => self.host,
            TierKind::Pool => self.pool,
        }
    }
}

/// A map keyed by small integers (record indices, tiers): foldhash instead of SipHash,
/// since its keys are not chosen by a client and a move touches several entries per
/// object.
pub(crate) type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The fixed per-page record. Kept at 56 bytes; see `bench index`.
#[derive(Clone, Copy, Debug)]
struct PageRecord {
    hash: PageHash,
    ns: NamespaceId,
    /// Two bits per tier: absent, partial or complete.
    state: u8,
    /// One bit per tier: some object is being written there.
    inflight: u8,
    /// One bit per tier: pinned there (the manager owns the TTLs).
    pinned: u8,
    /// Retention preference: higher is kept longer. 0 is neutral.
    retain: i8,
    /// Saturating hit count, for write-through-selective.
    hits: u8,
    /// Session that last touched the page (0: none).
    session: u32,
    /// Logical access time for LRU ordering.
    last_access: u64,
}

impl PageRecord {
    fn tier_state(&self, tier: TierKind) -> u8 {
        (self.state >> (tier.index() * 2)) & 3
    }

    fn set_tier_state(&mut self, tier: TierKind, s: u8) {
        let shift = tier.index() * 2;
        self.state = (self.state & !(3 << shift)) | (s << shift);
    }

    fn is_empty(&self) -> bool {
        self.state == 0 && self.inflight == 0 && self.pinned == 0
    }
}

/// Public view of one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageInfo {
    pub hash: PageHash,
    pub ns: NamespaceId,
    pub retain: i8,
    pub hits: u8,
    pub session: u32,
    pub last_access: u64,
}

/// The page directory. Not thread-safe by itself: the manager owns it under a lock.
#[derive(Debug, Default)]
pub struct Directory {
    layouts: Vec<(Namespace, Layout)>,
    table: PageIndex,
    records: Vec<PageRecord>,
    live: Vec<bool>,
    free: Vec<u32>,
    partial: IdMap<(u32, u8), ObjectSet>,
    inflight: IdMap<(u32, u8), ObjectSet>,
    pending: Vec<PageEvent>,
    next_seq: u64,
    complete: [usize; 3],
    /// Pages with an entry in `inflight`, per tier (kept as it changes, so stats are O(1)).
    inflight_count: [usize; 3],
    access_clock: u64,
    now_ms: u64,
    max_pages: usize,
}

impl Directory {
    /// A directory that refuses to track more than `max_pages` pages at once.
    pub fn new(max_pages: usize) -> Self {
        Self {
            next_seq: 1,
            max_pages,
            ..Self::default()
        }
    }

    /// Interns a namespace with its layout. Registering the same namespace again with the
    /// same layout returns the same id; with another layout it is an error.
    pub fn register(&mut self, ns: Namespace, layout: Layout) -> Result<NamespaceId, DirectoryError> {
        if let Some(i) = self.layouts.iter().position(|(n, _)| *n == ns) {
            if self.layouts[i].1 != layout {
                return Err(DirectoryError::LayoutMismatch(ns));
            }
            return Ok(NamespaceId(i as u16));
        }
        if self.layouts.len() >= u16::MAX as usize {
            return Err(DirectoryError::TooManyNamespaces(u16::MAX as usize));
        }
        self.layouts.push((ns, layout));
        Ok(NamespaceId(self.layouts.len() as u16 - 1))
    }

    pub fn layout(&self, ns: NamespaceId) -> Result<&Layout, DirectoryError> {
        self.layouts
            .get(ns.0 as usize)
            .map(|(_, l)| l)
            .ok_or(DirectoryError::UnknownNamespace(ns.0))
    }

    pub fn namespace(&self, ns: NamespaceId) -> Option<&Namespace> {
        self.layouts.get(ns.0 as usize).map(|(n, _)| n)
    }

    pub fn namespaces(&self) -> impl Iterator<Item = (NamespaceId, &Namespace, &Layout)> {
        self.layouts
            .iter()
            .enumerate()
            .map(|(i, (n, l))| (NamespaceId(i as u16), n, l))
    }

    /// Sets the time stamped on events from now on.
    pub fn set_now(&mut self, now_ms: u64) {
        self.now_ms = now_ms;
    }

    /// Number of pages with any state.
    pub fn len(&self) -> usize {
        self.records.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pages complete in `tier`.
    pub fn complete_count(&self, tier: TierKind) -> usize {
        self.complete[tier.index()]
    }

    pub fn find(&self, ns: NamespaceId, hash: &PageHash) -> Option<PageId> {
        self.find_hashed(ns, hash, hash.table_hash(ns))
    }

    #[inline]
    fn find_hashed(&self, ns: NamespaceId, hash: &PageHash, h: u64) -> Option<PageId> {
        self.table
            .find(h, |i| {
                let r = &self.records[i as usize];
                r.ns == ns && r.hash == *hash
            })
            .map(PageId)
    }

    /// Finds a page, creating an empty record when it is new.
    pub fn find_or_insert(&mut self, ns: NamespaceId, hash: &PageHash) -> Result<PageId, DirectoryError> {
        self.layout(ns)?;
        if let Some(id) = self.find(ns, hash) {
            return Ok(id);
        }
        if self.len() >= self.max_pages {
            return Err(DirectoryError::Full(self.max_pages));
        }
        let rec = PageRecord {
            hash: *hash,
            ns,
            state: 0,
            inflight: 0,
            pinned: 0,
            retain: 0,
            hits: 0,
            session: 0,
            last_access: 0,
        };
        let idx = match self.free.pop() {
            Some(i) => {
                self.records[i as usize] = rec;
                self.live[i as usize] = true;
                i
            }
            None => {
                self.records.push(rec);
                self.live.push(true);
                self.records.len() as u32 - 1
            }
        };
        self.table.insert(hash.table_hash(ns), idx);
        Ok(PageId(idx))
    }

    pub fn info(&self, id: PageId) -> PageInfo {
        let r = &self.records[id.0 as usize];
        PageInfo {
            hash: r.hash,
            ns: r.ns,
            retain: r.retain,
            hits: r.hits,
            session: r.session,
            last_access: r.last_access,
        }
    }

    pub fn is_complete(&self, id: PageId, tier: TierKind) -> bool {
        self.records[id.0 as usize].tier_state(tier) == COMPLETE
    }

    /// Whether any object of the page is present in `tier`.
    pub fn has_any(&self, id: PageId, tier: TierKind) -> bool {
        self.records[id.0 as usize].tier_state(tier) != ABSENT
    }

    pub fn is_inflight(&self, id: PageId, tier: TierKind) -> bool {
        self.records[id.0 as usize].inflight & (1 << tier.index()) != 0
    }

    pub fn is_pinned(&self, id: PageId, tier: TierKind) -> bool {
        self.records[id.0 as usize].pinned & (1 << tier.index()) != 0
    }

    fn object_count(&self, id: PageId) -> usize {
        let ns = self.records[id.0 as usize].ns;
        self.layouts[ns.0 as usize].1.object_count()
    }

    /// Whether object `index` of the page is present in `tier`.
    pub fn has_object(&self, id: PageId, tier: TierKind, index: usize) -> bool {
        match self.records[id.0 as usize].tier_state(tier) {
            COMPLETE => index < self.object_count(id),
            PARTIAL => self.partial.get(&(id.0, tier as u8)).is_some_and(|s| s.contains(index)),
            _ => false,
        }
    }

    /// Objects of the page that are not present in `tier`, in canonical order.
    pub fn missing_objects(&self, id: PageId, tier: TierKind) -> Vec<usize> {
        let n = self.object_count(id);
        match self.records[id.0 as usize].tier_state(tier) {
            COMPLETE => Vec::new(),
            PARTIAL => match self.partial.get(&(id.0, tier as u8)) {
                Some(s) => (0..n).filter(|&i| !s.contains(i)).collect(),
                None => (0..n).collect(),
            },
            _ => (0..n).collect(),
        }
    }

    /// Pages with at least one object being written into `tier`.
    pub fn inflight_pages(&self, tier: TierKind) -> usize {
        self.inflight_count[tier.index()]
    }

    /// Objects of the page that are being written into `tier`.
    pub fn inflight_objects(&self, id: PageId, tier: TierKind) -> Vec<usize> {
        if !self.is_inflight(id, tier) {
            return Vec::new();
        }
        self.inflight
            .get(&(id.0, tier as u8))
            .map(|s| s.iter().collect())
            .unwrap_or_default()
    }

    /// Whether object `index` of the page is being written into `tier`. Answers from the
    /// record's in-flight bit when the page has nothing in flight there.
    pub fn is_inflight_object(&self, id: PageId, tier: TierKind, index: usize) -> bool {
        self.is_inflight(id, tier)
            && self
                .inflight
                .get(&(id.0, tier as u8))
                .is_some_and(|s| s.contains(index))
    }

    fn check_index(&self, id: PageId, index: usize) -> Result<usize, DirectoryError> {
        let count = self.object_count(id);
        if index >= count {
            return Err(DirectoryError::ObjectOutOfRange { index, count });
        }
        Ok(count)
    }

    /// Marks one object present or gone. Emits `stored` when this completes the page and
    /// `removed` when it breaks a complete page. Returns whether completeness changed.
    pub fn set_object(
        &mut self,
        id: PageId,
        tier: TierKind,
        index: usize,
        present: bool,
    ) -> Result<bool, DirectoryError> {
        let count = self.check_index(id, index)?;
        let key = (id.0, tier as u8);
        let state = self.records[id.0 as usize].tier_state(tier);
        let changed = match (state, present) {
            (COMPLETE, true) | (ABSENT, false) => false,
            (ABSENT, true) => {
                if count == 1 {
                    self.set_state(id, tier, COMPLETE);
                    true
                } else {
                    let mut s = ObjectSet::new(count);
                    s.insert(index);
                    self.partial.insert(key, s);
                    self.set_state(id, tier, PARTIAL);
                    false
                }
            }
            (COMPLETE, false) => {
                if count == 1 {
                    self.set_state(id, tier, ABSENT);
                } else {
                    let mut s = ObjectSet::full(count);
                    s.remove(index);
                    self.partial.insert(key, s);
                    self.set_state(id, tier, PARTIAL);
                }
                true
            }
            (_, true) => {
                let s = self.partial.get_mut(&key).expect("partial pages have a set");
                s.insert(index);
                if s.is_full() {
                    self.partial.remove(&key);
                    self.set_state(id, tier, COMPLETE);
                    true
                } else {
                    false
                }
            }
            (_, false) => {
                let s = self.partial.get_mut(&key).expect("partial pages have a set");
                s.remove(index);
                if s.is_empty() {
                    self.partial.remove(&key);
                    self.set_state(id, tier, ABSENT);
                }
                false
            }
        };
        self.release_if_empty(id);
        Ok(changed)
    }

    /// Marks every object of the page present (`true`) or gone (`false`) in `tier` at once.
    /// Returns whether completeness changed (at most one event).
    pub fn set_page(&mut self, id: PageId, tier: TierKind, present: bool) -> bool {
        let state = self.records[id.0 as usize].tier_state(tier);
        self.partial.remove(&(id.0, tier as u8));
        let target = if present { COMPLETE } else { ABSENT };
        let changed = (state == COMPLETE) != present;
        if state != target {
            self.set_state(id, tier, target);
        }
        self.release_if_empty(id);
        changed
    }

    /// Marks several objects of one page present or gone in `tier` at once, with one
    /// side-table change instead of one per object. Events and the result are those of
    /// calling [`Self::set_object`] for each in turn (completeness crosses at most once,
    /// since every object moves the same way): a page whose objects all arrive in one
    /// call goes from absent to complete without a partial set.
    pub fn set_objects(
        &mut self,
        id: PageId,
        tier: TierKind,
        objs: &[usize],
        present: bool,
    ) -> Result<bool, DirectoryError> {
        let count = self.object_count(id);
        if let Some(&index) = objs.iter().find(|&&o| o >= count) {
            return Err(DirectoryError::ObjectOutOfRange { index, count });
        }
        let key = (id.0, tier as u8);
        let state = self.records[id.0 as usize].tier_state(tier);
        let mut set = match (state, present) {
            (COMPLETE, true) | (ABSENT, false) => {
                self.release_if_empty(id);
                return Ok(false);
            }
            _ if objs.is_empty() => return Ok(false),
            (COMPLETE, false) => ObjectSet::full(count),
            (ABSENT, true) => ObjectSet::new(count),
            _ => self.partial.remove(&key).unwrap_or_else(|| ObjectSet::new(count)),
        };
        for &o in objs {
            if present {
                set.insert(o);
            } else {
                set.remove(o);
            }
        }
        let target = if set.is_full() {
            COMPLETE
        } else if set.is_empty() {
            ABSENT
        } else {
            self.partial.insert(key, set);
            PARTIAL
        };
        if target != state {
            self.set_state(id, tier, target);
        }
        self.release_if_empty(id);
        Ok((state == COMPLETE) != (target == COMPLETE))
    }

    /// Marks several objects of one page as being written into `tier` (or no longer),
    /// with one side-table change.
    pub fn set_inflight_objects(
        &mut self,
        id: PageId,
        tier: TierKind,
        objs: &[usize],
        on: bool,
    ) -> Result<(), DirectoryError> {
        let count = self.object_count(id);
        if let Some(&index) = objs.iter().find(|&&o| o >= count) {
            return Err(DirectoryError::ObjectOutOfRange { index, count });
        }
        let key = (id.0, tier as u8);
        let bit = 1u8 << tier.index();
        if on && !objs.is_empty() {
            let set = self.inflight.entry(key).or_insert_with(|| {
                self.inflight_count[tier.index()] += 1;
                ObjectSet::new(count)
            });
            for &o in objs {
                set.insert(o);
            }
            self.records[id.0 as usize].inflight |= bit;
        } else if !on && let Some(s) = self.inflight.get_mut(&key) {
            for &o in objs {
                s.remove(o);
            }
            if s.is_empty() {
                self.inflight.remove(&key);
                self.inflight_count[tier.index()] -= 1;
                self.records[id.0 as usize].inflight &= !bit;
            }
        }
        self.release_if_empty(id);
        Ok(())
    }

    /// Marks one object as being written into `tier` (or no longer).
    pub fn set_inflight(&mut self, id: PageId, tier: TierKind, index: usize, on: bool) -> Result<(), DirectoryError> {
        let count = self.check_index(id, index)?;
        let key = (id.0, tier as u8);
        if on {
            let set = self.inflight.entry(key).or_insert_with(|| {
                self.inflight_count[tier.index()] += 1;
                ObjectSet::new(count)
            });
            set.insert(index);
        } else if let Some(s) = self.inflight.get_mut(&key) {
            s.remove(index);
            if s.is_empty() {
                self.inflight.remove(&key);
                self.inflight_count[tier.index()] -= 1;
            }
        }
        let bit = 1u8 << tier.index();
        let rec = &mut self.records[id.0 as usize];
        if self.inflight.contains_key(&key) {
            rec.inflight |= bit;
        } else {
            rec.inflight &= !bit;
        }
        self.release_if_empty(id);
        Ok(())
    }

    pub fn set_pinned(&mut self, id: PageId, tier: TierKind, on: bool) {
        let bit = 1u8 << tier.index();
        let rec = &mut self.records[id.0 as usize];
        if on {
            rec.pinned |= bit;
        } else {
            rec.pinned &= !bit;
        }
        self.release_if_empty(id);
    }

    pub fn set_retain(&mut self, id: PageId, priority: i8) {
        self.records[id.0 as usize].retain = priority;
    }

    pub fn set_session(&mut self, id: PageId, session: u32) {
        self.records[id.0 as usize].session = session;
    }

    /// Records an access (for LRU) and, when `hit`, a hit.
    pub fn touch(&mut self, id: PageId, hit: bool) {
        self.access_clock += 1;
        let rec = &mut self.records[id.0 as usize];
        rec.last_access = self.access_clock;
        if hit {
            rec.hits = rec.hits.saturating_add(1);
        }
    }

    fn set_state(&mut self, id: PageId, tier: TierKind, s: u8) {
        let rec = &mut self.records[id.0 as usize];
        let old = rec.tier_state(tier);
        rec.set_tier_state(tier, s);
        let (hash, ns) = (rec.hash, rec.ns);
        let kind = match (old == COMPLETE, s == COMPLETE) {
            (false, true) => {
                self.complete[tier.index()] += 1;
                PageEventKind::Stored
            }
            (true, false) => {
                self.complete[tier.index()] -= 1;
                PageEventKind::Removed
            }
            _ => return,
        };
        self.pending.push(PageEvent {
            seq: self.next_seq,
            kind,
            tier,
            ns,
            hash,
            at_ms: self.now_ms,
        });
        self.next_seq += 1;
    }

    /// Frees the record of a page that has no state left (e.g. one found by
    /// `find_or_insert` and then not used). Its `PageId` is invalid afterwards.
    pub fn release_if_empty(&mut self, id: PageId) {
        let rec = self.records[id.0 as usize];
        if !rec.is_empty() || !self.live[id.0 as usize] {
            return;
        }
        self.table.remove(rec.hash.table_hash(rec.ns), id.0);
        self.live[id.0 as usize] = false;
        self.free.push(id.0);
    }

    /// Drops every page of `tier` at once and emits a single `cleared` event.
    pub fn clear_tier(&mut self, tier: TierKind) -> usize {
        let mut n = 0;
        for i in 0..self.records.len() {
            if !self.live[i] || self.records[i].tier_state(tier) == ABSENT {
                continue;
            }
            if self.records[i].tier_state(tier) == COMPLETE {
                n += 1;
            }
            self.records[i].set_tier_state(tier, ABSENT);
            self.partial.remove(&(i as u32, tier as u8));
            self.release_if_empty(PageId(i as u32));
        }
        self.complete[tier.index()] = 0;
        self.pending.push(PageEvent {
            seq: self.next_seq,
            kind: PageEventKind::Cleared,
            tier,
            ns: NamespaceId(0),
            hash: PageHash::from_u64(0),
            at_ms: self.now_ms,
        });
        self.next_seq += 1;
        n
    }

    /// Takes the events emitted since the last call, in sequence order.
    pub fn drain_events(&mut self) -> Vec<PageEvent> {
        std::mem::take(&mut self.pending)
    }

    /// Sequence number of the last event emitted.
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Contiguous-prefix lookup: how many leading pages of `hashes` are complete, credited
    /// to the nearest tier holding each (see [`PrefixHit`]).
    pub fn lookup_prefix(&self, ns: NamespaceId, hashes: &[PageHash]) -> PrefixHit {
        // Prefix lengths where every page so far is complete on device, on device-or-host,
        // and anywhere. Each is monotone, so credit per tier is a difference.
        let (mut d, mut hn, mut p) = (0usize, 0usize, 0usize);
        let mut d_open = true;
        let mut h_open = true;
        // Hash a window ahead and prefetch its index slots, so that the misses of several
        // pages are in flight at once.
        const AHEAD: usize = 8;
        let mut ring = [0u64; AHEAD];
        for (i, hash) in hashes.iter().take(AHEAD).enumerate() {
            ring[i] = hash.table_hash(ns);
            self.table.prefetch(ring[i]);
        }
        for (i, hash) in hashes.iter().enumerate() {
            let h = ring[i % AHEAD];
            if let Some(next) = hashes.get(i + AHEAD) {
                let nh = next.table_hash(ns);
                ring[i % AHEAD] = nh;
                self.table.prefetch(nh);
            }
            let Some(id) = self.find_hashed(ns, hash, h) else { break };
            let s = self.records[id.0 as usize].state;
            let dev = s & 3 == COMPLETE;
            let host = (s >> 2) & 3 == COMPLETE;
            let pool = (s >> 4) & 3 == COMPLETE;
            if !(dev || host || pool) {
                break;
            }
            d_open &= dev;
            h_open &= dev || host;
            d += usize::from(d_open);
            hn += usize::from(h_open);
            p += 1;
        }
        PrefixHit {
            device: d,
            host: hn - d,
            pool: p - hn,
        }
    }

    /// Pages complete in `tier` that may be evicted (not pinned there, not in flight
    /// anywhere), with their eviction facts. The policy decides the order.
    pub fn eviction_candidates(&self, tier: TierKind) -> Vec<(PageId, PageInfo)> {
        self.eviction_candidates_in(tier, 0..self.records.len())
    }

    /// [`Self::eviction_candidates`] among the records in `range` (clipped to
    /// [`Self::record_slots`]), so a caller can walk the directory in bounded chunks and
    /// let go of its lock between them.
    pub fn eviction_candidates_in(&self, tier: TierKind, range: std::ops::Range<usize>) -> Vec<(PageId, PageInfo)> {
        let bit = 1u8 << tier.index();
        let range = range.start.min(self.records.len())..range.end.min(self.records.len());
        self.records[range.clone()]
            .iter()
            .zip(range)
            .filter(|(r, i)| self.live[*i] && r.tier_state(tier) == COMPLETE && r.pinned & bit == 0 && r.inflight == 0)
            .map(|(_, i)| (PageId(i as u32), self.info(PageId(i as u32))))
            .collect()
    }

    /// Record slots, live or free: the end of the ranges the `_in` walks take.
    pub fn record_slots(&self) -> usize {
        self.records.len()
    }

    /// Every live page last touched by `session`.
    pub fn pages_of_session(&self, session: u32) -> Vec<PageId> {
        self.pages_of_session_in(session, 0..self.records.len())
    }

    /// [`Self::pages_of_session`] among the records in `range` (clipped).
    pub fn pages_of_session_in(&self, session: u32, range: std::ops::Range<usize>) -> Vec<PageId> {
        (range.start.min(self.records.len())..range.end.min(self.records.len()))
            .filter(|&i| self.live[i] && self.records[i].session == session)
            .map(|i| PageId(i as u32))
            .collect()
    }

    /// Every live page holding any object in `tier`.
    pub fn pages_in(&self, tier: TierKind) -> Vec<PageId> {
        (0..self.records.len())
            .filter(|&i| self.live[i] && self.records[i].tier_state(tier) != ABSENT)
            .map(|i| PageId(i as u32))
            .collect()
    }

    /// Approximate heap bytes held by the directory's structures.
    pub fn heap_bytes(&self) -> usize {
        let rec = self.records.capacity() * std::mem::size_of::<PageRecord>() + self.live.capacity();
        let table = self.table.heap_bytes();
        let side = (self.partial.capacity() + self.inflight.capacity())
            * (std::mem::size_of::<((u32, u8), ObjectSet)>() + 1)
            + self
                .partial
                .values()
                .chain(self.inflight.values())
                .map(ObjectSet::heap_bytes)
                .sum::<usize>();
        rec + table + side + self.free.capacity() * 4
    }

    /// Size of the fixed per-page record.
    pub const fn record_bytes() -> usize {
        std::mem::size_of::<PageRecord>()
    }
}

#[cfg(test)]
mod tests;
