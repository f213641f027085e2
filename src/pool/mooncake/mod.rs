//! The `mooncake` pool backend: a real Mooncake Store, interoperable with SGLang HiCache.
//!
//! Two ways to reach the store implement the same [`PoolBackend`](super::PoolBackend):
//!
//! - [`MooncakePool`] drives the official client of the PyPI wheel
//!   (`mooncake-transfer-engine-non-cuda`) through a small supervised helper process
//!   (`python/kvtier_mooncake_helper.py`, embedded in the binary). The helper maps kvtier's
//!   host arena and a staging region and registers both with Mooncake, so puts and gets
//!   move bytes between those mappings and the store with no extra copy; only keys and
//!   offsets cross the control socket ([`wire`]). Existence queries skip the helper: the
//!   pool asks the master's own `BatchExistKey` RPC from the caller's thread
//!   (`master_rpc.rs`, [`ExistsVia`]).
//! - `cabi::MooncakeCPool` (feature `mooncake-c`, `mooncake.client = "c-abi"`) calls
//!   upstream's own C ABI (`store_c.h`, vendored verbatim) in `libmooncake_store.so`, loaded
//!   into the daemon at run time (`mooncake.library` or `MOONCAKE_STORE_LIBRARY`): no helper.
//!
//! Keys are whatever the caller renders with [`KeyScheme`](crate::page::KeyScheme)
//! (HiCache's scheme); objects hold HiCache's page-first bytes. Error codes map to
//! [`PoolError`](super::PoolError) in [`codes`].

mod batch;
#[cfg(feature = "mooncake-c")]
pub mod cabi;
pub mod codes;
mod helper;
pub mod integrity;
mod master_rpc;
mod polyval_hash;
mod pool;
pub mod programs;
mod run_dir;
mod sealed;
pub mod wire;

use std::path::PathBuf;
use std::time::Duration;

pub use pool::{MooncakePool, RawBench};

/// What to do when a remove meets a read lease (`OBJECT_HAS_LEASE`, -706).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemovePolicy {
    /// Return [`PoolError::HasLease`](super::PoolError::HasLease) unless the caller forces.
    Fail,
    /// Retry up to `attempts` times, `interval` apart, then fail with `HasLease`.
    Retry { attempts: u32, interval: Duration },
    /// Always remove with `force`, overriding readers' leases.
    Force,
}

/// Why a Mooncake backend could not be built.
#[derive(Debug, thiserror::Error)]
pub enum MooncakeError {
    #[error("invalid Mooncake configuration: {0}")]
    Config(String),
    #[error("staging region: {0}")]
    Staging(#[from] crate::tier::host::ArenaError),
    #[error("helper files: {0}")]
    Io(#[from] std::io::Error),
    #[error("helper directory: {0}")]
    Private(#[from] crate::tier::private::PrivateError),
    #[error(transparent)]
    Program(#[from] programs::ProgramError),
    #[error("Mooncake C library: {0}")]
    Library(String),
}

/// Who answers the pool's existence queries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExistsVia {
    /// The master, over its own RPC from the caller's thread (`master_rpc.rs`). A master that
    /// answers in a form this client does not speak turns the pool to `Helper` for good.
    #[default]
    Master,
    /// The wheel's client in the helper, like every data operation.
    Helper,
}

impl ExistsVia {
    pub fn name(self) -> &'static str {
        match self {
            ExistsVia::Master => "master",
            ExistsVia::Helper => "helper",
        }
    }
}

/// Configuration of [`MooncakePool`]. Build with [`MooncakeConfig::new`] and the `with_*`
/// options, or [`MooncakeConfig::from_env`].
#[derive(Clone, Debug)]
pub struct MooncakeConfig {
    pub(crate) master: String,
    pub(crate) metadata: String,
    pub(crate) python: Option<PathBuf>,
    pub(crate) helper_script: Option<PathBuf>,
    pub(crate) local_hostname: String,
    pub(crate) protocol: String,
    pub(crate) device: String,
    pub(crate) segment_bytes: u64,
    pub(crate) local_buffer_bytes: u64,
    pub(crate) replicas: u32,
    pub(crate) staging_bytes: u64,
    pub(crate) run_dir: Option<PathBuf>,
    pub(crate) max_batch: usize,
    pub(crate) op_timeout: Duration,
    pub(crate) min_bandwidth: u64,
    pub(crate) remove_policy: RemovePolicy,
    pub(crate) probe_interval: Duration,
    pub(crate) restart_backoff_max: Duration,
    pub(crate) start_timeout: Duration,
    pub(crate) exists_via: ExistsVia,
    pub(crate) helper_workers: usize,
    pub(crate) test_get_delay: Duration,
    pub(crate) integrity: Option<std::sync::Arc<integrity::Integrity>>,
}

impl MooncakeConfig {
    /// A store whose master listens at `master` (`host:port`) and whose transfer metadata
    /// lives at `metadata` (e.g. `http://127.0.0.1:8080/metadata`).
    pub fn new(master: impl Into<String>, metadata: impl Into<String>) -> Self {
        Self {
            master: master.into(),
            metadata: metadata.into(),
            python: None,
            helper_script: None,
            local_hostname: "127.0.0.1".into(),
            protocol: "tcp".into(),
            device: String::new(),
            segment_bytes: 512 << 20,
            local_buffer_bytes: 16 << 20,
            replicas: 1,
            staging_bytes: 64 << 20,
            run_dir: None,
            max_batch: 256,
            op_timeout: Duration::from_secs(3),
            min_bandwidth: 200 << 20,
            remove_policy: RemovePolicy::Retry {
                attempts: 3,
                interval: Duration::from_millis(200),
            },
            probe_interval: Duration::from_millis(250),
            restart_backoff_max: Duration::from_secs(5),
            start_timeout: Duration::from_secs(20),
            exists_via: ExistsVia::Master,
            helper_workers: 8,
            test_get_delay: Duration::ZERO,
            integrity: None,
        }
    }

    /// From `KVTIER_MOONCAKE_MASTER`, `KVTIER_MOONCAKE_METADATA` (default
    /// `http://{master host}:8080/metadata`) and `KVTIER_MOONCAKE_PYTHON`; `None` when no
    /// master is named.
    pub fn from_env() -> Option<Self> {
        let master = std::env::var("KVTIER_MOONCAKE_MASTER").ok()?;
        let host = master.rsplit_once(':').map_or(master.as_str(), |(h, _)| h).to_owned();
        let metadata =
            std::env::var("KVTIER_MOONCAKE_METADATA").unwrap_or_else(|_| format!("http://{host}:8080/metadata"));
        let mut cfg = Self::new(master, metadata);
        cfg.python = std::env::var_os("KVTIER_MOONCAKE_PYTHON").map(PathBuf::from);
        Some(cfg)
    }

    /// Python interpreter that has the wheel: an absolute path, or a bare name looked up in
    /// the absolute entries of `PATH` at start; checked before it runs ([`programs`]). A
    /// relative path is refused (never resolved against the working directory). Default:
    /// `python3` from `PATH`.
    pub fn with_python(mut self, python: impl Into<PathBuf>) -> Self {
        self.python = Some(python.into());
        self
    }

    /// Run this helper script (an absolute path, checked like the interpreter) instead of
    /// the copy embedded in the binary. Default: embedded.
    pub fn with_helper_script(mut self, path: impl Into<PathBuf>) -> Self {
        self.helper_script = Some(path.into());
        self
    }

    /// Address this node's client advertises to peers. Default: `127.0.0.1`.
    pub fn with_local_hostname(mut self, host: impl Into<String>) -> Self {
        self.local_hostname = host.into();
        self
    }

    /// Transfer protocol and device (`tcp`, or `rdma` with a device list). Default: `tcp`, none.
    pub fn with_protocol(mut self, protocol: impl Into<String>, device: impl Into<String>) -> Self {
        self.protocol = protocol.into();
        self.device = device.into();
        self
    }

    /// Memory this node contributes to the pool (Mooncake's global segment). Default: 512 MiB.
    pub fn with_segment_bytes(mut self, bytes: u64) -> Self {
        self.segment_bytes = bytes;
        self
    }

    /// The client's local transfer buffer (Mooncake's `local_buffer_size`). Default: 16 MiB.
    pub fn with_local_buffer_bytes(mut self, bytes: u64) -> Self {
        self.local_buffer_bytes = bytes;
        self
    }

    /// Copies of each object the store keeps (Mooncake's `replica_num`). Default: 1.
    pub fn with_replicas(mut self, n: u32) -> Self {
        self.replicas = n;
        self
    }

    /// The master's address (`host:port`).
    pub fn master(&self) -> &str {
        &self.master
    }

    /// Staging region for caller buffers outside the host arena; also the largest such
    /// object. Default: 64 MiB.
    pub fn with_staging_bytes(mut self, bytes: u64) -> Self {
        self.staging_bytes = bytes;
        self
    }

    /// Directory for the helper's socket, script copy, staging file and log: created `0700`,
    /// or accepted only when it is ours and private. Default: a fresh directory created
    /// exclusively in `/dev/shm/kvtier-mooncake-<uid>` (or the system temporary directory's),
    /// removed on drop.
    pub fn with_run_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.run_dir = Some(dir.into());
        self
    }

    /// Most objects in one request to the helper; larger caller batches are split. Default: 256.
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }

    /// Base deadline of one request; each request also gets its bytes divided by
    /// `min_bandwidth` (bytes/s). Default: 3 s and 200 MiB/s.
    pub fn with_op_timeout(mut self, base: Duration, min_bandwidth: u64) -> Self {
        self.op_timeout = base;
        self.min_bandwidth = min_bandwidth;
        self
    }

    /// Lease conflicts on remove. Default: retry 3 times, 200 ms apart.
    pub fn with_remove_policy(mut self, policy: RemovePolicy) -> Self {
        self.remove_policy = policy;
        self
    }

    /// How often the supervisor asks the helper for its state. Default: 250 ms.
    pub fn with_probe_interval(mut self, every: Duration) -> Self {
        self.probe_interval = every;
        self
    }

    /// Who answers existence queries. Default: [`ExistsVia::Master`].
    pub fn with_exists_via(mut self, via: ExistsVia) -> Self {
        self.exists_via = via;
        self
    }

    /// Seal every object with a keyed MAC under this cluster key (the key file's
    /// contents) and refuse, as not found, every object whose MAC fails ([`integrity`]).
    /// Default: off.
    pub fn with_integrity_key(mut self, key_material: &[u8]) -> Self {
        self.integrity = Some(std::sync::Arc::new(integrity::Integrity::new(key_material)));
        self
    }

    /// Requests the helper runs at once (each on its own thread; the wheel's calls release
    /// the GIL); up to 8 times as many more wait in its queue, and past that a request is
    /// answered "busy" without running. Default: 8.
    pub fn with_helper_workers(mut self, n: usize) -> Self {
        self.helper_workers = n;
        self
    }

    /// Test only: the helper waits this long before each get, so that loads overrun their
    /// deadline while the helper stays healthy. Default: zero.
    pub fn with_test_get_delay(mut self, delay: Duration) -> Self {
        self.test_get_delay = delay;
        self
    }

    /// Longest pause between helper restarts (backoff doubles from 100 ms). Default: 5 s.
    pub fn with_restart_backoff_max(mut self, max: Duration) -> Self {
        self.restart_backoff_max = max;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), MooncakeError> {
        let bad = |m: &str| Err(MooncakeError::Config(m.into()));
        if self
            .master
            .rsplit_once(':')
            .is_none_or(|(_, p)| p.parse::<u16>().is_err())
        {
            return bad("master must be host:port");
        }
        if self.replicas == 0 || self.replicas > 16 {
            return bad("replicas must be 1..=16");
        }
        if self.max_batch == 0 || self.max_batch > 4096 {
            return bad("max_batch must be 1..=4096");
        }
        if self.staging_bytes < 4096 || !self.staging_bytes.is_multiple_of(64) {
            return bad("staging_bytes must be a multiple of 64, at least 4096");
        }
        if self.helper_workers == 0 || self.helper_workers > 256 {
            return bad("helper_workers must be 1..=256");
        }
        if self.min_bandwidth == 0 {
            return bad("min_bandwidth must be positive");
        }
        Ok(())
    }

    /// Deadline of one request moving `bytes`.
    pub(crate) fn deadline_for(&self, bytes: u64) -> Duration {
        self.op_timeout + Duration::from_secs_f64(bytes as f64 / self.min_bandwidth as f64)
    }
}
