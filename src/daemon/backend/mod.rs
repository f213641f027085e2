//! What the daemon's request handlers drive: a [`Backend`] that owns the directory, the
//! host arena and the grants of engine-driven copies.
//!
//! The trait mirrors the in-process manager's engine-facing API (register, lookup,
//! begin/commit/abort store, begin/finish load, removed, hint, tick), so the daemon can be
//! pointed at any implementation. [`host::HostBackend`] is the host-tier implementation
//! the daemon runs today, with crash recovery through a checksummed [`manifest`].

pub mod host;
mod host_hint;
mod host_recover;
pub mod manifest;

use std::time::Duration;

use crate::directory::{DirectoryError, PrefixHit};
use crate::hints::{Hint, HintError, HintOutcome};
use crate::layout::{Layout, LayoutError, LayoutSpec};
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::protocol::{ArenaInfo, DaemonStats, GrantPage, LoadWait, ObjectSlot, SessionPhase, TicketStatus};
use crate::tier::host::ArenaError;

pub use host::{HostBackend, HostConfig};

/// Why the backend refused an operation.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Directory(#[from] DirectoryError),
    #[error(transparent)]
    Arena(#[from] ArenaError),
    #[error("objects of {bytes} bytes do not fit the arena's {slot_bytes}-byte slots")]
    ObjectTooLarge { bytes: u64, slot_bytes: u64 },
    #[error("unknown grant or ticket {0}")]
    UnknownGrant(u64),
    #[error("grant {grant} has {pages} pages but {flags} flags were sent")]
    FlagCount { grant: u64, pages: usize, flags: usize },
    #[error("the host arena has no free slot, even after eviction")]
    NoSpace,
    #[error("too many open grants ({0})")]
    TooManyGrants(usize),
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
/// waits (`begin_load` with a wait policy, `ticket`) take an explicit deadline.
pub trait Backend: Send + Sync + 'static {
    /// Registers (or finds) a namespace with its layout; creates the arena on first use.
    fn register(&self, ns: &Namespace, spec: &LayoutSpec) -> Result<Registered, BackendError>;
    /// Contiguous-prefix lookup with per-tier credit.
    fn lookup(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<PrefixHit, BackendError>;
    /// Reserves host slots for the rank's objects of each page that still needs them.
    fn begin_store(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        session: &str,
    ) -> Result<(u64, Vec<GrantPage>), BackendError>;
    /// Marks the written pages' objects present; returns the ticket and how many of the
    /// grant's pages are complete across every rank now.
    fn commit_store(&self, grant: u64, written: &[bool]) -> Result<(u64, u32), BackendError>;
    /// Frees every slot of a store grant (a failed copy, or a dead client).
    fn abort_store(&self, grant: u64) -> Result<(), BackendError>;
    /// Holds the leading host-complete pages for reading and returns the rank's slots.
    fn begin_load(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        wait: LoadWait,
    ) -> Result<(u64, Vec<Vec<ObjectSlot>>), BackendError>;
    /// Releases a load grant's hold on its pages.
    fn finish_load(&self, grant: u64) -> Result<(), BackendError>;
    /// A ticket's status, waiting up to `timeout` for it to finish.
    fn ticket(&self, ticket: u64, timeout: Duration) -> Result<TicketStatus, BackendError>;
    /// The engine freed these device pages. Returns how many kvtier knew.
    fn removed(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<usize, BackendError>;
    /// A session changed phase (tool-call start/end, pause, end).
    fn session(&self, id: &str, parent: Option<&str>, phase: SessionPhase);
    fn hint(&self, ns: NamespaceId, hint: &Hint) -> Result<HintOutcome, HintError>;
    /// Counters (the daemon adds its connection count).
    fn stats(&self) -> DaemonStats;
    /// Periodic work: TTL expiry.
    fn tick(&self);
    /// Clean shutdown: compacts persistent state.
    fn shutdown(&self) -> Result<(), BackendError>;
}
