//! The in-process tier manager: the directory, the host arena, the pool and the transfer
//! engine behind one API. The daemon is a thin layer over it.
//!
//! Engine ranks store and load through *grants*: `begin_store` reserves host slots for
//! the rank's objects and marks them in flight; the rank (or a transfer worker, in
//! process) copies the bytes; `commit_store` makes them present. A page becomes complete
//! in a tier only when every object of every rank is present there, so no rank needs a
//! collective with the others. A failed or abandoned grant frees its slots and leaves
//! the source intact. Loads lease the host slots they read so eviction cannot reuse them.
//!
//! The state is split by who touches it, each part behind its own lock (`locks` says in
//! which order they nest): lookups read the directory under a shared lock and never wait
//! on grants, timers, queues, sessions or admin renders.

mod config;
mod devices;
mod engine;
mod grants;
mod hints;
mod host_io;
mod host_pages;
mod inproc;
mod locks;
mod moves;
mod pages;
mod policy;
mod pool_evict;
mod pool_layout;
mod pool_recover;
mod pool_sync;
mod queues;
mod recover;
mod remote;
mod session_events;
mod session_registry;
mod stage;
mod state;
mod stats;
mod store_plan;
mod stores;
mod tiers;
mod timers;
mod upkeep;

/// Pages per batch of a staging from the pool (the bench sizes its references by it).
#[cfg(feature = "daemon")]
pub(crate) use stage::POOL_BATCH as STAGE_BATCH_PAGES;

#[cfg(test)]
mod api_tests;
#[cfg(test)]
mod evict_tests;
#[cfg(test)]
mod grant_tests;
#[cfg(test)]
mod remote_tests;
#[cfg(test)]
mod split_tests;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use config::TunableCell;
pub use config::{ManagerConfig, PoolConfig, PoolFactory, Tunables};
pub use engine::{LoadGrant, LoadPage, LoadWait, OpResult, StoreGrant, StorePage, StoreStatus};
pub use host_io::PageObjects;
pub use host_pages::{GrantedPage, drop_host_copy, host_complete_pages, load_grant_pages};
pub use moves::{MOVE_QUEUE, MoveCounts};
pub use policy::SessionPolicyPart;
pub use pool_recover::{PoolAdopted, adopt_recovered_pool};
pub use queues::{Advice, EngineQueues};
#[cfg(feature = "daemon")]
pub use remote::{LookupStep, PendingLookup};
pub use remote::{PoolDiscovery, PoolOrigin, PoolReport, RemoteConfig, RemoteSnapshot, settle_lookups};
pub use session_events::{
    SESSION_EVENT_RING, SessionEvent, SessionEventBatch, SessionEventKind, SessionEventLog, SessionEventReason,
};
pub use session_registry::SessionRegistry;
pub use stats::{
    COPY_BUCKETS_S, CopyLatency, LOOKUP_BUCKETS_S, Latency, RECOVERY_REASONS, Stats, StatsSnapshot, TierStats,
};
pub use stores::Stores;

use crate::clock::Clock;
use crate::directory::shared::{self, LookupFile};
use crate::directory::{Directory, DirectoryError};

use crate::hints::HintError;
use crate::layout::Layout;
use crate::page::{KeyScheme, Namespace, NamespaceId, PageError, PageHash};
use crate::pool::PoolError;
use crate::pool::mooncake::MooncakeError;
pub use crate::session::SessionError;
pub use crate::session::registry::{DEFAULT_MAX_ID_BYTES, DEFAULT_MAX_SESSIONS};
use crate::tier::TierKind;
use crate::tier::device::{DeviceError, DeviceRegion};
use crate::tier::host::ArenaError;
use crate::transfer::{TicketError, TransferEngine};
use crate::wire::PrefixHit;
use grants::Grants;
pub use pages::Pages;
pub use upkeep::Upkeep;

/// Errors of the manager's API. Each is a caller's mistake or a resource problem; none
/// leaves the manager in a bad state.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Directory(#[from] DirectoryError),
    #[error(transparent)]
    Page(#[from] PageError),
    #[error(transparent)]
    Arena(#[from] ArenaError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Mooncake(#[from] MooncakeError),
    #[error(transparent)]
    Hint(#[from] HintError),
    #[error(transparent)]
    Ticket(#[from] TicketError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("a batch of {got} pages exceeds the maximum of {max}")]
    BatchTooLarge { got: usize, max: usize },
    #[error("{hashes} hashes but {slots} device slots")]
    LengthMismatch { hashes: usize, slots: usize },
    #[error("object of {got} bytes where the layout says {want}")]
    ObjectSize { got: usize, want: u64 },
    #[error(
        "objects of {need} bytes do not fit the host arena's {slot} byte slots; the daemon's host.slot_bytes \
         must be at least {need}"
    )]
    SlotTooSmall { need: u64, slot: usize },
    #[error("no device region is attached for namespace {ns} rank tp={tp} pp={pp}")]
    NoDevice { ns: u16, tp: u16, pp: u16 },
    #[error("unknown grant {0}")]
    UnknownGrant(u64),
    #[error("grant {id} covers {pages} pages, the result names {got}")]
    GrantMismatch { id: u64, pages: usize, got: usize },
    #[error("a store of {pages} pages needs {need} host slots; the arena has {slots} in all")]
    StoreTooLarge { pages: usize, need: usize, slots: u32 },
    #[error("the transfer queue is full")]
    Busy,
    #[error("no namespace is registered yet")]
    NoNamespace,
    #[error(transparent)]
    Policy(#[from] crate::policy::SessionPolicyError),
}

/// The tier manager. Cheap to clone; all clones share one state.
#[derive(Clone)]
pub struct Manager {
    inner: Arc<Inner>,
}

/// The manager's state, split by who touches it. Each lock's rank (in brackets) is its
/// place in the one nesting order: a thread takes locks in increasing rank only, through
/// the helpers in `locks` (`read`, `write`, `grants`, `tunables`) or, for the components
/// that own their state (`stores`, `pages`, `sessions`, `devices`, `policy`, `upkeep`,
/// `queues`), inside the component's own methods; all check the order in test and debug
/// builds. See docs/ARCHITECTURE.md, "Locks".
pub(crate) struct Inner {
    cfg: ManagerConfig,
    clock: Arc<dyn Clock>,
    /// [Init] The host arena and the pool, each made once under their own lock, taken
    /// before any other.
    stores: Stores,
    /// [Dir] The directory (key schemes and host slot map with it) behind its
    /// read-mostly lock, its lock-free lookup view and its event log.
    pages: Pages,
    /// [Grants] Open grants and host-slot leases. Nested inside `dir` when a lease must
    /// agree with completeness (loads, pool writes, eviction).
    grants: Grants,
    /// [Queues] Advice and deferred hints; filled after the directory work is done.
    queues: EngineQueues,
    /// [Sessions] Interned sessions and the idle set (a component that owns its lock).
    sessions: SessionRegistry,
    /// [Tunables] Runtime tunables; read as a copy.
    tun: TunableCell,
    /// [Devices] Attached device regions and device pages per namespace.
    devices: devices::Devices,
    /// [Policy] The session-aware policy, when configured (taken alone), with the queue
    /// of its pool moves and the session event log (a component that owns them).
    policy: SessionPolicyPart,
    /// [Timers] Pin and retain expiries, watermark crossings and the upkeep waker (a
    /// component that owns its lock; crossings are lock-free on the hot path).
    upkeep: Upkeep,
    /// The transfer workers (shared with the policy's move queue).
    xfer: Arc<TransferEngine>,
    /// In-process operations' tickets (a component that owns its table).
    jobs: inproc::InProcJobs,
    stats: Stats,
    /// [Remote] Discovery of pages other nodes wrote, on a shared pool.
    remote: Option<remote::Remote>,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Manager").field("config", &self.inner.cfg).finish()
    }
}

/// The lookup file ([`ManagerConfig::lookup_file`]): a directory over its view, the file
/// (live, with the discovery flags set), and the pool page table when the pool is shared.
fn open_lookup_file(
    cfg: &ManagerConfig,
) -> Result<(Directory, Arc<LookupFile>, Option<crate::pool::index::table::PoolTable>), ManagerError> {
    let path = crate::directory::shared::lookup_path(&cfg.host_path);
    let records = crate::directory::max_records(cfg.max_pages);
    let pool_pages = if cfg.remote.is_some() { cfg.lookup_pool_pages } else { 0 };
    let (file, dir_view, pool_view) = LookupFile::create(&path, cfg.arena.group, records, pool_pages)
        .map_err(|e| ManagerError::Config(format!("lookup file: {e}")))?;
    let dir = Directory::from(dir_view);
    let (flags, budget) = match &cfg.remote {
        Some(r) => (shared::LIVE | shared::REMOTE, r.budget_pages),
        None => (shared::LIVE, 0),
    };
    file.set_flags(flags, budget, cfg.max_batch);
    let file = Arc::new(file);
    let table =
        (pool_pages > 0).then(|| crate::pool::index::table::PoolTable::new(file.clone(), pool_view, pool_pages));
    Ok((dir, file, table))
}

impl Manager {
    pub fn new(cfg: ManagerConfig, clock: Arc<dyn Clock>) -> Result<Self, ManagerError> {
        cfg.validate()?;
        let session_policy = match cfg.policy {
            Some(p) => Some(
                crate::policy::SessionPolicy::new(p, clock.clone()).map_err(|e| ManagerError::Config(e.to_string()))?,
            ),
            None => None,
        };
        let (dir, lookup, table) = if cfg.lookup_file {
            let (dir, file, table) = open_lookup_file(&cfg)?;
            (dir, Some(file), table)
        } else {
            (Directory::try_new(cfg.max_pages)?, None, None)
        };
        if cfg.resident_index && lookup.as_ref().is_none_or(|f| f.on_tmpfs()) {
            dir.view().make_index_resident();
        }
        let xfer = Arc::new(TransferEngine::configured(
            cfg.transfer_threads,
            cfg.transfer_queue,
            cfg.worker_nice,
            &cfg.worker_cores,
        ));
        let sessions = SessionRegistry::default();
        sessions.set_limits(cfg.tunables.max_sessions, cfg.tunables.max_session_id_bytes);
        Ok(Self {
            inner: Arc::new(Inner {
                policy: SessionPolicyPart::new(session_policy, clock.clone(), xfer.clone()),
                xfer,
                jobs: inproc::InProcJobs::new(cfg.max_outstanding),
                stats: Stats::default(),
                remote: cfg.remote.map(|r| remote::Remote::new(r, table, lookup)),
                stores: Stores::new(&cfg),
                pages: Pages::new(dir, cfg.event_ring, clock.clone()),
                grants: Grants::default(),
                queues: EngineQueues::default(),
                sessions,
                tun: TunableCell::new(cfg.tunables),
                devices: devices::Devices::default(),
                upkeep: Upkeep::new(clock.clone()),
                clock,
                cfg,
            }),
        })
    }

    pub fn config(&self) -> &ManagerConfig {
        &self.inner.cfg
    }

    /// Registers a namespace and its layout. The first registration creates the pool, and
    /// the host arena unless [`Stores::create_arena`] or [`Stores::open_existing_arena`]
    /// made it (as the daemon always does, with its configured slot size); an arena made
    /// here has slots of this layout's largest object, for in-process callers.
    pub fn register_namespace(&self, ns: Namespace, layout: Layout) -> Result<NamespaceId, ManagerError> {
        let need = layout.max_object_bytes();
        let arena = self.inner.stores.ensure_arena(need)?;
        if need > arena.slot_bytes() as u64 {
            return Err(ManagerError::SlotTooSmall {
                need,
                slot: arena.slot_bytes(),
            });
        }
        self.inner.stores.ensure_pool(&arena)?;
        let scheme = pool_key_scheme(&self.inner.cfg, &ns, &layout);
        let mut st = self.write();
        let id = st.dir.register(ns, layout.clone())?;
        if st.keys.len() <= id.0 as usize {
            st.keys.push(scheme.clone());
        }
        drop(st);
        self.discovery().publish_namespace(id, &scheme, &layout);
        Ok(id)
    }

    /// The host arena and the pool: where a restarting daemon opens, creates or adopts
    /// the arena before the first namespace is registered.
    pub fn stores(&self) -> &Stores {
        &self.inner.stores
    }

    /// Attaches one rank's device region, so in-process `store`/`load` can copy.
    pub fn attach_device(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        region: Arc<dyn DeviceRegion>,
    ) -> Result<(), ManagerError> {
        let layout = self.pages().layout(ns)?;
        layout
            .rank_objects(tp_rank, pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?;
        // Every rank's region holds its stage's layers of its parts (MLA ranks all hold the
        // latent, though only TP rank 0 stores it).
        let want =
            layout.stage_layers(pp_rank) as u64 * layout.page_tokens() as u64 * layout.token_layer_bytes() as u64;
        if region.object_bytes() as u64 != want {
            return Err(ManagerError::ObjectSize {
                got: region.object_bytes(),
                want,
            });
        }
        self.inner.devices.attach(ns, tp_rank, pp_rank, region);
        Ok(())
    }

    /// Contiguous-prefix lookup with per-tier credit (see [`PrefixHit`]). Takes only the
    /// directory's read lock: it never waits on grants, timers, queues or sessions.
    pub fn lookup(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<PrefixHit, ManagerError> {
        self.inner.cfg.check_batch(hashes.len())?;
        // No lock: the view answers while stores and eviction rounds hold the directory.
        let hit = self.inner.pages.lookup(ns, hashes)?;
        let hit = self.discovery().discover(ns, hashes, hit);
        self.inner.stats.record_lookup(hashes.len(), &hit);
        Ok(hit)
    }

    /// The page directory (completeness, eviction order, the lookup view and the page
    /// event log): namespaces, layouts and key schemes for anyone, the rest for the
    /// components that act on pages.
    pub fn pages(&self) -> &Pages {
        &self.inner.pages
    }

    /// Completeness of a page per tier, and which objects are missing where.
    pub fn page_status(&self, ns: NamespaceId, hash: &PageHash) -> Result<Option<PageStatus>, ManagerError> {
        settle_lookups(self);
        let st = self.read();
        st.dir.layout(ns)?;
        let Some(id) = st.dir.find(ns, hash) else {
            return Ok(None);
        };
        let per_tier = TierKind::ALL.map(|t| TierStatus {
            tier: t,
            complete: st.dir.is_complete(id, t),
            missing: st.dir.objects().missing_objects(id, t),
            inflight: st.dir.objects().inflight_objects(id, t),
            pinned: st.dir.is_pinned(id, t),
        });
        let info = st.dir.info(id);
        Ok(Some(PageStatus {
            hash: *hash,
            tiers: per_tier.to_vec(),
            hits: info.hits,
            retain: info.retain,
        }))
    }

    /// The session table: every session engines and routers named (interned by
    /// [`SessionRegistry::index`]), listed and paged for renders. Holds only its own lock.
    pub fn session_registry(&self) -> &SessionRegistry {
        &self.inner.sessions
    }

    /// Waits up to `timeout` until every queued transfer has finished. Returns whether it
    /// did (shutdown, tests).
    pub fn quiesce(&self, timeout: std::time::Duration) -> bool {
        self.inner.xfer.wait_idle(timeout)
    }

    /// Current tunables.
    pub fn tunables(&self) -> Tunables {
        self.inner.tun.get()
    }

    /// Changes the tunables that are safe to change while running (the session table's
    /// limits among them).
    pub fn set_tunables(&self, t: Tunables) -> Result<(), ManagerError> {
        t.validate()?;
        self.inner.tun.set(t);
        // After the tunables' lock is let go: the table's lock ranks below it.
        self.inner.sessions.set_limits(t.max_sessions, t.max_session_id_bytes);
        Ok(())
    }
}

/// Where a page stands in one tier.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TierStatus {
    pub tier: TierKind,
    pub complete: bool,
    pub missing: Vec<usize>,
    pub inflight: Vec<usize>,
    pub pinned: bool,
}

/// Where a page stands in every tier.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PageStatus {
    pub hash: PageHash,
    pub tiers: Vec<TierStatus>,
    pub hits: u8,
    pub retain: i8,
}

/// The pool key scheme for a namespace of `layout` under the manager's key tag and format
/// (see `pool::keys`): distinct namespaces and layouts never share a key, except in
/// SGLang's format, which is explicit.
pub fn pool_key_scheme(cfg: &ManagerConfig, ns: &Namespace, layout: &Layout) -> KeyScheme {
    crate::pool::keys::scheme_for(&cfg.pool_key_tag, cfg.pool_key_format, ns, layout)
}
