use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::clock::SimClock;
use crate::events::PageEventKind;
use crate::hints::{Hint, HintOutcome, HintTarget, Reason};
use crate::layout::LayoutSpec;
use crate::tier::device::{EmulatedDevice, ObjectCopy};

pub(super) const WAIT: Duration = Duration::from_secs(10);

pub(super) struct Fixture {
    _dir: tempfile::TempDir,
    pub(super) m: Manager,
    pub(super) ns: NamespaceId,
    pub(super) clock: Arc<SimClock>,
    pub(super) devs: Vec<Arc<EmulatedDevice>>,
}

/// TP=`tp` ranks of a small MHA layout (4 layers, 16-token pages, objects of 4 KiB),
/// each with an emulated device of 64 pages.
pub(super) fn fixture(tp: u16, host_pages: u64, pool_pages: Option<u64>) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let layout = LayoutSpec::mha(4, 2 * tp as u32, 32, 2, 16)
        .with_parallel(tp, 1)
        .build()
        .unwrap();
    let page = layout.page_bytes();
    let mut cfg = ManagerConfig::in_dir(dir.path(), host_pages * page, pool_pages.map(|p| p * page));
    cfg.arena.lock = false;
    cfg.max_batch = 256;
    let clock = SimClock::new();
    let m = Manager::new(cfg, clock.clone()).unwrap();
    let ns = m.register_namespace(Namespace::model("test"), layout.clone()).unwrap();
    let devs: Vec<Arc<EmulatedDevice>> = (0..tp).map(|_| Arc::new(EmulatedDevice::new(&layout, 0, 64))).collect();
    for (r, d) in devs.iter().enumerate() {
        m.attach_device(ns, r as u16, 0, d.clone()).unwrap();
    }
    Fixture {
        _dir: dir,
        m,
        ns,
        clock,
        devs,
    }
}

pub(super) fn hashes(range: std::ops::Range<u64>) -> Vec<PageHash> {
    range.map(|i| PageHash::from_u64(0x1000 + i)).collect()
}

impl Fixture {
    /// Every rank writes known bytes into device pages `slots` and stores them.
    pub(super) fn store_all(&self, hs: &[PageHash], slots: &[u32]) {
        for (r, d) in self.devs.iter().enumerate() {
            for (h, &s) in hs.iter().zip(slots) {
                d.fill_page(s, h.prefix_u64() ^ r as u64).unwrap();
            }
            let t = self.m.store(self.ns, r as u16, 0, hs, slots, 0).unwrap();
            let res = self.m.wait(t, WAIT).unwrap();
            assert_eq!(res.error, None);
            assert_eq!(res.pages, hs.len(), "rank {r} stored everything");
        }
    }

    pub(super) fn status(&self, h: &PageHash, tier: TierKind) -> bool {
        self.m
            .page_status(self.ns, h)
            .unwrap()
            .is_some_and(|s| s.tiers[tier.index()].complete)
    }
}

#[test]
fn bytes_survive_device_host_pool_and_back_by_content() {
    let f = fixture(2, 32, Some(64));
    let hs = hashes(0..8);
    let slots: Vec<u32> = (0..8).collect();
    f.store_all(&hs, &slots);
    assert_eq!(f.m.lookup(f.ns, &hs).unwrap().device, 8);
    // Drop the device copies: host now serves the prefix.
    for r in 0..2 {
        f.m.removed(f.ns, r, 0, &hs).unwrap();
    }
    assert_eq!(
        f.m.lookup(f.ns, &hs).unwrap(),
        PrefixHit {
            device: 0,
            host: 8,
            pool: 0
        }
    );
    // Host → pool (Share), then drop host by demoting and evicting.
    let out =
        f.m.hint(
            f.ns,
            Hint::Share {
                target: HintTarget::Prefix(hs.clone()),
            },
        )
        .unwrap();
    assert_eq!(out, HintOutcome::Accepted { pages: 8 });
    f.m.quiesce(WAIT);
    assert!(hs.iter().all(|h| f.status(h, TierKind::Pool)));
    f.m.mover().make_host_room(usize::MAX);
    assert_eq!(
        f.m.lookup(f.ns, &hs).unwrap(),
        PrefixHit {
            device: 0,
            host: 0,
            pool: 8
        }
    );
    // Pool → host → device, into other device slots, and check every byte.
    let back: Vec<u32> = (20..28).collect();
    for (r, d) in f.devs.iter().enumerate() {
        let t = f.m.load(f.ns, r as u16, 0, &hs, &back, LoadWait::WaitComplete).unwrap();
        let res = f.m.wait(t, WAIT).unwrap();
        assert_eq!((res.pages, res.failed), (8, 0));
        for (h, &s) in hs.iter().zip(&back) {
            assert!(
                d.page_matches(s, h.prefix_u64() ^ r as u64).unwrap(),
                "rank {r} page {h}"
            );
            assert!(!d.page_matches(s, h.prefix_u64() ^ 7).unwrap());
        }
    }
    let st = f.m.stats();
    assert!(st.moved_bytes(TierKind::Device, TierKind::Host) > 0);
    assert!(st.moved_bytes(TierKind::Host, TierKind::Pool) > 0);
    assert!(st.moved_bytes(TierKind::Pool, TierKind::Host) > 0);
    assert!(st.moved_bytes(TierKind::Host, TierKind::Device) > 0);
}

#[test]
fn page_is_complete_only_when_every_rank_stored() {
    let f = fixture(2, 32, None);
    let hs = hashes(0..3);
    f.devs[0].fill_page(0, 1).unwrap();
    let t = f.m.store(f.ns, 0, 0, &hs[..1], &[0], 0).unwrap();
    f.m.wait(t, WAIT).unwrap();
    assert_eq!(f.m.lookup(f.ns, &hs).unwrap().total(), 0, "rank 1 has not stored");
    let st = f.m.page_status(f.ns, &hs[0]).unwrap().unwrap();
    assert_eq!(st.tiers[TierKind::Host.index()].missing, vec![2, 3]);
    assert_eq!(f.m.pages().events().last_seq(), 0, "no event for a partial page");
    let t = f.m.store(f.ns, 1, 0, &hs[..1], &[0], 0).unwrap();
    f.m.wait(t, WAIT).unwrap();
    assert_eq!(
        f.m.lookup(f.ns, &hs).unwrap(),
        PrefixHit {
            device: 1,
            host: 0,
            pool: 0
        }
    );
    let evs = f.m.pages().events().read_from(1, 10, Duration::ZERO).events;
    let kinds: Vec<_> = evs.iter().map(|e| (e.kind, e.tier)).collect();
    assert_eq!(
        kinds,
        vec![
            (PageEventKind::Stored, TierKind::Device),
            (PageEventKind::Stored, TierKind::Host)
        ]
    );
}

#[test]
fn failed_device_copy_leaves_source_and_frees_slots() {
    struct Broken;
    impl crate::tier::device::DeviceRegion for Broken {
        fn kind(&self) -> &'static str {
            "broken"
        }
        fn pages(&self) -> u32 {
            64
        }
        fn object_bytes(&self) -> usize {
            4 * 16 * 2 * 32 * 2
        }
        fn copy_to_host(&self, _: &mut [ObjectCopy<&mut [u8]>]) -> Result<(), DeviceError> {
            Err(DeviceError::Copy("injected".into()))
        }
        fn copy_from_host(&self, _: &[ObjectCopy<&[u8]>]) -> Result<(), DeviceError> {
            Err(DeviceError::Copy("injected".into()))
        }
    }
    let f = fixture(1, 32, None);
    let arena = f.m.stores().arena().unwrap();
    let hs = hashes(0..4);
    f.store_all(&hs, &[0, 1, 2, 3]);
    let used = arena.used();
    f.m.attach_device(f.ns, 0, 0, Arc::new(Broken)).unwrap();
    let more = hashes(4..8);
    let t = f.m.store(f.ns, 0, 0, &more, &[4, 5, 6, 7], 0).unwrap();
    let res = f.m.wait(t, WAIT).unwrap();
    assert_eq!((res.pages, res.failed), (0, 4));
    assert_eq!(arena.used(), used, "destination slots freed");
    assert_eq!(f.m.lookup(f.ns, &more).unwrap().host, 0);
    assert_eq!(f.m.open_grants(), 0);
    // A failed load leaves the host copy intact and reports nothing loaded.
    f.m.removed(f.ns, 0, 0, &hs).unwrap();
    let t =
        f.m.load(f.ns, 0, 0, &hs, &[9, 10, 11, 12], LoadWait::BestEffort)
            .unwrap();
    assert_eq!(f.m.wait(t, WAIT).unwrap().pages, 0);
    assert_eq!(f.m.lookup(f.ns, &hs).unwrap().host, 4);
}

#[test]
fn eviction_keeps_utilisation_between_target_and_high_and_spares_pinned_and_inflight() {
    let f = fixture(1, 100, None);
    let arena = f.m.stores().arena().unwrap();
    assert_eq!(arena.slots(), 200); // 2 objects a page
    // Pin the first 10 pages of host, hold 5 more in flight.
    let first = hashes(0..60);
    f.store_all(&first, &(0..60).collect::<Vec<_>>());
    f.m.removed(f.ns, 0, 0, &first).unwrap();
    let pinned = &first[..10];
    let out =
        f.m.hint(
            f.ns,
            Hint::Pin {
                target: HintTarget::Pages(pinned.to_vec()),
                tier: TierKind::Host,
                ttl_ms: 60_000,
            },
        )
        .unwrap();
    assert_eq!(out, HintOutcome::Accepted { pages: 10 });
    let inflight = hashes(1000..1005);
    let g = f.m.begin_store(f.ns, 0, 0, &inflight, 0, 42).unwrap();
    // Fill host past the high watermark (≥ 95 of 100 pages).
    let rest = hashes(100..132);
    f.store_all(&rest, &(0..32).collect::<Vec<_>>());
    let used = arena.used() as f64 / arena.slots() as f64;
    assert!(used >= 0.95, "filled to {used}");
    f.m.tick().unwrap();
    let used = arena.used() as f64 / arena.slots() as f64;
    assert!((0.75..=0.80).contains(&used), "after eviction utilisation is {used}");
    for h in pinned {
        assert!(f.status(h, TierKind::Host), "pinned page {h} survived");
    }
    // The in-flight pages still have their slots and commit fine.
    assert_eq!(f.m.commit_store(g.id, &[true; 5]).unwrap(), 5);
    assert!(inflight.iter().all(|h| f.status(h, TierKind::Host)));
    // Below the high watermark nothing more is evicted (hysteresis).
    let before = arena.used();
    f.m.tick().unwrap();
    assert_eq!(arena.used(), before);
}

#[test]
fn pins_are_bounded_by_budget_and_expire_at_ttl() {
    let f = fixture(1, 40, None);
    let hs = hashes(0..20);
    f.store_all(&hs, &(0..20).collect::<Vec<_>>());
    // Budget: 25% of 40 host pages = 10.
    let out =
        f.m.hint(
            f.ns,
            Hint::Pin {
                target: HintTarget::Pages(hs.clone()),
                tier: TierKind::Host,
                ttl_ms: 1000,
            },
        )
        .unwrap();
    assert_eq!(
        out,
        HintOutcome::Clipped {
            applied: 10,
            requested: 20,
            reason: Reason::PinBudget
        }
    );
    assert_eq!(f.m.stats().tier(TierKind::Host).pinned_pages, 10);
    // TTL above the maximum is clipped.
    let mut t = f.m.tunables();
    t.max_pin_ttl_ms = 500;
    f.m.set_tunables(t).unwrap();
    let out =
        f.m.hint(
            f.ns,
            Hint::Retain {
                target: HintTarget::Pages(hs[..2].to_vec()),
                priority: 5,
                ttl_ms: 900,
            },
        )
        .unwrap();
    assert_eq!(
        out,
        HintOutcome::Clipped {
            applied: 2,
            requested: 2,
            reason: Reason::MaxTtl
        }
    );
    f.clock.advance(999);
    f.m.tick().unwrap();
    assert_eq!(f.m.stats().tier(TierKind::Host).pinned_pages, 10, "not yet expired");
    assert_eq!(
        f.m.page_status(f.ns, &hs[0]).unwrap().unwrap().retain,
        0,
        "retain expired at its clipped TTL"
    );
    f.clock.advance(1);
    f.m.tick().unwrap();
    assert_eq!(f.m.stats().tier(TierKind::Host).pinned_pages, 0, "expired at 1000 ms");
}

#[test]
fn demote_and_share_move_pages_to_the_right_tier() {
    let f = fixture(1, 32, Some(32));
    let hs = hashes(0..4);
    f.store_all(&hs, &[0, 1, 2, 3]);
    // Demote device → host: pages have a host copy, so the engine is told to evict them.
    let out =
        f.m.hint(
            f.ns,
            Hint::Demote {
                target: HintTarget::Pages(hs.clone()),
                to: TierKind::Host,
            },
        )
        .unwrap();
    assert_eq!(out, HintOutcome::Accepted { pages: 4 });
    assert!(f.m.engine_queues().take_advice().contains(&Advice::EvictFirst {
        ns: f.ns,
        hashes: hs.clone()
    }));
    // Demote host → pool: a complete pool copy exists afterwards.
    let out =
        f.m.hint(
            f.ns,
            Hint::Demote {
                target: HintTarget::Pages(hs[..2].to_vec()),
                to: TierKind::Pool,
            },
        )
        .unwrap();
    assert_eq!(out, HintOutcome::Accepted { pages: 2 });
    assert!(f.status(&hs[0], TierKind::Pool) && f.status(&hs[1], TierKind::Pool));
    assert!(!f.status(&hs[2], TierKind::Pool));
    // Share the rest.
    let out =
        f.m.hint(
            f.ns,
            Hint::Share {
                target: HintTarget::Pages(hs[2..].to_vec()),
            },
        )
        .unwrap();
    assert_eq!(out, HintOutcome::Accepted { pages: 2 });
    f.m.quiesce(WAIT);
    assert!(hs.iter().all(|h| f.status(h, TierKind::Pool)));
    // Demoted pages are evicted from host first.
    f.m.mover().make_host_room(1);
    assert!(!f.status(&hs[0], TierKind::Host) || !f.status(&hs[1], TierKind::Host));
    assert!(f.status(&hs[2], TierKind::Host) && f.status(&hs[3], TierKind::Host));
    // Prefetch back to device: staged in host, engine told it is ready.
    f.m.mover().make_host_room(usize::MAX);
    let out =
        f.m.hint(
            f.ns,
            Hint::Prefetch {
                target: HintTarget::Pages(hs.clone()),
                to: TierKind::Device,
                deadline_ms: None,
            },
        )
        .unwrap();
    assert_eq!(out, HintOutcome::Accepted { pages: 4 });
    assert!(hs.iter().all(|h| f.status(h, TierKind::Host)));
    assert!(f.m.engine_queues().take_advice().contains(&Advice::ReadyToLoad {
        ns: f.ns,
        hashes: hs.clone()
    }));
}

#[test]
fn prefetch_stages_every_named_pool_page_past_gaps_in_one_call() {
    // More pages than one pool batch (64), so staging runs batch after batch.
    let f = fixture(1, 256, Some(256));
    let hs = hashes(0..100);
    let slots: Vec<u32> = (0..100).map(|i| i % 64).collect();
    for (h, s) in hs[..90].chunks(45).zip(slots.chunks(45)) {
        f.store_all(h, s);
    }
    let out =
        f.m.hint(
            f.ns,
            Hint::Share {
                target: HintTarget::Pages(hs[..90].to_vec()),
            },
        )
        .unwrap();
    assert_eq!(out, HintOutcome::Accepted { pages: 90 });
    assert!(f.m.quiesce(WAIT));
    // Drop the host copies of the shared pages; pages 90.. go to host only.
    f.m.removed(f.ns, 0, 0, &hs[..90]).unwrap();
    f.m.mover().make_host_room(usize::MAX);
    assert_eq!(f.m.lookup(f.ns, &hs[..90]).unwrap().host, 0);
    f.store_all(&hs[90..], &slots[90..]);
    assert!(hs[90..].iter().all(|h| f.status(h, TierKind::Host)));
    // The named pages: an unknown hash first, a host-only page, then pool pages.
    let mut named = vec![PageHash::from_u64(0xdead_beef), hs[95]];
    named.extend_from_slice(&hs[..90]);
    let out =
        f.m.hint(
            f.ns,
            Hint::Prefetch {
                target: HintTarget::Pages(named),
                to: TierKind::Host,
                deadline_ms: None,
            },
        )
        .unwrap();
    // 91 known pages are on host now; the unknown one is clipped.
    assert_eq!(
        out,
        HintOutcome::Clipped {
            applied: 91,
            requested: 92,
            reason: Reason::NotComplete
        }
    );
    assert!(hs.iter().all(|h| f.status(h, TierKind::Host)));
    // And the staged bytes are the stored bytes.
    for (i, h) in hs[..90].iter().enumerate().step_by(17) {
        let t =
            f.m.load(f.ns, 0, 0, std::slice::from_ref(h), &[63], LoadWait::WaitComplete)
                .unwrap();
        assert_eq!(f.m.wait(t, WAIT).unwrap().pages, 1);
        assert!(f.devs[0].page_matches(63, h.prefix_u64()).unwrap(), "page {i}");
    }
}
