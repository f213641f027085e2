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

use super::devices::DevicePages;
use super::hints::{clip, expiry};
use super::locks::{Ordered, Rank};
use super::pages::Pages;
use super::queues::Advice;
use super::stores::Stores;
use super::timers::{TimerKey, Timers};
use super::{Manager, ManagerError, Tunables};
use crate::clock::Clock;
use crate::directory::PageId;
use crate::hints::{HintOutcome, Reason};
use crate::page::PageHash;
use crate::policy::Watermarks;
use crate::pool::PoolBackend;
use crate::tier::TierKind;
use crate::tier::host::HostArena;

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

    /// Looks at `tier`'s usage (host or pool) in `stores` after it may have grown; on a
    /// crossing of its high watermark from below, calls the upkeep waker. Call with no
    /// manager lock held. Only the tier that grew is read, so a store does not touch the
    /// pool's lock.
    pub(super) fn usage_grew(&self, tier: TierKind, stores: &Stores, tun: &Tunables) {
        match tier {
            TierKind::Pool => self.crossed(1, pool_over(stores.pool(), &tun.pool_watermarks)),
            _ => self.crossed(0, host_over(stores.arena(), &tun.host_watermarks)),
        }
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

    /// Ends the pins and retains due at `now`: O(log n) each from the timer heap. Nothing
    /// is locked exclusively when none is due. Directory, then timers: a pin mark and its
    /// expiry change together.
    fn expire(&self, now: u64, pages: &Pages) {
        if self.timers().next_deadline().is_none_or(|at| at > now) {
            return;
        }
        let mut st = pages.write();
        let due = self.timers().expire(now);
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

// Pin and retain hints: the timers are upkeep's, the marks the directory's.
impl Upkeep {
    /// Pins the pages of `pages` complete in `tier` until the TTL ends, at most `budget`
    /// pins in the tier in all.
    pub(super) fn pin(
        &self,
        dir: &Pages,
        pages: &[PageId],
        requested: usize,
        tier: TierKind,
        budget: usize,
        (ttl, ttl_clipped): (u64, bool),
    ) -> HintOutcome {
        let expires = expiry(self.clock.now_ms(), ttl);
        // Directory, then timers: the pin mark and its expiry change together.
        let mut st = dir.write();
        let mut timers = self.timers();
        let mut room = budget.saturating_sub(timers.pins_in(tier));
        let mut pinned = 0;
        let mut over_budget = false;
        for &p in pages {
            if !st.dir.is_complete(p, tier) {
                continue;
            }
            let hash = st.dir.info(p).hash;
            if timers.is_pinned(p.0, tier) {
                timers.pin(p.0, tier, hash, expires);
                pinned += 1;
                continue;
            }
            if room == 0 {
                over_budget = true;
                continue;
            }
            room -= 1;
            timers.pin(p.0, tier, hash, expires);
            st.dir.set_pinned(p, tier, true);
            pinned += 1;
        }
        drop(timers);
        drop(st);
        let reason = if over_budget {
            Reason::PinBudget
        } else if pinned < requested {
            Reason::NotComplete
        } else {
            Reason::MaxTtl
        };
        if pinned == requested && ttl_clipped {
            return HintOutcome::Clipped {
                applied: pinned,
                requested,
                reason: Reason::MaxTtl,
            };
        }
        clip(pinned, requested, reason)
    }

    /// Sets the pages' retention priority until the TTL ends.
    pub(super) fn retain(
        &self,
        dir: &Pages,
        pages: &[PageId],
        requested: usize,
        priority: i8,
        (ttl, ttl_clipped): (u64, bool),
    ) -> HintOutcome {
        let expires = expiry(self.clock.now_ms(), ttl);
        let mut st = dir.write();
        let mut timers = self.timers();
        for &p in pages {
            let hash = st.dir.info(p).hash;
            st.dir.order_mut().set_retain(p, priority);
            timers.retain(p.0, hash, expires);
        }
        drop(timers);
        drop(st);
        if ttl_clipped {
            return HintOutcome::Clipped {
                applied: pages.len(),
                requested,
                reason: Reason::MaxTtl,
            };
        }
        clip(pages.len(), requested, Reason::UnknownPages)
    }
}

impl Manager {
    /// Upkeep's timers, deadlines and waker.
    pub fn upkeep(&self) -> &Upkeep {
        &self.inner.upkeep
    }

    /// Periodic upkeep: expire pins and retains, evict by watermark, reconcile the pool's
    /// own evictions, retry deferred hints, and refresh device advice.
    pub fn tick(&self) -> Result<(), ManagerError> {
        let now = self.inner.clock.now_ms();
        self.inner.upkeep.expire(now, &self.inner.pages);
        let mover = self.mover();
        mover.expire_protection();
        if let Some(pool) = self.stores().pool() {
            self.inner.pages.forget_pool_objects(pool.take_evicted());
        }
        // Engines credit the pool from the lookup file only while the pool is healthy.
        self.discovery().refresh_pool_health();
        // The session policy first: at the high watermark its pressure controller pauses
        // acting sessions and demotes their private pages, which is what frees host
        // before plain eviction would take the least recently used pages of anyone.
        self.inner.policy.tick(self);
        // Host watermark.
        if let Some(arena) = self.stores().arena() {
            let tun = self.tunables();
            let reclaim = tun
                .host_watermarks
                .reclaim(arena.used() as usize, arena.slots() as usize);
            if reclaim > 0 {
                mover.make_host_room(reclaim);
            }
        }
        if let Some(pool) = self.stores().pool() {
            let slot_kib = self.stores().arena().map_or(1, |a| (a.slot_bytes() >> 10).max(1));
            let tun = self.tunables();
            self.inner
                .pages
                .evict_pool(pool.as_ref(), &tun.pool_watermarks, slot_kib, &self.inner.stats);
        }
        // Outcomes are counted in the hint stats and failures logged by the retry itself.
        let _retried = self.inner.queues.retry_deferred(self);
        let tun = self.tunables();
        for advice in device_advice(&self.inner.pages, self.inner.devices.pages(), &tun.device_watermarks) {
            self.inner.queues.lock().push_advice(advice);
        }
        // Re-arm: the next growth that finds usage above a high watermark wakes upkeep.
        self.inner.upkeep.rearm();
        self.inner.stats.ticked();
        Ok(())
    }
}

/// Device tier: kvtier cannot evict engine memory, so above the high watermark it
/// advises the engine which pages to evict first (those with a colder copy): per
/// namespace above its high watermark, the pages to evict first, coldest first.
fn device_advice(pages: &Pages, device_pages: DevicePages, watermarks: &Watermarks) -> Vec<Advice> {
    let mut advice = Vec::new();
    if device_pages.is_empty() {
        return advice;
    }
    let all = pages.candidates(TierKind::Device, |_, _, _| true);
    for (ns, capacity) in device_pages {
        let reclaim = watermarks.reclaim(all.iter().filter(|(_, i)| i.ns == ns).count(), capacity);
        if reclaim == 0 {
            continue;
        }
        // The directory's eviction order (idle and ended sessions' pages first), the
        // one `kvtier replay`'s emulated device follows, gathered in chunks.
        let mut cold: Vec<((bool, i8, u64), PageHash)> = Vec::new();
        pages.walk(|st, range| {
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
            advice.push(Advice::EvictFirst { ns, hashes });
        }
    }
    advice
}
