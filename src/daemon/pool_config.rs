//! The daemon's pool keys: which backend (`[pool] kind = "none" | "local" | "mooncake"`) and the
//! `[mooncake]` section, validated at start, and the backend built from them.
//!
//! Every field is a key like any other: in the file (`[mooncake] master = "…"`), in the
//! environment (`KVTIER_POOL_KIND=mooncake`, `KVTIER_MOONCAKE_MASTER=host:port`), and as flags
//! (`--pool-kind mooncake --mooncake-master host:port`, or `--set mooncake.master=host:port`).
//! The backend is constructed here, in the daemon, and handed to the manager as a factory
//! that runs once the host arena exists (Mooncake registers the arena for copy-free moves).

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::manager::{PoolConfig, PoolFactory, RemoteConfig};
use crate::pool::PoolBackend;
use crate::pool::keys::KeyFormat;
use crate::pool::mooncake::integrity::{self, KeyFileError};
use crate::pool::mooncake::{ExistsVia, MooncakeConfig, MooncakePool};

/// Which pool backend the daemon runs (`pool`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// No pool: pages leaving host are dropped.
    None,
    /// The node-local shared-memory pool beside the arena (`pool_bytes`).
    #[default]
    Local,
    /// A Mooncake Store shared by the nodes of a cluster (`[mooncake]`).
    Mooncake,
}

impl PoolKind {
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::None => "none",
            PoolKind::Local => "local",
            PoolKind::Mooncake => "mooncake",
        }
    }
}

/// How the daemon reaches the Mooncake Store (`mooncake.client`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MooncakeClient {
    /// The PyPI wheel's client in a supervised helper process.
    #[default]
    Helper,
    /// Upstream's C ABI (`store_c.h`) in `libmooncake_store.so`, loaded into the daemon
    /// (`mooncake.library`); needs a kvtier built with the `mooncake-c` feature.
    CAbi,
}

/// The `[mooncake]` section: used when `pool = "mooncake"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MooncakeSection {
    /// The master's RPC address, `host:port`. Required with `pool = "mooncake"`.
    pub master: String,
    /// Transfer metadata server; empty means `http://{master host}:8080/metadata`.
    /// Default: empty.
    pub metadata: String,
    /// Transfer protocol: `tcp` or `rdma`. Default: `tcp`.
    pub protocol: String,
    /// RDMA device names (empty for tcp). Default: empty.
    pub device: String,
    /// Address this node's client advertises to peers. Default: `127.0.0.1`.
    pub local_hostname: String,
    /// The store's client: `helper` (the PyPI wheel's client in a helper process, see
    /// `python`) or `c-abi` (upstream's C ABI from `libmooncake_store.so`, built with
    /// `cmake -DWITH_STORE_C_SHARED=ON`, loaded into the daemon: no helper process; needs a
    /// kvtier built with `--features mooncake-c`). Default: `helper`.
    pub client: MooncakeClient,
    /// With `client = "c-abi"`: the absolute path of `libmooncake_store.so`. Empty: the
    /// `MOONCAKE_STORE_LIBRARY` environment variable. Default: empty.
    pub library: PathBuf,
    /// Memory this node contributes to the store (Mooncake's global segment). Default: 512 MiB.
    pub global_segment_bytes: u64,
    /// The client's local transfer buffer. Default: 16 MiB.
    pub local_buffer_bytes: u64,
    /// Copies of each object the store keeps. Default: 1.
    pub replicas: u32,
    /// Key prefix tag (`{tag}_…`); letters, digits, `.` and `-` only. With `key_format =
    /// "sglang"`, empty gives SGLang HiCache's keys exactly (for a model-only namespace).
    /// Default: `kvtier`.
    pub key_tag: String,
    /// How object keys are rendered: `kvtier` (the namespace escaped and a fingerprint of
    /// the whole layout, TP size, PP split, dtype and page size included, in every key:
    /// engines share an object only when its bytes are the same for both) or `sglang`
    /// (SGLang HiCache's exact keys, which carry the TP rank but not the TP size, dtype or
    /// page size: safe only when every engine on the store serves the model with one TP
    /// size, PP split, dtype, page size and byte order). Default: `kvtier`.
    pub key_format: KeyFormat,
    /// Python interpreter with the Mooncake wheel: an absolute path, or a bare name looked up
    /// in the absolute entries of `PATH` at start. A relative path is refused (it is never
    /// resolved against the daemon's working directory); the file and the directories above
    /// it must be owned by the daemon's user or root and not writable by others. Empty:
    /// `python3` from `PATH`. Default: empty.
    pub python: PathBuf,
    /// Most pages one lookup or load asks the store about. Default: 256.
    pub lookup_budget_pages: usize,
    /// How long a "page complete in the store" answer is cached, in ms. Default: 2000.
    pub exists_cache_ms: u64,
    /// How long a "page not in the store" answer is cached, in ms. Default: 500.
    pub missing_cache_ms: u64,
    /// Who answers existence queries: `master` (its RPC, from the daemon's thread) or
    /// `helper` (the wheel's client). Default: `master`.
    pub exists_via: ExistsVia,
    /// Object event streams that feed the pool index: every peer's `events.pool_endpoint`
    /// (this node's own is added), and/or a master's `--kv_events_bind_endpoint`. Non-empty
    /// turns the index on: lookups are answered from it, with no master query, while it is
    /// in sync (docs/pool.md, "The pool index"). Default: empty (off).
    pub index_sources: Vec<String>,
    /// The master's admin HTTP address (its `--metrics_port`), `host:port`: the index lists
    /// the store there (`/get_all_keys`) to resync, and watches it for restarts. Empty:
    /// `{master host}:9003`, the master's default. Default: empty.
    pub master_admin: String,
    /// Most object keys the pool index holds; past it the index stops answering and
    /// lookups ask the master. Default: 4,194,304.
    pub index_max_keys: usize,
    /// Seal every object with a keyed BLAKE3 MAC over its key and bytes (a 32-byte trailer)
    /// and refuse, as not found and counted, every object whose MAC fails: a foreign put
    /// under a page's key is never loaded. Must be `false` with `key_format = "sglang"`
    /// (SGLang reads raw bytes). Default: `true`.
    pub integrity: bool,
    /// The cluster key: a file of at least 32 bytes, owned by the daemon's user, mode 0600
    /// (`head -c 32 /dev/urandom > key; chmod 600 key`), the same on every node of the
    /// store. Empty: a key generated once in `/dev/shm/kvtier-mooncake-<uid>/pool.key`,
    /// shared by this uid's daemons on this node only (single node). Default: empty.
    pub integrity_key_file: PathBuf,
    /// Base deadline of one request to the helper, in ms; a transfer gets its bytes at
    /// 200 MiB/s on top. Past it the request is answered "busy" if it has not started, or
    /// waited for if it has (never a reason to kill the helper). Default: 3000.
    pub op_timeout_ms: u64,
    /// Requests the helper runs at once (1 to 256); up to 8 times as many wait in its
    /// queue, and past that a request is answered "busy". Default: 8.
    pub helper_workers: usize,
    /// Test only: the helper waits this long before each get, so that loads overrun their
    /// deadline on a healthy helper. Default: 0.
    pub test_get_delay_ms: u64,
    /// The key material read at start ([`MooncakeSection::load_integrity_key`]); not a key.
    #[serde(skip)]
    pub integrity_key: Option<integrity::KeyMaterial>,
}

impl Default for MooncakeSection {
    fn default() -> Self {
        let remote = RemoteConfig::default();
        Self {
            master: String::new(),
            metadata: String::new(),
            protocol: "tcp".into(),
            device: String::new(),
            local_hostname: "127.0.0.1".into(),
            client: MooncakeClient::Helper,
            library: PathBuf::new(),
            global_segment_bytes: 512 << 20,
            local_buffer_bytes: 16 << 20,
            replicas: 1,
            key_tag: "kvtier".into(),
            key_format: KeyFormat::Kvtier,
            python: PathBuf::new(),
            lookup_budget_pages: remote.budget_pages,
            exists_cache_ms: remote.positive_ttl_ms,
            missing_cache_ms: remote.negative_ttl_ms,
            exists_via: ExistsVia::Master,
            index_sources: Vec::new(),
            master_admin: String::new(),
            index_max_keys: 4 << 20,
            integrity: true,
            integrity_key_file: PathBuf::new(),
            op_timeout_ms: 3000,
            helper_workers: 8,
            test_get_delay_ms: 0,
            integrity_key: None,
        }
    }
}

/// Why a pool setting was refused (at start, before anything is created).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolConfigError {
    #[error("pool.kind = \"mooncake\" needs mooncake.master (--mooncake-master host:port)")]
    NoMaster,
    #[error("mooncake.master {0:?} is not host:port with a port in 1..=65535")]
    BadMaster(String),
    #[error("mooncake.key_tag {0:?} may hold only letters, digits, '.' and '-' (no '_', '/', '+', '%')")]
    BadTag(String),
    #[error("mooncake.protocol {0:?} is not one of: tcp, rdma")]
    BadProtocol(String),
    #[error("mooncake.{0} must be positive")]
    Zero(&'static str),
    #[error("mooncake.replicas must be 1..=16, not {0}")]
    Replicas(u32),
    #[error(
        "mooncake.python {0:?} is a relative path; give an absolute path or a bare command name looked up in \
         PATH (a relative path is never resolved against the daemon's working directory)"
    )]
    RelativePython(PathBuf),
    #[error(
        "mooncake.key_format = \"sglang\" stores raw bytes SGLang reads as they are, so it cannot carry \
         kvtier's integrity MAC; set mooncake.integrity = false explicitly (objects are then unauthenticated: \
         anyone who reaches the master can replace them)"
    )]
    IntegrityWithSglang,
    #[error("mooncake.integrity_key_file {0:?} must be an absolute path")]
    RelativeKeyFile(PathBuf),
    #[error(
        "mooncake.client = \"c-abi\" needs a kvtier built with `--features mooncake-c`; this one was not \
         (use mooncake.client = \"helper\", or rebuild)"
    )]
    CAbiNotBuilt,
    #[error("mooncake.library {0:?} must be an absolute path")]
    RelativeLibrary(PathBuf),
}

/// A key tag is a single key field: no separator may appear in it.
pub fn check_key_tag(tag: &str) -> Result<(), PoolConfigError> {
    if tag.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-') {
        Ok(())
    } else {
        Err(PoolConfigError::BadTag(tag.to_owned()))
    }
}

/// `host:port`, with a non-empty host and a port in 1..=65535.
pub fn check_master(addr: &str) -> Result<(), PoolConfigError> {
    let bad = || PoolConfigError::BadMaster(addr.chars().take(120).collect());
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains(char::is_whitespace) || host.contains('/') {
        return Err(bad());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(bad()),
    }
}

impl MooncakeSection {
    pub fn validate(&self) -> Result<(), PoolConfigError> {
        if self.master.is_empty() {
            return Err(PoolConfigError::NoMaster);
        }
        check_master(&self.master)?;
        check_key_tag(&self.key_tag)?;
        if !matches!(self.protocol.as_str(), "tcp" | "rdma") {
            return Err(PoolConfigError::BadProtocol(self.protocol.clone()));
        }
        for (name, v) in [
            ("global_segment_bytes", self.global_segment_bytes),
            ("local_buffer_bytes", self.local_buffer_bytes),
            ("lookup_budget_pages", self.lookup_budget_pages as u64),
            ("index_max_keys", self.index_max_keys as u64),
            ("op_timeout_ms", self.op_timeout_ms),
            ("helper_workers", self.helper_workers as u64),
        ] {
            if v == 0 {
                return Err(PoolConfigError::Zero(name));
            }
        }
        if !(1..=16).contains(&self.replicas) {
            return Err(PoolConfigError::Replicas(self.replicas));
        }
        if !self.master_admin.is_empty() {
            check_master(&self.master_admin)?;
        }
        let p = &self.python;
        if p.is_relative() && p.components().count() > 1 {
            return Err(PoolConfigError::RelativePython(p.clone()));
        }
        if self.integrity && self.key_format == KeyFormat::Sglang {
            return Err(PoolConfigError::IntegrityWithSglang);
        }
        let k = &self.integrity_key_file;
        if !k.as_os_str().is_empty() && !k.is_absolute() {
            return Err(PoolConfigError::RelativeKeyFile(k.clone()));
        }
        if self.client == MooncakeClient::CAbi && !cfg!(feature = "mooncake-c") {
            return Err(PoolConfigError::CAbiNotBuilt);
        }
        let l = &self.library;
        if !l.as_os_str().is_empty() && !l.is_absolute() {
            return Err(PoolConfigError::RelativeLibrary(l.clone()));
        }
        Ok(())
    }

    /// Reads the cluster key when integrity is on: from `integrity_key_file` (checked: ours,
    /// 0600, at least 32 bytes), or the single-node default, generated when absent. Returns
    /// the file it read.
    pub fn load_integrity_key(&mut self) -> Result<Option<PathBuf>, KeyFileError> {
        if !self.integrity {
            self.integrity_key = None;
            return Ok(None);
        }
        let path = if self.integrity_key_file.as_os_str().is_empty() {
            integrity::default_key_file()?
        } else {
            self.integrity_key_file.clone()
        };
        self.integrity_key = Some(integrity::KeyMaterial(integrity::read_key_file(&path)?));
        Ok(Some(path))
    }

    /// The backend's own configuration.
    pub fn client_config(&self) -> MooncakeConfig {
        let metadata = if self.metadata.is_empty() {
            let host = self.master.rsplit_once(':').map_or(self.master.as_str(), |(h, _)| h);
            format!("http://{host}:8080/metadata")
        } else {
            self.metadata.clone()
        };
        let mut c = MooncakeConfig::new(self.master.clone(), metadata)
            .with_local_hostname(self.local_hostname.clone())
            .with_protocol(self.protocol.clone(), self.device.clone())
            .with_segment_bytes(self.global_segment_bytes)
            .with_local_buffer_bytes(self.local_buffer_bytes)
            .with_replicas(self.replicas)
            .with_exists_via(self.exists_via)
            .with_op_timeout(std::time::Duration::from_millis(self.op_timeout_ms), 200 << 20)
            .with_helper_workers(self.helper_workers.min(256))
            .with_test_get_delay(std::time::Duration::from_millis(self.test_get_delay_ms));
        if let Some(k) = &self.integrity_key {
            c = c.with_integrity_key(&k.0);
        }
        if !self.python.as_os_str().is_empty() {
            c = c.with_python(self.python.clone());
        }
        c
    }

    /// The master's admin HTTP address (`master_admin`, or the master's host and port 9003).
    pub fn admin_addr(&self) -> String {
        if self.master_admin.is_empty() {
            let host = self.master.rsplit_once(':').map_or(self.master.as_str(), |(h, _)| h);
            format!("{host}:9003")
        } else {
            self.master_admin.clone()
        }
    }

    /// Discovery tunables.
    pub fn remote(&self) -> RemoteConfig {
        RemoteConfig {
            budget_pages: self.lookup_budget_pages,
            positive_ttl_ms: self.exists_cache_ms,
            negative_ttl_ms: self.missing_cache_ms,
            ..RemoteConfig::default()
        }
    }

    /// Whether the master accepts a TCP connection within `timeout` (the start-up banner's
    /// honest answer; the helper keeps retrying on its own either way).
    pub fn master_reachable(&self, timeout: std::time::Duration) -> bool {
        use std::net::ToSocketAddrs;
        let Ok(addrs) = self.master.to_socket_addrs() else {
            return false;
        };
        addrs
            .into_iter()
            .any(|a| std::net::TcpStream::connect_timeout(&a, timeout).is_ok())
    }
}

/// The manager's pool: built by the daemon, started when the arena exists.
pub fn build(kind: PoolKind, local: PoolConfig, mooncake: &MooncakeSection) -> PoolConfig {
    match kind {
        PoolKind::None => PoolConfig::None,
        PoolKind::Local => local,
        PoolKind::Mooncake if mooncake.client == MooncakeClient::CAbi => c_abi(mooncake),
        PoolKind::Mooncake => {
            let cfg = mooncake.client_config();
            PoolConfig::Build(PoolFactory {
                label: "mooncake",
                build: Arc::new(move |arena| {
                    // Returns at once: the pool is degraded until the helper has reached
                    // the master, and recovers on its own when the master comes back.
                    let pool = MooncakePool::start(cfg.clone(), Some(arena)).map_err(|e| e.to_string())?;
                    Ok(Arc::new(pool) as Arc<dyn PoolBackend>)
                }),
            })
        }
    }
}

/// The `c-abi` client: upstream's C library in the daemon's process. A library that is
/// missing, or that lacks a function of upstream's header, fails the daemon's start.
#[cfg(feature = "mooncake-c")]
fn c_abi(mooncake: &MooncakeSection) -> PoolConfig {
    let cfg = mooncake.client_config();
    let library = mooncake.library.clone();
    PoolConfig::Build(PoolFactory {
        label: "mooncake-c",
        build: Arc::new(move |arena| {
            let lib = (!library.as_os_str().is_empty()).then_some(library.as_path());
            let pool = crate::pool::mooncake::cabi::MooncakeCPool::open(cfg.clone(), lib, Some(arena))
                .map_err(|e| format!("pool mooncake (client c-abi): {e}"))?;
            Ok(Arc::new(pool) as Arc<dyn PoolBackend>)
        }),
    })
}

/// Without the feature, validation refuses `c-abi` first; this says so again if reached.
#[cfg(not(feature = "mooncake-c"))]
fn c_abi(_: &MooncakeSection) -> PoolConfig {
    PoolConfig::Build(PoolFactory {
        label: "mooncake-c",
        build: Arc::new(|_| Err(PoolConfigError::CAbiNotBuilt.to_string())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_c_abi_client_is_refused_without_the_feature_and_its_library_must_be_absolute() {
        let s = MooncakeSection {
            master: "127.0.0.1:50051".into(),
            client: MooncakeClient::CAbi,
            ..MooncakeSection::default()
        };
        if cfg!(feature = "mooncake-c") {
            assert_eq!(s.validate(), Ok(()));
        } else {
            assert_eq!(s.validate(), Err(PoolConfigError::CAbiNotBuilt));
        }
        let rel = MooncakeSection {
            client: MooncakeClient::Helper,
            library: "lib/libmooncake_store.so".into(),
            ..s.clone()
        };
        assert_eq!(
            rel.validate(),
            Err(PoolConfigError::RelativeLibrary(rel.library.clone()))
        );
        let parsed: MooncakeSection =
            toml::from_str("master = \"h:1\"\nclient = \"c-abi\"\nlibrary = \"/x/l.so\"\n").unwrap();
        assert_eq!(
            (parsed.client, parsed.library),
            (MooncakeClient::CAbi, PathBuf::from("/x/l.so"))
        );
    }

    #[test]
    fn malformed_masters_and_tags_with_separators_are_refused() {
        for ok in ["127.0.0.1:50051", "master.local:1", "[::1]:50051"] {
            assert_eq!(check_master(ok), Ok(()), "{ok}");
        }
        for bad in [
            "127.0.0.1",
            "127.0.0.1:",
            ":50051",
            "h:0",
            "h:70000",
            "h:port",
            "a b:1",
            "http://h:1",
        ] {
            assert_eq!(check_master(bad), Err(PoolConfigError::BadMaster(bad.into())), "{bad}");
        }
        for ok in ["", "kvtier", "node-1.a"] {
            assert_eq!(check_key_tag(ok), Ok(()));
        }
        for bad in ["a_b", "a/b", "a+b", "a%b", "a b"] {
            assert_eq!(check_key_tag(bad), Err(PoolConfigError::BadTag(bad.into())));
        }
        let s = MooncakeSection::default();
        assert_eq!(s.validate(), Err(PoolConfigError::NoMaster));
        let s = MooncakeSection {
            master: "127.0.0.1:50051".into(),
            ..MooncakeSection::default()
        };
        assert_eq!(s.validate(), Ok(()));
        assert_eq!(s.client_config().master(), "127.0.0.1:50051");
        let r = MooncakeSection {
            replicas: 0,
            ..s.clone()
        };
        assert_eq!(r.validate(), Err(PoolConfigError::Replicas(0)));
        let p = MooncakeSection {
            protocol: "udp".into(),
            ..s.clone()
        };
        assert_eq!(p.validate(), Err(PoolConfigError::BadProtocol("udp".into())));
        for (python, ok) in [
            (".venv/bin/python3", false),
            ("./python3", false),
            ("python3", true),
            ("/usr/bin/python3", true),
        ] {
            let p = MooncakeSection {
                python: python.into(),
                ..s.clone()
            };
            assert_eq!(p.validate().is_ok(), ok, "{python}");
        }
    }
}
