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
    assert_eq!(d.missing_objects(id, TierKind::Host), vec![15]);
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
    assert_eq!(d.missing_objects(id, TierKind::Host), vec![7, 8]);
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
        Err(DirectoryError::LayoutMismatch(_))
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
    assert!(d.eviction_candidates(TierKind::Host).is_empty());
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
    assert!(Directory::record_bytes() <= 56, "{}", Directory::record_bytes());
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
                        prop_assert_eq!(d.missing_objects(id, t), missing);
                        prop_assert_eq!(d.is_inflight(id, t), inflight[p][t.index()].iter().any(|&b| b));
                        let flying: Vec<usize> = (0..4).filter(|&o| inflight[p][t.index()][o]).collect();
                        prop_assert_eq!(d.inflight_objects(id, t), flying.clone());
                        for o in 0..4 {
                            prop_assert_eq!(d.is_inflight_object(id, t, o), flying.contains(&o));
                        }
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
