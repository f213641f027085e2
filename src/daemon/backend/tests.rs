//! The daemon backend in process: journal records follow eviction, so a crash after slots
//! were reused recovers exactly the pages that were on host, and nothing else.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::clock::SystemClock;
use crate::layout::LayoutSpec;
use crate::manager::Tunables;
use crate::tier::host::{ArenaOptions, HostArena, SlotId};

fn config(dir: &std::path::Path, recover: bool) -> TiersConfig {
    TiersConfig {
        arena_path: dir.join("arena"),
        arena_bytes: 4096,
        slot_bytes: 0,
        pool_bytes: 0,
        shared_pool: None,
        max_pages: 1024,
        max_wait: Duration::from_millis(200),
        recover,
        arena: ArenaOptions {
            lock: false,
            prefault: false,
            touch_threads: 1,
            group: None,
        },
        tunables: Tunables::default(),
        event_ring: 1 << 12,
        policy: Some(crate::policy::SessionPolicyConfig::default()),
        request_traces: None,
    }
}

/// Stores one page as the only rank, writing `fill` into every object.
fn store(b: &ManagedTiers, arena: &HostArena, ns: NamespaceId, h: PageHash, fill: u8) -> bool {
    let Ok((grant, pages)) = b.begin_store(ns, 0, 0, &[h], "", 1) else {
        return false;
    };
    for s in pages.iter().flat_map(|p| &p.slots) {
        // SAFETY: the grant gives us the slot until commit.
        unsafe { arena.slot_mut(SlotId(s.slot), 128).unwrap() }.fill(fill);
    }
    b.commit_store(grant, &vec![true; pages.len()]).is_ok()
}

fn complete_in(b: &ManagedTiers, ns: NamespaceId, h: &PageHash, tier: crate::tier::TierKind) -> bool {
    b.manager()
        .page_status(ns, h)
        .unwrap()
        .is_some_and(|s| s.tiers[tier.index()].complete)
}

fn host_complete(b: &ManagedTiers, ns: NamespaceId, h: &PageHash) -> bool {
    complete_in(b, ns, h, crate::tier::TierKind::Host)
}

#[test]
fn a_crash_after_eviction_recovers_exactly_the_host_pages() {
    let dir = tempfile::tempdir().unwrap();
    let spec = LayoutSpec::mha(1, 1, 16, 2, 4); // two 128-byte objects a page
    let ns_name = Namespace::model("m");
    let hashes: Vec<PageHash> = (0..24).map(|i| PageHash::from_u64(100 + i)).collect();
    let on_host: Vec<bool>;
    {
        let b = ManagedTiers::open(config(dir.path(), true), SystemClock::new()).unwrap();
        let reg = b.register(&ns_name, &spec).unwrap();
        assert_eq!(reg.arena.slots, 32, "16 pages fit");
        let arena = b.manager().arena().unwrap();
        for (i, h) in hashes.iter().enumerate() {
            assert!(store(&b, &arena, reg.ns, *h, i as u8), "page {i}");
            b.tick();
        }
        // Device credit would hide host state (this rank still "has" every page on device).
        on_host = hashes.iter().map(|h| host_complete(&b, reg.ns, h)).collect();
        let kept = on_host.iter().filter(|&&x| x).count();
        assert!((8..24).contains(&kept), "eviction ran: {kept} of 24 on host");
        assert!(on_host[23], "the newest page is on host");
        // Crash: no shutdown, no compaction.
    }
    let b = ManagedTiers::open(config(dir.path(), true), SystemClock::new()).unwrap();
    let s = b.stats();
    assert_eq!(s.recovered_pages, on_host.iter().filter(|&&x| x).count() as u64);
    assert_eq!(
        s.discarded_pages, 0,
        "released slots are not mistaken for corrupt pages"
    );
    let reg = b.register(&ns_name, &spec).unwrap();
    let arena = b.manager().arena().unwrap();
    for (i, h) in hashes.iter().enumerate() {
        assert_eq!(b.lookup(reg.ns, &[*h]).unwrap().host == 1, on_host[i], "page {i}");
        assert_eq!(host_complete(&b, reg.ns, h), on_host[i], "page {i}");
        if on_host[i] {
            let (g, pages) = b.begin_load(reg.ns, 0, 0, &[*h], LoadWait::BestEffort, 2).unwrap();
            for s in &pages[0] {
                // SAFETY: the load grant leases the page.
                let bytes = unsafe { arena.slot(SlotId(s.slot), 128).unwrap() };
                assert!(bytes.iter().all(|&x| x == i as u8), "page {i} bytes survived");
            }
            b.finish_load(g, 1).unwrap();
        }
    }
    // Disconnect bookkeeping: an owner's open store grant is reclaimed by abort.
    let (g, pages) = b.begin_store(reg.ns, 0, 0, &[PageHash::from_u64(999)], "", 7).unwrap();
    assert_eq!(pages.len(), 1);
    let used = arena.used();
    b.abort_store(g).unwrap();
    assert_eq!(arena.used(), used - 2);
    assert!(matches!(b.commit_store(g, &[true]), Err(BackendError::UnknownGrant(_))));
    let _ = Arc::clone(&arena);
}

#[test]
fn a_load_with_a_timeout_waits_for_the_other_rank_and_best_effort_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), false);
    cfg.max_wait = Duration::from_secs(3);
    let b = Arc::new(ManagedTiers::open(cfg, SystemClock::new()).unwrap());
    let spec = LayoutSpec::mha(1, 2, 16, 2, 4).with_parallel(2, 1);
    let ns = b.register(&Namespace::model("m"), &spec).unwrap().ns;
    let h = [PageHash::from_u64(42)];
    let (g, p) = b.begin_store(ns, 0, 0, &h, "", 1).unwrap();
    b.commit_store(g, &vec![true; p.len()]).unwrap();
    let (g, pages) = b.begin_load(ns, 0, 0, &h, LoadWait::BestEffort, 1).unwrap();
    assert!(pages.is_empty(), "rank 1 has not stored: nothing loadable");
    b.finish_load(g, 0).unwrap();
    let other = b.clone();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(150));
        let (g, p) = other.begin_store(ns, 1, 0, &h, "", 2).unwrap();
        other.commit_store(g, &vec![true; p.len()]).unwrap()
    });
    let t = std::time::Instant::now();
    let (g, pages) = b.begin_load(ns, 0, 0, &h, LoadWait::Timeout(2_000), 1).unwrap();
    assert_eq!(pages.len(), 1, "the wait saw the page complete");
    assert!(t.elapsed() >= Duration::from_millis(100) && t.elapsed() < Duration::from_millis(1_500));
    assert_eq!(late.join().unwrap().1, 1, "the second rank's commit completed the page");
    b.finish_load(g, 1).unwrap();
    // A page nobody is storing is not waited for.
    let t = std::time::Instant::now();
    let (_, pages) = b
        .begin_load(ns, 0, 0, &[PageHash::from_u64(43)], LoadWait::Timeout(2_000), 1)
        .unwrap();
    assert!(pages.is_empty() && t.elapsed() < Duration::from_millis(200));
}

#[test]
fn a_page_staged_back_from_the_pool_is_journalled_and_recovered_then_released() {
    use crate::hints::{HintOutcome, HintTarget};
    use crate::tier::TierKind;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), true);
    cfg.pool_bytes = 1 << 20;
    let spec = LayoutSpec::mha(1, 1, 16, 2, 4); // two 128-byte objects a page
    let ns_name = Namespace::model("m");
    let h = PageHash::from_u64(77);
    let hint = |b: &ManagedTiers, ns, hint| b.hint(ns, &hint).unwrap();
    {
        let b = ManagedTiers::open(cfg.clone(), SystemClock::new()).unwrap();
        let reg = b.register(&ns_name, &spec).unwrap();
        let arena = b.manager().arena().unwrap();
        assert!(store(&b, &arena, reg.ns, h, 0xa5));
        let to_pool = Hint::Demote {
            target: HintTarget::Pages(vec![h]),
            to: TierKind::Pool,
        };
        assert_eq!(hint(&b, reg.ns, to_pool), HintOutcome::Accepted { pages: 1 });
        // Off host, and the journal has seen it go (the daemon ticks every 100 ms).
        b.manager().make_host_room(usize::MAX);
        b.tick();
        assert!(!host_complete(&b, reg.ns, &h));
        assert!(
            complete_in(&b, reg.ns, &h, TierKind::Pool),
            "the page is in the pool only"
        );
        let back = Hint::Prefetch {
            target: HintTarget::Pages(vec![h]),
            to: TierKind::Host,
            deadline_ms: None,
        };
        assert_eq!(hint(&b, reg.ns, back), HintOutcome::Accepted { pages: 1 });
        assert!(host_complete(&b, reg.ns, &h), "staged back into host");
        // Crash right after the answer: no tick, no shutdown.
    }
    let b = ManagedTiers::open(cfg.clone(), SystemClock::new()).unwrap();
    assert_eq!((b.stats().recovered_pages, b.stats().discarded_pages), (1, 0));
    let reg = b.register(&ns_name, &spec).unwrap();
    let arena = b.manager().arena().unwrap();
    assert_eq!(b.lookup(reg.ns, &[h]).unwrap().host, 1, "a host hit after the restart");
    let (g, pages) = b.begin_load(reg.ns, 0, 0, &[h], LoadWait::BestEffort, 2).unwrap();
    assert_eq!(pages[0].len(), 2);
    for s in &pages[0] {
        // SAFETY: the load grant leases the page.
        let bytes = unsafe { arena.slot(SlotId(s.slot), 128).unwrap() };
        assert!(bytes.iter().all(|&x| x == 0xa5), "the staged bytes survived");
    }
    b.finish_load(g, 1).unwrap();
    // Evicted again (the recovered manager has no pool copy of it): gone from the manifest.
    b.manager().make_host_room(usize::MAX);
    b.shutdown().unwrap();
    drop(b);
    let b = ManagedTiers::open(cfg, SystemClock::new()).unwrap();
    assert_eq!((b.stats().recovered_pages, b.stats().discarded_pages), (0, 0));
}
