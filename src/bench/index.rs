//! `kvtier bench index`: contiguous-prefix lookups per second over a directory of many
//! pages, on one thread, and the directory's bytes per page.

use std::collections::HashMap;
use std::time::Instant;

use clap::Args;
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
    /// Chains in the directory, and how many distinct ones the queries named.
    pub chains: usize,
    pub chains_queried: usize,
    pub lookups: usize,
    pub lookups_per_sec: f64,
    /// The reference: a std `HashMap` walked the same way over the same chains.
    pub hashmap_lookups_per_sec: f64,
    /// `lookups_per_sec / hashmap_lookups_per_sec`.
    pub ratio: f64,
    pub bytes_per_page: f64,
    pub record_bytes: usize,
    pub hit_pages: usize,
    pub hashmap_hit_pages: usize,
    pub hashmap_lookups: usize,
}

/// Builds the directory (32-byte SHA-256-sized hashes, pages complete on host and every
/// fourth chain's first half on device) and times prefix lookups of chains spread over
/// all pages, beside a `HashMap` walked over the same chains.
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
    // Every page's hash is prepared up front, so hashing is not timed, and queries can
    // name any chain: a stride coprime with the chain count walks all of them, so the
    // directory is as cold in cache as it is under real traffic.
    let hashes: Vec<PageHash> = (0..chains * chain).map(hash).collect();
    let stride = [7_919, 7_907, 7_901, 1]
        .into_iter()
        .find(|s| !chains.is_multiple_of(*s))
        .unwrap_or(1)
        % chains.max(1);
    let stride = stride.max(1);
    // The reference: a std HashMap from hash to page, walked the same way (stop at the
    // first miss), on the same queries.
    let map: HashMap<PageHash, u32> = hashes.iter().enumerate().map(|(i, h)| (*h, i as u32)).collect();
    let rounds = args.lookups.div_ceil(chain);
    let slices = 8;
    let (mut hit_pages, mut map_hits) = (0usize, 0usize);
    let (mut secs, mut map_secs, mut map_rounds) = (0.0, 0.0, 0usize);
    let mut at = 0usize;
    let next = |at: &mut usize| {
        *at = (*at + stride) % chains;
        &hashes[*at * chain..(*at + 1) * chain]
    };
    for s in 0..slices {
        let n = rounds / slices + usize::from(s < rounds % slices);
        let t = Instant::now();
        for _ in 0..n {
            hit_pages += dir.lookup_prefix(ns, next(&mut at)).total();
        }
        secs += t.elapsed().as_secs_f64();
        // A quarter as many reference lookups: the figure is a rate, and the reference
        // is several times slower.
        let m = n.div_ceil(4);
        let t = Instant::now();
        for _ in 0..m {
            map_hits += next(&mut at).iter().take_while(|h| map.contains_key(*h)).count();
        }
        map_secs += t.elapsed().as_secs_f64();
        map_rounds += m;
    }
    let looked = rounds * chain;
    let per_sec = looked as f64 / secs.max(1e-12);
    let map_per_sec = (map_rounds * chain) as f64 / map_secs.max(1e-12);
    IndexReport {
        pages: args.pages,
        chain,
        chains,
        chains_queried: (rounds + map_rounds).min(chains),
        lookups: looked,
        lookups_per_sec: per_sec,
        hashmap_lookups_per_sec: map_per_sec,
        ratio: per_sec / map_per_sec.max(1e-12),
        bytes_per_page: dir.heap_bytes() as f64 / args.pages.max(1) as f64,
        record_bytes: Directory::record_bytes(),
        hit_pages,
        hashmap_hit_pages: map_hits,
        hashmap_lookups: map_rounds * chain,
    }
}

pub fn run(args: IndexArgs) -> anyhow::Result<()> {
    let r = measure(&args);
    anyhow::ensure!(
        r.hit_pages == r.lookups && r.hashmap_hit_pages == r.hashmap_lookups,
        "every queried page is stored, yet {} of {} hit ({} of {} in the reference)",
        r.hit_pages,
        r.lookups,
        r.hashmap_hit_pages,
        r.hashmap_lookups
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{} pages: {:.1} M page lookups/s (one thread, chains of {}, {} of {} chains queried) | HashMap {:.1} M/s | ratio {:.2} | {:.1} bytes/page (record {} B)",
            r.pages,
            r.lookups_per_sec / 1e6,
            r.chain,
            r.chains_queried,
            r.chains,
            r.hashmap_lookups_per_sec / 1e6,
            r.ratio,
            r.bytes_per_page,
            r.record_bytes
        );
    }
    Ok(())
}
