//! [`ManagedTiers`]: the daemon's backend over the tier manager.
//!
//! Grants carry the connection id as owner. Store grants are remembered here too, so a
//! commit can checksum exactly the slots the rank wrote and journal them, and so the
//! protocol's per-grant-page flags can be mapped onto the manager's per-request ones.
//! Tickets are committed stores; a ticket is done when every page of the request is
//! complete on host across all ranks, or can no longer become so.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use xxhash_rust::xxh3::xxh3_64;

use crate::clock::Clock;
use crate::hints::{Hint, HintOutcome};
use crate::layout::LayoutSpec;
use crate::manager::{self, LookupStep, Manager, ManagerConfig, ManagerError, PendingLookup, PoolConfig, StoreStatus};
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::pool::PoolError;
use crate::protocol::{
    AdviceBatch, AdviceKind, ArenaInfo, DaemonStats, EngineAdvice, GrantPage, LoadWait, ObjectSlot, SessionPhase,
    TicketStatus,
};
use crate::tier::TierKind;
use crate::tier::host::{ArenaOptions, HostArena, SlotId};
use crate::tier::private::{self, OwnerLock};
use crate::wire::PrefixHit;

use super::fence::{self, Fence};
use super::journal::{Journal, Recovered};
use super::manifest::ObjectRecord;
use super::tickets::Tickets;
use super::{Backend, BackendError, Registered};

mod fit;

/// Configuration of [`ManagedTiers`].
#[derive(Clone, Debug)]
pub struct TiersConfig {
    /// The host arena file; the manifest sits beside it (`.manifest`), the local pool too
    /// (`.pool`).
    pub arena_path: PathBuf,
    pub arena_bytes: u64,
    /// Slot size of the host arena, which is created with it at open. 0 (`kvtier serve`'s
    /// default) creates and touches the arena at open but cuts it into slots of the first
    /// registered layout's largest object, rounded up to 64 bytes.
    pub slot_bytes: u64,
    /// Local pool size; 0 runs without a pool.
    pub pool_bytes: u64,
    pub max_pages: usize,
    /// Longest a load or ticket wait may block, whatever the client asks.
    pub max_wait: Duration,
    /// Reopen the arena and re-adopt its pages from the manifest at start.
    pub recover: bool,
    /// How long slots that open store grants held when the daemon stopped stay
    /// quarantined after a restart that reopened the arena (`host.fence_timeout_ms`).
    pub fence_timeout: Duration,
    pub arena: ArenaOptions,
    pub tunables: manager::Tunables,
    /// Page events kept for replay (the ring's bound; its memory grows to it).
    pub event_ring: usize,
    /// The session-aware policy; `None` turns it off.
    pub policy: Option<crate::policy::SessionPolicyConfig>,
    /// Request traces (`request_trace_path`); `None` writes none.
    pub request_traces: Option<crate::session::trace_log::TraceLogConfig>,
    /// A pool shared with other nodes, built by the daemon (`pool = "mooncake"`); it
    /// replaces the local pool of `pool_bytes`. `None`: the local pool (or none).
    pub shared_pool: Option<SharedPool>,
    /// Nice steps the transfer workers lower their priority by (`control.worker_nice`).
    pub worker_nice: u8,
    /// Cores the transfer workers pin themselves to (`control.worker_cores`).
    pub worker_cores: Vec<usize>,
}

/// A shared pool as the daemon configured it.
#[derive(Clone, Debug)]
pub struct SharedPool {
    pub pool: PoolConfig,
    /// Pool key tag (`mooncake.key_tag`).
    pub key_tag: String,
    /// Pool key format (`mooncake.key_format`).
    pub key_format: crate::pool::keys::KeyFormat,
    /// Discovery of pages other nodes wrote.
    pub remote: manager::RemoteConfig,
    /// Objects carry the 32-byte integrity trailer (`mooncake.integrity`), sealed in place
    /// where their slot has room for it: fitted slots keep that room.
    pub sealed: bool,
    /// Pages the lookup file's pool page table holds (`mooncake.index_max_keys`: the pool
    /// index holds no more keys, so no more pages).
    pub index_pages: usize,
}

struct StoreInfo {
    ns: NamespaceId,
    hashes: Vec<PageHash>,
    /// (request index, objects) of each page the rank must write.
    pages: Vec<(usize, Vec<(usize, SlotId)>)>,
}

/// The daemon's backend. See the module docs.
pub struct ManagedTiers {
    mgr: Manager,
    cfg: TiersConfig,
    journal: Mutex<Journal>,
    /// Marks of the slots open store grants hold, for the next life's quarantine.
    fence: Mutex<Fence>,
    stores: Mutex<HashMap<u64, StoreInfo>>,
    tickets: Tickets,
    recovered: Recovered,
    /// Held for the backend's whole life: no second daemon opens this arena meanwhile.
    owner: OwnerLock,
    traces: Option<Mutex<crate::session::trace_log::TraceLog>>,
    clock: Arc<dyn Clock>,
    /// The arena, mapped but not yet cut into slots, until the first registration fits
    /// it (`slot_bytes = 0`).
    unfitted: Mutex<Option<crate::tier::host::Unfitted>>,
}

impl ManagedTiers {
    /// Opens the tiers: checks the arena's directory ([`private::trusted_dir`]: created
    /// `0700`, or `0750` with the engines' group where one is configured; never writable
    /// by others; the daemon makes its default one strictly private before this), takes
    /// the arena's owner lock (refusing, with the holder's pid, when another daemon has
    /// it), recovers the arena from its manifest when asked, and creates it with the
    /// configured slot size.
    pub fn open(cfg: TiersConfig, clock: Arc<dyn Clock>) -> Result<Self, BackendError> {
        let dir = private::parent_of(&cfg.arena_path);
        match cfg.arena.group {
            // One the daemon creates is for the engines' group to enter; one that exists
            // is the operator's, as they made it.
            Some(g) if !dir.exists() => private::shared_dir(dir, Some(g))?,
            _ => private::trusted_dir(dir)?,
        }
        let owner = OwnerLock::acquire(&cfg.arena_path)?;
        let mut pool_path = cfg.arena_path.clone().into_os_string();
        pool_path.push(".pool");
        let mcfg = ManagerConfig {
            host_path: cfg.arena_path.clone(),
            host_bytes: cfg.arena_bytes,
            arena: cfg.arena.clone(),
            pool: if cfg.pool_bytes == 0 {
                PoolConfig::None
            } else {
                PoolConfig::Local {
                    path: pool_path.into(),
                    bytes: cfg.pool_bytes,
                    recover: cfg.recover,
                }
            },
            max_pages: cfg.max_pages,
            // A daemon's lookups should never wait on a page fault of the index.
            resident_index: true,
            // Engines answer their lookups from it (see `directory::shared`).
            lookup_file: true,
            tunables: cfg.tunables,
            event_ring: cfg.event_ring,
            policy: cfg.policy,
            worker_nice: cfg.worker_nice,
            worker_cores: cfg.worker_cores.clone(),
            ..ManagerConfig::default()
        };
        let mcfg = match &cfg.shared_pool {
            Some(s) => ManagerConfig {
                pool: s.pool.clone(),
                pool_key_tag: s.key_tag.clone(),
                pool_key_format: {
                    if s.key_format == crate::pool::keys::KeyFormat::Sglang {
                        tracing::warn!(
                            "mooncake.key_format = \"sglang\": pool keys carry no TP size, dtype or page size; \
                             safe only when every engine on this store serves the model with one TP size, PP split, \
                             dtype, page size and byte order"
                        );
                    }
                    s.key_format
                },
                remote: Some(s.remote),
                lookup_pool_pages: s.index_pages,
                ..mcfg
            },
            None => mcfg,
        };
        let mgr = Manager::new(mcfg, clock.clone())?;
        let traces = match &cfg.request_traces {
            Some(t) => Some(Mutex::new(
                crate::session::trace_log::TraceLog::open(t.clone())
                    .map_err(|e| BackendError::Manager(ManagerError::Config(e.to_string())))?,
            )),
            None => None,
        };
        let mut journal = Journal::new(cfg.arena_path.with_extension("manifest"));
        let fence_path = cfg.arena_path.with_extension("fence");
        let marked = Fence::read_marked(&fence_path);
        let mut fence = Fence::new(fence_path.clone(), cfg.arena.group);
        let recovered = if cfg.recover {
            journal.recover(&mgr, &cfg.arena_path, cfg.slot_bytes)?
        } else {
            Recovered::default()
        };
        mgr.record_recovery([
            recovered.pages,
            recovered.corrupt,
            recovered.incomplete,
            recovered.outside,
            recovered.bad_records,
            recovered.garbage as u64,
        ]);
        let fence_io = |source| BackendError::Manifest {
            path: fence_path.display().to_string(),
            source,
        };
        // Only a reopened arena can receive an earlier life's late copies.
        if let Some(reopened) = mgr.stores().arena() {
            fence
                .attach(&reopened, Some(marked), cfg.fence_timeout)
                .map_err(fence_io)?;
        }
        let mut unfitted = None;
        if mgr.stores().arena().is_none() {
            if cfg.slot_bytes != 0 {
                let arena = mgr.stores().create_arena(cfg.slot_bytes)?;
                fence.attach(&arena, None, cfg.fence_timeout).map_err(fence_io)?;
            } else {
                let mc = mgr.config();
                unfitted = Some(
                    HostArena::create_unfitted(&mc.host_path, mc.host_bytes, &mc.arena).map_err(ManagerError::from)?,
                );
            }
        }
        Ok(Self {
            owner,
            mgr,
            journal: Mutex::new(journal),
            fence: Mutex::new(fence),
            stores: Mutex::new(HashMap::new()),
            tickets: Tickets::default(),
            recovered,
            traces,
            clock,
            cfg,
            unfitted: Mutex::new(unfitted),
        })
    }

    pub fn manager(&self) -> &Manager {
        &self.mgr
    }

    /// The owner lock's file (beside the arena).
    pub fn lock_path(&self) -> &std::path::Path {
        self.owner.path()
    }

    /// What recovery found at start: (pages recovered, pages discarded, manifest records
    /// skipped, whether the manifest was garbage).
    pub fn recovery(&self) -> (u64, u64, u64, bool) {
        let r = &self.recovered;
        (r.pages, r.discarded(), r.bad_records, r.garbage)
    }

    pub fn manifest_path(&self) -> PathBuf {
        self.cfg.arena_path.with_extension("manifest")
    }

    /// The manifest's upkeep so far: (its bytes, live object records, compactions,
    /// full resyncs after the event ring lost events).
    pub fn manifest_upkeep(&self) -> (u64, u64, u64, u64) {
        let j = self.journal.lock();
        (j.manifest_bytes(), j.live_objects(), j.compactions, j.resyncs)
    }

    /// (complete on host, on its way to host: some objects there or in flight).
    fn host_state(&self, ns: NamespaceId, h: &PageHash) -> (bool, bool) {
        let count = self.mgr.pages().layout(ns).map_or(0, |l| l.object_count());
        match self.mgr.page_status(ns, h) {
            Ok(Some(s)) => {
                let t = &s.tiers[TierKind::Host.index()];
                let partial = t.missing.len() < count || !t.inflight.is_empty();
                (t.complete, !t.complete && partial)
            }
            _ => (false, false),
        }
    }

    fn ticket_status(&self, ns: NamespaceId, hashes: &[PageHash]) -> TicketStatus {
        let mut t = TicketStatus {
            total: hashes.len() as u32,
            ..TicketStatus::default()
        };
        for h in hashes {
            match self.mgr.page_status(ns, h) {
                Ok(Some(s)) if s.tiers[TierKind::Host.index()].complete => t.complete += 1,
                Ok(Some(_)) => {}
                _ => t.failed += 1,
            }
        }
        t
    }

    fn complete_on_host(&self, ns: NamespaceId, hashes: &[PageHash]) -> u32 {
        hashes.iter().filter(|h| self.host_state(ns, h).0).count() as u32
    }
}

impl ManagedTiers {
    /// Every slot of a store grant.
    fn grant_slots(info: &StoreInfo) -> Vec<SlotId> {
        info.pages
            .iter()
            .flat_map(|(_, objects)| objects.iter().map(|&(_, s)| s))
            .collect()
    }

    /// Host slots quarantined by the restart fence right now.
    pub fn fenced_slots(&self) -> usize {
        self.fence.lock().quarantined()
    }
}

impl Backend for ManagedTiers {
    fn register(&self, ns: &Namespace, spec: &LayoutSpec) -> Result<Registered, BackendError> {
        let layout = spec.clone().build().map_err(|e| ManagerError::Config(e.to_string()))?;
        self.fit_arena(&layout)?;
        let known = self.mgr.pages().namespaces().iter().any(|(_, n, _)| n == ns);
        let id = self.mgr.register_namespace(ns.clone(), layout.clone())?;
        // A local pool reopened at this first registration (no manifest named a
        // namespace): book what it holds of this namespace, remove the rest. Once only.
        manager::adopt_recovered_pool(&self.mgr);
        let arena = self.mgr.stores().arena().ok_or(ManagerError::NoNamespace)?;
        let mut j = self.journal.lock();
        if j.manifest.is_none() || !known {
            j.sync(&self.mgr);
            j.start(&self.mgr, arena.slot_bytes() as u64)?;
        }
        Ok(Registered {
            ns: id,
            layout,
            arena: ArenaInfo {
                path: arena.path().display().to_string(),
                slot_bytes: arena.slot_bytes() as u64,
                slots: arena.slots(),
            },
        })
    }

    fn fence_engine(&self, conn: u64, token: u64, done: bool) -> usize {
        self.fence
            .lock()
            .engine(self.mgr.stores().arena().as_deref(), conn, token, done)
    }

    fn forget_conn(&self, conn: u64) {
        self.fence.lock().forget(conn);
    }

    fn discovers_remotely(&self) -> bool {
        self.mgr.discovery().is_remote()
    }

    fn lookup(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<PrefixHit, BackendError> {
        Ok(self.mgr.lookup(ns, hashes)?)
    }

    fn lookup_begin(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<LookupStep, BackendError> {
        Ok(self.mgr.discovery().lookup_begin(ns, hashes)?)
    }

    fn settle_lookups(&self) {
        crate::manager::settle_lookups(&self.mgr);
    }

    fn lookup_finish(
        &self,
        _ns: NamespaceId,
        hashes: &[PageHash],
        pending: PendingLookup,
        answers: Vec<Result<bool, PoolError>>,
    ) -> Result<PrefixHit, BackendError> {
        Ok(self.mgr.discovery().lookup_finish(hashes, pending, answers))
    }

    fn begin_store(
        &self,
        ns: NamespaceId,
        tp: u16,
        pp: u16,
        hashes: &[PageHash],
        session: &str,
        owner: u64,
    ) -> Result<(u64, Vec<GrantPage>), BackendError> {
        let session_id = session;
        let session = if session.is_empty() {
            0
        } else {
            self.mgr.session_registry().index(session).map_err(ManagerError::from)?
        };
        let g = self.mgr.begin_store(ns, tp, pp, hashes, session, owner)?;
        if session != 0
            && let Err(e) = self.mgr.session_policy().page_stored(session_id, ns, hashes)
        {
            // The store stands; only the session's chain misses these pages.
            tracing::debug!(error = %e, "session policy refused a store's session");
        }
        let mut out = Vec::new();
        let mut pages = Vec::new();
        let mut no_space = false;
        for (i, p) in g.pages.iter().enumerate() {
            match p.status {
                StoreStatus::Write => {
                    let arena = self.mgr.stores().arena();
                    let slots = p
                        .objects
                        .iter()
                        .map(|&(o, s)| fence::object_slot(arena.as_deref(), o, s));
                    out.push(GrantPage {
                        index: i as u32,
                        slots: slots.collect(),
                    });
                    pages.push((i, p.objects.clone()));
                }
                StoreStatus::NoSpace => no_space = true,
                StoreStatus::AlreadyStored => {}
            }
        }
        if out.is_empty() && no_space {
            let _ = self.mgr.abort(g.id);
            return Err(BackendError::NoSpace);
        }
        // Marked before the engine learns the slots: a restart fences them.
        self.fence.lock().hold(
            owner,
            pages.iter().flat_map(|(_, objects)| objects.iter().map(|&(_, s)| s)),
        );
        self.stores.lock().insert(
            g.id,
            StoreInfo {
                ns,
                hashes: hashes.to_vec(),
                pages,
            },
        );
        Ok((g.id, out))
    }

    fn commit_store(&self, grant: u64, written: &[bool]) -> Result<(u64, u32), BackendError> {
        let info = self
            .stores
            .lock()
            .remove(&grant)
            .ok_or(BackendError::UnknownGrant(grant))?;
        if info.pages.len() != written.len() {
            let pages = info.pages.len();
            self.stores.lock().insert(grant, info);
            return Err(BackendError::FlagCount {
                grant,
                pages,
                flags: written.len(),
            });
        }
        let layout = self.mgr.pages().layout(info.ns)?;
        let arena = self.mgr.stores().arena().ok_or(ManagerError::NoNamespace)?;
        let mut flags = vec![false; info.hashes.len()];
        let mut recs = Vec::new();
        for ((i, objects), &ok) in info.pages.iter().zip(written) {
            // A page whose slot stamps changed since the grant is not kept (a late copy).
            let ok = ok && fence::stamped(&arena, objects);
            flags[*i] = ok;
            if !ok {
                continue;
            }
            for &(o, slot) in objects {
                let len = layout.object_bytes(o);
                // SAFETY: the grant owns these slots until it is committed.
                let sum = unsafe { arena.slot(slot, len as usize) }.map_or(0, xxh3_64);
                recs.push(ObjectRecord {
                    ns: info.ns.0,
                    hash: info.hashes[*i],
                    object: o as u16,
                    slot: slot.0,
                    len,
                    checksum: sum,
                });
            }
        }
        {
            // Removals first, so a slot freed by eviction and granted again is released
            // before it is recorded anew; the records go in before the journal next reads
            // events, so the commit's own `stored` events find them in place.
            let mut journal = self.journal.lock();
            journal.sync(&self.mgr);
            self.mgr.commit_store(grant, &flags)?;
            journal.record(recs);
            journal.flush(&self.mgr);
        }
        self.fence.lock().release(Self::grant_slots(&info));
        let complete = self.complete_on_host(info.ns, &info.hashes);
        self.tickets.insert(grant, info.ns, info.hashes);
        self.tickets.bump();
        Ok((grant, complete))
    }

    fn abort_store(&self, grant: u64) -> Result<(), BackendError> {
        let info = self.stores.lock().remove(&grant);
        self.mgr.abort(grant)?;
        if let Some(info) = info {
            self.fence.lock().release(Self::grant_slots(&info));
        }
        self.tickets.bump();
        Ok(())
    }

    fn begin_load(
        &self,
        ns: NamespaceId,
        tp: u16,
        pp: u16,
        hashes: &[PageHash],
        wait: LoadWait,
        owner: u64,
    ) -> Result<(u64, Vec<Vec<ObjectSlot>>), BackendError> {
        let (mwait, limit) = match wait {
            LoadWait::BestEffort => (manager::LoadWait::BestEffort, Duration::ZERO),
            LoadWait::WaitComplete => (manager::LoadWait::WaitComplete, self.cfg.max_wait),
            LoadWait::Timeout(ms) => {
                let d = Duration::from_millis(ms as u64).min(self.cfg.max_wait);
                (
                    manager::LoadWait::Timeout {
                        ms: d.as_millis() as u64,
                    },
                    d,
                )
            }
        };
        let deadline = Instant::now() + limit;
        loop {
            let g = self.mgr.begin_load(ns, tp, pp, hashes, mwait, owner)?;
            let n = g.pages.len();
            // Wait only while the next page is on its way (another rank holds part of it).
            let pending = n < hashes.len() && self.host_state(ns, &hashes[n]).1;
            if !pending || Instant::now() >= deadline {
                let arena = self.mgr.stores().arena();
                let slot = |&(o, s, _): &_| fence::object_slot(arena.as_deref(), o, s);
                let mut pages: Vec<Vec<ObjectSlot>> =
                    g.pages.iter().map(|p| p.objects.iter().map(slot).collect()).collect();
                // The rest stay leased until `finish_load`, which drops the page hit.
                pages.truncate(fence::granted_prefix(arena.as_deref(), &pages));
                return Ok((g.id, pages));
            }
            self.mgr.finish_load(g.id, 0)?;
            self.tickets.wait_change(deadline);
        }
    }

    fn finish_load(&self, grant: u64, loaded: usize) -> Result<(), BackendError> {
        let hit = fence::hit_pages(&self.mgr, grant, loaded);
        let done = self.mgr.finish_load(grant, loaded);
        fence::drop_hit(&self.mgr, &hit);
        match done {
            Ok(_) => Ok(()),
            Err(ManagerError::UnknownGrant(g)) => Err(BackendError::UnknownGrant(g)),
            Err(e) => Err(e.into()),
        }
    }

    fn ticket(&self, ticket: u64, timeout: Duration) -> Result<TicketStatus, BackendError> {
        let deadline = Instant::now() + timeout.min(self.cfg.max_wait);
        let (ns, hashes) = self.tickets.get(ticket).ok_or(BackendError::UnknownGrant(ticket))?;
        loop {
            let t = self.ticket_status(ns, &hashes);
            // A poll (no wait) answers what it saw: walking the pages again would see the
            // same, at twice the cost, on the control thread.
            if t.done() || timeout.is_zero() || !self.tickets.wait_change(deadline) {
                return Ok(if t.done() || timeout.is_zero() {
                    t
                } else {
                    self.ticket_status(ns, &hashes)
                });
            }
        }
    }

    fn removed(&self, ns: NamespaceId, tp: u16, pp: u16, hashes: &[PageHash]) -> Result<usize, BackendError> {
        let mut n = 0;
        for chunk in hashes.chunks(self.mgr.config().max_batch) {
            n += self.mgr.removed(ns, tp, pp, chunk)?;
        }
        Ok(n)
    }

    fn session(&self, id: &str, parent: Option<&str>, phase: SessionPhase) -> Result<(), BackendError> {
        let policy_phase = match phase {
            SessionPhase::Reasoning => crate::policy::Phase::Reasoning,
            SessionPhase::Acting => crate::policy::Phase::Acting,
            SessionPhase::Paused => crate::policy::Phase::Paused,
            SessionPhase::Ended => crate::policy::Phase::Ended,
        };
        // The policy refuses a parent cycle or an over-long id before the session table or
        // any page's eviction class changes.
        self.mgr
            .session_policy()
            .phase(&self.mgr, id, parent.filter(|p| !p.is_empty()), policy_phase)?;
        tracing::debug!(
            id_len = id.len(),
            has_parent = parent.is_some(),
            ?phase,
            "session phase"
        );
        Ok(())
    }

    fn request_end(&self, end: &crate::policy::RequestEnd) -> Result<(), BackendError> {
        self.mgr.session_policy().request_ended(&self.mgr, end)?;
        if let Some(t) = &self.traces {
            let line = crate::session::trace_log::TraceLine {
                timestamp: self.clock.now_ms(),
                input_length: end.input_length,
                output_length: end.output_length,
                hash_ids: end
                    .hashes
                    .iter()
                    .map(crate::session::trace_log::TraceLine::hash_id)
                    .collect(),
                session_id: end.session_id.clone(),
                parent_session_id: end.parent_session_id.clone(),
            };
            // A full disk loses trace lines, never the request: the engine is not told.
            if let Err(e) = t.lock().append(&line) {
                tracing::warn!(error = %e, "request trace not written");
            }
        }
        Ok(())
    }

    fn hint(&self, ns: NamespaceId, hint: &Hint) -> Result<HintOutcome, BackendError> {
        let outcome = match self.mgr.hint(ns, hint.clone()) {
            Ok(o) => o,
            Err(ManagerError::Hint(e)) => return Err(BackendError::Hint(e)),
            Err(e) => return Err(e.into()),
        };
        if matches!(hint, Hint::Prefetch { .. }) {
            // A prefetch stages pages from the pool before it answers: journal them now,
            // not at the next tick, so a crash right after the answer keeps them.
            let mut journal = self.journal.lock();
            journal.sync(&self.mgr);
            journal.flush(&self.mgr);
        }
        Ok(outcome)
    }

    fn take_advice(&self, ns: NamespaceId, max_pages: usize) -> AdviceBatch {
        let (taken, more) = self.mgr.engine_queues().take_advice_for(ns, max_pages);
        let advice = taken
            .into_iter()
            .map(|a| match a {
                manager::Advice::EvictFirst { hashes, .. } => EngineAdvice::pages(AdviceKind::EvictFirst, hashes),
                manager::Advice::Offload { hashes, .. } => EngineAdvice::pages(AdviceKind::Offload, hashes),
                manager::Advice::ReadyToLoad { hashes, .. } => EngineAdvice::pages(AdviceKind::ReadyToLoad, hashes),
                manager::Advice::Pause { session_id, .. } => EngineAdvice::session(AdviceKind::Pause, session_id),
                manager::Advice::Resume { session_id, .. } => EngineAdvice::session(AdviceKind::Resume, session_id),
            })
            .collect();
        AdviceBatch { advice, more }
    }

    fn lookup_served(&self, d: Duration) {
        self.mgr.discovery().lookup_served(d);
    }

    fn lookups_tallied(&self, t: &crate::wire::LookupTally) {
        self.mgr.discovery().lookups_tallied(t);
    }

    fn stats(&self) -> DaemonStats {
        let s = self.mgr.stats();
        let arena = self.mgr.stores().arena();
        DaemonStats {
            arena_slots: arena.as_ref().map_or(0, |a| a.slots() as u64),
            arena_used: arena.as_ref().map_or(0, |a| a.used() as u64),
            host_complete_pages: s.tier(TierKind::Host).complete_pages,
            open_grants: s.open_grants,
            connections: 0,
            recovered_pages: self.recovered.pages,
            discarded_pages: self.recovered.discarded(),
        }
    }

    fn next_deadline(&self) -> Option<Duration> {
        self.mgr.upkeep().until_next_deadline()
    }

    fn host_keep(&self) -> Option<crate::admin::HostKeep> {
        let (manifest_bytes, manifest_live_records, manifest_compactions, manifest_resyncs) = self.manifest_upkeep();
        Some(crate::admin::HostKeep {
            manifest_bytes,
            manifest_live_records,
            manifest_compactions,
            manifest_resyncs,
            fenced_slots: self.fenced_slots() as u64,
        })
    }

    fn tick(&self) {
        if let Err(e) = self.mgr.tick() {
            tracing::warn!(error = %e, "background work failed");
        }
        if let Some(arena) = self.mgr.stores().arena() {
            self.fence.lock().expire(&arena);
        }
        let mut j = self.journal.lock();
        j.sync(&self.mgr);
        j.flush(&self.mgr);
    }

    fn shutdown(&self) -> Result<(), BackendError> {
        if !self.mgr.quiesce(Duration::from_secs(5)) {
            tracing::warn!("transfers still running at shutdown");
        }
        self.journal.lock().compact(&self.mgr)
    }
}
