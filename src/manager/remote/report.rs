//! What `kvtier status` and `/metrics` say about the pool: [`PoolReport`].

use serde::Serialize;

use super::{PoolDiscovery, RemoteSnapshot};
use crate::pool::PoolHealth;
use crate::pool::index::IndexSnapshot;

/// Which pool this manager uses and how it is doing, for `kvtier status` and `/metrics`.
#[derive(Clone, Debug, Serialize)]
pub struct PoolReport {
    /// `none`, `local`, `mooncake`, or a caller-built backend's name.
    pub backend: &'static str,
    /// Whether the backend is built yet (it starts with the first namespace).
    pub started: bool,
    /// Its health once started.
    pub health: Option<PoolHealth>,
    /// Whether other nodes write to it (pages found there are hits here).
    pub shared: bool,
    /// Discovery counters on a shared pool.
    pub remote: Option<RemoteSnapshot>,
    /// The pool index's mode and counters, when the daemon runs one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<IndexSnapshot>,
    /// Who answers existence queries, where the backend has a choice (`master`, `helper`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exists_via: Option<&'static str>,
    /// The master's version, where the backend asks it (Mooncake: existence queries go to
    /// the master only when this client speaks its version).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub master_version: Option<String>,
    /// Whether pool objects carry a keyed MAC, and how many failed it (never loaded).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub integrity: Option<crate::pool::IntegrityReport>,
    /// The page size of the memory holding the pool's objects, where kvtier maps it (the
    /// local pool): 4096, or the huge page size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mapping_page_bytes: Option<u64>,
}

impl PoolDiscovery<'_> {
    /// The pool's name, health and discovery counters.
    pub fn report(&self) -> PoolReport {
        use crate::manager::PoolConfig;
        let pool = self.stores.pool();
        let backend = match (&self.cfg.pool, &pool) {
            (_, Some(p)) => p.name(),
            (PoolConfig::None, None) => "none",
            (PoolConfig::LocalDefault | PoolConfig::Local { .. }, None) => "local",
            (PoolConfig::Backend(b), None) => b.name(),
            (PoolConfig::Build(f), None) => f.label,
            (PoolConfig::Mooncake(_), None) => "mooncake",
        };
        PoolReport {
            backend,
            started: pool.is_some(),
            health: pool.as_ref().map(|p| p.health()),
            shared: self.remote.is_some(),
            remote: self.counters(),
            index: self.index().map(|i| i.snapshot()),
            exists_via: pool.as_ref().and_then(|p| p.exists_source()),
            master_version: pool.as_ref().and_then(|p| p.master_version()),
            integrity: pool.as_ref().and_then(|p| p.integrity()),
            mapping_page_bytes: pool.as_ref().and_then(|p| p.mapping_page_bytes()),
        }
    }
}
