//! What orders a page for eviction besides its tier state: retain priority, the session
//! that last touched it and that session's idleness, the eviction class (normal, idle,
//! protected until a time), and recency. [`EvictOrder`] owns the lists, the pages per
//! session, the idle sessions, the protection-expiry heap and the recency clock; each
//! change relinks the page in its tier's lists in O(1) ([`EvictOrder::relink`]).
//!
//! Callers reach it through [`Directory::order`] (victims, classes, walks: read-only, so
//! under a read lock) and [`Directory::order_mut`] (classes and recency changes), which
//! lend it the page records it orders.

use std::collections::HashSet;

use super::evict::{self, Lists, SessionLists};
use super::{
    CLASS_IDLE, CLASS_PROTECTED, COMPLETE, DirView, Directory, EvictClass, LISTED, PageId, PageInfo, PageRecord, Place,
    listed,
};
use crate::expiry::ExpiryHeap;
use crate::tier::TierKind;

/// The eviction order's own state (a field of [`Directory`]).
#[derive(Debug, Default)]
pub(super) struct EvictOrder {
    /// Eviction order of the listed tiers ([`LISTED`]).
    lists: [Lists; 2],
    /// Pages per session, so a session changing class touches only its pages.
    by_session: SessionLists,
    /// Sessions whose new pages start in the idle class.
    idle_sessions: HashSet<u32>,
    /// Protected pages and when their protection ends, in the core's expiry heap
    /// (entries whose page was unprotected or reused are skipped when they come up).
    protected: ExpiryHeap<u32>,
    /// Logical access time for LRU ordering.
    access_clock: u64,
}

impl EvictOrder {
    /// Puts the page in the lists where it belongs now: linked in a listed tier iff live,
    /// complete there, not pinned there, not in flight anywhere and not protected. A page
    /// that changes bucket enters at the tail, or where `place` says; `Tail` and `Head`
    /// move it even when its bucket stays (an access; a protection that ran out).
    pub(super) fn relink(&mut self, records: &[PageRecord], live: &[bool], id: PageId, place: Place) {
        let i = id.0;
        let rec = records[i as usize];
        let live = live.get(i as usize).copied().unwrap_or(false);
        for (k, &tier) in LISTED.iter().enumerate() {
            let evictable = live
                && rec.tier_state(tier) == COMPLETE
                && rec.pinned & (1 << tier.index()) == 0
                && rec.inflight == 0
                && rec.class & CLASS_PROTECTED == 0;
            let want = evictable.then(|| evict::bucket(rec.class & CLASS_IDLE != 0, rec.retain));
            let have = self.lists[k].bucket_of(i);
            if want == have && (place == Place::Keep || want.is_none()) {
                continue;
            }
            self.lists[k].unlink(i);
            match (want, place) {
                (Some(b), Place::Head) => self.lists[k].push_front(i, b),
                (Some(b), _) => self.lists[k].push_back(i, b),
                (None, _) => {}
            }
        }
    }

    /// Forgets a record slot being freed (it was `session`'s): a reused slot starts with
    /// no session and no protection.
    pub(super) fn forget(&mut self, id: PageId, session: u32) {
        self.by_session.remove(session, id.0);
        self.protected.remove(&id.0);
    }

    /// Heap bytes of the lists and the pages per session.
    pub(super) fn heap_bytes(&self) -> usize {
        self.lists.iter().map(Lists::heap_bytes).sum::<usize>() + self.by_session.heap_bytes()
    }
}

/// Whether the record is an eviction candidate in `tier`: live, complete there, not
/// pinned there, not in flight anywhere.
fn candidate(rec: &PageRecord, live: bool, tier: TierKind) -> bool {
    live && rec.tier_state(tier) == COMPLETE && rec.pinned & (1 << tier.index()) == 0 && rec.inflight == 0
}

/// The eviction order, read-only, with the records it orders ([`Directory::order`]).
#[derive(Clone, Copy)]
pub struct Order<'a> {
    pub(super) records: &'a [PageRecord],
    pub(super) live: &'a [bool],
    pub(super) view: &'a DirView,
    pub(super) order: &'a EvictOrder,
}

impl<'a> Order<'a> {
    /// Up to `n` victims in `tier` in eviction order (idle sessions' pages, then low
    /// retain, then least recently used), never pinned, in-flight or protected, skipping
    /// pages for which `skip` holds (e.g. leased). For host and pool this follows the
    /// lists: O(n + skipped), read-only, so it runs under a read lock; at most `n * 4 +
    /// 1024` skipped pages are stepped over. Device pages are walked and sorted (advice).
    pub fn victims(&self, tier: TierKind, n: usize, mut skip: impl FnMut(PageId) -> bool) -> Vec<PageId> {
        if n == 0 {
            return Vec::new();
        }
        let Some(k) = listed(tier) else {
            let mut c = self.eviction_candidates(tier);
            c.retain(|(id, _)| !self.is_protected(*id) && !skip(*id));
            c.sort_unstable_by_key(|(id, _)| self.evict_key(*id));
            return c.into_iter().take(n).map(|(id, _)| id).collect();
        };
        let mut budget = n * 4 + 1024;
        let mut out = Vec::with_capacity(n);
        for i in self.order.lists[k].iter() {
            if out.len() == n {
                break;
            }
            if skip(PageId(i)) {
                if budget == 0 {
                    break;
                }
                budget -= 1;
                continue;
            }
            out.push(PageId(i));
        }
        out
    }

    /// A page's place in eviction order as a sort key, smallest first: the idle class
    /// (idle and ended sessions' pages) before the others, then low retain priority, then
    /// least recently used. The host and pool lists keep this order as it changes; the
    /// device tier (advice to the engine, and `kvtier replay`'s emulated device) sorts
    /// by it.
    pub fn evict_key(&self, id: PageId) -> (bool, i8, u64) {
        let rec = &self.records[id.0 as usize];
        (rec.class & CLASS_IDLE == 0, rec.retain, rec.last_access)
    }

    /// Pages evictable in `tier` now (linked in its lists). O(1); host and pool only.
    pub fn evictable(&self, tier: TierKind) -> usize {
        listed(tier).map_or(0, |k| self.order.lists[k].len())
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
        let range = range.start.min(self.records.len())..range.end.min(self.records.len());
        self.records[range.clone()]
            .iter()
            .zip(range)
            .filter(|(r, i)| candidate(r, self.live[*i], tier))
            .map(|(r, i)| (PageId(i as u32), r.info(self.view.hash(i as u32))))
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

    /// Pages whose session is `session`, least recently used first: O(k log k) for the
    /// session's k pages, no scan.
    pub fn session_pages(&self, session: u32) -> Vec<PageId> {
        let mut pages = self.order.by_session.pages(session);
        pages.sort_by_key(|&i| self.records[i as usize].last_access);
        pages.into_iter().map(PageId).collect()
    }

    /// Whether the page is protected from eviction.
    pub fn is_protected(&self, id: PageId) -> bool {
        self.records[id.0 as usize].class & CLASS_PROTECTED != 0
    }

    /// Whether the page is in the idle-session class.
    pub fn is_idle_class(&self, id: PageId) -> bool {
        self.records[id.0 as usize].class & CLASS_IDLE != 0
    }

    /// When the next protection ends (manager clock), if any page is protected. Stale
    /// entries may make this early, never late.
    pub fn next_protection_expiry(&self) -> Option<u64> {
        self.order.protected.peek_deadline()
    }

    /// Protected pages now.
    pub fn protected_pages(&self) -> usize {
        self.order.protected.len()
    }
}

/// The eviction order with the records it orders, for changes ([`Directory::order_mut`]).
pub struct OrderMut<'a> {
    pub(super) records: &'a mut [PageRecord],
    pub(super) live: &'a [bool],
    pub(super) view: &'a DirView,
    pub(super) order: &'a mut EvictOrder,
}

impl OrderMut<'_> {
    /// The same order, read-only.
    pub fn read(&self) -> Order<'_> {
        Order {
            records: self.records,
            live: self.live,
            view: self.view,
            order: self.order,
        }
    }

    fn relink(&mut self, id: PageId, place: Place) {
        self.order.relink(self.records, self.live, id, place);
    }

    pub fn set_retain(&mut self, id: PageId, priority: i8) {
        self.records[id.0 as usize].retain = priority;
        self.relink(id, Place::Keep);
    }

    /// Records the session that last touched the page. Its class follows the session's
    /// (idle when the session is, see [`Self::set_session_idle`]); protection stays.
    pub fn set_session(&mut self, id: PageId, session: u32) {
        let rec = &mut self.records[id.0 as usize];
        let old = rec.session;
        if old != session {
            rec.session = session;
            self.order.by_session.remove(old, id.0);
            self.order.by_session.add(session, id.0);
        }
        let idle = session != 0 && self.order.idle_sessions.contains(&session);
        self.set_idle_bit(id, idle);
    }

    /// Moves every page of `session` into the idle class (or out of it), and makes the
    /// session's later pages start there. O(pages of the session), no scan.
    pub fn set_session_idle(&mut self, session: u32, idle: bool) {
        self.note_session_idle(session, idle);
        // Least recently used first, so the class they enter keeps their recency order.
        for id in self.read().session_pages(session) {
            self.set_idle_bit(id, idle);
        }
    }

    /// Makes `session`'s later pages start in the idle class (or not), leaving its
    /// existing pages to [`Self::set_session_page_idle`] (a caller that works in chunks).
    pub fn note_session_idle(&mut self, session: u32, idle: bool) {
        if session == 0 {
            return;
        }
        if idle {
            self.order.idle_sessions.insert(session);
        } else {
            self.order.idle_sessions.remove(&session);
        }
    }

    /// Moves one page into the idle class (or out), if it still belongs to `session`.
    pub fn set_session_page_idle(&mut self, id: PageId, session: u32, idle: bool) {
        if self.live.get(id.0 as usize) == Some(&true) && self.records[id.0 as usize].session == session {
            self.set_idle_bit(id, idle);
        }
    }

    /// Forgets `session` (it ended): its pages stay in the idle class, so they go first,
    /// and the directory keeps nothing per ended session.
    pub fn end_session(&mut self, session: u32) {
        self.set_session_idle(session, true);
        self.order.idle_sessions.remove(&session);
    }

    fn set_idle_bit(&mut self, id: PageId, idle: bool) {
        let rec = &mut self.records[id.0 as usize];
        let was = rec.class & CLASS_IDLE != 0;
        if was != idle {
            rec.class ^= CLASS_IDLE;
            self.relink(id, Place::Keep);
        }
    }

    /// Moves a page between eviction classes (the session policy's hook). O(1), plus
    /// O(log n) to schedule a protection's end.
    pub fn set_class(&mut self, id: PageId, class: EvictClass) {
        let rec = &mut self.records[id.0 as usize];
        match class {
            EvictClass::Normal => rec.class = 0,
            EvictClass::IdleSession => rec.class = CLASS_IDLE,
            EvictClass::Protected { until_ms } => {
                rec.class |= CLASS_PROTECTED;
                self.order.protected.insert(id.0, until_ms, ());
            }
        }
        if self.records[id.0 as usize].class & CLASS_PROTECTED == 0 {
            self.order.protected.remove(&id.0);
        }
        self.relink(id, Place::Keep);
    }

    /// Ends protection early (the page was loaded).
    pub fn unprotect(&mut self, id: PageId) {
        self.end_protection(id, Place::Keep);
    }

    fn end_protection(&mut self, id: PageId, place: Place) {
        if self.records[id.0 as usize].class & CLASS_PROTECTED != 0 {
            self.records[id.0 as usize].class &= !CLASS_PROTECTED;
            self.order.protected.remove(&id.0);
            self.relink(id, place);
        }
    }

    /// Ends the protections due at `now_ms`: each page goes to the head of its bucket
    /// (staged, never loaded: the first to go). Returns how many pages it released.
    pub fn expire_protection(&mut self, now_ms: u64) -> usize {
        let mut n = 0;
        while let Some((i, _, ())) = self.order.protected.pop_due(now_ms) {
            // Staged and never loaded within the TTL: the coldest page of its bucket.
            // Its deadline is gone already; `end_protection` clears the class and relinks.
            self.end_protection(PageId(i), Place::Head);
            n += 1;
        }
        n
    }

    /// Records an access (for LRU) and, when `hit`, a hit. A hit is a load: it ends the
    /// page's protection. The page moves to the tail of its eviction bucket.
    pub fn touch(&mut self, id: PageId, hit: bool) {
        self.order.access_clock += 1;
        let rec = &mut self.records[id.0 as usize];
        rec.last_access = self.order.access_clock;
        if hit {
            rec.hits = rec.hits.saturating_add(1);
            self.unprotect(id);
        }
        self.relink(id, Place::Tail);
    }
}

impl Directory {
    /// The eviction order, read-only: victims, eviction keys, classes and the record walks
    /// that a policy chunks under its read lock.
    pub fn order(&self) -> Order<'_> {
        Order {
            records: &self.records,
            live: &self.live,
            view: &self.view,
            order: &self.order,
        }
    }

    /// The eviction order for changes: classes, sessions, retain priority, recency.
    pub fn order_mut(&mut self) -> OrderMut<'_> {
        OrderMut {
            records: &mut self.records,
            live: &self.live,
            view: &self.view,
            order: &mut self.order,
        }
    }
}
