//! The manager's session table as a component: the bounded table of every session an
//! engine or router names (`session::registry::Sessions`), behind its own lock
//! ([`Rank::Sessions`]). It owns the table and its limits (the manager sets them from its
//! tunables when they change); nothing else takes the lock. The manager composes it with
//! the directory (moving a session's pages between eviction classes).

use parking_lot::{Mutex, MutexGuard};

use super::ManagerError;
use super::locks::{Ordered, Rank};
use super::pages::Pages;
use crate::session::SessionError;
use crate::session::registry::{Sessions, Standing};

/// Interned sessions, their index (the one pages carry) and standing.
#[derive(Default)]
pub struct SessionRegistry {
    table: Mutex<Sessions>,
}

impl SessionRegistry {
    /// The table, under its lock (rank-checked in test and debug builds).
    pub(super) fn lock(&self) -> Ordered<MutexGuard<'_, Sessions>> {
        Ordered::take(Rank::Sessions, || self.table.lock())
    }

    /// Bounds the table: at most `max_sessions` sessions, ids of at most `max_id_bytes`
    /// (the manager's tunables; sessions already held stay).
    pub(super) fn set_limits(&self, max_sessions: usize, max_id_bytes: usize) {
        self.lock().set_limits(max_sessions, max_id_bytes);
    }

    /// The index pages of session `id` carry, interned on first use (never 0). An id
    /// over the table's `max_session_id_bytes` is refused; a new session in a full table
    /// frees the oldest ended one first.
    pub fn index(&self, id: &str) -> Result<u32, SessionError> {
        self.lock().intern(id)
    }

    /// Interns session `id` and records its standing from a phase change: ended, idle
    /// (paused or acting) or busy. Returns its index. The eviction class of its pages is
    /// the caller's to move (the directory's, not this table's).
    pub(super) fn set_phase(&self, id: &str, idle: bool, ended: bool) -> Result<u32, SessionError> {
        let standing = match (ended, idle) {
            (true, _) => Standing::Ended,
            (false, true) => Standing::Idle,
            (false, false) => Standing::Busy,
        };
        let mut t = self.lock();
        let idx = t.intern(id)?;
        t.set_standing(id, standing);
        Ok(idx)
    }

    /// The index of a session the table holds, without interning it.
    pub(super) fn get(&self, id: &str) -> Option<u32> {
        self.lock().get(id)
    }

    /// A session changed phase: `idle` (paused, acting) or not, or `ended`. Interns it,
    /// records its standing and moves its pages in `pages` to the matching eviction class
    /// (idle and ended sessions' pages are evicted first). An ended session is freed from
    /// the table once it needs the room (oldest ended first); its pages stay in the idle
    /// class. Returns its index.
    pub fn changed(&self, pages: &Pages, id: &str, idle: bool, ended: bool) -> Result<u32, ManagerError> {
        let idx = self.set_phase(id, idle, ended)?;
        // After the table's lock is let go: the directory's ranks below it.
        pages.reclass_session(idx, idle || ended, ended);
        Ok(idx)
    }

    /// Marks session `idx` idle (paused, or acting: waiting on a tool) or busy, and moves
    /// its pages in `pages` to the matching eviction class.
    pub fn mark_idle(&self, pages: &Pages, idx: u32, idle: bool) {
        self.set_idle(idx, idle);
        pages.reclass_session(idx, idle, false);
    }

    /// Records a session's standing (busy, idle, ended).
    pub(super) fn set_standing(&self, id: &str, standing: Standing) {
        self.lock().set_standing(id, standing);
    }

    /// Marks a session idle or busy by index.
    pub(super) fn set_idle(&self, idx: u32, idle: bool) {
        self.lock().set_idle(idx, idle);
    }

    /// Every session, sorted by id, each with whether it is idle. Copies every row
    /// (tests, small tables); renders use [`SessionRegistry::page`].
    pub fn list(&self) -> Vec<(String, bool)> {
        self.lock().list()
    }

    /// One page of sessions in id order: up to `limit` rows with ids after `after`, past
    /// `offset` of them, each (id, idle, ended), and how many sessions the table holds.
    /// Holds only this table's lock, for O(log n + offset + limit); the caller renders
    /// after it let go.
    pub fn page(&self, after: Option<&str>, offset: usize, limit: usize) -> (Vec<(String, bool, bool)>, usize) {
        let t = self.lock();
        (t.list_page(after, offset, limit), t.len())
    }

    /// Sessions held and the table's approximate heap bytes.
    pub fn size(&self) -> (usize, usize) {
        let t = self.lock();
        (t.len(), t.heap_bytes())
    }
}
