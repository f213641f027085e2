//! Eviction victim selection: what the manager does when the host tier crosses its
//! watermark: take a batch of 64 victims in eviction order (idle sessions first, then low
//! retain priority, then least recently used).
//!
//! Three figures over 100,000 host pages: the directory's lists (`victims`, what the
//! manager runs), and for reference the scan it replaced (`eviction_candidates`, then a
//! partial sort by `evict_key`, the order the lists keep) and that sort alone on a
//! prepared candidate list.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvtier::directory::{Directory, PageId};
use kvtier::{LayoutSpec, Namespace, PageHash, TierKind};

const PAGES: u64 = 100_000;
const VICTIMS: usize = 64;

fn bench(c: &mut Criterion) {
    let layout = LayoutSpec::mha(32, 8, 128, 2, 16).build().expect("valid layout");
    let mut dir = Directory::new(PAGES as usize + 1);
    let ns = dir
        .register(Namespace::model("bench"), layout)
        .expect("first namespace");
    let ids: Vec<_> = (0..PAGES)
        .map(|i| {
            let id = dir.find_or_insert(ns, &PageHash::from_u64(i)).expect("room");
            dir.set_page(id, TierKind::Host, true);
            // A spread of sessions and retain priorities, so every key field matters.
            dir.order_mut().set_session(id, (i % 97) as u32 + 1);
            dir.order_mut().set_retain(id, (i % 5) as i8 - 2);
            id
        })
        .collect();
    for s in (1..=97u32).filter(|s| s.is_multiple_of(3)) {
        dir.order_mut().set_session_idle(s, true);
    }
    // Access times in a scrambled order (61,813 is prime, so the walk visits every page
    // once), so the candidate list is not already in LRU order.
    for j in 0..PAGES {
        dir.order_mut().touch(ids[(j * 61_813 % PAGES) as usize], false);
    }
    dir.drain_events();
    // The scan: the `n` first candidates by the directory's eviction key.
    let select = |mut cands: Vec<(PageId, (bool, i8, u64))>, n: usize| {
        cands.select_nth_unstable_by_key(n, |c| c.1);
        cands.truncate(n);
        cands.sort_unstable_by_key(|c| c.1);
        cands.into_iter().map(|c| c.0).collect::<Vec<_>>()
    };
    let keyed = |dir: &Directory| {
        dir.order()
            .eviction_candidates(TierKind::Host)
            .into_iter()
            .map(|(id, _)| (id, dir.order().evict_key(id)))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        select(keyed(&dir), VICTIMS),
        dir.order().victims(TierKind::Host, VICTIMS, |_| false),
        "the lists keep the order the scan finds"
    );
    let mut g = c.benchmark_group("eviction");
    g.bench_function("lists_64_of_100k", |b| {
        b.iter(|| {
            let v = dir.order().victims(TierKind::Host, VICTIMS, |_| false);
            assert_eq!(v.len(), VICTIMS);
            v
        })
    });
    g.bench_function("candidates_and_select_64_of_100k", |b| {
        b.iter(|| {
            let v = select(keyed(&dir), VICTIMS);
            assert_eq!(v.len(), VICTIMS);
            v
        })
    });
    let cands = keyed(&dir);
    assert_eq!(cands.len(), PAGES as usize);
    g.bench_function("select_64_of_100k", |b| {
        b.iter_batched(
            || cands.clone(),
            |cs| {
                let v = select(black_box(cs), VICTIMS);
                assert_eq!(v.len(), VICTIMS);
                v
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
