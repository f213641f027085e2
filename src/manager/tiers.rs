//! The mover: moves from host to pool, and eviction by watermark (the periodic `tick`
//! that drives it lives in `upkeep`; staging from pool to host, also the mover's, lives
//! in `stage`).
//!
//! Each move runs in three phases so bytes are never copied under a lock:
//! reserve (directory write lock: pick pages, allocate destination slots, mark objects in
//! flight), copy (no lock), settle (write lock: mark what arrived present, free what did
//! not). In-
//! flight objects keep their pages out of eviction, so a page is never evicted mid-move.

use std::sync::Arc;

use parking_lot::RwLockReadGuard;

use super::Manager;
use super::config::{ManagerConfig, TunableCell, Tunables};
use super::grants::{GrantTable, Grants, Leases};
use super::locks::Ordered;
use super::pages::Pages;
use super::pool_layout;
use super::stage::POOL_BATCH;
use super::state::{DirState, DirWrite, NO_SLOT};
use super::stats::Stats;
use super::stores::Stores;
use super::upkeep::Upkeep;
use crate::clock::Clock;
use crate::directory::PageId;
use crate::page::{NamespaceId, PageHash};
use crate::pool::{PoolError, PoolHealth};
use crate::tier::TierKind;
use crate::tier::host::SlotId;
use crate::transfer::TransferEngine;

/// The mover: every move of page bytes between host and pool (write-back and eviction by
/// watermark here, staging back in `stage`), with the leases and in-flight marks that
/// keep a moving page out of eviction and its slots out of reuse. A view over the parts
/// it works on, built by [`Manager::mover`]: the directory it reserves and settles in,
/// the grant table its leases live in, the stores it copies between and the transfer
/// workers that copy. `owner` is only cloned into the background jobs it spawns, which
/// outlive the view.
#[derive(Clone, Copy)]
pub(crate) struct Mover<'a> {
    pub(super) owner: &'a Manager,
    pub(super) cfg: &'a ManagerConfig,
    pub(super) pages: &'a Pages,
    pub(super) grants: &'a Grants,
    pub(super) stores: &'a Stores,
    pub(super) xfer: &'a Arc<TransferEngine>,
    pub(super) stats: &'a Stats,
    pub(super) upkeep: &'a Upkeep,
    pub(super) tun: &'a TunableCell,
    pub(super) clock: &'a dyn Clock,
}

impl Manager {
    /// The mover, over this manager's directory, grants, stores and transfer workers.
    pub(crate) fn mover(&self) -> Mover<'_> {
        let inner = &*self.inner;
        Mover {
            owner: self,
            cfg: &inner.cfg,
            pages: &inner.pages,
            grants: &inner.grants,
            stores: &inner.stores,
            xfer: &inner.xfer,
            stats: &inner.stats,
            upkeep: &inner.upkeep,
            tun: &inner.tun,
            clock: &*inner.clock,
        }
    }
}

/// One object moving between host and pool.
pub(super) struct ObjMove {
    pub(super) page: PageId,
    pub(super) obj: usize,
    pub(super) slot: SlotId,
    pub(super) len: usize,
    pub(super) hash: PageHash,
    /// Where the pool key sits in the batch's key buffer, rendered after the reserve phase
    /// has let go of the directory lock.
    pub(super) key: std::ops::Range<usize>,
}

/// Renders the pool keys of `moves` into one buffer, outside the directory lock: they need
/// nothing the lock guards (the layout is cloned, the key scheme too), and under the write
/// lock they held up the other transfer worker's reserve and settle and lookups. One
/// buffer per batch, not a `String` per object: the allocations showed on 64 KiB moves.
pub(super) fn render_keys(
    moves: &mut [ObjMove],
    keys: &crate::page::KeyScheme,
    layout: &crate::layout::Layout,
    buf: &mut String,
) {
    buf.clear();
    buf.reserve(moves.len() * keys.key_capacity());
    for m in moves {
        let start = buf.len();
        keys.write_object_key(buf, layout, &m.hash, layout.objects()[m.obj]);
        m.key = start..buf.len();
    }
}

impl Mover<'_> {
    pub(super) fn read(&self) -> Ordered<RwLockReadGuard<'_, DirState>> {
        self.pages.read()
    }

    pub(super) fn write(&self) -> DirWrite<'_> {
        self.pages.write()
    }

    pub(super) fn grants(&self) -> Ordered<parking_lot::MutexGuard<'_, GrantTable>> {
        self.grants.lock()
    }

    pub(super) fn tunables(&self) -> Tunables {
        self.tun.get()
    }

    /// Looks at `tier`'s usage after it may have grown (see [`Upkeep::usage_grew`]). Call
    /// with no manager lock held.
    pub(crate) fn usage_grew(&self, tier: TierKind) {
        self.upkeep.usage_grew(tier, self.stores, &self.tunables());
    }

    /// Frees at least `slots` host slots if it can, by watermark order, writing pages
    /// back to the pool when it has room. Returns slots freed.
    pub(crate) fn make_host_room(&self, slots: usize) -> usize {
        let Some(arena) = self.stores.arena() else { return 0 };
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
        let first = st.dir.order().victims(TierKind::Host, 1, |id| gt.leased(id));
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
            .order()
            .victims(TierKind::Host, want, |id| gt.leased(id))
            .into_iter()
            .map(|id| (id, st.dir.info(id).ns))
            .collect()
    }

    /// Ends the stage protections that are due. The due check is a heap peek under the
    /// read lock; the write lock is taken only when one is due.
    pub(crate) fn expire_protection(&self) {
        let now = self.clock.now_ms();
        if self
            .read()
            .dir
            .order()
            .next_protection_expiry()
            .is_none_or(|at| at > now)
        {
            return;
        }
        self.write().dir.order_mut().expire_protection(now);
    }

    /// Copies host-complete pages to the pool in the background (write-through, share).
    pub(crate) fn spawn_copy_to_pool(&self, ns: NamespaceId, pages: Vec<PageId>) -> bool {
        if self.stores.pool().is_none() {
            return false;
        }
        let m = self.owner.clone();
        self.xfer
            .try_submit(Box::new(move || {
                m.mover().copy_to_pool(ns, &pages, false);
            }))
            .is_ok()
    }

    /// Writes the objects of host-complete pages that the pool lacks, then (when `evict`)
    /// drops the host copies. A page whose pool write failed is still dropped when
    /// evicting: the pool had no room, and the event says so. Returns pages now complete
    /// in the pool.
    pub(crate) fn copy_to_pool(&self, ns: NamespaceId, pages: &[PageId], evict: bool) -> usize {
        let Some(arena) = self.stores.arena() else { return 0 };
        let pool = self.stores.pool().filter(|p| p.health() == PoolHealth::Ok);
        // Reserve.
        // Their pool in-flight marks are cleared in the settle below, or when dropped (a
        // panic in the pool's put), like the leases.
        let mut moves = PoolMarks::new(self.pages);
        // Given back in the settle below, or when dropped (a panic in the pool's put).
        let mut leases = Leases::new(self.grants);
        let mut objs: Vec<usize> = Vec::new();
        let mut want: Vec<usize> = Vec::new();
        let (layout, keys) = {
            let mut st = self.write();
            let Ok(layout) = st.dir.layout(ns).cloned() else {
                return 0;
            };
            let mut gt = self.grants();
            for &page in pages {
                if !st.dir.is_complete(page, TierKind::Host) {
                    continue;
                }
                let info = st.dir.info(page);
                if info.ns != ns {
                    continue;
                }
                if pool.is_some() {
                    let hash = info.hash;
                    let first = moves.len();
                    let slots = st.host_slots(page).unwrap_or(&[]);
                    // One list reused from page to page.
                    st.dir.objects().unwritten_into(page, TierKind::Pool, &mut want);
                    for &obj in &want {
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
                leases.take(&mut gt, page);
            }
            let keys = st.keys[ns.0 as usize].clone();
            (layout, keys)
        };
        let mut key_buf = String::new();
        let format = self.cfg.pool_key_format;
        render_keys(&mut moves, &keys, &layout, &mut key_buf);
        // Copy, straight from the arena slots into the pool's objects; under SGLang's keys
        // layer-first host objects are transposed to page-first (SGLang's bytes) in the
        // same copy (`pool_layout`). `None`: the arena slot could not be reached, nothing
        // was written.
        let mut results: Vec<Option<Result<(), PoolError>>> = Vec::new();
        if let Some(pool) = pool.as_ref().filter(|_| !moves.is_empty()) {
            let mut items = Vec::with_capacity(moves.len());
            let mut at = Vec::with_capacity(moves.len());
            results = vec![None; moves.len()];
            for (i, m) in moves.iter().enumerate() {
                // SAFETY: the page is leased: its host slots are neither freed nor
                // rewritten until we unlease it below.
                if let Ok(s) = unsafe { arena.slot(m.slot, m.len) } {
                    items.push((
                        &key_buf[m.key.clone()],
                        s,
                        pool_layout::transpose_rows(format, &layout, m.obj),
                    ));
                    at.push(i);
                }
            }
            crate::pool::io_guard::check("put");
            let t = std::time::Instant::now();
            // Shared with idle workers piece by piece, as stores and loads are: one Share
            // is one job, however many pages it names.
            let runners = self.xfer.runners(items.iter().map(|it| it.1.len() as u64).sum());
            let put = |r: std::ops::Range<usize>| pool.batch_put_ordered(&items[r]);
            for (r, i) in self.xfer.map_pieces(items.len(), runners, put).into_iter().zip(at) {
                results[i] = Some(r);
            }
            self.stats.copied(TierKind::Host, TierKind::Pool, t.elapsed());
        }
        // Settle.
        let mut st = self.write();
        let mut gt = self.grants();
        let mut bytes = 0u64;
        // Per page, one side-table change for what arrived (the moves of a page are
        // adjacent); then, under the same lock, one for what is no longer in flight.
        for run in page_runs(&moves) {
            let page = moves[run.start].page;
            objs.clear();
            for (m, r) in moves[run.clone()].iter().zip(&results[run]) {
                if matches!(r, Some(Ok(()))) {
                    objs.push(m.obj);
                    bytes += m.len as u64;
                }
            }
            // Cannot fail: every object index comes from this page's own layout.
            let _ = st.dir.set_objects(page, TierKind::Pool, &objs, true);
        }
        moves.clear(&mut st, &mut objs);
        let mut complete = 0;
        leases.give_back_each(&mut gt, |gt, page| {
            complete += usize::from(st.dir.is_complete(page, TierKind::Pool));
            if evict && !gt.leased(page) && !st.dir.is_pinned(page, TierKind::Host) {
                self.drop_host_page(&mut st, page);
                self.stats.evicted(TierKind::Host);
            }
        });
        drop(gt);
        drop(st);
        self.stats.moved(TierKind::Host, TierKind::Pool, bytes);
        if bytes > 0 {
            self.usage_grew(TierKind::Pool);
        }
        complete
    }

    /// Frees a page's host slots and marks it gone from host.
    pub(crate) fn drop_host_page(&self, st: &mut DirState, page: PageId) {
        let Some(arena) = self.stores.arena() else { return };
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

    /// Stages the prefix in the background (a best-effort load whose prefix has pages in
    /// the pool alone: the caller has looked).
    pub(crate) fn spawn_stage_prefix(&self, ns: NamespaceId, hashes: &[PageHash]) -> bool {
        if self.stores.pool().is_none() {
            return true;
        }
        let m = self.owner.clone();
        let hashes = hashes.to_vec();
        self.xfer
            .try_submit(Box::new(move || {
                m.mover().stage_prefix_from_pool(ns, &hashes, None);
            }))
            .is_ok()
    }
}

/// The moves of one host→pool write, owning the pool in-flight marks its reserve phase
/// set: the settle clears them ([`Self::clear`]); dropped before that (a panic in the
/// pool's put, an early return), it clears them itself under the directory lock, so no
/// page is left marked in flight in the pool, which would keep its objects out of every
/// later write-back. Declare it before the settle's lock guards, so it drops after them.
pub(super) struct PoolMarks<'a> {
    pages: &'a Pages,
    moves: Vec<ObjMove>,
    cleared: bool,
}

impl<'a> PoolMarks<'a> {
    fn new(pages: &'a Pages) -> Self {
        Self {
            pages,
            moves: Vec::new(),
            cleared: false,
        }
    }

    /// Ends every move's in-flight mark, one side-table change per page, under the
    /// directory lock the caller holds (`objs` is scratch).
    fn clear(&mut self, st: &mut DirState, objs: &mut Vec<usize>) {
        for run in page_runs(&self.moves) {
            objs.clear();
            objs.extend(self.moves[run.clone()].iter().map(|m| m.obj));
            // Cannot fail: every object index comes from this page's own layout.
            let _ = st
                .dir
                .set_inflight_objects(self.moves[run.start].page, TierKind::Pool, objs, false);
        }
        self.cleared = true;
    }
}

impl std::ops::Deref for PoolMarks<'_> {
    type Target = Vec<ObjMove>;

    fn deref(&self) -> &Vec<ObjMove> {
        &self.moves
    }
}

impl std::ops::DerefMut for PoolMarks<'_> {
    fn deref_mut(&mut self) -> &mut Vec<ObjMove> {
        &mut self.moves
    }
}

impl Drop for PoolMarks<'_> {
    fn drop(&mut self) {
        if self.cleared || self.moves.is_empty() {
            return;
        }
        let pages = self.pages;
        let mut st = pages.write();
        self.clear(&mut st, &mut Vec::new());
    }
}

/// The index ranges of `moves` that belong to one page each (a page's moves are pushed
/// together).
pub(super) fn page_runs(moves: &[ObjMove]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
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
