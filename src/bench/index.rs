//! `kvtier bench index`: contiguous-prefix lookups per second over a directory of many
//! pages, on one thread, and the directory's bytes per page.

use std::time::Instant;

use clap::Args;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::directory::Directory;
use crate::layout::LayoutSpec;
use crate::page::{Namespace, PageHash};
use crate::tier::TierKind;

#[derive(Debug, Args)]
pub struct IndexArgs {
    /// Pages in the directory.
    #[arg(long, default_value_t = 1_000_000)]
    pub pages: usize,
    /// Pages per request chain (each lookup walks one chain).
    #[arg(long, default_value_t = 64)]
    pub chain: usize,
    /// Page lookups to time.
    #[arg(long, default_value_t = 20_000_000)]
    pub lookups: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct IndexReport {
    pub pages: usize,
    pub chain: usize,
    pub lookups: usize,
    pub lookups_per_sec: f64,
    pub bytes_per_page: f64,
    pub record_bytes: usize,
    pub hit_pages: usize,
}

/// Builds the directory (32-byte SHA-256-sized hashes, pages complete on host and every
/// fourth chain's first half on device) and times prefix lookups of random chains.
pub fn measure(args: &IndexArgs) -> IndexReport {
    let chain = args.chain.max(1);
    let mut dir = Directory::new(args.pages + 1);
    let layout = LayoutSpec::mha(32, 8, 128, 2, 16)
        .with_parallel(2, 1)
        .build()
        .expect("valid layout");
    let ns = dir
        .register(Namespace::model("bench"), layout)
        .expect("first namespace");
    let hash = |i: usize| {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&(i as u64).to_le_bytes());
        b[8..16].copy_from_slice(&(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
        PageHash::new(&b).expect("32 bytes")
    };
    for i in 0..args.pages {
        let id = dir.find_or_insert(ns, &hash(i)).expect("room for every page");
        dir.set_page(id, TierKind::Host, true);
        if (i / chain).is_multiple_of(4) && i % chain < chain / 2 {
            dir.set_page(id, TierKind::Device, true);
        }
    }
    dir.drain_events();
    let chains = (args.pages / chain).max(1);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    // Query chains are prepared up front so hashing them is not timed.
    let queries: Vec<Vec<PageHash>> = (0..1024)
        .map(|_| {
            let c = rng.gen_range(0..chains);
            (c * chain..(c + 1) * chain).map(hash).collect()
        })
        .collect();
    let rounds = args.lookups.div_ceil(chain);
    let mut hit_pages = 0usize;
    let t = Instant::now();
    for r in 0..rounds {
        let hit = dir.lookup_prefix(ns, &queries[r % queries.len()]);
        hit_pages += hit.total();
    }
    let secs = t.elapsed().as_secs_f64();
    let looked = rounds * chain;
    IndexReport {
        pages: args.pages,
        chain,
        lookups: looked,
        lookups_per_sec: looked as f64 / secs.max(1e-12),
        bytes_per_page: dir.heap_bytes() as f64 / args.pages.max(1) as f64,
        record_bytes: Directory::record_bytes(),
        hit_pages,
    }
}

pub fn run(args: IndexArgs) -> anyhow::Result<()> {
    let r = measure(&args);
    anyhow::ensure!(
        r.hit_pages == r.lookups,
        "every queried page is stored, yet {} of {} hit",
        r.hit_pages,
        r.lookups
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{} pages: {:.1} M page lookups/s (one thread, chains of {}), {:.1} bytes/page (record {} B)",
            r.pages,
            r.lookups_per_sec / 1e6,
            r.chain,
            r.bytes_per_page,
            r.record_bytes
        );
    }
    Ok(())
}
