//! The control-socket server in process, on a temporary socket: the connection limit,
//! frame errors through the tokio codec, and cancellation releasing grants.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::{ControlSection, HostSection, PoolSection};
use super::{DaemonConfig, ManagedTiers, Shared, Shutdown, server};
use crate::clock::SystemClock;
use crate::layout::LayoutSpec;
use crate::page::{Namespace, PageHash};
use crate::protocol::{ErrorCode, Header, Identity, Request, Response, frame, read_frame};

struct Served {
    socket: std::path::PathBuf,
    shared: Arc<Shared>,
    shutdown: Shutdown,
    thread: Option<JoinHandle<std::io::Result<()>>>,
    _dir: tempfile::TempDir,
}

fn serve(max_connections: usize) -> Served {
    serve_with(max_connections, 1 << 20, Duration::from_secs(1), false)
}

/// A server on a fresh arena of `arena_bytes`, upkeep every `tick`, and (with `waker`)
/// the manager's upkeep waker hooked up as `kvtier serve` does.
fn serve_with(max_connections: usize, arena_bytes: u64, tick: Duration, waker: bool) -> Served {
    let dir = tempfile::tempdir().unwrap();
    let d = DaemonConfig::default();
    let cfg = DaemonConfig {
        socket: dir.path().join("s.sock"),
        host: HostSection {
            path: dir.path().join("arena"),
            bytes: arena_bytes,
            // The largest object of the layouts these tests connect (128 bytes).
            slot_bytes: 128,
            lock: false,
            prefault: false,
            recover: false,
            ..d.host.clone()
        },
        pool: PoolSection {
            bytes: 0,
            ..d.pool.clone()
        },
        control: ControlSection {
            max_connections,
            max_frame_bytes: 4096,
            ..d.control.clone()
        },
        ..d
    };
    let backend = Arc::new(ManagedTiers::open(cfg.tiers(), SystemClock::new()).unwrap());
    let shared = Arc::new(Shared::new(backend.clone(), cfg.limits()));
    if waker {
        backend.manager().upkeep().set_waker(shared.upkeep_waker());
    }
    let listener = UnixListener::bind(&cfg.socket).unwrap();
    let shutdown = Shutdown::new();
    let (sd, sh) = (shutdown.clone(), shared.clone());
    let thread = std::thread::spawn(move || server::run_blocking(listener, sd, sh, tick));
    Served {
        socket: cfg.socket,
        shared,
        shutdown,
        thread: Some(thread),
        _dir: dir,
    }
}

impl Served {
    fn connect(&self) -> UnixStream {
        let s = UnixStream::connect(&self.socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    /// Cancels the token and waits for `run` to return.
    fn stop(&mut self) -> Duration {
        let t = Instant::now();
        self.shutdown.cancel();
        self.thread.take().unwrap().join().unwrap().unwrap();
        t.elapsed()
    }
}

/// The next frame on `s`, decoded: its request id and response.
fn answer(s: &mut UnixStream) -> Option<(u64, Response)> {
    let mut body = Vec::new();
    let h = read_frame(s, 1 << 20, &mut body).ok()?;
    Some((h.request_id, Response::decode(h.kind, &body).ok()?))
}

fn ask(s: &mut UnixStream, id: u64, req: &Request) -> Option<Response> {
    let mut out = Vec::new();
    req.encode(id, &mut out);
    frame::write_all(&mut &*s, &out).ok()?;
    let (got, resp) = answer(s)?;
    assert_eq!(got, id, "the answer echoes the request id");
    Some(resp)
}

fn ping(s: &mut UnixStream, id: u64) -> Option<Response> {
    ask(
        s,
        id,
        &Request::Ping {
            payload: vec![id as u8; 3],
        },
    )
}

fn error_code(r: Option<(u64, Response)>) -> Option<ErrorCode> {
    match r {
        Some((0, Response::Error(e))) => Some(e.code),
        _ => None,
    }
}

#[test]
fn a_connection_over_the_limit_gets_too_many_connections_and_a_freed_slot_is_reused() {
    let mut d = serve(2);
    let mut a = d.connect();
    let mut b = d.connect();
    assert_eq!(ping(&mut a, 1), Some(Response::Pong { payload: vec![1; 3] }));
    assert_eq!(ping(&mut b, 2), Some(Response::Pong { payload: vec![2; 3] }));
    assert_eq!(d.shared.connections(), 2);
    // Refused before it sends anything: the refusal is already waiting for it.
    let mut c = d.connect();
    assert_eq!(error_code(answer(&mut c)), Some(ErrorCode::TooManyConnections));
    assert!(answer(&mut c).is_none(), "the refused connection is closed");
    assert_eq!(d.shared.connections(), 2);
    drop(b);
    let t = Instant::now();
    while d.shared.connections() > 1 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "a closed connection is not released"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut e = d.connect();
    assert_eq!(ping(&mut e, 3), Some(Response::Pong { payload: vec![3; 3] }));
    d.stop();
    assert_eq!(d.shared.connections(), 0);
    assert_eq!(error_code(answer(&mut a)), Some(ErrorCode::ShuttingDown));
}

#[test]
fn malformed_and_oversized_frames_get_typed_errors_and_other_connections_are_served() {
    let mut d = serve(8);
    let mut good = d.connect();
    assert!(ping(&mut good, 1).is_some());

    // Oversized: refused from its header (max_frame_bytes is 4096), body never sent.
    let mut big = d.connect();
    let h = Header {
        kind: crate::protocol::kind::PING,
        body_len: 1 << 20,
        request_id: 9,
    };
    big.write_all(&h.encode()).unwrap();
    let (id, resp) = answer(&mut big).unwrap();
    match resp {
        Response::Error(e) => {
            assert_eq!((id, e.code), (0, ErrorCode::FrameTooLarge));
            assert!(e.message.contains("1048576"), "{}", e.message);
        }
        other => panic!("oversized frame answered with {other:?}"),
    }
    assert!(answer(&mut big).is_none(), "closed after a bad header");

    // Bad magic and bad version: typed, then closed.
    for (at, value, code) in [(0, 0u8, ErrorCode::BadFrame), (2, 7u8, ErrorCode::UnsupportedVersion)] {
        let mut s = d.connect();
        let mut bytes = Vec::new();
        Request::Ping { payload: vec![1] }.encode(5, &mut bytes);
        bytes[at] = value;
        s.write_all(&bytes).unwrap();
        assert_eq!(error_code(answer(&mut s)), Some(code));
        assert!(answer(&mut s).is_none());
    }

    // A body that does not decode keeps the connection: bad_frame for it, then service.
    let mut soft = d.connect();
    let mut bytes = Vec::new();
    frame::encode_frame(&mut bytes, crate::protocol::kind::LOOKUP, 11, |b| {
        b.extend_from_slice(&[0xff; 3])
    });
    soft.write_all(&bytes).unwrap();
    match answer(&mut soft) {
        Some((11, Response::Error(e))) => assert_eq!(e.code, ErrorCode::BadFrame),
        other => panic!("undecodable body answered with {other:?}"),
    }
    assert_eq!(ping(&mut soft, 12), Some(Response::Pong { payload: vec![12; 3] }));

    // A peer that leaves mid-frame costs nothing but its own connection.
    let mut half = d.connect();
    half.write_all(&h.encode()[..7]).unwrap();
    drop(half);
    assert_eq!(ping(&mut good, 2), Some(Response::Pong { payload: vec![2; 3] }));
    d.stop();
}

/// Connects `s` as the only rank of an instance whose pages are two 128-byte objects.
fn connect_rank(s: &mut UnixStream) {
    let identity = Identity {
        instance: "i".into(),
        namespace: Namespace::model("m"),
        tp_size: 1,
        pp_size: 1,
        ..Identity::default()
    };
    let layout = LayoutSpec::mha(1, 1, 16, 2, 4);
    match ask(s, 1, &Request::Connect { identity, layout }) {
        Some(Response::Connected { .. }) => {}
        other => panic!("connect answered {other:?}"),
    }
}

/// Opens a store grant for `n` pages from `first`; returns the grant.
fn store(s: &mut UnixStream, id: u64, first: u64, n: u64) -> u64 {
    let hashes: Vec<PageHash> = (first..first + n).map(PageHash::from_u64).collect();
    match ask(
        s,
        id,
        &Request::Store {
            hashes,
            session: String::new(),
        },
    ) {
        Some(Response::StoreGrant { grant, pages }) => {
            assert_eq!(pages.len() as u64, n);
            grant
        }
        other => panic!("store answered {other:?}"),
    }
}

#[test]
fn a_store_that_reaches_the_high_watermark_wakes_upkeep_long_before_its_tick() {
    // 64 slots of 128 bytes; high watermark 95 % (61 slots), target 80 % (51).
    let mut d = serve_with(8, 8192, Duration::from_secs(3600), true);
    let mut s = d.connect();
    connect_rank(&mut s);
    let grant = store(&mut s, 2, 0x7000, 31);
    match ask(
        &mut s,
        3,
        &Request::Commit {
            grant,
            written: vec![true; 31],
        },
    ) {
        Some(Response::Committed { complete, .. }) => assert_eq!(complete, 31),
        other => panic!("commit answered {other:?}"),
    }
    // 62 slots used: at the watermark. One more page (held in flight, so not evictable)
    // makes sure a wake comes after the committed pages are evictable.
    store(&mut s, 4, 0x8000, 1);
    let t = Instant::now();
    let used = loop {
        let used = d.shared.backend.stats().arena_used;
        if used <= 52 || t.elapsed() > Duration::from_secs(20) {
            break used;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(used <= 52, "upkeep never ran: {used} of 64 slots used");
    assert!(used >= 2, "the in-flight page kept its slots");
    d.stop();
}

#[test]
fn cancelling_the_token_stops_the_server_and_releases_a_clients_grants() {
    let mut d = serve(8);
    let mut s = d.connect();
    connect_rank(&mut s);
    store(&mut s, 2, 0x5e_0000, 4);
    let before = d.shared.backend.stats();
    assert_eq!((before.open_grants, before.arena_used), (1, 8), "4 pages of 2 objects");

    let took = d.stop();
    assert!(took < Duration::from_secs(3), "shutdown waited out the drain: {took:?}");
    let after = d.shared.backend.stats();
    assert_eq!(
        (after.open_grants, after.arena_used),
        (0, 0),
        "the open store grant was aborted"
    );
    assert_eq!(d.shared.connections(), 0);
    assert_eq!(error_code(answer(&mut s)), Some(ErrorCode::ShuttingDown));
    assert!(answer(&mut s).is_none(), "closed after the notice");
    assert!(UnixStream::connect(&d.socket).is_err(), "no longer accepting");
}
