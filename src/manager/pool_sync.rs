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
use super::pages::Pages;
use crate::page::{NamespaceId, PageHash};
use crate::pool::index::PoolIndex;
use crate::pool::{KeyBatch, PoolBackend};
use crate::tier::TierKind;

impl Manager {
    /// Brings the directory in line with `index` after a resync: pages with pool objects
    /// in flight are left alone. With `share`, then Shares the dropped pages, from host
    /// where it still holds them. Returns (pages that stopped being pool-complete, pages
    /// the shares took).
    pub fn reconcile_pool(&self, index: &PoolIndex, share: bool) -> (usize, usize) {
        let Some(pool) = self.stores().pool() else {
            return (0, 0);
        };
        let lost = self.inner.pages.drop_lost_pool_pages(pool.as_ref(), index);
        if !share {
            return (lost.len(), 0);
        }
        let mut shared = 0;
        for chunk in lost.chunks(self.inner.cfg.max_batch.max(1)) {
            for &ns in chunk
                .iter()
                .map(|(ns, _)| ns)
                .collect::<std::collections::BTreeSet<_>>()
            {
                let pages = chunk.iter().filter(|(n, _)| *n == ns).map(|(_, h)| *h).collect();
                let share = crate::hints::Hint::Share {
                    target: crate::hints::HintTarget::Pages(pages),
                };
                shared += match self.hint(ns, share) {
                    Ok(crate::hints::HintOutcome::Accepted { pages }) => pages,
                    Ok(crate::hints::HintOutcome::Clipped { applied, .. }) => applied,
                    _ => 0,
                };
            }
        }
        (lost.len(), shared)
    }
}

impl Pages {
    /// The pool-complete pages (none in flight to the pool) whose objects `index` lacks
    /// and `pool` confirms missing: they stop being pool-complete. Returns them.
    fn drop_lost_pool_pages(&self, pool: &dyn PoolBackend, index: &PoolIndex) -> Vec<(NamespaceId, PageHash)> {
        let cands: Vec<(NamespaceId, PageHash)> = {
            let st = self.read();
            st.dir
                .pages_in(TierKind::Pool)
                .into_iter()
                .filter(|&id| {
                    st.dir.is_complete(id, TierKind::Pool)
                        && st.dir.objects().inflight_objects(id, TierKind::Pool).is_empty()
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
            let mut batch = KeyBatch::default();
            {
                let st = self.read();
                for &(ns, h) in chunk {
                    let (Some(scheme), Ok(layout)) = (st.keys.get(ns.0 as usize), st.dir.layout(ns)) else {
                        continue;
                    };
                    let keys = scheme.page_keys(layout, &h);
                    if !index.contains_all(&keys) {
                        batch.push_page(scheme, layout, &h);
                        pages.push((ns, h, keys));
                    }
                }
            }
            if pages.is_empty() {
                continue;
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
        let mut dropped = Vec::new();
        {
            let mut st = self.write();
            for (ns, h) in lost {
                if let Some(id) = st.dir.find(ns, &h)
                    && st.dir.is_complete(id, TierKind::Pool)
                    && st.dir.objects().inflight_objects(id, TierKind::Pool).is_empty()
                {
                    st.dir.set_page(id, TierKind::Pool, false);
                    dropped.push((ns, h));
                }
            }
        }
        if !dropped.is_empty() {
            tracing::warn!(
                pages = dropped.len(),
                "the store lost pages this node had in the pool; they will be written again"
            );
        }
        dropped
    }
}
