//! A lookup's answer first, its directory work after.
//!
//! A lookup past device and host counts the pages the pool holds (from the pool index, or
//! the master's answer) without touching the directory: its credit is the device and host
//! prefix of the lock-free walk plus the leading run of pages the pool holds ([`credit`]).
//! Bringing the directory in line — pages found in the pool entered as pool-complete (a
//! record, a `stored` event and an origin entry each), a found page the pool no longer
//! holds dropped — is a [`Settle`], which a blocking lookup does at once and a lookup
//! answered on the daemon's connection task leaves for after its reply ([`defer`]): the
//! task settles once the connection is idle after writing the answer (about a millisecond
//! later), or before its next frame, whichever comes first ([`settle_lookups`]).
//!
//! Nothing is lost meanwhile: any discovery (a load, a blocking lookup), a hint, a page's
//! status and a page's origin settle what is pending before they read the directory, so no
//! request that follows a lookup's answer sees the directory behind it. A lookup's credit
//! never depends on the settling: a page the pool holds counts whether or not the
//! directory knows it yet, and a later lookup of it asks the index (or the master) again
//! until it does. The queue is bounded ([`MAX_PENDING`] lookups); past it a lookup settles
//! everything itself.

use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::time::Duration;

use super::{DiscoveryPlan, Known, PoolDiscovery};
use crate::manager::Manager;
use crate::page::{NamespaceId, PageHash};
use crate::pool::PoolError;
use crate::tier::TierKind;
use crate::wire::PrefixHit;

/// Most lookups whose directory work waits for their connection task; past it a lookup
/// settles everything itself (a connection task that never got to write its answer).
#[cfg(feature = "daemon")]
pub(crate) const MAX_PENDING: usize = 64;

/// The directory work one lookup's answer leaves (see the module doc).
pub(crate) struct Settle {
    ns: NamespaceId,
    /// Pages credited from the pool that the directory did not know, in order.
    found: Vec<PageHash>,
    /// The first page not credited, when the directory credited it to the pool and the
    /// pool said it no longer holds every object.
    vanished: Option<PageHash>,
    /// When the pool was asked (ms, the manager's clock).
    now: u64,
}

/// The answers the query brought, and how long it took; `None`: nothing was asked.
pub(super) type Answers = Option<(Vec<Result<bool, PoolError>>, Duration)>;

/// A lookup's credit from the directory's, the cache's and the pool's answers, and the
/// directory work it leaves (`None`: none). The cache takes the query's answers here.
pub(super) fn credit(
    pd: &PoolDiscovery,
    hashes: &[PageHash],
    d: DiscoveryPlan,
    res: Answers,
) -> (PrefixHit, Option<Settle>) {
    let Some(remote) = pd.remote else {
        return (d.hit, None);
    };
    let DiscoveryPlan {
        ns,
        hit,
        start,
        end,
        known,
        mut answer,
        ask,
        per_page,
        now,
    } = d;
    let window = &hashes[start..end];
    if let Some((res, took)) = res {
        let asked = ask.len() * per_page;
        let res: Result<Vec<bool>, _> = res.into_iter().collect();
        remote.n.exists_queries.fetch_add(1, Relaxed);
        remote.n.exists_keys.fetch_add(asked as u64, Relaxed);
        remote
            .n
            .exists_ns
            .fetch_add(took.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
        let Ok(present) = res else {
            // Unreachable or failing: nothing in the pool gets credit on this answer.
            remote.n.exists_failed.fetch_add(1, Relaxed);
            return (PrefixHit { pool: 0, ..hit }, None);
        };
        if let Some(mut cache) = pd.cache() {
            for (j, &i) in ask.iter().enumerate() {
                let yes = present.len() == asked && present[j * per_page..(j + 1) * per_page].iter().all(|&p| p);
                answer[i] = Some(yes);
                let ttl = if yes {
                    remote.cfg.positive_ttl_ms
                } else {
                    remote.cfg.negative_ttl_ms
                };
                cache.answers.insert((ns, window[i]), (yes, now + ttl));
            }
        }
    }
    // Only the leading run counts; the budget ends the window, so pages past it were not
    // confirmed in this lookup and earn nothing.
    let lead = answer.iter().take_while(|a| **a == Some(true)).count();
    let remote_hits = known[..lead]
        .iter()
        .filter(|k| matches!(k, Known::No | Known::Found))
        .count();
    remote.n.remote_hit_pages.fetch_add(remote_hits as u64, Relaxed);
    let found: Vec<PageHash> = window[..lead]
        .iter()
        .zip(&known)
        .filter(|(_, k)| **k == Known::No)
        .map(|(h, _)| *h)
        .collect();
    let vanished = window
        .get(lead)
        .filter(|_| matches!(known[lead], Known::Pool | Known::Found) && answer[lead] == Some(false))
        .copied();
    let credit = PrefixHit {
        device: hit.device,
        host: hit.host,
        pool: lead,
    };
    let work = (!found.is_empty() || vanished.is_some()).then_some(Settle {
        ns,
        found,
        vanished,
        now,
    });
    (credit, work)
}

/// Leaves `work` for the connection task that answers the lookup (see the module doc);
/// settles at once when [`MAX_PENDING`] lookups wait already.
#[cfg(feature = "daemon")]
pub(super) fn defer(pd: &PoolDiscovery, work: Option<Settle>) {
    let (Some(work), Some(remote)) = (work, pd.remote) else {
        return;
    };
    let work = {
        let Some(mut cache) = pd.cache() else { return };
        if cache.pending.len() < MAX_PENDING {
            cache.pending.push(work);
            remote.pending.store(true, std::sync::atomic::Ordering::Release);
            return;
        }
        work
    };
    settle(pd, Some(work));
}

/// Does the directory work that lookups answered on a connection task left (pages the
/// pool holds entered as pool-complete, pages it lost dropped). The daemon calls it once a
/// connection that wrote a lookup's answer is idle, before each request, and when a
/// connection ends; a no-op (one atomic load) when nothing waits.
pub fn settle_lookups(m: &Manager) {
    m.discovery().settle_pending();
}

impl PoolDiscovery<'_> {
    /// [`settle_lookups`]: the directory work lookups answered on a connection task left.
    pub fn settle_pending(&self) {
        if self.remote.is_some_and(|r| r.pending.load(Acquire)) {
            settle(self, None);
        }
    }
}

/// Settles every pending lookup's work and `extra`, under the directory's write lock (the
/// cache's lock nested inside it, which the lock order allows): a reader that takes the
/// directory's lock after a settler took the pending work sees all of it done.
pub(super) fn settle(pd: &PoolDiscovery, extra: Option<Settle>) {
    let Some(remote) = pd.remote else {
        return;
    };
    let (mut found, mut vanished) = (0u64, 0u64);
    {
        let mut st = pd.pages.write();
        let Some(mut cache) = pd.cache() else { return };
        let mut batch = std::mem::take(&mut cache.pending);
        remote.pending.store(false, Relaxed);
        batch.extend(extra);
        if batch.is_empty() {
            return;
        }
        for w in &batch {
            for h in &w.found {
                let Ok(id) = st.dir.find_or_insert(w.ns, h) else { break };
                // Another lookup may have settled it meanwhile; set_page emits only on change.
                if !st.dir.is_complete(id, TierKind::Pool)
                    && st.dir.objects().inflight_objects(id, TierKind::Pool).is_empty()
                {
                    st.dir.set_page(id, TierKind::Pool, true);
                    cache.found.insert((w.ns, *h), w.now);
                    found += 1;
                }
            }
            if let Some(h) = &w.vanished
                && let Some(id) = st.dir.find(w.ns, h)
                && st.dir.is_complete(id, TierKind::Pool)
                && st.dir.objects().inflight_objects(id, TierKind::Pool).is_empty()
            {
                st.dir.set_page(id, TierKind::Pool, false);
                cache.found.remove(&(w.ns, *h));
                vanished += 1;
            }
        }
        // The cache's guard goes first; the directory's then publishes the events.
        drop(cache);
    }
    remote.n.found_pages.fetch_add(found, Relaxed);
    remote.n.vanished_pages.fetch_add(vanished, Relaxed);
}
