//! The session-aware tiering policy: the one component that decides which pages move
//! because of what agent sessions do. The daemon's manager and `kvtier replay` drive it
//! through the same five calls — [`SessionPolicy::page_stored`], [`SessionPolicy::page_hit`],
//! [`SessionPolicy::phase_changed`], [`SessionPolicy::request_ended`] and
//! [`SessionPolicy::tick`] — and carry out the [`Move`]s, [`Advice`] and eviction-class
//! changes ([`ClassChange`]) it returns, so what the replay measures is what the daemon
//! runs. The class decides which pages the directory's eviction order takes first; the
//! rule is `SessionPolicy::idle_class`: idle sessions' pages go first where a pool takes
//! them (a demotion, undone when the tool ends), ended sessions' always.
//!
//! It keeps the sessions (phase, parent, the page chain of each, in the lineage radix tree)
//! and runs the pressure controller on the utilisation its caller measures (the daemon's
//! host tier). It knows page hashes, never page records: the caller maps moves onto its
//! tiers. Which signals it acts on is configuration ([`Signals`]), so the replay can show
//! what each contributes.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::PolicyError;
use crate::clock::Clock;
use crate::page::{NamespaceId, PageHash};
use crate::session::lineage::Lineage;
use crate::session::pressure::{PressureConfig, PressureController};
use crate::session::{Activity, MAX_SESSION_ID_BYTES, SessionError, SessionTable};

/// Retain priority of a page that two or more sessions used (kept longest).
pub const SHARED_PRIORITY: i8 = 1;
/// Retain priority of a page only an ended session used (goes first).
pub const ENDED_PRIORITY: i8 = -1;
/// Longest parent chain followed when checking for a cycle.
const MAX_PARENT_DEPTH: usize = 4096;

/// Why the policy refused a call. Nothing is changed when it does.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SessionPolicyError {
    #[error("session {session:?} cannot have parent {parent:?}: that makes a cycle")]
    ParentCycle { session: String, parent: String },
    #[error(transparent)]
    Table(#[from] SessionError),
}

/// What a session is doing, as engines and routers report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Generating: its pages are in use.
    Reasoning,
    /// Waiting on a tool: its private pages may be demoted.
    Acting,
    /// Paused by the pressure controller or a router.
    Paused,
    /// Done: its pages no live session holds lose their priority.
    Ended,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Reasoning => "reasoning",
            Phase::Acting => "acting",
            Phase::Paused => "paused",
            Phase::Ended => "ended",
        }
    }
}

/// The session signals the policy acts on; each can be turned off to measure it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Signals {
    /// Pages on a chain two or more sessions used are retained longest. Default: true.
    pub lineage: bool,
    /// Acting sessions' private pages are demoted under pressure and staged back when the
    /// tool ends. Default: true.
    pub phases: bool,
    /// The pressure controller pauses and resumes sessions. Default: true.
    pub pressure: bool,
    /// An ended session's private pages go first. Default: true.
    pub ended: bool,
}

impl Default for Signals {
    fn default() -> Self {
        Self::ALL
    }
}

impl Signals {
    pub const ALL: Signals = Signals {
        lineage: true,
        phases: true,
        pressure: true,
        ended: true,
    };
    pub const NONE: Signals = Signals {
        lineage: false,
        phases: false,
        pressure: false,
        ended: false,
    };
}

/// Settings of [`SessionPolicy`] (config key `policy`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionPolicyConfig {
    /// Watermarks (on host utilisation in the daemon), resume buffer (in pages here),
    /// boost and forced-resume cap. Default: pause at 0.95, target 0.80, resume at 0.85,
    /// 16 pages a resumed session, 1 s boost, 30 minutes cap.
    pub pressure: PressureConfig,
    /// An acting session's private pages are demoted once it has acted this long and host
    /// is above the target watermark. Default: 0 ms.
    pub demote_after_ms: u64,
    /// Drop the host copy of a page once it is loaded to device (exclusive tiers). The
    /// engine must store a page again when it frees it. Default: false.
    pub exclusive: bool,
    /// Sessions kept at once. Default: 65,536.
    pub max_sessions: usize,
    /// A session with no activity this long ends. Default: 300,000 ms.
    pub idle_timeout_ms: u64,
    /// Pages in the lineage tree. Default: 4,194,304.
    pub max_lineage_pages: usize,
    pub signals: Signals,
}

impl Default for SessionPolicyConfig {
    fn default() -> Self {
        Self {
            pressure: PressureConfig {
                resume_buffer_tokens: 16,
                ..PressureConfig::default()
            },
            demote_after_ms: 0,
            exclusive: false,
            max_sessions: 1 << 16,
            idle_timeout_ms: 300_000,
            max_lineage_pages: 1 << 22,
            signals: Signals::ALL,
        }
    }
}

/// A move the caller makes in its tiers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "move", rename_all = "snake_case")]
pub enum Move {
    /// Make sure the pool has the pages, then drop their host copies.
    Demote { ns: NamespaceId, hashes: Vec<PageHash> },
    /// Bring the pages that are in the pool back into host, then tell the engine which of
    /// the pages are ready to load.
    Stage { ns: NamespaceId, hashes: Vec<PageHash> },
    /// The pages are on device now: drop their host copies (exclusive tiers).
    DropHost { ns: NamespaceId, hashes: Vec<PageHash> },
    /// Set the pages' retain priority; with `disown` they belong to no single session
    /// any more (a prefix two sessions share).
    Retain {
        ns: NamespaceId,
        hashes: Vec<PageHash>,
        priority: i8,
        disown: bool,
    },
}

/// The eviction class the policy puts a session's pages in. The drivers keep it in the
/// directory's per-class lists (`Directory::set_session_idle`, `Directory::end_session`),
/// so the daemon and the replay evict in the same order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionClass {
    /// Ordered with everyone's pages by retain priority and recency.
    Normal,
    /// Evicted before every normal page of its tier: the session is idle and its pages
    /// are not expected back soon, or a pool takes them when they leave host.
    Idle,
    /// The session ended: its pages go first, and the driver forgets the session.
    Ended,
}

/// A session's pages change eviction class.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClassChange {
    pub session_id: String,
    pub class: SessionClass,
}

/// Advice for engines (the advice stream) and routers (admin socket, events).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "advice", rename_all = "snake_case")]
pub enum Advice {
    /// Stop admitting turns of this session: host is over its high watermark.
    Pause { session_id: String },
    /// The session may run again.
    Resume {
        session_id: String,
        forced: bool,
        paused_ms: u64,
    },
}

/// What one call decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decisions {
    pub moves: Vec<Move>,
    pub advice: Vec<Advice>,
    /// Sessions whose pages change eviction class, in order (a later change of the same
    /// session wins).
    pub classes: Vec<ClassChange>,
}

impl Decisions {
    pub fn is_empty(&self) -> bool {
        self.moves.is_empty() && self.advice.is_empty() && self.classes.is_empty()
    }

    fn extend(&mut self, other: Decisions) {
        self.moves.extend(other.moves);
        self.advice.extend(other.advice);
        self.classes.extend(other.classes);
    }

    fn class(&mut self, session_id: &str, class: SessionClass) {
        self.classes.push(ClassChange {
            session_id: session_id.to_owned(),
            class,
        });
    }
}

/// A finished request as an engine reports it: no content, only lengths and hashes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestEnd {
    pub session_id: String,
    #[serde(default)]
    pub parent_session_id: Option<String>,
    pub ns: NamespaceId,
    pub input_length: u64,
    pub output_length: u64,
    /// The prompt's page hashes, in order.
    pub hashes: Vec<PageHash>,
}

/// A tier's utilisation, in pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub used_pages: u64,
    pub capacity_pages: u64,
    /// Whether there is a pool to demote to.
    pub pool: bool,
}

/// One session as listed by `kvtier sessions`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SessionView {
    pub session_id: String,
    pub parent_session_id: Option<String>,
    pub phase: Phase,
    /// Pages on the session's chain.
    pub pages: usize,
    pub paused_ms: u64,
}

/// Counters for operators and the replay report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PolicyStats {
    pub pauses: u64,
    pub resumes: u64,
    pub forced_resumes: u64,
    pub marked_pauses: u64,
    pub early_band_marks: u64,
    pub demoted_pages: u64,
    pub staged_pages: u64,
    pub paused_ms_total: u64,
    /// Idle sessions a full session table freed for a new one.
    pub sessions_freed_full: u64,
    /// New sessions refused because every session in the full table was active.
    pub sessions_refused_full: u64,
}

#[derive(Debug, Default)]
struct Chain {
    ns: NamespaceId,
    hashes: Vec<PageHash>,
    /// Private pages were demoted and not staged back yet.
    demoted: bool,
}

/// The policy. See the module docs.
#[derive(Debug)]
pub struct SessionPolicy {
    cfg: SessionPolicyConfig,
    table: SessionTable,
    lineage: Lineage,
    pressure: PressureController,
    chains: HashMap<u32, Chain>,
    stats: PolicyStats,
    /// What freeing idle sessions for new ones decided, returned with the next call's
    /// decisions.
    freed: Decisions,
}

mod calls;
pub use calls::MAX_CHAIN_PAGES;

impl SessionPolicy {
    pub fn new(cfg: SessionPolicyConfig, clock: Arc<dyn Clock>) -> Result<Self, PolicyError> {
        Ok(Self {
            table: SessionTable::new(clock, cfg.max_sessions.max(1), cfg.idle_timeout_ms),
            lineage: Lineage::new(cfg.max_lineage_pages),
            pressure: PressureController::new(cfg.pressure)?,
            chains: HashMap::new(),
            stats: PolicyStats::default(),
            freed: Decisions::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &SessionPolicyConfig {
        &self.cfg
    }

    pub fn stats(&self) -> PolicyStats {
        self.stats
    }

    /// The policy's table index of a live session (not the index the daemon's pages
    /// carry: the manager interns sessions in its own table).
    pub fn index_of(&self, id: &str) -> Option<u32> {
        self.table.index_of(id)
    }

    /// A live session's phase.
    pub fn phase(&self, id: &str) -> Option<Phase> {
        let s = self.table.get(self.table.index_of(id)?)?;
        Some(if s.paused {
            Phase::Paused
        } else if s.activity == Activity::Acting {
            Phase::Acting
        } else {
            Phase::Reasoning
        })
    }

    /// The namespace a live session's pages are in (its chain's), if it stored any.
    pub fn session_ns(&self, id: &str) -> Option<NamespaceId> {
        self.chains.get(&self.table.index_of(id)?).map(|c| c.ns)
    }

    /// Live sessions, sorted by id.
    pub fn sessions(&self) -> Vec<SessionView> {
        let mut out: Vec<SessionView> = self.table.iter().filter_map(|(i, _)| self.view_at(i)).collect();
        out.sort_by(|a, b| a.session_id.cmp(&b.session_id));
        out
    }

    /// One session as the policy keeps it, found by id in O(1).
    pub fn session(&self, id: &str) -> Option<SessionView> {
        self.view_at(self.table.index_of(id)?)
    }

    fn view_at(&self, i: u32) -> Option<SessionView> {
        let s = self.table.get(i)?;
        Some(SessionView {
            session_id: s.id.clone(),
            parent_session_id: s.parent_id.clone(),
            phase: self.phase(&s.id)?,
            pages: self.chains.get(&i).map_or(0, |c| c.hashes.len()),
            paused_ms: s.total_paused_ms,
        })
    }

    /// The session's index, opening it (with `parent`) on first use. Checks the ids and
    /// that the parent does not lead back to the session.
    fn open(&mut self, id: &str, parent: Option<&str>) -> Result<u32, SessionPolicyError> {
        SessionError::check_id(id, MAX_SESSION_ID_BYTES)?;
        if let Some(p) = parent {
            SessionError::check_id(p, MAX_SESSION_ID_BYTES)?;
            let mut at = Some(p.to_owned());
            for _ in 0..MAX_PARENT_DEPTH {
                let Some(cur) = at.take() else { break };
                if cur == id {
                    return Err(SessionPolicyError::ParentCycle {
                        session: id.to_owned(),
                        parent: p.to_owned(),
                    });
                }
                at = self
                    .table
                    .index_of(&cur)
                    .and_then(|i| self.table.get(i))
                    .and_then(|s| s.parent_id.clone());
            }
        }
        if self.table.index_of(id).is_none() && self.table.is_full() {
            // A full table frees the session idle longest; only when every session is
            // active is the new one refused (`Full`, counted).
            match self.table.oldest_idle() {
                Some(old) => {
                    let d = self.end(old);
                    self.freed.extend(d);
                    self.stats.sessions_freed_full += 1;
                }
                None => self.stats.sessions_refused_full += 1,
            }
        }
        Ok(self.table.open(id, parent)?)
    }

    /// Decisions of sessions freed for new ones since the last call that returned some.
    fn take_freed(&mut self) -> Decisions {
        std::mem::take(&mut self.freed)
    }

    /// The pages of the session's chain that no other live session holds.
    fn private_pages(&self, idx: u32) -> Option<(NamespaceId, Vec<PageHash>)> {
        let c = self.chains.get(&idx)?;
        if !self.cfg.signals.lineage {
            return Some((c.ns, c.hashes.clone()));
        }
        let stats = self.lineage.stats(&c.hashes);
        let private = c
            .hashes
            .iter()
            .enumerate()
            .filter(|(k, _)| stats.get(*k).is_none_or(|s| s.live <= 1))
            .map(|(_, h)| *h)
            .collect();
        Some((c.ns, private))
    }

    /// Demotes the session's private pages (when there is a pool to take them).
    fn demote(&mut self, idx: u32, pool: bool) -> Decisions {
        let mut d = Decisions::default();
        if !pool || self.chains.get(&idx).is_none_or(|c| c.demoted) {
            return d;
        }
        let Some((ns, hashes)) = self.private_pages(idx) else {
            return d;
        };
        if let Some(c) = self.chains.get_mut(&idx) {
            c.demoted = true;
        }
        if !hashes.is_empty() {
            self.stats.demoted_pages += hashes.len() as u64;
            d.moves.push(Move::Demote { ns, hashes });
        }
        d
    }

    /// The class an idle (acting or paused) session's pages go in: idle first where
    /// leaving host is a demotion (a pool takes the pages, and `stage` brings them back
    /// when the tool ends). Without a pool, leaving host drops them, and an agent waiting
    /// on a tool usually comes back for its context, so they keep their place by retain
    /// priority and recency. With the phases signal off they stay in the normal class.
    fn idle_class(&self, pool: bool) -> SessionClass {
        if self.cfg.signals.phases && pool {
            SessionClass::Idle
        } else {
            SessionClass::Normal
        }
    }

    /// Stages the session's chain back (its demoted pages come from the pool) and tells
    /// the engine it is ready to load: when its pages were demoted, or always (`force`,
    /// a resumed session, whose pages eviction may have moved).
    fn stage(&mut self, idx: u32, force: bool) -> Decisions {
        let mut d = Decisions::default();
        let Some(c) = self.chains.get_mut(&idx) else { return d };
        if !c.demoted && !force {
            return d;
        }
        c.demoted = false;
        if !c.hashes.is_empty() {
            self.stats.staged_pages += c.hashes.len() as u64;
            d.moves.push(Move::Stage {
                ns: c.ns,
                hashes: c.hashes.clone(),
            });
        }
        d
    }
}

#[cfg(test)]
mod tests;
