//! `kvtier bench recovery`: how long a restarted daemon takes to recover its host arena
//! from the manifest, beside the time to only read the manifest file.
//!
//! A first life stores `pages` pages (every object's bytes distinct) through the daemon's
//! backend, as engines' commits do, and ends without a clean shutdown (as a SIGKILL
//! would: the manifest is the append-only log, not compacted). A second life opens the
//! same arena with recovery on; its open is the figure (`seconds_100k` scales it to
//! 100,000 pages). The reference, taken in the same run right before, is reading the
//! manifest file into memory: recovery must read it too, and does constant work per
//! page beyond that (parse, checksum each object, book its slots).

use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;

use crate::clock::SystemClock;
use crate::daemon::backend::{Backend, ManagedTiers, TiersConfig};
use crate::layout::LayoutSpec;
use crate::manager::Tunables;
use crate::page::{Namespace, PageHash};
use crate::tier::host::{ArenaOptions, SlotId};

#[derive(Debug, Args)]
pub struct RecoveryArgs {
    /// Pages stored before the restart.
    #[arg(long, default_value_t = 100_000)]
    pub pages: usize,
    /// Tokens per page (objects are `tokens * 2 heads * 64 dims * 2 bytes`, K and V).
    #[arg(long, default_value_t = 4)]
    pub page_tokens: u32,
    /// Restarts measured (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct RecoveryReport {
    pub pages: usize,
    pub objects: usize,
    pub object_bytes: u64,
    pub manifest_bytes: u64,
    /// Pages the second life recovered (must be `pages`).
    pub recovered: u64,
    /// Median time to open the tiers with recovery, in seconds.
    pub seconds: f64,
    /// `seconds` scaled to 100,000 pages (goal: at most 3).
    pub seconds_100k: f64,
    /// Median time to read the manifest file alone, in seconds (the reference).
    pub manifest_read_seconds: f64,
    /// `seconds / manifest_read_seconds`.
    pub ratio: f64,
}

fn config(dir: &std::path::Path, arena_bytes: u64, slot_bytes: u64, pages: usize, recover: bool) -> TiersConfig {
    TiersConfig {
        arena_path: dir.join("arena"),
        arena_bytes,
        slot_bytes,
        pool_bytes: 0,
        shared_pool: None,
        max_pages: pages + 1024,
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
        event_ring: 1 << 16,
        policy: None,
        request_traces: None,
        worker_nice: 0,
        worker_cores: Vec::new(),
    }
}

pub fn run(args: RecoveryArgs) -> anyhow::Result<()> {
    let r = measure(&args)?;
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "recovery of {} pages ({} objects of {} bytes, manifest {} bytes): {:.3} s ({:.3} s per 100k pages); reading the manifest alone: {:.3} s; ratio {:.1}",
            r.pages,
            r.objects,
            r.object_bytes,
            r.manifest_bytes,
            r.seconds,
            r.seconds_100k,
            r.manifest_read_seconds,
            r.ratio
        );
    }
    Ok(())
}

pub fn measure(args: &RecoveryArgs) -> anyhow::Result<RecoveryReport> {
    anyhow::ensure!(args.pages > 0, "--pages must be positive");
    let spec = LayoutSpec::mha(1, 2, 64, 2, args.page_tokens);
    let layout = spec.clone().build()?;
    let object_bytes = layout.object_bytes(0);
    let slot_bytes = object_bytes.div_ceil(64) * 64;
    let objects = args.pages * layout.object_count();
    let arena_bytes = slot_bytes * objects as u64;
    let dir = tempfile::tempdir()?;
    let ns = Namespace::model("bench-recovery");
    {
        let b = ManagedTiers::open(
            config(dir.path(), arena_bytes, slot_bytes, args.pages, false),
            SystemClock::new(),
        )?;
        let reg = b.register(&ns, &spec)?;
        let arena = b
            .manager()
            .stores()
            .arena()
            .ok_or_else(|| anyhow::anyhow!("no arena"))?;
        let hashes: Vec<PageHash> = (0..args.pages as u64).map(|i| PageHash::from_u64(i + 1)).collect();
        for batch in hashes.chunks(256) {
            let (grant, pages) = b.begin_store(reg.ns, 0, 0, batch, "", 1)?;
            for p in &pages {
                for s in &p.slots {
                    // SAFETY: the grant gives this writer the slot until it commits.
                    let bytes = unsafe { arena.slot_mut(SlotId(s.slot), object_bytes as usize)? };
                    bytes.fill(s.slot as u8);
                    bytes[..4].copy_from_slice(&s.slot.to_le_bytes());
                }
            }
            b.commit_store(grant, &vec![true; pages.len()])?;
        }
        // No shutdown: the next life finds the manifest as a crash leaves it.
    }
    let manifest = dir.path().join("arena.manifest");
    let manifest_bytes = std::fs::metadata(&manifest)?.len();
    let cfg = config(dir.path(), arena_bytes, slot_bytes, args.pages, true);
    let (mut opens, mut reads) = (Vec::new(), Vec::new());
    let mut recovered = 0;
    for _ in 0..args.runs.max(1) {
        let t = Instant::now();
        let bytes = std::fs::read(&manifest)?;
        reads.push(t.elapsed());
        anyhow::ensure!(!bytes.is_empty(), "the manifest is empty");
        drop(bytes);
        let t = Instant::now();
        let b = ManagedTiers::open(cfg.clone(), SystemClock::new())?;
        opens.push(t.elapsed());
        recovered = b.stats().recovered_pages;
        anyhow::ensure!(
            recovered == args.pages as u64,
            "recovered {recovered} of {} pages",
            args.pages
        );
        // Dropped without a shutdown, again: the next run recovers the same way.
        drop(b);
    }
    opens.sort();
    reads.sort();
    let seconds = opens[opens.len() / 2].as_secs_f64();
    let read = reads[reads.len() / 2].as_secs_f64();
    Ok(RecoveryReport {
        pages: args.pages,
        objects,
        object_bytes,
        manifest_bytes,
        recovered,
        seconds,
        seconds_100k: seconds * 100_000.0 / args.pages as f64,
        manifest_read_seconds: read,
        ratio: seconds / read.max(1e-9),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_recovery_bench_recovers_every_page() {
        let r = measure(&RecoveryArgs {
            pages: 2000,
            page_tokens: 4,
            runs: 1,
            json: true,
        })
        .unwrap();
        assert_eq!((r.recovered, r.objects), (2000, 4000));
        assert!(r.seconds > 0.0 && r.manifest_read_seconds > 0.0);
        assert!(r.manifest_bytes > 4000 * 40, "{}", r.manifest_bytes);
    }
}
