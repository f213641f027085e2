//! A master that trickles its replies does not starve the daemon, through its sockets.
//!
//! Node B reaches the master's RPC port through a proxy in this test. For about 20 s the
//! proxy forwards the master's replies one byte every 2.5 s (requests pass as they come),
//! to B's existence queries and to its helper's calls alike. Meanwhile 80 connections of
//! one loading engine on B keep loads and lookups of pages that only the store holds in
//! flight, each needing the master; an unrelated engine on B (its own namespace) keeps
//! connecting, storing and looking up its own pages, and every one of those calls must
//! succeed. B's thread count stays under its fixed threads plus its blocking pool's cap:
//! a trickled reply may hold a blocking thread no longer than the op timeout, and never
//! more threads than that pool has. Once the trickle ends, B finds and loads the pages
//! again, with the right bytes.
//!
//! Needs the Mooncake wheel's `mooncake_master` and its Python (`scripts/mooncake-env.sh
//! env`); without them the test writes a `SKIPPED` line, or fails where `KVTIER_REQUIRE`
//! lists `mooncake`.

mod cluster_support;
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cluster_support::{Master, Node, eventually, store_and_share};
use common::require::require;
use common::{hashes, identity, seed, spec};
use kvtier::client::{Client, ClientConfig};
use kvtier::page::Namespace;
use kvtier::protocol::LoadWait;
use kvtier::tier::device::EmulatedDevice;

/// One byte of a reply every this long while the trickle lasts.
const TRICKLE_BYTE: Duration = Duration::from_millis(2500);
/// How long the trickle lasts.
const TRICKLE_FOR: Duration = Duration::from_secs(20);
/// Loads and lookups of the loading engine in flight at once.
const LOADERS: usize = 80;
/// The daemon's blocking pool's cap (`BLOCKING_THREADS` in the daemon's server): commands
/// that may block run there, so a trickle may hold at most this many threads.
const BLOCKING_CAP: usize = 64;
/// Longest one call of the unrelated engine may take during the trickle. Its connects,
/// stores and lookups of host pages take milliseconds even on a loaded machine; a call
/// that waits behind the trickled reads waits until its helper is replaced as hung (15 s).
/// A store that makes room may wait one op timeout (3 s) for the staging buffer; 10 s
/// leaves a loaded machine room and still fails the 15 s stall.
const STALL: Duration = Duration::from_secs(10);

/// A TCP proxy to `upstream`: requests pass as they come; replies pass as they come too,
/// except while `trickle` is set, when they pass one byte every [`TRICKLE_BYTE`].
struct Proxy {
    addr: String,
    trickle: Arc<AtomicBool>,
    /// Reply bytes forwarded one at a time, to show that the trickle was felt.
    trickled: Arc<AtomicUsize>,
}

impl Proxy {
    fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let trickle = Arc::new(AtomicBool::new(false));
        let trickled = Arc::new(AtomicUsize::new(0));
        let (t, n) = (trickle.clone(), trickled.clone());
        std::thread::spawn(move || {
            for down in listener.incoming().map_while(Result::ok) {
                let Ok(up) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let _ = up.set_nodelay(true);
                let _ = down.set_nodelay(true);
                let (up2, down2) = (up.try_clone().unwrap(), down.try_clone().unwrap());
                std::thread::spawn(move || pipe(down, up, None));
                let (t, n) = (t.clone(), n.clone());
                std::thread::spawn(move || pipe(up2, down2, Some((t, n))));
            }
        });
        Self {
            addr,
            trickle,
            trickled,
        }
    }
}

/// Copies `from` to `to` until either side closes; with `trickle`, one byte at a time
/// while its flag is set.
fn pipe(mut from: TcpStream, mut to: TcpStream, trickle: Option<(Arc<AtomicBool>, Arc<AtomicUsize>)>) {
    let mut buf = vec![0u8; 64 << 10];
    'copy: loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut at = 0;
        while at < n {
            let slow = trickle.as_ref().is_some_and(|(t, _)| t.load(Ordering::Relaxed));
            if !slow {
                if to.write_all(&buf[at..n]).is_err() {
                    break 'copy;
                }
                break;
            }
            if to.write_all(&buf[at..at + 1]).is_err() {
                break 'copy;
            }
            at += 1;
            if let Some((t, count)) = &trickle {
                count.fetch_add(1, Ordering::Relaxed);
                // The trickle's pace (not a wait for a condition): the next byte in 2.5 s,
                // or at once when the trickle ends.
                let next = Instant::now() + TRICKLE_BYTE;
                while Instant::now() < next && t.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// The daemon's threads (`Threads:` in `/proc/<pid>/status`).
fn threads(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// What the unrelated engine did while the trickle lasted.
#[derive(Default, Debug)]
struct Unrelated {
    connects: usize,
    stores: usize,
    lookups: usize,
    errors: Vec<String>,
    /// The slowest connect, store and lookup.
    slowest: [Duration; 3],
}

/// The unrelated engine: a fresh connection, a store of 4 new pages (from `base` on) and a
/// lookup that must find them in host, round after round until `stop` (at least once).
fn unrelated(b: &Node, base: u64, stop: &AtomicBool) -> Unrelated {
    let layout = spec(1, 1);
    let built = layout.clone().build().unwrap();
    let mut id = identity(&format!("other-engine-{base:x}"), 0, 0, 1, 1);
    id.namespace = Namespace::model("other-model");
    let cfg = ClientConfig::new(&b.socket, id.clone(), layout.clone()).with_timeout(Duration::from_secs(20));
    let c = Client::connect(cfg).expect("the unrelated engine connects");
    let dev = Arc::new(EmulatedDevice::new(&built, 0, 64));
    c.register_device(dev.clone()).unwrap();
    let mut out = Unrelated::default();
    let mut round = 0u64;
    loop {
        let mut started = Instant::now();
        let mut probe_id = id.clone();
        probe_id.instance = format!("other-probe-{round}");
        let probe = ClientConfig::new(&b.socket, probe_id, layout.clone()).with_timeout(Duration::from_secs(20));
        match Client::connect(probe) {
            Ok(p) => {
                out.connects += 1;
                drop(p);
            }
            Err(e) => out.errors.push(format!("connect: {e}")),
        }
        out.slowest[0] = out.slowest[0].max(started.elapsed());
        started = Instant::now();
        let hs = hashes(base + round * 16, 4);
        for (i, h) in hs.iter().enumerate() {
            dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
        }
        match c.store(&hs, &[0, 1, 2, 3], "other") {
            Ok(r) if r.complete == hs.len() as u32 => out.stores += 1,
            Ok(r) => out
                .errors
                .push(format!("store: {} of {} complete", r.complete, hs.len())),
            Err(e) => out.errors.push(format!("store: {e}")),
        }
        out.slowest[1] = out.slowest[1].max(started.elapsed());
        started = Instant::now();
        match c.lookup(&hs) {
            Ok(h) if h.device + h.host == hs.len() => out.lookups += 1,
            Ok(h) => out.errors.push(format!("lookup of {} stored pages: {h:?}", hs.len())),
            Err(e) => out.errors.push(format!("lookup: {e}")),
        }
        out.slowest[2] = out.slowest[2].max(started.elapsed());
        round += 1;
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    out
}

#[test]
fn a_trickling_master_does_not_starve_an_unrelated_engine() {
    if !require(
        "mooncake",
        "a trickling master needs mooncake_master and the wheel's Python",
    ) {
        return;
    }
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(bin, dir.path());
    let proxy = Proxy::start(master.addr());

    // A stores 16 pages in the store before B starts, so every object lies in A's segment
    // and B holds none of them in host: each of B's loads and lookups needs the master.
    let a = Node::start(&dir.path().join("a"), &master, &python);
    let hs = hashes(0x7c1e_0000_0000, 16);
    let ranks = store_and_share(&a, &hs);
    let b = Node::start_via(&dir.path().join("b"), &master, &proxy.addr, &python, &[]);
    let layout = spec(2, 1);
    let built = layout.build().unwrap();
    let loaders: Vec<(Arc<Client>, Arc<EmulatedDevice>)> = (0..LOADERS)
        .map(|i| {
            let c = b.client(&format!("b-loader-{i}"), (i % 2) as u16);
            let dev = Arc::new(EmulatedDevice::new(&built, 0, 64));
            c.register_device(dev.clone()).unwrap();
            (Arc::new(c), dev)
        })
        .collect();
    let finds = eventually(Duration::from_secs(60), || {
        loaders[0].0.lookup(&hs).is_ok_and(|h| h.pool == hs.len())
    });
    assert!(finds, "B finds A's pages in the store; log {}", b.log.display());
    // B's fixed threads, once it has served a store, a lookup and a pool query.
    let idle = {
        let warm = unrelated(&b, 0x07e4_0000_0000, &AtomicBool::new(true));
        assert!(warm.errors.is_empty(), "{warm:?}");
        threads(b.pid())
    };
    let bound = idle + BLOCKING_CAP;

    proxy.trickle.store(true, Ordering::Relaxed);
    let trickle_start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let in_flight: Vec<_> = loaders
        .iter()
        .enumerate()
        .map(|(i, (c, _))| {
            let (c, hs, stop) = (c.clone(), hs.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut calls, mut failed) = (0usize, 0usize);
                while !stop.load(Ordering::Relaxed) {
                    let part = &hs[i % 4 * 4..][..4];
                    let ok = if i % 2 == 0 {
                        c.load(part, &[0, 1, 2, 3], LoadWait::Timeout(30_000)).is_ok()
                    } else {
                        c.lookup(part).is_ok()
                    };
                    calls += 1;
                    failed += usize::from(!ok);
                }
                (calls, failed)
            })
        })
        .collect();
    let unrelated_stop = Arc::new(AtomicBool::new(false));
    let work = std::thread::scope(|s| {
        let u = s.spawn(|| unrelated(&b, 0x07e5_0000_0000, &unrelated_stop));
        let mut most = 0;
        while trickle_start.elapsed() < TRICKLE_FOR {
            most = most.max(threads(b.pid()));
            std::thread::sleep(Duration::from_millis(100));
        }
        unrelated_stop.store(true, Ordering::Relaxed);
        let work = u.join().unwrap();
        (work, most)
    });
    let (work, most) = work;
    proxy.trickle.store(false, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let trickled = proxy.trickled.load(Ordering::Relaxed);
    eprintln!(
        "trickle {:?}: {trickled} reply bytes trickled; unrelated engine {} connects, {} stores, {} lookups, slowest connect, store, lookup {:?}, {} errors; daemon threads idle {idle}, most {most}, bound {bound}",
        trickle_start.elapsed(),
        work.connects,
        work.stores,
        work.lookups,
        work.slowest,
        work.errors.len()
    );
    assert!(trickled > 0, "the master's replies to B were trickled");
    assert!(
        work.errors.is_empty(),
        "the unrelated engine's calls failed during the trickle: {:?}; log {}",
        &work.errors[..work.errors.len().min(10)],
        b.log.display()
    );
    assert!(
        work.slowest.iter().all(|t| *t < STALL),
        "the unrelated engine's calls waited behind the trickle: slowest connect, store, lookup {:?}; log {}",
        work.slowest,
        b.log.display()
    );
    assert!(
        work.connects > 0 && work.stores > 0 && work.lookups > 0,
        "the unrelated engine kept working: {work:?}; log {}",
        b.log.display()
    );
    assert!(
        most < bound,
        "B ran {most} threads during the trickle, {idle} idle: a trickle may hold at most its blocking pool's {BLOCKING_CAP}"
    );

    // The loading engine's calls end (each within its deadline), and B recovers: it finds
    // A's pages in the store again and loads them with the right bytes.
    let (mut calls, mut failed) = (0, 0);
    for t in in_flight {
        let (c, f) = t.join().unwrap();
        calls += c;
        failed += f;
    }
    eprintln!("loading engine: {calls} calls during the trickle, {failed} failed");
    assert!(calls >= LOADERS, "all {LOADERS} loaders had a call in flight");
    let (c, dev) = &loaders[1];
    let back = eventually(Duration::from_secs(90), || {
        c.lookup(&hs).is_ok_and(|h| h.pool == hs.len())
            && c.load(&hs[..4], &[0, 1, 2, 3], LoadWait::Timeout(30_000))
                .is_ok_and(|n| n == 4)
    });
    assert!(
        back,
        "B finds and loads A's pages after the trickle; log {}",
        b.log.display()
    );
    for (i, h) in hs[..4].iter().enumerate() {
        assert!(
            dev.page_matches(i as u32, seed(h, 1, 0)).unwrap(),
            "page {i} loaded after the trickle holds A's rank 1 bytes"
        );
    }
    drop(ranks);
}
