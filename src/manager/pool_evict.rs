//! Pool eviction by watermark, as the page directory's own work: the directory picks the
//! victims from its pool eviction list, marks their objects absent and in flight under its
//! write lock, the pool removes them with no lock held, and the marks are settled. Upkeep
//! (`Manager::tick`) passes in the pool, its watermarks, the slot size and the counters.

use super::pages::Pages;
use super::stats::Stats;
use crate::directory::PageId;
use crate::policy::Watermarks;
use crate::pool::{PoolBackend, PoolError};
use crate::tier::TierKind;

/// Pool victims marked per write lock.
const POOL_EVICT_BATCH: usize = 64;

impl Pages {
    /// Pool watermark: marks the victims' pool objects absent (and in flight, so no pool
    /// write races the removal), removes them from the pool with no lock held, then
    /// clears the in-flight marks. Lookups stop counting a page before its bytes go.
    pub(super) fn evict_pool(&self, pool: &dyn PoolBackend, watermarks: &Watermarks, slot_kib: usize, stats: &Stats) {
        let usage = pool.usage();
        if usage.capacity_bytes == 0 {
            return;
        }
        // Work in KiB so the watermark math stays in usize on 32-bit too.
        let reclaim = watermarks.reclaim((usage.used_bytes >> 10) as usize, (usage.capacity_bytes >> 10) as usize);
        if reclaim == 0 {
            return;
        }
        // Victims from the pool's eviction lists: a read-only walk of O(victims) under the
        // read lock, re-checked under the write lock below.
        let victims = {
            let st = self.read();
            let Some(&head) = st.dir.order().victims(TierKind::Pool, 1, |_| false).first() else {
                return;
            };
            let per_page = st.dir.layout(st.dir.info(head).ns).map_or(1, |l| l.object_count());
            let pages = reclaim.div_ceil(slot_kib * per_page.max(1));
            st.dir.order().victims(TierKind::Pool, pages, |_| false)
        };
        // A batch at a time, so the write lock is held for one batch's marks only.
        for batch in victims.chunks(POOL_EVICT_BATCH) {
            self.evict_pool_batch(pool, batch, stats);
        }
    }

    /// Reserve: under the write lock, pages still live and still evictable get their pool
    /// objects marked absent and in flight. Remove with no lock held. Settle: clear the
    /// in-flight marks.
    fn evict_pool_batch(&self, pool: &dyn PoolBackend, victims: &[PageId], stats: &Stats) {
        let mut removing = Vec::new();
        {
            let mut st = self.write();
            for &id in victims {
                let info = st.dir.info(id);
                let Ok(layout) = st.dir.layout(info.ns).cloned() else {
                    continue;
                };
                if !st.same_page(id, &info.hash, info.ns)
                    || !st.dir.is_complete(id, TierKind::Pool)
                    || st.dir.is_pinned(id, TierKind::Pool)
                    || st.dir.is_inflight(id, TierKind::Pool)
                {
                    continue;
                }
                for (obj, &oid) in layout.objects().iter().enumerate() {
                    let key = st.keys[info.ns.0 as usize].object_key(&layout, &info.hash, oid);
                    // `obj` indexes the page's own layout: neither call can fail.
                    if let Err(e) = st
                        .dir
                        .set_inflight(id, TierKind::Pool, obj, true)
                        .and_then(|()| st.dir.set_object(id, TierKind::Pool, obj, false).map(|_| ()))
                    {
                        tracing::warn!(error = %e, "pool eviction: could not reserve an object");
                        continue;
                    }
                    removing.push((id, obj, key));
                }
                stats.evicted(TierKind::Pool);
            }
        }
        // Remove, no lock held.
        let results: Vec<Result<(), PoolError>> = removing.iter().map(|(_, _, key)| pool.remove(key, true)).collect();
        // Settle. An object the pool could not remove is still there: it is marked present
        // again (before its in-flight mark goes, so the record stays live), not orphaned.
        let mut st = self.write();
        let mut kept = 0usize;
        for ((id, obj, _), r) in removing.into_iter().zip(results) {
            let restore = match r {
                Ok(()) | Err(PoolError::NotFound) => None,
                Err(e) => Some(e),
            };
            if let Some(e) = &restore {
                kept += 1;
                tracing::debug!(error = %e, "pool eviction: remove failed; the object stays");
            }
            // `obj` is an index of the page's own layout and the in-flight mark has kept the
            // record live since the reserve step, so neither call can fail; if one did, the
            // directory is wrong about this object, which is worth a warning.
            let mut r = Ok(());
            if restore.is_some() {
                r = st.dir.set_object(id, TierKind::Pool, obj, true).map(|_| ());
            }
            let r = r.and_then(|()| st.dir.set_inflight(id, TierKind::Pool, obj, false));
            if let Err(e) = r {
                tracing::warn!(error = %e, "pool eviction: could not settle an object");
            }
        }
        drop(st);
        if kept > 0 {
            tracing::warn!(
                objects = kept,
                "pool eviction: removes failed; those objects stay in the pool"
            );
        }
    }
}
