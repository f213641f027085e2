//! Sessions: one agent execution chain each, with an optional parent, a phase
//! (reasoning or acting, active or paused) and a working set per tier.
//!
//! The [`SessionTable`] interns each `session_id` to a small `u32` index (0 is reserved for
//! "no session") so the page directory can store the session that owns a page in its fixed
//! record. Sessions end explicitly or after an idle timeout measured on a [`Clock`], so the
//! daemon (system time) and `kvtier replay` (simulated time) share the same code.
//! [`lineage`] keeps the radix tree of page-hash chains, [`pressure`] decides pauses and
//! resumptions, [`trace`] writes the per-request records that replay reads back, and
//! [`trace_log`] the daemon's rotated request traces in the Mooncake format. `registry` is
//! the manager's bounded table of every session an engine names (the index pages carry,
//! busy, idle or ended), kept whether or not the session policy runs. One error type,
//! [`SessionError`], serves them all.

pub mod lineage;
pub mod pressure;
pub(crate) mod registry;
pub mod trace;
pub mod trace_log;

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use crate::clock::Clock;
use crate::tier::TierKind;

/// Longest accepted `session_id`, in bytes.
pub const MAX_SESSION_ID_BYTES: usize = 1024;
/// Pause durations kept per session for reporting (older ones are folded into the totals).
const MAX_PAUSES_KEPT: usize = 256;

/// Why a session call was refused: the one error type of sessions, for the registry, the
/// policy's table and the policy alike.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SessionError {
    #[error("session id of {len} bytes is over the limit of {max} bytes")]
    IdTooLong { len: usize, max: usize },
    #[error("the empty string is not a session id")]
    EmptyId,
    #[error("unknown session index {0}")]
    Unknown(u32),
    #[error("the session table is full ({0} sessions)")]
    Full(usize),
}

impl SessionError {
    /// Checks a session id: 1 to `max` bytes.
    pub fn check_id(id: &str, max: usize) -> Result<(), SessionError> {
        if id.is_empty() {
            return Err(SessionError::EmptyId);
        }
        if id.len() > max {
            return Err(SessionError::IdTooLong { len: id.len(), max });
        }
        Ok(())
    }
}

/// What a session is doing: generating (reasoning) or waiting on a tool (acting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Activity {
    Reasoning,
    Acting,
}

/// One live session.
#[derive(Clone, Debug, Serialize)]
pub struct Session {
    pub id: String,
    /// The parent's id as the engine gave it (the parent may have ended).
    pub parent_id: Option<String>,
    /// The parent's index while it is live.
    pub parent: Option<u32>,
    pub activity: Activity,
    pub paused: bool,
    /// Marked to pause at its next tool boundary (set on reasoning sessions under pressure).
    pub pause_pending: bool,
    /// Tokens the session holds in each tier (device, host, pool), from actual token counts.
    pub working_set: [u64; 3],
    /// Tokens of the session's context as of its last request (prompt + completion).
    pub context_tokens: u64,
    pub started_ms: u64,
    pub last_activity_ms: u64,
    pub paused_since_ms: Option<u64>,
    /// Resumed sessions are preferred until then.
    pub boost_until_ms: u64,
    /// Durations of finished pauses, most recent last (bounded).
    pub pauses_ms: Vec<u64>,
    pub total_paused_ms: u64,
}

impl Session {
    /// Paused or acting: its pages may go first under pressure.
    pub fn is_idle(&self) -> bool {
        self.paused || self.activity == Activity::Acting
    }

    /// Total working set over every tier, in tokens.
    pub fn total_tokens(&self) -> u64 {
        self.working_set.iter().sum()
    }
}

/// Why a session ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    Explicit,
    IdleTimeout,
}

/// Live sessions, interned to `u32` indices (0: none).
#[derive(Debug)]
pub struct SessionTable {
    clock: Arc<dyn Clock>,
    by_id: HashMap<String, u32>,
    /// Slot `i` holds index `i + 1`.
    slots: Vec<Option<Session>>,
    free: Vec<u32>,
    max_sessions: usize,
    idle_timeout_ms: u64,
}

impl SessionTable {
    /// A table of at most `max_sessions` live sessions that ends a session after
    /// `idle_timeout_ms` without activity.
    pub fn new(clock: Arc<dyn Clock>, max_sessions: usize, idle_timeout_ms: u64) -> Self {
        Self {
            clock,
            by_id: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            max_sessions,
            idle_timeout_ms,
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Opens a session (reasoning, active) or returns the index of the live one with that id.
    pub fn open(&mut self, id: &str, parent_id: Option<&str>) -> Result<u32, SessionError> {
        SessionError::check_id(id, MAX_SESSION_ID_BYTES)?;
        if let Some(&idx) = self.by_id.get(id) {
            self.touch(idx)?;
            return Ok(idx);
        }
        if self.len() >= self.max_sessions {
            return Err(SessionError::Full(self.max_sessions));
        }
        let now = self.now_ms();
        let parent = parent_id.and_then(|p| self.by_id.get(p).copied());
        let session = Session {
            id: id.to_owned(),
            parent_id: parent_id.map(|p| p.chars().take(MAX_SESSION_ID_BYTES).collect()),
            parent,
            activity: Activity::Reasoning,
            paused: false,
            pause_pending: false,
            working_set: [0; 3],
            context_tokens: 0,
            started_ms: now,
            last_activity_ms: now,
            paused_since_ms: None,
            boost_until_ms: 0,
            pauses_ms: Vec::new(),
            total_paused_ms: 0,
        };
        let idx = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize - 1] = Some(session);
                i
            }
            None => {
                self.slots.push(Some(session));
                self.slots.len() as u32
            }
        };
        self.by_id.insert(id.to_owned(), idx);
        Ok(idx)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether a new session would find the table full.
    pub fn is_full(&self) -> bool {
        self.len() >= self.max_sessions
    }

    /// The idle (acting or paused) session with the oldest activity: the one a full table
    /// frees for a new session. `None` when every session is active.
    pub fn oldest_idle(&self) -> Option<u32> {
        self.iter()
            .filter(|(_, s)| s.is_idle())
            .min_by_key(|(i, s)| (s.last_activity_ms, *i))
            .map(|(i, _)| i)
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub fn index_of(&self, id: &str) -> Option<u32> {
        self.by_id.get(id).copied()
    }

    pub fn get(&self, idx: u32) -> Option<&Session> {
        idx.checked_sub(1)
            .and_then(|i| self.slots.get(i as usize))
            .and_then(Option::as_ref)
    }

    fn get_mut(&mut self, idx: u32) -> Result<&mut Session, SessionError> {
        idx.checked_sub(1)
            .and_then(|i| self.slots.get_mut(i as usize))
            .and_then(Option::as_mut)
            .ok_or(SessionError::Unknown(idx))
    }

    /// Live sessions with their indices.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &Session)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i as u32 + 1, s)))
    }

    /// Whether the page owner `idx` is paused or acting. Index 0 and ended sessions are not idle.
    pub fn is_idle(&self, idx: u32) -> bool {
        self.get(idx).is_some_and(Session::is_idle)
    }

    /// Records activity (resets the idle timeout).
    pub fn touch(&mut self, idx: u32) -> Result<(), SessionError> {
        let now = self.now_ms();
        self.get_mut(idx)?.last_activity_ms = now;
        Ok(())
    }

    /// Tool-call start (`Acting`) or end (`Reasoning`). A session marked to pause does so
    /// as it reaches the tool boundary. Returns whether the session paused now.
    pub fn set_activity(&mut self, idx: u32, activity: Activity) -> Result<bool, SessionError> {
        let now = self.now_ms();
        let s = self.get_mut(idx)?;
        s.activity = activity;
        s.last_activity_ms = now;
        if activity == Activity::Acting && s.pause_pending && !s.paused {
            s.pause_pending = false;
            s.paused = true;
            s.paused_since_ms = Some(now);
            return Ok(true);
        }
        Ok(false)
    }

    /// Sets the tokens the session holds in `tier`.
    pub fn set_working_set(&mut self, idx: u32, tier: TierKind, tokens: u64) -> Result<(), SessionError> {
        self.get_mut(idx)?.working_set[tier.index()] = tokens;
        Ok(())
    }

    /// Records the actual token counts of a finished request: the context is now
    /// `prompt + completion` tokens.
    pub fn record_tokens(&mut self, idx: u32, prompt: u64, completion: u64) -> Result<(), SessionError> {
        let s = self.get_mut(idx)?;
        s.context_tokens = prompt.saturating_add(completion);
        Ok(())
    }

    pub(crate) fn mark_pause(&mut self, idx: u32) -> Result<(), SessionError> {
        self.get_mut(idx)?.pause_pending = true;
        Ok(())
    }

    /// Pauses a session now (its pages become eviction candidates first).
    pub fn pause(&mut self, idx: u32) -> Result<(), SessionError> {
        let now = self.now_ms();
        let s = self.get_mut(idx)?;
        if !s.paused {
            s.paused = true;
            s.pause_pending = false;
            s.paused_since_ms = Some(now);
        }
        Ok(())
    }

    /// Lets a paused session back with a priority boost until `now + boost_ms`. Returns the
    /// pause's duration, or `None` when it was not paused.
    pub fn resume(&mut self, idx: u32, boost_ms: u64) -> Result<Option<u64>, SessionError> {
        let now = self.now_ms();
        let s = self.get_mut(idx)?;
        if !s.paused {
            return Ok(None);
        }
        let d = now.saturating_sub(s.paused_since_ms.unwrap_or(now));
        s.paused = false;
        s.paused_since_ms = None;
        s.boost_until_ms = now.saturating_add(boost_ms);
        s.total_paused_ms = s.total_paused_ms.saturating_add(d);
        if s.pauses_ms.len() >= MAX_PAUSES_KEPT {
            s.pauses_ms.remove(0);
        }
        s.pauses_ms.push(d);
        Ok(Some(d))
    }

    /// Whether a resumed session is still within its priority boost.
    pub fn is_boosted(&self, idx: u32) -> bool {
        let now = self.now_ms();
        self.get(idx).is_some_and(|s| s.boost_until_ms > now)
    }

    /// Ends a session explicitly and returns its last state. A pause still open counts.
    pub fn end(&mut self, idx: u32) -> Result<Session, SessionError> {
        self.resume(idx, 0)?;
        let i = idx.checked_sub(1).ok_or(SessionError::Unknown(idx))?;
        let s = self
            .slots
            .get_mut(i as usize)
            .and_then(Option::take)
            .ok_or(SessionError::Unknown(idx))?;
        self.by_id.remove(&s.id);
        self.free.push(idx);
        for slot in self.slots.iter_mut().flatten() {
            if slot.parent == Some(idx) {
                slot.parent = None;
            }
        }
        Ok(s)
    }

    /// Ends every session idle for at least the idle timeout; returns them with their indices.
    pub fn expire_idle(&mut self) -> Vec<(u32, Session)> {
        let now = self.now_ms();
        let expired: Vec<u32> = self
            .iter()
            .filter(|(_, s)| now.saturating_sub(s.last_activity_ms) >= self.idle_timeout_ms)
            .map(|(i, _)| i)
            .collect();
        expired
            .into_iter()
            .filter_map(|i| self.end(i).ok().map(|s| (i, s)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SimClock;

    fn table() -> (Arc<SimClock>, SessionTable) {
        let clock = SimClock::new();
        let t = SessionTable::new(clock.clone(), 4, 1_000);
        (clock, t)
    }

    #[test]
    fn interning_reserves_zero_and_reuses_indices() {
        let (_, mut t) = table();
        let a = t.open("a", None).unwrap();
        let b = t.open("b", Some("a")).unwrap();
        assert_eq!((a, b), (1, 2));
        assert_eq!(t.open("a", None).unwrap(), 1);
        assert_eq!(t.get(b).unwrap().parent, Some(a));
        assert!(t.get(0).is_none() && !t.is_idle(0));
        t.end(a).unwrap();
        assert_eq!(t.get(b).unwrap().parent, None);
        assert_eq!(t.open("c", None).unwrap(), 1);
        assert_eq!(t.open("", None), Err(SessionError::EmptyId));
        t.open("d", None).unwrap();
        t.open("e", None).unwrap();
        assert_eq!(t.open("f", None), Err(SessionError::Full(4)));
    }

    #[test]
    fn acting_or_paused_is_idle_and_pending_pause_waits_for_the_tool_boundary() {
        let (clock, mut t) = table();
        let a = t.open("a", None).unwrap();
        assert!(!t.is_idle(a));
        t.mark_pause(a).unwrap();
        assert!(!t.is_idle(a), "a reasoning session is never preempted");
        clock.advance(10);
        assert!(t.set_activity(a, Activity::Acting).unwrap());
        assert!(t.get(a).unwrap().paused && t.is_idle(a));
        clock.advance(40);
        assert_eq!(t.resume(a, 1_000).unwrap(), Some(40));
        assert!(t.is_boosted(a));
        clock.advance(1_000);
        assert!(!t.is_boosted(a));
        assert!(t.is_idle(a), "still acting");
        t.set_activity(a, Activity::Reasoning).unwrap();
        assert!(!t.is_idle(a));
    }

    #[test]
    fn idle_timeout_ends_sessions_on_the_clock() {
        let (clock, mut t) = table();
        let a = t.open("a", None).unwrap();
        let b = t.open("b", None).unwrap();
        t.set_working_set(a, TierKind::Host, 512).unwrap();
        t.record_tokens(a, 400, 112).unwrap();
        clock.advance(600);
        t.touch(b).unwrap();
        clock.advance(400);
        let ended = t.expire_idle();
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].0, a);
        assert_eq!(ended[0].1.total_tokens(), 512);
        assert_eq!(ended[0].1.context_tokens, 512);
        assert_eq!(t.index_of("b"), Some(b));
        assert!(t.index_of("a").is_none());
    }
}
