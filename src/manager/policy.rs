//! The manager's side of the session-aware policy (`crate::policy::session`): it feeds the
//! policy what engines and routers report, and carries out the moves it returns on the
//! real tiers — demotion to the pool, staging back to host with `ReadyToLoad` advice,
//! dropping host copies, retain priorities. `kvtier replay` carries out the same moves on
//! its emulated tiers.
//!
//! The component, [`SessionPolicyPart`], owns the policy, the advice kept for routers,
//! the queue of pool moves (`moves`) and the session event log. Its calls take the
//! manager whose tiers they move pages on; they reach the tiers only through the
//! manager's methods and the components it hands out (pages, sessions, queues, stores).
//!
//! The policy sits behind its own lock ([`Rank::Policy`], the last), taken alone: every
//! call takes it, gets the decisions and lets it go before any move touches the
//! directory, so a policy call never holds a lock a lookup needs.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::locks::{Ordered, Rank};
use super::moves::PolicyMoves;
use super::pages::Pages;
use super::queues::{Advice as EngineAdvice, EngineQueues};
use super::session_events::{AdviceCause, SessionEventLog};
use super::state::DirState;
use super::tiers::Mover;
use super::{Manager, ManagerError, SessionRegistry, Stores};
use crate::clock::Clock;
use crate::directory::PageId;
use crate::page::{NamespaceId, PageHash};
use crate::policy::{
    Advice, Decisions, Move, Phase, PolicyStats, RequestEnd, SessionClass, SessionPolicy, SessionView, Usage,
};
use crate::tier::TierKind;
use crate::transfer::TransferEngine;

/// Pause and resume advice kept for routers (oldest dropped past this).
const MAX_ROUTER_ADVICE: usize = 4096;

/// The policy and the advice it gave routers that no router has read yet.
struct PolicyState {
    policy: SessionPolicy,
    advice: VecDeque<Advice>,
}

/// The session-aware policy as a component: it owns the policy and the pause and resume
/// advice kept for routers, behind its own lock ([`Rank::Policy`], taken alone), the
/// queue of its pool moves and the numbered session events. Without a configured policy
/// every read answers empty and every call decides nothing.
pub struct SessionPolicyPart {
    state: Option<Mutex<PolicyState>>,
    /// The pool moves of policy calls, drained in order on the transfer workers.
    pub(super) moves: PolicyMoves,
    /// Pauses and resumes for routers, read from a sequence (a leaf lock).
    events: SessionEventLog,
    clock: Arc<dyn Clock>,
    /// The transfer workers the move queue's drainer runs on (shared with the manager).
    pub(super) xfer: Arc<TransferEngine>,
}

impl SessionPolicyPart {
    pub(super) fn new(policy: Option<SessionPolicy>, clock: Arc<dyn Clock>, xfer: Arc<TransferEngine>) -> Self {
        Self {
            state: policy.map(|policy| {
                Mutex::new(PolicyState {
                    policy,
                    advice: VecDeque::new(),
                })
            }),
            moves: PolicyMoves::default(),
            events: SessionEventLog::default(),
            clock,
            xfer,
        }
    }

    /// The session event log: the pressure controller's pauses and resumes, which every
    /// reader reads from its own sequence (none takes them from the advice queues).
    pub fn events(&self) -> &SessionEventLog {
        &self.events
    }

    /// Runs `f` on the policy under its lock; `None` without a policy.
    pub(super) fn with<R>(&self, f: impl FnOnce(&mut SessionPolicy) -> R) -> Option<R> {
        self.lock().map(|mut p| f(&mut p.policy))
    }

    fn lock(&self) -> Option<Ordered<MutexGuard<'_, PolicyState>>> {
        let p = self.state.as_ref()?;
        Some(Ordered::take(Rank::Policy, || p.lock()))
    }

    /// Holds the policy's lock (tests: proving an operation does not need it).
    #[cfg(test)]
    pub(super) fn hold(&self) -> Box<dyn super::locks::Held + '_> {
        match self.lock() {
            Some(g) => Box::new(g),
            None => Box::new(()),
        }
    }

    /// Sessions the policy keeps, sorted by id (empty with the policy off).
    pub fn views(&self) -> Vec<SessionView> {
        self.with(|p| p.sessions()).unwrap_or_default()
    }

    /// The policy's view of some sessions (phase, parent, chain length), in the order
    /// asked; `None` where the policy does not keep one. One lock take for the lot.
    pub fn views_of<'a>(&self, ids: impl Iterator<Item = &'a str>) -> Vec<Option<SessionView>> {
        match self.lock() {
            Some(p) => ids.map(|id| p.policy.session(id)).collect(),
            None => ids.map(|_| None).collect(),
        }
    }

    /// The policy's counters (pauses, paused time, pages demoted and staged).
    pub fn stats(&self) -> Option<PolicyStats> {
        self.with(|p| p.stats())
    }

    /// Takes the pause and resume advice given since the last call (for routers).
    pub fn take_advice(&self) -> Vec<Advice> {
        self.lock().map_or_else(Vec::new, |mut p| p.advice.drain(..).collect())
    }

    /// Keeps a call's advice for routers (the oldest dropped past [`MAX_ROUTER_ADVICE`])
    /// and returns it for engines: each session's namespace (`None` when it stored no
    /// page yet), its id, and whether it is a pause.
    fn keep_advice(&self, advice: Vec<Advice>) -> Vec<(Option<NamespaceId>, String, bool)> {
        let mut to_engines = Vec::with_capacity(advice.len());
        if let Some(mut p) = self.lock() {
            for a in advice {
                let (id, pause) = match &a {
                    Advice::Pause { session_id } => (session_id, true),
                    Advice::Resume { session_id, .. } => (session_id, false),
                };
                to_engines.push((p.policy.session_ns(id), id.clone(), pause));
                if p.advice.len() >= MAX_ROUTER_ADVICE {
                    p.advice.pop_front();
                }
                p.advice.push_back(a);
            }
        }
        to_engines
    }
}

impl SessionPolicyPart {
    /// A session changed phase (an engine through its client, or a router through the
    /// admin socket). Acting and paused sessions' pages are evicted first; the policy
    /// decides what moves, on `m`'s tiers. A refused call (bad id, a parent cycle)
    /// changes nothing.
    pub fn phase(&self, m: &Manager, id: &str, parent: Option<&str>, phase: Phase) -> Result<(), ManagerError> {
        let usage = host_usage(m.stores(), m.pages());
        let decisions = self.with(|p| p.phase_changed(id, parent, phase, usage)).transpose()?;
        // The session table follows the phase (acting and paused are idle, an ended
        // session is freed first). The eviction class of the session's pages is the
        // policy's decision, carried out with its moves; without the policy, idle and
        // ended sessions' pages go first.
        let idle = matches!(phase, Phase::Acting | Phase::Paused);
        let ended = phase == Phase::Ended;
        match decisions {
            Some(d) => {
                m.session_registry().set_phase(id, idle, ended)?;
                // A resume waits for its staging (see `moves`); a demotion does not.
                let resume = phase == Phase::Reasoning;
                self.apply_decisions(m, d, Some((AdviceCause::Phase, usage)), resume);
            }
            None => {
                m.session_registry().changed(m.pages(), id, idle, ended)?;
            }
        }
        Ok(())
    }

    /// The engine stored `hashes` for `session`: they join the session's chain.
    pub fn page_stored(&self, session: &str, ns: NamespaceId, hashes: &[PageHash]) -> Result<(), ManagerError> {
        if session.is_empty() {
            return Ok(());
        }
        self.with(|p| p.page_stored(session, ns, hashes)).transpose()?;
        Ok(())
    }

    /// `loaded` leading pages of `hashes` were loaded to device for `session`.
    pub(super) fn page_hit(
        &self,
        m: &Manager,
        session: Option<&str>,
        ns: NamespaceId,
        hashes: &[PageHash],
        loaded: usize,
    ) {
        if let Some(d) = self.with(|p| p.page_hit(session, ns, hashes, loaded)) {
            self.apply_decisions(m, d, None, false);
        }
    }

    /// A request ended: its chain becomes its session's (lineage).
    pub fn request_ended(&self, m: &Manager, end: &RequestEnd) -> Result<(), ManagerError> {
        m.inner.cfg.check_batch(end.hashes.len())?;
        if let Some(d) = self.with(|p| p.request_ended(end)).transpose()? {
            self.apply_decisions(m, d, None, false);
        }
        Ok(())
    }

    /// The policy's periodic step on host utilisation (from the manager's `tick`).
    pub(super) fn tick(&self, m: &Manager) {
        let usage = host_usage(m.stores(), m.pages());
        let Some(d) = self.with(|p| p.tick(usage)) else {
            return;
        };
        // The tick runs on the upkeep task's blocking thread and waits for its moves, so
        // watermark eviction after it sees the room a demotion made.
        self.apply_decisions(m, d, Some((AdviceCause::Tick, usage)), true);
    }

    /// Carries out the class changes and the moves that only touch the directory here,
    /// and hands the pool moves (demote, stage) to the move queue (`moves`), which keeps
    /// the advice and session `events` until they are done: a resumed session's pages are
    /// staged by the time anyone hears of it. Without pool moves the advice is kept now.
    /// With `wait`, returns once the pool moves are done (or the move queue's wait has
    /// passed). No lock is held here.
    fn apply_decisions(&self, m: &Manager, d: Decisions, events: Option<(AdviceCause, Usage)>, wait: bool) {
        for c in &d.classes {
            apply_class(m.session_registry(), m.pages(), &c.session_id, c.class);
        }
        let mut pool_moves = Vec::new();
        for mv in d.moves {
            match mv {
                Move::Demote { .. } | Move::Stage { .. } => pool_moves.push(mv),
                other => apply_pool_move(m, other),
            }
        }
        if pool_moves.is_empty() {
            self.finish_moves(m, d.advice, events);
        } else {
            self.queue_moves(
                m,
                super::moves::MoveBatch {
                    moves: pool_moves,
                    advice: d.advice,
                    events,
                },
                wait,
            );
        }
    }

    /// Keeps a policy call's advice for routers and engines and numbers its pauses and
    /// resumes as session events, once its moves are done.
    pub(super) fn finish_moves(&self, m: &Manager, advice: Vec<Advice>, events: Option<(AdviceCause, Usage)>) {
        if let Some((cause, usage)) = events {
            // Numbered after their moves: a resumed session's pages are staged by the
            // time a router hears of it.
            self.events.record(&advice, cause, usage, self.clock.now_ms());
        }
        if advice.is_empty() {
            return;
        }
        // Routers read the advice at the admin socket; engines in their advice stream,
        // in the namespace the session's pages are in.
        let to_engines = self.keep_advice(advice);
        advise_engines(m.engine_queues(), m.pages(), to_engines);
    }
}

/// Host utilisation in pages (slots over the largest page's object count).
fn host_usage(stores: &Stores, pages: &Pages) -> Usage {
    let Some(arena) = stores.arena() else {
        return Usage::default();
    };
    let objs = pages.largest_page_objects() as u64;
    Usage {
        used_pages: arena.used() as u64 / objs,
        capacity_pages: arena.slots() as u64 / objs,
        pool: stores.pool().is_some(),
    }
}

/// Puts a session's pages in the eviction class the policy chose (the same directory
/// calls `kvtier replay` makes). A session the table no longer holds has no pages to move.
fn apply_class(sessions: &SessionRegistry, pages: &Pages, id: &str, class: SessionClass) {
    let Some(idx) = sessions.get(id) else {
        return;
    };
    match class {
        SessionClass::Normal => pages.reclass_session(idx, false, false),
        SessionClass::Idle => pages.reclass_session(idx, true, false),
        SessionClass::Ended => {
            // Ended by the policy's idle timeout too: the table frees it first.
            sessions.set_standing(id, crate::session::registry::Standing::Ended);
            pages.reclass_session(idx, true, true);
        }
    }
}

/// Carries out one move on the calling thread, on `m`'s tiers (demote and stage do pool
/// I/O: the move queue's drainer calls them).
pub(super) fn apply_pool_move(m: &Manager, mv: Move) {
    match mv {
        Move::Demote { ns, hashes } => m.mover().demote_pages(ns, &hashes),
        Move::Stage { ns, hashes } => stage_and_advise(&m.mover(), m.engine_queues(), ns, &hashes),
        Move::DropHost { ns, hashes } => {
            // Host copies of pages on device now (exclusive tiers): a colder copy is not needed.
            let mover = m.mover();
            let pages = complete_ids(&mover.read(), ns, &hashes, TierKind::Host);
            mover.drop_host_if_held(&pages, TierKind::Device);
        }
        Move::Retain {
            ns,
            hashes,
            priority,
            disown,
        } => m.pages().set_retain(ns, &hashes, priority, disown),
    }
}

/// Queues Pause and Resume advice for engines. A session that stored no pages yet has no
/// namespace: every namespace hears of it (the engine that runs it is in one).
fn advise_engines(queues: &EngineQueues, pages: &Pages, advice: Vec<(Option<NamespaceId>, String, bool)>) {
    let all: Vec<NamespaceId> = if advice.iter().any(|(ns, _, _)| ns.is_none()) {
        pages.read().dir.namespaces().map(|(id, _, _)| id).collect()
    } else {
        Vec::new()
    };
    let mut q = queues.lock();
    for (ns, session_id, pause) in advice {
        let targets = ns.map_or_else(|| all.clone(), |ns| vec![ns]);
        for ns in targets {
            let session_id = session_id.clone();
            q.push_advice(if pause {
                EngineAdvice::Pause { ns, session_id }
            } else {
                EngineAdvice::Resume { ns, session_id }
            });
        }
    }
}

impl Manager {
    /// The session policy: its sessions, counters, the advice kept for routers, and the
    /// calls that feed it (phases, stores, request ends), carried out on these tiers.
    pub fn session_policy(&self) -> &SessionPolicyPart {
        &self.inner.policy
    }
}

/// Brings the pool's copies of the pages back into host, then tells the engine which
/// of them are ready to load, in order.
fn stage_and_advise(mover: &Mover<'_>, queues: &EngineQueues, ns: NamespaceId, hashes: &[PageHash]) {
    for chunk in hashes.chunks(mover.cfg.max_batch.max(1)) {
        let in_pool = {
            let st = mover.read();
            hashes_where(&st, ns, chunk, |id| {
                st.dir.is_complete(id, TierKind::Pool) && !st.dir.is_complete(id, TierKind::Host)
            })
        };
        if !in_pool.is_empty() {
            mover.stage_pages_from_pool(ns, &in_pool);
        }
        let ready = {
            let st = mover.read();
            hashes_where(&st, ns, chunk, |id| st.dir.is_complete(id, TierKind::Host))
        };
        if !ready.is_empty() {
            queues
                .lock()
                .push_advice(EngineAdvice::ReadyToLoad { ns, hashes: ready });
        }
    }
}

impl Mover<'_> {
    /// Writes the pages to the pool, then drops the host copies of those the pool now
    /// holds whole (a failed pool write keeps its host copy: nothing is lost).
    pub(super) fn demote_pages(&self, ns: NamespaceId, hashes: &[PageHash]) {
        for chunk in hashes.chunks(self.cfg.max_batch.max(1)) {
            let pages = complete_ids(&self.read(), ns, chunk, TierKind::Host);
            if pages.is_empty() {
                continue;
            }
            self.copy_to_pool(ns, &pages, false);
            self.drop_host_if_held(&pages, TierKind::Pool);
        }
    }

    /// Host copies of `pages` that `held_in` holds whole (the pool after a demotion, the
    /// device with exclusive tiers), when the host copy is not needed: dropped unless
    /// leased, pinned or in flight.
    pub(super) fn drop_host_if_held(&self, pages: &[PageId], held_in: TierKind) {
        let mut st = self.write();
        let gt = self.grants();
        for &p in pages {
            if st.dir.is_complete(p, TierKind::Host)
                && st.dir.is_complete(p, held_in)
                && !gt.leased(p)
                && !st.dir.is_pinned(p, TierKind::Host)
                && !st.dir.is_inflight(p, TierKind::Host)
            {
                self.drop_host_page(&mut st, p);
            }
        }
    }
}

/// The pages of `hashes` the directory knows whose record `keep` accepts, in order.
fn hashes_where(st: &DirState, ns: NamespaceId, hashes: &[PageHash], keep: impl Fn(PageId) -> bool) -> Vec<PageHash> {
    hashes
        .iter()
        .copied()
        .filter(|h| st.dir.find(ns, h).is_some_and(&keep))
        .collect()
}

/// The pages of `hashes` the directory holds complete in `tier`.
fn complete_ids(st: &DirState, ns: NamespaceId, hashes: &[PageHash], tier: TierKind) -> Vec<PageId> {
    hashes
        .iter()
        .filter_map(|h| st.dir.find(ns, h))
        .filter(|&id| st.dir.is_complete(id, tier))
        .collect()
}
