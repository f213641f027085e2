//! Dynamo 1.6.1's standalone KV indexer (`python -m dynamo.indexer`, from the dynamo venv)
//! subscribed to a running `kvtier serve`: two engine ranks (MHA, TP=2) store a chain of
//! pages with their token ids; the indexer's `/query` then matches the whole prefix for
//! kvtier's worker. After the pages leave every tier, it matches none.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{identity, kvtier_bin, spec};
use kvtier::client::{Client, ClientConfig};
use kvtier::page::PageHash;
use kvtier::tier::device::EmulatedDevice;
use serde_json::{Value, json};

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A plain HTTP/1.1 exchange with the indexer; `None` while nothing listens.
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: indexer\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The tokens of the longest prefix `/query` matched on worker 1 (kvtier's), from its
/// answer `{"scores": {...}, "instances": {"1": {"longest_matched": n, ...}}}`; 0 when the
/// worker is not in it.
fn matched(body: &str) -> u64 {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    v["instances"]["1"]["longest_matched"].as_u64().unwrap_or(0)
}

#[test]
fn dynamos_indexer_matches_the_prefix_kvtier_stored_and_forgets_it_after_removal() {
    let Some(python) =
        common::require::engine_python("dynamo", &["dynamo.indexer"], "Dynamo 1.6.1's standalone KV indexer")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtier.sock");
    let admin = dir.path().join("admin.sock");
    let mut cmd = Command::new(kvtier_bin());
    cmd.args(["serve", "--socket"])
        .arg(&socket)
        .arg("--arena-path")
        .arg(dir.path().join("arena"))
        .args(["--arena-bytes", "16777216"]);
    let admin_set = format!("admin_socket={}", admin.display());
    for s in [
        "lock_arena=false",
        "prefault=false",
        "slot_bytes=1024",
        "pool_bytes=0",
        "events_endpoint=ipc",
        "events_replay_endpoint=",
        "pool_events_endpoint=",
        admin_set.as_str(),
    ] {
        cmd.args(["--set", s]);
    }
    let log = std::fs::File::create(dir.path().join("daemon.log")).unwrap();
    let _serve = Proc(cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap());
    let events: PathBuf = dir.path().join("kv-events.ipc");
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() || !events.exists() || !admin.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "daemon did not start");
        std::thread::sleep(Duration::from_millis(10));
    }

    let port = free_port();
    let workers = format!("1=ipc://{}", events.display());
    let _indexer = Proc(
        Command::new(&python)
            .args(["-m", "dynamo.indexer", "--block-size", "4", "--threads", "1", "--port"])
            .arg(port.to_string())
            .args(["--workers", &workers])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("indexer.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while http(port, "GET", "/health", "").is_none_or(|(s, _)| s != 200) {
        assert!(t.elapsed() < Duration::from_secs(120), "the indexer did not come up");
        std::thread::sleep(Duration::from_millis(200));
    }
    let ranks: Vec<(Client, Arc<EmulatedDevice>)> = (0..2u16)
        .map(|tp| {
            let cfg = ClientConfig::new(&socket, identity("dynamo-test", tp, 0, 2, 1), spec(2, 1))
                .with_timeout(Duration::from_secs(10));
            let c = Client::connect(cfg).unwrap();
            let dev = Arc::new(EmulatedDevice::new(&spec(2, 1).build().unwrap(), 0, 16));
            c.register_device(dev.clone()).unwrap();
            (c, dev)
        })
        .collect();
    // The indexer's SUB socket joins the publisher asynchronously, and a PUB socket
    // drops what it sends before the join. Store probe pages (tokens no query below
    // uses) until the indexer has seen one, instead of sleeping for a guessed time.
    let t = Instant::now();
    for probe in 0u32.. {
        let page = [PageHash::from_u64(0xe000 + u64::from(probe))];
        let toks = vec![(0..4).map(|i| 50_000 + 4 * probe + i).collect::<Vec<u32>>()];
        for (c, _) in &ranks {
            c.store_with_tokens(&page, &[15], "", None, Some(&toks)).unwrap();
        }
        let q = json!({"token_ids": toks[0], "model_name": "default"}).to_string();
        let asked = Instant::now();
        let seen = loop {
            if http(port, "POST", "/query", &q).is_some_and(|(s, b)| s == 200 && matched(&b) == 4) {
                break true;
            }
            if asked.elapsed() > Duration::from_secs(2) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        if seen {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "the indexer never saw a probe page's event in {probe} tries"
        );
    }
    let pages: Vec<PageHash> = (0..3).map(|i| PageHash::from_u64(0xd000 + i)).collect();
    let tokens: Vec<Vec<u32>> = (0..3u32).map(|p| (0..4).map(|t| 100 + 4 * p + t).collect()).collect();
    for (c, _) in &ranks {
        c.store_with_tokens(&pages, &[0, 1, 2], "", None, Some(&tokens))
            .unwrap();
    }
    let all: Vec<u32> = tokens.concat();
    let query = json!({"token_ids": all, "model_name": "default"}).to_string();
    let t = Instant::now();
    let mut last = String::new();
    loop {
        if let Some((200, body)) = http(port, "POST", "/query", &query) {
            if matched(&body) == 12 {
                break;
            }
            last = body;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the indexer never matched 3 blocks (12 tokens): {last}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Two pages' tokens match two blocks; a different second page matches only the first.
    let two = json!({"token_ids": &all[..8], "model_name": "default"}).to_string();
    let (_, body) = http(port, "POST", "/query", &two).unwrap();
    assert_eq!(matched(&body), 8, "{body}");
    let mut other = all.clone();
    other[5] = 9_999;
    let diverged = json!({"token_ids": other, "model_name": "default"}).to_string();
    let (_, body) = http(port, "POST", "/query", &diverged).unwrap();
    assert_eq!(matched(&body), 4, "{body}");

    // The pages leave device (the engine freed them) and host (squeezed out, no pool).
    for (c, _) in &ranks {
        c.removed(&pages).unwrap();
    }
    let tight = json!({"host_watermarks": {"high": 0.0002, "resume": 0.0002, "target": 0.0001}}).to_string();
    let r = kvtier::cli::client::request(
        &admin,
        "PUT",
        "/v1/config",
        Some(tight.as_bytes()),
        Some(Duration::from_secs(10)),
    )
    .unwrap();
    assert_eq!(r.status, 200);
    let t = Instant::now();
    loop {
        let (_, body) = http(port, "POST", "/query", &query).unwrap();
        if matched(&body) == 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the indexer still matches after removal: {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
