//! Prefix lookup: `Directory::lookup_prefix` of 64-page chains over a directory of
//! 1,000,000 pages with 32-byte hashes, the engine's hot path on every request.
//!
//! Queries walk chains spread over the whole directory in a scrambled order, so the index
//! and records are cold in cache as they are under real traffic (a few prepared chains
//! would stay in cache and flatter the figure).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier::directory::Directory;
use kvtier::{LayoutSpec, Namespace, PageHash, TierKind};

const PAGES: usize = 1_000_000;
const CHAIN: usize = 64;

fn hash(i: usize) -> PageHash {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i as u64).to_le_bytes());
    b[8..16].copy_from_slice(&(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    PageHash::new(&b).expect("32 bytes is a valid hash length")
}

fn bench(c: &mut Criterion) {
    let layout = LayoutSpec::mha(32, 8, 128, 2, 16)
        .with_parallel(2, 1)
        .build()
        .expect("valid layout");
    let mut dir = Directory::new(PAGES + 1);
    let ns = dir
        .register(Namespace::model("bench"), layout)
        .expect("first namespace");
    let hashes: Vec<PageHash> = (0..PAGES).map(hash).collect();
    for (i, h) in hashes.iter().enumerate() {
        let id = dir.find_or_insert(ns, h).expect("room for every page");
        dir.set_page(id, TierKind::Host, true);
        // Every fourth chain has its first half on device too, so credit is split.
        if (i / CHAIN).is_multiple_of(4) && i % CHAIN < CHAIN / 2 {
            dir.set_page(id, TierKind::Device, true);
        }
    }
    dir.drain_events();
    let chains = PAGES / CHAIN;
    // A multiplicative step coprime with the chain count visits every chain once per cycle.
    let step = 7_919 % chains;
    let mut at = 0usize;
    let mut g = c.benchmark_group("prefix_lookup");
    g.throughput(Throughput::Elements(CHAIN as u64));
    g.bench_function("chain64_of_1M_pages", |b| {
        b.iter(|| {
            at = (at + step) % chains;
            let hit = dir.lookup_prefix(ns, black_box(&hashes[at * CHAIN..(at + 1) * CHAIN]));
            assert_eq!(hit.total(), CHAIN, "every page of every chain is stored");
            hit
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
