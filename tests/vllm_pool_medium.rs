//! Pool pages in vLLM's KV events say which pool holds them: with the node-local pool
//! (`pool = "local"`) a page shared to the pool is announced as `medium: "STORAGE"`,
//! `locality: "LOCAL"`, vLLM 0.33's own pair for a secondary tier on this node, while its
//! host copy stays `CPU_PINNED` with no locality. Decoded by vLLM 0.33's
//! `msgspec.msgpack.Decoder(KVEventBatch)` (`python/tests/vllm_pool_medium.py`); a
//! Mooncake Store's pages keep `SHARED` (the encoder's unit tests).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use common::require::engine_python;
use common::{Daemon, hashes, identity, seed, spec};
use kvtier::hints::{Hint, HintOutcome, HintTarget};
use kvtier::publish::vllm::low_u64;
use kvtier::tier::device::EmulatedDevice;
use serde_json::Value;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn local_pool_pages_are_storage_and_local_in_vllm_events() {
    let Some(py) = engine_python(
        "vllm",
        &["vllm", "msgspec", "zmq"],
        "decodes KV events with vLLM's own types",
    ) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(
        tmp.path(),
        16 << 20,
        &[
            "pool_bytes=16777216",
            "events_endpoint=ipc",
            "events_replay_endpoint=\"\"",
        ],
    );
    let pub_ep = format!("ipc://{}", tmp.path().join("kv-events.ipc").display());
    let t = Instant::now();
    while !tmp.path().join("kv-events.ipc").exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no events socket: {}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut child = Command::new(&py)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/vllm_pool_medium.py"))
        .arg(&pub_ep)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let _proc = Proc(child);
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    // Importing vLLM (and torch under it) takes a while on a loaded machine.
    assert_eq!(lines.recv_timeout(Duration::from_secs(240)).unwrap(), "ready");
    // The subscription reaches the publisher some time after `connect`: until then events
    // are dropped. A probe engine (TP=1) stores a page of its own, a new one each try,
    // until the subscriber has received an event; probe pages are never shared.
    // Its own model: a namespace serves one layout.
    let mut probe_id = identity("vllm-probe", 0, 0, 1, 1);
    probe_id.namespace = kvtier::page::Namespace::model("vllm-probe");
    let probe = d.client(probe_id, spec(1, 1));
    let probe_dev = Arc::new(EmulatedDevice::new(&spec(1, 1).build().unwrap(), 0, 16));
    probe.register_device(probe_dev.clone()).unwrap();
    let probes = hashes(0x9e0b_e000_0000, 16);
    let mut joined = false;
    for (i, h) in probes.iter().enumerate() {
        probe_dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
        probe.store(&[*h], &[i as u32], "").unwrap();
        writeln!(stdin, "join 1000").unwrap();
        if lines.recv_timeout(Duration::from_secs(60)).unwrap() == "joined" {
            joined = true;
            break;
        }
    }
    assert!(
        joined,
        "the subscriber received no probe event in {} tries",
        probes.len()
    );
    let probed: Vec<u64> = probes.iter().map(low_u64).collect();

    // Two ranks (MHA, TP=2) store 4 pages; one of them shares them to the local pool.
    let hs = hashes(0x5707_a6e0_0000, 4);
    let ranks: Vec<_> = (0..2u16)
        .map(|tp| {
            let c = d.client(identity("vllm-pool", tp, 0, 2, 1), spec(2, 1));
            let dev = Arc::new(EmulatedDevice::new(&spec(2, 1).build().unwrap(), 0, 16));
            c.register_device(dev.clone()).unwrap();
            for (i, h) in hs.iter().enumerate() {
                dev.fill_page(i as u32, seed(h, tp, 0)).unwrap();
            }
            c.store(&hs, &[0, 1, 2, 3], "").unwrap();
            (c, dev)
        })
        .collect();
    let share = Hint::Share {
        target: HintTarget::Pages(hs.clone()),
    };
    assert!(
        matches!(ranks[0].0.hint(share).unwrap(), HintOutcome::Accepted { .. }),
        "share to the local pool"
    );
    writeln!(stdin, "collect {}", hs.len()).unwrap();
    let seen: Value = serde_json::from_str(&lines.recv_timeout(Duration::from_secs(60)).unwrap()).unwrap();
    let events = seen.as_array().unwrap();
    let want: Vec<u64> = hs.iter().map(low_u64).collect();
    let stored = |medium: &str| -> Vec<(u64, Value)> {
        events
            .iter()
            .filter(|e| e["type"] == "BlockStored" && e["medium"] == medium)
            .flat_map(|e| {
                e["block_hashes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| (h.as_u64().unwrap(), e["locality"].clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let pool = stored("STORAGE");
    assert_eq!(
        pool.iter().map(|(h, _)| *h).collect::<Vec<_>>(),
        want,
        "every shared page, once, in order: {seen}"
    );
    assert!(pool.iter().all(|(_, l)| l == "LOCAL"), "{seen}");
    // A probe stored before the subscriber joined may still be published after it.
    let host: Vec<(u64, Value)> = stored("CPU_PINNED")
        .into_iter()
        .filter(|(h, _)| !probed.contains(h))
        .collect();
    assert_eq!(host.iter().map(|(h, _)| *h).collect::<Vec<_>>(), want, "{seen}");
    assert!(
        host.iter().all(|(_, l)| l.is_null()),
        "host pages carry no locality: {seen}"
    );
    assert!(
        !events.iter().any(|e| e["medium"] == "SHARED"),
        "nothing says shared store: {seen}"
    );
}
