//! The daemon backend in process: journal records follow eviction, so a crash after slots
//! were reused recovers exactly the pages that were on host, and nothing else.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::clock::SystemClock;
use crate::layout::LayoutSpec;
use crate::manager::Tunables;
use crate::tier::host::{ArenaOptions, HostArena, SlotId};

/// A small arena's tiers (4 KiB, 1,024 pages), recovering or not; other tests in the
/// backend start from it.
pub(in crate::daemon::backend) fn config(dir: &std::path::Path, recover: bool) -> TiersConfig {
    TiersConfig {
        arena_path: dir.join("arena"),
        arena_bytes: 4096,
        slot_bytes: 0,
        pool_bytes: 0,
        shared_pool: None,
        max_pages: 1024,
        max_wait: Duration::from_millis(200),
        recover,
        fence_timeout: Duration::from_secs(30),
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
        worker_nice: 0,
        worker_cores: Vec::new(),
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
        let arena = b.manager().stores().arena().unwrap();
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
    let arena = b.manager().stores().arena().unwrap();
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
        let arena = b.manager().stores().arena().unwrap();
        assert!(store(&b, &arena, reg.ns, h, 0xa5));
        let to_pool = Hint::Demote {
            target: HintTarget::Pages(vec![h]),
            to: TierKind::Pool,
        };
        assert_eq!(hint(&b, reg.ns, to_pool), HintOutcome::Accepted { pages: 1 });
        // Off host, and the journal has seen it go (the daemon ticks every 100 ms).
        b.manager().mover().make_host_room(usize::MAX);
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
    let arena = b.manager().stores().arena().unwrap();
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
    b.manager().mover().make_host_room(usize::MAX);
    b.shutdown().unwrap();
    drop(b);
    let b = ManagedTiers::open(cfg, SystemClock::new()).unwrap();
    assert_eq!((b.stats().recovered_pages, b.stats().discarded_pages), (0, 0));
}

/// Issue 28 item 4: one million store/release cycles through the journal (64 pages live
/// at any time) never take the manifest past its bound, and what it replays is exactly
/// the live pages.
#[test]
fn the_manifest_stays_bounded_over_a_million_store_release_cycles() {
    use super::journal::{COMPACT_FACTOR, COMPACT_SLACK, Journal};
    use super::manifest::{Manifest, ObjectRecord};
    let dir = tempfile::tempdir().unwrap();
    let b = ManagedTiers::open(config(dir.path(), false), SystemClock::new()).unwrap();
    let reg = b
        .register(&Namespace::model("m"), &LayoutSpec::mha(1, 1, 16, 2, 4))
        .unwrap();
    let mgr = b.manager();
    let path = dir.path().join("bounded.manifest");
    let mut j = Journal::new(path.clone());
    j.start(mgr, reg.arena.slot_bytes).unwrap();
    const LIVE: u64 = 64;
    const FLUSH_EVERY: u64 = 16;
    let rec = |i: u64| ObjectRecord {
        ns: reg.ns.0,
        hash: PageHash::from_u64(i),
        object: 0,
        slot: (i % (2 * LIVE)) as u32,
        len: 128,
        checksum: i,
    };
    let (mut largest, mut record_bytes) = (0, 0);
    for i in 0..1_000_000u64 {
        j.record(vec![rec(i)]);
        if i >= LIVE {
            j.release(reg.ns, PageHash::from_u64(i - LIVE));
        }
        if i % FLUSH_EVERY == FLUSH_EVERY - 1 {
            j.flush(mgr);
            largest = largest.max(j.manifest_bytes());
            record_bytes = j.manifest.as_ref().unwrap().object_record_bytes();
        }
    }
    j.flush(mgr);
    assert_eq!(j.live_objects(), LIVE);
    // Between two flushes at most FLUSH_EVERY stores and releases are appended.
    let bound = COMPACT_FACTOR * LIVE * record_bytes + COMPACT_SLACK + 2 * FLUSH_EVERY * record_bytes;
    assert!(record_bytes > 0);
    assert!(largest <= bound, "the manifest reached {largest} bytes; bound {bound}");
    assert!(j.compactions > 100, "compacted {} times", j.compactions);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), j.manifest_bytes());
    let r = Manifest::replay(&path).unwrap().unwrap();
    let mut live: Vec<u64> = r.objects.values().map(|o| o.hash.prefix_u64()).collect();
    live.sort();
    assert_eq!(live, (1_000_000 - LIVE..1_000_000).collect::<Vec<_>>());
    assert_eq!(r.bad_records, 0);
}

/// Issue 28 item 4: when the event ring drops events the journal had not read, the
/// journal rebuilds its records from the directory, so a crash then recovers exactly
/// the pages on host, not the ones whose removal was lost.
#[test]
fn a_journal_that_missed_events_resyncs_and_recovers_exactly_the_host_pages() {
    let dir = tempfile::tempdir().unwrap();
    let spec = LayoutSpec::mha(1, 1, 16, 2, 4);
    let ns_name = Namespace::model("m");
    let hashes: Vec<PageHash> = (0..48).map(|i| PageHash::from_u64(500 + i)).collect();
    let small_ring = |recover| TiersConfig {
        event_ring: 4,
        ..config(dir.path(), recover)
    };
    let on_host: Vec<bool>;
    {
        let b = ManagedTiers::open(small_ring(true), SystemClock::new()).unwrap();
        let reg = b.register(&ns_name, &spec).unwrap();
        let arena = b.manager().stores().arena().unwrap();
        // Batches of 8 pages: each evicts 8 older ones, far more events than the ring holds.
        for (n, batch) in hashes.chunks(8).enumerate() {
            let (grant, pages) = b.begin_store(reg.ns, 0, 0, batch, "", 1).unwrap();
            for p in &pages {
                for s in &p.slots {
                    // SAFETY: the grant gives us the slot until commit.
                    unsafe { arena.slot_mut(SlotId(s.slot), 128).unwrap() }.fill((n * 8) as u8 + p.index as u8);
                }
            }
            b.commit_store(grant, &vec![true; pages.len()]).unwrap();
        }
        b.tick();
        on_host = hashes.iter().map(|h| host_complete(&b, reg.ns, h)).collect();
        let kept = on_host.iter().filter(|&&x| x).count();
        assert!((8..48).contains(&kept), "eviction ran: {kept} of 48 on host");
        let (_, live, _, resyncs) = b.manifest_upkeep();
        assert!(resyncs > 0, "the journal saw the loss");
        assert_eq!(
            live,
            2 * kept as u64,
            "two records per page on host, none for evicted ones"
        );
    }
    let b = ManagedTiers::open(config(dir.path(), true), SystemClock::new()).unwrap();
    let s = b.stats();
    assert_eq!(s.recovered_pages, on_host.iter().filter(|&&x| x).count() as u64);
    assert_eq!(s.discarded_pages, 0);
    let reg = b.register(&ns_name, &spec).unwrap();
    let arena = b.manager().stores().arena().unwrap();
    for (i, h) in hashes.iter().enumerate() {
        assert_eq!(host_complete(&b, reg.ns, h), on_host[i], "page {i}");
        if on_host[i] {
            let (_, pages) = b.begin_load(reg.ns, 0, 0, &[*h], LoadWait::BestEffort, 2).unwrap();
            for s in &pages[0] {
                // SAFETY: the load grant leases the page.
                let bytes = unsafe { arena.slot(SlotId(s.slot), 128).unwrap() };
                assert!(bytes.iter().all(|&x| x == i as u8), "page {i} bytes survived");
            }
        }
    }
}
