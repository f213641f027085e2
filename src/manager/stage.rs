//! Staging pool pages into the host arena (pool→host): prefetches, best-effort loads and
//! the background stage of a prefix.
//!
//! A staging runs in batches of [`POOL_BATCH`] pages, each in the three phases of every
//! move. The caller reserves (directory write lock: fresh arena slots, objects marked in
//! flight) and renders the batch's pool keys with no lock held. The copy then runs on as
//! many transfer workers as its bytes are worth ([`crate::transfer::runners`], as stores
//! and loads share their batches), cut into pieces that are each one pool batch (one
//! index lock pair in the local pool, not one per object), and the worker that ends the
//! last piece settles the batch. The caller reserves the next batch while the workers
//! copy this one, and waits for every settle at the end. A staging that runs on a
//! transfer worker (the background stage of a prefix), or whose batch is too small to be
//! worth a wake-up, copies and settles where it runs.
//!
//! A batch's slots are owned by a [`Settle`] guard: it settles when the last piece is
//! done, or, dropped unrun (a piece panicked, the queue refused the job), settles what
//! arrived and frees the rest, after every job that could still write a slot is gone.

use std::ops::Range;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::Manager;
use super::pool_layout;
use super::tiers::{Mover, ObjMove, page_runs, render_keys};
use crate::directory::EvictClass;
use crate::layout::Layout;
use crate::page::{NamespaceId, PageHash};
use crate::pool::{PoolBackend, PoolError, PoolHealth};
use crate::tier::TierKind;
use crate::tier::host::HostArena;

/// Pages handled per staging batch.
pub(crate) const POOL_BATCH: usize = 64;
/// Longest a staging waits for the batches it handed to the transfer workers.
const STAGE_WAIT: Duration = Duration::from_secs(30);
/// Pieces per worker a shared batch is cut into, so a worker that starts late takes
/// fewer of them rather than leaving the others idle at the end.
const PIECES_PER_RUNNER: usize = 4;

/// One object's result: `None` when its slot could not be reached (nothing was copied).
type ObjResult = Option<Result<usize, PoolError>>;

/// One reserved batch: the moves, their keys, and what each piece of the copy came to.
struct StageBatch {
    m: Manager,
    ns: NamespaceId,
    pool: Arc<dyn PoolBackend>,
    arena: Arc<HostArena>,
    layout: Layout,
    moves: Vec<ObjMove>,
    keys: String,
    pieces: Vec<Range<usize>>,
    results: Vec<OnceLock<Vec<ObjResult>>>,
    protect_ms: u64,
}

impl StageBatch {
    /// Copies piece `k` straight from the pool's objects into its fresh arena slots
    /// (under SGLang's keys, page-first objects transposed back to layer-first in the same
    /// copy), as one pool batch.
    fn copy_piece(&self, k: usize) {
        let Some(range) = self.pieces.get(k).cloned() else {
            return;
        };
        let moves = &self.moves[range];
        let mut items = Vec::with_capacity(moves.len());
        let mut at = Vec::with_capacity(moves.len());
        for (i, m) in moves.iter().enumerate() {
            // SAFETY: freshly allocated slots, in flight, owned by this batch's `Settle`
            // until it settles; pieces are disjoint, so no other piece writes this slot.
            if let Ok(s) = unsafe { self.arena.slot_mut(m.slot, m.len) } {
                items.push((
                    &self.keys[m.key.clone()],
                    s,
                    pool_layout::transpose_rows(self.m.config().pool_key_format, &self.layout, m.obj),
                ));
                at.push(i);
            }
        }
        let mut out: Vec<ObjResult> = vec![None; moves.len()];
        crate::pool::io_guard::check("get");
        let t = Instant::now();
        for (r, i) in self.pool.batch_get_ordered(&mut items).into_iter().zip(at) {
            out[i] = Some(r);
        }
        self.m.mover().stats.copied(TierKind::Pool, TierKind::Host, t.elapsed());
        let _ = self.results[k].set(out);
    }

    /// Marks what arrived present on host (and what the pool lost gone from it), frees
    /// the slots of what did not arrive, and ends the in-flight marks. Returns pages now
    /// complete on host.
    fn settle(&self) -> usize {
        let mut results: Vec<&ObjResult> = Vec::with_capacity(self.moves.len());
        for (range, r) in self.pieces.iter().zip(&self.results) {
            match r.get() {
                Some(v) => results.extend(v.iter()),
                None => results.extend(std::iter::repeat_n(&None, range.len())),
            }
        }
        let (m, arena, moves) = (self.m.mover(), &self.arena, &self.moves);
        let mut staged = 0;
        let mut st = m.write();
        let count = st.dir.layout(self.ns).map_or(0, |l| l.object_count());
        let mut bytes = 0u64;
        let (mut arrived, mut lost, mut all) = (Vec::new(), Vec::new(), Vec::new());
        let mut vanished: Vec<PageHash> = Vec::new();
        let until_ms = m.clock.now_ms() + self.protect_ms;
        let cap = arena.slots() as usize / (2 * count.max(1));
        // Per page (its moves are adjacent): one side-table change each for what arrived,
        // what the pool lost and what is no longer in flight; present before out of
        // flight, so the page never looks empty in between.
        for run in page_runs(moves) {
            let page = moves[run.start].page;
            arrived.clear();
            lost.clear();
            for (mv, r) in moves[run.clone()].iter().zip(&results[run.clone()]) {
                match r {
                    Some(Ok(n)) if *n == mv.len => {
                        arrived.push((mv.obj, mv.slot));
                        bytes += mv.len as u64;
                    }
                    other => {
                        arena.free(mv.slot);
                        // The pool lost the object (or it is the wrong size): the page is
                        // not complete there any more.
                        if matches!(other, Some(Err(PoolError::NotFound) | Ok(_))) {
                            lost.push(mv.obj);
                            if vanished.last() != Some(&mv.hash) {
                                vanished.push(mv.hash);
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
            all.extend(moves[run].iter().map(|mv| mv.obj));
            // Cannot fail: every object index comes from this page's own layout.
            let _ = st.dir.set_inflight_objects(page, TierKind::Host, &all, false);
            // Staged for a load: protected until the load hits it or the TTL ends, so the
            // next eviction round does not drop what was just brought in. At most half of
            // host is protected at once, so a huge prefetch cannot lock stores out.
            if st.dir.is_complete(page, TierKind::Host) {
                staged += 1;
                if self.protect_ms > 0 && st.dir.order().protected_pages() < cap {
                    st.dir.order_mut().set_class(page, EvictClass::Protected { until_ms });
                }
            }
        }
        drop(st);
        for h in &vanished {
            self.m.discovery().object_vanished(self.ns, h);
        }
        m.stats.moved(TierKind::Pool, TierKind::Host, bytes);
        if bytes > 0 {
            m.usage_grew(TierKind::Host);
        }
        staged
    }
}

/// Owns a reserved batch's slots until it is settled: settles when dropped, after the
/// last piece ran or, unrun, with what arrived (see the module docs), and reports the
/// pages staged to the waiting caller.
struct Settle {
    batch: Arc<StageBatch>,
    reply: crossbeam_channel::Sender<usize>,
}

impl Drop for Settle {
    fn drop(&mut self) {
        let staged = self.batch.settle();
        // The channel has room for every batch of the staging; a caller that stopped
        // waiting has dropped its end, and then nobody needs the count.
        let _ = self.reply.try_send(staged);
    }
}

/// The contiguous index ranges that cut `n` moves into `pieces` pieces of near-equal size.
fn cut(n: usize, pieces: usize) -> Vec<Range<usize>> {
    let pieces = pieces.clamp(1, n.max(1));
    (0..pieces)
        .map(|k| k * n / pieces..(k + 1) * n / pieces)
        .filter(|r| !r.is_empty())
        .collect()
}

impl Mover<'_> {
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
    pub(crate) fn stage_pages_from_pool(&self, ns: NamespaceId, hashes: &[PageHash]) -> usize {
        self.stage_from_pool(ns, hashes, None, false)
    }

    /// Stages pages from the pool in batches of [`POOL_BATCH`] (see the module docs). With
    /// `prefix`, the first page that is unknown or not in the pool ends it; otherwise such
    /// pages are skipped. A full arena always ends it.
    fn stage_from_pool(&self, ns: NamespaceId, hashes: &[PageHash], deadline: Option<Instant>, prefix: bool) -> usize {
        let Some(pool) = self.stores.pool().filter(|p| p.health() == PoolHealth::Ok) else {
            return 0;
        };
        let Some(arena) = self.stores.arena() else { return 0 };
        let protect_ms = self.tunables().stage_protect_ms;
        let on_worker = crate::transfer::on_worker();
        let (reply, settled) = crossbeam_channel::bounded(hashes.len().div_ceil(POOL_BATCH).max(1));
        let mut batches = 0;
        for chunk in hashes.chunks(POOL_BATCH) {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            let Some((layout, keys, moves, stop)) = self.reserve_staging(ns, chunk, &arena, prefix) else {
                break;
            };
            let mut moves = moves;
            let mut key_buf = String::new();
            render_keys(&mut moves, &keys, &layout, &mut key_buf);
            let bytes: u64 = moves.iter().map(|m| m.len as u64).sum();
            let runners = if on_worker { 1 } else { self.xfer.runners(bytes) };
            // One runner copies the batch in one pool call: pieces only let several
            // workers share it, and each is a pool round trip (a 1,000-page resume on a
            // 200 ms pool took 64 of them, 12.8 s, where 16 do).
            let pieces = cut(moves.len(), if runners <= 1 { 1 } else { runners * PIECES_PER_RUNNER });
            let batch = Arc::new(StageBatch {
                m: self.owner.clone(),
                ns,
                pool: pool.clone(),
                arena: arena.clone(),
                layout,
                moves,
                keys: key_buf,
                results: pieces.iter().map(|_| OnceLock::new()).collect(),
                pieces,
                protect_ms,
            });
            let settle = Settle {
                batch: batch.clone(),
                reply: reply.clone(),
            };
            batches += 1;
            if runners <= 1 {
                for k in 0..batch.pieces.len() {
                    batch.copy_piece(k);
                }
                drop(settle);
            } else {
                let n = batch.pieces.len();
                let item = move |k: usize| {
                    batch.copy_piece(k);
                    true
                };
                let finish = move |_: Vec<bool>| drop(settle);
                // A full queue hands the batch back: it runs here instead.
                if let Err(job) = self.xfer.submit_shared(n, runners, item, finish, Duration::ZERO) {
                    job();
                }
            }
            if stop {
                break;
            }
        }
        drop(reply);
        let until = Instant::now() + STAGE_WAIT;
        (0..batches).map_while(|_| settled.recv_deadline(until).ok()).sum()
    }

    /// Reserves one batch of a staging: finds the pages of `chunk` to bring in, makes room
    /// in the arena, allocates their slots and marks their objects in flight. Returns the
    /// layout, the key scheme, the moves, and whether the staging ends after this batch;
    /// `None` when the namespace is gone.
    fn reserve_staging(
        &self,
        ns: NamespaceId,
        chunk: &[PageHash],
        arena: &HostArena,
        prefix: bool,
    ) -> Option<(Layout, crate::page::KeyScheme, Vec<ObjMove>, bool)> {
        // Which pages need staging, and how many slots.
        let need: usize = {
            let st = self.read();
            let layout = st.dir.layout(ns).ok()?;
            chunk
                .iter()
                .filter_map(|h| st.dir.find(ns, h))
                .filter(|&id| st.dir.is_complete(id, TierKind::Pool) && !st.dir.is_complete(id, TierKind::Host))
                .map(|id| match st.dir.has_any(id, TierKind::Host) {
                    true => st.dir.objects().missing_objects(id, TierKind::Host).len(),
                    false => layout.object_count(),
                })
                .sum::<usize>()
                .min(layout.object_count() * POOL_BATCH)
        };
        if need > arena.free_slots() as usize {
            self.make_host_room(need - arena.free_slots() as usize);
        }
        let mut stop = false;
        let mut st = self.write();
        let layout = st.dir.layout(ns).ok()?.clone();
        let count = layout.object_count();
        let mut moves = Vec::with_capacity(chunk.len() * count);
        let mut missing: Vec<usize> = Vec::with_capacity(count);
        for h in chunk {
            let Some(id) = st
                .dir
                .find(ns, h)
                .filter(|&id| st.dir.is_complete(id, TierKind::Host) || st.dir.is_complete(id, TierKind::Pool))
            else {
                if prefix {
                    stop = true;
                    break;
                }
                continue;
            };
            if st.dir.is_complete(id, TierKind::Host) {
                continue;
            }
            // One list serves the batch.
            st.dir.objects().unwritten_into(id, TierKind::Host, &mut missing);
            let Some(slots) = arena.alloc_n(missing.len()) else {
                stop = true;
                break;
            };
            // Cannot fail: every object index comes from this page's own layout.
            let _ = st.dir.set_inflight_objects(id, TierKind::Host, &missing, true);
            for (&obj, slot) in missing.iter().zip(slots) {
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
        Some((layout, keys, moves, stop))
    }
}

#[cfg(test)]
mod tests {
    use super::cut;
    use crate::clock::SimClock;
    use crate::hints::{Hint, HintOutcome, HintTarget};
    use crate::layout::LayoutSpec;
    use crate::manager::{LoadWait, Manager, ManagerConfig};
    use crate::page::{Namespace, PageHash};
    use crate::tier::TierKind;
    use crate::tier::device::EmulatedDevice;
    use std::sync::Arc;
    use std::time::Duration;

    /// A prefetch of two staging batches of 256 KiB pages (16 MiB a batch, so each is
    /// shared by every transfer worker, piece by piece) brings every page back with its
    /// bytes, and a page whose pool objects vanished is reported gone from the pool.
    #[test]
    fn a_shared_staging_brings_every_page_back_byte_for_byte() {
        let dir = tempfile::tempdir().unwrap();
        let layout = LayoutSpec::mha(4, 8, 128, 2, 16).build().unwrap();
        let page = layout.page_bytes();
        assert_eq!(page, 256 << 10);
        let n = 100usize;
        let mut cfg = ManagerConfig::in_dir(dir.path(), (n as u64 + 8) * page, Some((n as u64 + 8) * page));
        cfg.arena.lock = false;
        cfg.max_batch = 256;
        cfg.transfer_threads = 3;
        let m = Manager::new(cfg, SimClock::new()).unwrap();
        let ns = m.register_namespace(Namespace::model("stage"), layout.clone()).unwrap();
        let dev = Arc::new(EmulatedDevice::new(&layout, 0, n as u32));
        m.attach_device(ns, 0, 0, dev.clone()).unwrap();
        let hs: Vec<PageHash> = (0..n as u64).map(|i| PageHash::from_u64(0x5000 + i)).collect();
        let slots: Vec<u32> = (0..n as u32).collect();
        for (h, &s) in hs.iter().zip(&slots) {
            dev.fill_page(s, h.prefix_u64()).unwrap();
        }
        for (h, s) in hs.chunks(32).zip(slots.chunks(32)) {
            let t = m.store(ns, 0, 0, h, s, 0).unwrap();
            assert_eq!(m.wait(t, Duration::from_secs(30)).unwrap().failed, 0);
        }
        let share = Hint::Share {
            target: HintTarget::Pages(hs.clone()),
        };
        assert_eq!(m.hint(ns, share).unwrap(), HintOutcome::Accepted { pages: n });
        assert!(m.quiesce(Duration::from_secs(30)));
        m.removed(ns, 0, 0, &hs).unwrap();
        m.mover().make_host_room(usize::MAX);
        assert_eq!(m.lookup(ns, &hs).unwrap().host, 0);
        // One page's pool objects vanish behind the manager's back.
        let pool = m.stores().pool().unwrap();
        let keys: Vec<String> = {
            let st = m.read();
            let scheme = &st.keys[ns.0 as usize];
            layout
                .objects()
                .iter()
                .map(|&id| scheme.object_key(&layout, &hs[7], id))
                .collect()
        };
        for k in &keys {
            pool.remove(k, true).unwrap();
        }
        for d in 0..n as u32 {
            dev.fill_page(d, 0).unwrap();
        }
        let prefetch = Hint::Prefetch {
            target: HintTarget::Pages(hs.clone()),
            to: TierKind::Host,
            deadline_ms: None,
        };
        let out = m.hint(ns, prefetch).unwrap();
        assert!(
            matches!(out, HintOutcome::Clipped { applied, .. } if applied == n - 1),
            "{out:?}"
        );
        // A page complete nowhere is forgotten (no status at all).
        let complete = |h: &PageHash, t: TierKind| {
            m.page_status(ns, h)
                .unwrap()
                .is_some_and(|st| st.tiers.iter().any(|s| s.tier == t && s.complete))
        };
        assert!(!complete(&hs[7], TierKind::Host) && !complete(&hs[7], TierKind::Pool));
        assert!(
            hs.iter()
                .enumerate()
                .all(|(i, h)| i == 7 || complete(h, TierKind::Host))
        );
        for (i, h) in hs.iter().enumerate().filter(|&(i, _)| i != 7) {
            let t = m
                .load(ns, 0, 0, std::slice::from_ref(h), &[i as u32], LoadWait::WaitComplete)
                .unwrap();
            assert_eq!(m.wait(t, Duration::from_secs(30)).unwrap().pages, 1, "page {i}");
            assert!(dev.page_matches(i as u32, h.prefix_u64()).unwrap(), "page {i}");
        }
    }

    /// A load whose first page must be staged from the pool into a full host: the room
    /// comes from a page outside the load, never from the load's own pages on host (the
    /// least recently used here), so the load gets its whole prefix.
    #[test]
    fn staging_for_a_load_never_evicts_the_loads_own_pages() {
        let dir = tempfile::tempdir().unwrap();
        let layout = LayoutSpec::mha(2, 2, 64, 2, 16).build().unwrap();
        let page = layout.page_bytes();
        let n = 8usize;
        let mut cfg = ManagerConfig::in_dir(dir.path(), n as u64 * page, Some(4 * n as u64 * page));
        cfg.arena.lock = false;
        let m = Manager::new(cfg, SimClock::new()).unwrap();
        let ns = m.register_namespace(Namespace::model("own"), layout.clone()).unwrap();
        let per_page = layout.object_count();
        assert_eq!(m.stores().arena().unwrap().slots() as usize, n * per_page);
        let dev = Arc::new(EmulatedDevice::new(&layout, 0, n as u32 + 1));
        m.attach_device(ns, 0, 0, dev.clone()).unwrap();
        // The load's pages 0..8, then one page outside it.
        let hs: Vec<PageHash> = (0..n as u64 + 1).map(|i| PageHash::from_u64(0x7700 + i)).collect();
        let stored = |i: usize| {
            dev.fill_page(i as u32, hs[i].prefix_u64()).unwrap();
            let t = m.store(ns, 0, 0, &hs[i..=i], &[i as u32], 0).unwrap();
            assert_eq!(m.wait(t, Duration::from_secs(30)).unwrap().failed, 0, "page {i}");
        };
        (0..n).for_each(stored);
        let share = Hint::Share {
            target: HintTarget::Pages(hs[..n].to_vec()),
        };
        assert_eq!(m.hint(ns, share).unwrap(), HintOutcome::Accepted { pages: n });
        assert!(m.quiesce(Duration::from_secs(30)));
        // Page 0, the least recently used, leaves host for the pool; the outside page
        // takes its room, so host is full and page 1 is now the least recently used.
        m.mover().make_host_room(per_page);
        let on_host = |i: usize| {
            m.page_status(ns, &hs[i])
                .unwrap()
                .is_some_and(|st| st.tiers.iter().any(|s| s.tier == TierKind::Host && s.complete))
        };
        assert!(!on_host(0) && (1..n).all(on_host));
        stored(n);
        assert!(on_host(n));
        assert_eq!(m.stores().arena().unwrap().free_slots(), 0);
        let grant = m.begin_load(ns, 0, 0, &hs[..n], LoadWait::WaitComplete, 0).unwrap();
        assert_eq!(
            grant.pages.len(),
            n,
            "the load got a prefix of {} of {n} pages",
            grant.pages.len()
        );
        assert!((0..n).all(on_host) && !on_host(n));
        assert_eq!(m.finish_load(grant.id, n).unwrap(), n);
    }

    #[test]
    fn cut_covers_every_move_once_in_order() {
        for (n, pieces) in [(0, 4), (1, 8), (7, 3), (64, 8), (256, 8), (5, 0)] {
            let r = cut(n, pieces);
            let flat: Vec<usize> = r.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>(), "n {n} pieces {pieces}");
            assert!(r.len() <= pieces.max(1), "n {n}: {} pieces", r.len());
        }
    }
}
