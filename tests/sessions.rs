//! Sessions in the daemon, end to end: two engine processes (a parent session and a
//! child that forks its prefix) report phases through their clients; under host pressure
//! the acting child's private pages go to the pool while the shared prefix stays, and on
//! resume they are back in host, with ReadyToLoad advice, before the engine looks again —
//! with no hint sent. Bad session input gets typed errors and loses nothing.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::rank::RankProc;
use common::{hashes, kvtier_bin};
use serde_json::{Value, json};

/// One page is 2 objects of 2048 bytes (`common::spec(1, 1)`): 100 pages of host.
const ARENA_BYTES: u64 = 100 * 2 * 2048;

struct Serve {
    child: Child,
    socket: PathBuf,
    admin: PathBuf,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(dir: &Path) -> Serve {
    let socket = dir.join("kvtier.sock");
    let admin = dir.join("admin.sock");
    let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
    let child = Command::new(kvtier_bin())
        .args(["serve", "--socket"])
        .arg(&socket)
        .arg("--arena-path")
        .arg(dir.join("arena"))
        .args(["--arena-bytes", &ARENA_BYTES.to_string()])
        .args([
            "--set",
            "lock_arena=false",
            "--set",
            "prefault=false",
            "--set",
            "pool_bytes=8388608",
        ])
        .args(["--set", "tick_ms=50", "--set", "recover=false"])
        .args([
            "--set",
            "events_endpoint=",
            "--set",
            "events_replay_endpoint=",
            "--set",
            "pool_events_endpoint=",
        ])
        .arg("--set")
        .arg(format!("admin_socket={}", admin.display()))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let t = Instant::now();
    while UnixStream::connect(&socket).is_err() || UnixStream::connect(&admin).is_err() {
        assert!(t.elapsed() < Duration::from_secs(10), "daemon did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    Serve { child, socket, admin }
}

/// One HTTP/1.1 request on the admin socket: (status, JSON body).
fn http(sock: &Path, method: &str, path: &str, body: &str) -> (u16, Value) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// Whether each page of `base..base+n` is complete in host and in the pool.
fn where_are(sock: &Path, base: u64, n: usize) -> Vec<(bool, bool)> {
    let list: Vec<String> = hashes(base, n).iter().map(|h| h.to_hex()).collect();
    let (status, v) = http(sock, "GET", &format!("/v1/pages?prefix={}", list.join(",")), "");
    assert_eq!(status, 200, "{v}");
    v["pages"]
        .as_array()
        .unwrap_or_else(|| panic!("pages in {v}"))
        .iter()
        .map(|p| {
            let tier = |name: &str| {
                p["tiers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|t| t["tier"] == name && t["complete"] == true)
            };
            (tier("host"), tier("pool"))
        })
        .collect()
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(15), "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_acting_child_goes_to_the_pool_under_pressure_and_comes_back_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let d = serve(dir.path());
    let mut parent = RankProc::spawn(&d.socket, "parent-engine", 0, 0, 1, 1);
    let mut child = RankProc::spawn(&d.socket, "child-engine", 0, 0, 1, 1);

    assert_eq!(parent.cmd("phase parent - reasoning"), "ok");
    assert_eq!(parent.cmd("cstore parent 1000 8"), "stored 8 8");
    assert_eq!(child.cmd("phase child parent reasoning"), "ok");
    assert_eq!(child.cmd("cstore child 1000 8 2000 16"), "stored 24 24");
    assert_eq!(child.cmd("phase child - acting"), "ok");

    // The sessions as the daemon keeps them.
    let (_, v) = http(&d.admin, "GET", "/v1/sessions", "");
    let s = |id: &str| {
        v["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["session_id"] == id)
            .cloned()
    };
    let c = s("child").unwrap_or_else(|| panic!("child in {v}"));
    assert_eq!(
        (c["parent_session_id"].clone(), c["phase"].clone()),
        (json!("parent"), json!("acting"))
    );
    assert_eq!(c["pages"], json!(24));
    assert_eq!(s("parent").unwrap()["phase"], json!("reasoning"));

    // No pressure (24 of 100 pages): an acting session keeps its pages in host.
    std::thread::sleep(Duration::from_millis(300));
    assert!(where_are(&d.admin, 2000, 16).iter().all(|&(host, _)| host));

    // Another session fills host to 0.88, between the target (0.80) and the high
    // watermark (0.95): the child's private pages go to the pool, the prefix stays.
    assert_eq!(parent.cmd("cstore filler 5000 64"), "stored 64 64");
    wait_until("the child's private pages are only in the pool", || {
        where_are(&d.admin, 2000, 16) == vec![(false, true); 16]
    });
    assert!(
        where_are(&d.admin, 1000, 8).iter().all(|&(host, _)| host),
        "the shared prefix stays in host"
    );
    // Nothing else left host: the filler (reasoning) and the parent keep theirs.
    assert!(where_are(&d.admin, 5000, 64).iter().all(|&(host, _)| host));

    // Resume: no hint, only the phase. Back in host before the next lookup.
    assert_eq!(child.cmd("phase child - reasoning"), "ok");
    assert_eq!(where_are(&d.admin, 2000, 16), vec![(true, true); 16]);
    assert_eq!(child.cmd("advice"), "ready 24", "ReadyToLoad names the whole chain");
    assert_eq!(child.cmd("cload 1000 8 2000 16"), "loaded 24 24");

    let (_, a) = http(&d.admin, "GET", "/v1/sessions/advice", "");
    assert_eq!(a["stats"]["demoted_pages"], json!(16), "{a}");
    assert_eq!(a["stats"]["staged_pages"], json!(24), "{a}");
}

#[test]
fn bad_session_input_gets_typed_errors_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = serve(dir.path());
    let mut e = RankProc::spawn(&d.socket, "engine", 0, 0, 1, 1);
    assert_eq!(e.cmd("phase a - reasoning"), "ok");
    assert_eq!(e.cmd("cstore a 1000 8"), "stored 8 8");
    assert_eq!(e.cmd("phase b a reasoning"), "ok");

    // A parent cycle (a's parent would be b, whose parent is a), from an engine.
    let cycle = e.cmd("phase a b reasoning");
    assert!(cycle.starts_with("err") && cycle.contains("cycle"), "{cycle}");
    // An id over the length limit.
    let long = "x".repeat(1025);
    let too_long = e.cmd(&format!("phase {long} - acting"));
    assert!(too_long.starts_with("err") && too_long.contains("1024"), "{too_long}");
    // From a router: an unknown phase, and a cycle.
    let (status, v) = http(
        &d.admin,
        "POST",
        "/v1/sessions/phase",
        r#"{"session_id":"a","phase":"thinking"}"#,
    );
    assert_eq!((status, v["code"].clone()), (400, json!("bad_session")), "{v}");
    assert!(
        v["message"].as_str().unwrap_or("").contains("reasoning"),
        "lists the phases: {v}"
    );
    let (status, v) = http(
        &d.admin,
        "POST",
        "/v1/sessions/phase",
        r#"{"session_id":"a","parent_session_id":"b","phase":"acting"}"#,
    );
    assert_eq!((status, v["code"].clone()), (400, json!("bad_session")), "{v}");
    // A good one from the router works, and nothing stored was lost.
    let (status, v) = http(
        &d.admin,
        "POST",
        "/v1/sessions/phase",
        r#"{"session_id":"b","phase":"acting"}"#,
    );
    assert_eq!((status, v["session"]["phase"].clone()), (200, json!("acting")), "{v}");
    assert_eq!(e.cmd("cload 1000 8"), "loaded 8 8");
    let (_, v) = http(&d.admin, "GET", "/v1/sessions", "");
    let a = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["session_id"] == "a")
        .cloned()
        .unwrap();
    assert_eq!(
        a["parent_session_id"],
        Value::Null,
        "the refused parent was not recorded"
    );
}
