//! `kvtier bench evict`: eviction per victim, and what it does to lookups, over a large
//! directory held at its high watermark by a steady store stream.
//!
//! The directory sits behind a `parking_lot::RwLock`, as in the manager, and the threads
//! follow the manager's discipline: a store takes the write lock per batch of pages; an
//! eviction round walks the host eviction lists under the read lock (`Directory::victims`)
//! and takes the write lock once per batch of 64 victims to drop them. Lookups go where
//! the manager's `lookup` goes: the directory's lock-free view (`DirView::lookup_prefix`),
//! with no lock. One thread stores and evicts; another times prefix lookups of recently
//! stored chains. The lookup figure is measured twice in the same run, interleaved slice
//! by slice: with the store/evict thread parked (idle) and running (during eviction);
//! their ratio is the figure to read. A third slice kind, also during eviction, times
//! the same lookups under the directory's read lock (what lookups did before they had
//! the view): the reference that shows what the lock-free path saves.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use parking_lot::RwLock;
use serde::Serialize;

use super::control::percentile;
use crate::directory::{DirView, Directory};
use crate::layout::LayoutSpec;
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::tier::TierKind;

/// Victims dropped per write lock, as the manager's pool batch.
const BATCH: usize = 64;
/// Pages per lookup chain.
const CHAIN: usize = 16;

#[derive(Debug, Args)]
pub struct EvictArgs {
    /// Pages in the directory at its high watermark.
    #[arg(long, default_value_t = 4_000_000)]
    pub pages: usize,
    /// Interleaved slice triples (idle, during eviction, during eviction under the read
    /// lock; each `slice_ms` long).
    #[arg(long, default_value_t = 6)]
    pub slices: usize,
    /// Length of each slice in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub slice_ms: u64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct EvictReport {
    pub pages: usize,
    /// Pages evicted while measuring, and rounds (each reclaims to `pages - reclaim`).
    pub evicted: usize,
    pub reclaim_pages: usize,
    /// p99 and p50 of one batch's cost (victim walk under the read lock, drop under the
    /// write lock) divided by its victims, in microseconds; in the slices whose lookups
    /// use the lock-free view (the manager's path).
    pub evict_p99_us: f64,
    pub evict_p50_us: f64,
    /// p99 of one prefix lookup of a 16-page chain while the store stream and eviction
    /// run, and with them parked, in microseconds; measured in interleaved slices.
    pub lookup_p99_us_during_eviction: f64,
    pub lookup_p99_us_idle: f64,
    /// `lookup_p99_us_during_eviction / lookup_p99_us_idle` (goal: at most 2).
    pub ratio: f64,
    /// The reference: p99 of the same lookups during eviction taken under the
    /// directory's read lock, as lookups were before the lock-free view, and its ratio
    /// to idle.
    pub lookup_p99_us_during_eviction_locked: f64,
    pub locked_ratio: f64,
    /// p99.9 of the three, where waits behind a writer show first.
    pub lookup_p999_us_idle: f64,
    pub lookup_p999_us_during_eviction: f64,
    pub lookup_p999_us_during_eviction_locked: f64,
    pub lookups_during: usize,
    pub lookups_idle: usize,
    pub lookups_locked: usize,
    /// Lookups that found their whole chain (recent pages are rarely victims).
    pub full_hits: usize,
    pub bytes_per_page: f64,
}

fn hash(i: usize) -> PageHash {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i as u64).to_le_bytes());
    b[8..16].copy_from_slice(&(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    PageHash::new(&b).unwrap_or_else(|_| PageHash::from_u64(i as u64))
}

/// Stores page `i` complete on host with a spread of sessions and retain levels, so the
/// eviction lists have several classes to walk.
fn store(dir: &mut Directory, ns: NamespaceId, i: usize) -> anyhow::Result<()> {
    let id = dir.find_or_insert(ns, &hash(i))?;
    dir.set_page(id, TierKind::Host, true);
    dir.order_mut().set_session(id, (i % 97) as u32 + 1);
    if i.is_multiple_of(8) {
        dir.order_mut().set_retain(id, 1);
    }
    dir.order_mut().touch(id, false);
    Ok(())
}

/// The store/evict thread's state, shared with the lookups for the live window.
struct Shared {
    dir: RwLock<Directory>,
    /// The directory's read view, which lookups use without the lock.
    view: Arc<DirView>,
    ns: NamespaceId,
    /// Next page index to store.
    next: AtomicUsize,
    run: AtomicBool,
    /// The lookups run under the read lock (reference slices): the eviction costs of
    /// these slices are kept apart, since readers holding the lock delay the writer.
    locked: AtomicBool,
    stop: AtomicBool,
}

/// Stores a batch; when the directory reaches `high`, evicts down to `target` in
/// batches, recording each batch's per-victim cost.
fn store_and_evict(s: &Shared, high: usize, target: usize, costs: &mut Vec<f64>) -> anyhow::Result<usize> {
    let start = s.next.load(Ordering::Relaxed);
    {
        let mut d = s.dir.write();
        for i in start..start + BATCH {
            store(&mut d, s.ns, i)?;
        }
        d.drain_events();
    }
    s.next.store(start + BATCH, Ordering::Release);
    let mut evicted = 0;
    if s.dir.read().complete_count(TierKind::Host) < high {
        return Ok(0);
    }
    loop {
        let t = Instant::now();
        let victims = {
            let d = s.dir.read();
            let over = d.complete_count(TierKind::Host).saturating_sub(target);
            if over == 0 {
                break;
            }
            d.order().victims(TierKind::Host, over.min(BATCH), |_| false)
        };
        if victims.is_empty() {
            break;
        }
        {
            let mut d = s.dir.write();
            for &v in &victims {
                d.set_page(v, TierKind::Host, false);
            }
            d.drain_events();
        }
        let cost = t.elapsed().as_secs_f64() * 1e6 / victims.len() as f64;
        if !s.locked.load(Ordering::Acquire) {
            costs.push(cost);
        }
        evicted += victims.len();
    }
    Ok(evicted)
}

pub fn measure(args: &EvictArgs) -> anyhow::Result<EvictReport> {
    anyhow::ensure!(
        args.pages >= 4 * BATCH * CHAIN,
        "--pages must be at least {}",
        4 * BATCH * CHAIN
    );
    let layout = LayoutSpec::mha(32, 8, 128, 2, 16).with_parallel(2, 1).build()?;
    let reclaim = (args.pages / 256).max(BATCH);
    let mut dir = Directory::new(args.pages + 2 * BATCH);
    let ns = dir.register(Namespace::model("bench"), layout)?;
    for i in 0..args.pages - BATCH {
        store(&mut dir, ns, i)?;
        if i.is_multiple_of(65_536) {
            dir.drain_events();
        }
    }
    dir.drain_events();
    let bytes_per_page = dir.heap_bytes() as f64 / args.pages as f64;
    let shared = Arc::new(Shared {
        view: dir.view(),
        dir: RwLock::new(dir),
        ns,
        next: AtomicUsize::new(args.pages - BATCH),
        run: AtomicBool::new(false),
        locked: AtomicBool::new(false),
        stop: AtomicBool::new(false),
    });
    let (high, target) = (args.pages, args.pages - reclaim);
    let writer = {
        let s = shared.clone();
        std::thread::spawn(move || -> anyhow::Result<(Vec<f64>, usize)> {
            let mut costs = Vec::new();
            let mut evicted = 0;
            while !s.stop.load(Ordering::Acquire) {
                if s.run.load(Ordering::Acquire) {
                    evicted += store_and_evict(&s, high, target, &mut costs)?;
                } else {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Ok((costs, evicted))
        })
    };
    // Lookups of chains among the most recent pages (still resident: eviction takes the
    // least recently used first), on this thread.
    let (mut idle, mut during, mut locked) = (Vec::new(), Vec::new(), Vec::new());
    let mut full_hits = 0;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut chain = Vec::with_capacity(CHAIN);
    for slice in 0..3 * args.slices.max(1) {
        let (busy, under_lock) = (slice % 3 != 0, slice % 3 == 2);
        shared.locked.store(under_lock, Ordering::Release);
        shared.run.store(busy, Ordering::Release);
        let out = match slice % 3 {
            0 => &mut idle,
            1 => &mut during,
            _ => &mut locked,
        };
        let end = Instant::now() + Duration::from_millis(args.slice_ms.max(10));
        while Instant::now() < end {
            let next = shared.next.load(Ordering::Acquire);
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let window = reclaim / 2;
            let first = next - CHAIN - (rng as usize % window);
            chain.clear();
            chain.extend((first..first + CHAIN).map(hash));
            let t = Instant::now();
            let hit = if under_lock {
                shared.dir.read().lookup_prefix(ns, &chain)
            } else {
                shared.view.lookup_prefix(ns, &chain)
            };
            out.push(t.elapsed().as_secs_f64() * 1e6);
            full_hits += usize::from(hit.total() == CHAIN);
        }
    }
    shared.stop.store(true, Ordering::Release);
    let (mut costs, evicted) = writer
        .join()
        .map_err(|_| anyhow::anyhow!("the store/evict thread panicked"))??;
    anyhow::ensure!(!costs.is_empty(), "no eviction happened; run longer slices");
    for v in [&mut costs, &mut idle, &mut during, &mut locked] {
        v.sort_by(f64::total_cmp);
    }
    let (p_idle, p_during) = (percentile(&idle, 0.99), percentile(&during, 0.99));
    let p_locked = percentile(&locked, 0.99);
    Ok(EvictReport {
        pages: args.pages,
        evicted,
        reclaim_pages: reclaim,
        evict_p99_us: percentile(&costs, 0.99),
        evict_p50_us: percentile(&costs, 0.50),
        lookup_p99_us_during_eviction: p_during,
        lookup_p99_us_idle: p_idle,
        ratio: p_during / p_idle.max(1e-9),
        lookup_p99_us_during_eviction_locked: p_locked,
        locked_ratio: p_locked / p_idle.max(1e-9),
        lookup_p999_us_idle: percentile(&idle, 0.999),
        lookup_p999_us_during_eviction: percentile(&during, 0.999),
        lookup_p999_us_during_eviction_locked: percentile(&locked, 0.999),
        lookups_during: during.len(),
        lookups_idle: idle.len(),
        lookups_locked: locked.len(),
        full_hits,
        bytes_per_page,
    })
}

pub fn run(args: EvictArgs) -> anyhow::Result<()> {
    let r = measure(&args)?;
    anyhow::ensure!(
        r.full_hits * 2 >= r.lookups_during + r.lookups_idle + r.lookups_locked,
        "recent chains should be resident, yet only {} of {} lookups hit in full",
        r.full_hits,
        r.lookups_during + r.lookups_idle + r.lookups_locked
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{} pages at the high watermark: evict p99 {:.2} us/victim (p50 {:.2}, {} evicted) | lookup p99 during eviction {:.2} us, idle {:.2} us | ratio {:.2} (goal <= 2) | reference, under the read lock: {:.2} us, ratio {:.2} | p99.9 idle {:.2} us, during {:.2} us, under the lock {:.2} us | {:.1} bytes/page",
            r.pages,
            r.evict_p99_us,
            r.evict_p50_us,
            r.evicted,
            r.lookup_p99_us_during_eviction,
            r.lookup_p99_us_idle,
            r.ratio,
            r.lookup_p99_us_during_eviction_locked,
            r.locked_ratio,
            r.lookup_p999_us_idle,
            r.lookup_p999_us_during_eviction,
            r.lookup_p999_us_during_eviction_locked,
            r.bytes_per_page
        );
    }
    Ok(())
}
