//! The soak tests: client processes store, load and look up over a shared prefix set
//! while the daemon is SIGKILLed and restarted (the local pool), or while the Mooncake
//! master is killed and restarted (a Mooncake pool). Every page loaded is checked byte for
//! byte against what its writer stored.
//!
//! `KVTIER_SOAK_SECONDS` sets how long the clients run: 24 s by default (the README's test
//! command), 600 in `.ci/run`. Runs of 4 minutes or more kill the daemon every 2 minutes;
//! shorter ones twice, at a quarter and at half of the run. The Mooncake case kills its
//! daemon as often in long runs (once, at a quarter, in shorter ones) and its master once,
//! at half of the run.
//!
//! Acknowledged-but-lost pages are counted from the daemon's own answers: just before each
//! kill, an observer looks up every page of the set one by one, and each page the daemon
//! answers is complete in host or in the pool (an acknowledged store: a page is complete
//! only once its store was committed) must load with its bytes after the restart. On the
//! local pool every such page counts; on Mooncake, pages only in the store when its master
//! died may be gone (the master keeps no data), and so may those when its daemon died (the
//! objects live in the dead daemon's segment): they are counted apart, never as lost or
//! wrong. There the clients are paused (SIGSTOP) from the observer's look-ups until its
//! loads are done, so no eviction under load takes a host page while the pool is down.
//!
//! Each test prints one JSON summary line (`"soak": "local"` or `"mooncake"`) and fails on
//! any wrong byte, on any acknowledged page lost from host or the local pool, on a
//! manifest or a private memory (`RssAnon`) past its fixed bound at any 250 ms sample;
//! the local case also on `no_space` (its pool always has room), and when the daemon's
//! private memory or descriptors are not back within 10 % once the load is over:
//! descriptors of the fresh idle daemon, private memory of the last daemon sampled warm,
//! near the end of the load.
//!
//! The clients are this test binary re-executed with `KVT_SOAK` set: an ELF constructor
//! (as in `common/rank.rs`) runs the client body before libtest's `main`, so the client
//! is not a registered test. Each client runs for a fixed time and prints its counts as
//! one `@@ {json}` line.

mod cluster_support;
mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use kvtier::client::{Client, ClientConfig, ClientError};
use kvtier::page::PageHash;
use kvtier::protocol::LoadWait;
use kvtier::tier::device::EmulatedDevice;
use kvtier::tier::tensors::PageMap;
use serde_json::{Value, json};

const CHILD_ENV: &str = "KVT_SOAK";
const CLIENTS: usize = 32;
/// Shared prefixes, of `PAGES` pages each: 256 x 8 x 4 KiB = 8 MiB, twice the arena, so
/// pages are evicted to the pool and staged back while the clients run. The arena holds
/// 1,024 pages: 32 clients with a store (8 pages) in flight and a load (8 pages) leased
/// each hold at most half of it, so host room can always be made.
const PREFIXES: u64 = 256;
const PAGES: usize = 8;
const ARENA_BYTES: u64 = 4 << 20;
/// Clients of the Mooncake case, which runs beside the local one.
const MOONCAKE_CLIENTS: usize = 8;
/// How long the clients run unless `KVTIER_SOAK_SECONDS` says otherwise.
const DEFAULT_RUN: Duration = Duration::from_secs(24);
/// Runs at least this long kill the daemon every [`KILL_EVERY`].
const LONG_RUN: Duration = Duration::from_secs(240);
const KILL_EVERY: Duration = Duration::from_secs(120);
/// The manifest's bound at any sample, for an arena of `slots` slots: twice its live
/// records (at most one ~70-byte record per arena slot, counted here at 128) plus 64 KiB,
/// as the daemon compacts it, and room for what one upkeep tick appends before the next
/// compaction.
const fn manifest_bound(slots: u64) -> u64 {
    2 * slots * 128 + (64 << 10) + (256 << 10)
}

/// The local case's bound: its arena has 2 KiB slots.
const MANIFEST_BOUND: u64 = manifest_bound(ARENA_BYTES / 2048);

/// The daemon's private memory at any sample, in MiB: a fixed bound whatever the run's
/// length (each daemon here settles near 55 MiB once its bounded books, such as the
/// 65,536 store tickets and the `max_pages` directory, have filled).
const RSS_BOUND_MB: f64 = 128.0;

/// How long the clients run: `KVTIER_SOAK_SECONDS`, else [`DEFAULT_RUN`].
fn run_time() -> Duration {
    std::env::var("KVTIER_SOAK_SECONDS")
        .ok()
        .map(|s| Duration::from_secs(s.trim().parse().expect("KVTIER_SOAK_SECONDS is a number of seconds")))
        .unwrap_or(DEFAULT_RUN)
}

/// When to kill the daemon, from the clients' start: every 2 minutes in a long run (none
/// in its last 2 minutes' tail), else at a quarter and at half of the run.
fn kill_times(run: Duration) -> Vec<Duration> {
    if run >= LONG_RUN {
        (1..)
            .map(|k| KILL_EVERY * k)
            .take_while(|t| *t + KILL_EVERY / 2 < run)
            .collect()
    } else {
        vec![run / 4, run / 2]
    }
}

#[used]
#[unsafe(link_section = ".init_array")]
static SOAK_ENTRY: extern "C" fn() = soak_entry;

extern "C" fn soak_entry() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    // A panic may not unwind out of an `extern "C"` function; end the process instead.
    let code = match std::panic::catch_unwind(client_main) {
        Ok(()) => 0,
        Err(_) => 101,
    };
    std::process::exit(code);
}

/// The hashes of shared prefix `p`.
fn prefix(p: u64) -> Vec<PageHash> {
    hashes(1_000_000 + p * 1_000, PAGES)
}

/// What one client counted.
#[derive(Default)]
struct Counts {
    ops: u64,
    pages_verified: u64,
    wrong_bytes: u64,
    errors: BTreeMap<String, u64>,
}

impl Counts {
    fn error(&mut self, e: &ClientError) {
        if std::env::var_os("KVT_SOAK_DEBUG").is_some() {
            eprintln!("soak client error: {e}");
        }
        let kind = match e {
            ClientError::Remote(r) => r.code.name().to_owned(),
            ClientError::Timeout => "timeout".to_owned(),
            ClientError::Unavailable(_) => "unavailable".to_owned(),
            _ => "other".to_owned(),
        };
        *self.errors.entry(kind).or_default() += 1;
    }
}

/// A client process: until its deadline, pick a shared prefix, look it up, load it
/// (checking every loaded byte), and store what was not loadable.
fn client_main() {
    let env = |k: &str| std::env::var(k).unwrap();
    let idx: u64 = env("KVT_SOAK_INDEX").parse().unwrap();
    let run = Duration::from_millis(env("KVT_SOAK_MS").parse().unwrap());
    let deadline = Instant::now() + run;
    let layout = spec(1, 1);
    let built = layout.clone().build().unwrap();
    let cfg = ClientConfig::new(env("KVT_SOCKET"), identity(&format!("soak{idx}"), 0, 0, 1, 1), layout)
        .with_timeout(Duration::from_secs(3));
    let mut c = Counts::default();
    let dev = Arc::new(EmulatedDevice::new(&built, 0, PAGES as u32));
    let want = EmulatedDevice::new(&built, 0, PAGES as u32);
    let len = PageMap::contiguous_bytes(&built, 0, PAGES as u32);
    let client = loop {
        match Client::connect(cfg.clone()).and_then(|cl| cl.register_device(dev.clone()).map(|()| cl)) {
            Ok(cl) => break Some(cl),
            Err(e) => {
                c.error(&e);
                if Instant::now() >= deadline {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let slots: Vec<u32> = (0..PAGES as u32).collect();
    let mut rng = idx.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while let Some(client) = client.as_ref().filter(|_| Instant::now() < deadline) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let hs = prefix(rng % PREFIXES);
        c.ops += 1;
        if let Err(e) = client.lookup(&hs) {
            c.error(&e);
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        // Junk in both the device and the model of it, so a page the load claims but did
        // not write shows up as wrong bytes.
        for i in 0..PAGES as u32 {
            dev.fill_page(i, 0xdead_0000 + i as u64).unwrap();
            want.fill_page(i, 0xdead_0000 + i as u64).unwrap();
        }
        c.ops += 1;
        let loaded = match client.load(&hs, &slots, LoadWait::Timeout(200)) {
            Ok(n) => n,
            Err(e) => {
                // The copy may have run before the daemon went away: what the device holds
                // then is not a load's answer, and nothing was claimed.
                c.error(&e);
                continue;
            }
        };
        for (i, h) in hs.iter().enumerate().take(loaded) {
            want.fill_page(i as u32, seed(h, 0, 0)).unwrap();
        }
        let (got, exp) = (dev.read_raw(0, len).unwrap(), want.read_raw(0, len).unwrap());
        c.wrong_bytes += got.iter().zip(&exp).filter(|(a, b)| a != b).count() as u64;
        c.pages_verified += loaded as u64;
        if loaded < PAGES {
            for (i, h) in hs.iter().enumerate() {
                dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
            }
            c.ops += 1;
            if let Err(e) = client.store(&hs, &slots, "") {
                c.error(&e);
            }
        }
        // The engine frees its device copy; the next load must come from host or pool.
        c.ops += 1;
        if let Err(e) = client.removed(&hs) {
            c.error(&e);
        }
    }
    let summary = json!({
        "ops": c.ops,
        "pages_verified": c.pages_verified,
        "wrong_bytes": c.wrong_bytes,
        "errors_by_kind": c.errors,
    });
    println!("@@ {summary}");
}

/// The daemon's private resident memory in MiB (RssAnon: the heap and stacks; the arena
/// and the pool are file or shared-memory mappings of a configured, fixed size) and its
/// open descriptors.
fn footprint(pid: u32) -> (f64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| -> f64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let rss = kib("RssAnon:") / 1024.0;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count);
    (rss, fds)
}

fn spawn_client(socket: &Path, idx: usize, run: Duration) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, "1")
        .env("KVT_SOCKET", socket)
        .env("KVT_SOAK_INDEX", idx.to_string())
        .env("KVT_SOAK_MS", run.as_millis().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(if std::env::var_os("KVT_SOAK_DEBUG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .spawn()
        .unwrap()
}

/// Sends `sig` to every client (SIGSTOP and SIGCONT around the Mooncake check).
fn signal_all(children: &[Child], sig: i32) {
    for ch in children {
        // SAFETY: kill(2) on a child process of this test.
        unsafe { libc::kill(ch.id() as i32, sig) };
    }
}

/// What every client counted, summed.
#[derive(Default)]
struct Totals {
    ops: u64,
    pages_verified: u64,
    wrong_bytes: u64,
    errors: BTreeMap<String, u64>,
}

fn collect(children: &mut [Child]) -> Totals {
    let mut t = Totals::default();
    for ch in children {
        let out = ch.stdout.take().unwrap();
        let line = BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| l.find("@@ ").map(|at| l[at + 3..].to_owned()))
            .expect("every client prints its summary");
        assert!(ch.wait().unwrap().success());
        let v: Value = serde_json::from_str(&line).unwrap();
        t.ops += v["ops"].as_u64().unwrap();
        t.pages_verified += v["pages_verified"].as_u64().unwrap();
        t.wrong_bytes += v["wrong_bytes"].as_u64().unwrap();
        if let Some(m) = v["errors_by_kind"].as_object() {
            for (k, n) in m {
                *t.errors.entry(k.clone()).or_default() += n.as_u64().unwrap();
            }
        }
    }
    t
}

/// Where the daemon said a page was when the observer asked.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    Host,
    Pool,
}

/// What the observer found after a restart among the pages the daemon held before it.
#[derive(Default)]
struct Checked {
    /// Pages the daemon answered complete in host or the pool before the kill.
    held_host: u64,
    held_pool: u64,
    /// Pages answered complete on device only (an engine's copy the kill may take): not checked.
    device_only: u64,
    /// Of the held pages, those that did not load after the restart.
    lost_host: u64,
    lost_pool: u64,
    /// Pages loaded whose bytes were not their writer's.
    wrong_pages: u64,
    /// The lost pages (hash, where they were), for the failure's message.
    lost: Vec<String>,
}

/// A client of the test's own: looks up every page of the set one by one, and loads each
/// into its own emulated device to check its bytes.
struct Observer {
    client: Client,
    dev: Arc<EmulatedDevice>,
}

impl Observer {
    /// Connects, retrying while the daemon starts or recovers.
    fn connect(socket: &Path) -> Self {
        let end = Instant::now() + Duration::from_secs(60);
        let layout = spec(1, 1);
        let built = layout.clone().build().unwrap();
        loop {
            let cfg = ClientConfig::new(socket, identity("soak-observer", 0, 0, 1, 1), layout.clone())
                .with_timeout(Duration::from_secs(10));
            let dev = Arc::new(EmulatedDevice::new(&built, 0, 1));
            match Client::connect(cfg).and_then(|c| c.register_device(dev.clone()).map(|()| c)) {
                Ok(client) => return Self { client, dev },
                Err(e) => assert!(Instant::now() < end, "the observer could not connect: {e}"),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Every page of the set the daemon answers complete in host or in the pool, and the
    /// count of those it answers on device only.
    fn held(&self) -> (Vec<(PageHash, Held)>, u64) {
        let mut held = Vec::new();
        let mut device_only = 0;
        for h in (0..PREFIXES).flat_map(prefix) {
            let Ok(hit) = self.client.lookup(std::slice::from_ref(&h)) else {
                continue;
            };
            if hit.host == 1 {
                held.push((h, Held::Host));
            } else if hit.pool == 1 {
                held.push((h, Held::Pool));
            } else if hit.device == 1 {
                device_only += 1;
            }
        }
        (held, device_only)
    }

    /// Loads one page into slot 0 (retrying until `end` while the daemon is busy or
    /// unavailable); returns whether it loaded, and whether its bytes were right.
    fn load(&self, h: &PageHash, end: Instant) -> (bool, bool) {
        loop {
            let _ = self.dev.fill_page(0, 0xdead_beef);
            match self
                .client
                .load(std::slice::from_ref(h), &[0], LoadWait::Timeout(2_000))
            {
                Ok(1) => {
                    let right = self.dev.page_matches(0, seed(h, 0, 0)).unwrap();
                    let _ = self.client.removed(std::slice::from_ref(h));
                    return (true, right);
                }
                // Nothing loaded: lost only if the daemon answers it holds the page nowhere
                // (a page staged by another load, or host without room, loads later).
                Ok(_) => {
                    let held = self
                        .client
                        .lookup(std::slice::from_ref(h))
                        .map_or(true, |hit| hit.total() > 0);
                    if !held || Instant::now() >= end {
                        return (false, true);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(_) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
                Err(_) => return (false, true),
            }
        }
    }

    /// Loads every page of `held` (its pool pages only with `pool`), counting those that
    /// do not load and wrong bytes.
    fn check(&self, held: &[(PageHash, Held)], device_only: u64, pool: bool) -> Checked {
        let mut c = Checked {
            device_only,
            ..Checked::default()
        };
        let end = Instant::now() + Duration::from_secs(60);
        for (h, at) in held.iter().filter(|(_, at)| pool || *at == Held::Host) {
            let (loaded, right) = self.load(h, end);
            let (count, lost) = match at {
                Held::Host => (&mut c.held_host, &mut c.lost_host),
                Held::Pool => (&mut c.held_pool, &mut c.lost_pool),
            };
            *count += 1;
            *lost += u64::from(!loaded);
            c.wrong_pages += u64::from(!right);
            if !loaded {
                let tier = if *at == Held::Host { "host" } else { "pool" };
                c.lost.push(format!("{}@{tier}", h.to_hex()));
            }
        }
        c
    }
}

/// Samples the manifest's size and the running daemon's private memory every 250 ms.
struct Sampler {
    stop: Arc<AtomicBool>,
    pid: Arc<AtomicU32>,
    manifest_max: Arc<AtomicU64>,
    rss_kib_max: Arc<AtomicU64>,
    samples: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(manifest: std::path::PathBuf, pid: u32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let pid = Arc::new(AtomicU32::new(pid));
        let manifest_max = Arc::new(AtomicU64::new(0));
        let rss_kib_max = Arc::new(AtomicU64::new(0));
        let samples = Arc::new(AtomicU64::new(0));
        let (s, p, m, r, n) = (
            stop.clone(),
            pid.clone(),
            manifest_max.clone(),
            rss_kib_max.clone(),
            samples.clone(),
        );
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                if let Ok(md) = std::fs::metadata(&manifest) {
                    m.fetch_max(md.len(), Ordering::AcqRel);
                    n.fetch_add(1, Ordering::AcqRel);
                }
                let (rss, _) = footprint(p.load(Ordering::Acquire));
                r.fetch_max((rss * 1024.0) as u64, Ordering::AcqRel);
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        Self {
            stop,
            pid,
            manifest_max,
            rss_kib_max,
            samples,
            thread: Some(thread),
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Pages the running daemon recovered from its manifest at start.
fn recovered(socket: &Path) -> u64 {
    let o = Observer::connect(socket);
    o.client.stats().unwrap().recovered_pages
}

/// Pages evicted from host so far (`kvtier_evictions_total{tier="host"}` in `/metrics`,
/// through the admin socket).
fn host_evictions(admin: &Path) -> Option<u64> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(admin).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.lines().find_map(|l| {
        let v = l.strip_prefix("kvtier_evictions_total{tier=\"host\"} ")?;
        v.trim().parse::<f64>().ok().map(|v| v as u64)
    })
}

/// Sleeps until `at` after `t0`.
fn sleep_until(t0: Instant, at: Duration) {
    if let Some(left) = (t0 + at).checked_duration_since(Instant::now()) {
        std::thread::sleep(left);
    }
}

#[test]
fn soak_32_clients_through_daemon_kills_serve_only_right_bytes_and_lose_no_acknowledged_page() {
    let t0 = Instant::now();
    let run = run_time();
    let kills = kill_times(run);
    let dir = tempfile::tempdir().unwrap();
    // The admin socket in the test's directory: the memory check below waits on its status.
    let admin = format!("admin.socket={}", dir.path().join("admin.sock").display());
    // A small event ring and a directory sized to what the arena and pool can hold (the
    // lookup view reserves its index and cells for `max_pages` up front, and they become
    // resident as ids and slots are first used): their bounded growth would otherwise hide
    // a leak in the RSS figures.
    let sets = [
        "pool_bytes=33554432",
        "prefault=true",
        "tick_ms=100",
        "event_ring=4096",
        "max_pages=65536",
        admin.as_str(),
    ];
    let mut d = Daemon::start_with(dir.path(), ARENA_BYTES, &sets);
    // Descriptors of the fresh, idle daemon, counted with one raw connection of the test's
    // own once the daemon counts it alone (the start-up probe's connection gone): once the
    // load is over and its clients have left, the last daemon must be back there, counted
    // the same way.
    let fds_start = {
        let mut own = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
        until_sole_connection(&mut own, Duration::from_secs(10));
        footprint(d.pid().unwrap()).1
    };
    let sampler = Sampler::start(dir.path().join("arena.manifest"), d.pid().unwrap());
    let start = Instant::now();
    let mut children: Vec<Child> = (0..CLIENTS).map(|i| spawn_client(&d.socket, i, run)).collect();
    let mut recovered_pages = 0;
    let mut checked = Checked::default();
    for at in &kills {
        sleep_until(start, *at);
        // What the daemon holds in host and the local pool now, by its own answers.
        let (held, device_only) = Observer::connect(&d.socket).held();
        d.signal(libc::SIGKILL);
        assert!(!d.wait(), "SIGKILL ends the daemon");
        d.restart(ARENA_BYTES);
        sampler.pid.store(d.pid().unwrap(), Ordering::Release);
        recovered_pages += recovered(&d.socket);
        let c = Observer::connect(&d.socket).check(&held, device_only, true);
        checked.held_host += c.held_host;
        checked.held_pool += c.held_pool;
        checked.device_only += c.device_only;
        checked.lost_host += c.lost_host;
        checked.lost_pool += c.lost_pool;
        checked.wrong_pages += c.wrong_pages;
        checked.lost.extend(c.lost);
    }
    // Memory of the last daemon once warm, near the end of the load (its threads, tables,
    // buffers and bounded books such as the 65,536 store tickets grown to what this load
    // needs; sampled earlier, the ticket book was still filling and read as growth):
    // after the load it must not have grown past this by 10 %.
    let last = kills.last().copied().unwrap_or_default();
    sleep_until(start, last + (run - last) * 4 / 5);
    let (rss_start, _) = footprint(d.pid().unwrap());
    let t = collect(&mut children);
    // The load is over: every client has gone. Once the daemon counts the test's own
    // connection alone (every client's closed on its side too), and has given the
    // allocator's free memory back after the last frame (what a quiet daemon does; before,
    // its resident memory stayed at the load's high-water mark), measure.
    let (rss_end, fds_end) = {
        let mut own = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
        until_sole_connection(&mut own, Duration::from_secs(30));
        common::until_memory_trimmed(&d.wait_admin().admin, Duration::from_secs(30));
        footprint(d.pid().unwrap())
    };
    let manifest_max = sampler.manifest_max.load(Ordering::Acquire);
    let rss_max = sampler.rss_kib_max.load(Ordering::Acquire) as f64 / 1024.0;
    let manifest_samples = sampler.samples.load(Ordering::Acquire);
    drop(sampler);
    let summary = json!({
        "soak": "local",
        "seconds": run.as_secs(),
        "clients": CLIENTS,
        "daemon_kills": kills.len(),
        "ops": t.ops,
        "pages_verified": t.pages_verified,
        "wrong_bytes": t.wrong_bytes,
        "errors_by_kind": t.errors,
        "recovered_pages": recovered_pages,
        "held_host_pages_at_kills": checked.held_host,
        "held_pool_pages_at_kills": checked.held_pool,
        "device_only_pages_at_kills": checked.device_only,
        "acknowledged_lost_host_pages": checked.lost_host,
        "acknowledged_lost_pool_pages": checked.lost_pool,
        "observer_wrong_pages": checked.wrong_pages,
        "manifest_bytes_max": manifest_max,
        "manifest_bytes_bound": MANIFEST_BOUND,
        "manifest_samples": manifest_samples,
        "rss_mb_start": (rss_start * 10.0).round() / 10.0,
        "rss_mb_end": (rss_end * 10.0).round() / 10.0,
        "rss_mb_max": (rss_max * 10.0).round() / 10.0,
        "rss_mb_bound": RSS_BOUND_MB,
        "fds_start": fds_start,
        "fds_end": fds_end,
    });
    println!("{summary}");
    eprintln!("soak: {:.1} s", t0.elapsed().as_secs_f64());
    assert_eq!(t.wrong_bytes, 0, "{summary}");
    assert_eq!(checked.wrong_pages, 0, "{summary}");
    assert!(t.pages_verified > 0 && t.ops > 0, "the clients did work: {summary}");
    assert_eq!(
        t.errors.get("no_space"),
        None,
        "no no_space while the pool has room: {summary}"
    );
    assert!(recovered_pages > 0, "restarts recovered the arena: {summary}");
    assert!(
        checked.held_host + checked.held_pool > 0,
        "the daemon held pages at its kills: {summary}"
    );
    assert_eq!(
        checked.lost_host + checked.lost_pool,
        0,
        "no acknowledged page in host or the local pool is lost to a SIGKILL: {summary}; lost {:?}; the daemon said:\n{}",
        checked.lost,
        d.log_text()
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("recover") || l.contains("pool"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(manifest_samples > 0, "the manifest was sampled: {summary}");
    assert!(manifest_max <= MANIFEST_BOUND, "the manifest stays bounded: {summary}");
    assert!(
        fds_end as f64 <= fds_start as f64 * 1.1,
        "descriptors back within 10 %: {summary}"
    );
    assert!(rss_end <= rss_start * 1.1, "private memory back within 10 %: {summary}");
    assert!(rss_max <= RSS_BOUND_MB, "private memory stays bounded: {summary}");
}

#[test]
fn soak_mooncake_daemon_and_master_killed_lose_no_host_page_and_serve_only_right_bytes() {
    if !common::require::require(
        "mooncake",
        "the Mooncake soak needs mooncake_master and the wheel's Python",
    ) {
        return;
    }
    let t0 = Instant::now();
    let run = run_time();
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    // A master of the test's own, on fresh ports: killing it touches no one else's.
    let mut master = cluster_support::Master::start(bin, dir.path());
    // 16 MiB of 16 KiB slots: 512 pages of 2 objects in host, a quarter of the set, so
    // pages are evicted to the store and staged back while the clients run. The arena is
    // recovered after each SIGKILL; the event ring and the directory are sized as in the
    // local case, so their bounded growth does not hide a leak in the RSS figures.
    let node_dir = dir.path().join("node");
    let extra = [
        ("recover", "true".to_owned()),
        ("event_ring", "4096".to_owned()),
        ("max_pages", "65536".to_owned()),
    ];
    let start_node = |m: &cluster_support::Master| cluster_support::Node::start_with(&node_dir, m, &python, &extra);
    let mut node = start_node(&master);
    let sampler = Sampler::start(node_dir.join("arena.manifest"), node.pid());
    let start = Instant::now();
    let mut children: Vec<Child> = (0..MOONCAKE_CLIENTS)
        .map(|i| spawn_client(&node.socket, i, run))
        .collect();
    let mut events: Vec<(Duration, bool)> = mooncake_daemon_kills(run).into_iter().map(|t| (t, false)).collect();
    events.push((run / 2, true));
    events.sort();
    let mut daemon_kills = DaemonKills::default();
    let mut master_kill = None;
    for (at, is_master) in events {
        sleep_until(start, at);
        // The clients paused: what the daemon holds now stays where it is (no store evicts
        // a host page to the store while it is about to go), so every host page it names
        // must still load.
        signal_all(&children, libc::SIGSTOP);
        let paused = Instant::now();
        let evicted = settle_host_evictions(&node.admin, paused);
        if is_master {
            master_kill = Some(kill_master(&node, &mut master, evicted));
        } else {
            let (held, device_only) = Observer::connect(&node.socket).held();
            // SAFETY: kill(2) on the daemon this test started; dropping the node reaps it.
            unsafe { libc::kill(node.pid() as i32, libc::SIGKILL) };
            drop(node);
            node = start_node(&master);
            sampler.pid.store(node.pid(), Ordering::Release);
            daemon_kills.count(&node, &held, device_only);
        }
        signal_all(&children, libc::SIGCONT);
        daemon_kills.paused_s += paused.elapsed().as_secs_f64();
    }
    let master_kill = master_kill.expect("the master was killed once");
    let t = collect(&mut children);
    let manifest_max = sampler.manifest_max.load(Ordering::Acquire);
    let rss_max = sampler.rss_kib_max.load(Ordering::Acquire) as f64 / 1024.0;
    let manifest_samples = sampler.samples.load(Ordering::Acquire);
    drop(sampler);
    let manifest_bound = manifest_bound(MOONCAKE_SLOTS);
    let (down, back) = (&master_kill.down, &master_kill.back);
    let k = &daemon_kills;
    let summary = json!({
        "soak": "mooncake",
        "seconds": run.as_secs(),
        "clients": MOONCAKE_CLIENTS,
        "daemon_kills": k.kills,
        "master_kills": 1,
        "clients_paused_s": (k.paused_s * 10.0).round() / 10.0,
        "ops": t.ops,
        "pages_verified": t.pages_verified,
        "wrong_bytes": t.wrong_bytes,
        "errors_by_kind": t.errors,
        "recovered_pages": k.recovered_pages,
        "pool_healthy_after_daemon_restarts": k.healthy,
        "held_host_pages_at_daemon_kills": k.checked.held_host,
        "held_pool_only_pages_at_daemon_kills": k.checked.held_pool,
        "device_only_pages_at_daemon_kills": k.checked.device_only,
        "acknowledged_lost_host_pages_daemon_kills": k.checked.lost_host,
        "pool_only_pages_gone_after_daemon_kills": k.checked.lost_pool,
        "pool_healthy_after_master_restart": master_kill.healthy,
        "host_evictions_during_master_check": master_kill.evicted_meanwhile,
        "held_host_pages_at_master_kill": back.held_host,
        "held_pool_only_pages_at_master_kill": back.held_pool,
        "device_only_pages_at_master_kill": back.device_only,
        "acknowledged_lost_host_pages_master_down": down.lost_host,
        "acknowledged_lost_host_pages_after_master_restart": back.lost_host,
        "pool_only_pages_gone_after_master_restart": back.lost_pool,
        "observer_wrong_pages": down.wrong_pages + back.wrong_pages + k.checked.wrong_pages,
        "manifest_bytes_max": manifest_max,
        "manifest_bytes_bound": manifest_bound,
        "manifest_samples": manifest_samples,
        "rss_mb_max": (rss_max * 10.0).round() / 10.0,
        "rss_mb_bound": RSS_BOUND_MB,
    });
    println!("{summary}");
    eprintln!("soak (mooncake): {:.1} s", t0.elapsed().as_secs_f64());
    assert_eq!(t.wrong_bytes, 0, "{summary}");
    assert_eq!(
        down.wrong_pages + back.wrong_pages + k.checked.wrong_pages,
        0,
        "{summary}"
    );
    assert!(t.pages_verified > 0 && t.ops > 0, "the clients did work: {summary}");
    assert!(
        master_kill.healthy && k.healthy,
        "the pool is healthy again after every restart: {summary}"
    );
    assert!(k.kills > 0, "the daemon was killed: {summary}");
    assert!(k.recovered_pages > 0, "restarts recovered the arena: {summary}");
    assert!(
        back.held_host > 0 && k.checked.held_host > 0,
        "the daemon held host pages at its kills: {summary}"
    );
    assert!(
        master_kill.evicted_before.is_some(),
        "/metrics counts host evictions: {summary}"
    );
    assert_eq!(
        master_kill.evicted_meanwhile,
        Some(0),
        "nothing was evicted from host during the master check: {summary}"
    );
    assert_eq!(
        down.lost_host + back.lost_host + k.checked.lost_host,
        0,
        "no acknowledged page in host is lost to a daemon or master kill: {summary}; lost {:?} {:?} {:?}; log {}",
        down.lost,
        back.lost,
        k.checked.lost,
        node.log.display()
    );
    assert!(manifest_samples > 0, "the manifest was sampled: {summary}");
    assert!(manifest_max <= manifest_bound, "the manifest stays bounded: {summary}");
    assert!(rss_max <= RSS_BOUND_MB, "private memory stays bounded: {summary}");
}

/// Slots of the Mooncake case's arena (`cluster_support::Node`: 16 MiB of 16 KiB slots).
const MOONCAKE_SLOTS: u64 = (16 << 20) / 16384;

/// When the Mooncake case SIGKILLs its daemon: every 2 minutes in a long run (as the local
/// case), else once, at a quarter of the run; the master dies at half of it.
fn mooncake_daemon_kills(run: Duration) -> Vec<Duration> {
    if run >= LONG_RUN {
        kill_times(run)
    } else {
        vec![run / 4]
    }
}

/// Waits until the daemon has evicted nothing from host for 1 s (eviction the clients'
/// last stores made due may still run once they paused); returns the eviction count then.
fn settle_host_evictions(admin: &Path, paused: Instant) -> Option<u64> {
    let mut evicted = host_evictions(admin);
    let mut still_since = Instant::now();
    while still_since.elapsed() < Duration::from_secs(1) {
        assert!(
            paused.elapsed() < Duration::from_secs(30),
            "host eviction did not settle once the clients paused"
        );
        std::thread::sleep(Duration::from_millis(100));
        let now = host_evictions(admin);
        if now != evicted {
            (evicted, still_since) = (now, Instant::now());
        }
    }
    evicted
}

/// What the Mooncake case's daemon kills found, summed.
#[derive(Default)]
struct DaemonKills {
    kills: u64,
    recovered_pages: u64,
    /// Whether the pool was healthy again after every restart.
    healthy: bool,
    checked: Checked,
    /// Seconds the clients spent paused around the kills' checks.
    paused_s: f64,
}

impl DaemonKills {
    /// After a restart: every page the killed daemon held in host must load with its
    /// bytes. Its store objects lived in its own segment, which went with it (its helper
    /// dies with it, and the master drops a dead client's objects after `client_ttl`):
    /// the pages only in the store are counted, not required. The check waits until the
    /// master no longer names them, so it does not try loads of objects that no segment
    /// holds any more.
    fn count(&mut self, node: &cluster_support::Node, held: &[(PageHash, Held)], device_only: u64) {
        if self.kills == 0 {
            self.healthy = true;
        }
        self.kills += 1;
        let observer = Observer::connect(&node.socket);
        self.recovered_pages += observer.client.stats().unwrap().recovered_pages;
        self.healthy &= cluster_support::eventually(Duration::from_secs(60), || {
            node.admin(&["status"])["pool"]["health"]["state"] == "ok"
        });
        let pool_only: Vec<PageHash> = held
            .iter()
            .filter(|(_, at)| *at == Held::Pool)
            .map(|(h, _)| *h)
            .collect();
        cluster_support::eventually(Duration::from_secs(30), || {
            pool_only
                .chunks(64)
                .all(|hs| observer.client.lookup(hs).is_ok_and(|hit| hit.pool == 0))
        });
        let c = observer.check(held, device_only, true);
        let k = &mut self.checked;
        k.held_host += c.held_host;
        k.held_pool += c.held_pool;
        k.device_only += c.device_only;
        k.lost_host += c.lost_host;
        k.lost_pool += c.lost_pool;
        k.wrong_pages += c.wrong_pages;
        k.lost.extend(c.lost.into_iter().filter(|l| l.ends_with("@host")));
    }
}

/// What the master's kill found.
struct MasterKill {
    /// Host pages checked while the master was down, and every page after its restart.
    down: Checked,
    back: Checked,
    healthy: bool,
    evicted_before: Option<u64>,
    /// Pages evicted from host while the observer looked and loaded.
    evicted_meanwhile: Option<u64>,
}

/// Kills the master (the clients paused, host eviction settled at `evicted`), checks the
/// host pages while it is down and every page once it is back.
fn kill_master(node: &cluster_support::Node, master: &mut cluster_support::Master, evicted: Option<u64>) -> MasterKill {
    let observer = Observer::connect(&node.socket);
    let (held, device_only) = observer.held();
    master.kill();
    // While it is down, only the host pages: a get of a page only in the store waits for
    // the helper's deadline until the daemon sees the store gone.
    let down = observer.check(&held, device_only, false);
    master.restart();
    // Once the daemon answers for its pool again (the helper back on the new master), the
    // host pages load as before; those only in the store may be gone.
    let healthy = cluster_support::eventually(Duration::from_secs(60), || {
        node.admin(&["status"])["pool"]["health"]["state"] == "ok"
    });
    let back = observer.check(&held, device_only, true);
    // None may be evicted meanwhile, or a host page gone would be the cache's choice
    // rather than a loss.
    let evicted_meanwhile = host_evictions(&node.admin)
        .zip(evicted)
        .map(|(b, a)| b.saturating_sub(a));
    MasterKill {
        down,
        back,
        healthy,
        evicted_before: evicted,
        evicted_meanwhile,
    }
}
