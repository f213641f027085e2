//! The Mooncake helper under load, through the daemons' sockets: a node whose loads overrun
//! their deadline (its helper waits before every get, `mooncake.test_get_delay_ms`, on 2
//! workers, so requests also queue past their deadline) keeps its helper, and the store
//! keeps every object: the helper used to be killed on the first late transfer, and with
//! it went this node's segment and every object the store had placed there, other nodes'
//! included.
//!
//! And a helper that is replaced (killed here) took its segment with it: once the master
//! drops that segment, the node writes the objects it still holds in host again.
//!
//! Needs the Mooncake wheel's `mooncake_master` and its Python (`scripts/mooncake-env.sh
//! env`); without them the test writes a `SKIPPED` line, or fails where `KVTIER_REQUIRE`
//! lists `mooncake`.

mod cluster_support;
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_support::{Master, Node, eventually, helper_pid, store_and_share};
use common::rank::RankProc;
use common::require::require;
use common::{hashes, spec};
use kvtier::client::Client;
use kvtier::page::{Namespace, PageHash};
use kvtier::pool::keys::{KeyFormat, scheme_for};
use kvtier::protocol::LoadWait;
use kvtier::tier::device::EmulatedDevice;

/// The master's key list (`/get_all_keys` on its admin port), as text.
fn store_keys(master: &Master) -> String {
    let raw = kvtier::pool::index::sync::get(&master.admin(), "/get_all_keys", Duration::from_secs(10), 64 << 20)
        .expect("the master lists its keys");
    String::from_utf8_lossy(&raw).into_owned()
}

/// Keys of `want` missing from the store.
fn missing(master: &Master, want: &[String]) -> Vec<String> {
    let listed = store_keys(master);
    want.iter().filter(|k| !listed.contains(k.as_str())).cloned().collect()
}

/// One sample of `/metrics`, read through the node's admin socket.
fn metric(node: &Node, name: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(&node.admin).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// `store_and_share`, then waits until the master lists every object of the pages;
/// returns the objects' keys and the ranks (which hold the pages' engine side).
fn store_share_and_list(a: &Node, master: &Master, hs: &[PageHash]) -> (Vec<String>, Vec<RankProc>) {
    let ranks = store_and_share(a, hs);
    let layout = spec(2, 1).build().unwrap();
    let scheme = scheme_for("kvtier", KeyFormat::Kvtier, &Namespace::model("test-model"), &layout);
    let keys: Vec<String> = hs.iter().flat_map(|h| scheme.page_keys(&layout, h)).collect();
    assert!(
        eventually(Duration::from_secs(20), || missing(master, &keys).is_empty()),
        "the store lists A's {} objects",
        keys.len()
    );
    (keys, ranks)
}

#[test]
fn a_replaced_helpers_lost_objects_are_written_again_from_host() {
    if !require(
        "mooncake",
        "a replaced helper needs mooncake_master and the wheel's Python",
    ) {
        return;
    }
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(bin, dir.path());
    // One node: every object lies in its own helper's segment.
    let a = Node::start(&dir.path().join("a"), &master, &python);
    let hs = hashes(0x2e_0000_0000, 12);
    let (keys, ranks) = store_share_and_list(&a, &master, &hs);
    assert!(
        eventually(Duration::from_secs(30), || helper_pid(a.pid()).is_some()),
        "A runs a helper"
    );
    let old = helper_pid(a.pid()).unwrap();
    // SAFETY: kill(2) on the daemon's helper, a process of this test's user.
    unsafe { libc::kill(old as i32, libc::SIGKILL) };
    assert!(
        eventually(Duration::from_secs(60), || helper_pid(a.pid())
            .is_some_and(|p| p != old)),
        "A replaced its helper; log {}",
        a.log.display()
    );
    // The master drops the dead segment after its client TTL (3 s here), and with it every
    // object; A checks its pool pages, finds them lost and writes them again from host.
    let back = eventually(Duration::from_secs(90), || {
        a.log_text().contains("wrote again those host still holds") && missing(&master, &keys).is_empty()
    });
    let gone = missing(&master, &keys);
    let said: Vec<String> = a
        .log_text()
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("helper") || l.contains("pool"))
        .map(str::to_owned)
        .collect();
    assert!(
        back,
        "{} of A's {} objects are not in the store again; the daemon said:\n{}",
        gone.len(),
        keys.len(),
        said.join("\n")
    );
    // /metrics counts the replacement, and the new helper's queue is empty and idle.
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &a,
            "kvtier_pool_helper_restarts_total"
        )
        .is_some_and(|n| n >= 1.0)),
        "/metrics counts A's helper restart: {:?}",
        metric(&a, "kvtier_pool_helper_restarts_total")
    );
    assert!(
        eventually(Duration::from_secs(10), || metric(&a, "kvtier_pool_helper_queued")
            == Some(0.0)
            && metric(&a, "kvtier_pool_helper_in_flight") == Some(0.0)),
        "A's helper queue is idle once the rewrite is done"
    );
    assert!(
        a.admin(&[
            "pages",
            "--prefix",
            &hs.iter().map(PageHash::to_hex).collect::<Vec<_>>().join(",")
        ])["complete_prefix"]["pool"]
            == hs.len(),
        "A counts every page complete in the pool again"
    );
    drop(ranks);
}

#[test]
fn a_helper_whose_loads_overrun_their_deadline_is_kept_and_no_object_is_lost() {
    if !require(
        "mooncake",
        "the helper under load needs mooncake_master and the wheel's Python",
    ) {
        return;
    }
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(bin, dir.path());
    let a = Node::start(&dir.path().join("a"), &master, &python);
    let b = Node::start_with(
        &dir.path().join("b"),
        &master,
        &python,
        &[
            ("mooncake.op_timeout_ms", "300".into()),
            ("mooncake.test_get_delay_ms", "1200".into()),
            ("mooncake.helper_workers", "2".into()),
        ],
    );

    // Node A stores and shares 16 pages: the store places each object in A's segment or
    // in B's.
    let hs = hashes(0x10ad_0000_0000, 16);
    let (keys, ranks) = store_share_and_list(&a, &master, &hs);
    let layout = spec(2, 1).build().unwrap();

    // Node B's engine loads them from 6 threads at once: every get waits 1.2 s in B's helper
    // against a 300 ms deadline, and most wait in its queue of 2 workers past theirs.
    let clients: Vec<(Arc<Client>, Arc<EmulatedDevice>)> = (0..6u16)
        .map(|i| {
            let c = b.client(&format!("b-engine-{i}"), i % 2);
            let dev = Arc::new(EmulatedDevice::new(&layout, 0, 64));
            c.register_device(dev.clone()).unwrap();
            (Arc::new(c), dev)
        })
        .collect();
    let finds = eventually(Duration::from_secs(60), || {
        clients[0].0.lookup(&hs[..4]).is_ok_and(|h| h.pool == 4)
    });
    assert!(finds, "B finds A's pages in the store; log {}", b.log.display());
    let helper = eventually(Duration::from_secs(30), || helper_pid(b.pid()).is_some());
    assert!(helper, "B runs a helper; log {}", b.log.display());
    let before = helper_pid(b.pid()).unwrap();
    let loaders: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, (c, _))| {
            let c = c.clone();
            let hs = hs.clone();
            std::thread::spawn(move || {
                let mut loaded = 0;
                for round in 0..3 {
                    // A different quarter each round and thread: no load finds another's pages in B's host.
                    let part = &hs[(i + round) % 4 * 4..][..4];
                    let slots: Vec<u32> = (0..4).collect();
                    loaded += c.load(part, &slots, LoadWait::Timeout(30_000)).unwrap_or(0);
                }
                loaded
            })
        })
        .collect();
    // B's helper queue through /metrics while the loads run: gets in flight on its 2
    // workers (each takes 1.2 s, the probe comes every 250 ms), never more than 2.
    let (mut in_flight_max, mut queued_max) = (0.0f64, 0.0f64);
    while !loaders.iter().all(|t| t.is_finished()) {
        in_flight_max = in_flight_max.max(metric(&b, "kvtier_pool_helper_in_flight").unwrap_or(0.0));
        queued_max = queued_max.max(metric(&b, "kvtier_pool_helper_queued").unwrap_or(0.0));
        std::thread::sleep(Duration::from_millis(100));
    }
    let loaded: usize = loaders.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(
        loaded < 6 * 3 * 4,
        "every load overran its deadline in B's helper, so not all {} pages could load; {loaded} did",
        6 * 3 * 4
    );

    // B's helper was not replaced, and the store still holds every object, past the master's
    // client TTL (3 s): a killed helper's segment, and the objects in it, would be gone by then.
    let log = b.log_text();
    assert!(
        log.contains("answered after its deadline"),
        "B's gets overran their deadline; log {}",
        b.log.display()
    );
    assert!(
        !log.contains("killing the mooncake helper"),
        "B killed a helper that was only slow; log {}",
        b.log.display()
    );
    assert_eq!(
        helper_pid(b.pid()),
        Some(before),
        "B's helper is the one it started with"
    );
    // After the loads: the queue is idle again, the helper ran gets, was never replaced,
    // and every figure is there.
    let figures = || -> Vec<(&str, Option<f64>)> {
        [
            "kvtier_pool_helper_queued",
            "kvtier_pool_helper_in_flight",
            "kvtier_pool_helper_timed_out_in_queue_total",
            "kvtier_pool_helper_refused_full_total",
            "kvtier_pool_helper_done_total",
            "kvtier_pool_helper_restarts_total",
        ]
        .into_iter()
        .map(|n| (n, metric(&b, n)))
        .collect()
    };
    let idle = eventually(Duration::from_secs(10), || {
        metric(&b, "kvtier_pool_helper_in_flight") == Some(0.0) && metric(&b, "kvtier_pool_helper_queued") == Some(0.0)
    });
    let seen = figures();
    eprintln!("B's helper queue: in flight at most {in_flight_max}, queued at most {queued_max}; after: {seen:?}");
    assert!(
        seen.iter().all(|(_, v)| v.is_some()),
        "/metrics has every helper figure: {seen:?}"
    );
    assert!(
        (1.0..=2.0).contains(&in_flight_max),
        "/metrics showed gets in flight on B's 2 helper workers: at most {in_flight_max}"
    );
    assert!(idle, "B's helper queue is idle after the loads: {seen:?}");
    assert_eq!(
        metric(&b, "kvtier_pool_helper_restarts_total"),
        Some(0.0),
        "no helper restart on B: {seen:?}"
    );
    assert!(
        metric(&b, "kvtier_pool_helper_done_total").is_some_and(|n| n >= 1.0),
        "B's helper ran gets: {seen:?}"
    );
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(5) {
        let gone = missing(&master, &keys);
        assert!(
            gone.is_empty(),
            "the store lost {} of A's {} objects: {gone:?}",
            gone.len(),
            keys.len()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    drop(ranks);
}
