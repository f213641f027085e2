//! The `remote_lookup` row of `kvtier bench pool --backend mooncake`: a 64-page prefix
//! lookup that misses in a node's directory and hits in the store, where another node
//! wrote every object of every page.
//!
//! Two nodes on one master. The writer (node A) is this process's own Mooncake pool
//! backend; the subject (node B) is a real `kvtier serve --pool-kind mooncake` child, asked
//! through its control socket by an engine rank (the client library), as an engine asks.
//! Each round the writer stores 64 fresh TP=2 pages (256 objects); then the subject's
//! lookup and the reference, the wheel's own `batch_is_exist` over the same 256 keys timed
//! inside the writer's helper (the Python client as HiCache calls it), run one after the
//! other, alternating which goes first. Medians over rounds; the goal is a ratio of at
//! most 1.5.
//!
//! The subject's cache never answers for it: every round's pages are new (hashes no round
//! used before, so the daemon has neither a directory record nor a cached answer for
//! them), and a round fails unless the daemon's own counters show exactly one existence
//! query for its lookup. What the row leaves out is a freshly started daemon's first
//! touches of memory: the subject's directory is sized to its arena
//! (`max_pages = 65536`, as an operator sizes it), and a few uncounted warm-up rounds
//! let its lookup view's pages become resident, as they are in a daemon that has served
//! for a while. Without them each new page's record and index slot is a page fault, and
//! on the shared development VM those faults, not the lookup, were a fifth of the row.
//!
//! Beside the two figures the row breaks the subject's time down, from the daemon's own
//! counters read between rounds (`GET /v1/status`): `daemon_exists_p50_us` is its
//! existence query as the daemon timed it (by default the master's own `BatchExistKey`,
//! asked from the daemon's thread; with `mooncake.exists_via = "helper"` through the
//! helper), the rest of `kvtier_p50_us` is the control socket and the daemon's own work.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::daemon::DaemonChild;
use super::pool::{PoolBenchArgs, Row, median};
use crate::client::{Client, ClientConfig};
use crate::layout::LayoutSpec;
use crate::page::{Namespace, PageHash};
use crate::pool::mooncake::{MooncakeConfig, MooncakePool};
use crate::pool::{PoolBackend, PoolHealth};
use crate::protocol::Identity;

/// Pages in the looked-up prefix.
const PAGES: usize = 64;
/// The subject daemon's key tag (its keys are computed here with the same scheme).
const TAG: &str = "kvbench";
/// How long the subject may take to reach the store and credit a first prefix.
const WARM_WAIT: Duration = Duration::from_secs(60);
/// Uncounted rounds after the first credited one (see the module doc).
const WARM_ROUNDS: usize = 4;
/// The subject's directory size: 16 times the pages its 64 MiB arena holds.
const SUBJECT_MAX_PAGES: usize = 65_536;

fn config(args: &PoolBenchArgs) -> MooncakeConfig {
    let c = MooncakeConfig::new(&args.master, &args.metadata).with_segment_bytes(256 << 20);
    match &args.python {
        Some(p) => c.with_python(p),
        None => c,
    }
}

/// `kvtier serve --pool-kind mooncake` on the bench's master: node B.
fn subject_daemon(args: &PoolBenchArgs, slot_bytes: u64) -> anyhow::Result<DaemonChild> {
    let exe = std::env::current_exe().context("this executable")?;
    let quote = |s: &str| format!("{s:?}");
    let mut pool = vec![
        "--pool-kind".to_string(),
        "mooncake".into(),
        "--mooncake-master".into(),
        args.master.clone(),
    ];
    let mut set = |k: &str, v: String| pool.extend(["--set".to_string(), format!("{k}={v}")]);
    set("mooncake.metadata", quote(&args.metadata));
    set("mooncake.key_tag", quote(TAG));
    set("mooncake.global_segment_bytes", (64u64 << 20).to_string());
    set("tiers.max_pages", SUBJECT_MAX_PAGES.to_string());
    if let Some(p) = &args.python {
        set("mooncake.python", quote(&p.display().to_string()));
    }
    DaemonChild::start_with(&exe, 64 << 20, slot_bytes, &pool)
}

/// The daemon's existence-query counters: (queries, nanoseconds).
fn exists_counters(admin: &Path) -> anyhow::Result<(u64, u64)> {
    let r = crate::cli::client::request(admin, "GET", "/v1/status", None, Some(Duration::from_secs(10)))?;
    let v: serde_json::Value = serde_json::from_slice(&r.body()?)?;
    let remote = &v["pool"]["remote"];
    match (remote["exists_queries"].as_u64(), remote["exists_ns"].as_u64()) {
        (Some(q), Some(ns)) => Ok((q, ns)),
        _ => bail!("the subject's status has no discovery counters: {}", v["pool"]),
    }
}

pub(super) fn remote_lookup(args: &PoolBenchArgs) -> anyhow::Result<Row> {
    let spec = LayoutSpec::mha(4, 4, 64, 2, 16).with_parallel(2, 1);
    let layout = spec.clone().build()?;
    let obj = layout.object_bytes(0) as usize;
    let writer = MooncakePool::start(config(args), None)?;
    if writer.wait_healthy(Duration::from_secs(30)) != PoolHealth::Ok {
        bail!(
            "writer's pool not healthy (helper log in {})",
            writer.run_dir().display()
        );
    }
    let daemon = subject_daemon(args, layout.max_object_bytes()).context("the subject daemon")?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tag = format!("{}-{nanos:x}", std::process::id());
    let ns = Namespace::model(format!("bench-{tag}"));
    let identity = Identity {
        instance: format!("bench-b-{tag}"),
        namespace: ns.clone(),
        tp_rank: 0,
        tp_size: 2,
        pp_rank: 0,
        pp_size: 1,
        dp_rank: 0,
    };
    let client =
        Client::connect(ClientConfig::new(daemon.socket(), identity, spec).with_timeout(Duration::from_secs(20)))
            .context("connecting to the subject daemon")?;
    let admin: PathBuf = daemon.admin_socket();
    let scheme = crate::pool::keys::scheme_for(TAG, crate::pool::keys::KeyFormat::Kvtier, &ns, &layout);
    let zeros = vec![0u8; obj];
    let base = (std::process::id() as u64) << 32;
    let (mut k, mut r, mut d) = (Vec::new(), Vec::new(), Vec::new());
    // A round takes milliseconds, and one lookup crosses the engine, the daemon and the
    // master, whose wake-ups a shared machine delays at random: five times the put/get
    // rounds, so one slow wake-up moves the median little.
    let rounds = args.rounds * 5;
    // Round 0 waits for the subject's pool; it and the next WARM_ROUNDS warm both sides up
    // and are not counted.
    for round in 0..=rounds + WARM_ROUNDS {
        let hs: Vec<PageHash> = (0..PAGES as u64)
            .map(|i| PageHash::from_u64(base + (round * PAGES) as u64 + i))
            .collect();
        let keys: Vec<String> = hs.iter().flat_map(|h| scheme.page_keys(&layout, h)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let items: Vec<(&str, &[u8])> = refs.iter().map(|&k| (k, zeros.as_slice())).collect();
        if let Some(e) = writer.batch_put_from(&items).into_iter().find_map(Result::err) {
            bail!("writer put: {e}");
        }
        if round == 0 {
            let end = Instant::now() + WARM_WAIT;
            while client.lookup(&hs)?.pool != PAGES {
                if Instant::now() >= end {
                    bail!("the subject never credited the writer's pages (is its pool healthy?)");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            writer.remove_batch(&refs, true);
            continue;
        }
        let counted = round > WARM_ROUNDS;
        let before = exists_counters(&admin)?;
        let subject = || -> anyhow::Result<f64> {
            let t = Instant::now();
            let hit = client.lookup(&hs)?;
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
        let after = exists_counters(&admin)?;
        if after.0 != before.0 + 1 {
            bail!(
                "the subject sent {} existence queries for one lookup, not 1",
                after.0 - before.0
            );
        }
        if counted {
            k.push(ks);
            r.push(rs);
            d.push((after.1 - before.1) as f64 * 1e-9);
        }
        writer.remove_batch(&refs, true);
    }
    let (kp, rp, dp) = (median(k) * 1e6, median(r) * 1e6, median(d) * 1e6);
    Ok(Row {
        backend: "mooncake",
        op: "remote_lookup",
        object_bytes: obj,
        objects: PAGES * layout.object_count(),
        batch: PAGES * layout.object_count(),
        rounds,
        kvtier_gbps: 0.0,
        raw_gbps: 0.0,
        ratio: kp / rp.max(1e-9),
        reference: "wheel python client batch_is_exist, same keys; subject: a second kvtier serve, \
                    through its socket (goal: ratio <= 1.5)",
        failed: 0,
        corrupt: 0,
        kvtier_p50_us: Some(kp),
        raw_p50_us: Some(rp),
        daemon_exists_p50_us: Some(dp),
    })
}
