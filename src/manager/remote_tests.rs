//! Discovery on a shared pool, with two managers on one real pool backend (the node-local
//! pool, shared by handing both managers the same backend): pages one wrote are hits on
//! the other only when every object exists, load with the writer's bytes, are confirmed
//! through the cache within its TTL, and are misses once their objects are gone.

use std::sync::Arc;
use std::time::Duration;

use super::engine::LoadWait;
use super::tests::WAIT;
use super::*;
use crate::clock::SimClock;
use crate::events::PageEventKind;
use crate::hints::{Hint, HintOutcome, HintTarget};
use crate::layout::LayoutSpec;
use crate::pool::PoolBackend;
use crate::pool::local::LocalPool;
use crate::tier::device::EmulatedDevice;
use crate::tier::host::ArenaOptions;

struct Node {
    m: Manager,
    ns: NamespaceId,
    devs: Vec<Arc<EmulatedDevice>>,
    clock: Arc<SimClock>,
}

fn layout() -> Layout {
    LayoutSpec::mha(4, 4, 32, 2, 16).with_parallel(2, 1).build().unwrap()
}

fn opts() -> ArenaOptions {
    ArenaOptions {
        lock: false,
        ..ArenaOptions::default()
    }
}

/// A TP=2 node on `pool`, with discovery on, in namespace `ns`.
fn node(dir: &std::path::Path, name: &str, pool: &Arc<LocalPool>, ns: Namespace) -> Node {
    let l = layout();
    let mut cfg = ManagerConfig::in_dir(&dir.join(name), 64 * l.page_bytes(), None);
    std::fs::create_dir_all(dir.join(name)).unwrap();
    cfg.arena.lock = false;
    cfg.pool = PoolConfig::Backend(pool.clone());
    cfg.remote = Some(RemoteConfig::default());
    let clock = SimClock::new();
    let m = Manager::new(cfg, clock.clone()).unwrap();
    let ns = m.register_namespace(ns, l.clone()).unwrap();
    let devs: Vec<Arc<EmulatedDevice>> = (0..2).map(|_| Arc::new(EmulatedDevice::new(&l, 0, 16))).collect();
    for (r, d) in devs.iter().enumerate() {
        m.attach_device(ns, r as u16, 0, d.clone()).unwrap();
    }
    Node { m, ns, devs, clock }
}

fn shared_pool(dir: &std::path::Path) -> Arc<LocalPool> {
    let slot = layout().max_object_bytes();
    Arc::new(LocalPool::create(&dir.join("pool"), 256 * slot, slot, &opts()).unwrap())
}

fn hashes(n: u64) -> Vec<PageHash> {
    (0..n).map(|i| PageHash::from_u64(0xc1_0000 + i)).collect()
}

impl Node {
    /// Both ranks store `hs` from device slots 0.. with bytes seeded by hash and rank, and
    /// the pages are shared to the pool.
    fn store_and_share(&self, hs: &[PageHash]) {
        let slots: Vec<u32> = (0..hs.len() as u32).collect();
        for (r, d) in self.devs.iter().enumerate() {
            for (h, &s) in hs.iter().zip(&slots) {
                d.fill_page(s, h.prefix_u64() ^ r as u64).unwrap();
            }
            let t = self.m.store(self.ns, r as u16, 0, hs, &slots, 0).unwrap();
            assert_eq!(self.m.wait(t, WAIT).unwrap().pages, hs.len());
        }
        let share = Hint::Share {
            target: HintTarget::Prefix(hs.to_vec()),
        };
        assert_eq!(
            self.m.hint(self.ns, share).unwrap(),
            HintOutcome::Accepted { pages: hs.len() }
        );
        assert!(self.m.quiesce(WAIT));
    }

    /// Loads `hs` on both ranks into slots 8..; returns pages loaded per rank, after
    /// checking that every loaded page holds the writer's bytes for that rank.
    fn load(&self, hs: &[PageHash]) -> Vec<usize> {
        let slots: Vec<u32> = (8..8 + hs.len() as u32).collect();
        (0..2u16)
            .map(|r| {
                let t = self
                    .m
                    .load(self.ns, r, 0, hs, &slots, LoadWait::Timeout { ms: 5_000 })
                    .unwrap();
                let n = self.m.wait(t, WAIT).unwrap().pages;
                for (h, &s) in hs.iter().zip(&slots).take(n) {
                    assert!(
                        self.devs[r as usize]
                            .page_matches(s, h.prefix_u64() ^ r as u64)
                            .unwrap(),
                        "rank {r} page {h} holds the writer's bytes"
                    );
                }
                n
            })
            .collect()
    }

    fn pool_stored_events(&self) -> Vec<PageHash> {
        let b = self.m.pages().events().read_from(1, 10_000, Duration::ZERO);
        b.events
            .iter()
            .filter(|e| e.tier == TierKind::Pool && e.kind == PageEventKind::Stored)
            .map(|e| e.hash)
            .collect()
    }
}

#[test]
fn pages_another_node_shared_are_pool_hits_here_and_load_the_writers_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let pool = shared_pool(dir.path());
    let a = node(dir.path(), "a", &pool, Namespace::model("org/m"));
    let b = node(dir.path(), "b", &pool, Namespace::model("org/m"));
    let hs = hashes(4);
    a.store_and_share(&hs);
    // B never saw these pages; one batched query over all 16 objects finds them.
    let hit = b.m.lookup(b.ns, &hs).unwrap();
    assert_eq!((hit.device, hit.host, hit.pool), (0, 0, 4));
    let r = b.m.discovery().counters().unwrap();
    assert_eq!((r.exists_queries, r.exists_keys, r.found_pages), (1, 16, 4));
    assert_eq!(
        b.pool_stored_events(),
        hs,
        "each found page is announced once, in order"
    );
    assert_eq!(b.m.discovery().origin(b.ns, &hs[0]), Some(PoolOrigin::FoundInPool));
    assert_eq!(a.m.discovery().origin(a.ns, &hs[0]), Some(PoolOrigin::WrittenHere));
    // Again within the TTL: no new query, and no second announcement.
    assert_eq!(b.m.lookup(b.ns, &hs).unwrap().pool, 4);
    assert_eq!(b.m.discovery().counters().unwrap().exists_queries, 1);
    assert_eq!(b.pool_stored_events().len(), 4);
    // Both ranks load every page with A's bytes for that rank.
    assert_eq!(b.load(&hs), vec![4, 4]);
    let after = b.m.lookup(b.ns, &hs).unwrap();
    assert_eq!(
        (after.device + after.host, after.pool),
        (4, 0),
        "now nearer than the pool"
    );
}

/// A lookup begun on an async runtime hands its query back, and finishing it with the
/// pool's answers gives what a blocking lookup gives: the complete pages of the prefix, each
/// announced once, and nothing for a page missing one rank's objects.
#[cfg(feature = "daemon")]
#[test]
fn an_awaited_lookup_credits_what_a_blocking_one_does() {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let dir = tempfile::tempdir().unwrap();
    let pool = shared_pool(dir.path());
    let a = node(dir.path(), "a", &pool, Namespace::model("m"));
    let hs = hashes(4);
    a.store_and_share(&hs);
    let keys = a.m.pages().key_scheme(a.ns).unwrap().page_keys(&layout(), &hs[2]);
    pool.remove(&keys[3], true).unwrap();
    // The local pool, with an existence query the caller awaits (as the Mooncake pool's
    // query of the master is), counting how often each way was asked.
    let (awaited, blocking) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let awaitable = {
        let (a, b) = (awaited.clone(), blocking.clone());
        Arc::new(
            crate::pool::hooked::HookedPool::new(pool.clone())
                .awaitable(move || {
                    a.fetch_add(1, Relaxed);
                })
                .before(move |call| {
                    if call == crate::pool::hooked::Call::Exists {
                        b.fetch_add(1, Relaxed);
                    }
                }),
        )
    };
    let l = layout();
    let mut cfg = ManagerConfig::in_dir(&dir.path().join("b"), 64 * l.page_bytes(), None);
    std::fs::create_dir_all(dir.path().join("b")).unwrap();
    cfg.arena.lock = false;
    cfg.pool = PoolConfig::Backend(awaitable.clone());
    cfg.remote = Some(RemoteConfig::default());
    let b = Manager::new(cfg, SimClock::new()).unwrap();
    let ns = b.register_namespace(Namespace::model("m"), l).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let LookupStep::Query(mut pending) = b.discovery().lookup_begin(ns, &hs).unwrap() else {
        panic!("a lookup past the directory must hand its query back");
    };
    let answers = rt.block_on(pending.answers()).unwrap();
    assert_eq!(answers.len(), 16, "every object of the four pages");
    let hit = b.discovery().lookup_finish(&hs, pending, answers);
    assert_eq!(
        (hit.device, hit.host, hit.pool),
        (0, 0, 2),
        "the prefix ends at the page missing an object"
    );
    let r = b.discovery().counters().unwrap();
    // Credited before the directory knows them: their entries wait for the reply.
    assert_eq!((r.exists_queries, r.exists_keys, r.found_pages), (1, 16, 0));
    settle_lookups(&b);
    assert_eq!(b.discovery().counters().unwrap().found_pages, 2);
    assert_eq!(b.discovery().origin(ns, &hs[1]), Some(PoolOrigin::FoundInPool));
    // Within the TTL the cache answers: no query to await, and the same credit.
    match b.discovery().lookup_begin(ns, &hs).unwrap() {
        LookupStep::Done(again) => assert_eq!(again.pool, 2),
        _ => panic!("cached answers need no query"),
    }
    assert_eq!((awaited.load(Relaxed), blocking.load(Relaxed)), (1, 0));
    assert_eq!(b.lookup(ns, &hs).unwrap().pool, 2, "a blocking lookup agrees");
}

#[test]
fn a_page_missing_one_ranks_objects_is_never_a_hit() {
    let dir = tempfile::tempdir().unwrap();
    let pool = shared_pool(dir.path());
    let a = node(dir.path(), "a", &pool, Namespace::model("m"));
    let b = node(dir.path(), "b", &pool, Namespace::model("m"));
    let hs = hashes(3);
    a.store_and_share(&hs);
    // Page 1 loses TP rank 1's objects (as if only rank 0 ever wrote them).
    let l = layout();
    let keys = a.m.pages().key_scheme(a.ns).unwrap().page_keys(&l, &hs[1]);
    for k in &keys[2..] {
        pool.remove(k, true).unwrap();
    }
    let hit = b.m.lookup(b.ns, &hs).unwrap();
    assert_eq!(hit.pool, 1, "the prefix ends at the incomplete page");
    assert_eq!(b.m.lookup(b.ns, &hs[1..2]).unwrap().total(), 0);
    assert_eq!(b.load(&hs), vec![1, 1]);
}

#[test]
fn vanished_pages_are_misses_after_the_cache_ttl_and_loads_return_fewer_pages() {
    let dir = tempfile::tempdir().unwrap();
    let pool = shared_pool(dir.path());
    let a = node(dir.path(), "a", &pool, Namespace::model("m"));
    let b = node(dir.path(), "b", &pool, Namespace::model("m"));
    let hs = hashes(4);
    a.store_and_share(&hs);
    assert_eq!(b.m.lookup(b.ns, &hs).unwrap().pool, 4);
    let l = layout();
    let scheme = a.m.pages().key_scheme(a.ns).unwrap();
    for k in scheme.page_keys(&l, &hs[2]) {
        pool.remove(&k, true).unwrap();
    }
    // The load's get finds nothing for page 2: fewer pages, no wrong bytes, and the
    // directory stops crediting it (the `removed` event).
    assert_eq!(b.load(&hs), vec![2, 2]);
    assert!(b.m.discovery().counters().unwrap().get_not_found >= 1);
    let removed = b.m.pages().events().read_from(1, 10_000, Duration::ZERO);
    assert!(
        removed
            .events
            .iter()
            .any(|e| e.tier == TierKind::Pool && e.kind == PageEventKind::Removed && e.hash == hs[2])
    );
    // A node that learned of page 3 before it vanished confirms it again after the TTL.
    let c = node(dir.path(), "c", &pool, Namespace::model("m"));
    assert_eq!(c.m.lookup(c.ns, &hs[3..]).unwrap().pool, 1);
    for k in scheme.page_keys(&l, &hs[3]) {
        pool.remove(&k, true).unwrap();
    }
    assert_eq!(c.m.lookup(c.ns, &hs[3..]).unwrap().pool, 1, "cached within the TTL");
    c.clock.advance(RemoteConfig::default().positive_ttl_ms + 1);
    assert_eq!(c.m.lookup(c.ns, &hs[3..]).unwrap().pool, 0, "gone after the TTL");
    assert_eq!(c.m.discovery().counters().unwrap().vanished_pages, 1);
    assert_eq!(c.m.discovery().origin(c.ns, &hs[3]), None);
    let _ = b.clock;
}

#[test]
fn tenants_whose_namespaces_differ_only_in_separators_never_share_pages_on_the_local_pool() {
    let dir = tempfile::tempdir().unwrap();
    let pool = shared_pool(dir.path());
    let salt = |s: &str| Namespace {
        model: "m".into(),
        salt: s.into(),
        ..Namespace::default()
    };
    let lora = Namespace {
        model: "m".into(),
        lora: "adapterX".into(),
        ..Namespace::default()
    };
    let a = node(dir.path(), "a", &pool, salt("t_1"));
    let hs = hashes(2);
    a.store_and_share(&hs);
    for (name, ns) in [
        ("b", salt("t-1")),
        ("c", salt("adapterX")),
        ("d", Namespace::model("m")),
    ] {
        let other = node(dir.path(), name, &pool, ns);
        assert_eq!(other.m.lookup(other.ns, &hs).unwrap().total(), 0, "{name}");
        assert_eq!(other.load(&hs), vec![0, 0]);
    }
    let a2 = node(dir.path(), "a2", &pool, lora.clone());
    a2.store_and_share(&hs);
    let same = node(dir.path(), "e", &pool, lora);
    assert_eq!(same.m.lookup(same.ns, &hs).unwrap().pool, 2, "the same tenant does hit");
    let salted = node(dir.path(), "f", &pool, salt("adapterX"));
    assert_eq!(salted.m.lookup(salted.ns, &hs).unwrap().total(), 0);
}

/// With the pool index in sync, a lookup on an async runtime is answered where it is asked,
/// even on a pool whose existence query cannot be awaited (the local pool's): no blocking
/// thread, no query, and the same credit, ending at the page the index lacks an object of.
#[cfg(feature = "daemon")]
#[test]
fn an_in_sync_index_answers_a_lookup_without_leaving_the_callers_thread() {
    use crate::pool::index::PoolIndex;
    let dir = tempfile::tempdir().unwrap();
    let pool = shared_pool(dir.path());
    assert!(!crate::pool::PoolBackend::awaits_exists(&*pool));
    let a = node(dir.path(), "a", &pool, Namespace::model("m"));
    let b = node(dir.path(), "b", &pool, Namespace::model("m"));
    let hs = hashes(4);
    a.store_and_share(&hs);
    let scheme = a.m.pages().key_scheme(a.ns).unwrap();
    let mut listing: Vec<String> = hs.iter().flat_map(|h| scheme.page_keys(&layout(), h)).collect();
    // The index lacks one object of the third page.
    listing.retain(|k| *k != scheme.page_keys(&layout(), &hs[2])[1]);
    let index = Arc::new(PoolIndex::new(1 << 10));
    index.begin_resync();
    assert!(index.finish_resync(listing, std::time::Instant::now()));
    assert!(b.m.discovery().set_index(index.clone()));
    match b.m.discovery().lookup_begin(b.ns, &hs).unwrap() {
        LookupStep::Done(hit) => assert_eq!((hit.device, hit.host, hit.pool), (0, 0, 2)),
        LookupStep::Query(_) => panic!("the index answers: nothing to ask the pool"),
        LookupStep::Blocking => panic!("the index answers on the caller's thread"),
    }
    let ix = index.snapshot();
    // Probing stops at the page that lacks an object: the fourth is never probed.
    assert_eq!((ix.index_lookups, ix.index_pages), (1, 3));
    // The answer needed no directory write: the pages are entered after it.
    let r = b.m.discovery().counters().unwrap();
    assert_eq!((r.exists_queries, r.found_pages, r.remote_hit_pages), (0, 0, 2));
    assert!(
        b.pool_stored_events().is_empty(),
        "nothing announced before the settling"
    );
    // A load that comes before the connection task settles still finds both pages, with
    // A's bytes, and each is entered (and announced) once.
    assert_eq!(b.load(&hs[..2]), vec![2, 2]);
    assert_eq!(b.pool_stored_events(), hs[..2].to_vec());
    assert_eq!(b.m.discovery().counters().unwrap().found_pages, 2);
    assert_eq!(b.m.discovery().origin(b.ns, &hs[1]), Some(PoolOrigin::FoundInPool));
}

/// Lookups answered on a connection task leave their directory work queued, bounded: past
/// `MAX_PENDING` a lookup settles everything itself; the settling enters each page once,
/// and any reader of a page's state (its status, its origin) settles first.
#[cfg(feature = "daemon")]
#[test]
fn the_directory_work_lookups_leave_is_bounded_and_settled_before_anyone_reads_it() {
    use crate::pool::index::PoolIndex;
    let dir = tempfile::tempdir().unwrap();
    let pool = shared_pool(dir.path());
    let a = node(dir.path(), "a", &pool, Namespace::model("m"));
    let b = node(dir.path(), "b", &pool, Namespace::model("m"));
    let hs = hashes(3);
    a.store_and_share(&hs);
    let scheme = a.m.pages().key_scheme(a.ns).unwrap();
    let listing: Vec<String> = hs.iter().flat_map(|h| scheme.page_keys(&layout(), h)).collect();
    let index = Arc::new(PoolIndex::new(1 << 10));
    index.begin_resync();
    assert!(index.finish_resync(listing, std::time::Instant::now()));
    assert!(b.m.discovery().set_index(index));
    let credit = |hs: &[PageHash]| match b.m.discovery().lookup_begin(b.ns, hs).unwrap() {
        LookupStep::Done(hit) => hit.pool,
        _ => panic!("the index answers"),
    };
    for _ in 0..super::remote::settle::MAX_PENDING {
        assert_eq!(credit(&hs[..2]), 2);
    }
    assert_eq!(b.m.discovery().counters().unwrap().found_pages, 0, "all queued");
    assert_eq!(credit(&hs[..2]), 2, "one past the bound settles everything");
    assert_eq!(
        b.m.discovery().counters().unwrap().found_pages,
        2,
        "each page entered once"
    );
    assert_eq!(b.pool_stored_events(), hs[..2].to_vec());
    // A page's status right after a lookup's answer knows the page.
    assert_eq!(credit(&hs), 3);
    let st =
        b.m.page_status(b.ns, &hs[2])
            .unwrap()
            .expect("entered before its status is read");
    assert!(st.tiers[TierKind::Pool.index()].complete);
    assert_eq!(b.m.discovery().counters().unwrap().found_pages, 3);
}

/// The index's walk takes the window in growing parts and stops after the part that holds
/// the first page that does not count: the credit is the same wherever that page falls
/// (inside the first part, on a part's edge, deep in the window, or nowhere), a page this
/// node holds counts although the index lacks it, and the walk is one lookup of the index
/// however many parts it took, probing pages up to the first it lacks and no further.
#[cfg(feature = "daemon")]
#[test]
fn the_index_walk_credits_the_same_wherever_the_first_missing_page_falls() {
    use crate::pool::index::PoolIndex;
    let dir = tempfile::tempdir().unwrap();
    let pool = shared_pool(dir.path());
    let a = node(dir.path(), "a", &pool, Namespace::model("m"));
    let hs = hashes(64);
    let scheme = a.m.pages().key_scheme(a.ns).unwrap();
    // (first page the index lacks, credit, pages the index is asked about: the parts are
    // 4, 8, 16 and 32 pages, and page 40, which B holds itself, is not asked about).
    let cases: [(Option<usize>, usize, u64); 6] = [
        (Some(0), 0, 1),
        (Some(3), 3, 4),
        (Some(4), 4, 5),
        (Some(27), 27, 28),
        (Some(41), 41, 41),
        (None, 64, 63),
    ];
    for (missing, credit, probed) in cases {
        let mut listing: Vec<String> = hs.iter().flat_map(|h| scheme.page_keys(&layout(), h)).collect();
        let mut drop = vec![scheme.page_keys(&layout(), &hs[40])[0].clone()];
        if let Some(m) = missing {
            drop.push(scheme.page_keys(&layout(), &hs[m])[3].clone());
        }
        listing.retain(|k| !drop.contains(k));
        let index = Arc::new(PoolIndex::new(1 << 12));
        index.begin_resync();
        assert!(index.finish_resync(listing, std::time::Instant::now()));
        let b = node(dir.path(), &format!("b{credit}"), &pool, Namespace::model("m"));
        b.store_and_share(&hs[40..41]);
        assert!(b.m.discovery().set_index(index.clone()));
        match b.m.discovery().lookup_begin(b.ns, &hs).unwrap() {
            LookupStep::Done(hit) => assert_eq!((hit.device, hit.host, hit.pool), (0, 0, credit), "{missing:?}"),
            _ => panic!("the index answers"),
        }
        let ix = index.snapshot();
        assert_eq!((ix.index_lookups, ix.index_pages), (1, probed), "{missing:?}");
    }
}

/// The discovery cache holds at most its capacity, and a page that lookups keep asking
/// about outlives a scan of pages asked about once (a burst of new prefixes must not
/// flush the answers that save master queries). The old cache dropped an arbitrary half
/// of its entries whenever it filled.
#[test]
fn the_discovery_cache_is_bounded_and_keeps_what_lookups_reuse() {
    let cap = 1_000;
    let mut map = super::remote::page_map::<u64>(cap);
    let ns = NamespaceId(0);
    let key = |i: u64| (ns, PageHash::from_u64(i));
    let hot: Vec<_> = (0..100u64).map(|i| key(1 << 40 | i)).collect();
    for (i, k) in hot.iter().enumerate() {
        map.insert(*k, i as u64);
    }
    let mut most = 0;
    for i in 0..20 * cap as u64 {
        map.insert(key(i), i);
        most = most.max(map.len());
        if i % 50 == 0 {
            // The hot pages are read between inserts, as repeated lookups read them.
            for k in &hot {
                let _ = map.get(k);
            }
        }
    }
    assert!(most <= cap, "held {most} entries, capacity {cap}");
    assert!(
        map.len() >= cap * 9 / 10,
        "a full cache stays nearly full: {}",
        map.len()
    );
    let kept = hot.iter().filter(|k| map.contains_key(*k)).count();
    assert_eq!(kept, hot.len(), "every reused entry survives the scan");
    for (i, k) in hot.iter().enumerate() {
        assert_eq!(map.get(k), Some(&(i as u64)), "with its value");
    }
}
