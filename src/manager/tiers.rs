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
use super::pool_layout;
use super::state::{DirState, NO_SLOT};
use crate::directory::{EvictClass, PageId};
use crate::page::{NamespaceId, PageHash};
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
    /// Where the pool key sits in the batch's key buffer, rendered after the reserve phase
    /// has let go of the directory lock.
    key: std::ops::Range<usize>,
}

/// Renders the pool keys of `moves` into one buffer, outside the directory lock: they need
/// nothing the lock guards (the layout is cloned, the key scheme too), and under the write
/// lock they held up the other transfer worker's reserve and settle and lookups. One
/// buffer per batch, not a `String` per object: the allocations showed on 64 KiB moves.
fn render_keys(moves: &mut [ObjMove], keys: &crate::page::KeyScheme, layout: &crate::layout::Layout, buf: &mut String) {
    buf.clear();
    buf.reserve(moves.len() * keys.key_capacity());
    for m in moves {
        let start = buf.len();
        keys.write_object_key(buf, layout, &m.hash, layout.objects()[m.obj]);
        m.key = start..buf.len();
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

    /// Up to a batch of host pages to evict for `slots` slots, in eviction order, with
    /// their namespaces. The directory keeps the order as lists, so this is a read-only
    /// walk of O(batch) under the read lock (lookups run beside it); leases are checked
    /// during the walk and again when the copy settles, so a page leased meanwhile is
    /// never dropped.
    fn host_victims(&self, slots: usize) -> Vec<(PageId, NamespaceId)> {
        self.expire_protection();
        let st = self.read();
        let gt = self.grants();
        let first = st.dir.victims(TierKind::Host, 1, |id| gt.leased(id));
        let Some(&head) = first.first() else {
            return Vec::new();
        };
        let per_page = st
            .dir
            .layout(st.dir.info(head).ns)
            .map_or(1, |l| l.object_count())
            .max(1);
        let want = slots.div_ceil(per_page).clamp(1, POOL_BATCH);
        st.dir
            .victims(TierKind::Host, want, |id| gt.leased(id))
            .into_iter()
            .map(|id| (id, st.dir.info(id).ns))
            .collect()
    }

    /// Ends the stage protections that are due. The due check is a heap peek under the
    /// read lock; the write lock is taken only when one is due.
    pub(crate) fn expire_protection(&self) {
        let now = self.inner.clock.now_ms();
        if self.read().dir.next_protection_expiry().is_none_or(|at| at > now) {
            return;
        }
        self.write().dir.expire_protection(now);
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
        let mut objs: Vec<usize> = Vec::new();
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
                    let first = moves.len();
                    let slots = st.host_slots(page).unwrap_or(&[]);
                    for obj in st.dir.missing_objects(page, TierKind::Pool) {
                        if st.dir.is_inflight_object(page, TierKind::Pool, obj) {
                            continue;
                        }
                        let Some(&slot) = slots.get(obj).filter(|&&s| s != NO_SLOT) else {
                            continue;
                        };
                        moves.push(ObjMove {
                            page,
                            obj,
                            slot: SlotId(slot),
                            len: layout.object_bytes(obj) as usize,
                            hash,
                            key: 0..0,
                        });
                    }
                    objs.clear();
                    objs.extend(moves[first..].iter().map(|m| m.obj));
                    // Cannot fail: every object index comes from this page's own layout.
                    let _ = st.dir.set_inflight_objects(page, TierKind::Pool, &objs, true);
                }
                gt.lease(page);
                settled.push(page);
            }
            let keys = st.keys[ns.0 as usize].clone();
            (layout, keys)
        };
        let mut key_buf = String::new();
        render_keys(&mut moves, &keys, &layout, &mut key_buf);
        // Copy, straight from the arena slots into the pool's objects; layer-first host
        // objects are transposed to page-first (SGLang's bytes) in the same copy. `None`:
        // the arena slot could not be reached, nothing was written.
        let mut results: Vec<Option<Result<(), PoolError>>> = Vec::new();
        if let Some(pool) = pool.as_ref().filter(|_| !moves.is_empty()) {
            let mut items = Vec::with_capacity(moves.len());
            let mut at = Vec::with_capacity(moves.len());
            results = vec![None; moves.len()];
            for (i, m) in moves.iter().enumerate() {
                // SAFETY: the page is leased: its host slots are neither freed nor
                // rewritten until we unlease it below.
                if let Ok(s) = unsafe { arena.slot(m.slot, m.len) } {
                    items.push((&key_buf[m.key.clone()], s, pool_layout::transpose_rows(&layout, m.obj)));
                    at.push(i);
                }
            }
            crate::pool::io_guard::check("put");
            let t = std::time::Instant::now();
            for (r, i) in pool.batch_put_ordered(&items).into_iter().zip(at) {
                results[i] = Some(r);
            }
            self.inner.stats.copied(TierKind::Host, TierKind::Pool, t.elapsed());
        }
        // Settle.
        let mut st = self.write();
        let mut gt = self.grants();
        let mut bytes = 0u64;
        // Per page, one side-table change for what arrived and one for what is no longer
        // in flight (the moves of a page are adjacent).
        for run in page_runs(&moves) {
            let page = moves[run.start].page;
            objs.clear();
            for (m, r) in moves[run.clone()].iter().zip(&results[run.clone()]) {
                if matches!(r, Some(Ok(()))) {
                    objs.push(m.obj);
                    bytes += m.len as u64;
                }
            }
            // Cannot fail: every object index comes from this page's own layout.
            let _ = st.dir.set_objects(page, TierKind::Pool, &objs, true);
            objs.clear();
            objs.extend(moves[run].iter().map(|m| m.obj));
            // Cannot fail: every object index comes from this page's own layout.
            let _ = st.dir.set_inflight_objects(page, TierKind::Pool, &objs, false);
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
        let protect_ms = self.tunables().stage_protect_ms;
        let mut staged = 0;
        let mut key_buf = String::new();
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
                        let mut missing = st.dir.missing_objects(id, TierKind::Host);
                        missing.retain(|&o| !st.dir.is_inflight_object(id, TierKind::Host, o));
                        let Some(slots) = arena.alloc_n(missing.len()) else {
                            stop = true;
                            break;
                        };
                        // Cannot fail: every object index comes from this page's own layout.
                        let _ = st.dir.set_inflight_objects(id, TierKind::Host, &missing, true);
                        for (obj, slot) in missing.into_iter().zip(slots) {
                            moves.push(ObjMove {
                                page: id,
                                obj,
                                slot,
                                len: layout.object_bytes(obj) as usize,
                                hash: *h,
                                key: 0..0,
                            });
                        }
                    }
                    let keys = st.keys[ns.0 as usize].clone();
                    (layout, keys)
                };
            render_keys(&mut moves, &keys, &layout, &mut key_buf);
            // Straight from the pool's objects into the fresh arena slots, page-first
            // objects transposed back to layer-first in the same copy. `None`: the slot
            // could not be reached.
            let mut results: Vec<Option<Result<usize, PoolError>>> = vec![None; moves.len()];
            {
                let mut items = Vec::with_capacity(moves.len());
                let mut at = Vec::with_capacity(moves.len());
                for (i, m) in moves.iter().enumerate() {
                    // SAFETY: freshly allocated slots, in flight, owned by this move.
                    if let Ok(s) = unsafe { arena.slot_mut(m.slot, m.len) } {
                        items.push((&key_buf[m.key.clone()], s, pool_layout::transpose_rows(&layout, m.obj)));
                        at.push(i);
                    }
                }
                crate::pool::io_guard::check("get");
                let t = std::time::Instant::now();
                for (r, i) in pool.batch_get_ordered(&mut items).into_iter().zip(at) {
                    results[i] = Some(r);
                }
                self.inner.stats.copied(TierKind::Pool, TierKind::Host, t.elapsed());
            }
            let mut st = self.write();
            let count = st.dir.layout(ns).map_or(0, |l| l.object_count());
            let mut bytes = 0u64;
            let (mut arrived, mut lost, mut all) = (Vec::new(), Vec::new(), Vec::new());
            let mut vanished: Vec<PageHash> = Vec::new();
            let until_ms = self.inner.clock.now_ms() + protect_ms;
            let cap = arena.slots() as usize / (2 * count.max(1));
            // Per page (its moves are adjacent): one side-table change each for what
            // arrived, what the pool lost and what is no longer in flight; present before
            // out of flight, so the page never looks empty in between.
            for run in page_runs(&moves) {
                let page = moves[run.start].page;
                arrived.clear();
                lost.clear();
                for (m, r) in moves[run.clone()].iter().zip(&results[run.clone()]) {
                    match r {
                        Some(Ok(n)) if *n == m.len => {
                            arrived.push((m.obj, m.slot));
                            bytes += m.len as u64;
                        }
                        other => {
                            arena.free(m.slot);
                            // The pool lost the object (or it is the wrong size): the
                            // page is not complete there any more.
                            if matches!(other, Some(Err(PoolError::NotFound) | Ok(_))) {
                                lost.push(m.obj);
                                if vanished.last() != Some(&m.hash) {
                                    vanished.push(m.hash);
                                }
                            }
                        }
                    }
                }
                st.set_host_slots(page, &arrived, count);
                all.clear();
                all.extend(arrived.iter().map(|&(o, _)| o));
                // Cannot fail: every object index comes from this page's own layout.
                let _ = st.dir.set_objects(page, TierKind::Host, &all, true);
                // Cannot fail: every object index comes from this page's own layout.
                let _ = st.dir.set_objects(page, TierKind::Pool, &lost, false);
                all.clear();
                all.extend(moves[run].iter().map(|m| m.obj));
                // Cannot fail: every object index comes from this page's own layout.
                let _ = st.dir.set_inflight_objects(page, TierKind::Host, &all, false);
                // Staged for a load: protected until the load hits it or the TTL ends, so
                // the next eviction round does not drop what was just brought in. At most
                // half of host is protected at once, so a huge prefetch cannot lock
                // stores out.
                if st.dir.is_complete(page, TierKind::Host) {
                    staged += 1;
                    if protect_ms > 0 && st.dir.protected_pages() < cap {
                        st.dir.set_class(page, EvictClass::Protected { until_ms });
                    }
                }
            }
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

/// The index ranges of `moves` that belong to one page each (a page's moves are pushed
/// together).
fn page_runs(moves: &[ObjMove]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let page = moves.get(at)?.page;
        let start = at;
        at += moves[at..].iter().take_while(|m| m.page == page).count();
        Some(start..at)
    })
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
