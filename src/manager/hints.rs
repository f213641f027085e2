//! Executing KV hints against the tiers. Every well-formed hint gets an outcome; only a
//! malformed one is an error (see `crate::hints`).

use super::devices::Devices;
use super::pages::Pages;
use super::queues::{Advice, EngineQueues};
use super::state::DirState;
use super::tiers::Mover;
use super::{Manager, ManagerError, SessionRegistry, Stores};
use crate::directory::PageId;
use crate::hints::{Hint, HintError, HintOutcome, HintTarget, Reason};
use crate::page::NamespaceId;
use crate::pool::PoolHealth;
use crate::tier::TierKind;

impl Manager {
    /// Applies a hint. docs/ARCHITECTURE.md, "Hints", gives the semantics of each kind.
    pub fn hint(&self, ns: NamespaceId, hint: Hint) -> Result<HintOutcome, ManagerError> {
        validate(&hint, self.inner.cfg.max_batch)?;
        // Pages that earlier lookups credited from the pool are named here too.
        super::settle_lookups(self);
        // Hints are soft: naming only pages (or a session) kvtier does not know is an
        // outcome, not an error.
        let (pages, requested) = match self.inner.pages.resolve(ns, hint.target(), &self.inner.sessions) {
            Ok(found) => found,
            Err(ManagerError::Hint(HintError::UnknownPages(_))) => {
                let reason = match hint.target() {
                    HintTarget::Session(_) => Reason::UnknownSession,
                    HintTarget::Pages(_) | HintTarget::Prefix(_) => Reason::UnknownPages,
                };
                let outcome = HintOutcome::Ignored { reason };
                self.inner.stats.hint(hint.kind(), &outcome);
                return Ok(outcome);
            }
            Err(e) => return Err(e),
        };
        let moves = HintMoves {
            mover: self.mover(),
            queues: &self.inner.queues,
        };
        let outcome = match &hint {
            Hint::Share { .. } => moves.share(ns, &pages, requested, &hint),
            Hint::Prefetch { to, .. } => moves.prefetch(ns, &pages, requested, *to, &hint),
            Hint::Demote { to, .. } => moves.demote(ns, &pages, requested, *to, &hint),
            Hint::Pin { tier, ttl_ms, .. } => {
                let tun = self.tunables();
                let capacity = capacity_pages(*tier, &self.inner.pages, &self.inner.stores, &self.inner.devices);
                let budget = (tun.pin_budget * capacity as f64).floor() as usize;
                let ttl = clip_ttl(&tun, *ttl_ms);
                self.inner
                    .upkeep
                    .pin(&self.inner.pages, &pages, requested, *tier, budget, ttl)
            }
            Hint::Retain { priority, ttl_ms, .. } => {
                let ttl = clip_ttl(&self.tunables(), *ttl_ms);
                self.inner
                    .upkeep
                    .retain(&self.inner.pages, &pages, requested, *priority, ttl)
            }
        };
        self.inner.stats.hint(hint.kind(), &outcome);
        Ok(outcome)
    }
}

/// The hints that move bytes or advise engines (Share, Prefetch, Demote): carried out by
/// the mover, with the engine queues for their advice and for the hints deferred until
/// the pool is healthy or the transfer queue has room.
struct HintMoves<'a> {
    mover: Mover<'a>,
    queues: &'a EngineQueues,
}

impl HintMoves<'_> {
    fn share(&self, ns: NamespaceId, pages: &[PageId], requested: usize, hint: &Hint) -> HintOutcome {
        let Some(pool) = self.mover.stores.pool() else {
            return HintOutcome::Ignored { reason: Reason::NoPool };
        };
        if pool.health() != PoolHealth::Ok {
            return self.queues.defer(ns, hint, pages.len(), Reason::PoolDegraded);
        }
        let (already, on_host, offload) = {
            let st = self.mover.read();
            let already = pages.iter().filter(|&&p| st.dir.is_complete(p, TierKind::Pool)).count();
            let on_host: Vec<PageId> = pages
                .iter()
                .copied()
                .filter(|&p| !st.dir.is_complete(p, TierKind::Pool) && st.dir.is_complete(p, TierKind::Host))
                .collect();
            (already, on_host, offload_advice(&st, ns, pages))
        };
        let device_only = self.queues.push_offload(offload);
        if !on_host.is_empty() && !self.mover.spawn_copy_to_pool(ns, on_host.clone()) {
            return self.queues.defer(ns, hint, on_host.len(), Reason::QueueFull);
        }
        clip(
            already + on_host.len(),
            requested,
            if device_only > 0 {
                Reason::NotComplete
            } else {
                Reason::UnknownPages
            },
        )
    }

    fn prefetch(&self, ns: NamespaceId, pages: &[PageId], requested: usize, to: TierKind, hint: &Hint) -> HintOutcome {
        let (on_host, in_pool) = {
            let st = self.mover.read();
            let on_host: Vec<PageId> = pages
                .iter()
                .copied()
                .filter(|&p| st.dir.is_complete(p, TierKind::Host))
                .collect();
            let in_pool: Vec<_> = pages
                .iter()
                .copied()
                .filter(|&p| !st.dir.is_complete(p, TierKind::Host) && st.dir.is_complete(p, TierKind::Pool))
                .map(|p| st.dir.info(p).hash)
                .collect();
            (on_host, in_pool)
        };
        if !in_pool.is_empty() {
            if self.mover.stores.pool().is_none_or(|p| p.health() != PoolHealth::Ok) {
                return self.queues.defer(ns, hint, in_pool.len(), Reason::PoolDegraded);
            }
            // Staging is synchronous for the hint's own pages so that a prefetch to device
            // can say which pages are ready; it is bounded by the batch size.
            self.mover.stage_pages_from_pool(ns, &in_pool);
        }
        let st = self.mover.read();
        let ready: Vec<PageId> = pages
            .iter()
            .copied()
            .filter(|&p| st.dir.is_complete(p, TierKind::Host))
            .collect();
        let hashes: Vec<_> = ready.iter().map(|&p| st.dir.info(p).hash).collect();
        drop(st);
        if to == TierKind::Device && !hashes.is_empty() {
            self.queues.lock().push_advice(Advice::ReadyToLoad { ns, hashes });
        }
        let _ = on_host;
        clip(ready.len(), requested, Reason::NotComplete)
    }

    fn demote(&self, ns: NamespaceId, pages: &[PageId], requested: usize, to: TierKind, hint: &Hint) -> HintOutcome {
        match to {
            TierKind::Host => {
                let st = self.mover.read();
                let on_device: Vec<PageId> = pages
                    .iter()
                    .copied()
                    .filter(|&p| st.dir.is_complete(p, TierKind::Device))
                    .collect();
                let covered: Vec<PageId> = on_device
                    .iter()
                    .copied()
                    .filter(|&p| st.dir.is_complete(p, TierKind::Host) || st.dir.is_complete(p, TierKind::Pool))
                    .collect();
                let offload = offload_advice(&st, ns, &on_device);
                let hashes: Vec<_> = covered.iter().map(|&p| st.dir.info(p).hash).collect();
                drop(st);
                self.queues.push_offload(offload);
                if !hashes.is_empty() {
                    self.queues.lock().push_advice(Advice::EvictFirst { ns, hashes });
                }
                clip(covered.len(), requested, Reason::NotComplete)
            }
            _ => {
                let Some(pool) = self.mover.stores.pool() else {
                    return HintOutcome::Ignored { reason: Reason::NoPool };
                };
                if pool.health() != PoolHealth::Ok {
                    return self.queues.defer(ns, hint, pages.len(), Reason::PoolDegraded);
                }
                let on_host: Vec<PageId> = {
                    let st = self.mover.read();
                    pages
                        .iter()
                        .copied()
                        .filter(|&p| st.dir.is_complete(p, TierKind::Host))
                        .collect()
                };
                self.mover.copy_to_pool(ns, &on_host, false);
                let mut st = self.mover.write();
                let mut done = 0;
                for &p in &on_host {
                    if st.dir.is_complete(p, TierKind::Pool) {
                        // The host copy goes first when host needs room.
                        st.dir.order_mut().set_retain(p, i8::MIN);
                        done += 1;
                    }
                }
                clip(done, requested, Reason::NoSpace)
            }
        }
    }
}

impl EngineQueues {
    /// Re-runs the deferred hints on `m` once each; those still blocked go back in the
    /// queue. Returns what the re-runs came to (each outcome is also counted in the hint
    /// stats); a re-run that fails (its namespace or pages gone wrong since) is logged
    /// here, since nobody waits for it any more.
    pub(crate) fn retry_deferred(&self, m: &Manager) -> DeferredRetry {
        let pending = self.lock().take_deferred();
        let mut r = DeferredRetry::default();
        for (ns, hint) in pending {
            let kind = hint.kind();
            r.rerun += 1;
            match m.hint(ns, hint) {
                Ok(HintOutcome::Accepted { .. } | HintOutcome::Clipped { .. }) => r.applied += 1,
                Ok(HintOutcome::Deferred { .. }) => r.deferred_again += 1,
                Ok(_) => r.ignored += 1,
                Err(e) => {
                    r.failed += 1;
                    tracing::warn!(ns = ns.0, ?kind, error = %e, "a deferred hint failed when re-run");
                }
            }
        }
        if r.rerun > 0 {
            tracing::debug!(?r, "deferred hints re-run");
        }
        r
    }
}

impl Pages {
    /// The known pages a target names, and how many it asked for.
    fn resolve(
        &self,
        ns: NamespaceId,
        target: &HintTarget,
        sessions: &SessionRegistry,
    ) -> Result<(Vec<PageId>, usize), ManagerError> {
        self.read().dir.layout(ns)?;
        let (pages, requested): (Vec<PageId>, usize) = match target {
            HintTarget::Pages(hs) => {
                let st = self.read();
                (hs.iter().filter_map(|h| st.dir.find(ns, h)).collect(), hs.len())
            }
            HintTarget::Prefix(hs) => {
                let st = self.read();
                (hs.iter().map_while(|h| st.dir.find(ns, h)).collect(), hs.len())
            }
            HintTarget::Session(s) => {
                let Some(idx) = sessions.get(s) else {
                    return Err(HintError::UnknownPages(0).into());
                };
                // A session's pages are found by a walk: in chunks, so lookups never
                // wait behind it.
                let mut pages = Vec::new();
                self.walk(|st, range| {
                    pages.extend(
                        st.dir
                            .order()
                            .pages_of_session_in(idx, range)
                            .into_iter()
                            .filter(|&p| st.dir.info(p).ns == ns),
                    );
                });
                let n = pages.len();
                (pages, n)
            }
        };
        if pages.is_empty() {
            return Err(HintError::UnknownPages(requested).into());
        }
        Ok((pages, requested))
    }
}

/// Refuses a malformed hint: an empty or oversized target, a tier the kind cannot
/// move to, a zero TTL.
fn validate(hint: &Hint, max_batch: usize) -> Result<(), HintError> {
    let n = match hint.target() {
        HintTarget::Pages(h) | HintTarget::Prefix(h) => h.len(),
        HintTarget::Session(s) => usize::from(!s.is_empty()),
    };
    if n == 0 {
        return Err(HintError::Empty);
    }
    if n > max_batch {
        return Err(HintError::TooMany { got: n, max: max_batch });
    }
    let bad = |kind: &'static str, tier| Err(HintError::BadTier { kind, tier });
    match *hint {
        Hint::Prefetch { to: TierKind::Pool, .. } => bad("prefetch", TierKind::Pool),
        Hint::Demote {
            to: TierKind::Device, ..
        } => bad("demote", TierKind::Device),
        Hint::Pin { ttl_ms: 0, .. } | Hint::Retain { ttl_ms: 0, .. } => Err(HintError::ZeroTtl),
        _ => Ok(()),
    }
}

/// A tier's capacity in pages of the namespace layouts (the largest page if several).
fn capacity_pages(tier: TierKind, dir: &Pages, stores: &Stores, devices: &Devices) -> usize {
    let objs = dir.largest_page_objects();
    match tier {
        TierKind::Device => devices.pages().values().copied().max().unwrap_or(0),
        TierKind::Host => stores.arena().map_or(0, |a| a.slots() as usize / objs),
        TierKind::Pool => stores.pool().map_or(0, |p| {
            let slot = stores.arena().map_or(1, |a| a.slot_bytes() as u64).max(1);
            (p.usage().capacity_bytes / slot) as usize / objs
        }),
    }
}

/// What one [`EngineQueues::retry_deferred`] pass came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeferredRetry {
    /// Deferred hints taken from the queue and re-run.
    pub rerun: usize,
    /// Re-runs applied (accepted, or clipped).
    pub applied: usize,
    /// Re-runs deferred again (back in the queue, or refused by a full queue).
    pub deferred_again: usize,
    /// Re-runs that were ignored (nothing left to do, pages gone).
    pub ignored: usize,
    /// Re-runs that returned an error.
    pub failed: usize,
}

/// Advice to store the pages that are complete only on device, so a colder copy can be
/// made; queued by the caller once the directory lock is let go.
fn offload_advice(st: &DirState, ns: NamespaceId, pages: &[PageId]) -> Option<Advice> {
    let hashes: Vec<_> = pages
        .iter()
        .copied()
        .filter(|&p| {
            st.dir.is_complete(p, TierKind::Device)
                && !st.dir.is_complete(p, TierKind::Host)
                && !st.dir.is_complete(p, TierKind::Pool)
        })
        .map(|p| st.dir.info(p).hash)
        .collect();
    (!hashes.is_empty()).then_some(Advice::Offload { ns, hashes })
}

/// When a TTL set at `now_ms` ends. Saturates: a TTL reaching past `u64::MAX` ms (as
/// `max_pin_ttl_ms = u64::MAX` allows) ends at `u64::MAX`, which no clock reaches, so
/// the pin holds until it is replaced or its page goes, never wrapping to the past.
pub(crate) fn expiry(now_ms: u64, ttl_ms: u64) -> u64 {
    now_ms.saturating_add(ttl_ms)
}

/// The TTL to apply (clipped to `max_pin_ttl_ms`) and whether it was clipped.
fn clip_ttl(tun: &super::Tunables, ttl_ms: u64) -> (u64, bool) {
    let max = tun.max_pin_ttl_ms;
    (ttl_ms.min(max), ttl_ms > max)
}

pub(super) fn clip(applied: usize, requested: usize, reason: Reason) -> HintOutcome {
    if applied >= requested {
        HintOutcome::Accepted { pages: applied }
    } else if applied == 0 {
        HintOutcome::Ignored { reason }
    } else {
        HintOutcome::Clipped {
            applied,
            requested,
            reason,
        }
    }
}
