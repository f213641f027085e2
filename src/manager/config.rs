//! The manager's configuration: one struct, documented defaults, validated once.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

use super::ManagerError;
use super::locks::{Ordered, Rank};
use crate::policy::{Watermarks, WritePolicy};
use crate::pool::PoolBackend;
use crate::pool::mooncake::MooncakeConfig;
use crate::tier::host::{ArenaOptions, HostArena};

/// Builds a pool backend once the host arena exists (so a backend that moves arena pages
/// without copies, such as Mooncake's, can register it). The daemon constructs its
/// backends this way; `label` names the backend for operators before it is built.
#[derive(Clone)]
pub struct PoolFactory {
    pub label: &'static str,
    #[allow(clippy::type_complexity)]
    pub build: Arc<dyn Fn(Arc<HostArena>) -> Result<Arc<dyn PoolBackend>, String> + Send + Sync>,
}

/// Which shared pool the manager uses.
#[derive(Clone, Default)]
pub enum PoolConfig {
    /// No pool: pages leaving host are dropped.
    None,
    /// The embedded node-local pool in a shared-memory file. Default, with 2 GiB.
    #[default]
    LocalDefault,
    /// The embedded node-local pool at `path` with `bytes` of capacity. With `recover`,
    /// the pool an earlier life left at `path` is reopened with its objects (their pages
    /// are booked once their namespaces are registered); otherwise it starts empty.
    Local { path: PathBuf, bytes: u64, recover: bool },
    /// A backend built by the caller.
    Backend(Arc<dyn PoolBackend>),
    /// A backend the caller builds when the host arena exists.
    Build(PoolFactory),
    /// A Mooncake Store through the wheel's client; started once the host arena exists,
    /// so arena pages move to and from the store without copies.
    Mooncake(Box<MooncakeConfig>),
}

impl std::fmt::Debug for PoolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolConfig::None => f.write_str("None"),
            PoolConfig::LocalDefault => f.write_str("LocalDefault"),
            PoolConfig::Local { path, bytes, recover } => {
                write!(f, "Local({}, {bytes}, recover: {recover})", path.display())
            }
            PoolConfig::Backend(b) => write!(f, "Backend({})", b.name()),
            PoolConfig::Build(b) => write!(f, "Build({})", b.label),
            PoolConfig::Mooncake(c) => write!(f, "Mooncake({c:?})"),
        }
    }
}

/// Tunables that are safe to change while running (admin `config` endpoint).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Tunables {
    /// Watermarks of the device tier (advice only). Default: 0.95 / 0.80 / 0.85.
    pub device_watermarks: Watermarks,
    /// Watermarks of the host arena. Default: 0.95 / 0.80 / 0.85.
    pub host_watermarks: Watermarks,
    /// Watermarks of the pool. Default: 0.95 / 0.80 / 0.85.
    pub pool_watermarks: Watermarks,
    /// Share of a tier that pins may hold. Default: 0.25.
    pub pin_budget: f64,
    /// Longest pin or retain TTL; longer ones are clipped. Default: 600 000 ms.
    pub max_pin_ttl_ms: u64,
    /// When host pages are copied on to the pool. Default: write-back (on eviction).
    pub host_to_pool: WritePolicy,
    /// How long pages staged from the pool into host (a prefetch, a best-effort load) are
    /// protected from eviction unless a load hits them first; 0 turns protection off. At
    /// most half of the host arena's pages are protected at once. Default: 5 000 ms.
    pub stage_protect_ms: u64,
    /// Most sessions the session table holds; a new one in a full table frees the oldest
    /// ended session first, then the one idle longest, then the oldest. Default: 65 536.
    pub max_sessions: usize,
    /// Longest session id in bytes; longer ids are refused. Default: 1 024.
    pub max_session_id_bytes: usize,
    /// Fault injection: every pool batch call waits this long first (read when the pool
    /// is created). 0 (the default) adds nothing.
    pub pool_fault_delay_ms: u64,
}

/// The runtime tunables behind their own lock, of rank [`Rank::Tunables`]: read as a
/// copy, so no caller holds the lock while it works.
#[derive(Debug)]
pub(crate) struct TunableCell(RwLock<Tunables>);

impl TunableCell {
    pub(crate) fn new(t: Tunables) -> Self {
        Self(RwLock::new(t))
    }

    pub(crate) fn get(&self) -> Tunables {
        *Ordered::take(Rank::Tunables, || self.0.read())
    }

    pub(crate) fn set(&self, t: Tunables) {
        *Ordered::take(Rank::Tunables, || self.0.write()) = t;
    }

    /// Holds the lock until the guard drops (tests: proving a path does not need it).
    #[cfg(test)]
    pub(crate) fn hold(&self) -> impl Drop + '_ {
        Ordered::take(Rank::Tunables, || self.0.write())
    }
}

impl Default for Tunables {
    fn default() -> Self {
        Self {
            device_watermarks: Watermarks::default(),
            host_watermarks: Watermarks::default(),
            pool_watermarks: Watermarks::default(),
            pin_budget: 0.25,
            max_pin_ttl_ms: 600_000,
            host_to_pool: WritePolicy::WriteBack,
            stage_protect_ms: 5_000,
            max_sessions: crate::session::registry::DEFAULT_MAX_SESSIONS,
            max_session_id_bytes: crate::session::registry::DEFAULT_MAX_ID_BYTES,
            pool_fault_delay_ms: 0,
        }
    }
}

impl Tunables {
    pub fn validate(&self) -> Result<(), ManagerError> {
        for w in [&self.device_watermarks, &self.host_watermarks, &self.pool_watermarks] {
            w.validate().map_err(|e| ManagerError::Config(e.to_string()))?;
        }
        if !(0.0..=1.0).contains(&self.pin_budget) {
            return Err(ManagerError::Config(format!(
                "pin_budget {} is not in 0..=1",
                self.pin_budget
            )));
        }
        if self.max_sessions == 0 || self.max_session_id_bytes == 0 {
            return Err(ManagerError::Config(
                "max_sessions and max_session_id_bytes must be positive".into(),
            ));
        }
        if self.max_pin_ttl_ms == 0 {
            return Err(ManagerError::Config("max_pin_ttl_ms must be positive".into()));
        }
        Ok(())
    }
}

/// Everything the manager needs to start.
#[derive(Clone, Debug)]
pub struct ManagerConfig {
    /// The host arena's shared-memory file. Default: `/dev/shm/kvtier-<pid>-host`.
    pub host_path: PathBuf,
    /// Host arena capacity in bytes. Default: 1 GiB.
    pub host_bytes: u64,
    /// How the arena is mapped (locking, parallel first touch). Default: lock and touch.
    pub arena: ArenaOptions,
    /// The shared pool. Default: the local pool, 2 GiB, beside the arena.
    pub pool: PoolConfig,
    /// Tag of the pool key prefix `{tag}_{model}_`; with `pool_key_format` `Sglang`, empty
    /// gives bare HiCache keys (only safe with one model per pool). Default: `kvtier`.
    pub pool_key_tag: String,
    /// How pool keys are rendered: kvtier's (namespace escaped, layout fingerprint in every
    /// key) or SGLang's exact keys (see `pool::keys`). Default: `Kvtier`.
    pub pool_key_format: crate::pool::keys::KeyFormat,
    /// Most pages in one request. Default: 4096.
    pub max_batch: usize,
    /// Transfer worker threads. Default: 2.
    pub transfer_threads: usize,
    /// Transfer jobs that may wait in the queue. Default: 256.
    pub transfer_queue: usize,
    /// Nice steps the transfer workers lower their CPU priority by when they start (the
    /// daemon's `control.worker_nice`). Default: 0 (the creating thread's priority).
    pub worker_nice: u8,
    /// Cores the transfer workers pin themselves to, worker `i` on `worker_cores[i % len]`
    /// (the daemon's `control.worker_cores`); each must be one this process may run on.
    /// Default: empty (the scheduler places them).
    pub worker_cores: Vec<usize>,
    /// Most pages the directory tracks. Default: 16 Mi.
    pub max_pages: usize,
    /// Makes the directory's lookup index (8 bytes × the power of two above 4/3 ×
    /// `max_pages`) resident at start instead of page by page as lookups first probe it
    /// (the daemon does: no lookup then takes a page fault on it). Default: off.
    pub resident_index: bool,
    /// Puts the directory's lookup view, and the pool index's page table, in a file beside
    /// the arena (`<host_path>.lookup`) that engines map read-only and answer lookups
    /// from (see `directory::shared`). The daemon does. Default: off (the view on the heap).
    pub lookup_file: bool,
    /// Pages the lookup file's pool page table holds (the daemon: `mooncake.index_max_keys`);
    /// 0 without a shared pool. Default: 0.
    pub lookup_pool_pages: usize,
    /// Page events kept for replay. Default: 1 Mi.
    pub event_ring: usize,
    /// Operations that may be outstanding (issued, not yet collected). Default: 65 536.
    pub max_outstanding: usize,
    pub tunables: Tunables,
    /// The session-aware policy; `None` turns it off (sessions then only order
    /// eviction). Default: on, with its defaults.
    pub policy: Option<crate::policy::SessionPolicyConfig>,
    /// Discovery of pages other nodes wrote to a shared pool (see `manager::remote`);
    /// `None` for a pool only this node writes. Default: `None`.
    pub remote: Option<super::RemoteConfig>,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            host_path: PathBuf::from(format!("/dev/shm/kvtier-{}-host", std::process::id())),
            host_bytes: 1 << 30,
            arena: ArenaOptions::default(),
            pool: PoolConfig::LocalDefault,
            pool_key_tag: "kvtier".into(),
            pool_key_format: crate::pool::keys::KeyFormat::Kvtier,
            max_batch: 4096,
            transfer_threads: 2,
            transfer_queue: 256,
            worker_nice: 0,
            worker_cores: Vec::new(),
            max_pages: 16 << 20,
            resident_index: false,
            lookup_file: false,
            lookup_pool_pages: 0,
            event_ring: 1 << 20,
            max_outstanding: 65_536,
            tunables: Tunables::default(),
            policy: Some(crate::policy::SessionPolicyConfig::default()),
            remote: None,
        }
    }
}

impl ManagerConfig {
    /// Refuses a batch of more than `max_batch` pages.
    pub(super) fn check_batch(&self, n: usize) -> Result<(), super::ManagerError> {
        if n > self.max_batch {
            return Err(super::ManagerError::BatchTooLarge {
                got: n,
                max: self.max_batch,
            });
        }
        Ok(())
    }

    /// A configuration whose files all live in `dir` (tests, benches, the daemon's state
    /// directory), with the given host and pool sizes.
    pub fn in_dir(dir: &std::path::Path, host_bytes: u64, pool_bytes: Option<u64>) -> Self {
        Self {
            host_path: dir.join("host.arena"),
            host_bytes,
            pool: match pool_bytes {
                Some(bytes) => PoolConfig::Local {
                    path: dir.join("pool.arena"),
                    bytes,
                    recover: false,
                },
                None => PoolConfig::None,
            },
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<(), ManagerError> {
        self.tunables.validate()?;
        if self.max_batch == 0 || self.transfer_threads == 0 || self.transfer_queue == 0 {
            return Err(ManagerError::Config(
                "max_batch, transfer_threads and transfer_queue must be positive".into(),
            ));
        }
        if !self
            .pool_key_tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
        {
            return Err(ManagerError::Config(format!(
                "pool_key_tag {:?} may hold only letters, digits, '.' and '-'",
                self.pool_key_tag
            )));
        }
        if self.host_bytes == 0 {
            return Err(ManagerError::Config("host_bytes must be positive".into()));
        }
        crate::affinity::check_allowed(&self.worker_cores)
            .map_err(|e| ManagerError::Config(format!("worker_cores names {e}")))?;
        Ok(())
    }
}
