//! The page directory: which objects of which page are present, in flight or missing, in
//! which tier.
//!
//! A page is complete in a tier iff every object its layout requires is present there.
//! The directory emits an event only when that changes (became complete / stopped being
//! complete), each exactly once, numbered in one sequence. It answers contiguous-prefix
//! lookups over a hash sequence with per-tier credit that never counts a page twice.
//!
//! Memory per page is kept small: a fixed 24-byte record the writer keeps, a 40-byte
//! cell and an 8-byte index slot (load at most 3/4) that lookups read, and side tables
//! only for the rare pages that are partial or in flight.
//!
//! Lookups do not take the directory's lock: the index and the fields a lookup needs
//! (hash, namespace, per-tier state) live in a [`DirView`] of atomics that the writer
//! updates in place, so a lookup never waits behind a store or an eviction round (see
//! `view.rs`). Everything else is the writer's alone, under its owner's write lock.

mod bitset;
mod classes;
mod evict;
pub(crate) mod index;
mod objects;
mod view;

use std::sync::Arc;

pub use bitset::ObjectSet;
pub use classes::{Order, OrderMut};
pub use objects::Objects;
pub use view::DirView;

pub mod shared;

use crate::events::{PageEvent, PageEventKind};
use crate::layout::Layout;
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::wire::PrefixHit;
use classes::EvictOrder;
use objects::ObjectMarks;

const ABSENT: u8 = 0;
const PARTIAL: u8 = 1;
pub(crate) const COMPLETE: u8 = 2;

/// `PageRecord::class` bits.
const CLASS_IDLE: u8 = 1;
const CLASS_PROTECTED: u8 = 2;

/// The tiers whose eviction order the directory keeps as lists (device memory belongs to
/// the engine: kvtier only advises there, from a walk at upkeep).
const LISTED: [TierKind; 2] = [TierKind::Host, TierKind::Pool];

fn listed(tier: TierKind) -> Option<usize> {
    LISTED.iter().position(|&t| t == tier)
}

/// Where [`classes::EvictOrder::relink`] puts a page in its bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Leave it where it is if its bucket did not change; else at the tail.
    Keep,
    /// At the tail (most recently used).
    Tail,
    /// At the head (next victim).
    Head,
}

/// A page's eviction class, set by the session policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictClass {
    /// Ordered by retain priority and recency. Clears idle and protected.
    Normal,
    /// Its session is idle (paused, acting): evicted before every normal page. Clears
    /// protection.
    IdleSession,
    /// Never evicted until `until_ms` (the manager's clock) passes or the page is hit by
    /// a load; then back to the class it had (idle or normal).
    Protected { until_ms: u64 },
}

/// Index of a page's record. Valid while the page has any state in any tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId(pub u32);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DirectoryError {
    #[error("namespace {ns:?} is registered with layout [{registered}]; this engine gives [{given}]")]
    LayoutMismatch {
        ns: Namespace,
        registered: String,
        given: String,
    },
    #[error("unknown namespace id {0}")]
    UnknownNamespace(u16),
    #[error("too many namespaces (at most {0})")]
    TooManyNamespaces(usize),
    #[error("object index {index} is outside the page's {count} objects")]
    ObjectOutOfRange { index: usize, count: usize },
    #[error("the directory is full ({0} pages)")]
    Full(usize),
    #[error("cannot reserve {0} bytes for the directory's lookup view; lower max_pages")]
    Alloc(usize),
}

/// A map keyed by small integers (record indices, tiers): foldhash instead of SipHash,
/// since its keys are not chosen by a client and a move touches several entries per
/// object.
/// The registered namespaces with their layouts, indexed by [`NamespaceId`].
type NsLayouts = [(Namespace, Layout)];

pub(crate) type IdMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The fixed per-page record the writer keeps: 24 bytes, beside the page's 40-byte cell
/// in the [`DirView`] (the hash lives only there); see `bench index`.
#[derive(Clone, Copy, Debug)]
struct PageRecord {
    /// The writer's copy of the namespace in the page's cell.
    ns: NamespaceId,
    /// Two bits per tier: absent, partial or complete. The writer's copy of the state in
    /// the page's cell; both change together in [`Directory::write_state`].
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
    /// Eviction class bits (`CLASS_*`); fits the record's padding, so it stays 56 bytes.
    class: u8,
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

    fn info(&self, hash: PageHash) -> PageInfo {
        PageInfo {
            hash,
            ns: self.ns,
            retain: self.retain,
            hits: self.hits,
            session: self.session,
            last_access: self.last_access,
        }
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

/// The page directory. Changes need `&mut self` (the manager owns it under a lock);
/// lookups can go through [`Directory::view`] with no lock at all.
#[derive(Debug)]
pub struct Directory {
    layouts: Vec<(Namespace, Layout)>,
    /// The index and the cells lookups read; written here, read anywhere.
    view: Arc<DirView>,
    records: Vec<PageRecord>,
    live: Vec<bool>,
    free: Vec<u32>,
    pending: Vec<PageEvent>,
    next_seq: u64,
    complete: [usize; 3],
    now_ms: u64,
    max_pages: usize,
    /// The eviction order: lists, pages per session, idle sessions, protections.
    order: EvictOrder,
    /// Objects of partial and in-flight pages.
    marks: ObjectMarks,
}

/// Records a directory for `max_pages` pages has (clipped to 2^32 - 2).
pub fn max_records(max_pages: usize) -> usize {
    max_pages.min(view::MAX_RECORDS)
}

/// A directory over `view`, for as many pages as it has records (the lookup file's view,
/// see [`shared`]; [`Directory::try_new`] makes one on the heap).
impl From<DirView> for Directory {
    fn from(view: DirView) -> Self {
        let max_pages = view.records();
        Self {
            layouts: Vec::new(),
            view: Arc::new(view),
            records: Vec::new(),
            live: Vec::new(),
            free: Vec::new(),
            pending: Vec::new(),
            next_seq: 1,
            complete: [0; 3],
            now_ms: 0,
            max_pages,
            order: EvictOrder::default(),
            marks: ObjectMarks::default(),
        }
    }
}

impl Directory {
    /// A directory that refuses to track more than `max_pages` pages at once. Panics when
    /// its lookup view cannot be reserved; callers with `max_pages` from outside use
    /// [`Self::try_new`].
    pub fn new(max_pages: usize) -> Self {
        match Self::try_new(max_pages) {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        }
    }

    /// A directory for at most `max_pages` pages (clipped to 2^32 - 2). Its lookup view
    /// is reserved now at its full size, zeroed, so it is never reallocated under a
    /// reader: an index of 8 bytes × the power of two above 4/3 × `max_pages` (all of it
    /// becomes resident once pages are spread over it) and 40 bytes × `max_pages` of
    /// cells (resident as records are first used).
    pub fn try_new(max_pages: usize) -> Result<Self, DirectoryError> {
        Ok(Self::from(DirView::new(max_records(max_pages))?))
    }

    /// The lock-free read side: prefix lookups through it need no lock and see every
    /// change this directory makes (see [`DirView`]).
    pub fn view(&self) -> Arc<DirView> {
        self.view.clone()
    }

    /// Interns a namespace with its layout. Registering the same namespace again with the
    /// same layout returns the same id; with another layout it is an error.
    pub fn register(&mut self, ns: Namespace, layout: Layout) -> Result<NamespaceId, DirectoryError> {
        if let Some(i) = self.layouts.iter().position(|(n, _)| *n == ns) {
            if self.layouts[i].1 != layout {
                return Err(DirectoryError::LayoutMismatch {
                    registered: self.layouts[i].1.spec().describe(),
                    given: layout.spec().describe(),
                    ns,
                });
            }
            return Ok(NamespaceId(i as u16));
        }
        if self.layouts.len() >= u16::MAX as usize {
            return Err(DirectoryError::TooManyNamespaces(u16::MAX as usize));
        }
        self.layouts.push((ns, layout));
        self.view.set_namespaces(self.layouts.len());
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
        self.view.find(ns, hash, hash.table_hash(ns)).map(|(i, _)| PageId(i))
    }

    /// Finds a page, creating an empty record when it is new.
    pub fn find_or_insert(&mut self, ns: NamespaceId, hash: &PageHash) -> Result<PageId, DirectoryError> {
        self.find_or_insert_fresh(ns, hash).map(|(id, _)| id)
    }

    /// Finds a page or creates its empty record, and says whether it was created: one
    /// index probe where `find` followed by `find_or_insert` took two (a store's
    /// reserve needs to know which records it made, to release them if unused).
    pub fn find_or_insert_fresh(&mut self, ns: NamespaceId, hash: &PageHash) -> Result<(PageId, bool), DirectoryError> {
        self.layout(ns)?;
        if let Some(id) = self.find(ns, hash) {
            return Ok((id, false));
        }
        if self.len() >= self.max_pages && self.forget_device_only((self.max_pages / 64).max(1)) == 0 {
            return Err(DirectoryError::Full(self.max_pages));
        }
        let rec = PageRecord {
            ns,
            state: 0,
            inflight: 0,
            pinned: 0,
            retain: 0,
            hits: 0,
            session: 0,
            last_access: 0,
            class: 0,
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
        // The cell first: a reader that finds the index slot finds this page in it.
        self.view.publish(idx, ns, hash);
        self.view.insert(hash.table_hash(ns), idx);
        Ok((PageId(idx), true))
    }

    pub fn info(&self, id: PageId) -> PageInfo {
        self.records[id.0 as usize].info(self.view.hash(id.0))
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

    /// Sets the page's state in `tier` in the record and in its cell (one store there, so
    /// a lookup sees the old or the new state, never a mix).
    fn write_state(&mut self, i: usize, tier: TierKind, s: u8) {
        let rec = &mut self.records[i];
        rec.set_tier_state(tier, s);
        self.view.set_state(i as u32, rec.state);
    }

    fn set_state(&mut self, id: PageId, tier: TierKind, s: u8) {
        let old = self.records[id.0 as usize].tier_state(tier);
        self.write_state(id.0 as usize, tier, s);
        let (hash, ns) = (self.view.hash(id.0), self.records[id.0 as usize].ns);
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
        self.order.relink(&self.records, &self.live, id, Place::Keep);
        let rec = self.records[id.0 as usize];
        if !rec.is_empty() || !self.live[id.0 as usize] {
            return;
        }
        self.view.remove(self.view.hash(id.0).table_hash(rec.ns), id.0);
        self.live[id.0 as usize] = false;
        self.free.push(id.0);
        // A reused slot starts with no session, class or protection.
        self.order.forget(id, rec.session);
        self.records[id.0 as usize].session = 0;
        self.records[id.0 as usize].class = 0;
        self.order.relink(&self.records, &self.live, id, Place::Keep);
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
            self.write_state(i, tier, ABSENT);
            self.marks.clear_partial(PageId(i as u32), tier);
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
    /// to the nearest tier holding each (see [`PrefixHit`]). The same code as a lookup
    /// through [`Self::view`] with no lock.
    pub fn lookup_prefix(&self, ns: NamespaceId, hashes: &[PageHash]) -> PrefixHit {
        self.view.lookup_prefix(ns, hashes)
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
        let table = self.view.heap_bytes(self.records.len());
        let side = self.marks.heap_bytes();
        let order = self.order.heap_bytes();
        rec + table + side + self.free.capacity() * 4 + order
    }

    /// Fixed bytes per page: the writer's record and the page's cell in the view.
    pub const fn record_bytes() -> usize {
        std::mem::size_of::<PageRecord>() + view::CELL_BYTES
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod view_tests;
