//! Fault cases of issue 15 against the built daemon, one regression test each: refused
//! stores leave no phantom pages, `no_space` only when there is truly no room, a store
//! larger than the arena is refused up front, control frames get a body deadline and
//! idle connections a timeout, and the small ones (pin TTL saturation, the 4,096-hash
//! admin prefix limit).

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use kvtier::client::{Client, ClientConfig, ClientError};
use kvtier::protocol::{ErrorCode, Request, Response};
use kvtier::tier::device::EmulatedDevice;

/// A connected in-process rank (tp 1, pp 1) with an emulated device of `pages` pages.
fn rank(d: &Daemon, instance: &str, pages: u32) -> (Client, Arc<EmulatedDevice>) {
    let layout = spec(1, 1);
    let c = Client::connect(
        ClientConfig::new(&d.socket, identity(instance, 0, 0, 1, 1), layout.clone())
            .with_timeout(Duration::from_secs(10)),
    )
    .unwrap();
    let dev = Arc::new(EmulatedDevice::new(&layout.build().unwrap(), 0, pages));
    c.register_device(dev.clone()).unwrap();
    (c, dev)
}

fn remote_code(e: &ClientError) -> Option<ErrorCode> {
    match e {
        ClientError::Remote(r) => Some(r.code),
        _ => None,
    }
}

/// Item 3: a store refused for lack of room leaves no trace. A rank holds every slot of
/// the arena in open (uncommitted) grants; another rank's store is refused; a fresh
/// engine must then see none of the refused pages anywhere, on device included.
#[test]
fn a_refused_store_leaves_no_phantom_device_pages() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), 64 << 10);
    let (holder, _hdev) = rank(&d, "holder", 64);
    let slots = holder.arena().unwrap().slots as usize;
    assert!(slots > 0 && slots <= 64, "{slots} slots");
    // Open grants on every slot: nothing is evictable, nothing can be freed.
    let mut plans = Vec::new();
    for i in 0..=slots as u64 {
        match holder.begin_store(&hashes(10_000 + i, 1), "") {
            Ok(p) => plans.push(p),
            Err(e) if remote_code(&e) == Some(ErrorCode::NoSpace) => break,
            Err(e) => panic!("slot {i} of {slots}: {e}"),
        }
    }
    assert!(!plans.is_empty() && plans.len() <= slots);
    let (b, bdev) = rank(&d, "refused", 16);
    let refused = hashes(50_000, 16);
    for (i, h) in refused.iter().enumerate() {
        bdev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
    }
    let slots16: Vec<u32> = (0..16).collect();
    let err = b.store(&refused, &slots16, "").unwrap_err();
    assert_eq!(remote_code(&err), Some(ErrorCode::NoSpace), "{err}");
    let (fresh, _) = rank(&d, "fresh", 4);
    let hit = fresh.lookup(&refused).unwrap();
    assert_eq!(
        (hit.device, hit.host, hit.pool),
        (0, 0, 0),
        "pages nobody stored must not be credited to any tier"
    );
    // The holder's pages are untouched by the refusal: on its device, and its grants
    // still end cleanly.
    assert_eq!(fresh.lookup(&hashes(10_000, 1)).unwrap().device, 1);
    for p in &plans {
        holder.abort(p).unwrap();
    }
}

/// Item 7: a store with more objects than the arena has slots is refused up front with
/// a clear error, and writes nothing.
#[test]
fn a_store_bigger_than_the_arena_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), 64 << 10);
    let (c, dev) = rank(&d, "big", 256);
    let slots = c.arena().unwrap().slots as usize;
    let n = slots + 8;
    let hs = hashes(70_000, n);
    for (i, h) in hs.iter().enumerate() {
        dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
    }
    let dev_slots: Vec<u32> = (0..n as u32).collect();
    let err = c.store(&hs, &dev_slots, "").unwrap_err();
    assert_eq!(remote_code(&err), Some(ErrorCode::BadRequest), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("{n} pages")) && msg.contains(&format!("{slots} in all")),
        "{msg}"
    );
    let hit = c.lookup(&hs).unwrap();
    assert_eq!((hit.device, hit.host, hit.pool), (0, 0, 0), "nothing of it was stored");
    // One that fits is stored whole.
    let ok = c.store(&hs[..slots / 2], &dev_slots[..slots / 2], "").unwrap();
    assert_eq!(ok.written, slots / 2);
}

/// Item 7: 32 concurrent clients storing into an arena that always has evictable pages
/// (and a pool with room) never get `no_space`: slots being freed by another store's
/// eviction are waited for, not reported missing.
#[test]
fn concurrent_stores_never_get_no_space_while_there_is_room() {
    let dir = tempfile::tempdir().unwrap();
    // 1 MiB arena, 64 MiB pool: 32 clients x 4 pages in flight use at most half of it.
    let d = Daemon::start_with(dir.path(), 1 << 20, &["pool_bytes=67108864"]);
    let no_space = Arc::new(AtomicU64::new(0));
    let other = Arc::new(AtomicU64::new(0));
    let stored = Arc::new(AtomicU64::new(0));
    std::thread::scope(|s| {
        for t in 0..32u64 {
            let (d, no_space, other, stored) = (&d, no_space.clone(), other.clone(), stored.clone());
            s.spawn(move || {
                let (c, dev) = rank(d, &format!("c{t}"), 4);
                for round in 0..40u64 {
                    let hs = hashes(1_000_000 * (t + 1) + round * 4, 4);
                    for (i, h) in hs.iter().enumerate() {
                        dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
                    }
                    match c.store(&hs, &[0, 1, 2, 3], "") {
                        Ok(r) => {
                            stored.fetch_add(r.written as u64, Ordering::Relaxed);
                        }
                        Err(e) if remote_code(&e) == Some(ErrorCode::NoSpace) => {
                            no_space.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            eprintln!("store failed: {e}");
                            other.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    let (ns, ot, st) = (
        no_space.load(Ordering::Relaxed),
        other.load(Ordering::Relaxed),
        stored.load(Ordering::Relaxed),
    );
    assert_eq!((ns, ot), (0, 0), "{st} pages stored");
    assert_eq!(st, 32 * 40 * 4, "every page of every store was written");
}

/// A raw control connection that has sent `Connect` for a fresh instance.
fn raw_connected(d: &Daemon, instance: &str) -> UnixStream {
    let mut s = UnixStream::connect(&d.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut body = Vec::new();
    Request::Connect {
        identity: identity(instance, 0, 0, 1, 1),
        layout: spec(1, 1),
    }
    .encode(1, &mut body);
    s.write_all(&body).unwrap();
    let a = answer(&mut s);
    assert!(matches!(a, Some(Response::Connected { .. })), "{a:?}");
    s
}

fn ping_frame(id: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    Request::Ping {
        payload: payload.to_vec(),
    }
    .encode(id, &mut out);
    out
}

/// Item 9: a pause inside a frame body is not a reason to close; a body that does not
/// complete within `frame_body_timeout_ms` is answered `bad_frame` and closed.
#[test]
fn a_frame_body_has_its_own_deadline_and_pauses_inside_it_are_fine() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(dir.path(), 64 << 10, &["frame_body_timeout_ms=1500"]);
    let mut s = raw_connected(&d, "pause");
    let frame = ping_frame(2, &[0x5a; 64]);
    s.write_all(&frame[..20]).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    s.write_all(&frame[20..]).unwrap();
    assert_eq!(
        answer(&mut s),
        Some(Response::Pong {
            payload: vec![0x5a; 64]
        }),
        "a 400 ms pause inside a body is served"
    );
    // A body that stops for good.
    s.write_all(&ping_frame(3, &[1; 64])[..24]).unwrap();
    let got = answer(&mut s);
    assert_eq!(code(got), Some(ErrorCode::BadFrame), "the stalled frame is refused");
    let mut rest = [0u8; 16];
    assert_eq!(s.read(&mut rest).unwrap_or(0), 0, "and the connection closed");
}

/// Item 9: idle connections cannot hold the connection limit: one that never sent
/// `Connect` is closed after `connect_timeout_ms`, and a connected rank's after
/// `idle_timeout_ms`, so a new engine gets in.
#[test]
fn idle_connections_are_closed_so_a_new_engine_gets_in() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(
        dir.path(),
        64 << 10,
        &["max_connections=4", "connect_timeout_ms=1000", "idle_timeout_ms=1500"],
    );
    // The start-up probe's connection must be gone before the limit is filled: the
    // connected idle rank waits until the daemon counts it alone.
    let mut connected = raw_connected(&d, "idle");
    until_sole_connection(&mut connected, Duration::from_secs(10));
    let mut idle: Vec<UnixStream> = (0..3).map(|_| UnixStream::connect(&d.socket).unwrap()).collect();
    idle.push(connected);
    // The limit is held: a fifth connection is refused.
    let mut over = UnixStream::connect(&d.socket).unwrap();
    over.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(code(answer(&mut over)), Some(ErrorCode::TooManyConnections));
    // Each idle socket is closed by the daemon (read sees EOF).
    for s in &mut idle {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 64];
        assert_eq!(s.read(&mut b).unwrap(), 0, "the daemon closed an idle connection");
    }
    let (c, _) = rank(&d, "newcomer", 4);
    assert_eq!(c.lookup(&hashes(1, 1)).unwrap().device, 0);
}

fn admin_socket(d: &Daemon) -> std::path::PathBuf {
    d.dir.join("admin.sock")
}

/// `--set` pairs that put the admin socket in the test's directory.
fn admin_set(dir: &std::path::Path) -> String {
    format!("admin_socket={}", dir.join("admin.sock").display())
}

/// One HTTP/1.1 request on the daemon's admin socket; the status and the body.
fn admin(d: &Daemon, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = UnixStream::connect(admin_socket(d)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: kvtier\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

/// Item 10: a pin TTL near `u64::MAX` (allowed once `max_pin_ttl_ms` is raised that far)
/// saturates instead of wrapping into the past: the pin holds through eviction and ticks.
#[test]
fn a_pin_ttl_near_u64_max_saturates_and_holds() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(dir.path(), 64 << 10, &["tick_ms=20", &admin_set(dir.path())]);
    let (c, dev) = rank(&d, "pin", 256);
    let slots = c.arena().unwrap().slots as u64;
    let keep = hashes(90_000, 2);
    for (i, h) in keep.iter().enumerate() {
        dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
    }
    assert_eq!(c.store(&keep, &[0, 1], "").unwrap().written, 2);
    // Not on device any more: a lookup credits host (or pool) only.
    c.removed(&keep).unwrap();
    let (st, body) = admin(
        &d,
        "PUT",
        "/v1/config",
        &format!("{{\"max_pin_ttl_ms\": {}}}", u64::MAX),
    );
    assert_eq!(st, 200, "{body}");
    // The answer is the configuration now in force (applied before the answer).
    let now: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(now["max_pin_ttl_ms"].as_u64(), Some(u64::MAX), "{body}");
    let pin = kvtier::hints::Hint::Pin {
        target: kvtier::hints::HintTarget::Pages(keep.clone()),
        tier: kvtier::tier::TierKind::Host,
        ttl_ms: u64::MAX - 1,
    };
    let outcome = c.hint(pin).unwrap();
    assert_eq!(outcome, kvtier::hints::HintOutcome::Accepted { pages: 2 });
    // Push the arena through twice its size; unpinned pages go to the pool.
    for round in 0..(slots / 2) {
        let hs = hashes(100_000 + round * 4, 4);
        for (i, h) in hs.iter().enumerate() {
            dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
        }
        c.store(&hs, &[0, 1, 2, 3], "").unwrap();
        c.removed(&hs).unwrap();
    }
    // Upkeep has had its chance: a whole run (pin expiry, then eviction by watermark)
    // started after the last store.
    two_more_upkeep_runs(&admin_socket(&d), Duration::from_secs(15));
    let hit = c.lookup(&keep).unwrap();
    assert_eq!((hit.device, hit.host), (0, 2), "the pinned pages stayed on host");
}

/// Item 10: the documented 4,096-hash `prefix=` limit is reachable (in a form body), and
/// one more is refused with `batch_too_large`.
#[test]
fn admin_prefix_of_4096_hashes_is_served_and_4097_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(dir.path(), 64 << 10, &[&admin_set(dir.path())]);
    let (c, dev) = rank(&d, "prefix", 4);
    let hs = hashes(1, 4097);
    for (i, h) in hs[..2].iter().enumerate() {
        dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
    }
    c.store(&hs[..2], &[0, 1], "").unwrap();
    let hex = |n: usize| hs[..n].iter().map(|h| h.to_hex()).collect::<Vec<_>>().join(",");
    let body = format!("prefix={}", hex(4096));
    assert!(body.len() > 16 << 10, "the prefix does not fit a request head");
    let (st, answer) = admin(&d, "POST", "/v1/pages", &body);
    assert_eq!(st, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(v["complete_prefix"]["host"], 2, "{}", &answer[..answer.len().min(300)]);
    let (st, answer) = admin(&d, "POST", "/v1/pages", &format!("prefix={}", hex(4097)));
    assert_eq!(st, 413, "{answer}");
    assert!(answer.contains("batch_too_large"), "{answer}");
    // A short one still works as a GET.
    let (st, _) = admin(&d, "GET", &format!("/v1/pages?prefix={}", hex(2)), "");
    assert_eq!(st, 200);
}

/// Item 8: 64 clients trickling a request cannot lock the admin socket: a newcomer at the
/// limit takes the slot of the oldest slow one and is answered, and the slow one is cut
/// off (it never gets an answer to a request it never finished).
#[test]
fn slow_admin_clients_cannot_lock_out_a_newcomer() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(dir.path(), 64 << 10, &[&admin_set(dir.path())]);
    let mut slow: Vec<UnixStream> = Vec::new();
    for _ in 0..64 {
        let mut s = UnixStream::connect(admin_socket(&d)).unwrap();
        s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: kvtier\r\n").unwrap();
        slow.push(s);
    }
    // Past the grace a slow request has before it can be displaced.
    std::thread::sleep(Duration::from_millis(600));
    for i in 0..3 {
        let (st, body) = admin(&d, "GET", "/v1/status", "");
        assert_eq!(st, 200, "newcomer {i} is served while 64 clients trickle: {body}");
    }
    // The three oldest slow clients lost their slots: their sockets read as closed.
    for s in &mut slow[..3] {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = Vec::new();
        let _ = s.read_to_end(&mut b);
        assert!(
            !String::from_utf8_lossy(&b).contains("200 OK"),
            "a displaced client gets no answer"
        );
    }
}

/// A peer that pipelines thousands of commands, each run inline on the control thread,
/// takes turns with the other connections: another client's ping is answered while most
/// of the burst is still to come, not after all of it (a poll of a 4,096-page ticket
/// walks every page; 2,000 of them once held the thread for seconds).
#[test]
fn a_pipelined_burst_of_inline_commands_takes_turns_with_other_connections() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(dir.path(), 8 << 20, &["host.slot_bytes=256"]);
    let layout = small_spec();
    let pages = 4096usize;
    let c = d.client(identity("big", 0, 0, 1, 1), layout.clone());
    c.register_device(Arc::new(EmulatedDevice::new(
        &layout.clone().build().unwrap(),
        0,
        pages as u32,
    )))
    .unwrap();
    let slots: Vec<u32> = (0..pages as u32).collect();
    let ticket = c.store(&hashes(1, pages), &slots, "").unwrap().ticket;
    // Connection A: connected as a rank, then 2,000 polls of that ticket in one write.
    let mut a = UnixStream::connect(&d.socket).unwrap();
    a.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut connect = Vec::new();
    Request::Connect {
        identity: identity("burst", 0, 0, 1, 1),
        layout: layout.clone(),
    }
    .encode(1, &mut connect);
    a.write_all(&connect).unwrap();
    assert!(matches!(answer(&mut a), Some(Response::Connected { .. })));
    const N: usize = 2000;
    let mut burst = Vec::new();
    for i in 0..N {
        Request::Poll { ticket }.encode(10 + i as u64, &mut burst);
    }
    let mut b = UnixStream::connect(&d.socket).unwrap();
    b.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    // A's answers, each timed as it is read, on a thread of their own.
    let mut reader = a.try_clone().unwrap();
    let answers = std::thread::spawn(move || {
        (0..N)
            .map(|_| {
                let r = answer(&mut reader);
                assert!(matches!(r, Some(Response::Ticket(_))), "{r:?}");
                std::time::Instant::now()
            })
            .collect::<Vec<_>>()
    });
    a.write_all(&burst).unwrap();
    b.write_all(&ping_frame(2, b"me too")).unwrap();
    assert_eq!(
        answer(&mut b),
        Some(Response::Pong {
            payload: b"me too".to_vec()
        })
    );
    let pong = std::time::Instant::now();
    let times = answers.join().unwrap();
    let before = times.iter().filter(|&&t| t < pong).count();
    let burst_ms = (times[N - 1] - times[0]).as_millis();
    assert!(
        before < N / 2,
        "the ping was answered after {before} of the burst's {N} answers (the burst took {burst_ms} ms)"
    );
}
