//! What wakes the daemon's upkeep: the next timer deadline, and watermark crossings.
//!
//! Upkeep (`Manager::tick`) has work to do at two kinds of moments: when a pin or retain
//! expires (a deadline known in advance, [`Upkeep::next_deadline_ms`]) and when host or
//! pool usage reaches its high watermark (eviction becomes due). A store or a stage that
//! pushes usage across the high watermark calls the waker the daemon registered with
//! [`Upkeep::set_waker`] outside every manager lock: once per crossing, and again
//! at most once after each upkeep run while usage stays above. The daemon's upkeep sleeps
//! until one of the two instead of polling.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::locks::{Ordered, Rank};
use super::queues::Advice;
use super::timers::{TimerKey, Timers};
use super::{Manager, ManagerError};
use crate::clock::Clock;
use crate::directory::PageId;
use crate::page::{NamespaceId, PageHash};
use crate::policy::Watermarks;
use crate::pool::{PoolBackend, PoolError};
use crate::tier::TierKind;
use crate::tier::host::HostArena;

/// Pool victims marked per write lock.
const POOL_EVICT_BATCH: usize = 64;

/// A callback that wakes the upkeep task. It must return quickly and must not call back
/// into the manager synchronously (it runs on the thread that crossed the watermark).
pub type UpkeepWaker = Arc<dyn Fn() + Send + Sync>;

/// Upkeep as a component: the pin and retain timers (behind their own lock,
/// [`Rank::Timers`]), the watermark crossing state per watched tier and the waker. It
/// answers when upkeep next has timer work and wakes upkeep on a crossing; what usage is,
/// and what to do at a deadline, the manager passes in or does itself.
pub struct Upkeep {
    clock: Arc<dyn Clock>,
    /// [Timers] Pin and retain expiries. Nested inside `dir` (pin, expire).
    timers: Mutex<Timers>,
    /// Whether host (0) and pool (1) usage was at or above its high watermark when last
    /// looked at; a wake fires on a change from below to above.
    above: [AtomicBool; 2],
    /// Taken alone and only to clone the Arc out, never while calling it.
    waker: Mutex<Option<UpkeepWaker>>,
}

/// Whether `used` of `capacity` is at or above the high watermark.
fn over(w: &Watermarks, used: u64, capacity: u64) -> bool {
    capacity > 0 && used as f64 >= w.high * capacity as f64
}

/// Whether the arena's slots in use are at or above the high watermark.
fn host_over(arena: Option<Arc<HostArena>>, w: &Watermarks) -> bool {
    arena.is_some_and(|a| over(w, a.used() as u64, a.slots() as u64))
}

/// Whether the pool's bytes in use are at or above the high watermark.
fn pool_over(pool: Option<Arc<dyn PoolBackend>>, w: &Watermarks) -> bool {
    pool.is_some_and(|p| {
        let u = p.usage();
        over(w, u.used_bytes, u.capacity_bytes)
    })
}

impl Upkeep {
    pub(super) fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            timers: Mutex::new(Timers::default()),
            above: Default::default(),
            waker: Mutex::new(None),
        }
    }

    /// The pin and retain timers, under their lock ([`Rank::Timers`]).
    pub(super) fn timers(&self) -> Ordered<MutexGuard<'_, Timers>> {
        Ordered::take(Rank::Timers, || self.timers.lock())
    }

    /// Registers the callback that wakes the upkeep task when a store or a stage pushes
    /// host or pool usage across its high watermark. Replaces any earlier one. The waker
    /// is called outside every manager lock.
    pub fn set_waker(&self, waker: UpkeepWaker) {
        *self.waker.lock() = Some(waker);
    }

    /// The earliest pin or retain expiry (clock milliseconds), if any: when `tick` next
    /// has timer work to do.
    pub fn next_deadline_ms(&self) -> Option<u64> {
        self.timers().next_deadline()
    }

    /// How long from now until [`Upkeep::next_deadline_ms`], if there is one (zero when
    /// it has passed).
    pub fn until_next_deadline(&self) -> Option<std::time::Duration> {
        let now = self.clock.now_ms();
        self.next_deadline_ms()
            .map(|at| std::time::Duration::from_millis(at.saturating_sub(now)))
    }

    /// Records whether watched tier `i` (host 0, pool 1) is above its high watermark now;
    /// on a change from below, calls the waker (outside every lock but its own clone).
    fn crossed(&self, i: usize, now: bool) {
        // Always record the state: eviction outside `tick` may have brought it below.
        let was = self.above[i].swap(now, Ordering::AcqRel);
        if now && !was {
            let waker = self.waker.lock().clone();
            if let Some(w) = waker {
                w();
            }
        }
    }

    /// Re-arms both crossings after upkeep ran: the next store or stage that finds usage at
    /// or above a high watermark wakes upkeep again. Usage can stay above after a run when
    /// the pages it could evict were in flight or pinned; once those settle, the next
    /// growth must not wait for the fallback tick. So a wake happens at most once per
    /// upkeep run, never once per store. Never wakes itself: upkeep is what is running.
    fn rearm(&self) {
        for flag in &self.above {
            flag.store(false, Ordering::Release);
        }
    }
}

impl Manager {
    /// Upkeep's timers, deadlines and waker.
    pub fn upkeep(&self) -> &Upkeep {
        &self.inner.upkeep
    }

    /// Looks at `tier`'s usage (host or pool) after it may have grown; on a crossing of
    /// its high watermark from below, calls the upkeep waker. Call with no manager lock
    /// held. Only the tier that grew is read, so a store does not touch the pool's lock.
    pub(crate) fn usage_grew(&self, tier: TierKind) {
        let tun = self.tunables();
        match tier {
            TierKind::Pool => self
                .inner
                .upkeep
                .crossed(1, pool_over(self.pool(), &tun.pool_watermarks)),
            _ => self
                .inner
                .upkeep
                .crossed(0, host_over(self.arena(), &tun.host_watermarks)),
        }
    }
}

impl Manager {
    /// Periodic upkeep: expire pins and retains, evict by watermark, reconcile the pool's
    /// own evictions, retry deferred hints, and refresh device advice.
    pub fn tick(&self) -> Result<(), ManagerError> {
        let now = self.inner.clock.now_ms();
        self.expire(now);
        self.expire_protection();
        self.sync_pool_evictions();
        // The session policy first: at the high watermark its pressure controller pauses
        // acting sessions and demotes their private pages, which is what frees host
        // before plain eviction would take the least recently used pages of anyone.
        self.policy_tick();
        // Host watermark.
        if let Some(arena) = self.arena() {
            let tun = self.tunables();
            let reclaim = tun
                .host_watermarks
                .reclaim(arena.used() as usize, arena.slots() as usize);
            if reclaim > 0 {
                self.make_host_room(reclaim);
            }
        }
        self.evict_pool_by_watermark();
        // Outcomes are counted in the hint stats and failures logged by the retry itself.
        let _retried = self.retry_deferred();
        self.device_advice();
        // Re-arm: the next growth that finds usage above a high watermark wakes upkeep.
        self.inner.upkeep.rearm();
        Ok(())
    }

    /// Ends the pins and retains due at `now`: O(log n) each from the timer heap. Nothing
    /// is locked exclusively when none is due.
    fn expire(&self, now: u64) {
        if self.inner.upkeep.timers().next_deadline().is_none_or(|at| at > now) {
            return;
        }
        let mut st = self.write();
        let due = self.inner.upkeep.timers().expire(now);
        for (key, e) in due {
            let (page, tier) = match key {
                TimerKey::Pin(p, t) => (PageId(p), TierKind::from_index(t as usize)),
                TimerKey::Retain(p) => (PageId(p), None),
            };
            // The record may have been reused by another page since: leave that one be.
            let ns = st.dir.info(page).ns;
            if !st.same_page(page, &e.hash, ns) {
                continue;
            }
            match (key, tier) {
                (TimerKey::Pin(..), Some(tier)) => st.dir.set_pinned(page, tier, false),
                (TimerKey::Retain(_), _) => st.dir.order_mut().set_retain(page, 0),
                (TimerKey::Pin(..), None) => {}
            }
        }
    }

    /// Objects the pool dropped on its own: their pages are no longer pool-complete.
    fn sync_pool_evictions(&self) {
        let Some(pool) = self.pool() else { return };
        let keys = pool.take_evicted();
        if keys.is_empty() {
            return;
        }
        let mut st = self.write();
        for key in keys {
            for i in 0..st.keys.len() {
                let ns = NamespaceId(i as u16);
                let Ok(layout) = st.dir.layout(ns) else { continue };
                if let Ok((hash, obj)) = st.keys[i].parse(layout, &key) {
                    if let Some(id) = st.dir.find(ns, &hash) {
                        // `parse` checked `obj` against this layout: this cannot fail.
                        let _ = st.dir.set_object(id, TierKind::Pool, obj, false);
                    }
                    break;
                }
            }
        }
    }

    /// Pool watermark: marks the victims' pool objects absent (and in flight, so no pool
    /// write races the removal), removes them from the pool with no lock held, then
    /// clears the in-flight marks. Lookups stop counting a page before its bytes go.
    fn evict_pool_by_watermark(&self) {
        let Some(pool) = self.pool() else { return };
        let usage = pool.usage();
        if usage.capacity_bytes == 0 {
            return;
        }
        let tun = self.tunables();
        // Work in KiB so the watermark math stays in usize on 32-bit too.
        let reclaim = tun
            .pool_watermarks
            .reclaim((usage.used_bytes >> 10) as usize, (usage.capacity_bytes >> 10) as usize);
        if reclaim == 0 {
            return;
        }
        // Victims from the pool's eviction lists: a read-only walk of O(victims) under the
        // read lock, re-checked under the write lock below.
        let slot_kib = self.arena().map_or(1, |a| (a.slot_bytes() >> 10).max(1));
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
            self.evict_pool_batch(pool.as_ref(), batch);
        }
    }

    /// Reserve: under the write lock, pages still live and still evictable get their pool
    /// objects marked absent and in flight. Remove with no lock held. Settle: clear the
    /// in-flight marks.
    fn evict_pool_batch(&self, pool: &dyn crate::pool::PoolBackend, victims: &[PageId]) {
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
                self.inner.stats.evicted(TierKind::Pool);
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

    /// Device tier: kvtier cannot evict engine memory, so above the high watermark it
    /// advises the engine which pages to evict first (those with a colder copy).
    fn device_advice(&self) {
        let tun = self.tunables();
        let device_pages = self.inner.devices.pages();
        if device_pages.is_empty() {
            return;
        }
        let all = self.candidates(TierKind::Device, |_, _, _| true);
        for (ns, capacity) in device_pages {
            let reclaim = tun
                .device_watermarks
                .reclaim(all.iter().filter(|(_, i)| i.ns == ns).count(), capacity);
            if reclaim == 0 {
                continue;
            }
            // The directory's eviction order (idle and ended sessions' pages first), the
            // one `kvtier replay`'s emulated device follows, gathered in chunks.
            let mut cold: Vec<((bool, i8, u64), PageHash)> = Vec::new();
            self.walk_dir(|st, range| {
                cold.extend(
                    st.dir
                        .order()
                        .eviction_candidates_in(TierKind::Device, range)
                        .into_iter()
                        .filter(|(id, i)| {
                            i.ns == ns
                                && !st.dir.order().is_protected(*id)
                                && (st.dir.is_complete(*id, TierKind::Host) || st.dir.is_complete(*id, TierKind::Pool))
                        })
                        .map(|(id, i)| (st.dir.order().evict_key(id), i.hash)),
                );
            });
            if reclaim < cold.len() {
                cold.select_nth_unstable_by_key(reclaim, |c| c.0);
                cold.truncate(reclaim);
            }
            cold.sort_unstable_by_key(|c| c.0);
            let hashes: Vec<PageHash> = cold.into_iter().map(|(_, h)| h).collect();
            if !hashes.is_empty() {
                self.inner.queues.lock().push_advice(Advice::EvictFirst { ns, hashes });
            }
        }
    }
}
