//! What the daemon's request handlers drive: a [`Backend`] over the tier manager.
//!
//! [`managed::ManagedTiers`] wraps the in-process [`crate::manager::Manager`] and adds what
//! only a daemon needs: owner-tagged grants that die with their connection, tickets that
//! say when a store is complete across ranks, and crash recovery of the host arena
//! through a checksummed [`manifest`] ([`journal`]).

mod fence;
mod journal;
pub mod managed;
pub mod manifest;
mod tickets;

#[cfg(test)]
mod tests;

use std::time::Duration;

use crate::hints::{Hint, HintError, HintOutcome};
use crate::layout::{Layout, LayoutSpec};
use crate::manager::{LookupStep, ManagerError, PendingLookup};
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::pool::PoolError;
use crate::protocol::{
    AdviceBatch, ArenaInfo, DaemonStats, GrantPage, LoadWait, ObjectSlot, SessionPhase, TicketStatus,
};
use crate::wire::PrefixHit;

pub use managed::{ManagedTiers, SharedPool, TiersConfig};

/// Why the backend refused an operation.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Manager(#[from] ManagerError),
    #[error(transparent)]
    Hint(#[from] HintError),
    #[error("unknown grant or ticket {0}")]
    UnknownGrant(u64),
    #[error("grant {grant} has {pages} pages but {flags} flags were sent")]
    FlagCount { grant: u64, pages: usize, flags: usize },
    #[error("the host arena has no free slot, even after eviction")]
    NoSpace,
    /// A layout whose objects are larger than the host arena's slots (`bad_layout`).
    #[error(
        "objects of {need} bytes do not fit the host arena's {slot}-byte slots, {how}; set host.slot_bytes \
         to at least {need} (a restart with it starts a fresh arena) to serve this layout beside the others"
    )]
    SlotTooSmall { need: u64, slot: u64, how: String },
    #[error(transparent)]
    Private(#[from] crate::tier::private::PrivateError),
    #[error("manifest {path}: {source}")]
    Manifest {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// A namespace as registered: its id, validated layout and the arena clients map.
#[derive(Clone, Debug)]
pub struct Registered {
    pub ns: NamespaceId,
    pub layout: Layout,
    pub arena: ArenaInfo,
}

/// The operations the daemon's handlers need. Every method is bounded in time: the only
/// waits (`begin_load` with a wait policy, `ticket`) have a deadline. `owner` is the
/// connection id: grants are tagged with it so a dead client's can be found.
pub trait Backend: Send + Sync + 'static {
    /// Registers (or finds) a namespace with its layout; creates the arena on first use.
    fn register(&self, ns: &Namespace, spec: &LayoutSpec) -> Result<Registered, BackendError>;
    /// Whether a lookup or a load may wait on the network: it asks a shared pool about
    /// pages other nodes wrote (cluster mode). Such calls leave the connection task.
    fn discovers_remotely(&self) -> bool {
        false
    }
    /// Contiguous-prefix lookup with per-tier credit.
    fn lookup(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<PrefixHit, BackendError>;
    /// A lookup's first step on the connection task, where the pool's query can be awaited
    /// instead of blocking (see [`PoolDiscovery::lookup_begin`](crate::manager::PoolDiscovery::lookup_begin)).
    /// Default: [`LookupStep::Blocking`], run [`Backend::lookup`] off the runtime.
    fn lookup_begin(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<LookupStep, BackendError> {
        let _ = (ns, hashes);
        Ok(LookupStep::Blocking)
    }
    /// The directory work that lookups answered on the connection task left for after
    /// their reply (see [`crate::manager::settle_lookups`]). Default: none.
    fn settle_lookups(&self) {}
    /// Completes a lookup that [`Backend::lookup_begin`] handed back as a query.
    fn lookup_finish(
        &self,
        ns: NamespaceId,
        hashes: &[PageHash],
        pending: PendingLookup,
        answers: Vec<Result<bool, PoolError>>,
    ) -> Result<PrefixHit, BackendError> {
        let _ = (pending, answers);
        self.lookup(ns, hashes)
    }
    /// Reserves host slots for the rank's objects of each page that still needs them.
    #[allow(clippy::too_many_arguments)]
    fn begin_store(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        session: &str,
        owner: u64,
    ) -> Result<(u64, Vec<GrantPage>), BackendError>;
    /// Marks the written pages' objects present (`written[i]` for grant page `i`);
    /// returns the ticket and how many requested pages are complete across every rank.
    fn commit_store(&self, grant: u64, written: &[bool]) -> Result<(u64, u32), BackendError>;
    /// Frees every slot of a store grant (a failed copy, or a dead client).
    fn abort_store(&self, grant: u64) -> Result<(), BackendError>;
    /// Leases the leading host-complete pages and returns the rank's slots of each.
    #[allow(clippy::too_many_arguments)]
    fn begin_load(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        wait: LoadWait,
        owner: u64,
    ) -> Result<(u64, Vec<Vec<ObjectSlot>>), BackendError>;
    /// Connection `conn`'s client library sent its restart-fence token; `done`: no copy
    /// of its earlier grants is still running. Returns the quarantined slots freed.
    fn fence_engine(&self, _conn: u64, _token: u64, _done: bool) -> usize {
        0
    }
    /// An engine's report of the lookups it answered itself (see
    /// [`crate::wire::LookupTally`]): counted as lookups, not timed.
    fn lookups_tallied(&self, _t: &crate::wire::LookupTally) {}
    /// Connection `conn` closed (after its grants were given back).
    fn forget_conn(&self, _conn: u64) {}
    /// Ends a load: the first `loaded` pages are now on the rank's device.
    fn finish_load(&self, grant: u64, loaded: usize) -> Result<(), BackendError>;
    /// A ticket's status, waiting up to `timeout` for it to finish.
    fn ticket(&self, ticket: u64, timeout: Duration) -> Result<TicketStatus, BackendError>;
    /// The rank freed these device pages. Returns how many kvtier knew.
    fn removed(&self, ns: NamespaceId, tp_rank: u16, pp_rank: u16, hashes: &[PageHash]) -> Result<usize, BackendError>;
    /// A session changed phase (tool-call start/end, pause, end).
    /// Refused with a typed error when the id is over the session id limit.
    fn session(&self, id: &str, parent: Option<&str>, phase: SessionPhase) -> Result<(), BackendError>;
    /// A request finished (session, lengths, page hashes; no content).
    fn request_end(&self, _end: &crate::policy::RequestEnd) -> Result<(), BackendError> {
        Ok(())
    }
    fn hint(&self, ns: NamespaceId, hint: &Hint) -> Result<HintOutcome, BackendError>;
    /// Takes the namespace's advice for engines, at most `max_pages` page hashes in all.
    fn take_advice(&self, ns: NamespaceId, max_pages: usize) -> AdviceBatch;
    /// Counters (the daemon adds its connection count).
    fn stats(&self) -> DaemonStats;
    /// A lookup was answered `d` after its request was read (the lookup latency).
    fn lookup_served(&self, _d: Duration) {}
    /// The manifest's upkeep and the restart fence, for the admin socket (a backend
    /// without a manifest has none).
    fn host_keep(&self) -> Option<crate::admin::HostKeep> {
        None
    }
    /// Periodic work: TTLs, watermark eviction, deferred hints, manifest upkeep.
    fn tick(&self);
    /// How long until the earliest pin or retain expires, if any, so upkeep can sleep
    /// until then rather than only on its fallback tick.
    fn next_deadline(&self) -> Option<std::time::Duration> {
        None
    }
    /// Clean shutdown: finishes transfers and compacts persistent state.
    fn shutdown(&self) -> Result<(), BackendError>;
}
