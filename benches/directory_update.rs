//! Directory update: one page stored object by object (in flight, then present, as a
//! store commits) and then removed, in a directory already holding 100,000 pages.
//!
//! This is the work the manager does under its lock for every page an engine offloads
//! and later frees, including the `stored` and `removed` events it emits.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier::directory::Directory;
use kvtier::{LayoutSpec, Namespace, PageHash, TierKind};

const RESIDENT: u64 = 100_000;

fn bench(c: &mut Criterion) {
    // TP 2, MHA: four objects (K and V per rank) per page.
    let layout = LayoutSpec::mha(32, 8, 128, 2, 16)
        .with_parallel(2, 1)
        .build()
        .expect("valid layout");
    let objects = layout.object_count();
    let mut dir = Directory::new(RESIDENT as usize + 16);
    let ns = dir
        .register(Namespace::model("bench"), layout)
        .expect("first namespace");
    for i in 0..RESIDENT {
        let id = dir.find_or_insert(ns, &PageHash::from_u64(i)).expect("room");
        dir.set_page(id, TierKind::Host, true);
    }
    dir.drain_events();
    let mut next = RESIDENT;
    let mut g = c.benchmark_group("directory_update");
    g.throughput(Throughput::Elements(1));
    g.bench_function("store_commit_then_remove_page", |b| {
        b.iter(|| {
            next += 1;
            let h = PageHash::from_u64(black_box(next));
            let id = dir
                .find_or_insert(ns, &h)
                .expect("a record was freed by the last removal");
            for obj in 0..objects {
                dir.set_inflight(id, TierKind::Host, obj, true).expect("valid object");
            }
            for obj in 0..objects {
                dir.set_inflight(id, TierKind::Host, obj, false).expect("valid object");
                dir.set_object(id, TierKind::Host, obj, true).expect("valid object");
            }
            assert!(dir.is_complete(id, TierKind::Host));
            dir.set_page(id, TierKind::Host, false);
            let events = dir.drain_events();
            assert_eq!(events.len(), 2, "one stored and one removed event per page");
            events
        })
    });
    g.finish();
    assert_eq!(dir.len(), RESIDENT as usize, "removed pages free their records");
}

criterion_group!(benches, bench);
criterion_main!(benches);
