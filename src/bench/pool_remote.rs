//! The `remote_lookup` row of `kvtier bench pool --backend mooncake`: a 64-page prefix
//! lookup that misses in a node's directory and hits in the store, where another node
//! wrote every object of every page, answered by an engine of that node from the node's
//! lookup file, which its pool index keeps.
//!
//! Two nodes on one master. The writer (node A) is this process's own Mooncake pool
//! backend, which announces its puts and removes as a kvtier node does, in Mooncake's
//! object event format on a ZMQ PUB socket of its own; the subject (node B) is a real
//! `kvtier serve --pool-kind mooncake` child with `mooncake.index_sources` on that socket,
//! and an engine rank of it (the client library, in this process). Each round the writer
//! stores 64 fresh TP=2 pages (256 objects) and announces them; once the subject's index
//! has applied the events, the engine's lookup and the reference, the wheel's own
//! `batch_is_exist` over the same 256 keys timed inside the writer's helper (the Python
//! client as HiCache calls it), run one after the other, alternating which goes first.
//! Then the same lookup is asked of the subject daemon through its socket
//! (`socket_lookup_p50_us`). Medians over rounds; the goal is a ratio of at most 0.1.
//!
//! A round fails unless the engine answered the lookup itself (`Client::engine_lookups`
//! grew by one and the daemon served no lookup for it), and the socket lookup was
//! answered from the daemon's index with no existence query to the master. The daemon
//! enters the pages the socket lookup credited in its directory after its reply; a round
//! waits for that (and fails unless each page was entered once). Every round's pages are
//! new (hashes no round used before), so the lookups find them through the index, not the
//! directory. A few uncounted warm-up rounds let both sides' memory become resident, as in
//! a daemon that has served for a while.
//!
//! Placed, as `kvtier bench control` places its round trips (see [`super::placement`]):
//! the rounds alternate, two at a time, between client and subject on one core
//! (`same_core`) and on two (`cross_core`). The client side is this thread (the engine
//! rank); the server side is every thread of the subject daemon. Each placement gets its
//! own row (`remote_lookup_same_core`, `remote_lookup_cross_core`), and `remote_lookup`
//! is the worse of them: each placement must meet the goal.
//!
//! The reference is timed inside the writer's helper, around the wheel's call (its round
//! trip to the master included, no IPC to the helper), as HiCache calls it in its own
//! process; the subject's time is the engine's call, in the engine.
//! Neither the helper nor the master is pinned: pinned to one core of a busy machine, the
//! helper's many client threads slowed the reference several-fold, which would flatter
//! the ratio; left to the scheduler, the reference is as fast as it gets.
//!
//! Each round also times a raw Unix-socket echo of the lookup's own request frame
//! (`socket_echo_p50_us`): a thread of this process, pinned to the subject's core, that
//! writes back what it reads. It runs after the round's last status poll and the same
//! quiet as the subject, so it pays what any socket round trip pays at that placement
//! here (two wake-ups, cold caches); the subject's time minus it is kvtier's own share.
//! On a machine whose idle cores wake slowly, the echo alone can exceed a tenth of the
//! reference, and then no socket round trip meets the goal there.
//!
//! Each round also reads the daemon's own time for the socket lookup from its lookup
//! latency histogram (`daemon_lookup_p50_us`; the round fails unless exactly one lookup
//! was timed between its two polls), so a row says how much of the socket lookup is the
//! daemon's work and how much the round trip around it.
//!
//! The `index_resync` row starts a second subject against a store that holds
//! `--resync-pages` pages (4 objects each) and reports how long its index took to list
//! the store and come in sync, as the daemon timed it, against the wheel's
//! `batch_is_exist` over the same keys.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::control::{Raw, echo_server};
use super::daemon::DaemonChild;
use super::placement::{self, Placement};
use super::pool::{PoolBenchArgs, Row, median};
use crate::client::{Client, ClientConfig};
use crate::layout::LayoutSpec;
use crate::page::{Namespace, PageHash};
use crate::pool::mooncake::{MooncakeConfig, MooncakePool};
use crate::pool::{PoolBackend, PoolHealth};
use crate::protocol::{Identity, Request, kind};

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
/// How long the subject's index may take to apply a round's events.
const EVENT_WAIT: Duration = Duration::from_secs(10);
/// The pause between the bench's last status poll and the timed pair (see the loop).
const QUIET: Duration = Duration::from_millis(2);

/// The writer's announcements: object Store/Remove events in Mooncake's format (the
/// fields a master sends with `--kv_events_emit_object_key`), sequence from 1.
struct Announcer {
    sock: zmq::Socket,
    endpoint: String,
    seq: u64,
}

impl Announcer {
    fn bind() -> anyhow::Result<Self> {
        let sock = zmq::Context::new().socket(zmq::PUB)?;
        sock.set_sndhwm(100_000)?;
        sock.bind("tcp://127.0.0.1:*")?;
        let endpoint = sock.get_last_endpoint()?.map_err(|_| anyhow::anyhow!("no endpoint"))?;
        Ok(Self { sock, endpoint, seq: 1 })
    }

    fn send(&mut self, stored: bool, keys: &[&str]) -> anyhow::Result<()> {
        for chunk in keys.chunks(4096) {
            let mut p = Vec::with_capacity(chunk.len() * 96 + 16);
            rmp::encode::write_array_len(&mut p, 3)?;
            rmp::encode::write_uint(&mut p, 1)?;
            rmp::encode::write_array_len(&mut p, chunk.len() as u32)?;
            let (rfc, legacy) = if stored {
                ("stored", "BlockStored")
            } else {
                ("removed", "BlockRemoved")
            };
            for k in chunk {
                rmp::encode::write_map_len(&mut p, 3)?;
                for (f, v) in [("event_type", rfc), ("type", legacy), ("object_key", k)] {
                    rmp::encode::write_str(&mut p, f)?;
                    rmp::encode::write_str(&mut p, v)?;
                }
            }
            rmp::encode::write_uint(&mut p, 0)?;
            self.sock
                .send_multipart([&b""[..], &self.seq.to_be_bytes()[..], &p[..]], 0)?;
            self.seq += 1;
        }
        Ok(())
    }
}

fn config(args: &PoolBenchArgs) -> MooncakeConfig {
    let c = MooncakeConfig::new(&args.master, &args.metadata).with_segment_bytes(256 << 20);
    match &args.python {
        Some(p) => c.with_python(p),
        None => c,
    }
}

/// `kvtier serve --pool-kind mooncake` on the bench's master: node B.
fn subject_daemon(args: &PoolBenchArgs, slot_bytes: u64, events: &str) -> anyhow::Result<DaemonChild> {
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
    set("mooncake.index_sources", format!("[{}]", quote(events)));
    set("mooncake.master_admin", quote(&args.master_admin));
    if let Some(p) = &args.python {
        set("mooncake.python", quote(&p.display().to_string()));
    }
    DaemonChild::start_with(&exe, 64 << 20, slot_bytes, &pool)
}

/// The subject's counters: master existence queries, pages found in the pool and entered
/// in its directory, and its index's mode, events applied, lookups answered, last resync
/// (µs) and keys listed then; lookups it served and their summed latency (ns).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Counters {
    served: u64,
    served_ns: u64,
    queries: u64,
    found: u64,
    in_sync: bool,
    events: u64,
    index_lookups: u64,
    resync_us: u64,
    resync_keys: u64,
}

fn counters(admin: &Path) -> anyhow::Result<Counters> {
    let r = crate::cli::client::request(admin, "GET", "/v1/status", None, Some(Duration::from_secs(10)))?;
    let v: serde_json::Value = serde_json::from_slice(&r.body()?)?;
    let (remote, ix) = (&v["pool"]["remote"], &v["pool"]["index"]);
    let latency = &v["lookups"]["latency"];
    let n = |x: &serde_json::Value| x.as_u64();
    match (
        n(&remote["exists_queries"]),
        n(&remote["found_pages"]),
        n(&ix["events"]),
        n(&ix["index_lookups"]),
        n(&latency["count"]),
        n(&latency["sum_ns"]),
    ) {
        (Some(queries), Some(found), Some(events), Some(index_lookups), Some(served), Some(served_ns)) => {
            Ok(Counters {
                served,
                served_ns,
                queries,
                found,
                in_sync: ix["mode"] == "in_sync",
                events,
                index_lookups,
                resync_us: n(&ix["last_resync_us"]).unwrap_or(0),
                resync_keys: n(&ix["last_resync_keys"]).unwrap_or(0),
            })
        }
        _ => bail!(
            "the subject's status has no index or lookup counters: {} {}",
            v["pool"],
            v["lookups"]
        ),
    }
}

/// Polls the subject's counters until `ok` holds, for at most `limit`.
fn wait_for(admin: &Path, limit: Duration, what: &str, ok: impl Fn(&Counters) -> bool) -> anyhow::Result<Counters> {
    let end = Instant::now() + limit;
    loop {
        let c = counters(admin)?;
        if ok(&c) {
            return Ok(c);
        }
        if Instant::now() >= end {
            bail!("the subject never reached: {what} ({c:?})");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub(super) fn remote_lookup(args: &PoolBenchArgs) -> anyhow::Result<Vec<Row>> {
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
    let mut announce = Announcer::bind()?;
    let daemon = subject_daemon(args, layout.max_object_bytes(), &announce.endpoint).context("the subject daemon")?;
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
    let allowed = placement::allowed_cores()?;
    let places = placement::placements(&allowed[..allowed.len().min(2)]);
    let subject_pid = daemon.pid().context("the subject daemon has no pid")?;
    let place = |p: &Placement| -> anyhow::Result<()> {
        placement::pin(0, &[p.client_core])?;
        placement::pin_process(subject_pid, &[p.server_core])?;
        Ok(())
    };
    // The socket echo, one connection per placement, each served by a thread that pinned
    // itself to that placement's server core when it was accepted (a first round trip
    // here makes sure it was, before the core changes for the next).
    let echo_path = daemon.scratch("echo.sock");
    let echo_core = Arc::new(AtomicUsize::new(usize::MAX));
    {
        let (listener, core) = (UnixListener::bind(&echo_path)?, echo_core.clone());
        std::thread::spawn(move || echo_server(listener, core));
    }
    let mut echoes = Vec::new();
    for p in &places {
        echo_core.store(p.server_core, Ordering::SeqCst);
        let mut e = Raw::connect(&echo_path)?;
        let mut hello = Vec::new();
        Request::Lookup { hashes: Vec::new() }.encode(1, &mut hello);
        e.round_trip(&hello, 1).context("the socket echo")?;
        echoes.push(e);
    }
    let scheme = crate::pool::keys::scheme_for(TAG, crate::pool::keys::KeyFormat::Kvtier, &ns, &layout);
    let zeros = vec![0u8; obj];
    let base = (std::process::id() as u64) << 32;
    // Per placement: the subject's, the reference's, the socket echo's, the subject
    // daemon's own and the socket lookup's times.
    let mut times: Vec<[Vec<f64>; 5]> = vec![Default::default(); places.len()];
    // The pool starts with the subject's first namespace; its index then lists the store.
    let mut seen = wait_for(&admin, WARM_WAIT, "index in sync", |c| c.in_sync)?.events;
    // One lookup the daemon answers: it checks the pool's health, and says so in the
    // lookup file the engine answers from.
    client.lookup_remote(&[PageHash::from_u64(base)])?;
    // A round takes milliseconds, and one lookup crosses the engine, the daemon and the
    // master, whose wake-ups a shared machine delays at random: five times the put/get
    // rounds, so one slow wake-up moves the median little.
    let rounds = args.rounds * 5 * places.len();
    // Round 0 waits for the subject's pool; it and the next WARM_ROUNDS warm both sides up
    // and are not counted.
    for round in 0..=rounds + WARM_ROUNDS {
        let hs: Vec<PageHash> = (0..PAGES as u64)
            .map(|i| PageHash::from_u64(base + ((round + 1) * PAGES) as u64 + i))
            .collect();
        let keys: Vec<String> = hs.iter().flat_map(|h| scheme.page_keys(&layout, h)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let items: Vec<(&str, &[u8])> = refs.iter().map(|&k| (k, zeros.as_slice())).collect();
        if let Some(e) = writer.batch_put_from(&items).into_iter().find_map(Result::err) {
            bail!("writer put: {e}");
        }
        announce.send(true, &refs)?;
        let want = seen + refs.len() as u64;
        // The poll that saw the events applied is the round's `before`: no lookup runs
        // between it and the timed pair.
        let before = wait_for(&admin, EVENT_WAIT, "the round's events applied", |c| c.events >= want)?;
        seen = before.events;
        let counted = round > WARM_ROUNDS;
        // Two rounds per placement in turn: one with each side first.
        let at = (round / 2) % places.len();
        place(&places[at])?;
        if !before.in_sync {
            bail!("the subject's index fell out of sync: {before:?}");
        }
        // That poll is a status render in the subject (its heaviest admin request) and
        // two HTTP exchanges here; timed right after it, the lookup also measured the
        // render's wind-down on a shared core. Both sides start from a quiet subject.
        std::thread::sleep(QUIET);
        let local = client.engine_lookups().answered();
        let timed = |remote: bool| -> anyhow::Result<f64> {
            let t = Instant::now();
            let hit = if remote {
                client.lookup_remote(&hs)?
            } else {
                client.lookup(&hs)?
            };
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
            (timed(false)?, rs)
        } else {
            let ks = timed(false)?;
            std::thread::sleep(QUIET);
            (ks, reference()?)
        };
        if client.engine_lookups().answered() != local + 1 {
            bail!("the engine did not answer the lookup from the subject's lookup file");
        }
        // The same lookup asked of the subject through its socket, answered from its
        // index; it enters the credited pages in its directory after its reply.
        std::thread::sleep(QUIET);
        let ss = timed(true)?;
        let want = before.found + PAGES as u64;
        let after = wait_for(&admin, EVENT_WAIT, "the lookup's pages entered", |c| c.found >= want)?;
        if after.queries != before.queries
            || after.index_lookups != before.index_lookups + 1
            || after.found != want
            || after.served != before.served + 1
        {
            bail!(
                "the socket lookup was not answered from the index alone, or the engine's reached the daemon: before {before:?}, after {after:?}"
            );
        }
        // The echo of the lookup's own frame, after that poll and the same quiet.
        let mut frame = Vec::new();
        Request::Lookup { hashes: hs.clone() }.encode(1, &mut frame);
        std::thread::sleep(QUIET);
        let t = Instant::now();
        let echoed = echoes[at].round_trip(&frame, 1)?;
        let es = t.elapsed().as_secs_f64();
        if echoed != kind::LOOKUP {
            bail!("the socket echo answered with kind {echoed:#x}");
        }
        if counted {
            times[at][0].push(ks);
            times[at][1].push(rs);
            times[at][2].push(es);
            times[at][3].push(after.served_ns.saturating_sub(before.served_ns) as f64 / 1e9);
            times[at][4].push(ss);
        }
        writer.remove_batch(&refs, true);
        announce.send(false, &refs)?;
        let want = seen + refs.len() as u64;
        seen = wait_for(&admin, EVENT_WAIT, "the round's removals applied", |c| c.events >= want)?.events;
    }
    placement::pin(0, &allowed)?;
    let mut rows: Vec<Row> = places
        .iter()
        .zip(times)
        .map(|(p, t)| {
            let op = if p.name == "same_core" {
                "remote_lookup_same_core"
            } else {
                "remote_lookup_cross_core"
            };
            lookup_row(op, obj, PAGES * layout.object_count(), t)
        })
        .collect();
    let worst = rows
        .iter()
        .max_by(|a, b| a.ratio.total_cmp(&b.ratio))
        .context("no placement")?;
    let mut row = lookup_row("remote_lookup", obj, PAGES * layout.object_count(), Default::default());
    (
        row.rounds,
        row.kvtier_p50_us,
        row.raw_p50_us,
        row.socket_echo_p50_us,
        row.socket_lookup_p50_us,
        row.daemon_lookup_p50_us,
        row.ratio,
    ) = (
        worst.rounds,
        worst.kvtier_p50_us,
        worst.raw_p50_us,
        worst.socket_echo_p50_us,
        worst.socket_lookup_p50_us,
        worst.daemon_lookup_p50_us,
        worst.ratio,
    );
    rows.insert(0, row);
    Ok(rows)
}

/// A `remote_lookup` row from the subject's, the reference's, the socket echo's, the
/// subject daemon's own and the socket lookup's times (s) of its rounds.
fn lookup_row(op: &'static str, obj: usize, objects: usize, times: [Vec<f64>; 5]) -> Row {
    let rounds = times[0].len();
    let [kp, rp, ep, dp, sp] = times.map(|t| if rounds == 0 { 0.0 } else { median(t) * 1e6 });
    Row {
        backend: "mooncake",
        op,
        object_bytes: obj,
        objects,
        batch: objects,
        rounds,
        kvtier_gbps: 0.0,
        raw_gbps: 0.0,
        ratio: kp / rp.max(1e-9),
        reference: "wheel python client batch_is_exist, same keys, timed in the writer's helper; \
                    subject: an engine of a second kvtier serve answering from that daemon's \
                    lookup file, kept by its pool index (socket_lookup: the daemon asked); client \
                    and subject pinned as the op's suffix says, remote_lookup the worse \
                    placement (goal: ratio <= 0.1)",
        // The subject daemon runs with `mooncake.integrity` at its default, on.
        integrity: true,
        failed: 0,
        corrupt: 0,
        kvtier_p50_us: Some(kp),
        raw_p50_us: Some(rp),
        socket_lookup_p50_us: Some(sp),
        socket_echo_p50_us: Some(ep),
        daemon_lookup_p50_us: Some(dp),
        daemon_exists_p50_us: None,
        slot_bytes: None,
    }
}

/// The `index_resync` row: a subject started against a store holding `--resync-pages`
/// TP=2 pages (4 small objects each) lists it at start; the daemon's own timing of that
/// resync, against the wheel's `batch_is_exist` over the same keys.
pub(super) fn index_resync(args: &PoolBenchArgs) -> anyhow::Result<Row> {
    let spec = LayoutSpec::mha(1, 2, 8, 2, 16).with_parallel(2, 1);
    let layout = spec.clone().build()?;
    let obj = layout.object_bytes(0) as usize;
    let writer = MooncakePool::start(config(args), None)?;
    if writer.wait_healthy(Duration::from_secs(30)) != PoolHealth::Ok {
        bail!("writer's pool not healthy");
    }
    let tag = format!("{}-resync", std::process::id());
    let ns = Namespace::model(format!("bench-{tag}"));
    let scheme = crate::pool::keys::scheme_for(TAG, crate::pool::keys::KeyFormat::Kvtier, &ns, &layout);
    let base = (std::process::id() as u64) << 40;
    let keys: Vec<String> = (0..args.resync_pages as u64)
        .flat_map(|i| scheme.page_keys(&layout, &PageHash::from_u64(base + i)))
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let zeros = vec![0u8; obj];
    for chunk in refs.chunks(4096) {
        let items: Vec<(&str, &[u8])> = chunk.iter().map(|&k| (k, zeros.as_slice())).collect();
        if let Some(e) = writer.batch_put_from(&items).into_iter().find_map(Result::err) {
            bail!("writer put: {e}");
        }
    }
    let result = (|| -> anyhow::Result<Row> {
        let mut raw = 0.0;
        for chunk in refs.chunks(65_536) {
            let r = writer.raw_exists(chunk)?;
            if r.failed > 0 {
                bail!("raw client: {} of {} keys missing", r.failed, chunk.len());
            }
            raw += r.seconds;
        }
        let announce = Announcer::bind()?;
        let daemon = subject_daemon(args, layout.max_object_bytes().max(65_536), &announce.endpoint)?;
        let identity = Identity {
            instance: format!("bench-c-{tag}"),
            namespace: ns.clone(),
            tp_rank: 0,
            tp_size: 2,
            pp_rank: 0,
            pp_size: 1,
            dp_rank: 0,
        };
        let _client = Client::connect(
            ClientConfig::new(daemon.socket(), identity, spec.clone()).with_timeout(Duration::from_secs(20)),
        )?;
        let want = keys.len() as u64;
        let c = wait_for(&daemon.admin_socket(), Duration::from_secs(300), "index in sync", |c| {
            c.in_sync && c.resync_keys >= want
        })?;
        let (kp, rp) = (c.resync_us as f64, raw * 1e6);
        Ok(Row {
            backend: "mooncake",
            op: "index_resync",
            object_bytes: obj,
            objects: keys.len(),
            batch: keys.len(),
            rounds: 1,
            kvtier_gbps: 0.0,
            raw_gbps: 0.0,
            ratio: kp / rp.max(1e-9),
            reference: "a kvtier serve started against the populated store: its index's resync \
                        (listing over the master's admin HTTP, as the daemon timed it) against the \
                        wheel python client batch_is_exist over the same keys",
            integrity: true,
            failed: 0,
            corrupt: 0,
            kvtier_p50_us: Some(kp),
            raw_p50_us: Some(rp),
            socket_lookup_p50_us: None,
            socket_echo_p50_us: None,
            daemon_lookup_p50_us: None,
            daemon_exists_p50_us: None,
            slot_bytes: None,
        })
    })();
    for chunk in refs.chunks(4096) {
        writer.remove_batch(chunk, true);
    }
    result
}
