//! `kvtier bench pool`: put and get throughput of pool objects through kvtier's backend,
//! against a reference measured in the same run on the same bytes.
//!
//! For `--backend mooncake` the reference is the wheel's own Python client: the helper
//! times `batch_put_from` / `batch_get_into` of the same objects, in the same batches,
//! from the same registered arena, against the same master. For `--backend local` the
//! reference is a plain memcpy of the same bytes. Rounds alternate which side goes first;
//! each figure is the median over rounds.

mod mac;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::PageAligned;
use crate::pool::PoolBackend;
use crate::pool::local::LocalPool;
use crate::pool::mooncake::{MooncakeConfig, MooncakePool};
use crate::tier::device::pattern;
use crate::tier::host::{ArenaOptions, HostArena, SlotId};
use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Mooncake,
    Local,
}

/// Options of `kvtier bench pool`.
#[derive(Args, Debug)]
pub struct PoolBenchArgs {
    /// Which pool backend to measure.
    #[arg(long, value_enum, default_value = "mooncake")]
    pub backend: Backend,
    /// Print JSON rows instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Object sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "65536,1048576")]
    pub sizes: Vec<usize>,
    /// Bytes moved per operation and round, per size.
    #[arg(long, default_value_t = 128 << 20)]
    pub bytes: usize,
    /// Bytes per batch (objects per batch = this / object size, at least 1).
    #[arg(long, default_value_t = 64 << 20)]
    pub batch_bytes: usize,
    /// Rounds per size; figures are medians.
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Mooncake master `host:port`.
    #[arg(long, env = "KVTIER_MOONCAKE_MASTER", default_value = "127.0.0.1:50051")]
    pub master: String,
    /// Mooncake metadata server URL.
    #[arg(
        long,
        env = "KVTIER_MOONCAKE_METADATA",
        default_value = "http://127.0.0.1:8080/metadata"
    )]
    pub metadata: String,
    /// Python interpreter with the Mooncake wheel; a relative path is taken from the
    /// current directory here (the daemon itself refuses relative paths). Default: `python3`
    /// from `PATH`.
    #[arg(long, env = "KVTIER_MOONCAKE_PYTHON", value_parser = absolute_path)]
    pub python: Option<PathBuf>,
    /// The master's admin HTTP address (its `--metrics_port`), where the subject's pool
    /// index lists the store.
    #[arg(long, env = "KVTIER_MOONCAKE_MASTER_ADMIN", default_value = "127.0.0.1:9003")]
    pub master_admin: String,
    /// Pages in the store for the `index_resync` row (4 objects each); 0 skips the row.
    #[arg(long, default_value_t = 100_000)]
    pub resync_pages: usize,
    /// Mooncake: seal and check every object with the keyed MAC, as `kvtier serve` does by
    /// default (`mooncake.integrity`), under a fresh random key; `false` measures the
    /// unsealed path. Rows say which (`integrity`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub integrity: bool,
    /// Mooncake: arena slots leave room for the MAC after each object, as the daemon's
    /// default 2 MiB slots do for any object up to 2 MiB - 32 bytes, so sealed objects move
    /// straight from and into their slots; `false` makes slots exactly object-sized, which
    /// measures the staging path sealed objects take without that room.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub mac_room: bool,
    /// Directory for the benchmark's shared-memory files.
    #[arg(long, default_value = "/dev/shm")]
    pub dir: PathBuf,
}

/// One output row.
#[derive(Debug, Serialize)]
pub struct Row {
    pub backend: &'static str,
    pub op: &'static str,
    pub object_bytes: usize,
    pub objects: usize,
    pub batch: usize,
    pub rounds: usize,
    pub kvtier_gbps: f64,
    pub raw_gbps: f64,
    pub ratio: f64,
    pub reference: &'static str,
    /// Whether kvtier's side sealed and checked every object with the keyed MAC
    /// (`mooncake.integrity`); the reference never does.
    pub integrity: bool,
    /// Operations (objects) that failed, over all rounds: an error, or a get of the wrong
    /// length. The Mooncake run stops at the first failure instead.
    pub failed: usize,
    /// Objects a get returned with bytes different from what was put, over all rounds.
    /// The Mooncake run checks its warm-up round and stops at the first difference.
    pub corrupt: usize,
    /// Latency rows (`remote_lookup`): kvtier's median in µs; `ratio` is then kvtier over
    /// the reference, lower is better.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvtier_p50_us: Option<f64>,
    /// Latency rows: the reference's median in µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw_p50_us: Option<f64>,
    /// `remote_lookup`: the same lookup asked of the subject daemon through its socket
    /// (answered from its pool index), median in µs, timed in the same rounds after the
    /// engine's own answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_lookup_p50_us: Option<f64>,
    /// `remote_lookup`: a raw Unix-socket echo of the same request frame, median in µs,
    /// timed in the same rounds, placed as the subject (client on the client core, the
    /// echo's thread on the subject's core) and after the same quiet: what any socket
    /// round trip costs here, so `socket_lookup_p50_us` minus it is the daemon's share.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_echo_p50_us: Option<f64>,
    /// `remote_lookup`: the subject daemon's own time for the socket lookup, as its lookup
    /// latency histogram took it (request read to answer built), median in µs: the rest of
    /// `socket_lookup_p50_us` is the socket round trip, the engine's side and the daemon's
    /// wake-up and read path.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub daemon_lookup_p50_us: Option<f64>,
    /// `remote_lookup`: the subject daemon's existence query as it timed it (daemon →
    /// master and back), median in µs; the rest of `kvtier_p50_us` is the control socket
    /// and the daemon's own work.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub daemon_exists_p50_us: Option<f64>,
    /// Throughput rows of `--backend mooncake`: the arena slot size the objects lie in
    /// (larger than `object_bytes` when slots leave room for the MAC: `--mac-room`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot_bytes: Option<usize>,
}

pub fn run(args: PoolBenchArgs) -> anyhow::Result<()> {
    if args.rounds == 0 || args.sizes.iter().any(|&s| s == 0 || s % 64 != 0) {
        bail!("rounds must be positive and sizes non-zero multiples of 64");
    }
    let mut rows = Vec::new();
    for &size in &args.sizes {
        rows.extend(bench_size(&args, size).with_context(|| format!("objects of {size} bytes"))?);
    }
    if args.backend == Backend::Mooncake {
        rows.extend(super::pool_remote::remote_lookup(&args).context("remote lookup")?);
        if args.resync_pages > 0 {
            rows.push(super::pool_remote::index_resync(&args).context("index resync")?);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("backend   op   object_bytes objects batch kvtier_GB/s raw_GB/s ratio failed corrupt mac  reference");
        for r in &rows {
            println!(
                "{:<9} {:<4} {:>12} {:>7} {:>5} {:>11.3} {:>8.3} {:>5.2} {:>6} {:>7} {:<3}  {}",
                r.backend,
                r.op,
                r.object_bytes,
                r.objects,
                r.batch,
                r.kvtier_gbps,
                r.raw_gbps,
                r.ratio,
                r.failed,
                r.corrupt,
                if r.integrity { "on" } else { "off" },
                r.reference
            );
        }
    }
    if rows.iter().any(|r| r.failed > 0 || r.corrupt > 0) {
        bail!("some pool operations failed or returned different bytes (see the rows)");
    }
    Ok(())
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

/// Seconds `f` takes.
fn timed(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

/// Runs kvtier's side and the reference side of every batch, batch by batch, alternating
/// which goes first from round 1 on (round 0, the warm-up, runs the reference first), so
/// both meet the same machine load. Returns the total seconds of each side.
fn side_by_side(
    round: usize,
    chunks: usize,
    mut kvtier: impl FnMut(usize) -> anyhow::Result<f64>,
    mut reference: impl FnMut(usize) -> anyhow::Result<f64>,
) -> anyhow::Result<(f64, f64)> {
    let (mut k, mut r) = (0.0, 0.0);
    for c in 0..chunks {
        if round > 0 && (c + round).is_multiple_of(2) {
            k += kvtier(c)?;
            r += reference(c)?;
        } else {
            r += reference(c)?;
            k += kvtier(c)?;
        }
    }
    Ok((k, r))
}

/// What the two rows (put and get) of one measurement share.
struct Shape {
    backend: &'static str,
    reference: &'static str,
    object_bytes: usize,
    objects: usize,
    batch: usize,
    rounds: usize,
    integrity: bool,
}

impl Shape {
    /// A row from per-round seconds of kvtier (`k`) and of the reference (`r`): medians as GB/s.
    fn row(&self, op: &'static str, k: Vec<f64>, r: Vec<f64>) -> Row {
        let total = self.objects * self.object_bytes;
        let (kg, rg) = (gbps(total, median(k)), gbps(total, median(r)));
        Row {
            backend: self.backend,
            op,
            object_bytes: self.object_bytes,
            objects: self.objects,
            batch: self.batch,
            rounds: self.rounds,
            kvtier_gbps: kg,
            raw_gbps: rg,
            ratio: kg / rg.max(1e-12),
            reference: self.reference,
            integrity: self.integrity,
            failed: 0,
            corrupt: 0,
            kvtier_p50_us: None,
            raw_p50_us: None,
            socket_lookup_p50_us: None,
            socket_echo_p50_us: None,
            daemon_lookup_p50_us: None,
            daemon_exists_p50_us: None,
            slot_bytes: None,
        }
    }
}

fn bench_size(args: &PoolBenchArgs, size: usize) -> anyhow::Result<Vec<Row>> {
    let n = (args.bytes / size).max(1);
    let batch = (args.batch_bytes / size).clamp(1, 1024);
    let opts = ArenaOptions {
        lock: false,
        ..ArenaOptions::default()
    };
    let tag = format!("{}-{}", std::process::id(), size);
    let arena_path = args.dir.join(format!("kvtier-bench-arena-{tag}"));
    // Slots 0..n hold the source objects, n..2n receive gets. With `mac_room`, each slot
    // has a page-aligned tail after its object, as a daemon's slot does when it is larger
    // than the objects it holds; both sides use the same slots.
    let slot = if args.backend == Backend::Mooncake && args.mac_room {
        size + 4096
    } else {
        size
    };
    let arena = Arc::new(HostArena::create(
        &arena_path,
        (2 * n * slot) as u64,
        slot as u64,
        &opts,
    )?);
    let _cleanup = Cleanup(vec![arena_path.clone()]);
    for i in 0..n {
        // SAFETY: the bench owns every slot; nothing else maps this file.
        unsafe { arena.slot_mut(SlotId(i as u32), size)? }.copy_from_slice(&pattern(i as u64, size));
    }
    let slice = |i: usize| -> &[u8] {
        // SAFETY: as above; slices are only read while no get writes the same slot.
        unsafe { arena.slot(SlotId(i as u32), size).unwrap_or(&[]) }
    };
    let src: Vec<&[u8]> = (0..n).map(slice).collect();
    let dst: Vec<&[u8]> = (n..2 * n).map(slice).collect();
    match args.backend {
        Backend::Mooncake => bench_mooncake(args, &arena, size, batch, &src, &dst, &tag),
        Backend::Local => bench_local(args, size, batch, &src, &tag),
    }
}

/// Removes the benchmark's files on every exit path.
struct Cleanup(Vec<PathBuf>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn bench_mooncake(
    args: &PoolBenchArgs,
    arena: &Arc<HostArena>,
    size: usize,
    batch: usize,
    src: &[&[u8]],
    dst: &[&[u8]],
    tag: &str,
) -> anyhow::Result<Vec<Row>> {
    let n = src.len();
    let total = n * size;
    let mut cfg = MooncakeConfig::new(&args.master, &args.metadata)
        .with_segment_bytes((3 * total as u64).max(512 << 20))
        .with_max_batch(batch);
    if let Some(p) = &args.python {
        cfg = cfg.with_python(p);
    }
    if args.integrity {
        let mut key = [0u8; 32];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut key)?;
        cfg = cfg.with_integrity_key(&key);
    }
    let pool = MooncakePool::start(cfg, Some(arena.clone()))?;
    let h = pool.wait_healthy(Duration::from_secs(30));
    if h != crate::pool::PoolHealth::Ok {
        bail!(
            "Mooncake pool not healthy: {h:?} (helper log in {})",
            pool.run_dir().display()
        );
    }
    settle_store(&pool, src, batch, tag)?;
    let (mut kp, mut kg, mut rp, mut rg) = (vec![], vec![], vec![], vec![]);
    let chunks = n.div_ceil(batch);
    // Round 0 warms both sides up (first touch of the store's segment) and is not counted.
    for round in 0..=args.rounds {
        let kkeys: Vec<String> = (0..n).map(|i| format!("kvb-{tag}-{round}-{i}")).collect();
        let rprefix = |c: usize| format!("kvbraw-{tag}-{round}-{c}-");
        let kv_put = |c: usize| -> anyhow::Result<f64> {
            let span = c * batch..((c + 1) * batch).min(n);
            let items: Vec<(&str, &[u8])> = span.map(|i| (kkeys[i].as_str(), src[i])).collect();
            let t = Instant::now();
            if let Some(e) = pool.batch_put_from(&items).into_iter().find_map(Result::err) {
                bail!("kvtier put: {e}");
            }
            Ok(t.elapsed().as_secs_f64())
        };
        let kv_get = |c: usize, zero: bool| -> anyhow::Result<f64> {
            let mut items: Vec<(&str, &mut [u8])> = Vec::with_capacity(batch);
            let first = c * batch;
            for (i, key) in kkeys.iter().enumerate().skip(first).take(batch) {
                // SAFETY: destination slots are written only here, one batch at a time.
                let buf = unsafe { arena.slot_mut(SlotId((n + i) as u32), size)? };
                if zero {
                    buf.fill(0);
                }
                items.push((key.as_str(), buf));
            }
            let t = Instant::now();
            if let Some(e) = pool.batch_get_into(&mut items).into_iter().find_map(Result::err) {
                bail!("kvtier get: {e}");
            }
            Ok(t.elapsed().as_secs_f64())
        };
        let raw = |put: bool, c: usize| -> anyhow::Result<f64> {
            let span = c * batch..((c + 1) * batch).min(n);
            let objs = if put { &src[span] } else { &dst[span] };
            let r = pool.raw_bench(put, &rprefix(c), objs, batch)?;
            if r.failed > 0 {
                bail!("raw client: {} of {} failed", r.failed, objs.len());
            }
            Ok(r.seconds)
        };
        // Batch by batch, side by side, alternating which goes first, so both sides meet
        // the same machine load. In the warm-up round kvtier's get goes last, into zeroed
        // slots, and its bytes are checked against the source.
        let (t_kp, t_rp) = side_by_side(round, chunks, kv_put, |c| raw(true, c))?;
        let (t_kg, t_rg) = side_by_side(round, chunks, |c| kv_get(c, round == 0), |c| raw(false, c))?;
        if round == 0 {
            if src.iter().zip(dst).any(|(a, b)| a != b) {
                bail!("kvtier get returned different bytes");
            }
        } else {
            kp.push(t_kp);
            rp.push(t_rp);
            kg.push(t_kg);
            rg.push(t_rg);
        }
        let mut all: Vec<String> = (0..n).map(|i| format!("{}{}", rprefix(i / batch), i % batch)).collect();
        all.extend(kkeys.iter().cloned());
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        pool.remove_batch(&refs, true);
    }
    let shape = Shape {
        backend: "mooncake",
        reference: "wheel python client",
        object_bytes: size,
        objects: n,
        batch,
        rounds: args.rounds,
        integrity: args.integrity,
    };
    let mut rows = vec![shape.row("put", kp, rp), shape.row("get", kg, rg)];
    for r in &mut rows {
        r.slot_bytes = Some(arena.slot_bytes());
    }
    if args.integrity {
        rows.push(mac::row(&shape, src)?);
    }
    Ok(rows)
}

/// How long [`settle_store`] waits for the store to take a probe batch whole: a few times
/// the client TTL a master is run with (`scripts/mooncake-env.sh`: 3 s; upstream: 10 s).
const SETTLE_WAIT: Duration = Duration::from_secs(45);

/// Waits until the wheel's own client puts a probe batch (the first `batch` objects) with
/// no failures, removing each try's objects. A client that exited less than the master's
/// client TTL ago still has its segment mounted, and the puts the master places there fail
/// (`TRANSFER_FAIL`): kvtier's puts retry those, the raw reference does not. So a rerun of
/// the bench within seconds against one master lost a quarter to a half of the
/// reference's first puts and stopped, before anything was timed.
fn settle_store(pool: &MooncakePool, src: &[&[u8]], batch: usize, tag: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + SETTLE_WAIT;
    let probe = &src[..src.len().min(batch)];
    let mut attempt = 0usize;
    loop {
        let prefix = format!("kvbprobe-{tag}-{attempt}-");
        let r = pool.raw_bench(true, &prefix, probe, batch)?;
        let keys: Vec<String> = (0..probe.len()).map(|i| format!("{prefix}{i}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        pool.remove_batch(&refs, true);
        if r.failed == 0 {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "the store did not settle: {} of {} probe puts of the raw client still fail after {SETTLE_WAIT:?}",
                r.failed,
                probe.len()
            );
        }
        if attempt == 0 {
            eprintln!(
                "bench pool: {} of {} probe puts failed (a segment of a client that exited, still mounted?); \
                 waiting up to {SETTLE_WAIT:?} for the store to settle",
                r.failed,
                probe.len()
            );
        }
        // A poll of the store's state, bounded by the deadline above.
        std::thread::sleep(Duration::from_millis(250));
        attempt += 1;
    }
}

/// Local pool: every put and get result is counted, and every object a get returns is
/// compared with what was put. The reference is memcpy of the same bytes in the same
/// object-sized pieces, measured right after each operation, in alternating order.
fn bench_local(args: &PoolBenchArgs, size: usize, batch: usize, src: &[&[u8]], tag: &str) -> anyhow::Result<Vec<Row>> {
    let n = src.len();
    let total = n * size;
    let path = args.dir.join(format!("kvtier-bench-pool-{tag}"));
    let _cleanup = Cleanup(vec![path.clone()]);
    let opts = ArenaOptions {
        lock: false,
        ..ArenaOptions::default()
    };
    let pool = LocalPool::create(&path, total as u64, size as u64, &opts)?;
    // Page-aligned like the pool's slots, and touched here, so neither side pays
    // first-touch faults or the misaligned-copy slow path the other does not.
    let mut out = PageAligned::new(total, 0);
    let mut scratch = PageAligned::new(total, 1);
    let (mut kp, mut kg, mut rp, mut rg) = (vec![], vec![], vec![], vec![]);
    let (mut put_failed, mut get_failed, mut corrupt) = (0usize, 0usize, 0usize);
    let keys: Vec<String> = (0..n).map(|i| format!("kvb-{i}")).collect();
    let memcpy = |scratch: &mut PageAligned| {
        timed(|| {
            for (o, s) in scratch.chunks_mut(size).zip(src) {
                o.copy_from_slice(s);
            }
        })
    };
    for round in 0..args.rounds {
        let put = || {
            let mut failed = 0;
            let t = timed(|| {
                for (ks, objs) in keys.chunks(batch).zip(src.chunks(batch)) {
                    let items: Vec<(&str, &[u8])> = ks.iter().map(String::as_str).zip(objs.iter().copied()).collect();
                    failed += pool.batch_put_from(&items).iter().filter(|r| r.is_err()).count();
                }
            });
            (t, failed)
        };
        // Gets land in zeroed memory so a get that writes nothing cannot pass the check.
        out.fill(0);
        let get = |out: &mut PageAligned| {
            let mut failed = 0;
            let t = timed(|| {
                for (ks, chunk) in keys.chunks(batch).zip(out.chunks_mut(batch * size)) {
                    let mut items: Vec<(&str, &mut [u8])> =
                        ks.iter().map(String::as_str).zip(chunk.chunks_mut(size)).collect();
                    failed += pool
                        .batch_get_into(&mut items)
                        .iter()
                        .filter(|r| r.as_ref().map_or(true, |&len| len != size))
                        .count();
                }
            });
            (t, failed)
        };
        let ((tp, fp), p_ref, (tg, fg), g_ref) = if round % 2 == 0 {
            let a = put();
            let b = memcpy(&mut scratch);
            let c = get(&mut out);
            (a, b, c, memcpy(&mut scratch))
        } else {
            let b = memcpy(&mut scratch);
            let a = put();
            let d = memcpy(&mut scratch);
            (a, b, get(&mut out), d)
        };
        put_failed += fp;
        get_failed += fg;
        corrupt += out.chunks(size).zip(src).filter(|(o, s)| o != *s).count();
        kp.push(tp);
        rp.push(p_ref);
        kg.push(tg);
        rg.push(g_ref);
    }
    let shape = Shape {
        backend: "local",
        reference: "memcpy",
        object_bytes: size,
        objects: n,
        batch,
        rounds: args.rounds,
        integrity: false,
    };
    let mut put = shape.row("put", kp, rp);
    put.failed = put_failed;
    let mut get = shape.row("get", kg, rg);
    get.failed = get_failed;
    get.corrupt = corrupt;
    Ok(vec![put, get])
}

/// A command-line path made absolute against the current directory, as a shell user means it.
fn absolute_path(s: &str) -> Result<PathBuf, String> {
    std::path::absolute(s).map_err(|e| format!("{s}: {e}"))
}
