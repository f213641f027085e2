//! The event loop of the engine emulator (see the parent module for the policies).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use super::{EngineConfig, PolicyKind, PolicyRun, RequestOutcome};
use crate::clock::SimClock;
use crate::directory::Directory;
use crate::layout::LayoutSpec;
use crate::page::{Namespace, NamespaceId};
use crate::replay::ReplayError;
use crate::replay::workload::Workload;
use crate::session::lineage::Lineage;
use crate::session::pressure::{Action, PressureController};
use crate::session::{Activity, SessionTable};
use crate::tier::TierKind;

/// Retain priority of a page on a chain more than one request used.
const SHARED: i8 = 1;
/// Retain priority of a page only an ended session used.
const ENDED: i8 = -1;
/// Most sessions live at once in the emulator.
const MAX_SESSIONS: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    // Order within one millisecond: finishes, then tool ends, then arrivals.
    Finish(usize),
    ToolEnd(usize),
    Arrive(usize),
}

pub(super) struct Sim<'a> {
    w: &'a Workload,
    cfg: &'a EngineConfig,
    policy: PolicyKind,
    dir: Directory,
    ns: NamespaceId,
    clock: Arc<SimClock>,
    table: SessionTable,
    lineage: Lineage,
    pressure: PressureController,
    /// Workload session -> session table index (0: not open).
    idx: Vec<u32>,
    /// Workload session -> its latest request.
    last_req: Vec<Option<usize>>,
    remaining: Vec<usize>,
    /// Workload session -> pauses finished since its latest request.
    pauses: Vec<Vec<u64>>,
    events: BinaryHeap<Reverse<(u64, Event)>>,
    out: PolicyRun,
}

mod moves;

impl<'a> Sim<'a> {
    pub(super) fn new(w: &'a Workload, cfg: &'a EngineConfig, policy: PolicyKind) -> Result<Self, ReplayError> {
        let mut dir = Directory::new(w.distinct_blocks() + 1);
        let layout = LayoutSpec::mha(1, 1, 1, 1, w.block_tokens.max(1)).build()?;
        let ns = dir.register(Namespace::model("replay"), layout)?;
        let clock = SimClock::new();
        let table = SessionTable::new(clock.clone(), MAX_SESSIONS, cfg.idle_timeout_ms);
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
        Ok(Self {
            w,
            cfg,
            policy,
            dir,
            ns,
            clock,
            table,
            lineage: Lineage::new(w.requests.iter().map(|r| r.blocks.len()).sum::<usize>() + 1),
            pressure: PressureController::new(cfg.pressure)?,
            idx: vec![0; w.sessions.len()],
            last_req: vec![None; w.sessions.len()],
            remaining,
            pauses: vec![Vec::new(); w.sessions.len()],
            events,
            out: PolicyRun {
                requests: vec![RequestOutcome::default(); w.requests.len()],
                ..PolicyRun::default()
            },
        })
    }

    fn aware(&self) -> bool {
        self.policy == PolicyKind::SessionAware
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

    pub(super) fn run(mut self, progress: &mut dyn FnMut()) -> Result<PolicyRun, ReplayError> {
        while let Some(Reverse((t, ev))) = self.events.pop() {
            self.clock.set(t);
            self.dir.set_now(t);
            match ev {
                Event::Arrive(i) => {
                    self.arrive(i)?;
                    progress();
                }
                Event::Finish(i) => self.finish(i)?,
                Event::ToolEnd(s) => self.tool_end(s)?,
            }
        }
        Ok(self.out)
    }

    fn session_index(&mut self, s: usize) -> Result<u32, ReplayError> {
        if self.idx[s] != 0 && self.table.get(self.idx[s]).is_some() {
            return Ok(self.idx[s]);
        }
        let spec = &self.w.sessions[s];
        let parent = spec.parent.map(|p| self.w.sessions[p].id.as_str());
        let i = self.table.open(&spec.id, parent)?;
        self.idx[s] = i;
        Ok(i)
    }

    fn arrive(&mut self, i: usize) -> Result<(), ReplayError> {
        let r = &self.w.requests[i];
        for (idx, _) in self.table.expire_idle() {
            self.on_end(idx);
        }
        let idx = self.session_index(r.session)?;
        self.table.set_activity(idx, Activity::Reasoning)?;
        if self.aware() && self.table.get(idx).is_some_and(|s| s.paused) {
            self.resume(idx, r.session)?;
        }
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
                } else if self.aware() {
                    // The tiers hold distinct pages: the host copy makes room.
                    self.dir.set_page(id, TierKind::Host, false);
                }
            } else if k >= hit.total() {
                // Recomputed: a stray colder copy behind the missing prefix is redundant now.
                if self.aware() {
                    self.dir.set_page(id, TierKind::Host, false);
                }
                self.store_new(id);
            }
            ids.push(id);
        }
        if self.aware() {
            self.lineage.insert(idx, &r.blocks);
            let stats = self.lineage.stats(&r.blocks);
            for (k, &id) in ids.iter().enumerate() {
                let shared = stats.get(k).is_some_and(|p| p.sessions >= 2);
                self.dir.set_session(id, if shared { 0 } else { idx });
                self.dir.set_retain(id, if shared { SHARED } else { 0 });
            }
        }
        for &id in ids.iter().rev() {
            self.dir.touch(id, true);
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
        let idx = self.idx[s];
        if self.table.get(idx).is_none() {
            return Ok(());
        }
        self.table.record_tokens(idx, r.input_tokens, r.output_tokens)?;
        // The session's working set per tier: where its latest chain's pages are now.
        let mut ws = [0u64; 3];
        for hash in &r.blocks {
            if let Some(id) = self.dir.find(self.ns, hash) {
                for t in TierKind::ALL.into_iter().filter(|&t| self.dir.is_complete(id, t)) {
                    ws[t.index()] += u64::from(self.w.block_tokens);
                }
            }
        }
        for t in TierKind::ALL {
            self.table.set_working_set(idx, t, ws[t.index()].min(r.input_tokens))?;
        }
        let paused_now = self.table.set_activity(idx, Activity::Acting)?;
        if !self.aware() {
            if self.remaining[s] == 0 {
                self.table.end(idx)?;
            }
            return Ok(());
        }
        if paused_now {
            self.demote(idx);
        }
        if self.remaining[s] == 0 && self.w.sessions[s].ends_explicitly {
            self.table.end(idx)?;
            self.on_end(idx);
        } else if let Some(t) = r.tool_end_ms {
            let at = t.saturating_sub(self.cfg.tool_end_lead_ms).max(self.table.now_ms());
            self.events.push(Reverse((at, Event::ToolEnd(s))));
        }
        self.control()
    }

    fn tool_end(&mut self, s: usize) -> Result<(), ReplayError> {
        let idx = self.idx[s];
        if self.table.get(idx).is_none() {
            return Ok(());
        }
        self.table.set_activity(idx, Activity::Reasoning)?;
        if self.table.get(idx).is_some_and(|x| x.paused) {
            self.resume(idx, s)?;
        } else {
            self.prefetch(s);
        }
        Ok(())
    }

    /// One pressure-controller step on the live sessions' device demand.
    fn control(&mut self) -> Result<(), ReplayError> {
        let cap_tokens = self.cfg.capacity.device_pages as u64 * u64::from(self.w.block_tokens);
        for action in self.pressure.step(&mut self.table, cap_tokens)? {
            match action {
                Action::Pause { session } => self.demote(session),
                Action::MarkPause { .. } => self.out.marked_pauses += 1,
                Action::Resume {
                    session,
                    forced,
                    paused_ms,
                } => {
                    self.out.pauses_ms.push(paused_ms);
                    self.out.forced_resumes += u64::from(forced);
                    if let Some(s) = self.idx.iter().position(|&x| x == session) {
                        self.pauses[s].push(paused_ms);
                        self.prefetch(s);
                    }
                }
            }
        }
        Ok(())
    }

    fn resume(&mut self, idx: u32, s: usize) -> Result<(), ReplayError> {
        if let Some(d) = self.table.resume(idx, self.pressure.config().boost_ms)? {
            self.out.pauses_ms.push(d);
            self.pauses[s].push(d);
        }
        self.prefetch(s);
        Ok(())
    }

    /// An ended session: of its latest chain, the pages no live session holds go first from
    /// now on when only this session ever used them, and lose their shared priority (plain
    /// LRU from now on) when others did. Pages a live session holds keep theirs.
    fn on_end(&mut self, idx: u32) {
        let Some(s) = self.idx.iter().position(|&x| x == idx) else {
            return;
        };
        self.idx[s] = 0;
        if !self.aware() {
            return;
        }
        self.lineage.remove(idx);
        let Some(i) = self.last_req[s] else { return };
        let blocks = &self.w.requests[i].blocks;
        let stats = self.lineage.stats(blocks);
        for (hash, st) in blocks.iter().zip(&stats) {
            if st.live > 0 {
                continue;
            }
            if let Some(id) = self.dir.find(self.ns, hash) {
                self.dir.set_session(id, 0);
                self.dir.set_retain(id, if st.sessions >= 2 { 0 } else { ENDED });
            }
        }
    }
}
