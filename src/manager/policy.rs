//! The manager's side of the session-aware policy (`crate::policy::session`): it feeds the
//! policy what engines and routers report, and carries out the moves it returns on the
//! real tiers — demotion to the pool, staging back to host with `ReadyToLoad` advice,
//! dropping host copies, retain priorities. `kvtier replay` carries out the same moves on
//! its emulated tiers.
//!
//! The policy sits behind its own lock ([`Rank::Policy`], the last), taken alone: every
//! call takes it, gets the decisions and lets it go before any move touches the
//! directory, so a policy call never holds a lock a lookup needs.

use std::collections::VecDeque;

use parking_lot::{Mutex, MutexGuard};

use super::locks::{Ordered, Rank};
use super::queues::Advice as EngineAdvice;
use super::session_events::AdviceCause;
use super::state::DirState;
use super::{Manager, ManagerError};
use crate::directory::PageId;
use crate::page::{NamespaceId, PageHash};
use crate::policy::{
    Advice, Decisions, Move, Phase, PolicyStats, RequestEnd, SessionClass, SessionPolicy, SessionView, Usage,
};
use crate::tier::TierKind;

/// Pause and resume advice kept for routers (oldest dropped past this).
const MAX_ROUTER_ADVICE: usize = 4096;

/// The policy and the advice it gave routers that no router has read yet.
struct PolicyState {
    policy: SessionPolicy,
    advice: VecDeque<Advice>,
}

/// The session-aware policy as a component: it owns the policy and the pause and resume
/// advice kept for routers, behind its own lock ([`Rank::Policy`], taken alone). Without
/// a configured policy every read answers empty and every call decides nothing.
pub struct SessionPolicyPart {
    state: Option<Mutex<PolicyState>>,
}

impl SessionPolicyPart {
    pub(super) fn new(policy: Option<SessionPolicy>) -> Self {
        Self {
            state: policy.map(|policy| {
                Mutex::new(PolicyState {
                    policy,
                    advice: VecDeque::new(),
                })
            }),
        }
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

impl Manager {
    /// The session policy: its sessions, counters and the advice kept for routers.
    pub fn session_policy(&self) -> &SessionPolicyPart {
        &self.inner.policy
    }

    /// Host utilisation in pages (slots over the largest page's object count).
    fn host_usage(&self) -> Usage {
        let Some(arena) = self.arena() else {
            return Usage::default();
        };
        let objs = self.inner.pages.largest_page_objects() as u64;
        Usage {
            used_pages: arena.used() as u64 / objs,
            capacity_pages: arena.slots() as u64 / objs,
            pool: self.pool().is_some(),
        }
    }

    /// A session changed phase (an engine through its client, or a router through the
    /// admin socket). Acting and paused sessions' pages are evicted first; the policy
    /// decides what moves. A refused call (bad id, a parent cycle) changes nothing.
    pub fn session_phase(&self, id: &str, parent: Option<&str>, phase: Phase) -> Result<(), ManagerError> {
        let usage = self.host_usage();
        let decisions = self
            .inner
            .policy
            .with(|p| p.phase_changed(id, parent, phase, usage))
            .transpose()?;
        // The session table follows the phase (acting and paused are idle, an ended
        // session is freed first). The eviction class of the session's pages is the
        // policy's decision, carried out with its moves; without the policy, idle and
        // ended sessions' pages go first.
        let idle = matches!(phase, Phase::Acting | Phase::Paused);
        let ended = phase == Phase::Ended;
        match decisions {
            Some(d) => {
                self.session_standing(id, idle, ended)?;
                // A resume waits for its staging (see `moves`); a demotion does not.
                let resume = phase == Phase::Reasoning;
                self.apply_decisions(d, Some((AdviceCause::Phase, usage)), resume);
            }
            None => {
                self.session_changed(id, idle, ended)?;
            }
        }
        Ok(())
    }

    /// The engine stored `hashes` for `session`: they join the session's chain.
    pub fn policy_page_stored(&self, session: &str, ns: NamespaceId, hashes: &[PageHash]) -> Result<(), ManagerError> {
        if session.is_empty() {
            return Ok(());
        }
        self.inner
            .policy
            .with(|p| p.page_stored(session, ns, hashes))
            .transpose()?;
        Ok(())
    }

    /// `loaded` leading pages of `hashes` were loaded to device for `session`.
    pub fn policy_page_hit(&self, session: Option<&str>, ns: NamespaceId, hashes: &[PageHash], loaded: usize) {
        if let Some(d) = self.inner.policy.with(|p| p.page_hit(session, ns, hashes, loaded)) {
            self.apply_decisions(d, None, false);
        }
    }

    /// A request ended: its chain becomes its session's (lineage).
    pub fn request_ended(&self, end: &RequestEnd) -> Result<(), ManagerError> {
        self.check_batch(end.hashes.len())?;
        if let Some(d) = self.inner.policy.with(|p| p.request_ended(end)).transpose()? {
            self.apply_decisions(d, None, false);
        }
        Ok(())
    }

    /// The policy's periodic step on host utilisation (from `tick`).
    pub(crate) fn policy_tick(&self) {
        let usage = self.host_usage();
        let Some(d) = self.inner.policy.with(|p| p.tick(usage)) else {
            return;
        };
        // The tick runs on the upkeep task's blocking thread and waits for its moves, so
        // watermark eviction after it sees the room a demotion made.
        self.apply_decisions(d, Some((AdviceCause::Tick, usage)), true);
    }

    /// Puts a session's pages in the eviction class the policy chose (the same
    /// directory calls `kvtier replay` makes). A session the table no longer holds has
    /// no pages to move.
    fn apply_class(&self, id: &str, class: SessionClass) {
        let Some(idx) = self.inner.sessions.get(id) else {
            return;
        };
        match class {
            SessionClass::Normal => self.inner.pages.reclass_session(idx, false, false),
            SessionClass::Idle => self.inner.pages.reclass_session(idx, true, false),
            SessionClass::Ended => {
                // Ended by the policy's idle timeout too: the table frees it first.
                self.inner
                    .sessions
                    .set_standing(id, crate::session::registry::Standing::Ended);
                self.inner.pages.reclass_session(idx, true, true);
            }
        }
    }

    /// Carries out the class changes and the moves that only touch the directory here,
    /// and hands the pool moves (demote, stage) to the move queue (`moves`), which keeps
    /// the advice and session `events` until they are done: a resumed session's pages are
    /// staged by the time anyone hears of it. Without pool moves the advice is kept now.
    /// With `wait`, returns once the pool moves are done (or the move queue's wait has
    /// passed). No lock is held here.
    fn apply_decisions(&self, d: Decisions, events: Option<(AdviceCause, Usage)>, wait: bool) {
        for c in &d.classes {
            self.apply_class(&c.session_id, c.class);
        }
        let mut pool_moves = Vec::new();
        for m in d.moves {
            match m {
                Move::Demote { .. } | Move::Stage { .. } => pool_moves.push(m),
                other => self.apply_pool_move(other),
            }
        }
        if pool_moves.is_empty() {
            self.finish_moves(d.advice, events);
        } else {
            self.queue_moves(
                super::moves::MoveBatch {
                    moves: pool_moves,
                    advice: d.advice,
                    events,
                },
                wait,
            );
        }
    }

    /// Carries out one move on the calling thread (demote and stage do pool I/O: the move
    /// queue's drainer calls them).
    pub(super) fn apply_pool_move(&self, m: Move) {
        match m {
            Move::Demote { ns, hashes } => self.demote_pages(ns, &hashes),
            Move::Stage { ns, hashes } => self.stage_and_advise(ns, &hashes),
            Move::DropHost { ns, hashes } => self.drop_host_copies(ns, &hashes),
            Move::Retain {
                ns,
                hashes,
                priority,
                disown,
            } => {
                let mut st = self.write();
                for h in &hashes {
                    if let Some(id) = st.dir.find(ns, h) {
                        st.dir.order_mut().set_retain(id, priority);
                        if disown {
                            st.dir.order_mut().set_session(id, 0);
                        }
                    }
                }
            }
        }
    }

    /// Keeps a policy call's advice for routers and engines and numbers its pauses and
    /// resumes as session events, once its moves are done.
    pub(super) fn finish_moves(&self, advice: Vec<Advice>, events: Option<(AdviceCause, Usage)>) {
        if let Some((cause, usage)) = events {
            // Numbered after their moves: a resumed session's pages are staged by the
            // time a router hears of it.
            let now = self.inner.clock.now_ms();
            self.inner.session_events.record(&advice, cause, usage, now);
        }
        if advice.is_empty() {
            return;
        }
        // Routers read the advice at the admin socket; engines in their advice stream,
        // in the namespace the session's pages are in.
        let to_engines = self.inner.policy.keep_advice(advice);
        self.advise_engines(to_engines);
    }

    /// Queues Pause and Resume advice for engines. A session that stored no pages yet
    /// has no namespace: every namespace hears of it (the engine that runs it is in one).
    fn advise_engines(&self, advice: Vec<(Option<NamespaceId>, String, bool)>) {
        let all: Vec<NamespaceId> = if advice.iter().any(|(ns, _, _)| ns.is_none()) {
            self.read().dir.namespaces().map(|(id, _, _)| id).collect()
        } else {
            Vec::new()
        };
        let mut q = self.inner.queues.lock();
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

    /// Writes the pages to the pool, then drops the host copies of those the pool now
    /// holds whole (a failed pool write keeps its host copy: nothing is lost).
    fn demote_pages(&self, ns: NamespaceId, hashes: &[PageHash]) {
        for chunk in hashes.chunks(self.inner.cfg.max_batch.max(1)) {
            let pages = complete_ids(&self.read(), ns, chunk, TierKind::Host);
            if pages.is_empty() {
                continue;
            }
            self.copy_to_pool(ns, &pages, false);
            self.drop_if(&pages, |st, p| st.dir.is_complete(p, TierKind::Pool));
        }
    }

    /// Host copies of pages that are on device now (exclusive tiers), when a colder
    /// copy is not needed: dropped unless leased or pinned.
    fn drop_host_copies(&self, ns: NamespaceId, hashes: &[PageHash]) {
        let pages = complete_ids(&self.read(), ns, hashes, TierKind::Host);
        self.drop_if(&pages, |st, p| st.dir.is_complete(p, TierKind::Device));
    }

    fn drop_if(&self, pages: &[PageId], ok: impl Fn(&DirState, PageId) -> bool) {
        let mut st = self.write();
        let gt = self.grants();
        for &p in pages {
            if st.dir.is_complete(p, TierKind::Host)
                && ok(&st, p)
                && !gt.leased(p)
                && !st.dir.is_pinned(p, TierKind::Host)
                && !st.dir.is_inflight(p, TierKind::Host)
            {
                self.drop_host_page(&mut st, p);
            }
        }
    }

    /// Brings the pool's copies of the pages back into host, then tells the engine which
    /// of them are ready to load, in order.
    fn stage_and_advise(&self, ns: NamespaceId, hashes: &[PageHash]) {
        for chunk in hashes.chunks(self.inner.cfg.max_batch.max(1)) {
            let in_pool: Vec<PageHash> = {
                let st = self.read();
                chunk
                    .iter()
                    .copied()
                    .filter(|h| {
                        st.dir.find(ns, h).is_some_and(|id| {
                            st.dir.is_complete(id, TierKind::Pool) && !st.dir.is_complete(id, TierKind::Host)
                        })
                    })
                    .collect()
            };
            if !in_pool.is_empty() {
                self.stage_pages_from_pool(ns, &in_pool);
            }
            let ready: Vec<PageHash> = {
                let st = self.read();
                chunk
                    .iter()
                    .copied()
                    .filter(|h| {
                        st.dir
                            .find(ns, h)
                            .is_some_and(|id| st.dir.is_complete(id, TierKind::Host))
                    })
                    .collect()
            };
            if !ready.is_empty() {
                self.inner
                    .queues
                    .lock()
                    .push_advice(EngineAdvice::ReadyToLoad { ns, hashes: ready });
            }
        }
    }
}

/// The pages of `hashes` the directory holds complete in `tier`.
fn complete_ids(st: &DirState, ns: NamespaceId, hashes: &[PageHash], tier: TierKind) -> Vec<PageId> {
    hashes
        .iter()
        .filter_map(|h| st.dir.find(ns, h))
        .filter(|&id| st.dir.is_complete(id, tier))
        .collect()
}
