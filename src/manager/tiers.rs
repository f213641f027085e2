//! Moves between host and pool, and eviction by watermark (the periodic `tick` that
//! drives it lives in `upkeep`).
//!
//! Each move runs in three phases so bytes are never copied under a lock:
//! reserve (directory write lock: pick pages, allocate destination slots, mark objects in
//! flight), copy (no lock), settle (write lock: mark what arrived present, free what did
//! not). In-
//! flight objects keep their pages out of eviction, so a page is never evicted mid-move.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Manager;
use super::state::DirState;
use crate::directory::PageId;
use crate::page::{NamespaceId, PageHash};
use crate::policy::select_victims;
use crate::pool::{PoolError, PoolHealth};
use crate::tier::TierKind;
use crate::tier::host::SlotId;

/// Pages handled per pool batch.
const POOL_BATCH: usize = 64;
/// Longest a prefetch waits for the batches it handed to the transfer workers.
const FANOUT_WAIT: Duration = Duration::from_secs(30);

/// Batches handed out by a fanned-out staging: (finished, pages staged).
#[derive(Default)]
struct Fanout {
    state: parking_lot::Mutex<(usize, usize)>,
    cond: parking_lot::Condvar,
}

/// Counts its batch as finished when dropped: after it ran, or unrun (a shut-down queue),
/// so the waiter never waits for a batch that will not come.
struct FanoutGuard {
    done: Arc<Fanout>,
    staged: usize,
}

impl Drop for FanoutGuard {
    fn drop(&mut self) {
        let mut g = self.done.state.lock();
        g.0 += 1;
        g.1 += self.staged;
        self.done.cond.notify_all();
    }
}

/// One object moving between host and pool.
struct ObjMove {
    page: PageId,
    obj: usize,
    slot: SlotId,
    len: usize,
    hash: PageHash,
    /// The pool key, rendered after the reserve phase has let go of the directory lock.
    key: String,
}

/// Renders the pool keys of `moves` outside the directory lock: each key is a hex
/// rendering of the hash and a `format!`, two allocations per object that need nothing the
/// lock guards (the layout is cloned, the key scheme too), and under the write lock they
/// held up the other transfer worker's reserve and settle and lookups.
fn render_keys(moves: &mut [ObjMove], keys: &crate::page::KeyScheme, layout: &crate::layout::Layout) {
    for m in moves {
        m.key = keys.object_key(layout, &m.hash, layout.objects()[m.obj]);
    }
}

impl Manager {
    /// Frees at least `slots` host slots if it can, by watermark order, writing pages
    /// back to the pool when it has room. Returns slots freed.
    pub(crate) fn make_host_room(&self, slots: usize) -> usize {
        let Some(arena) = self.arena() else { return 0 };
        let mut freed = 0;
        // Bounded rounds: each round evicts a batch; stop when nothing is evictable.
        for _ in 0..64 {
            if freed >= slots {
                break;
            }
            let victims = self.host_victims(slots - freed);
            if victims.is_empty() {
                break;
            }
            let before = arena.free_slots();
            for (ns, pages) in group_by_ns(&victims) {
                self.copy_to_pool(ns, &pages, true);
            }
            let after = arena.free_slots();
            if after <= before {
                break;
            }
            freed += (after - before) as usize;
        }
        freed
    }

    /// Up to a batch of host pages to evict for `slots` slots, in policy order, with their
    /// namespaces. The directory is walked in chunks; leases are checked after the walk
    /// and again when the copy settles, so a page leased meanwhile is never dropped.
    fn host_victims(&self, slots: usize) -> Vec<(PageId, NamespaceId)> {
        let idle = self.sessions_table().idle_snapshot();
        let mut cands = self.candidates(TierKind::Host, |_, _, _| true);
        {
            let gt = self.grants();
            cands.retain(|(id, _)| !gt.leased(*id));
        }
        let per_page = match cands.first() {
            Some((_, i)) => self.layout(i.ns).map_or(1, |l| l.object_count()).max(1),
            None => return Vec::new(),
        };
        let want = slots.div_ceil(per_page).clamp(1, POOL_BATCH);
        let ns: std::collections::HashMap<PageId, NamespaceId> = cands.iter().map(|(id, i)| (*id, i.ns)).collect();
        select_victims(cands, want, |s| idle.contains(&s))
            .into_iter()
            .filter_map(|id| ns.get(&id).map(|&n| (id, n)))
            .collect()
    }

    /// Copies host-complete pages to the pool in the background (write-through, share).
    pub(crate) fn spawn_copy_to_pool(&self, ns: NamespaceId, pages: Vec<PageId>) -> bool {
        if self.pool().is_none() {
            return false;
        }
        let m = self.clone();
        self.inner
            .xfer
            .try_submit(Box::new(move || {
                m.copy_to_pool(ns, &pages, false);
            }))
            .is_ok()
    }

    /// Writes the objects of host-complete pages that the pool lacks, then (when `evict`)
    /// drops the host copies. A page whose pool write failed is still dropped when
    /// evicting: the pool had no room, and the event says so. Returns pages now complete
    /// in the pool.
    pub(crate) fn copy_to_pool(&self, ns: NamespaceId, pages: &[PageId], evict: bool) -> usize {
        let Some(arena) = self.arena() else { return 0 };
        let pool = self.pool().filter(|p| p.health() == PoolHealth::Ok);
        // Reserve.
        let mut moves = Vec::new();
        let mut settled = Vec::new();
        let (layout, keys) = {
            let mut st = self.write();
            let Ok(layout) = st.dir.layout(ns).cloned() else {
                return 0;
            };
            let mut gt = self.grants();
            for &page in pages {
                if !st.dir.is_complete(page, TierKind::Host) || st.dir.info(page).ns != ns {
                    continue;
                }
                if pool.is_some() {
                    let hash = st.dir.info(page).hash;
                    for obj in st.dir.missing_objects(page, TierKind::Pool) {
                        if st.dir.inflight_objects(page, TierKind::Pool).contains(&obj) {
                            continue;
                        }
                        let Some(slot) = st.host_slot(page, obj) else { continue };
                        let _ = st.dir.set_inflight(page, TierKind::Pool, obj, true);
                        moves.push(ObjMove {
                            page,
                            obj,
                            slot,
                            len: layout.object_bytes(obj) as usize,
                            hash,
                            key: String::new(),
                        });
                    }
                }
                gt.lease(page);
                settled.push(page);
            }
            let keys = st.keys[ns.0 as usize].clone();
            (layout, keys)
        };
        render_keys(&mut moves, &keys, &layout);
        // Copy, straight from the arena slots.
        let mut results: Vec<Result<(), PoolError>> = Vec::new();
        if let Some(pool) = pool.as_ref().filter(|_| !moves.is_empty()) {
            let mut items = Vec::with_capacity(moves.len());
            let mut at = Vec::with_capacity(moves.len());
            results = vec![Err(PoolError::Unavailable("arena slot".into())); moves.len()];
            for (i, m) in moves.iter().enumerate() {
                // SAFETY: the page is leased: its host slots are neither freed nor
                // rewritten until we unlease it below.
                if let Ok(s) = unsafe { arena.slot(m.slot, m.len) } {
                    items.push((m.key.as_str(), s));
                    at.push(i);
                }
            }
            let t = std::time::Instant::now();
            for (r, i) in pool.batch_put_from(&items).into_iter().zip(at) {
                results[i] = r;
            }
            self.inner.stats.copied(TierKind::Host, TierKind::Pool, t.elapsed());
        }
        // Settle.
        let mut st = self.write();
        let mut gt = self.grants();
        let mut bytes = 0u64;
        for (m, r) in moves.iter().zip(&results) {
            let _ = st.dir.set_inflight(m.page, TierKind::Pool, m.obj, false);
            if r.is_ok() {
                let _ = st.dir.set_object(m.page, TierKind::Pool, m.obj, true);
                bytes += m.len as u64;
            }
        }
        let mut complete = 0;
        for &page in &settled {
            gt.unlease(page);
            complete += usize::from(st.dir.is_complete(page, TierKind::Pool));
            if evict && !gt.leased(page) && !st.dir.is_pinned(page, TierKind::Host) {
                self.drop_host_page(&mut st, page);
                self.inner.stats.evicted(TierKind::Host);
            }
        }
        drop(gt);
        drop(st);
        self.inner.stats.moved(TierKind::Host, TierKind::Pool, bytes);
        if bytes > 0 {
            self.usage_grew(TierKind::Pool);
        }
        complete
    }

    /// Frees a page's host slots and marks it gone from host.
    pub(crate) fn drop_host_page(&self, st: &mut DirState, page: PageId) {
        let Some(arena) = self.arena() else { return };
        if let Some(slots) = st.host.remove(&page.0) {
            arena.free_all(
                slots
                    .iter()
                    .filter(|&&s| s != super::state::NO_SLOT)
                    .map(|&s| SlotId(s)),
            );
        }
        st.dir.set_page(page, TierKind::Host, false);
    }

    /// Brings the leading pool-complete pages of `hashes` that are not on host into host,
    /// until `deadline`. Returns pages staged.
    pub(crate) fn stage_prefix_from_pool(
        &self,
        ns: NamespaceId,
        hashes: &[PageHash],
        deadline: Option<Instant>,
    ) -> usize {
        self.stage_from_pool(ns, hashes, deadline, true)
    }

    /// Brings every pool-complete page of `hashes` that is not on host into host, skipping
    /// the others (a prefetch names pages, not a chain). Returns pages staged.
    ///
    /// Batches past the first go to the transfer workers, so a large prefetch copies on
    /// several threads; this thread stages the first batch (and any batch the full queue
    /// hands back), then waits up to [`FANOUT_WAIT`] for the rest.
    pub(crate) fn stage_pages_from_pool(&self, ns: NamespaceId, hashes: &[PageHash]) -> usize {
        if hashes.len() <= POOL_BATCH || crate::transfer::on_worker() {
            return self.stage_from_pool(ns, hashes, None, false);
        }
        let done = Arc::new(Fanout::default());
        let mut rest = 0;
        for chunk in hashes[POOL_BATCH..].chunks(POOL_BATCH) {
            rest += 1;
            let guard = FanoutGuard {
                done: done.clone(),
                staged: 0,
            };
            let (m, chunk) = (self.clone(), chunk.to_vec());
            let job: crate::transfer::Job = Box::new(move || {
                // Moves the whole guard in (a closure would capture only the field), so
                // it counts the batch finished when this job ends, not when it is queued.
                let mut guard = guard;
                guard.staged = m.stage_from_pool(ns, &chunk, None, false);
            });
            if let Err(job) = self.inner.xfer.try_submit(job) {
                job();
            }
        }
        let mut staged = self.stage_from_pool(ns, &hashes[..POOL_BATCH], None, false);
        let deadline = Instant::now() + FANOUT_WAIT;
        let mut g = done.state.lock();
        while g.0 < rest && !done.cond.wait_until(&mut g, deadline).timed_out() {}
        staged += g.1;
        staged
    }

    /// Stages pages from the pool in batches of [`POOL_BATCH`]: one index pass, one pool
    /// batch and one settle per batch. With `prefix`, the first page that is unknown or not
    /// in the pool ends it; otherwise such pages are skipped. A full arena always ends it.
    fn stage_from_pool(&self, ns: NamespaceId, hashes: &[PageHash], deadline: Option<Instant>, prefix: bool) -> usize {
        let Some(pool) = self.pool().filter(|p| p.health() == PoolHealth::Ok) else {
            return 0;
        };
        let Some(arena) = self.arena() else { return 0 };
        let mut staged = 0;
        for chunk in hashes.chunks(POOL_BATCH) {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            // Which pages need staging, and how many slots.
            let need: usize = {
                let st = self.read();
                let Ok(layout) = st.dir.layout(ns) else { return staged };
                chunk
                    .iter()
                    .filter_map(|h| st.dir.find(ns, h))
                    .filter(|&id| st.dir.is_complete(id, TierKind::Pool) && !st.dir.is_complete(id, TierKind::Host))
                    .map(|id| st.dir.missing_objects(id, TierKind::Host).len())
                    .sum::<usize>()
                    .min(layout.object_count() * POOL_BATCH)
            };
            if need > arena.free_slots() as usize {
                self.make_host_room(need - arena.free_slots() as usize);
            }
            let mut moves = Vec::new();
            let mut stop = false;
            let (layout, keys) =
                {
                    let mut st = self.write();
                    let Ok(layout) = st.dir.layout(ns).cloned() else {
                        return staged;
                    };
                    for h in chunk {
                        let Some(id) = st.dir.find(ns, h).filter(|&id| {
                            st.dir.is_complete(id, TierKind::Host) || st.dir.is_complete(id, TierKind::Pool)
                        }) else {
                            if prefix {
                                stop = true;
                                break;
                            }
                            continue;
                        };
                        if st.dir.is_complete(id, TierKind::Host) {
                            continue;
                        }
                        let missing: Vec<usize> = st
                            .dir
                            .missing_objects(id, TierKind::Host)
                            .into_iter()
                            .filter(|o| !st.dir.inflight_objects(id, TierKind::Host).contains(o))
                            .collect();
                        let Some(slots) = arena.alloc_n(missing.len()) else {
                            stop = true;
                            break;
                        };
                        for (obj, slot) in missing.into_iter().zip(slots) {
                            let _ = st.dir.set_inflight(id, TierKind::Host, obj, true);
                            moves.push(ObjMove {
                                page: id,
                                obj,
                                slot,
                                len: layout.object_bytes(obj) as usize,
                                hash: *h,
                                key: String::new(),
                            });
                        }
                    }
                    let keys = st.keys[ns.0 as usize].clone();
                    (layout, keys)
                };
            render_keys(&mut moves, &keys, &layout);
            let mut results: Vec<Result<usize, PoolError>> =
                vec![Err(PoolError::Unavailable("arena slot".into())); moves.len()];
            {
                let mut items = Vec::with_capacity(moves.len());
                let mut at = Vec::with_capacity(moves.len());
                for (i, m) in moves.iter().enumerate() {
                    // SAFETY: freshly allocated slots, in flight, owned by this move.
                    if let Ok(s) = unsafe { arena.slot_mut(m.slot, m.len) } {
                        items.push((m.key.as_str(), s));
                        at.push(i);
                    }
                }
                let t = std::time::Instant::now();
                for (r, i) in pool.batch_get_into(&mut items).into_iter().zip(at) {
                    results[i] = r;
                }
                self.inner.stats.copied(TierKind::Pool, TierKind::Host, t.elapsed());
            }
            let mut st = self.write();
            let count = st.dir.layout(ns).map_or(0, |l| l.object_count());
            let mut bytes = 0u64;
            let mut vanished: Vec<PageHash> = Vec::new();
            for (m, r) in moves.iter().zip(&results) {
                let _ = st.dir.set_inflight(m.page, TierKind::Host, m.obj, false);
                match r {
                    Ok(n) if *n == m.len => {
                        st.set_host_slot(m.page, m.obj, count, Some(m.slot));
                        let _ = st.dir.set_object(m.page, TierKind::Host, m.obj, true);
                        bytes += m.len as u64;
                    }
                    other => {
                        arena.free(m.slot);
                        // The pool lost the object (or it is the wrong size): the page is not
                        // complete there any more, and no part of it is loaded.
                        if matches!(other, Err(PoolError::NotFound) | Ok(_)) {
                            let _ = st.dir.set_object(m.page, TierKind::Pool, m.obj, false);
                            if vanished.last() != Some(&m.hash) {
                                vanished.push(m.hash);
                            }
                        }
                    }
                }
            }
            let mut pages: Vec<PageId> = moves.iter().map(|m| m.page).collect();
            pages.dedup();
            staged += pages.iter().filter(|&&p| st.dir.is_complete(p, TierKind::Host)).count();
            drop(st);
            for h in &vanished {
                self.pool_object_vanished(ns, h);
            }
            self.inner.stats.moved(TierKind::Pool, TierKind::Host, bytes);
            if bytes > 0 {
                self.usage_grew(TierKind::Host);
            }
            if stop {
                break;
            }
        }
        staged
    }

    /// Stages the prefix in the background (a best-effort load, a prefetch).
    pub(crate) fn spawn_stage_prefix(&self, ns: NamespaceId, hashes: &[PageHash]) -> bool {
        if self.pool().is_none() {
            return true;
        }
        let needed = {
            let st = self.read();
            hashes.iter().any(|h| {
                st.dir
                    .find(ns, h)
                    .is_some_and(|id| st.dir.is_complete(id, TierKind::Pool) && !st.dir.is_complete(id, TierKind::Host))
            })
        };
        if !needed {
            return true;
        }
        let m = self.clone();
        let hashes = hashes.to_vec();
        self.inner
            .xfer
            .try_submit(Box::new(move || {
                m.stage_prefix_from_pool(ns, &hashes, None);
            }))
            .is_ok()
    }
}

fn group_by_ns(pages: &[(PageId, NamespaceId)]) -> Vec<(NamespaceId, Vec<PageId>)> {
    let mut out: Vec<(NamespaceId, Vec<PageId>)> = Vec::new();
    for &(p, ns) in pages {
        match out.iter_mut().find(|(n, _)| *n == ns) {
            Some((_, v)) => v.push(p),
            None => out.push((ns, vec![p])),
        }
    }
    out
}
