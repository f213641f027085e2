use proptest::prelude::*;

use super::*;
use crate::layout::LayoutSpec;

fn dir_with(layout: Layout) -> (Directory, NamespaceId) {
    let mut d = Directory::new(1 << 20);
    let ns = d.register(Namespace::model("m"), layout).unwrap();
    (d, ns)
}

fn tp4pp2() -> Layout {
    LayoutSpec::mha(32, 8, 128, 2, 16).with_parallel(4, 2).build().unwrap()
}

#[test]
fn fifteen_of_sixteen_objects_is_not_a_hit_and_the_sixteenth_emits_one_stored() {
    let (mut d, ns) = dir_with(tp4pp2());
    let h = PageHash::from_u64(42);
    let id = d.find_or_insert(ns, &h).unwrap();
    for i in 0..15 {
        assert!(!d.set_object(id, TierKind::Host, i, true).unwrap());
    }
    assert!(!d.is_complete(id, TierKind::Host));
    assert_eq!(d.lookup_prefix(ns, &[h]).total(), 0);
    assert_eq!(d.objects().missing_objects(id, TierKind::Host), vec![15]);
    assert!(d.drain_events().is_empty());

    assert!(d.set_object(id, TierKind::Host, 15, true).unwrap());
    // Storing an object again changes nothing.
    assert!(!d.set_object(id, TierKind::Host, 3, true).unwrap());
    let evs = d.drain_events();
    assert_eq!(evs.len(), 1);
    assert_eq!(
        (evs[0].kind, evs[0].tier, evs[0].hash, evs[0].seq),
        (PageEventKind::Stored, TierKind::Host, h, 1)
    );
    assert_eq!(
        d.lookup_prefix(ns, &[h]),
        PrefixHit {
            device: 0,
            host: 1,
            pool: 0
        }
    );

    // Removing any one object breaks it: exactly one removed, and no more for the next.
    assert!(d.set_object(id, TierKind::Host, 7, false).unwrap());
    assert!(!d.set_object(id, TierKind::Host, 8, false).unwrap());
    let evs = d.drain_events();
    assert_eq!(evs.len(), 1);
    assert_eq!((evs[0].kind, evs[0].seq), (PageEventKind::Removed, 2));
    assert_eq!(d.objects().missing_objects(id, TierKind::Host), vec![7, 8]);
    assert_eq!(d.lookup_prefix(ns, &[h]).total(), 0);
}

#[test]
fn object_index_out_of_range_is_an_error() {
    let (mut d, ns) = dir_with(tp4pp2());
    let id = d.find_or_insert(ns, &PageHash::from_u64(1)).unwrap();
    assert_eq!(
        d.set_object(id, TierKind::Host, 16, true),
        Err(DirectoryError::ObjectOutOfRange { index: 16, count: 16 })
    );
}

#[test]
fn prefix_credit_goes_to_the_nearest_tier_and_is_never_counted_twice() {
    let layout = LayoutSpec::mha(2, 2, 8, 2, 4).build().unwrap();
    let (mut d, ns) = dir_with(layout);
    let hs: Vec<PageHash> = (0..8).map(PageHash::from_u64).collect();
    let put = |d: &mut Directory, i: usize, tier| {
        let id = d.find_or_insert(ns, &hs[i]).unwrap();
        d.set_page(id, tier, true);
    };
    // device: 0,1 ; host: 0..4 ; pool: 0..6, then a gap at 6, then 7 in pool.
    for i in 0..2 {
        put(&mut d, i, TierKind::Device);
    }
    for i in 0..4 {
        put(&mut d, i, TierKind::Host);
    }
    for i in 0..6 {
        put(&mut d, i, TierKind::Pool);
    }
    put(&mut d, 7, TierKind::Pool);
    let hit = d.lookup_prefix(ns, &hs);
    assert_eq!(
        hit,
        PrefixHit {
            device: 2,
            host: 2,
            pool: 2
        }
    );
    assert_eq!(hit.total(), 6);
    // A device page after a host-only page does not restart device credit.
    put(&mut d, 3, TierKind::Device);
    assert_eq!(
        d.lookup_prefix(ns, &hs),
        PrefixHit {
            device: 2,
            host: 2,
            pool: 2
        }
    );
    // Unknown namespace or first page missing: nothing.
    assert_eq!(d.lookup_prefix(ns, &hs[6..]).total(), 0);
    let other = d
        .register(
            Namespace::model("other"),
            LayoutSpec::mha(2, 2, 8, 2, 4).build().unwrap(),
        )
        .unwrap();
    assert_eq!(d.lookup_prefix(other, &hs).total(), 0);
}

#[test]
fn same_namespace_with_another_layout_is_refused() {
    let (mut d, _) = dir_with(tp4pp2());
    let other = LayoutSpec::mha(32, 8, 128, 2, 16).with_parallel(2, 2).build().unwrap();
    assert!(matches!(
        d.register(Namespace::model("m"), other),
        Err(DirectoryError::LayoutMismatch { .. })
    ));
    assert_eq!(d.register(Namespace::model("m"), tp4pp2()).unwrap(), NamespaceId(0));
}

#[test]
fn empty_pages_are_released_and_slots_reused() {
    let (mut d, ns) = dir_with(tp4pp2());
    let a = d.find_or_insert(ns, &PageHash::from_u64(1)).unwrap();
    d.set_page(a, TierKind::Pool, true);
    assert_eq!(d.len(), 1);
    d.set_page(a, TierKind::Pool, false);
    assert_eq!(d.len(), 0);
    assert!(d.find(ns, &PageHash::from_u64(1)).is_none());
    let b = d.find_or_insert(ns, &PageHash::from_u64(2)).unwrap();
    assert_eq!(a, b, "freed record is reused");
    // In-flight keeps a page alive even with no objects present.
    d.set_inflight(b, TierKind::Host, 0, true).unwrap();
    assert!(d.find(ns, &PageHash::from_u64(2)).is_some());
    assert!(d.order().eviction_candidates(TierKind::Host).is_empty());
    d.set_inflight(b, TierKind::Host, 0, false).unwrap();
    assert!(d.find(ns, &PageHash::from_u64(2)).is_none());
}

#[test]
fn clear_tier_emits_one_cleared_event() {
    let (mut d, ns) = dir_with(tp4pp2());
    for i in 0..5 {
        let id = d.find_or_insert(ns, &PageHash::from_u64(i)).unwrap();
        d.set_page(id, TierKind::Pool, true);
    }
    d.drain_events();
    assert_eq!(d.clear_tier(TierKind::Pool), 5);
    let evs = d.drain_events();
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0].kind, PageEventKind::Cleared);
    assert!(d.is_empty());
}

#[test]
fn record_is_small() {
    // 24 bytes the writer keeps, 40 of atomics lookups read (see `view.rs`).
    assert_eq!(std::mem::size_of::<PageRecord>(), 24);
    assert_eq!(Directory::record_bytes(), 64);
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        page: u8,
        tier: u8,
        obj: u8,
    },
    Remove {
        page: u8,
        tier: u8,
        obj: u8,
    },
    StorePage {
        page: u8,
        tier: u8,
    },
    Evict {
        page: u8,
        tier: u8,
    },
    Inflight {
        page: u8,
        tier: u8,
        obj: u8,
        on: bool,
    },
    /// Several objects at once (a bit mask over the page's four), through the bulk calls.
    StoreSome {
        page: u8,
        tier: u8,
        mask: u8,
        present: bool,
    },
    InflightSome {
        page: u8,
        tier: u8,
        mask: u8,
        on: bool,
    },
}

fn objs_of(mask: u8) -> Vec<usize> {
    (0..4).filter(|o| mask & (1 << o) != 0).collect()
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..12, 0u8..3, 0u8..4).prop_map(|(page, tier, obj)| Op::Store { page, tier, obj }),
        (0u8..12, 0u8..3, 0u8..4).prop_map(|(page, tier, obj)| Op::Remove { page, tier, obj }),
        (0u8..12, 0u8..3).prop_map(|(page, tier)| Op::StorePage { page, tier }),
        (0u8..12, 0u8..3).prop_map(|(page, tier)| Op::Evict { page, tier }),
        (0u8..12, 0u8..3, 0u8..4, any::<bool>()).prop_map(|(page, tier, obj, on)| Op::Inflight { page, tier, obj, on }),
        (0u8..12, 0u8..3, 0u8..16, any::<bool>()).prop_map(|(page, tier, mask, present)| Op::StoreSome {
            page,
            tier,
            mask,
            present
        }),
        (0u8..12, 0u8..3, 0u8..16, any::<bool>()).prop_map(|(page, tier, mask, on)| Op::InflightSome {
            page,
            tier,
            mask,
            on
        }),
    ]
}

proptest! {
    /// Against a plain model of object presence: completeness is exactly "all objects
    /// present", events are exactly the completeness changes (in order, numbered without
    /// gaps), counts match, and prefix lookups agree with the model.
    #[test]
    fn directory_matches_a_model(ops in proptest::collection::vec(op(), 1..200)) {
        let layout = LayoutSpec::mha(2, 2, 8, 2, 4).with_parallel(2, 1).build().unwrap(); // 4 objects
        let (mut d, ns) = dir_with(layout);
        let mut model = [[[false; 4]; 3]; 12];
        let mut inflight = [[[false; 4]; 3]; 12];
        let mut last_seq = 0;
        for op in ops {
            let before: Vec<[bool; 3]> = model.iter().map(|p| [0, 1, 2].map(|t| p[t].iter().all(|&b| b))).collect();
            let (page, tier) = match op {
                Op::Store { page, tier, obj } | Op::Remove { page, tier, obj } | Op::Inflight { page, tier, obj, .. } => {
                    let _ = obj;
                    (page, tier)
                }
                Op::StorePage { page, tier } | Op::Evict { page, tier } => (page, tier),
                Op::StoreSome { page, tier, .. } | Op::InflightSome { page, tier, .. } => (page, tier),
            };
            let t = TierKind::from_index(tier as usize).unwrap();
            let id = d.find_or_insert(ns, &PageHash::from_u64(page as u64)).unwrap();
            match op {
                Op::Store { obj, .. } => { d.set_object(id, t, obj as usize, true).unwrap(); model[page as usize][tier as usize][obj as usize] = true; }
                Op::Remove { obj, .. } => { d.set_object(id, t, obj as usize, false).unwrap(); model[page as usize][tier as usize][obj as usize] = false; }
                Op::StorePage { .. } => { d.set_page(id, t, true); model[page as usize][tier as usize] = [true; 4]; }
                Op::Evict { .. } => { d.set_page(id, t, false); model[page as usize][tier as usize] = [false; 4]; }
                Op::Inflight { obj, on, .. } => { d.set_inflight(id, t, obj as usize, on).unwrap(); inflight[page as usize][tier as usize][obj as usize] = on; }
                Op::StoreSome { mask, present, .. } => {
                    let was = model[page as usize][tier as usize].iter().all(|&b| b);
                    let changed = d.set_objects(id, t, &objs_of(mask), present).unwrap();
                    for o in objs_of(mask) { model[page as usize][tier as usize][o] = present; }
                    prop_assert_eq!(changed, was != model[page as usize][tier as usize].iter().all(|&b| b));
                }
                Op::InflightSome { mask, on, .. } => {
                    d.set_inflight_objects(id, t, &objs_of(mask), on).unwrap();
                    for o in objs_of(mask) { inflight[page as usize][tier as usize][o] = on; }
                }
            }
            d.release_if_empty(id);
            let after: Vec<[bool; 3]> = model.iter().map(|p| [0, 1, 2].map(|t| p[t].iter().all(|&b| b))).collect();
            let evs = d.drain_events();
            let mut expected = Vec::new();
            for p in 0..12 { for t in 0..3 { if before[p][t] != after[p][t] { expected.push((p as u64, t, after[p][t])); } } }
            prop_assert_eq!(evs.len(), expected.len());
            for (ev, (p, t, stored)) in evs.iter().zip(expected) {
                prop_assert_eq!(ev.seq, last_seq + 1);
                last_seq = ev.seq;
                prop_assert_eq!(ev.hash, PageHash::from_u64(p));
                prop_assert_eq!(ev.tier.index(), t);
                prop_assert_eq!(ev.kind, if stored { PageEventKind::Stored } else { PageEventKind::Removed });
            }
            for t in TierKind::ALL {
                prop_assert_eq!(d.complete_count(t), after.iter().filter(|p| p[t.index()]).count());
            }
            for p in 0..12usize {
                let live = model[p].iter().flatten().any(|&b| b) || inflight[p].iter().flatten().any(|&b| b);
                let found = d.find(ns, &PageHash::from_u64(p as u64));
                prop_assert_eq!(found.is_some(), live, "page {} liveness", p);
                if let Some(id) = found {
                    for t in TierKind::ALL {
                        prop_assert_eq!(d.is_complete(id, t), after[p][t.index()]);
                        let missing: Vec<usize> = (0..4).filter(|&o| !model[p][t.index()][o]).collect();
                        prop_assert_eq!(d.objects().missing_objects(id, t), missing);
                        prop_assert_eq!(d.is_inflight(id, t), inflight[p][t.index()].iter().any(|&b| b));
                        let flying: Vec<usize> = (0..4).filter(|&o| inflight[p][t.index()][o]).collect();
                        prop_assert_eq!(d.objects().inflight_objects(id, t), flying.clone());
                        for o in 0..4 {
                            prop_assert_eq!(d.objects().is_inflight_object(id, t, o), flying.contains(&o));
                        }
                        let unwritten: Vec<usize> =
                            (0..4).filter(|&o| !model[p][t.index()][o] && !inflight[p][t.index()][o]).collect();
                        let mut got = vec![99];
                        d.objects().unwritten_into(id, t, &mut got);
                        prop_assert_eq!(got, unwritten);
                    }
                }
            }
            // Prefix lookup over pages 0..12 agrees with the model.
            let hashes: Vec<PageHash> = (0..12).map(PageHash::from_u64).collect();
            let hit = d.lookup_prefix(ns, &hashes);
            let any = after.iter().take_while(|p| p.iter().any(|&b| b)).count();
            let near = after.iter().take_while(|p| p[0] || p[1]).count();
            let dev = after.iter().take_while(|p| p[0]).count();
            prop_assert_eq!(hit, PrefixHit { device: dev, host: near - dev, pool: any - near });
        }
    }
}

#[derive(Clone, Debug)]
enum EvOp {
    StorePage { page: u8, tier: u8 },
    Evict { page: u8, tier: u8 },
    Inflight { page: u8, on: bool },
    Pin { page: u8, tier: u8, on: bool },
    Retain { page: u8, level: i8 },
    Touch { page: u8, hit: bool },
    Session { page: u8, session: u8 },
    SessionIdle { session: u8, idle: bool },
    Protect { page: u8, until: u8 },
    Expire { now: u8 },
}

fn ev_op() -> impl Strategy<Value = EvOp> {
    prop_oneof![
        3 => (0u8..10, 0u8..3).prop_map(|(page, tier)| EvOp::StorePage { page, tier }),
        1 => (0u8..10, 0u8..3).prop_map(|(page, tier)| EvOp::Evict { page, tier }),
        1 => (0u8..10, any::<bool>()).prop_map(|(page, on)| EvOp::Inflight { page, on }),
        1 => (0u8..10, 0u8..3, any::<bool>()).prop_map(|(page, tier, on)| EvOp::Pin { page, tier, on }),
        1 => (0u8..10, -2i8..3).prop_map(|(page, level)| EvOp::Retain { page, level }),
        2 => (0u8..10, any::<bool>()).prop_map(|(page, hit)| EvOp::Touch { page, hit }),
        1 => (0u8..10, 0u8..4).prop_map(|(page, session)| EvOp::Session { page, session }),
        1 => (1u8..4, any::<bool>()).prop_map(|(session, idle)| EvOp::SessionIdle { session, idle }),
        1 => (0u8..10, 0u8..20).prop_map(|(page, until)| EvOp::Protect { page, until }),
        1 => (0u8..20).prop_map(|now| EvOp::Expire { now }),
    ]
}

/// Where the model puts a page in a tier's lists: (bucket as (busy, retain), when it
/// entered; negative for a page put at the head).
type Entered = ((bool, i8), i64);

/// A plain model of one page's eviction facts.
#[derive(Clone, Copy, Debug, Default)]
struct EvModel {
    complete: [bool; 3],
    inflight: bool,
    pinned: [bool; 3],
    retain: i8,
    session: u8,
    idle: bool,
    protected_until: Option<u8>,
}

proptest! {
    /// The eviction lists against a model: for host and pool, `victims` yields exactly
    /// the pages that are complete there, not pinned there, not in flight and not
    /// protected, ordered by (idle class first, retain, then when the page entered its
    /// bucket or was last touched), which is what the lists promise.
    #[test]
    fn eviction_lists_match_a_model(ops in proptest::collection::vec(ev_op(), 1..150)) {
        let layout = LayoutSpec::mha(2, 2, 8, 2, 4).build().unwrap();
        let (mut d, ns) = dir_with(layout);
        let mut m = [EvModel::default(); 10];
        let mut idle_sessions = [false; 4];
        // (bucket, entered) per page and listed tier, as the model sees it.
        let mut at: [[Option<Entered>; 2]; 10] = [[None; 2]; 10];
        let mut expired = [false; 10];
        let mut clock = 0i64;
        for op in ops {
            let mut touched = None;
            match op {
                EvOp::StorePage { page, tier } => {
                    let id = d.find_or_insert(ns, &PageHash::from_u64(page as u64)).unwrap();
                    d.set_page(id, TierKind::from_index(tier as usize).unwrap(), true);
                    m[page as usize].complete[tier as usize] = true;
                }
                EvOp::Evict { page, tier } => {
                    if let Some(id) = d.find(ns, &PageHash::from_u64(page as u64)) {
                        d.set_page(id, TierKind::from_index(tier as usize).unwrap(), false);
                        m[page as usize].complete[tier as usize] = false;
                    }
                }
                EvOp::Inflight { page, on } => {
                    let id = d.find_or_insert(ns, &PageHash::from_u64(page as u64)).unwrap();
                    d.set_inflight(id, TierKind::Device, 0, on).unwrap();
                    m[page as usize].inflight = on;
                }
                EvOp::Pin { page, tier, on } => {
                    if let Some(id) = d.find(ns, &PageHash::from_u64(page as u64)) {
                        d.set_pinned(id, TierKind::from_index(tier as usize).unwrap(), on);
                        m[page as usize].pinned[tier as usize] = on;
                    }
                }
                EvOp::Retain { page, level } => {
                    if let Some(id) = d.find(ns, &PageHash::from_u64(page as u64)) {
                        d.order_mut().set_retain(id, level);
                        m[page as usize].retain = level;
                    }
                }
                EvOp::Touch { page, hit } => {
                    if let Some(id) = d.find(ns, &PageHash::from_u64(page as u64)) {
                        d.order_mut().touch(id, hit);
                        if hit {
                            m[page as usize].protected_until = None;
                        }
                        touched = Some(page as usize);
                    }
                }
                EvOp::Session { page, session } => {
                    if let Some(id) = d.find(ns, &PageHash::from_u64(page as u64)) {
                        d.order_mut().set_session(id, session as u32);
                        let p = &mut m[page as usize];
                        p.session = session;
                        p.idle = session != 0 && idle_sessions[session as usize];
                    }
                }
                EvOp::SessionIdle { session, idle } => {
                    d.order_mut().set_session_idle(session as u32, idle);
                    idle_sessions[session as usize] = idle;
                    for p in m.iter_mut().filter(|p| p.session == session) {
                        p.idle = idle;
                    }
                }
                EvOp::Protect { page, until } => {
                    if let Some(id) = d.find(ns, &PageHash::from_u64(page as u64)) {
                        d.order_mut().set_class(id, EvictClass::Protected { until_ms: until as u64 });
                        m[page as usize].protected_until = Some(until);
                    }
                }
                EvOp::Expire { now } => {
                    d.order_mut().expire_protection(now as u64);
                    for (i, p) in m.iter_mut().enumerate() {
                        if p.protected_until.is_some_and(|u| u <= now) {
                            p.protected_until = None;
                            expired[i] = true;
                        }
                    }
                }
            }
            // A page with no state left is released, and with it its session and class.
            for (i, p) in m.iter_mut().enumerate() {
                let live = p.complete.iter().any(|&c| c) || p.inflight || p.pinned.iter().any(|&c| c);
                if live {
                    continue;
                }
                if let Some(id) = d.find(ns, &PageHash::from_u64(i as u64)) {
                    d.release_if_empty(id);
                }
                if d.find(ns, &PageHash::from_u64(i as u64)).is_none() {
                    *p = EvModel::default();
                }
            }
            let expired_now = std::mem::take(&mut expired);
            let expired = expired_now;
            // Pages that change bucket in one call share a time: their order among
            // themselves is the call's (expiry order, a session's list), not the model's.
            clock += 1;
            for (k, tier) in [TierKind::Host, TierKind::Pool].into_iter().enumerate() {
                for (i, p) in m.iter().enumerate() {
                    let t = tier.index();
                    let want = (p.complete[t] && !p.pinned[t] && !p.inflight && p.protected_until.is_none())
                        .then_some((!p.idle, p.retain));
                    let have = at[i][k].map(|(b, _)| b);
                    if expired[i] && want.is_some() {
                        // A protection that ran out: at the head of the bucket.
                        at[i][k] = want.map(|b| (b, -clock));
                    } else if want != have || (want.is_some() && touched == Some(i)) {
                        at[i][k] = want.map(|b| (b, clock));
                    }
                }
                let got: Vec<usize> = d
                    .order()
                    .victims(tier, 100, |_| false)
                    .into_iter()
                    .map(|id| (0..10).find(|&i| d.info(id).hash == PageHash::from_u64(i as u64)).unwrap())
                    .collect();
                let mut got_set = got.clone();
                got_set.sort();
                let want: Vec<usize> = (0..10).filter(|&i| at[i][k].is_some()).collect();
                prop_assert_eq!(&got_set, &want, "{:?} set", tier);
                let keys: Vec<Entered> = got.iter().map(|&i| at[i][k].unwrap()).collect();
                prop_assert!(keys.windows(2).all(|w| w[0] <= w[1]), "{:?} order {:?}", tier, keys);
                prop_assert_eq!(d.order().evictable(tier), want.len());
                // Skipping pages steps over them and keeps the order.
                let skip_first = d.order().victims(tier, 100, |id| Some(id) == d.order().victims(tier, 1, |_| false).first().copied());
                prop_assert_eq!(skip_first.len(), want.len().saturating_sub(1));
            }
        }
    }
}

#[test]
fn a_protected_page_is_not_a_victim_until_its_ttl_or_a_load() {
    let (mut d, ns) = dir_with(LayoutSpec::mha(2, 2, 8, 2, 4).build().unwrap());
    let ids: Vec<PageId> = (0..3)
        .map(|i| {
            let id = d.find_or_insert(ns, &PageHash::from_u64(i)).unwrap();
            d.set_page(id, TierKind::Host, true);
            id
        })
        .collect();
    d.order_mut().set_class(ids[0], EvictClass::Protected { until_ms: 100 });
    d.order_mut().set_class(ids[1], EvictClass::Protected { until_ms: 50 });
    assert_eq!(d.order().victims(TierKind::Host, 3, |_| false), vec![ids[2]]);
    assert_eq!(
        (d.order().protected_pages(), d.order().next_protection_expiry()),
        (2, Some(50))
    );
    assert_eq!(d.order_mut().expire_protection(49), 0);
    assert_eq!(d.order_mut().expire_protection(50), 1);
    // Staged and never loaded: at the head of its bucket, the next victim.
    assert_eq!(d.order().victims(TierKind::Host, 3, |_| false), vec![ids[1], ids[2]]);
    // A load (a hit) ends protection before the TTL, and is an access: at the tail.
    d.order_mut().touch(ids[0], true);
    assert_eq!(
        d.order().victims(TierKind::Host, 3, |_| false),
        vec![ids[1], ids[2], ids[0]]
    );
    assert_eq!(d.order().protected_pages(), 0);
    assert_eq!(
        d.order_mut().expire_protection(1_000),
        0,
        "the stale heap entry ends nothing"
    );
    // Idle sessions' pages go first, whatever their recency.
    d.order_mut().set_session(ids[0], 9);
    d.order_mut().set_session_idle(9, true);
    assert_eq!(d.order().victims(TierKind::Host, 1, |_| false), vec![ids[0]]);
    assert_eq!(d.order().session_pages(9), vec![ids[0]]);
    d.order_mut().end_session(9);
    assert!(d.order().is_idle_class(ids[0]), "an ended session's pages stay first");
}

#[test]
fn find_or_insert_fresh_says_once_that_it_created_the_record_and_untouched_follows_the_marks() {
    let (mut d, ns) = dir_with(LayoutSpec::mha(2, 1, 64, 2, 16).build().unwrap());
    let h = PageHash::from_u64(7);
    let (id, fresh) = d.find_or_insert_fresh(ns, &h).unwrap();
    assert!(fresh);
    assert_eq!(d.find_or_insert_fresh(ns, &h).unwrap(), (id, false));
    assert_eq!(d.find(ns, &h), Some(id));
    assert!(d.find_or_insert_fresh(NamespaceId(9), &h).is_err());
    assert!(d.objects().untouched(id, TierKind::Host));
    d.set_inflight_objects(id, TierKind::Host, &[1], true).unwrap();
    assert!(!d.objects().untouched(id, TierKind::Host));
    d.set_objects(id, TierKind::Host, &[1], true).unwrap();
    d.set_inflight_objects(id, TierKind::Host, &[1], false).unwrap();
    assert!(
        !d.objects().untouched(id, TierKind::Host),
        "one object present: partial"
    );
    assert!(d.objects().untouched(id, TierKind::Pool));
    d.set_objects(id, TierKind::Host, &[1], false).unwrap();
    // The page had nothing left anywhere: its record is gone, and a new one is fresh.
    assert_eq!(d.find(ns, &h), None);
    assert!(d.find_or_insert_fresh(ns, &h).unwrap().1);
}

#[test]
fn a_full_directory_forgets_pages_only_engines_hold_oldest_first() {
    let layout = LayoutSpec::mha(2, 2, 8, 2, 16).with_parallel(2, 1).build().unwrap();
    let mut d = Directory::new(128);
    let ns = d.register(Namespace::model("m"), layout).unwrap();
    let h = PageHash::from_u64;
    // 64 pages kvtier holds on host, then 64 that only engines hold on device (one rank's
    // objects each: partial, as one rank of two reports), each touched in turn.
    for i in 0..128u64 {
        let id = d.find_or_insert(ns, &h(i)).unwrap();
        let tier = if i < 64 { TierKind::Host } else { TierKind::Device };
        d.set_objects(id, tier, &[0, 1], true).unwrap();
        if i < 64 {
            d.set_objects(id, tier, &[2, 3], true).unwrap();
        }
        d.order_mut().touch(id, false);
    }
    // One device page complete (both ranks), pinned: never forgotten.
    let pinned = d.find(ns, &h(64)).unwrap();
    d.set_objects(pinned, TierKind::Device, &[2, 3], true).unwrap();
    d.set_pinned(pinned, TierKind::Device, true);
    d.drain_events();
    // Full: a new page is let in by forgetting the two oldest device-only pages (128 / 64),
    // the pinned one skipped; no host page is touched.
    assert!(d.find_or_insert(ns, &h(1000)).is_ok());
    assert!(d.find(ns, &h(65)).is_none() && d.find(ns, &h(66)).is_none());
    assert!(d.find(ns, &h(64)).is_some() && d.find(ns, &h(67)).is_some());
    assert!((0..64).all(|i| d.is_complete(d.find(ns, &h(i)).unwrap(), TierKind::Host)));
    assert_eq!(d.len(), 127);
    // Only host pages and pinned ones left to forget: full is full.
    let mut d = Directory::new(4);
    let ns = d
        .register(Namespace::model("m"), LayoutSpec::mha(2, 2, 8, 2, 16).build().unwrap())
        .unwrap();
    for i in 0..4u64 {
        let id = d.find_or_insert(ns, &h(i)).unwrap();
        d.set_objects(id, TierKind::Host, &[0, 1], true).unwrap();
    }
    assert!(matches!(d.find_or_insert(ns, &h(9)), Err(DirectoryError::Full(4))));
}
