//! The manager's session table as a component: the bounded table of every session an
//! engine or router names (`session::registry::Sessions`), behind its own lock
//! ([`Rank::Sessions`]). It owns the table; nothing else takes the lock. The manager
//! composes it with the directory (moving a session's pages between eviction classes)
//! and reads the table's limits from its tunables, passed in.

use parking_lot::{Mutex, MutexGuard};

use super::locks::{Ordered, Rank};
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

    /// The index of session `id`, interned on first use (never 0) under the limits given
    /// (the manager's tunables): an id over `max_id_bytes` is refused; a new session in a
    /// full table frees the oldest ended one first.
    pub(super) fn intern(&self, id: &str, max_sessions: usize, max_id_bytes: usize) -> Result<u32, SessionError> {
        let mut t = self.lock();
        t.set_limits(max_sessions, max_id_bytes);
        t.intern(id)
    }

    /// The index of a session the table holds, without interning it.
    pub(super) fn get(&self, id: &str) -> Option<u32> {
        self.lock().get(id)
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
