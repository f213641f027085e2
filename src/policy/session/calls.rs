//! The five calls its drivers make, and the session ends and pressure steps they lead to.

use super::{
    Advice, Decisions, ENDED_PRIORITY, Move, Phase, RequestEnd, SHARED_PRIORITY, SessionClass, SessionPolicy,
    SessionPolicyError, Usage,
};
use crate::page::{NamespaceId, PageHash};
use crate::session::Activity;
use crate::session::pressure::Action;

/// Most pages a session's chain holds (a million tokens at 16 tokens a page); pages a
/// session stores past it are not on its chain.
pub const MAX_CHAIN_PAGES: usize = 1 << 16;

impl SessionPolicy {
    /// The engine stored `hashes` for `session` (the request's pages in order; pages
    /// already stored may be among them). They join the session's chain.
    pub fn page_stored(
        &mut self,
        session: &str,
        ns: NamespaceId,
        hashes: &[PageHash],
    ) -> Result<(), SessionPolicyError> {
        let idx = self.open(session, None)?;
        self.table.touch(idx)?;
        let c = self.chains.entry(idx).or_default();
        c.ns = ns;
        // A store names the request's pages from some point of the chain on: where its
        // first page is already on the chain, the chain branches there.
        if let Some(first) = hashes.first() {
            if let Some(at) = c.hashes.iter().rposition(|h| h == first) {
                c.hashes.truncate(at);
            }
            // Up to MAX_CHAIN_PAGES: the chain's head is what subagents share, and past
            // the bound every store would re-walk an ever longer chain under the policy's
            // lock (a session whose stores never branch grew without end).
            let room = MAX_CHAIN_PAGES.saturating_sub(c.hashes.len());
            c.hashes.extend_from_slice(&hashes[..hashes.len().min(room)]);
        }
        self.lineage.insert(idx, &c.hashes);
        Ok(())
    }

    /// `hashes` of `session` were hit; `loaded` of them (a prefix) were loaded to device.
    /// With exclusive tiers their host copies go.
    pub fn page_hit(
        &mut self,
        session: Option<&str>,
        ns: NamespaceId,
        hashes: &[PageHash],
        loaded: usize,
    ) -> Decisions {
        if let Some(idx) = session.and_then(|s| self.table.index_of(s)) {
            let _ = self.table.touch(idx);
        }
        let mut d = Decisions::default();
        let loaded = loaded.min(hashes.len());
        if self.cfg.exclusive && loaded > 0 {
            d.moves.push(Move::DropHost {
                ns,
                hashes: hashes[..loaded].to_vec(),
            });
        }
        d
    }

    /// A session changed phase (engine or router). Acting sessions' private pages are
    /// demoted later, by `tick`, under pressure; a session back to reasoning gets its
    /// demoted pages staged and ready to load. The session's pages change eviction
    /// class with it (see `idle_class`).
    pub fn phase_changed(
        &mut self,
        session: &str,
        parent: Option<&str>,
        phase: Phase,
        usage: Usage,
    ) -> Result<Decisions, SessionPolicyError> {
        let idx = self.open(session, parent)?;
        let mut d = self.take_freed();
        match phase {
            Phase::Reasoning => {
                let was_paused = self.table.get(idx).is_some_and(|s| s.paused);
                self.table.set_activity(idx, Activity::Reasoning)?;
                d.class(session, SessionClass::Normal);
                if was_paused && let Some(ms) = self.table.resume(idx, self.cfg.pressure.boost_ms)? {
                    self.stats.resumes += 1;
                    self.stats.paused_ms_total += ms;
                    d.advice.push(Advice::Resume {
                        session_id: session.to_owned(),
                        forced: false,
                        paused_ms: ms,
                    });
                }
                if self.cfg.signals.phases || was_paused {
                    d.extend(self.stage(idx, was_paused));
                }
            }
            Phase::Acting => {
                let paused_now = self.table.set_activity(idx, Activity::Acting)?;
                d.class(session, self.idle_class(usage.pool));
                if paused_now {
                    self.stats.pauses += 1;
                    d.advice.push(Advice::Pause {
                        session_id: session.to_owned(),
                    });
                    d.extend(self.demote(idx, usage.pool));
                }
            }
            Phase::Paused => {
                let was = self.table.get(idx).is_some_and(|s| s.paused);
                self.table.pause(idx)?;
                if !was {
                    self.stats.pauses += 1;
                }
                d.class(session, self.idle_class(usage.pool));
                d.extend(self.demote(idx, usage.pool));
            }
            Phase::Ended => d.extend(self.end(idx)),
        }
        Ok(d)
    }

    /// A request finished: its chain becomes the session's, and pages two or more
    /// sessions used are retained longest.
    pub fn request_ended(&mut self, end: &RequestEnd) -> Result<Decisions, SessionPolicyError> {
        let idx = self.open(&end.session_id, end.parent_session_id.as_deref())?;
        self.table.record_tokens(idx, end.input_length, end.output_length)?;
        self.table.touch(idx)?;
        let c = self.chains.entry(idx).or_default();
        c.ns = end.ns;
        c.hashes.clone_from(&end.hashes);
        self.lineage.insert(idx, &end.hashes);
        let mut d = self.take_freed();
        if self.cfg.signals.lineage {
            let stats = self.lineage.stats(&end.hashes);
            let shared: Vec<PageHash> = end
                .hashes
                .iter()
                .zip(&stats)
                .filter(|(_, s)| s.sessions >= 2)
                .map(|(h, _)| *h)
                .collect();
            if !shared.is_empty() {
                d.moves.push(Move::Retain {
                    ns: end.ns,
                    hashes: shared,
                    priority: SHARED_PRIORITY,
                    disown: true,
                });
            }
        }
        Ok(d)
    }

    /// Periodic step on the caller's utilisation: sessions idle past the timeout end,
    /// the pressure controller pauses or resumes, and in the early band (between the
    /// target and high watermarks) acting sessions' private pages are demoted and
    /// reasoning sessions are marked to pause at their next tool boundary.
    pub fn tick(&mut self, usage: Usage) -> Decisions {
        let mut d = self.take_freed();
        for (idx, s) in self.table.expire_idle() {
            d.extend(self.forget(idx, &s.id));
        }
        let (used, cap) = (usage.used_pages, usage.capacity_pages);
        if cap == 0 {
            return d;
        }
        if self.cfg.signals.pressure {
            // A session's size is its chain, in pages: the unit of the host utilisation.
            let sizes: std::collections::HashMap<&str, u64> = self
                .table
                .iter()
                .map(|(i, s)| (s.id.as_str(), self.chains.get(&i).map_or(0, |c| c.hashes.len() as u64)))
                .collect();
            let sizes: std::collections::HashMap<String, u64> =
                sizes.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            let size_of = |s: &crate::session::Session| sizes.get(&s.id).copied().unwrap_or(0);
            let actions = self
                .pressure
                .step_at(&mut self.table, used, cap, size_of)
                .unwrap_or_default();
            for a in actions {
                d.extend(self.act(a, usage.pool));
            }
        }
        let wm = self.cfg.pressure.watermarks;
        if wm.in_early_band(used as usize, cap as usize) {
            d.extend(self.early_band(used, cap, usage.pool));
        }
        d
    }

    /// Carries out one pressure-controller action.
    fn act(&mut self, a: Action, pool: bool) -> Decisions {
        let mut d = Decisions::default();
        match a {
            Action::Pause { session } => {
                self.stats.pauses += 1;
                if let Some(s) = self.table.get(session) {
                    let id = s.id.clone();
                    d.advice.push(Advice::Pause { session_id: id.clone() });
                    d.class(&id, self.idle_class(pool));
                }
                d.extend(self.demote(session, pool));
            }
            Action::MarkPause { .. } => self.stats.marked_pauses += 1,
            Action::Resume {
                session,
                forced,
                paused_ms,
            } => {
                self.stats.resumes += 1;
                self.stats.forced_resumes += u64::from(forced);
                self.stats.paused_ms_total += paused_ms;
                if let Some(s) = self.table.get(session) {
                    d.advice.push(Advice::Resume {
                        session_id: s.id.clone(),
                        forced,
                        paused_ms,
                    });
                    // Resumed while still on its tool: its pages stay where they are.
                    if s.activity == Activity::Reasoning {
                        let id = s.id.clone();
                        d.class(&id, SessionClass::Normal);
                    }
                }
                d.extend(self.stage(session, true));
            }
        }
        d
    }

    /// Between the target and high watermarks: demote acting sessions' private pages
    /// (those acting at least `demote_after_ms`, largest first) until what they free
    /// covers the excess over the target, and mark the largest reasoning sessions to
    /// pause at their next tool boundary (their priority drops before anything pauses).
    fn early_band(&mut self, used: u64, cap: u64, pool: bool) -> Decisions {
        let mut d = Decisions::default();
        let excess = used.saturating_sub((self.cfg.pressure.watermarks.target * cap as f64) as u64);
        let now = self.table.now_ms();
        let mut acting = Vec::new();
        let mut reasoning = Vec::new();
        for (i, s) in self.table.iter() {
            let pages = self.chains.get(&i).map_or(0, |c| c.hashes.len() as u64);
            if s.paused || s.boost_until_ms > now {
                continue;
            }
            match s.activity {
                Activity::Acting if now.saturating_sub(s.last_activity_ms) >= self.cfg.demote_after_ms => {
                    acting.push((pages, i))
                }
                Activity::Reasoning if !s.pause_pending => reasoning.push((pages, i)),
                _ => {}
            }
        }
        acting.sort_unstable_by(|a, b| b.cmp(a));
        reasoning.sort_unstable_by(|a, b| b.cmp(a));
        let mut freed = 0;
        if self.cfg.signals.phases {
            for (pages, i) in acting {
                if freed >= excess {
                    break;
                }
                let moved = self.demote(i, pool);
                if !moved.is_empty() {
                    freed += pages;
                    d.extend(moved);
                }
            }
        }
        if self.cfg.signals.pressure && freed < excess {
            for (pages, i) in reasoning {
                if freed >= excess {
                    break;
                }
                if self.table.mark_pause(i).is_ok() {
                    self.stats.early_band_marks += 1;
                    freed += pages;
                }
            }
        }
        d
    }

    /// An explicit end.
    pub(super) fn end(&mut self, idx: u32) -> Decisions {
        let was_paused = self.table.get(idx).is_some_and(|s| s.paused);
        match self.table.end(idx) {
            Ok(s) => {
                // Ending closes an open pause; it counts.
                if was_paused {
                    self.stats.paused_ms_total += s.pauses_ms.last().copied().unwrap_or(0);
                }
                self.forget(idx, &s.id)
            }
            Err(_) => Decisions::default(),
        }
    }

    /// A session that ended (explicitly or by idle timeout) is freed: its pages go in
    /// the ended class, and of its chain, pages no live session holds lose their
    /// priority, and go first when only it used them.
    fn forget(&mut self, idx: u32, id: &str) -> Decisions {
        let mut d = Decisions::default();
        self.lineage.remove(idx);
        let ended = self.cfg.signals.ended;
        d.class(
            id,
            if ended {
                SessionClass::Ended
            } else {
                SessionClass::Normal
            },
        );
        let Some(c) = self.chains.remove(&idx) else { return d };
        if !ended {
            return d;
        }
        let stats = self.lineage.stats(&c.hashes);
        let (mut shared, mut private) = (Vec::new(), Vec::new());
        for (h, s) in c.hashes.iter().zip(&stats) {
            if s.live > 0 {
                continue;
            }
            if s.sessions >= 2 { &mut shared } else { &mut private }.push(*h);
        }
        for (hashes, priority) in [(shared, 0), (private, ENDED_PRIORITY)] {
            if !hashes.is_empty() {
                // The pages keep their owner: a hint naming the session still finds
                // them (another rank of the engine may not have heard of the end yet).
                d.moves.push(Move::Retain {
                    ns: c.ns,
                    hashes,
                    priority,
                    disown: false,
                });
            }
        }
        d
    }
}
