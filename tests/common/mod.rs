//! Helpers for the integration tests: the daemon as a real process, engine ranks as real
//! processes ([`rank`]), raw frames, and what a test needs from its environment
//! ([`require`]: loud skips, and failures where `KVTIER_REQUIRE` lists the need).

#![allow(dead_code)]

pub mod engine_lib;
pub mod rank;
pub mod require;

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvtier::client::{Client, ClientConfig};
use kvtier::layout::LayoutSpec;
use kvtier::page::{Namespace, PageHash};
use kvtier::protocol::{ErrorCode, Header, Identity, Response, read_frame};

/// 1 layer, 1 KV head, head dim 16, fp16, 4 tokens a page: 128-byte objects.
pub fn small_spec() -> LayoutSpec {
    LayoutSpec::mha(1, 1, 16, 2, 4)
}

/// 4 layers, 4 KV heads, head dim 16, fp16, 4 tokens a page: 512-byte objects at TP=2 PP=2.
pub fn spec(tp: u16, pp: u16) -> LayoutSpec {
    LayoutSpec::mha(4, 4, 16, 2, 4).with_parallel(tp, pp)
}

pub fn identity(instance: &str, tp: u16, pp: u16, tps: u16, pps: u16) -> Identity {
    Identity {
        instance: instance.into(),
        namespace: Namespace::model("test-model"),
        tp_rank: tp,
        tp_size: tps,
        pp_rank: pp,
        pp_size: pps,
        dp_rank: 0,
    }
}

pub fn hashes(base: u64, n: usize) -> Vec<PageHash> {
    (0..n as u64).map(|i| PageHash::from_u64(base + i)).collect()
}

/// The bytes a rank writes for a page: distinct per page and per rank.
pub fn seed(hash: &PageHash, tp: u16, pp: u16) -> u64 {
    hash.prefix_u64().wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (((tp as u64) << 8) | pp as u64)
}

/// A daemon running as the built `kvtier` binary.
pub struct Daemon {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub arena: PathBuf,
    child: Option<Child>,
    pub log: PathBuf,
    /// The admin socket a test set with `admin.socket=`; without one, `admin.sock` in
    /// `dir` (the daemon itself then binds its default, in the runtime dir).
    pub admin: PathBuf,
    /// `key=value` pairs passed as `--set` on every (re)start.
    pub sets: Vec<String>,
}

/// The `kvtier` binary the tests run: `KVTIER_BIN` where set (a prebuilt test binary
/// copied to another machine, as `scripts/gpu-bundle.sh` does), else the one cargo built.
pub fn kvtier_bin() -> PathBuf {
    std::env::var_os("KVTIER_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kvtier")), PathBuf::from)
}

impl Daemon {
    pub fn start(dir: &Path, arena_bytes: u64) -> Self {
        Self::start_with(dir, arena_bytes, &[])
    }

    /// [`Daemon::start`] with configuration keys set (`"key=value"`, as `--set` takes).
    pub fn start_with(dir: &Path, arena_bytes: u64, sets: &[&str]) -> Self {
        let admin = sets
            .iter()
            .rev()
            .find_map(|s| {
                s.strip_prefix("admin.socket=")
                    .or_else(|| s.strip_prefix("admin_socket="))
            })
            .map_or_else(|| dir.join("admin.sock"), PathBuf::from);
        let mut d = Self {
            dir: dir.to_owned(),
            socket: dir.join("kvtier.sock"),
            arena: dir.join("arena"),
            child: None,
            log: dir.join("daemon.log"),
            admin,
            sets: sets.iter().map(|s| s.to_string()).collect(),
        };
        d.restart(arena_bytes);
        d
    }

    /// Waits until the admin socket answers connections too (it starts after the
    /// control socket).
    pub fn wait_admin(&self) -> &Self {
        let t = Instant::now();
        while UnixStream::connect(&self.admin).is_err() {
            assert!(t.elapsed() < Duration::from_secs(10), "admin socket did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        self
    }

    /// The daemon's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn restart(&mut self, arena_bytes: u64) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(kvtier_bin())
            .args(["serve", "--socket"])
            .arg(&self.socket)
            .arg("--host-path")
            .arg(&self.arena)
            .args(["--host-bytes", &arena_bytes.to_string()])
            .args([
                "--set",
                "host.lock=false",
                "--set",
                "host.prefault=false",
                "--set",
                "pool.bytes=8388608",
                // The largest object of `spec(1, 1)` (most tests' layout, and more than
                // any other layout they use needs); a test may set its own.
                "--set",
                "host.slot_bytes=2048",
            ])
            .args(self.sets.iter().flat_map(|s| ["--set", s.as_str()]))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let t = Instant::now();
        while !serving(&self.socket) {
            assert!(t.elapsed() < Duration::from_secs(10), "daemon did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn signal(&mut self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// Waits for the daemon to exit; returns whether it exited successfully.
    pub fn wait(&mut self) -> bool {
        let mut c = self.child.take().expect("daemon running");
        let t = Instant::now();
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                return status.success();
            }
            assert!(t.elapsed() < Duration::from_secs(10), "daemon did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn client(&self, id: Identity, layout: LayoutSpec) -> Client {
        Client::connect(ClientConfig::new(&self.socket, id, layout).with_timeout(Duration::from_secs(10))).unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A frame with any kind and body, for feeding the daemon what a client never would.
pub fn raw_frame(kind: u8, id: u64, body: &[u8]) -> Vec<u8> {
    let mut out = Header {
        kind,
        body_len: body.len() as u32,
        request_id: id,
    }
    .encode()
    .to_vec();
    out.extend_from_slice(body);
    out
}

/// Whether a daemon serves at `socket`: it answers a ping, and not with `recovering` (the
/// socket is bound while the daemon still rebuilds its index, and answers that then).
pub fn serving(socket: &Path) -> bool {
    let Ok(mut s) = UnixStream::connect(socket) else {
        return false;
    };
    if s.set_read_timeout(Some(Duration::from_secs(5))).is_err() {
        return false;
    }
    let mut ping = Vec::new();
    kvtier::protocol::Request::Ping { payload: Vec::new() }.encode(1, &mut ping);
    if std::io::Write::write_all(&mut s, &ping).is_err() {
        return false;
    }
    let got = answer(&mut s);
    got.is_some() && code(got) != Some(ErrorCode::Recovering)
}

pub fn answer(s: &mut UnixStream) -> Option<Response> {
    let mut body = Vec::new();
    let h = read_frame(s, 1 << 20, &mut body).ok()?;
    Response::decode(h.kind, &body).ok()
}

pub fn code(r: Option<Response>) -> Option<ErrorCode> {
    match r {
        Some(Response::Error(e)) => Some(e.code),
        _ => None,
    }
}

/// The daemon's counters (`Stats`), asked on `s`, a raw control connection: `Stats`
/// needs no `Connect`, so the connection holds nothing in the daemon but itself.
pub fn raw_stats(s: &mut UnixStream) -> kvtier::protocol::DaemonStats {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req = Vec::new();
    kvtier::protocol::Request::Stats.encode(1, &mut req);
    std::io::Write::write_all(s, &req).unwrap();
    match answer(s) {
        Some(Response::Stats(st)) => st,
        other => panic!("a Stats answer, not {other:?}"),
    }
}

/// Waits (within `limit`) until the daemon counts the raw control connection `s` as its
/// only one: every connection closed before it (a start-up probe's, clients' that left)
/// is gone on the daemon's side too, its task ended and its descriptor closed.
pub fn until_sole_connection(s: &mut UnixStream, limit: Duration) {
    let t = Instant::now();
    loop {
        let n = raw_stats(s).connections;
        if n == 1 {
            return;
        }
        assert!(
            t.elapsed() < limit,
            "the daemon still counts {n} connections, not this one alone"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (within `limit`) until the daemon behind the admin socket `sock` has finished two
/// more upkeep runs (`upkeep_ticks` in `/v1/status`) than when called: one whole run
/// (pin expiry, the session policy's step, eviction by watermark) started after whatever
/// the caller did before. For a negative assertion ("nothing moved") that needs the
/// policy to have had its chance.
pub fn two_more_upkeep_runs(sock: &Path, limit: Duration) {
    let ticks = || {
        let (status, st) = admin_json(sock, "GET", "/v1/status", None);
        assert_eq!(status, 200, "{st}");
        st["upkeep_ticks"]
            .as_u64()
            .unwrap_or_else(|| panic!("upkeep_ticks in {st}"))
    };
    let from = ticks();
    until("two more upkeep runs", limit, || ticks() >= from + 2);
}

/// One admin-socket request; the status and the body as JSON (`Null` when it is not).
pub fn admin_json(sock: &Path, method: &str, target: &str, body: Option<&[u8]>) -> (u16, serde_json::Value) {
    let r = kvtier::cli::client::request(sock, method, target, body, Some(Duration::from_secs(30))).unwrap();
    let status = r.status;
    let body = r.body().unwrap();
    (status, serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null))
}

/// Leading pages of `pages` complete in `tier` ("host", "pool", ...), as the admin
/// socket's `/v1/pages` reports them.
pub fn complete_prefix(sock: &Path, pages: &[PageHash], tier: &str) -> u64 {
    let list: Vec<String> = pages.iter().map(|h| h.to_hex()).collect();
    let (status, v) = admin_json(sock, "GET", &format!("/v1/pages?prefix={}", list.join("%2C")), None);
    assert_eq!(status, 200, "{v}");
    v["complete_prefix"][tier].as_u64().unwrap()
}

/// Polls `f` until it holds; fails the test after `limit`.
pub fn until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (within `limit`) until the daemon behind the admin socket `sock` has given its
/// allocator's free memory back after every control frame it had read when called
/// (`memory` in `/v1/status`; the daemon trims once its control sockets have been quiet
/// for a second). Send no more frames meanwhile: each one restarts the quiet.
pub fn until_memory_trimmed(sock: &Path, limit: Duration) {
    let memory = || {
        let (status, st) = admin_json(sock, "GET", "/v1/status", None);
        assert_eq!(status, 200, "{st}");
        let m = &st["memory"];
        let field = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("memory.{k} in {st}"));
        (field("frames"), field("trimmed_after_frames"))
    };
    let (frames, _) = memory();
    until("the allocator's free memory given back", limit, || memory().1 >= frames);
}

/// Squeezes host through the admin socket's watermarks until none of `pages` is
/// complete there (within `limit`), then puts the usual watermarks back: pages already
/// copied to the pool are then complete in the pool only.
pub fn squeeze_host(admin_sock: &Path, pages: &[PageHash], limit: Duration) {
    let tight = serde_json::json!({"host_watermarks": {"high": 0.0002, "resume": 0.0002, "target": 0.0001}});
    let (s, v) = admin_json(admin_sock, "PUT", "/v1/config", Some(tight.to_string().as_bytes()));
    assert_eq!(s, 200, "{v}");
    until("the pages left host", limit, || {
        complete_prefix(admin_sock, pages, "host") == 0
    });
    let normal = serde_json::json!({"host_watermarks": {"high": 0.95, "resume": 0.85, "target": 0.8}});
    let (s, v) = admin_json(admin_sock, "PUT", "/v1/config", Some(normal.to_string().as_bytes()));
    assert_eq!(s, 200, "{v}");
}
