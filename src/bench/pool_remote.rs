//! The `remote_lookup` row of `kvtier bench pool --backend mooncake`: a 64-page prefix
//! lookup that misses in this node's directory and hits in the store, where another client
//! (the "other node") wrote every object of every page.
//!
//! The subject is a tier manager with discovery on and a Mooncake pool of its own (its own
//! helper and store client, as a second daemon has); each round the writer stores 64 fresh
//! TP=2 pages, then the subject's `lookup` and the reference, the wheel's own
//! `batch_is_exist` over the same 256 keys timed inside the helper, run one after the other,
//! alternating which goes first. Medians over rounds; the goal is a ratio of at most 1.5.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::pool::{PoolBenchArgs, Row, median};
use crate::clock::SystemClock;
use crate::layout::LayoutSpec;
use crate::manager::{Manager, ManagerConfig, PoolConfig, RemoteConfig};
use crate::page::{Namespace, PageHash};
use crate::pool::mooncake::{MooncakeConfig, MooncakePool};
use crate::pool::{PoolBackend, PoolHealth};

/// Pages in the looked-up prefix.
const PAGES: usize = 64;

fn config(args: &PoolBenchArgs) -> MooncakeConfig {
    let c = MooncakeConfig::new(&args.master, &args.metadata).with_segment_bytes(256 << 20);
    match &args.python {
        Some(p) => c.with_python(p),
        None => c,
    }
}

pub(super) fn remote_lookup(args: &PoolBenchArgs) -> anyhow::Result<Row> {
    let layout = LayoutSpec::mha(4, 4, 64, 2, 16).with_parallel(2, 1).build()?;
    let obj = layout.object_bytes(0) as usize;
    let writer = MooncakePool::start(config(args), None)?;
    if writer.wait_healthy(Duration::from_secs(30)) != PoolHealth::Ok {
        bail!(
            "writer's pool not healthy (helper log in {})",
            writer.run_dir().display()
        );
    }
    let dir = tempfile::Builder::new()
        .prefix("kvtier-bench-remote-")
        .tempdir_in(&args.dir)
        .context("bench directory")?;
    let mut cfg = ManagerConfig::in_dir(dir.path(), 64 * layout.page_bytes(), None);
    cfg.arena.lock = false;
    cfg.pool = PoolConfig::Mooncake(Box::new(config(args)));
    cfg.pool_key_tag = "kvbench".into();
    cfg.remote = Some(RemoteConfig::default());
    let m = Manager::new(cfg, SystemClock::new())?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tag = format!("{}-{nanos:x}", std::process::id());
    let ns = m.register_namespace(Namespace::model(format!("bench-{tag}")), layout.clone())?;
    let subject_pool = m.pool().context("the subject has a pool")?;
    let end = Instant::now() + Duration::from_secs(30);
    while subject_pool.health() != PoolHealth::Ok {
        if Instant::now() >= end {
            bail!("subject's pool not healthy: {:?}", subject_pool.health());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let scheme = m.key_scheme(ns)?;
    let zeros = vec![0u8; obj];
    let base = (std::process::id() as u64) << 32;
    let (mut k, mut r) = (Vec::new(), Vec::new());
    // Round 0 warms both sides up and is not counted.
    for round in 0..=args.rounds {
        let hs: Vec<PageHash> = (0..PAGES as u64)
            .map(|i| PageHash::from_u64(base + (round * PAGES) as u64 + i))
            .collect();
        let keys: Vec<String> = hs.iter().flat_map(|h| scheme.page_keys(&layout, h)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let items: Vec<(&str, &[u8])> = refs.iter().map(|&k| (k, zeros.as_slice())).collect();
        if let Some(e) = writer.batch_put_from(&items).into_iter().find_map(Result::err) {
            bail!("writer put: {e}");
        }
        let subject = || -> anyhow::Result<f64> {
            let t = Instant::now();
            let hit = m.lookup(ns, &hs)?;
            let s = t.elapsed().as_secs_f64();
            if hit.pool != PAGES {
                bail!("the lookup credited {} of {PAGES} pages to the pool", hit.pool);
            }
            Ok(s)
        };
        let reference = || -> anyhow::Result<f64> {
            let raw = writer.raw_exists(&refs)?;
            if raw.failed > 0 {
                bail!("raw client: {} of {} keys missing", raw.failed, refs.len());
            }
            Ok(raw.seconds)
        };
        let (ks, rs) = if round % 2 == 0 {
            let rs = reference()?;
            (subject()?, rs)
        } else {
            let ks = subject()?;
            (ks, reference()?)
        };
        if round > 0 {
            k.push(ks);
            r.push(rs);
        }
        writer.remove_batch(&refs, true);
    }
    let (kp, rp) = (median(k) * 1e6, median(r) * 1e6);
    Ok(Row {
        backend: "mooncake",
        op: "remote_lookup",
        object_bytes: obj,
        objects: PAGES * layout.object_count(),
        batch: PAGES * layout.object_count(),
        rounds: args.rounds,
        kvtier_gbps: 0.0,
        raw_gbps: 0.0,
        ratio: kp / rp.max(1e-9),
        reference: "wheel python client batch_is_exist, same keys (goal: ratio <= 1.5)",
        failed: 0,
        corrupt: 0,
        kvtier_p50_us: Some(kp),
        raw_p50_us: Some(rp),
    })
}
