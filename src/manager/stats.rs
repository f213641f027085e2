//! Counters the manager keeps for operators: hits and misses by tier, bytes moved per
//! tier pair, hint outcomes by kind, evictions, copy latency per tier pair. Lock-free;
//! read as a [`StatsSnapshot`].

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::Serialize;

use crate::hints::{HintKind, HintOutcome};
use crate::pool::PoolUsage;
use crate::tier::TierKind;
use crate::tier::host::HostArena;
use crate::wire::PrefixHit;

#[derive(Debug, Default)]
pub struct Stats {
    lookups: AtomicU64,
    looked_up_pages: AtomicU64,
    hit_pages: [AtomicU64; 3],
    miss_pages: AtomicU64,
    moved: [[AtomicU64; 3]; 3],
    hints: [[AtomicU64; 4]; 5],
    evictions: [AtomicU64; 3],
    copies: [[Histogram; 3]; 3],
    /// How long the daemon took to answer each lookup ([`Stats::lookup_served`]).
    lookup_time: Histogram,
    /// What the daemon's start-up recovery kept and dropped, by [`RECOVERY_REASONS`].
    recovery: [AtomicU64; RECOVERY_REASONS.len()],
    /// Upkeep runs ([`Manager::tick`](super::Manager::tick)) finished.
    ticks: AtomicU64,
}

/// Labels of the recovery counters: pages recovered, pages discarded (failed checksum,
/// incomplete, outside the configured arena), manifest records skipped, and manifests
/// that were not manifests at all.
pub const RECOVERY_REASONS: [&str; 6] = [
    "recovered",
    "corrupt",
    "incomplete",
    "outside_arena",
    "bad_manifest_record",
    "garbage_manifest",
];

/// Upper bounds (seconds) of the copy latency histogram's buckets; a last `+Inf` bucket
/// is implied.
pub const COPY_BUCKETS_S: [f64; 12] = [
    0.000_01, 0.000_05, 0.000_1, 0.000_5, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
];

/// Upper bounds (seconds) of the lookup latency histogram's buckets; a last `+Inf`
/// bucket is implied. A lookup the directory or the pool index answers takes
/// microseconds; one that asks the pool's master, hundreds of them or more.
pub const LOOKUP_BUCKETS_S: [f64; 12] = [
    0.000_005, 0.000_01, 0.000_02, 0.000_05, 0.000_1, 0.000_2, 0.000_5, 0.001, 0.005, 0.02, 0.1, 1.0,
];

/// A fixed-bucket latency histogram (non-cumulative counts; the last is `+Inf`), over
/// the bounds its caller passes ([`COPY_BUCKETS_S`] or [`LOOKUP_BUCKETS_S`]).
#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; COPY_BUCKETS_S.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    fn record(&self, bounds: &[f64; COPY_BUCKETS_S.len()], d: Duration) {
        let s = d.as_secs_f64();
        let i = bounds.iter().position(|&b| s <= b).unwrap_or(bounds.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Relaxed);
    }

    fn latency(&self) -> Latency {
        let buckets: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        Latency {
            count: buckets.iter().sum(),
            sum_ns: self.sum_ns.load(Relaxed),
            buckets,
        }
    }
}

impl Stats {
    pub(crate) fn record_lookup(&self, pages: usize, hit: &PrefixHit) {
        let mut t = crate::wire::LookupTally::default();
        t.add(pages, hit);
        self.record_tally(&t);
    }

    /// Lookups summed: one answered here, or those an engine answered itself, as it
    /// reported them.
    pub(crate) fn record_tally(&self, t: &crate::wire::LookupTally) {
        self.lookups.fetch_add(t.lookups, Relaxed);
        self.looked_up_pages.fetch_add(t.pages, Relaxed);
        for (tier, n) in [
            (TierKind::Device, t.device),
            (TierKind::Host, t.host),
            (TierKind::Pool, t.pool),
        ] {
            self.hit_pages[tier.index()].fetch_add(n, Relaxed);
        }
        let hit = t.device.saturating_add(t.host).saturating_add(t.pool);
        self.miss_pages.fetch_add(t.pages.saturating_sub(hit), Relaxed);
    }

    pub(crate) fn moved(&self, from: TierKind, to: TierKind, bytes: u64) {
        if bytes > 0 {
            self.moved[from.index()][to.index()].fetch_add(bytes, Relaxed);
        }
    }

    /// One copy between tiers (a page, or a batch of objects) took `d`.
    pub(crate) fn copied(&self, from: TierKind, to: TierKind, d: Duration) {
        self.copies[from.index()][to.index()].record(&COPY_BUCKETS_S, d);
    }

    /// The daemon answered a lookup `d` after it read the request (see
    /// [`StatsSnapshot::lookup_latency`]).
    #[cfg(any(feature = "daemon", test))]
    pub(crate) fn lookup_served(&self, d: Duration) {
        self.lookup_time.record(&LOOKUP_BUCKETS_S, d);
    }

    pub(crate) fn hint(&self, kind: HintKind, outcome: &HintOutcome) {
        let o = match outcome {
            HintOutcome::Accepted { .. } => 0,
            HintOutcome::Clipped { .. } => 1,
            HintOutcome::Deferred { .. } => 2,
            HintOutcome::Ignored { .. } => 3,
        };
        self.hints[kind as usize][o].fetch_add(1, Relaxed);
    }

    /// Adds what a recovery found (`counts` in [`RECOVERY_REASONS`] order).
    pub(crate) fn recovered(&self, counts: [u64; RECOVERY_REASONS.len()]) {
        for (c, n) in self.recovery.iter().zip(counts) {
            c.fetch_add(n, Relaxed);
        }
    }

    pub(crate) fn evicted(&self, tier: TierKind) {
        self.evictions[tier.index()].fetch_add(1, Relaxed);
    }

    /// One upkeep run finished.
    pub(crate) fn ticked(&self) {
        self.ticks.fetch_add(1, Relaxed);
    }

    pub(crate) fn snapshot(&self, c: TableCounts<'_>) -> StatsSnapshot {
        let TableCounts {
            dir,
            open_grants,
            leased_pages,
            pinned,
            deferred_hints,
            device_pages,
            arena,
            pool,
        } = c;
        let mut moved = Vec::new();
        for from in TierKind::ALL {
            for to in TierKind::ALL {
                let b = self.moved[from.index()][to.index()].load(Relaxed);
                if from != to {
                    moved.push(MovedBytes { from, to, bytes: b });
                }
            }
        }
        let mut copy_latency = Vec::new();
        for from in TierKind::ALL {
            for to in TierKind::ALL {
                let h = &self.copies[from.index()][to.index()];
                if from != to {
                    let l = h.latency();
                    copy_latency.push(CopyLatency {
                        from,
                        to,
                        count: l.count,
                        sum_s: l.sum_ns as f64 / 1e9,
                        buckets: l.buckets,
                    });
                }
            }
        }
        let mut hints = Vec::new();
        for kind in HintKind::ALL {
            for (i, name) in ["accepted", "clipped", "deferred", "ignored"].iter().enumerate() {
                hints.push(HintCount {
                    kind,
                    outcome: name,
                    count: self.hints[kind as usize][i].load(Relaxed),
                });
            }
        }
        let tiers = TierKind::ALL
            .iter()
            .map(|&t| {
                let (capacity, used, unit) = match t {
                    TierKind::Device => (device_pages, dir.complete[t.index()], "pages"),
                    TierKind::Host => arena.map_or((0, 0, "bytes"), |a| {
                        (
                            a.slots() as u64 * a.slot_bytes() as u64,
                            a.used() as u64 * a.slot_bytes() as u64,
                            "bytes",
                        )
                    }),
                    TierKind::Pool => pool.map_or((0, 0, "bytes"), |p| (p.capacity_bytes, p.used_bytes, "bytes")),
                };
                TierStats {
                    tier: t,
                    unit,
                    capacity,
                    used,
                    complete_pages: dir.complete[t.index()],
                    pinned_pages: pinned[t.index()],
                    inflight_pages: dir.inflight[t.index()],
                    evictions: self.evictions[t.index()].load(Relaxed),
                }
            })
            .collect();
        StatsSnapshot {
            recovery: std::array::from_fn(|i| self.recovery[i].load(Relaxed)),
            lookups: self.lookups.load(Relaxed),
            looked_up_pages: self.looked_up_pages.load(Relaxed),
            hit_pages: TierKind::ALL.map(|t| self.hit_pages[t.index()].load(Relaxed)),
            miss_pages: self.miss_pages.load(Relaxed),
            moved,
            copy_latency,
            lookup_latency: self.lookup_time.latency(),
            hints,
            tiers,
            pages: dir.pages,
            open_grants,
            leased_pages,
            deferred_hints,
            event_seq: dir.event_seq,
            upkeep_ticks: self.ticks.load(Relaxed),
        }
    }
}

/// The directory's O(1) counters, read under its read lock.
pub(crate) struct DirCounts {
    pub pages: u64,
    pub complete: [u64; 3],
    pub inflight: [u64; 3],
    pub event_seq: u64,
}

/// What a snapshot needs from the manager's tables, each read on its own.
pub(crate) struct TableCounts<'a> {
    pub dir: DirCounts,
    pub open_grants: u64,
    pub leased_pages: u64,
    pub pinned: [u64; 3],
    pub deferred_hints: u64,
    pub device_pages: u64,
    pub arena: Option<&'a HostArena>,
    pub pool: Option<PoolUsage>,
}

impl super::Manager {
    /// Counters and tier usage. Each table is read on its own, O(1) under its lock, so a
    /// render never holds a lock that lookups need across a walk.
    pub fn stats(&self) -> StatsSnapshot {
        let dir = {
            let st = self.read();
            DirCounts {
                pages: st.dir.len() as u64,
                complete: TierKind::ALL.map(|t| st.dir.complete_count(t) as u64),
                inflight: TierKind::ALL.map(|t| st.dir.objects().inflight_pages(t) as u64),
                event_seq: st.dir.last_seq(),
            }
        };
        let (open_grants, leased_pages) = {
            let g = self.grants();
            (g.grants.len() as u64, g.leased_pages() as u64)
        };
        let pinned = {
            let t = self.inner.upkeep.timers();
            TierKind::ALL.map(|tier| t.pins_in(tier) as u64)
        };
        let deferred_hints = self.inner.queues.lock().deferred_len() as u64;
        let device_pages = self.inner.devices.pages().values().sum::<usize>() as u64;
        let arena = self.stores().arena();
        let pool = self.stores().pool().map(|p| p.usage());
        self.inner.stats.snapshot(TableCounts {
            dir,
            open_grants,
            leased_pages,
            pinned,
            deferred_hints,
            device_pages,
            arena: arena.as_deref(),
            pool,
        })
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct MovedBytes {
    pub from: TierKind,
    pub to: TierKind,
    pub bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct HintCount {
    pub kind: HintKind,
    pub outcome: &'static str,
    pub count: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct TierStats {
    pub tier: TierKind,
    /// What `capacity` and `used` count: bytes, or device pages.
    pub unit: &'static str,
    pub capacity: u64,
    pub used: u64,
    pub complete_pages: u64,
    pub pinned_pages: u64,
    /// Pages with objects being written into the tier.
    pub inflight_pages: u64,
    pub evictions: u64,
}

/// Copy latency between two tiers: counts per bucket of [`COPY_BUCKETS_S`] (not
/// cumulative; one more for `+Inf`), their total and the sum of latencies.
#[derive(Clone, Debug, Serialize)]
pub struct CopyLatency {
    pub from: TierKind,
    pub to: TierKind,
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_s: f64,
}

/// A latency histogram's counts per bucket (not cumulative; one more for `+Inf`), their
/// total and the sum of latencies, in nanoseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Latency {
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
}

/// A point-in-time view of the manager's counters and tiers.
#[derive(Clone, Debug, Serialize)]
pub struct StatsSnapshot {
    pub lookups: u64,
    pub looked_up_pages: u64,
    /// Pages credited to device, host, pool.
    pub hit_pages: [u64; 3],
    pub miss_pages: u64,
    pub moved: Vec<MovedBytes>,
    /// Copy latency per tier pair (from ≠ to).
    pub copy_latency: Vec<CopyLatency>,
    /// How long the daemon took to answer lookups, from reading the request to its answer
    /// ready to write ([`LOOKUP_BUCKETS_S`]): the directory, the pool index or the master's
    /// query, and, for a lookup sent to a blocking thread, the hand-off. Lookups of an
    /// embedding process (no daemon) are not timed.
    pub lookup_latency: Latency,
    pub hints: Vec<HintCount>,
    pub tiers: Vec<TierStats>,
    pub pages: u64,
    pub open_grants: u64,
    pub leased_pages: u64,
    pub deferred_hints: u64,
    pub event_seq: u64,
    /// Upkeep runs finished (each expires pins, takes the session policy's step and evicts
    /// by watermark). Two more than a count read after a change include a whole run that
    /// started after it.
    pub upkeep_ticks: u64,
    /// Start-up recovery counts, in [`RECOVERY_REASONS`] order.
    pub recovery: [u64; RECOVERY_REASONS.len()],
}

impl StatsSnapshot {
    pub fn moved_bytes(&self, from: TierKind, to: TierKind) -> u64 {
        self.moved
            .iter()
            .find(|m| m.from == from && m.to == to)
            .map_or(0, |m| m.bytes)
    }

    pub fn tier(&self, t: TierKind) -> &TierStats {
        &self.tiers[t.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_lands_in_the_first_bucket_whose_bound_holds_it() {
        let s = Stats::default();
        for us in [3, 5, 7, 150, 2_000_000] {
            s.lookup_served(Duration::from_micros(us));
        }
        let l = s.lookup_time.latency();
        // ≤ 5 µs: 3 and 5; ≤ 10 µs: 7; ≤ 200 µs: 150; past 1 s: the +Inf bucket.
        assert_eq!(l.buckets, [2, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(l.count, 5);
        assert_eq!(l.sum_ns, (3 + 5 + 7 + 150 + 2_000_000) * 1_000);
        // The copy histograms keep their own bounds.
        s.copied(TierKind::Host, TierKind::Pool, Duration::from_micros(7));
        assert_eq!(
            s.copies[TierKind::Host.index()][TierKind::Pool.index()]
                .latency()
                .buckets[0],
            1
        );
    }
}
