//! Helpers for the session tests (tests/sessions.rs, tests/session_moves.rs): the daemon
//! as a process with 100 pages of host and a pool, its admin socket over raw HTTP/1.1,
//! where pages are, the engine's advice stream, and the host and pool moves the daemon's
//! page events show.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::rank::RankProc;
use crate::common::{Daemon, hashes};

/// One page is 2 objects of 2048 bytes (`common::spec(1, 1)`): 100 pages of host.
pub const ARENA_BYTES: u64 = 100 * 2 * 2048;

/// The daemon the session tests run: `common::Daemon` with 100 pages of host, a 50 ms
/// upkeep tick, no recovery and no ZMQ publishers, plus `extra` keys (`key=value`).
pub type Serve = Daemon;

pub fn serve(dir: &Path, extra: &[String]) -> Serve {
    let mut sets = vec![
        "tick_ms=50",
        "recover=false",
        "events_endpoint=",
        "events_replay_endpoint=",
    ];
    sets.extend(["pool_events_endpoint=", "session_events_endpoint="]);
    let admin = format!("admin_socket={}", dir.join("admin.sock").display());
    sets.push(&admin);
    sets.extend(extra.iter().map(String::as_str));
    let d = Daemon::start_with(dir, ARENA_BYTES, &sets);
    d.wait_admin();
    d
}

/// One HTTP/1.1 request on the admin socket: (status, JSON body).
pub fn http(sock: &Path, method: &str, path: &str, body: &str) -> (u16, Value) {
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
pub fn where_are(sock: &Path, base: u64, n: usize) -> Vec<(bool, bool)> {
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

pub fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(15), "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Advice taken from one engine connection until `want` entries came, in order.
pub fn advice_until(e: &mut RankProc, want: usize) -> Vec<String> {
    let mut got = Vec::new();
    wait_until(&format!("{want} advice entries"), || {
        let line = e.cmd("alladvice");
        got.extend(line.split_whitespace().skip(1).map(str::to_owned));
        got.len() >= want
    });
    got
}

/// Moves between host and pool, from page events in order: a host copy that goes while
/// the pool holds the page is `host -> pool`; one that comes back while the pool holds it
/// is `pool -> host`. Consecutive moves of one direction are one run, its pages sorted
/// (the daemon's copy workers finish a batch in any order).
pub fn move_runs(moves: impl IntoIterator<Item = (String, String, String)>) -> Vec<(String, String, Vec<String>)> {
    let mut runs: Vec<(String, String, Vec<String>)> = Vec::new();
    for (page, from, to) in moves {
        match runs.last_mut() {
            Some((f, t, pages)) if *f == from && *t == to => pages.push(page),
            _ => runs.push((from, to, vec![page])),
        }
    }
    for r in &mut runs {
        r.2.sort();
    }
    runs
}

/// The daemon's host and pool moves so far, from `/v1/events`.
pub fn daemon_moves(admin: &Path) -> Vec<(String, String, String)> {
    let (_, status) = http(admin, "GET", "/v1/status", "");
    let n = status["event_seq"]
        .as_u64()
        .unwrap_or_else(|| panic!("event_seq in {status}"));
    let mut s = UnixStream::connect(admin).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /v1/events?from=1&limit={n} HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    // The body is chunked: its event lines are the JSON objects among the lines.
    let events: Vec<Value> = text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len() as u64, n, "every event up to {n}");
    let mut at: std::collections::HashMap<String, (bool, bool)> = Default::default();
    let mut moves = Vec::new();
    for e in events {
        let page = e["hash"].as_str().unwrap().to_owned();
        let st = at.entry(page.clone()).or_default();
        match (e["tier"].as_str().unwrap(), e["kind"].as_str().unwrap()) {
            ("host", "stored") => {
                if st.1 {
                    moves.push((page, "pool".into(), "host".into()));
                }
                st.0 = true;
            }
            ("host", "removed") => {
                if st.1 {
                    moves.push((page, "host".into(), "pool".into()));
                }
                st.0 = false;
            }
            ("pool", "stored") => st.1 = true,
            ("pool", "removed") => st.1 = false,
            _ => {}
        }
    }
    moves
}

/// The pressure scenario of tests/sessions.rs, for a daemon started with
/// `policy_exclusive=true`: session `tool-user` stores 10 pages (1000..) and starts
/// acting; a filler takes host to 96 of 100 pages, so the controller pauses `tool-user`
/// (its pages go to the pool); the filler's pages are loaded to device and leave host,
/// so the controller resumes it (its pages are staged back). Returns the engine's advice
/// after the pause and after the resume, as `kind:detail` strings.
pub fn pause_then_resume(d: &Serve, e: &mut RankProc) -> (Vec<String>, Vec<String>) {
    assert_eq!(e.cmd("phase tool-user - reasoning"), "ok");
    assert_eq!(e.cmd("cstore tool-user 1000 10"), "stored 10 10");
    assert_eq!(e.cmd("phase tool-user - acting"), "ok");
    assert_eq!(e.cmd("cstore filler 5000 86"), "stored 86 86");
    let paused = advice_until(e, 1);
    wait_until("the paused session's pages are only in the pool", || {
        where_are(&d.admin, 1000, 10) == vec![(false, true); 10]
    });
    assert_eq!(e.cmd("cload 5000 86"), "loaded 86 86");
    let resumed = advice_until(e, 2);
    (paused, resumed)
}
