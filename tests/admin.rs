//! The admin socket driven by real clients: curl over the Unix socket (also as another
//! user, to be refused), the `kvtier` CLI, Python's Prometheus text parser, and raw
//! sockets for what well-behaved clients never do (trickling, oversized heads, holding
//! connections).

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::require::{python, require};
use kvtier::admin::{self, AdminConfig, EngineInfo, EngineView, SessionInfo};
use kvtier::manager::{Manager, ManagerConfig};
use kvtier::tier::device::pattern;
use kvtier::{LayoutSpec, Namespace, NamespaceId, PageHash};
use serde_json::{Value, json};
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

struct Engines;

impl EngineView for Engines {
    fn engines(&self) -> Vec<EngineInfo> {
        vec![EngineInfo {
            instance: "vllm-0".into(),
            namespace: "m".into(),
            tp_rank: 1,
            tp_size: 2,
            pp_rank: 0,
            pp_size: 1,
            dp_rank: 0,
            pid: Some(4242),
            connected_ms: 10,
        }]
    }

    fn sessions(&self) -> Vec<SessionInfo> {
        vec![SessionInfo {
            session_id: "s1".into(),
            parent_session_id: None,
            phase: Some("acting".into()),
            idle: true,
            pages: Some(3),
        }]
    }
}

/// A manager with one TP=2 namespace (four objects per page) and pages 1..=3 complete on
/// host, page 4 stored there by TP rank 0 only.
fn manager(dir: &Path) -> (Manager, NamespaceId, Vec<PageHash>) {
    let mut cfg = ManagerConfig::in_dir(dir, 1 << 20, Some(1 << 20));
    cfg.arena.lock = false;
    let m = Manager::new(cfg, kvtier::clock::SystemClock::new()).unwrap();
    let layout = LayoutSpec::mha(2, 2, 16, 2, 16).with_parallel(2, 1).build().unwrap();
    let ns = m.register_namespace(Namespace::model("m"), layout.clone()).unwrap();
    let hs: Vec<PageHash> = (1..=4).map(PageHash::from_u64).collect();
    let obj = pattern(7, layout.object_bytes(0) as usize);
    let pages: Vec<_> = hs[..3]
        .iter()
        .map(|h| (*h, (0..4).map(|o| (o, &obj[..])).collect()))
        .collect();
    assert_eq!(m.put_objects(ns, &pages).unwrap(), 3);
    let g = m.begin_store(ns, 0, 0, &hs[3..], 0, 0).unwrap();
    assert_eq!(m.commit_store(g.id, &[true]).unwrap(), 1);
    (m, ns, hs)
}

/// The runtime the admin servers of one test run on (in its own worker threads, while
/// the test drives clients from plain threads).
fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn start(rt: &Runtime, cfg: AdminConfig, m: &Manager, engines: Arc<dyn EngineView>) -> admin::AdminHandle {
    let _in_runtime = rt.enter();
    admin::spawn(cfg, m.clone(), engines, CancellationToken::new()).unwrap()
}

fn stop(rt: &Runtime, h: admin::AdminHandle) {
    rt.block_on(h.stop()).unwrap();
}

/// Runs curl against the socket; returns (HTTP status, body).
fn curl(sock: &Path, args: &[&str], uid: Option<u32>) -> (u16, String) {
    let mut c = Command::new("curl");
    c.args(["-sS", "--max-time", "10", "--unix-socket"])
        .arg(sock)
        .args(["-w", "\n%{http_code}"]);
    c.args(args);
    if let Some(u) = uid {
        c.uid(u).gid(u);
    }
    let out = c.output().expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').expect("status line from -w");
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn get(sock: &Path, path: &str) -> (u16, Value) {
    let (code, body) = curl(sock, &[&format!("http://kvtier{path}")], None);
    (code, serde_json::from_str(&body).unwrap_or(Value::String(body)))
}

fn send(sock: &Path, method: &str, path: &str, body: &str) -> (u16, Value) {
    let url = format!("http://kvtier{path}");
    let (code, body) = curl(
        sock,
        &[
            "-X",
            method,
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            body,
            &url,
        ],
        None,
    );
    (code, serde_json::from_str(&body).unwrap_or(Value::String(body)))
}

/// Parses the `/metrics` text with Python's `prometheus_client` and checks its samples.
fn check_metrics(py: &Path, text: &str) {
    let mut py = Command::new(py)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/check_metrics.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(py.stdin.as_mut().unwrap(), text.as_bytes()).unwrap();
    let out = py.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "prometheus_client could not parse /metrics:\n{text}"
    );
    let parsed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let s = &parsed["samples"];
    assert_eq!(s["kvtier_tier_complete_pages{tier=host}"], 3.0);
    assert_eq!(s["kvtier_tier_pinned_pages{tier=host}"], 2.0);
    assert_eq!(s["kvtier_hints_total{kind=pin,outcome=accepted}"], 1.0);
    assert_eq!(s["kvtier_event_seq{}"], 3.0);
    assert_eq!(s["kvtier_connected_engines{}"], 1.0);
    assert_eq!(s["kvtier_moved_bytes_total{from=host,to=pool}"], 0.0);
    assert_eq!(s["kvtier_copy_duration_seconds_count{from=host,to=pool}"], 0.0);
    assert_eq!(parsed["families"]["kvtier_copy_duration_seconds"], "histogram");
    // Lookups are timed by the daemon's connections; this manager has none.
    assert_eq!(parsed["families"]["kvtier_lookup_duration_seconds"], "histogram");
    assert_eq!(s["kvtier_lookup_duration_seconds_count{}"], 0.0);
    assert_eq!(parsed["families"]["kvtier_evictions"], "counter");
}

#[test]
fn endpoints_limits_metrics_and_cli() {
    if !require("curl", "drives the admin socket over HTTP") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (m, _ns, hs) = manager(dir.path());
    let mut cfg = AdminConfig::at(dir.path().join("run/admin.sock"));
    cfg.max_body = 1024;
    let sock = cfg.socket.clone();
    let rt = runtime();
    let server = start(&rt, cfg, &m, Arc::new(Engines));
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(
        std::fs::metadata(sock.parent().unwrap()).unwrap().permissions().mode() & 0o777,
        0o700
    );

    let kv = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_kvtier")).args(args).output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let (code, st) = get(&sock, "/v1/status");
    assert_eq!(code, 200);
    assert_eq!(st["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(st["tiers"][1]["tier"], "host");
    assert_eq!(st["tiers"][1]["complete_pages"], 3);
    assert_eq!(st["tiers"][2]["complete_pages"], 0);
    assert_eq!(st["engines"][0]["instance"], "vllm-0");
    assert_eq!(st["engines"][0]["tp_rank"], 1);
    assert_eq!(st["event_seq"], 3);
    let (_, tiers) = get(&sock, "/v1/tiers");
    assert_eq!(tiers["tiers"].as_array().unwrap().len(), 3);
    assert_eq!(get(&sock, "/v1/sessions").1["sessions"][0]["session_id"], "s1");
    let (code, out) = kv(&["sessions", "--socket", sock.to_str().unwrap()]);
    assert_eq!(code, Some(0));
    assert_eq!(
        out.lines().nth(1).map(|l| l.split_whitespace().collect::<Vec<_>>()),
        Some(vec!["s1", "-", "acting", "true", "3"])
    );

    let (code, p) = get(&sock, &format!("/v1/pages?hash={}", hs[3]));
    assert_eq!(code, 200);
    let host = &p["pages"][0]["tiers"][1];
    assert_eq!(
        (host["complete"].clone(), host["missing"].clone()),
        (
            json!(false),
            json!([
                {"index": 2, "object": {"pp_rank": 0, "tp_rank": 1, "part": "k"}},
                {"index": 3, "object": {"pp_rank": 0, "tp_rank": 1, "part": "v"}},
            ])
        )
    );
    let q = format!(
        "/v1/pages?prefix={},{},{},{}",
        hs[0],
        hs[1],
        PageHash::from_u64(99),
        hs[2]
    );
    let (_, p) = get(&sock, &q);
    assert_eq!(p["complete_prefix"], json!({"device": 0, "host": 2, "pool": 0}));
    assert_eq!(
        p["pages"][2],
        json!({"hash": PageHash::from_u64(99).to_hex(), "known": false})
    );
    assert_eq!(get(&sock, "/v1/pages?hash=xyz").1["code"], "bad_hash");

    let pin = json!({"kind": "pin", "target": {"pages": [hs[0], hs[1]]}, "tier": "host", "ttl_ms": 1000}).to_string();
    let (code, out) = send(&sock, "POST", "/v1/hints", &pin);
    assert_eq!(
        (code, out),
        (200, json!({"outcome": "accepted", "pages": 2, "kind": "pin"}))
    );
    let (code, out) = send(&sock, "POST", "/v1/hints", r#"{"kind": "pin"}"#);
    assert_eq!((code, out["code"].as_str()), (400, Some("malformed_hint")));

    let (code, out) = send(
        &sock,
        "PUT",
        "/v1/config",
        r#"{"pin_budget": 0.5, "host_watermarks": {"high": 0.9}}"#,
    );
    assert_eq!(code, 200);
    assert_eq!(
        (out["pin_budget"].as_f64(), out["host_watermarks"]["high"].as_f64()),
        (Some(0.5), Some(0.9))
    );
    assert_eq!(m.tunables().pin_budget, 0.5);
    assert_eq!(
        send(&sock, "PUT", "/v1/config", r#"{"max_batch": 1}"#).1["code"],
        "not_tunable"
    );
    assert_eq!(
        send(&sock, "PUT", "/v1/config", r#"{"pin_budget": 2.0}"#).1["code"],
        "invalid_config"
    );
    assert_eq!(m.tunables().pin_budget, 0.5);
    assert_eq!(
        get(&sock, "/v1/nope"),
        (404, json!({"code": "not_found", "message": "no endpoint /v1/nope"}))
    );

    // A body over the limit: 413, and the server keeps serving.
    let big = "x".repeat(4096);
    let (code, out) = send(&sock, "POST", "/v1/hints", &big);
    assert_eq!((code, out["code"].as_str()), (413, Some("body_too_large")));
    assert_eq!(get(&sock, "/v1/status").0, 200);

    // Events: the three stores and the partial page's nothing, as JSON lines.
    let (code, body) = curl(&sock, &["http://kvtier/v1/events?from=1&limit=3"], None);
    assert_eq!(code, 200);
    let lines: Vec<Value> = body.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let want: Vec<Value> = (0..3)
        .map(|i| json!({"seq": i + 1, "kind": "stored", "tier": "host", "ns": 0, "hash": hs[i as usize]}))
        .map(|mut v| {
            v["at_ms"] = lines[0]["at_ms"].clone();
            v
        })
        .collect();
    let strip = |v: &Value| {
        let mut v = v.clone();
        v["at_ms"] = json!(0);
        v
    };
    assert_eq!(
        lines.iter().map(strip).collect::<Vec<_>>(),
        want.iter().map(strip).collect::<Vec<_>>()
    );

    // /metrics through prometheus_client's parser.
    let (code, text) = curl(&sock, &["http://kvtier/metrics"], None);
    assert_eq!(code, 200);
    if let Some(py) = python(&["prometheus_client"], "parses /metrics with prometheus_client") {
        check_metrics(&py, &text);
    }

    // The CLI: tables, JSON, and exit codes.
    let s = sock.to_str().unwrap();
    let (code, out) = kv(&["status", "--socket", s]);
    assert_eq!(code, Some(0));
    assert!(out.contains("host") && out.contains("vllm-0"), "{out}");
    let (code, out) = kv(&["status", "--socket", s, "--json"]);
    assert_eq!(code, Some(0));
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["tiers"][1]["complete_pages"],
        3
    );
    let (code, out) = kv(&["pages", "--socket", s, &hs[3].to_hex()]);
    assert_eq!(code, Some(0));
    assert!(out.contains("missing 2/4"), "{out}");
    let prefix = format!("{},{}", hs[0], hs[1]);
    let (code, out) = kv(&["pages", "--socket", s, "--prefix", &prefix]);
    assert_eq!(code, Some(0));
    assert!(out.contains("complete prefix: device 0  host 2  pool 0"), "{out}");
    let (code, out) = kv(&["hint", "retain", "--socket", s, "--priority", "3", &hs[2].to_hex()]);
    assert_eq!((code, out.trim()), (Some(0), "retain: accepted  pages=1"));
    assert_eq!(kv(&["hint", "pin", "--socket", s, "zz"]).0, Some(3));
    let (code, out) = kv(&["events", "--socket", s, "--from", "2", "--limit", "1", "--json"]);
    assert_eq!(code, Some(0));
    assert_eq!(serde_json::from_str::<Value>(out.trim()).unwrap()["seq"], 2);
    let gone = dir.path().join("nothing.sock");
    assert_eq!(kv(&["status", "--socket", gone.to_str().unwrap()]).0, Some(2));
    assert_eq!(kv(&["status", "--bogus"]).0, Some(64));

    // Without the daemon's view of sessions, the manager's own are listed.
    let idle = m.session_registry().index("agent-7").unwrap();
    m.session_registry().mark_idle(m.pages(), idle, true);
    m.session_registry().index("agent-2").unwrap();
    let plain_cfg = AdminConfig::at(dir.path().join("run/plain.sock"));
    let plain = start(&rt, plain_cfg, &m, Arc::new(admin::NoEngines));
    let none = json!(null);
    let want = json!({"sessions": [
        {"session_id": "agent-2", "parent_session_id": none, "phase": none, "idle": false, "pages": none},
        {"session_id": "agent-7", "parent_session_id": none, "phase": none, "idle": true, "pages": none},
    ]});
    assert_eq!(get(&plain.socket(), "/v1/sessions"), (200, want.clone()));
    // Paged: the first of two, with where to go on; then the last, bare again.
    let (code, first) = get(&plain.socket(), "/v1/sessions?limit=1");
    assert_eq!(code, 200);
    assert_eq!(
        first,
        json!({"sessions": [want["sessions"][0]], "truncated": true, "next_offset": 1, "next_after": "agent-2", "total": 2})
    );
    let rest = get(&plain.socket(), "/v1/sessions?offset=1&limit=1");
    assert_eq!(rest, (200, json!({"sessions": [want["sessions"][1]]})));
    // By cursor: the same last page.
    let by_cursor = get(&plain.socket(), "/v1/sessions?after=agent-2&limit=1");
    assert_eq!(by_cursor, (200, json!({"sessions": [want["sessions"][1]]})));
    let (code, over) = get(&plain.socket(), "/v1/sessions?limit=10001");
    assert_eq!((code, over["code"].as_str()), (400, Some("bad_query")));
    assert_eq!(get(&plain.socket(), "/v1/status").1["engines"], json!([]));
    stop(&rt, plain);

    stop(&rt, server);
    assert!(!sock.exists());
}

#[test]
fn a_peer_not_on_the_allowlist_is_refused() {
    const NOBODY: u32 = 65534;
    if !require("root", &format!("runs curl as uid {NOBODY}")) || !require("curl", "drives the admin socket") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The socket is reachable by everyone at the file level (only in this test), so the
    // peer credential check is what stands between user `nobody` and the daemon.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (m, _, _) = manager(dir.path());
    let open = |name: &str, uids: Vec<u32>| {
        let mut cfg = AdminConfig::at(dir.path().join(name));
        cfg.mode = 0o666;
        cfg.allow_uids = uids;
        cfg
    };
    let rt = runtime();
    let strict = start(&rt, open("strict.sock", vec![0]), &m, Arc::new(Engines));
    let (code, body) = curl(
        &strict.socket(),
        &["-d", "{\"secret\": 1}", "http://kvtier/v1/hints"],
        Some(NOBODY),
    );
    assert_eq!(code, 403, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v,
        json!({"code": "peer_not_allowed", "message": "uid 65534 is not allowed on this socket"})
    );
    // The owner is still served.
    assert_eq!(curl(&strict.socket(), &["http://kvtier/v1/status"], None).0, 200);

    let shared = start(&rt, open("shared.sock", vec![0, NOBODY]), &m, Arc::new(Engines));
    assert_eq!(
        curl(&shared.socket(), &["http://kvtier/v1/status"], Some(NOBODY)).0,
        200
    );
    stop(&rt, strict);
    stop(&rt, shared);
}

/// One request over a raw socket, written whole and followed by a half-close (so no curl
/// is needed, and heads can be as odd as a test wants); returns the status and body. The
/// server closes after answering, so the body runs to the end of the stream.
fn raw(sock: &Path, request: &str) -> (u16, String) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    // A server that refuses a connection (at its connection cap) answers and closes without
    // reading the request: the write, or a read after the answer, may then meet a reset.
    // What was answered is still read; any other error fails the test.
    let reset = |e: &std::io::Error| {
        matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        )
    };
    match s
        .write_all(request.as_bytes())
        .and_then(|()| s.shutdown(std::net::Shutdown::Write))
    {
        Err(e) if !reset(&e) => panic!("writing the request: {e}"),
        _ => {}
    }
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Err(e) if !reset(&e) => panic!("reading the answer: {e}"),
        _ => {}
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

fn raw_get(sock: &Path, path: &str, extra_head: &str) -> (u16, Value) {
    let (code, body) = raw(
        sock,
        &format!("GET {path} HTTP/1.1\r\nHost: kvtier\r\n{extra_head}\r\n"),
    );
    (code, serde_json::from_str(&body).unwrap_or(Value::String(body)))
}

/// Opens a connection, sends `head`, then trickles one byte every 100 ms until the server
/// cuts the connection (a write fails: `Ok(bytes sent)`) or 60 s pass (`Err`). Returns
/// the connection's reading end and the trickling thread.
fn trickle(sock: &Path, head: &'static str) -> (UnixStream, std::thread::JoinHandle<Result<usize, usize>>) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let reader = s.try_clone().unwrap();
    let t = std::thread::spawn(move || {
        for sent in 0..600 {
            if s.write_all(b"a").is_err() {
                return Ok(sent);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(600)
    });
    (reader, t)
}

/// Reads until the server closes the connection; fails if it is still open after 60 s.
fn read_until_closed(mut s: UnixStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server kept the connection open: {e}"),
    }
    got
}

#[test]
fn a_trickling_client_is_cut_off_while_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let (m, _, _) = manager(dir.path());
    let mut cfg = AdminConfig::at(dir.path().join("run/admin.sock"));
    // Each byte arrives well within any per-read timeout; only a deadline on the whole
    // request ends these.
    cfg.read_timeout = Duration::from_secs(2);
    let sock = cfg.socket.clone();
    let rt = runtime();
    let server = start(&rt, cfg, &m, Arc::new(Engines));

    let (head_conn, head_trickle) = trickle(&sock, "GET /v1/status HTTP/1.1\r\nHost: kvtier\r\nX-Slow: ");
    let (body_conn, body_trickle) = trickle(
        &sock,
        "POST /v1/hints HTTP/1.1\r\nHost: kvtier\r\nContent-Length: 100000\r\n\r\n",
    );
    // Served while both trickle.
    let (code, st) = raw_get(&sock, "/v1/status", "");
    assert_eq!((code, st["tiers"][1]["complete_pages"].as_u64()), (200, Some(3)));

    // Cut off without an answer (there was no whole request to answer).
    assert_eq!(read_until_closed(head_conn), b"");
    assert_eq!(read_until_closed(body_conn), b"");
    assert!(head_trickle.join().unwrap().is_ok(), "the head kept trickling in");
    assert!(body_trickle.join().unwrap().is_ok(), "the body kept trickling in");
    assert_eq!(raw_get(&sock, "/v1/tiers", "").0, 200);
    stop(&rt, server);
}

#[test]
fn connection_cap_and_head_limits_answer_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (m, _, _) = manager(dir.path());
    let mut cfg = AdminConfig::at(dir.path().join("run/admin.sock"));
    cfg.max_connections = 2;
    let sock = cfg.socket.clone();
    let rt = runtime();
    let server = start(&rt, cfg, &m, Arc::new(Engines));

    // A head over max_header (16 KiB): the typed 431; far over it, hyper's own 431.
    let big = format!("X-Big: {}\r\n", "a".repeat(20 << 10));
    let (code, v) = raw_get(&sock, "/v1/status", &big);
    assert_eq!((code, v["code"].as_str()), (431, Some("header_too_large")));
    let huge = format!("X-Big: {}\r\n", "a".repeat(100 << 10));
    assert_eq!(raw_get(&sock, "/v1/status", &huge).0, 431);
    // A chunked body: 411, as before.
    let chunked = "POST /v1/hints HTTP/1.1\r\nHost: kvtier\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
    let (code, body) = raw(&sock, chunked);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((code, v["code"].as_str()), (411, Some("length_required")));

    // Two connections hold both slots with half a request; a third is turned away. The
    // server frees the slots of the connections above only as their tasks end, after it
    // closed them, so a holder may meet one still taken (and be refused itself): then the
    // holders hang up and try again, a bounded number of times.
    let refused = json!({"code": "too_many_connections", "message": "the admin socket is at its limit"});
    let mut third = (0, Value::Null);
    let mut hold = Vec::new();
    for _ in 0..50 {
        hold = (0..2)
            .map(|_| {
                let mut s = UnixStream::connect(&sock).unwrap();
                s.write_all(b"GET /v1/status HTTP/1.1\r\n").unwrap();
                s
            })
            .collect::<Vec<UnixStream>>();
        third = raw_get(&sock, "/v1/status", "");
        if third.0 == 503 {
            break;
        }
        hold.clear();
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(third, (503, refused));
    // Their slots come back once they hang up (polled: the server sees the hang-up
    // asynchronously).
    drop(hold);
    let served = (0..300).any(|_| {
        let ok = raw_get(&sock, "/v1/status", "").0 == 200;
        if !ok {
            std::thread::sleep(Duration::from_millis(100));
        }
        ok
    });
    assert!(served, "the slots of closed connections were not released");
    stop(&rt, server);
}

#[test]
fn an_event_stream_ends_cleanly_when_the_server_stops() {
    let dir = tempfile::tempdir().unwrap();
    let (m, _, hs) = manager(dir.path());
    let cfg = AdminConfig::at(dir.path().join("run/admin.sock"));
    let sock = cfg.socket.clone();
    let rt = runtime();
    let server = start(&rt, cfg, &m, Arc::new(Engines));

    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(b"GET /v1/events?from=1 HTTP/1.1\r\nHost: kvtier\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches("\"seq\":").count() < 3 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    // No limit: the stream stays open until the server stops, then ends with the last chunk.
    stop(&rt, server);
    s.read_to_end(&mut got).unwrap();
    let text = String::from_utf8(got).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    let head = head.to_ascii_lowercase();
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    assert!(head.contains("content-type: application/x-ndjson"), "{head}");
    assert!(body.ends_with("\r\n0\r\n\r\n"), "{body:?}");
    let seqs: Vec<(u64, String)> = body
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|v| (v["seq"].as_u64().unwrap(), v["hash"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(seqs, (0..3).map(|i| (i as u64 + 1, hs[i].to_hex())).collect::<Vec<_>>());
    assert!(!sock.exists());
}

#[test]
fn the_callers_token_stops_the_server_and_its_own_stop_does_not_cancel_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let (m, _, _) = manager(dir.path());
    let rt = runtime();
    let parent = CancellationToken::new();
    let spawn = |name: &str| {
        let _in_runtime = rt.enter();
        let cfg = AdminConfig::at(dir.path().join(name));
        admin::spawn(cfg, m.clone(), Arc::new(Engines), parent.clone()).unwrap()
    };
    let (one, two) = (spawn("one.sock"), spawn("two.sock"));
    stop(&rt, one);
    assert!(!parent.is_cancelled());
    assert_eq!(raw_get(&two.socket(), "/v1/status", "").0, 200);

    // The daemon's shutdown: only the shared token is cancelled; the server ends by itself
    // and removes its socket (waited for with a generous bound).
    parent.cancel();
    let sock = two.socket();
    let gone = (0..600).any(|_| {
        std::thread::sleep(Duration::from_millis(50));
        !sock.exists()
    });
    assert!(gone, "the socket outlived the cancellation");
    assert!(UnixStream::connect(&sock).is_err());
    drop(two);
}
