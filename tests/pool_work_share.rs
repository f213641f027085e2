//! Commands that may wait on the pool take their blocking threads from a capped share,
//! through the daemon's sockets: with every pool call held up for 20 s
//! (`pool.fault_delay_ms`), 80 connections of one engine each send a demote-to-pool hint
//! (each holds a blocking thread on the pool while it runs). An unrelated engine (its
//! own namespace) must still connect, store, look up and load meanwhile: such pool work
//! (session phase changes, request ends, pool hints) may take at most 16 of the daemon's
//! 64 blocking threads, and loads and lookups have 32 places of their own, so B's calls,
//! which need none of the pool, never wait behind the demotes. Before the cap, the demotes
//! took all 64 threads and every blocking command of every other engine waited behind
//! them for the whole delay.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvtier::client::{Client, ClientConfig};
use kvtier::hints::{Hint, HintTarget};
use kvtier::page::Namespace;
use kvtier::protocol::LoadWait;
use kvtier::tier::TierKind;
use kvtier::tier::device::EmulatedDevice;

/// Demote hints in flight at once, each from its own connection.
const DEMOTERS: usize = 80;
/// How long every pool call waits first.
const POOL_DELAY_MS: u64 = 20_000;
/// Longest one call of the unrelated engine may take while the demotes are stuck: well
/// under the pool's delay, which is what it waited before.
const CALL_BOUND: Duration = Duration::from_secs(8);

/// The daemon's threads asleep in the kernel's nanosleep: those waiting out the pool's
/// delay (`std::thread::sleep` in the delayed pool), beside a few of the daemon's own.
fn sleeping(pid: u32) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| std::fs::read_to_string(t.path().join("wchan")).is_ok_and(|w| w.trim() == "hrtimer_nanosleep"))
        .count()
}

fn engine(socket: &std::path::Path, instance: &str, model: &str) -> (Client, Arc<EmulatedDevice>) {
    let mut id = identity(instance, 0, 0, 1, 1);
    id.namespace = Namespace::model(model);
    let cfg = ClientConfig::new(socket, id, spec(1, 1)).with_timeout(CALL_BOUND);
    let c = Client::connect(cfg).expect("connects");
    let dev = Arc::new(EmulatedDevice::new(&spec(1, 1).build().unwrap(), 0, DEMOTERS as u32));
    c.register_device(dev.clone()).expect("registers its device");
    (c, dev)
}

#[test]
fn demotes_stuck_on_a_slow_pool_leave_blocking_threads_for_an_unrelated_engine() {
    let dir = tempfile::tempdir().unwrap();
    let delay = format!("pool.fault_delay_ms={POOL_DELAY_MS}");
    let d = Daemon::start_with(dir.path(), 8 << 20, &[delay.as_str()]);
    let pid = d.pid().unwrap();

    // Engine A stores one page per demoter; the unrelated engine B connects and stores
    // before the pool is busy (its namespace's first connection is then behind it).
    let (a, a_dev) = engine(&d.socket, "a-engine", "test-model");
    let hs = hashes(0x5a_0000_0000, DEMOTERS);
    let slots: Vec<u32> = (0..DEMOTERS as u32).collect();
    for (i, h) in hs.iter().enumerate() {
        a_dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
    }
    a.store(&hs, &slots, "").expect("A stores its pages");
    let (b, b_dev) = engine(&d.socket, "b-engine", "other-model");
    let warm = hashes(0xb0_0000_0000, 4);
    for (i, h) in warm.iter().enumerate() {
        b_dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
    }
    b.store(&warm, &[0, 1, 2, 3], "").expect("B stores before the demotes");
    let idle_sleepers = sleeping(pid);

    // 80 demote-to-pool hints, each on its own connection, each stuck in the pool.
    let socket = d.socket.clone();
    let demoters: Vec<_> = hs
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let (socket, h) = (socket.clone(), *h);
            std::thread::spawn(move || {
                let mut id = identity(&format!("a-demoter-{i}"), 0, 0, 1, 1);
                id.namespace = Namespace::model("test-model");
                let cfg = ClientConfig::new(&socket, id, spec(1, 1)).with_timeout(Duration::from_secs(60));
                if let Ok(c) = Client::connect(cfg) {
                    let _ = c.hint(Hint::Demote {
                        target: HintTarget::Prefix(vec![h]),
                        to: TierKind::Pool,
                    });
                }
            })
        })
        .collect();
    // The demotes are stuck once 16 more of the daemon's threads sleep in the pool's delay.
    let t = Instant::now();
    while sleeping(pid) < idle_sleepers + 16 {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the demotes did not reach the pool: {idle_sleepers} threads asleep, then {}",
            sleeping(pid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut stuck = sleeping(pid) - idle_sleepers;

    // Meanwhile B keeps working: a fresh connection, a store of new pages, a lookup and a
    // load of them, each within CALL_BOUND (its client's timeout).
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    for round in 0..5u64 {
        let call = Instant::now();
        let (c, dev) = engine(&d.socket, &format!("b-engine-{round}"), "other-model");
        let hs = hashes(0xb1_0000_0000 + round * 100, 4);
        for (i, h) in hs.iter().enumerate() {
            dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
        }
        c.store(&hs, &[0, 1, 2, 3], "")
            .unwrap_or_else(|e| panic!("B's store {round} while the demotes are stuck: {e}"));
        let hit = c.lookup(&hs).expect("B's lookup");
        assert_eq!(hit.total(), 4, "B finds its pages: {hit:?}");
        let n = b
            .load(&hs, &[10, 11, 12, 13], LoadWait::Timeout(2_000))
            .expect("B's load");
        assert_eq!(n, 4, "B loads its pages");
        for (i, h) in hs.iter().enumerate() {
            assert!(b_dev.page_matches(10 + i as u32, seed(h, 0, 0)).unwrap(), "B's bytes");
        }
        slowest = slowest.max(call.elapsed());
        stuck = stuck.max(sleeping(pid).saturating_sub(idle_sleepers));
    }
    let took = started.elapsed();
    eprintln!(
        "threads asleep in the pool: {stuck} (idle {idle_sleepers}); B's slowest round {:.0} ms, all {:.0} ms",
        slowest.as_secs_f64() * 1e3,
        took.as_secs_f64() * 1e3
    );
    // The demotes never held more threads than their share: 16 places.
    assert_eq!(stuck, 16, "the pool's work holds exactly its share of blocking threads");
    assert!(
        took < Duration::from_millis(POOL_DELAY_MS),
        "B finished before the pool's delay was over: {took:?}"
    );
    drop(d);
    for t in demoters {
        let _ = t.join();
    }
}
