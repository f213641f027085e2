//! What the admin socket shows of the daemon: the ranks connected right now.

use super::connection::Shared;
use crate::admin::{EngineInfo, EngineView, MemoryReport};

impl EngineView for Shared {
    fn engines(&self) -> Vec<EngineInfo> {
        let mut out: Vec<EngineInfo> = self
            .ranks
            .lock()
            .values()
            .map(|(id, since)| EngineInfo {
                instance: id.instance.clone(),
                namespace: id.namespace.model.clone(),
                tp_rank: id.tp_rank,
                tp_size: id.tp_size,
                pp_rank: id.pp_rank,
                pp_size: id.pp_size,
                dp_rank: id.dp_rank,
                pid: None,
                connected_ms: since.elapsed().as_millis() as u64,
            })
            .collect();
        out.sort_by(|a, b| (&a.instance, a.pp_rank, a.tp_rank).cmp(&(&b.instance, b.pp_rank, b.tp_rank)));
        out
    }

    fn kv_hints(&self) -> Option<&crate::router_hint::KvHintLog> {
        Some(&self.kv_hints)
    }

    fn host_keep(&self) -> Option<crate::admin::HostKeep> {
        self.backend.host_keep()
    }

    fn memory(&self) -> Option<MemoryReport> {
        Some(super::memory::report())
    }
}
