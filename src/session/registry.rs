//! The session registry: session ids interned to the small index pages carry, their idle
//! state (paused, or acting: waiting on a tool) and whether they ended. The manager keeps
//! it for every session an engine names, with or without the session policy.
//!
//! The manager holds it under its own lock so that listing sessions (an admin render) or a session changing
//! phase never waits on the directory. It is bounded: ids longer than the configured limit
//! are refused with a typed error, and when the table is full the oldest ended session is
//! freed first (then the session idle longest, then the oldest). Indices are never reused,
//! so a page that still carries a freed session's index is never credited to a new one.
//! Listing is by pages in id order (`list_page`), so a render copies out only the rows it
//! shows.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use super::SessionError;

/// Where a session stands; the table's eviction order follows it (ended first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Standing {
    Ended = 0,
    Idle = 1,
    Busy = 2,
}

/// One session's row. A struct so that the session policy can add fields (phase, parent)
/// without changing the table's interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SessionRecord {
    /// The index pages carry (never 0).
    pub idx: u32,
    pub standing: Standing,
    /// Table clock at the last change, for the eviction order.
    pub seq: u64,
}

/// Interned sessions, bounded.
#[derive(Debug)]
pub(crate) struct Sessions {
    ids: BTreeMap<Arc<str>, SessionRecord>,
    /// Eviction order: (standing, last change) → id. Ended sessions come first.
    order: BTreeMap<(Standing, u64), Arc<str>>,
    by_idx: HashMap<u32, Arc<str>>,
    next_idx: u32,
    seq: u64,
    /// Bytes of the ids held (for the table's memory figure).
    id_bytes: usize,
    max_sessions: usize,
    max_id_bytes: usize,
}

impl Default for Sessions {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_SESSIONS, DEFAULT_MAX_ID_BYTES)
    }
}

/// Default bound on sessions held.
pub const DEFAULT_MAX_SESSIONS: usize = 65_536;
/// Default limit on a session id's length in bytes.
pub const DEFAULT_MAX_ID_BYTES: usize = 1_024;

impl Sessions {
    pub fn new(max_sessions: usize, max_id_bytes: usize) -> Self {
        Self {
            ids: BTreeMap::new(),
            order: BTreeMap::new(),
            by_idx: HashMap::new(),
            next_idx: 1,
            seq: 0,
            id_bytes: 0,
            max_sessions: max_sessions.max(1),
            max_id_bytes,
        }
    }

    /// Applies new bounds; a smaller table shrinks at the next intern.
    pub fn set_limits(&mut self, max_sessions: usize, max_id_bytes: usize) {
        self.max_sessions = max_sessions.max(1);
        self.max_id_bytes = max_id_bytes;
    }

    /// The index of session `id`, interned on first use (never 0: 0 means no session).
    /// A new session in a full table frees the oldest ended one first.
    pub fn intern(&mut self, id: &str) -> Result<u32, SessionError> {
        if let Some(r) = self.ids.get(id) {
            return Ok(r.idx);
        }
        SessionError::check_id(id, self.max_id_bytes)?;
        while self.ids.len() >= self.max_sessions {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            self.forget(&victim);
        }
        let idx = self.next_idx;
        // Indices are not reused; after 2^32 - 1 sessions they wrap, skipping 0.
        self.next_idx = self.next_idx.checked_add(1).unwrap_or(1);
        self.seq += 1;
        let key: Arc<str> = Arc::from(id);
        self.order.insert((Standing::Busy, self.seq), key.clone());
        self.id_bytes += id.len();
        self.by_idx.insert(idx, key.clone());
        self.ids.insert(
            key,
            SessionRecord {
                idx,
                standing: Standing::Busy,
                seq: self.seq,
            },
        );
        Ok(idx)
    }

    fn forget(&mut self, id: &str) {
        if let Some(r) = self.ids.remove(id) {
            self.by_idx.remove(&r.idx);
            self.id_bytes -= id.len();
        }
    }

    /// The index of a known session.
    pub fn get(&self, id: &str) -> Option<u32> {
        self.ids.get(id).map(|r| r.idx)
    }

    /// Sets a session's standing by id. Returns its index, or `None` when unknown.
    pub fn set_standing(&mut self, id: &str, standing: Standing) -> Option<u32> {
        self.seq += 1;
        let seq = self.seq;
        let (key, r) = self.ids.get_key_value(id)?;
        let key = key.clone();
        let old = (r.standing, r.seq);
        let idx = r.idx;
        self.order.remove(&old);
        self.order.insert((standing, seq), key);
        if let Some(r) = self.ids.get_mut(id) {
            r.standing = standing;
            r.seq = seq;
        }
        Some(idx)
    }

    /// Marks a session idle or busy by index.
    pub fn set_idle(&mut self, idx: u32, idle: bool) {
        let Some(id) = self.by_idx.get(&idx).cloned() else {
            return;
        };
        self.set_standing(&id, if idle { Standing::Idle } else { Standing::Busy });
    }

    /// Whether a session index is idle (paused, acting or ended).
    #[cfg(test)]
    pub fn is_idle(&self, idx: u32) -> bool {
        let standing = self
            .by_idx
            .get(&idx)
            .and_then(|id| self.ids.get(id))
            .map(|r| r.standing);
        standing.is_some_and(|s| s != Standing::Busy)
    }

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Approximate heap bytes of the table: ids once (shared by the three maps through an
    /// `Arc`) and a per-entry cost for the maps' nodes and the `Arc` header.
    pub fn heap_bytes(&self) -> usize {
        self.id_bytes + self.ids.len() * 160
    }

    /// Up to `limit` sessions with ids after `after` (from the first when `None`), past
    /// the first `offset` of those, in id order, each with whether it is idle and whether
    /// it ended. O(log n + offset + limit): a cursor (`after`) pages in O(log n + limit).
    pub fn list_page(&self, after: Option<&str>, offset: usize, limit: usize) -> Vec<(String, bool, bool)> {
        let lower = match after {
            Some(a) => Bound::Excluded(a),
            None => Bound::Unbounded,
        };
        self.ids
            .range::<str, _>((lower, Bound::Unbounded))
            .skip(offset)
            .take(limit)
            .map(|(id, r)| {
                (
                    id.to_string(),
                    r.standing != Standing::Busy,
                    r.standing == Standing::Ended,
                )
            })
            .collect()
    }

    /// Every session, sorted by id, with whether it is idle.
    pub fn list(&self) -> Vec<(String, bool)> {
        self.list_page(None, 0, usize::MAX)
            .into_iter()
            .map(|(id, idle, _)| (id, idle))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_intern_once_and_list_sorted_with_idle_state() {
        let mut s = Sessions::default();
        assert_eq!(s.intern("b"), Ok(1));
        assert_eq!(s.intern("a"), Ok(2));
        assert_eq!(s.intern("b"), Ok(1), "interned once");
        assert_eq!(s.get("a"), Some(2));
        assert_eq!(s.get("c"), None);
        s.set_idle(2, true);
        assert_eq!(s.list(), vec![("a".to_owned(), true), ("b".to_owned(), false)]);
        assert!(s.is_idle(2));
        s.set_idle(2, false);
        assert!(!s.is_idle(2));
    }

    #[test]
    fn a_full_table_frees_the_oldest_ended_first_and_never_reuses_an_index() {
        let mut s = Sessions::new(3, 8);
        let a = s.intern("a").unwrap();
        let b = s.intern("b").unwrap();
        let c = s.intern("c").unwrap();
        s.set_standing("c", Standing::Ended);
        s.set_standing("a", Standing::Ended);
        s.set_standing("b", Standing::Idle);
        // Full: "c" ended before "a", so it goes first.
        let d = s.intern("d").unwrap();
        assert_eq!(s.get("c"), None);
        assert_eq!(s.len(), 3);
        assert!(![a, b, c].contains(&d), "index {d} reused");
        s.intern("e").unwrap();
        assert_eq!(s.get("a"), None, "then the other ended one");
        // No ended session left: the idle one goes before busy ones.
        s.intern("f").unwrap();
        assert_eq!(s.get("b"), None);
        assert_eq!(
            s.list().into_iter().map(|(id, _)| id).collect::<Vec<_>>(),
            vec!["d", "e", "f"]
        );
        assert_eq!(s.heap_bytes(), 3 + 3 * 160);
    }

    #[test]
    fn ids_over_the_limit_are_refused_and_pages_follow_id_order() {
        let mut s = Sessions::new(100, 4);
        assert_eq!(s.intern("toolong"), Err(SessionError::IdTooLong { len: 7, max: 4 }));
        assert_eq!(s.intern(""), Err(SessionError::EmptyId));
        assert_eq!(s.len(), 0);
        for id in ["d", "a", "c", "b", "e"] {
            s.intern(id).unwrap();
        }
        s.set_standing("c", Standing::Ended);
        let first = s.list_page(None, 0, 2);
        assert_eq!(first, vec![("a".into(), false, false), ("b".into(), false, false)]);
        let second = s.list_page(Some("b"), 0, 2);
        assert_eq!(s.list_page(None, 2, 2), second, "an offset reaches the same page");
        assert_eq!(second, vec![("c".into(), true, true), ("d".into(), false, false)]);
        assert_eq!(s.list_page(Some("d"), 0, 2).len(), 1);
    }
}
