//! `kvtier serve`'s KV events read by vLLM's own decoders: two engine ranks (MHA, TP=2)
//! store pages through the control socket, with and without token ids, and a Python
//! process decodes every batch with `msgspec.msgpack.Decoder(KVEventBatch)` from vLLM 0.33
//! (the default encoding) or from vLLM 0.23's `kv_events.py` (`events_encoding =
//! "vllm-legacy"`), fills the gap before it subscribed with the replay protocol of its
//! version, and floods the replay socket, which keeps serving the live stream.
//!
//! The publishers bind `ipc://` endpoints in the daemon's runtime dir (`events_endpoint =
//! "ipc"`), so tests running side by side never share a port.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use common::{identity, kvtier_bin, spec};
use kvtier::client::{Client, ClientConfig};
use kvtier::page::PageHash;
use kvtier::tier::device::EmulatedDevice;
use serde_json::{Value, json};

/// A `kvtier serve` with its publishers on ipc endpoints in `dir`.
struct Serve {
    child: Child,
    socket: PathBuf,
}

impl Serve {
    fn start(dir: &Path, sets: &[&str]) -> Self {
        let socket = dir.join("kvtier.sock");
        let mut cmd = Command::new(kvtier_bin());
        cmd.args(["serve", "--socket"])
            .arg(&socket)
            .arg("--arena-path")
            .arg(dir.join("arena"))
            .args(["--arena-bytes", "16777216"]);
        for s in [
            "lock_arena=false",
            "prefault=false",
            "slot_bytes=1024",
            "pool_bytes=0",
            "events_endpoint=ipc",
            "events_replay_endpoint=ipc",
            "pool_events_endpoint=",
        ]
        .iter()
        .chain(sets)
        {
            cmd.args(["--set", s]);
        }
        let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
        let child = cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap();
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() || !dir.join("kv-events-replay.ipc").exists() {
            assert!(t.elapsed() < Duration::from_secs(10), "daemon did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self { child, socket }
    }

    fn rank(&self, tp: u16) -> (Client, Arc<EmulatedDevice>) {
        let cfg = ClientConfig::new(&self.socket, identity("vllm-test", tp, 0, 2, 1), spec(2, 1))
            .with_timeout(Duration::from_secs(10));
        let c = Client::connect(cfg).unwrap();
        let layout = spec(2, 1).build().unwrap();
        let dev = Arc::new(EmulatedDevice::new(&layout, 0, 64));
        c.register_device(dev.clone()).unwrap();
        (c, dev)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Python decoder, driven one command line at a time.
struct Decoder {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Decoder {
    fn start(python: &Path, args: &[String]) -> Self {
        let mut child = Command::new(python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/vllm_events.py"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if tx.send(line.unwrap_or_default()).is_err() {
                    break;
                }
            }
        });
        let mut d = Self { child, stdin, lines };
        // Importing vLLM (and torch under it) takes a while on a loaded machine.
        assert_eq!(d.next(Duration::from_secs(240)), "ready");
        d
    }

    /// A PUB socket drops what it sends before a subscription reaches it: until the
    /// decoder hears a live batch, both ranks store a probe page (see [`is_probe`]).
    fn probe_until_heard(&mut self, ranks: &[(Client, Arc<EmulatedDevice>)]) {
        let start = Instant::now();
        for i in 1.. {
            store(ranks, &[PageHash::from_u64((PROBE_TOP << 48) | i)], None, false);
            if self.ask("heard 200")["heard"] == true {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "the decoder heard none of {i} probe pages"
            );
        }
    }

    fn next(&mut self, wait: Duration) -> String {
        match self.lines.recv_timeout(wait) {
            Ok(l) => l,
            Err(_) => {
                let status = self.child.try_wait().ok().flatten();
                panic!("the decoder did not answer (exit: {status:?}); see its stderr above")
            }
        }
    }

    fn ask(&mut self, cmd: &str) -> Value {
        writeln!(self.stdin, "{cmd}").unwrap();
        serde_json::from_str(&self.next(Duration::from_secs(60))).unwrap()
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The top 16 bits of probe pages' hashes (`python/tests/vllm_events.py` knows them too).
const PROBE_TOP: u64 = 0x7e57;

/// Whether a decoded event is of a probe page.
fn is_probe(e: &Value) -> bool {
    e["block_hashes"]
        .as_array()
        .is_some_and(|hs| hs.iter().any(|h| h.as_u64().is_some_and(|h| h >> 48 == PROBE_TOP)))
}

fn hashes(base: u64, n: u64) -> Vec<PageHash> {
    (0..n).map(|i| PageHash::from_u64(base + i)).collect()
}

/// 4 tokens a page (the layout's page size), distinct per page.
fn tokens(pages: &[PageHash]) -> Vec<Vec<u32>> {
    pages
        .iter()
        .map(|h| (0..4).map(|t| (h.prefix_u64() as u32) * 10 + t).collect())
        .collect()
}

/// Both TP ranks store `pages` (the page is complete, and published, when both did).
fn store(ranks: &[(Client, Arc<EmulatedDevice>)], pages: &[PageHash], parent: Option<PageHash>, with_tokens: bool) {
    let slots: Vec<u32> = (0..pages.len() as u32).collect();
    let toks = tokens(pages);
    for (c, _) in ranks {
        let r = c
            .store_with_tokens(pages, &slots, "", parent, with_tokens.then_some(&toks[..]))
            .unwrap();
        assert_eq!(r.written, pages.len());
    }
}

/// The BlockStored event vLLM's decoder reports for a host page.
fn stored_json(h: &PageHash, parent: Option<u64>, with_tokens: bool) -> Value {
    let toks: Vec<u32> = if with_tokens {
        tokens(&[*h]).remove(0)
    } else {
        Vec::new()
    };
    json!({
        "type": "BlockStored", "block_hashes": [h.prefix_u64()], "parent_block_hash": parent,
        "token_ids": toks, "block_size": 4, "lora_id": null, "medium": "CPU_PINNED",
    })
}

/// Host `BlockStored` events of batches (a `{seq: batch}` map or a list), in order,
/// probe pages left out.
fn host_stored(batches: &[&Value]) -> Vec<Value> {
    batches
        .iter()
        .flat_map(|b| b["events"].as_array().unwrap().iter())
        .filter(|e| e["type"] == "BlockStored" && e["medium"] == "CPU_PINNED" && !is_probe(e))
        .cloned()
        .collect()
}

fn by_seq(live: &Value) -> Vec<(u64, &Value)> {
    let mut v: Vec<(u64, &Value)> = live
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, b)| (k.parse().unwrap(), b))
        .collect();
    v.sort_by_key(|(s, _)| *s);
    v
}

/// Stores a chain with and without tokens around the decoder's start; checks every
/// event and the replay of the gap. Returns the decoder for further checks.
fn run(
    python: &Path,
    mode: &str,
    extra: &[String],
    sets: &[&str],
) -> (tempfile::TempDir, Serve, Decoder, Vec<(Client, Arc<EmulatedDevice>)>) {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(dir.path(), sets);
    let ranks = vec![serve.rank(0), serve.rank(1)];
    // Before the subscriber: a chain of 3 pages with tokens (the gap it will replay).
    let a = hashes(0x100, 3);
    store(&ranks, &a, None, true);
    let pub_ep = format!("ipc://{}", dir.path().join("kv-events.ipc").display());
    let replay_ep = format!("ipc://{}", dir.path().join("kv-events-replay.ipc").display());
    let mut args = vec![mode.to_string(), pub_ep, replay_ep];
    args.extend_from_slice(extra);
    let mut dec = Decoder::start(python, &args);
    dec.probe_until_heard(&ranks);
    // While it listens: the chain goes on with tokens, then 2 pages without, with a top
    // bit set hash so the integer needs msgpack's uint64.
    let b = hashes(0x200, 3);
    store(&ranks, &b, Some(a[2]), true);
    let c = vec![
        PageHash::from_u64(0xf000_0000_0000_0001),
        PageHash::from_u64(0xf000_0000_0000_0002),
    ];
    store(&ranks, &c, None, false);
    let live = dec.ask("until 5");
    let live = by_seq(&live);
    let mut want = vec![
        stored_json(&b[0], Some(a[2].prefix_u64()), true),
        stored_json(&b[1], Some(b[0].prefix_u64()), true),
        stored_json(&b[2], Some(b[1].prefix_u64()), true),
    ];
    want.extend(c.iter().map(|h| stored_json(h, None, false)));
    let got = host_stored(&live.iter().map(|(_, b)| *b).collect::<Vec<_>>());
    assert_eq!(got, want, "live events as vLLM's decoder read them");
    for (_, batch) in &live {
        assert_eq!(batch["dp"], 0);
    }
    // The gap: replay from 0 gives every batch before the first live one, and the live
    // ones again, byte for byte the same events.
    let first_live = live[0].0;
    assert!(first_live > 0, "the decoder missed the first batches");
    let replay = dec.ask("replay 0");
    let seqs: Vec<u64> = replay["seqs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (0..=live.last().unwrap().0).collect::<Vec<_>>());
    let batches: Vec<&Value> = replay["batches"].as_array().unwrap().iter().collect();
    for (seq, b) in &live {
        assert_eq!(batches[*seq as usize], *b, "replayed batch {seq}");
    }
    let gap = host_stored(&batches[..first_live as usize]);
    let want_gap = vec![
        stored_json(&a[0], None, true),
        stored_json(&a[1], Some(a[0].prefix_u64()), true),
        stored_json(&a[2], Some(a[1].prefix_u64()), true),
    ];
    assert_eq!(gap, want_gap, "the gap, replayed");
    (dir, serve, dec, ranks)
}

#[test]
fn vllm_033_decodes_every_batch_and_replays_the_gap() {
    let Some(python) = common::require::engine_python(
        "vllm",
        &["vllm.distributed.kv_events", "msgspec", "zmq"],
        "vLLM 0.33's own KV event decoders",
    ) else {
        return;
    };
    let (_dir, _serve, mut dec, ranks) = run(&python, "current", &[], &[]);
    // A flood of replay requests from one peer: the first burst is served, the rest get
    // the end marker alone.
    let flood = dec.ask("flood 10");
    let (served, refused) = (flood["served"].as_u64().unwrap(), flood["refused"].as_u64().unwrap());
    assert_eq!(served + refused, 10);
    assert!((1..=5).contains(&served) && refused >= 5, "{flood}");
    // A malformed request is answered with the end marker in the 0.26+ form.
    assert_eq!(dec.ask("bad"), json!({"end": true, "frames": 3}));
    // And the live stream goes on.
    let d = hashes(0x300, 1);
    store(&ranks, &d, None, true);
    let live = dec.ask("until 6");
    let live = by_seq(&live);
    let got = host_stored(&live.iter().map(|(_, b)| *b).collect::<Vec<_>>());
    assert_eq!(got.last(), Some(&stored_json(&d[0], None, true)));
}

#[test]
fn vllm_023_decodes_the_legacy_encoding() {
    let Some(python) = common::require::engine_python(
        "vllm",
        &["vllm", "msgspec", "zmq"],
        "vLLM 0.23's kv_events.py, loaded from its wheel, with vLLM 0.33's modules under it",
    ) else {
        return;
    };
    let wheel = std::env::var("KVTIER_VLLM023_WHEEL").unwrap_or_default();
    if wheel.is_empty() || !Path::new(&wheel).exists() {
        let why = "KVTIER_VLLM023_WHEEL is not set (scripts/engine-venvs.sh install downloads it)";
        if common::require::required().iter().any(|r| r == "vllm") {
            panic!("{why}; KVTIER_REQUIRE lists vllm");
        }
        common::require::say(&format!("SKIPPED: vllm_023_decodes_the_legacy_encoding: {why}"));
        return;
    }
    run(&python, "legacy", &[wheel], &["events_encoding=vllm-legacy"]);
}
