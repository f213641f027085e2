//! What orders a page for eviction besides its tier state: pin marks, retain priority,
//! the session that last touched it and that session's idleness, the eviction class
//! (normal, idle, protected until a time), and recency. Each change relinks the page in
//! its tier's lists in O(1) (`relink`).

use super::{CLASS_IDLE, CLASS_PROTECTED, COMPLETE, Directory, EvictClass, LISTED, PageId, Place, evict};
use crate::tier::TierKind;

impl Directory {
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
        self.relink(id, Place::Keep);
    }

    /// Records the session that last touched the page. Its class follows the session's
    /// (idle when the session is, see [`Self::set_session_idle`]); protection stays.
    pub fn set_session(&mut self, id: PageId, session: u32) {
        let rec = &mut self.records[id.0 as usize];
        let old = rec.session;
        if old != session {
            rec.session = session;
            self.by_session.remove(old, id.0);
            self.by_session.add(session, id.0);
        }
        let idle = session != 0 && self.idle_sessions.contains(&session);
        self.set_idle_bit(id, idle);
    }

    /// Moves every page of `session` into the idle class (or out of it), and makes the
    /// session's later pages start there. O(pages of the session), no scan.
    pub fn set_session_idle(&mut self, session: u32, idle: bool) {
        self.note_session_idle(session, idle);
        // Least recently used first, so the class they enter keeps their recency order.
        for id in self.session_pages(session) {
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
            self.idle_sessions.insert(session);
        } else {
            self.idle_sessions.remove(&session);
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
        self.idle_sessions.remove(&session);
    }

    /// Pages whose session is `session`, least recently used first: O(k log k) for the
    /// session's k pages, no scan.
    pub fn session_pages(&self, session: u32) -> Vec<PageId> {
        let mut pages = self.by_session.pages(session);
        pages.sort_by_key(|&i| self.records[i as usize].last_access);
        pages.into_iter().map(PageId).collect()
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
                self.protected.insert(id.0, until_ms, ());
            }
        }
        if self.records[id.0 as usize].class & CLASS_PROTECTED == 0 {
            self.protected.remove(&id.0);
        }
        self.relink(id, Place::Keep);
    }

    /// Whether the page is protected from eviction.
    pub fn is_protected(&self, id: PageId) -> bool {
        self.records[id.0 as usize].class & CLASS_PROTECTED != 0
    }

    /// Whether the page is in the idle-session class.
    pub fn is_idle_class(&self, id: PageId) -> bool {
        self.records[id.0 as usize].class & CLASS_IDLE != 0
    }

    /// Ends protection early (the page was loaded).
    pub fn unprotect(&mut self, id: PageId) {
        self.end_protection(id, Place::Keep);
    }

    fn end_protection(&mut self, id: PageId, place: Place) {
        if self.records[id.0 as usize].class & CLASS_PROTECTED != 0 {
            self.records[id.0 as usize].class &= !CLASS_PROTECTED;
            self.protected.remove(&id.0);
            self.relink(id, place);
        }
    }

    /// When the next protection ends (manager clock), if any page is protected. Stale
    /// entries may make this early, never late.
    pub fn next_protection_expiry(&self) -> Option<u64> {
        self.protected.peek_deadline()
    }

    /// Ends the protections due at `now_ms`: each page goes to the head of its bucket
    /// (staged, never loaded: the first to go). Returns how many pages it released.
    pub fn expire_protection(&mut self, now_ms: u64) -> usize {
        let mut n = 0;
        while let Some((i, _, ())) = self.protected.pop_due(now_ms) {
            // Staged and never loaded within the TTL: the coldest page of its bucket.
            // Its deadline is gone already; `end_protection` clears the class and relinks.
            self.end_protection(PageId(i), Place::Head);
            n += 1;
        }
        n
    }

    /// Protected pages now.
    pub fn protected_pages(&self) -> usize {
        self.protected.len()
    }

    /// Records an access (for LRU) and, when `hit`, a hit. A hit is a load: it ends the
    /// page's protection. The page moves to the tail of its eviction bucket.
    pub fn touch(&mut self, id: PageId, hit: bool) {
        self.access_clock += 1;
        let rec = &mut self.records[id.0 as usize];
        rec.last_access = self.access_clock;
        if hit {
            rec.hits = rec.hits.saturating_add(1);
            self.unprotect(id);
        }
        self.relink(id, Place::Tail);
    }

    /// Puts the page in the lists where it belongs now: linked in a listed tier iff live,
    /// complete there, not pinned there, not in flight anywhere and not protected. A page
    /// that changes bucket enters at the tail, or where `place` says; `Tail` and `Head`
    /// move it even when its bucket stays (an access; a protection that ran out).
    pub(super) fn relink(&mut self, id: PageId, place: Place) {
        let i = id.0;
        let rec = self.records[i as usize];
        let live = self.live.get(i as usize).copied().unwrap_or(false);
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
}
