//! Grants are released by ownership: a grant taken out of the table to be settled
//! ([`super::grants::Settling`]) gives back, when it drops, every page it did not settle,
//! so an error or early return in the middle of `commit_store` or `finish_load` leaks no
//! host slot, in-flight mark or lease.

use super::engine::{LoadWait, StoreStatus};
use super::grants::Leases;
use super::tests::{fixture, hashes};
use super::*;

fn host_inflight(s: &PageStatus) -> Vec<usize> {
    let host = s.tiers.iter().find(|t| t.tier == TierKind::Host).unwrap();
    host.inflight.clone()
}

#[test]
fn a_store_grant_dropped_mid_settle_frees_the_pages_it_did_not_settle() {
    let f = fixture(1, 16, None);
    let arena = f.m.stores().arena().unwrap();
    let hs = hashes(0..3);
    let g = f.m.begin_store(f.ns, 0, 0, &hs, 0, 1).unwrap();
    assert!(g.pages.iter().all(|p| p.status == StoreStatus::Write));
    let per_page = g.pages[0].objects.len();
    assert!(per_page > 0);
    assert_eq!(arena.used() as usize, 3 * per_page);
    {
        let mut s = f.m.grants().take(&f.m, g.id, |_| Ok(())).unwrap();
        // The settle dealt with the first page, then returned early (an error path).
        s.settle(1);
    }
    assert_eq!(f.m.open_grants(), 0, "the grant left the table");
    assert_eq!(
        arena.used() as usize,
        per_page,
        "the two unsettled pages' slots are free; the settled one's are the settle's"
    );
    for h in &hs[1..] {
        let inflight = f.m.page_status(f.ns, h).unwrap().map(|s| host_inflight(&s));
        assert!(
            inflight.as_ref().is_none_or(|o| o.is_empty()),
            "page {h:?} still in flight on host: {inflight:?}"
        );
    }
    // The guard did not touch the settled page: its marks are still the settle's.
    let first = f.m.page_status(f.ns, &hs[0]).unwrap().unwrap();
    assert_eq!(host_inflight(&first).len(), per_page);
    assert_eq!(f.m.lookup(f.ns, &hs).unwrap().host, 0);
}

#[test]
fn a_load_grant_dropped_mid_settle_gives_back_the_leases_it_did_not_settle() {
    let f = fixture(1, 16, None);
    let hs = hashes(0..3);
    f.store_all(&hs, &[0, 1, 2]);
    let g = f.m.begin_load(f.ns, 0, 0, &hs, LoadWait::BestEffort, 1).unwrap();
    assert_eq!(g.pages.len(), 3);
    assert_eq!(f.m.grants().lease_count(), 3);
    {
        let mut s = f.m.grants().take(&f.m, g.id, |_| Ok(())).unwrap();
        s.settle(1);
    }
    assert_eq!(f.m.open_grants(), 0);
    assert_eq!(
        f.m.grants().lease_count(),
        1,
        "only the settled page's lease is left (the settle's to give back)"
    );
    // A whole grant dropped unsettled gives back every lease.
    let g = f.m.begin_load(f.ns, 0, 0, &hs, LoadWait::BestEffort, 1).unwrap();
    assert_eq!(f.m.grants().lease_count(), 4);
    let s = f.m.grants().take(&f.m, g.id, |_| Ok(())).unwrap();
    drop(s);
    assert_eq!(f.m.grants().lease_count(), 1);
}

#[test]
fn a_refused_settle_leaves_the_grant_open_and_its_slots_held() {
    let f = fixture(1, 16, None);
    let arena = f.m.stores().arena().unwrap();
    let hs = hashes(0..2);
    let g = f.m.begin_store(f.ns, 0, 0, &hs, 0, 1).unwrap();
    let used = arena.used();
    assert!(matches!(
        f.m.commit_store(g.id, &[true]),
        Err(ManagerError::GrantMismatch { pages: 2, got: 1, .. })
    ));
    assert!(matches!(f.m.finish_load(g.id, 0), Err(ManagerError::UnknownGrant(_))));
    assert_eq!((f.m.open_grants(), arena.used()), (1, used));
    assert_eq!(f.m.commit_store(g.id, &[true, false]).unwrap(), 1);
    assert_eq!(f.m.open_grants(), 0);
    assert_eq!(arena.used() as usize, g.pages[0].objects.len());
    assert!(f.status(&hs[0], TierKind::Host) && !f.status(&hs[1], TierKind::Host));
}

#[test]
fn leases_dropped_before_their_settle_are_given_back() {
    let f = fixture(1, 16, None);
    let hs = hashes(0..2);
    f.store_all(&hs, &[0, 1]);
    let ids: Vec<_> = hs.iter().map(|h| f.m.read().dir.find(f.ns, h).unwrap()).collect();
    let take_all = || {
        let mut l = Leases::new(&f.m.inner.grants);
        let mut gt = f.m.grants();
        for &id in &ids {
            l.take(&mut gt, id);
        }
        l
    };
    let l = take_all();
    assert_eq!(f.m.grants().lease_count(), 2);
    // A pool write that never reaches its settle (a panic, an early return).
    drop(l);
    assert_eq!(f.m.grants().lease_count(), 0);
    // The settle gives each back under its own lock, in order, before looking at it.
    let l = take_all();
    f.m.grants().lease(ids[1]);
    let mut seen = Vec::new();
    {
        let mut gt = f.m.grants();
        l.give_back_each(&mut gt, |gt, p| seen.push((p, gt.leased(p))));
    }
    assert_eq!(seen, vec![(ids[0], false), (ids[1], true)]);
    assert_eq!(f.m.grants().lease_count(), 1, "only the other reader's lease is left");
}

/// A host→pool write whose pool put panics leaves no page marked in flight in the pool
/// and no lease behind: the next write of the same pages copies every object, and the
/// pages are complete in the pool with their bytes.
#[test]
fn a_pool_write_that_panics_clears_its_in_flight_marks_and_leases() {
    use crate::layout::LayoutSpec;
    use crate::page::Namespace;
    use crate::tier::device::EmulatedDevice;
    let dir = tempfile::tempdir().unwrap();
    let layout = LayoutSpec::mha(4, 2, 32, 2, 16).build().unwrap();
    let slot = layout.max_object_bytes();
    let opts = crate::tier::host::ArenaOptions {
        lock: false,
        ..Default::default()
    };
    let local = crate::pool::local::LocalPool::create(&dir.path().join("pool"), 256 * slot, slot, &opts).unwrap();
    // The first put panics; the rest go through.
    let panicked = std::sync::atomic::AtomicBool::new(false);
    let pool = Arc::new(
        crate::pool::hooked::HookedPool::new(Arc::new(local)).before(move |call| {
            if call == crate::pool::hooked::Call::Put && !panicked.swap(true, std::sync::atomic::Ordering::Relaxed) {
                panic!("the pool's put failed hard");
            }
        }),
    );
    let mut cfg = ManagerConfig::in_dir(dir.path(), 16 * layout.page_bytes(), None);
    cfg.arena.lock = false;
    cfg.pool = PoolConfig::Backend(pool.clone());
    let m = Manager::new(cfg, crate::clock::SimClock::new()).unwrap();
    let ns = m
        .register_namespace(Namespace::model("panics"), layout.clone())
        .unwrap();
    let dev = Arc::new(EmulatedDevice::new(&layout, 0, 8));
    m.attach_device(ns, 0, 0, dev.clone()).unwrap();
    let hs = hashes(0..3);
    for (i, h) in hs.iter().enumerate() {
        dev.fill_page(i as u32, h.prefix_u64()).unwrap();
    }
    let t = m.store(ns, 0, 0, &hs, &[0, 1, 2], 0).unwrap();
    assert_eq!(m.wait(t, std::time::Duration::from_secs(30)).unwrap().pages, 3);
    let ids: Vec<_> = hs.iter().map(|h| m.read().dir.find(ns, h).unwrap()).collect();
    let pool_inflight = |h: &PageHash| {
        let s = m.page_status(ns, h).unwrap().unwrap();
        s.tiers[TierKind::Pool.index()].inflight.clone()
    };

    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.mover().copy_to_pool(ns, &ids, false)));
    assert!(panicked.is_err(), "the pool's put panicked through the write");
    for h in &hs {
        assert_eq!(pool_inflight(h), Vec::<usize>::new(), "no object left in flight");
        assert!(!m.page_status(ns, h).unwrap().unwrap().tiers[TierKind::Pool.index()].complete);
    }
    assert_eq!(m.grants().lease_count(), 0, "no lease left");

    assert_eq!(
        m.mover().copy_to_pool(ns, &ids, false),
        3,
        "the next write copies every object"
    );
    // The pool's copies are whole: with the host copies dropped, staging them back gives
    // every object's bytes as they were.
    let host_bytes = |h: &PageHash| -> Vec<Vec<u8>> {
        (0..layout.object_count())
            .map(|o| {
                let mut b = vec![0u8; layout.object_bytes(o) as usize];
                assert!(m.read_host_object(ns, h, o, &mut b).unwrap(), "object {o} on host");
                b
            })
            .collect()
    };
    let before: Vec<_> = hs.iter().map(host_bytes).collect();
    assert!(
        before.iter().flatten().all(|b| b.iter().any(|&x| x != 0)),
        "the device filled every object"
    );
    m.mover().drop_host_if_held(&ids, TierKind::Pool);
    assert!(
        hs.iter()
            .all(|h| !m.page_status(ns, h).unwrap().unwrap().tiers[TierKind::Host.index()].complete)
    );
    assert_eq!(m.mover().stage_pages_from_pool(ns, &hs), 3);
    for (h, want) in hs.iter().zip(&before) {
        assert!(
            host_bytes(h) == *want,
            "a page staged back from the pool holds its bytes"
        );
    }
}
