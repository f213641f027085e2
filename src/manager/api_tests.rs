//! The manager's API at its edges: typed errors for bad input, grants of dead owners
//! reclaimed, whole-object writes, write policies, hints deferred by a full transfer
//! queue, copy timings per tier pair, and advice taken per namespace within a budget.

use std::time::Duration;

use super::tests::{WAIT, fixture, hashes};
use super::*;
use crate::clock::SimClock;
use crate::hints::{Hint, HintOutcome, HintTarget, Reason};
use crate::layout::LayoutSpec;
use crate::tier::device::pattern;

#[test]
fn bad_input_gets_typed_errors() {
    let f = fixture(1, 16, None);
    let hs = hashes(0..2);
    f.store_all(&hs, &[0, 1]);
    let big = hashes(0..257);
    assert!(matches!(
        f.m.lookup(f.ns, &big),
        Err(ManagerError::BatchTooLarge { got: 257, max: 256 })
    ));
    assert!(matches!(
        f.m.begin_store(f.ns, 0, 0, &big, 0, 1),
        Err(ManagerError::BatchTooLarge { .. })
    ));
    let unknown = Hint::Share {
        target: HintTarget::Pages(hashes(500..503)),
    };
    // Soft: naming only unknown pages is an outcome, not an error.
    assert_eq!(
        f.m.hint(f.ns, unknown).unwrap(),
        HintOutcome::Ignored {
            reason: Reason::UnknownPages
        }
    );
    let empty = Hint::Share {
        target: HintTarget::Pages(vec![]),
    };
    assert!(matches!(
        f.m.hint(f.ns, empty),
        Err(ManagerError::Hint(HintError::Empty))
    ));
    let bad_tier = Hint::Demote {
        target: HintTarget::Pages(hs.clone()),
        to: TierKind::Device,
    };
    assert!(matches!(
        f.m.hint(f.ns, bad_tier),
        Err(ManagerError::Hint(HintError::BadTier { .. }))
    ));
    let wrong = [0u8; 100];
    let r = f.m.put_objects(f.ns, &[(PageHash::from_u64(9), vec![(0, &wrong[..])])]);
    assert!(matches!(r, Err(ManagerError::ObjectSize { got: 100, .. })));
    assert!(matches!(
        f.m.store(f.ns, 0, 0, &hs, &[0], 0),
        Err(ManagerError::LengthMismatch { .. })
    ));
    assert!(matches!(
        f.m.store(f.ns, 3, 0, &hs, &[0, 1], 0),
        Err(ManagerError::NoDevice { .. })
    ));
    assert!(matches!(
        f.m.commit_store(999, &[true]),
        Err(ManagerError::UnknownGrant(999))
    ));
    assert!(matches!(
        f.m.lookup(NamespaceId(7), &hs),
        Err(ManagerError::Directory(_))
    ));
    // A hint naming some unknown pages is clipped, not an error.
    let mixed = Hint::Retain {
        target: HintTarget::Pages(vec![hs[0], PageHash::from_u64(77)]),
        priority: 1,
        ttl_ms: 10,
    };
    assert_eq!(
        f.m.hint(f.ns, mixed).unwrap(),
        HintOutcome::Clipped {
            applied: 1,
            requested: 2,
            reason: Reason::UnknownPages
        }
    );
}

#[test]
fn dead_owner_grants_are_reclaimed() {
    let f = fixture(2, 16, None);
    let arena = f.m.stores().arena().unwrap();
    let hs = hashes(0..4);
    let g = f.m.begin_store(f.ns, 0, 0, &hs, 0, 77).unwrap();
    assert_eq!(
        g.pages
            .iter()
            .filter(|p| p.status == engine::StoreStatus::Write)
            .count(),
        4
    );
    assert_eq!(arena.used(), 8);
    assert_eq!(f.m.release_owner(77), 1);
    assert_eq!(arena.used(), 0);
    assert_eq!(f.m.lookup(f.ns, &hs).unwrap().host, 0);
}

#[test]
fn put_objects_writes_whole_pages_and_reads_back() {
    let f = fixture(1, 16, None);
    let layout = f.m.pages().layout(f.ns).unwrap();
    let h = PageHash::from_u64(5);
    let k = pattern(1, layout.object_bytes(0) as usize);
    let v = pattern(2, layout.object_bytes(1) as usize);
    assert_eq!(
        f.m.put_objects(f.ns, &[(h, vec![(0, &k[..]), (1, &v[..])])]).unwrap(),
        1
    );
    let mut buf = vec![0u8; k.len()];
    assert!(f.m.read_host_object(f.ns, &h, 1, &mut buf).unwrap());
    assert_eq!(buf, v);
    assert!(!f.m.read_host_object(f.ns, &PageHash::from_u64(6), 1, &mut buf).unwrap());
}

#[test]
fn write_policies_decide_when_host_pages_reach_the_pool() {
    use crate::policy::WritePolicy;
    for (policy, after_store, after_hits) in [
        (WritePolicy::WriteThrough, true, true),
        (WritePolicy::WriteThroughSelective { hits: 2 }, false, true),
        (WritePolicy::WriteBack, false, false),
    ] {
        let f = fixture(1, 16, Some(16));
        let mut t = f.m.tunables();
        t.host_to_pool = policy;
        f.m.set_tunables(t).unwrap();
        let hs = hashes(0..2);
        f.store_all(&hs, &[0, 1]);
        f.m.quiesce(WAIT);
        assert_eq!(f.status(&hs[0], TierKind::Pool), after_store, "{policy:?} after store");
        for _ in 0..2 {
            let t = f.m.load(f.ns, 0, 0, &hs[..1], &[5], LoadWait::BestEffort).unwrap();
            assert_eq!(f.m.wait(t, WAIT).unwrap().pages, 1);
        }
        f.m.quiesce(WAIT);
        assert_eq!(
            f.status(&hs[0], TierKind::Pool),
            after_hits,
            "{policy:?} after two hits"
        );
        // Write-back: the pool copy is made when host evicts the page.
        f.m.removed(f.ns, 0, 0, &hs).unwrap();
        f.m.mover().make_host_room(usize::MAX);
        assert!(
            f.status(&hs[0], TierKind::Pool) && f.status(&hs[1], TierKind::Pool),
            "{policy:?} on eviction"
        );
    }
}

#[test]
fn a_full_transfer_queue_defers_a_hint_and_tick_applies_it_later() {
    let dir = tempfile::tempdir().unwrap();
    let layout = LayoutSpec::mha(4, 2, 32, 2, 16).build().unwrap();
    let page = layout.page_bytes();
    let mut cfg = ManagerConfig::in_dir(dir.path(), 16 * page, Some(16 * page));
    cfg.arena.lock = false;
    cfg.transfer_threads = 1;
    cfg.transfer_queue = 1;
    let m = Manager::new(cfg, SimClock::new()).unwrap();
    let ns = m.register_namespace(Namespace::model("q"), layout.clone()).unwrap();
    let hs = hashes(0..2);
    let k = pattern(1, layout.object_bytes(0) as usize);
    for h in &hs {
        m.put_objects(ns, &[(*h, vec![(0, &k[..]), (1, &k[..])])]).unwrap();
    }
    // Occupy the only worker and the only queue place: the second job is queued once the
    // worker has taken the first (it says so), however long a loaded machine takes.
    let (tx, rx) = crossbeam_channel::bounded::<()>(0);
    let rx2 = rx.clone();
    let (started_tx, started) = crossbeam_channel::bounded::<()>(1);
    assert!(
        m.inner
            .xfer
            .try_submit(Box::new(move || {
                let _ = started_tx.send(());
                let _ = rx.recv();
            }))
            .is_ok()
    );
    started
        .recv_timeout(Duration::from_secs(30))
        .expect("the worker took the first job");
    assert!(
        m.inner
            .xfer
            .try_submit(Box::new(move || {
                let _ = rx2.recv();
            }))
            .is_ok()
    );
    let out = m
        .hint(
            ns,
            Hint::Share {
                target: HintTarget::Pages(hs.clone()),
            },
        )
        .unwrap();
    assert_eq!(
        out,
        HintOutcome::Deferred {
            pages: 2,
            reason: Reason::QueueFull
        }
    );
    assert_eq!(m.stats().deferred_hints, 1);
    drop(tx);
    assert!(m.quiesce(WAIT));
    m.tick().unwrap();
    assert!(m.quiesce(WAIT));
    assert_eq!(m.stats().deferred_hints, 0);
    let st = m.page_status(ns, &hs[1]).unwrap().unwrap();
    assert!(st.tiers[TierKind::Pool.index()].complete, "the deferred share ran");
}

#[test]
fn copies_are_timed_per_tier_pair() {
    let f = fixture(1, 32, Some(32));
    let hs = hashes(0..4);
    f.store_all(&hs, &[0, 1, 2, 3]);
    let demote = Hint::Demote {
        target: HintTarget::Pages(hs.clone()),
        to: TierKind::Pool,
    };
    assert_eq!(f.m.hint(f.ns, demote).unwrap(), HintOutcome::Accepted { pages: 4 });
    let s = f.m.stats();
    let count = |from, to| {
        let c = s.copy_latency.iter().find(|c| c.from == from && c.to == to).unwrap();
        assert_eq!(c.buckets.iter().sum::<u64>(), c.count);
        assert_eq!(c.buckets.len(), COPY_BUCKETS_S.len() + 1);
        c.count
    };
    // One timed copy per page stored from device, one per batch written to the pool.
    assert_eq!(count(TierKind::Device, TierKind::Host), 4);
    assert_eq!(count(TierKind::Host, TierKind::Pool), 1);
    assert_eq!(count(TierKind::Pool, TierKind::Host), 0);
    assert_eq!(s.copy_latency.len(), 6);
}

#[test]
fn advice_is_taken_per_namespace_within_a_page_budget() {
    let f = fixture(1, 8, None);
    let other = NamespaceId(f.ns.0 + 1);
    let hs = hashes(0..5);
    {
        let mut st = f.m.inner.queues.lock();
        st.push_advice(Advice::EvictFirst {
            ns: f.ns,
            hashes: hs[..3].to_vec(),
        });
        st.push_advice(Advice::Offload {
            ns: other,
            hashes: hs[..1].to_vec(),
        });
        st.push_advice(Advice::ReadyToLoad {
            ns: f.ns,
            hashes: hs[3..].to_vec(),
        });
    }
    // Two pages: the first entry is split, its rest stays first in line.
    let (got, more) = f.m.engine_queues().take_advice_for(f.ns, 2);
    assert_eq!(
        (got, more),
        (
            vec![Advice::EvictFirst {
                ns: f.ns,
                hashes: hs[..2].to_vec()
            }],
            true
        )
    );
    let (got, more) = f.m.engine_queues().take_advice_for(f.ns, 100);
    assert_eq!(
        (got, more),
        (
            vec![
                Advice::EvictFirst {
                    ns: f.ns,
                    hashes: hs[2..3].to_vec()
                },
                Advice::ReadyToLoad {
                    ns: f.ns,
                    hashes: hs[3..].to_vec()
                }
            ],
            false
        )
    );
    assert_eq!(f.m.engine_queues().take_advice_for(f.ns, 100), (vec![], false));
    // The other namespace's advice was left alone.
    assert_eq!(
        f.m.engine_queues().take_advice(),
        vec![Advice::Offload {
            ns: other,
            hashes: hs[..1].to_vec()
        }]
    );
}
