//! The event publishers seen by a real router-side subscriber: a Python process with
//! pyzmq and msgpack that checks every message's exact shape, fills the gap before it
//! connected from the replay socket, and hands back what it decoded so this test can
//! compare it, event by event, with kvtier's own event log.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::require::python;
use kvtier::events::{PageEvent, PageEventKind};
use kvtier::hints::{Hint, HintTarget};
use kvtier::manager::{Manager, ManagerConfig, Tunables};
use kvtier::policy::Watermarks;
use kvtier::publish::PublisherHandle;
use kvtier::publish::mooncake::{self, MooncakeConfig};
use kvtier::publish::vllm::{self, Encoding, HashFormat, VllmConfig};
use kvtier::shutdown::Shutdown;
use kvtier::tier::device::pattern;
use kvtier::{LayoutSpec, Namespace, PageHash, TierKind};
use serde_json::{Value, json};

/// Waits (bounded) until every publisher has read the event log to its end.
fn drained(m: &Manager, pubs: &[&PublisherHandle]) {
    let last = m.pages().events().last_seq();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pubs.iter().any(|p| p.counts().next_event <= last) {
        assert!(Instant::now() < deadline, "publishers did not drain the log");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn hash_json(h: &PageHash, fmt: HashFormat) -> Value {
    match fmt {
        HashFormat::Auto if h.len() == 8 => json!(vllm::low_u64(h)),
        HashFormat::Int => json!(vllm::low_u64(h)),
        _ => json!(h.to_hex()),
    }
}

/// What the subscriber reports for a page event (see `python/tests/kv_subscriber.py`).
fn vllm_json(e: &PageEvent, fmt: HashFormat) -> Value {
    match e.kind {
        PageEventKind::Stored => json!(["BlockStored", [hash_json(&e.hash, fmt)], 16, e.tier.medium()]),
        PageEventKind::Removed => json!(["BlockRemoved", [hash_json(&e.hash, fmt)], e.tier.medium()]),
        PageEventKind::Cleared => json!(["AllBlocksCleared"]),
    }
}

fn flatten(batches: &Value, dp: u64) -> Vec<Value> {
    let mut out = Vec::new();
    for b in batches.as_array().unwrap() {
        assert_eq!(b["dp"], dp);
        out.extend(b["events"].as_array().unwrap().iter().cloned());
    }
    out
}

fn seqs(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|s| s.as_u64().unwrap()).collect()
}

#[test]
fn routers_decode_vllm_and_mooncake_events_and_replay_fills_gaps() {
    let Some(python) = python(
        &["zmq", "msgpack"],
        "the router-side subscriber needs pyzmq and msgpack",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ManagerConfig::in_dir(dir.path(), 1 << 20, Some(1 << 20));
    cfg.arena.lock = false;
    let m = Manager::new(cfg, kvtier::clock::SystemClock::new()).unwrap();
    let layout = LayoutSpec::mha(2, 2, 16, 2, 16).build().unwrap();
    let ns = m.register_namespace(Namespace::model("m"), layout.clone()).unwrap();
    let obj = pattern(3, layout.object_bytes(0) as usize);
    let put = |hs: &[PageHash]| {
        let pages: Vec<_> = hs.iter().map(|h| (*h, vec![(0, &obj[..]), (1, &obj[..])])).collect();
        assert_eq!(m.put_objects(ns, &pages).unwrap(), hs.len());
    };

    let sd = Shutdown::new();
    let any = "tcp://127.0.0.1:*".to_string();
    let pos = vllm::spawn(
        VllmConfig {
            endpoint: any.clone(),
            replay_endpoint: Some(any.clone()),
            encoding: Encoding::Positional,
            hashes: HashFormat::Auto,
            max_batch_events: 2,
            ..VllmConfig::default()
        },
        m.clone(),
        sd.clone(),
    )
    .unwrap();
    let named = vllm::spawn(
        VllmConfig {
            endpoint: any.clone(),
            replay_endpoint: None,
            encoding: Encoding::Tagged,
            hashes: HashFormat::Bytes,
            dp_rank: 1,
            ..VllmConfig::default()
        },
        m.clone(),
        sd.clone(),
    )
    .unwrap();
    let moon = mooncake::spawn(
        MooncakeConfig {
            endpoint: any,
            tenant_id: "t1".into(),
            group_id: "g1".into(),
            ..MooncakeConfig::default()
        },
        m.clone(),
        sd.clone(),
    )
    .unwrap();

    // Before the subscriber connects: three pages complete on host (u64 hashes with the
    // top bit set, so they need msgpack's uint64).
    let hs: Vec<PageHash> = (1..=3).map(|i| PageHash::from_u64(0xf000_0000_0000_0000 | i)).collect();
    put(&hs);
    drained(&m, &[&pos, &named, &moon]);
    let phase1_events = m.pages().events().last_seq();
    let phase1_named = named.counts().batches;
    assert_eq!(phase1_events, 3);
    assert!(pos.counts().batches >= 2, "max_batch_events 2 splits three events");
    assert_eq!(moon.counts().batches, 0, "no pool events yet");

    let mut py = Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/kv_subscriber.py"))
        .args([
            pos.endpoint(),
            pos.replay_endpoint().unwrap(),
            named.endpoint(),
            moon.endpoint(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = py.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(20)).expect("subscriber ready"),
        "ready"
    );
    // A PUB socket drops what it sends before a subscription reaches it. Until the
    // subscriber has heard all three publishers, a probe page is stored and demoted to the
    // pool (host and pool events); the scenario starts once the probes' work is done.
    let probed = Instant::now();
    for i in 1.. {
        let probe = PageHash::from_u64(0x7e57_0000_0000_0000 | i);
        put(&[probe]);
        let demote = Hint::Demote {
            target: HintTarget::Pages(vec![probe]),
            to: TierKind::Pool,
        };
        m.hint(ns, demote).unwrap();
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) => {
                assert_eq!(line, "heard");
                break;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => assert!(
                probed.elapsed() < Duration::from_secs(20),
                "the subscriber did not hear every publisher"
            ),
            Err(e) => panic!("the subscriber ended: {e}"),
        }
    }
    assert!(m.quiesce(Duration::from_secs(5)));
    drained(&m, &[&pos, &named, &moon]);
    // Events after this one are the scenario's.
    let scenario_from = m.pages().events().last_seq() as usize;

    // While it listens: a SHA-256-sized page, two pages demoted into the pool, then the
    // pool squeezed so its pages are evicted (pool `removed`).
    let long = PageHash::new(&[0xab; 32]).unwrap();
    put(&[long]);
    let demote = Hint::Demote {
        target: HintTarget::Pages(hs[..2].to_vec()),
        to: TierKind::Pool,
    };
    m.hint(ns, demote).unwrap();
    let tight = Watermarks {
        high: 0.002,
        resume: 0.002,
        target: 0.001,
    };
    m.set_tunables(Tunables {
        pool_watermarks: tight,
        ..m.tunables()
    })
    .unwrap();
    m.tick().unwrap();
    assert!(m.quiesce(Duration::from_secs(5)));
    drained(&m, &[&pos, &named, &moon]);
    let batch = m.pages().events().read_from(1, 10_000, Duration::ZERO);
    assert_eq!(batch.lost, 0);
    let log = batch.events;
    let pool_kinds: Vec<PageEventKind> = log[scenario_from..]
        .iter()
        .filter(|e| e.tier == TierKind::Pool)
        .map(|e| e.kind)
        .collect();
    assert!(
        pool_kinds.contains(&PageEventKind::Stored) && pool_kinds.contains(&PageEventKind::Removed),
        "{log:?}"
    );

    let done = format!(
        "done {} {} {}\n",
        pos.counts().batches,
        named.counts().batches,
        moon.counts().batches
    );
    py.stdin.as_mut().unwrap().write_all(done.as_bytes()).unwrap();
    let report = rx.recv_timeout(Duration::from_secs(40)).expect("subscriber report");
    let status = py.wait().unwrap();
    assert!(
        status.success(),
        "the subscriber found a malformed message (see its stderr)"
    );
    let r: Value = serde_json::from_str(&report).unwrap();

    // Positional: live batches after the gap, the gap filled by replay; every event equal
    // to the log's, in order.
    let pos_batches = pos.counts().batches;
    let first_live = r["first_live_seq"].as_u64().unwrap();
    assert!(
        first_live > 0 && first_live < pos_batches,
        "the subscriber had a gap to fill: {first_live}"
    );
    assert_eq!(seqs(&r["replay_from_0"]), (0..pos_batches).collect::<Vec<_>>());
    assert_eq!(seqs(&r["replay_from_1"]), (1..pos_batches).collect::<Vec<_>>());
    let want: Vec<Value> = log.iter().map(|e| vllm_json(e, HashFormat::Auto)).collect();
    assert_eq!(flatten(&r["positional"], 0), want);

    // Tagged (vLLM 0.24+): what was published after the subscriber joined (from some
    // probe on, the whole scenario), hashes as bytes, rank 1: the log's tail, every batch.
    let named_batches = named.counts().batches;
    let named_seqs = seqs(&r["named_seqs"]);
    let first_named = named_seqs[0];
    assert!(first_named >= phase1_named, "{named_seqs:?}");
    assert_eq!(named_seqs, (first_named..named_batches).collect::<Vec<_>>());
    let got = flatten(&r["named"], 1);
    assert!(
        got.len() >= log.len() - scenario_from && got.len() <= log.len() - phase1_events as usize,
        "{} events heard, {} in the log, the scenario's from {scenario_from}",
        got.len(),
        log.len()
    );
    let want: Vec<Value> = log[log.len() - got.len()..]
        .iter()
        .map(|e| vllm_json(e, HashFormat::Bytes))
        .collect();
    assert_eq!(got, want);

    // Mooncake: one event per pool object key for each pool page event, every batch from
    // the first heard (a probe's) on: the tail of all of them, the scenario's included.
    let moon_seqs = seqs(&r["mooncake_seqs"]);
    let first_moon = moon_seqs[0];
    assert!(first_moon >= 1, "{moon_seqs:?}");
    assert_eq!(moon_seqs, (first_moon..=moon.counts().batches).collect::<Vec<_>>());
    let scheme = m.pages().key_scheme(ns).unwrap();
    let mut want = Vec::new();
    let mut scenario_objects = 0;
    for e in log.iter().filter(|e| e.tier == TierKind::Pool) {
        let kind = if e.kind == PageEventKind::Stored {
            "stored"
        } else {
            "removed"
        };
        for key in scheme.page_keys(&layout, &e.hash) {
            want.push(json!([kind, key, "t1", "g1", e.hash.to_hex(), e.seq]));
            scenario_objects += usize::from(e.seq as usize > scenario_from);
        }
    }
    // kvtier's key format: the model, then the fingerprint of the whole layout, so engines
    // whose bytes differ never share an object.
    let fp = kvtier::pool::keys::layout_fingerprint(&layout);
    let hs0 = want
        .iter()
        .find(|w| w[4] == hs[0].to_hex())
        .expect("the first page went to the pool");
    assert_eq!(hs0[1], format!("kvtier_m+g{fp:016x}_{}_0_k", hs[0].to_hex()));
    let got = flatten(&r["mooncake"], 0);
    assert!(
        got.len() >= scenario_objects && got.len() <= want.len(),
        "{} object events heard, {} in all, {scenario_objects} of the scenario's",
        got.len(),
        want.len()
    );
    assert_eq!(got, want[want.len() - got.len()..]);

    sd.cancel();
    pos.stop();
    named.stop();
    moon.stop();
}
