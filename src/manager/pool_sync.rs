//! After the pool index resynced: the directory stops believing the store holds what it lost.
//!
//! A master that restarted has lost every object, and one that was unreachable may have
//! dropped some. Pages this node wrote stay pool-complete in its directory until something
//! says otherwise; while they do, Share and Demote have nothing to write ("applied" with
//! nothing written) and host eviction drops a page's last good copy believing the pool
//! holds it. So after each resync, every pool-complete page whose objects the listing lacks
//! is asked about once more, in one batched existence query to the store (the listing may
//! be a moment older than a put that just completed), and the pages the store confirms
//! incomplete stop being pool-complete (`removed`): their host copies are then demoted and
//! shared again like any page never written to the pool.

use super::Manager;
use crate::page::{NamespaceId, PageHash};
use crate::pool::KeyBatch;
use crate::pool::index::PoolIndex;
use crate::tier::TierKind;

impl Manager {
    /// Brings the directory in line with `index` after a resync; returns the pages that
    /// stopped being pool-complete. Pages with pool objects in flight are left alone.
    pub fn reconcile_pool(&self, index: &PoolIndex) -> usize {
        let Some(pool) = self.pool() else { return 0 };
        let cands: Vec<(NamespaceId, PageHash)> = {
            let st = self.read();
            st.dir
                .pages_in(TierKind::Pool)
                .into_iter()
                .filter(|&id| {
                    st.dir.is_complete(id, TierKind::Pool) && st.dir.inflight_objects(id, TierKind::Pool).is_empty()
                })
                .map(|id| {
                    let i = st.dir.info(id);
                    (i.ns, i.hash)
                })
                .collect()
        };
        let mut lost = Vec::new();
        for chunk in cands.chunks(256) {
            let mut pages = Vec::new();
            for &(ns, h) in chunk {
                let (Ok(scheme), Ok(layout)) = (self.key_scheme(ns), self.layout(ns)) else {
                    continue;
                };
                let keys = scheme.page_keys(&layout, &h);
                if !index.contains_all(&keys) {
                    pages.push((ns, h, keys));
                }
            }
            if pages.is_empty() {
                continue;
            }
            let mut batch = KeyBatch::default();
            for (ns, h, _) in &pages {
                if let (Ok(scheme), Ok(layout)) = (self.key_scheme(*ns), self.layout(*ns)) {
                    batch.push_page(&scheme, &layout, h);
                }
            }
            let answers = pool.batch_exists(&batch.refs());
            let mut at = 0;
            for (ns, h, keys) in pages {
                let n = keys.len();
                let Some(ans) = answers.get(at..at + n) else { break };
                at += n;
                // Only a clear "not there" from the store drops the record; an error keeps it.
                if ans.contains(&Ok(false)) && ans.iter().all(Result::is_ok) {
                    lost.push((ns, h));
                }
            }
        }
        let mut dropped = 0;
        {
            let mut st = self.write();
            for (ns, h) in &lost {
                if let Some(id) = st.dir.find(*ns, h)
                    && st.dir.is_complete(id, TierKind::Pool)
                    && st.dir.inflight_objects(id, TierKind::Pool).is_empty()
                {
                    st.dir.set_page(id, TierKind::Pool, false);
                    dropped += 1;
                }
            }
        }
        if dropped > 0 {
            tracing::warn!(
                pages = dropped,
                "the store lost pages this node had in the pool; they will be written again"
            );
        }
        dropped
    }
}
