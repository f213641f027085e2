//! The session table: session ids interned to the small index pages carry, and which
//! sessions are idle (paused, or acting: waiting on a tool).
//!
//! It has its own lock so that listing sessions (an admin render) or a session changing
//! phase never waits on the directory, and eviction reads the idle set as a copy taken
//! before it looks at the directory. The sessions issue builds its policy on this table.

use std::collections::{HashMap, HashSet};

/// Interned sessions and their idle state.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    ids: HashMap<String, u32>,
    idle: HashSet<u32>,
}

impl Sessions {
    /// The index of session `id`, interned on first use (never 0: 0 means no session).
    pub fn intern(&mut self, id: &str) -> u32 {
        if let Some(&idx) = self.ids.get(id) {
            return idx;
        }
        let next = self.ids.len() as u32 + 1;
        self.ids.insert(id.to_owned(), next);
        next
    }

    /// The index of a known session.
    pub fn get(&self, id: &str) -> Option<u32> {
        self.ids.get(id).copied()
    }

    pub fn set_idle(&mut self, idx: u32, idle: bool) {
        if idle {
            self.idle.insert(idx);
        } else {
            self.idle.remove(&idx);
        }
    }

    /// A copy of the idle set, for eviction to consult without this lock.
    pub fn idle_snapshot(&self) -> HashSet<u32> {
        self.idle.clone()
    }

    /// Every session, sorted by id, with whether it is idle.
    pub fn list(&self) -> Vec<(String, bool)> {
        let mut out: Vec<(String, bool)> = self
            .ids
            .iter()
            .map(|(id, idx)| (id.clone(), self.idle.contains(idx)))
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_intern_once_and_list_sorted_with_idle_state() {
        let mut s = Sessions::default();
        assert_eq!(s.intern("b"), 1);
        assert_eq!(s.intern("a"), 2);
        assert_eq!(s.intern("b"), 1, "interned once");
        assert_eq!(s.get("a"), Some(2));
        assert_eq!(s.get("c"), None);
        s.set_idle(2, true);
        assert_eq!(s.list(), vec![("a".to_owned(), true), ("b".to_owned(), false)]);
        assert_eq!(s.idle_snapshot(), HashSet::from([2]));
        s.set_idle(2, false);
        assert!(s.idle_snapshot().is_empty());
    }
}
