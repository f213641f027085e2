//! The event loop of the engine emulator (see the parent module for the policies).
//!
//! For the kinds with a session policy, every call the daemon's manager makes is made
//! here at the same moment of a request's life: `page_stored` and `page_hit` as the
//! request arrives and its prefix is looked up, `phase_changed` at arrival (the previous
//! tool call ended), at finish (a tool call starts) and at the session's end,
//! `request_ended` at finish, `tick` after every event. `moves` carries out the moves.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use super::{EngineConfig, PolicyKind, PolicyRun, RequestOutcome};
use crate::clock::{Clock, SimClock};
use crate::directory::Directory;
use crate::layout::LayoutSpec;
use crate::page::{Namespace, NamespaceId};
use crate::policy::{Decisions, Phase, RequestEnd, SessionPolicy, SessionPolicyConfig, Usage};
use crate::replay::ReplayError;
use crate::replay::workload::Workload;
use crate::session::pressure::PressureConfig;
use crate::tier::TierKind;

/// Most sessions live at once in the emulator.
const MAX_SESSIONS: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    // Order within one millisecond: finishes, then tool ends, then arrivals.
    Finish(usize),
    ToolEnd(usize),
    Arrive(usize),
}

mod moves;

pub(super) struct Sim<'a> {
    w: &'a Workload,
    cfg: &'a EngineConfig,
    policy: PolicyKind,
    dir: Directory,
    ns: NamespaceId,
    clock: Arc<SimClock>,
    /// The daemon's session policy, for the kinds that run one.
    sessions: Option<SessionPolicy>,
    /// Session id -> workload session.
    by_id: HashMap<String, usize>,
    /// Workload session -> its latest request.
    last_req: Vec<Option<usize>>,
    remaining: Vec<usize>,
    /// Workload session -> pauses finished since its latest request.
    pauses: Vec<Vec<u64>>,
    events: BinaryHeap<Reverse<(u64, Event)>>,
    out: PolicyRun,
    /// Host and pool moves still to log (0: not logging).
    log_left: usize,
    /// How long staged pages are protected: the daemon's default `stage_protect_ms`.
    stage_protect_ms: u64,
}

impl<'a> Sim<'a> {
    pub(super) fn new(w: &'a Workload, cfg: &'a EngineConfig, policy: PolicyKind) -> Result<Self, ReplayError> {
        let mut dir = Directory::new(w.distinct_blocks() + 1);
        let layout = LayoutSpec::mha(1, 1, 1, 1, w.block_tokens.max(1)).build()?;
        let ns = dir.register(Namespace::model("replay"), layout)?;
        let clock = SimClock::new();
        let mut remaining = vec![0; w.sessions.len()];
        let mut events = BinaryHeap::with_capacity(w.requests.len() * 2);
        for (i, r) in w.requests.iter().enumerate() {
            let s = remaining.get_mut(r.session).ok_or(ReplayError::Input {
                line: i + 1,
                what: format!("request names session {} of {}", r.session, w.sessions.len()),
            })?;
            *s += 1;
            events.push(Reverse((r.arrival_ms, Event::Arrive(i))));
        }
        let sessions = match policy.signals() {
            None => None,
            Some(signals) => {
                let pcfg = SessionPolicyConfig {
                    // The policy counts in pages; the replay's buffer is in tokens.
                    pressure: PressureConfig {
                        resume_buffer_tokens: cfg
                            .pressure
                            .resume_buffer_tokens
                            .div_ceil(u64::from(w.block_tokens.max(1))),
                        ..cfg.pressure
                    },
                    demote_after_ms: 0,
                    exclusive: true,
                    max_sessions: MAX_SESSIONS,
                    idle_timeout_ms: cfg.idle_timeout_ms,
                    max_lineage_pages: w.requests.iter().map(|r| r.blocks.len()).sum::<usize>() + 1,
                    signals,
                };
                Some(SessionPolicy::new(pcfg, clock.clone())?)
            }
        };
        Ok(Self {
            w,
            cfg,
            policy,
            dir,
            ns,
            clock,
            sessions,
            by_id: w.sessions.iter().enumerate().map(|(i, s)| (s.id.clone(), i)).collect(),
            last_req: vec![None; w.sessions.len()],
            remaining,
            pauses: vec![Vec::new(); w.sessions.len()],
            events,
            out: PolicyRun {
                requests: vec![RequestOutcome::default(); w.requests.len()],
                ..PolicyRun::default()
            },
            log_left: 0,
            stage_protect_ms: crate::manager::Tunables::default().stage_protect_ms,
        })
    }

    /// Logs the first `max` host and pool moves into the run's `moves`.
    pub(super) fn log_moves(&mut self, max: usize) {
        self.log_left = max;
    }

    /// Books a page's move between host and pool, while the log has room.
    fn log_move(&mut self, id: crate::directory::PageId, from: TierKind, to: TierKind) {
        if self.log_left == 0 {
            return;
        }
        self.log_left -= 1;
        let page = self.dir.info(id).hash.to_hex();
        self.out.moves.push(super::TierMove {
            at_ms: self.clock.now_ms(),
            page,
            from,
            to,
        });
    }

    /// Tiers held exclusively (every kind with a session policy, `exclusive-lru` too).
    fn exclusive(&self) -> bool {
        self.sessions.is_some()
    }

    fn cap(&self, tier: TierKind) -> usize {
        let c = &self.cfg.capacity;
        match tier {
            TierKind::Device => c.device_pages,
            TierKind::Host if self.policy == PolicyKind::DeviceLru => 0,
            TierKind::Host => c.host_pages,
            TierKind::Pool if self.policy == PolicyKind::DeviceLru => 0,
            TierKind::Pool => c.pool_pages,
        }
    }

    /// Host utilisation, what the daemon's policy runs on.
    fn usage(&self) -> Usage {
        Usage {
            used_pages: self.dir.complete_count(TierKind::Host) as u64,
            capacity_pages: self.cap(TierKind::Host) as u64,
            pool: self.cap(TierKind::Pool) > 0,
        }
    }

    pub(super) fn run(mut self, progress: &mut dyn FnMut()) -> Result<PolicyRun, ReplayError> {
        while let Some(Reverse((t, ev))) = self.events.pop() {
            self.clock.set(t);
            self.dir.set_now(t);
            // Staged pages the engine did not load within the TTL lose their protection,
            // as the daemon's upkeep ends them.
            self.dir.order_mut().expire_protection(t);
            match ev {
                Event::Arrive(i) => {
                    self.arrive(i)?;
                    progress();
                }
                Event::Finish(i) => self.finish(i)?,
                Event::ToolEnd(s) => self.phase(s, Phase::Reasoning)?,
            }
            let usage = self.usage();
            if let Some(d) = self.sessions.as_mut().map(|p| p.tick(usage)) {
                self.apply(d);
            }
        }
        if let Some(p) = &self.sessions {
            let st = p.stats();
            self.out.marked_pauses = st.marked_pauses + st.early_band_marks;
            self.out.forced_resumes = st.forced_resumes;
        }
        Ok(self.out)
    }

    /// Tells the policy that workload session `s` changed phase, and carries out what it
    /// decided.
    fn phase(&mut self, s: usize, phase: Phase) -> Result<(), ReplayError> {
        let usage = self.usage();
        let spec = &self.w.sessions[s];
        let parent = spec.parent.map(|p| self.w.sessions[p].id.as_str());
        let Some(p) = self.sessions.as_mut() else { return Ok(()) };
        let d = p.phase_changed(&spec.id, parent, phase, usage).map_err(policy_error)?;
        self.apply(d);
        Ok(())
    }

    fn arrive(&mut self, i: usize) -> Result<(), ReplayError> {
        let r = &self.w.requests[i];
        // The request arriving is the previous tool call's end, as the engine sees it.
        self.phase(r.session, Phase::Reasoning)?;
        let hit = self.dir.lookup_prefix(self.ns, &r.blocks);
        let page_bytes = self.cfg.page_bytes;
        let (d, h) = (hit.device, hit.device + hit.host);
        let mut ids = Vec::with_capacity(r.blocks.len());
        for (k, hash) in r.blocks.iter().enumerate() {
            let id = self.dir.find_or_insert(self.ns, hash)?;
            self.dir.set_page(id, TierKind::Device, true);
            if k >= d && k < hit.total() {
                // Loaded from host (or from the pool through host).
                self.out.bytes.host_device += page_bytes;
                if k >= h {
                    self.out.bytes.pool_host += page_bytes;
                }
            } else if k >= hit.total() {
                // Recomputed: with exclusive tiers a stray colder copy behind the missing
                // prefix is redundant now.
                if self.exclusive() {
                    self.dir.set_page(id, TierKind::Host, false);
                }
                self.store_new(id);
            }
            ids.push(id);
        }
        let session_id = self.w.sessions[r.session].id.as_str();
        if let Some(p) = self.sessions.as_mut() {
            let hd = p.page_hit(Some(session_id), self.ns, &r.blocks[d..h], h - d);
            p.page_stored(session_id, self.ns, &r.blocks).map_err(policy_error)?;
            // Pages carry the session as the daemon's do: a small index of its own table
            // (here the workload's), never 0.
            let tag = session_tag(r.session);
            for &id in &ids {
                self.dir.order_mut().set_session(id, tag);
            }
            self.apply(hd);
        }
        for &id in ids.iter().rev() {
            self.dir.order_mut().touch(id, true);
        }
        // The request's own pages stay on the device while it runs (at most half of it).
        let pinned = ids.len().min(self.cap(TierKind::Device) / 2);
        for &id in &ids[..pinned] {
            self.dir.set_pinned(id, TierKind::Device, true);
        }
        self.evict(TierKind::Device);
        self.evict(TierKind::Host);
        self.evict(TierKind::Pool);
        for &id in &ids[..pinned] {
            self.dir.set_pinned(id, TierKind::Device, false);
        }
        let hit_tokens = super::super::bounds::hit_tokens(hit.total(), self.w.block_tokens, r.input_tokens);
        let latency = self.cfg.cost.latency_ms(
            r.input_tokens - hit_tokens,
            hit.host as u64 * page_bytes,
            hit.pool as u64 * page_bytes,
            r.output_tokens,
        );
        let end = r.arrival_ms.saturating_add(latency.ceil() as u64);
        self.out.requests[i] = RequestOutcome {
            hit_pages: [hit.device, hit.host, hit.pool],
            latency_ms: latency,
            end_ms: end,
            pause_ms: std::mem::take(&mut self.pauses[r.session]),
        };
        self.last_req[r.session] = Some(i);
        self.events.push(Reverse((end, Event::Finish(i))));
        Ok(())
    }

    fn finish(&mut self, i: usize) -> Result<(), ReplayError> {
        let r = &self.w.requests[i];
        let s = r.session;
        self.remaining[s] -= 1;
        let spec = &self.w.sessions[s];
        let Some(p) = self.sessions.as_mut() else { return Ok(()) };
        let d = p
            .request_ended(&RequestEnd {
                session_id: spec.id.clone(),
                parent_session_id: spec.parent.map(|x| self.w.sessions[x].id.clone()),
                ns: self.ns,
                input_length: r.input_tokens,
                output_length: r.output_tokens,
                hashes: r.blocks.clone(),
            })
            .map_err(policy_error)?;
        self.apply(d);
        if self.remaining[s] == 0 && spec.ends_explicitly {
            return self.phase(s, Phase::Ended);
        }
        self.phase(s, Phase::Acting)?;
        if self.policy == PolicyKind::SessionAwareLookahead
            && let Some(t) = r.tool_end_ms
        {
            let at = t.saturating_sub(self.cfg.tool_end_lead_ms).max(self.clock.now_ms());
            self.events.push(Reverse((at, Event::ToolEnd(s))));
        }
        Ok(())
    }

    /// Carries out the policy's moves, and books its pause and resume advice.
    fn apply(&mut self, d: Decisions) {
        for a in &d.advice {
            if let crate::policy::Advice::Resume {
                session_id, paused_ms, ..
            } = a
            {
                self.out.pauses_ms.push(*paused_ms);
                if let Some(&s) = self.by_id.get(session_id) {
                    self.pauses[s].push(*paused_ms);
                }
            }
        }
        for c in d.classes {
            if let Some(&s) = self.by_id.get(&c.session_id) {
                self.set_class(session_tag(s), c.class);
            }
        }
        for m in d.moves {
            self.apply_move(m);
        }
    }
}

/// The index pages of workload session `s` carry in the directory.
fn session_tag(s: usize) -> u32 {
    u32::try_from(s).map_or(u32::MAX, |s| s.saturating_add(1))
}

fn policy_error(e: crate::policy::SessionPolicyError) -> ReplayError {
    ReplayError::Config(format!("session policy: {e}"))
}
