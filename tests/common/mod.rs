//! Helpers for the integration tests: the daemon as a real process, engine ranks as real
//! processes (this test binary re-executed in "rank" mode), the rank driver, and the
//! Python interpreter of the test environment.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use kvtier::client::{Client, ClientConfig};
use kvtier::layout::LayoutSpec;
use kvtier::page::{Namespace, PageHash};
use kvtier::protocol::{ErrorCode, Header, Identity, LoadWait, Response, read_frame};
use kvtier::tier::device::EmulatedDevice;

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

/// The Python interpreter of the test environment (`KVTIER_PYTHON`, else `.venv`).
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVTIER_PYTHON") {
        return p.into();
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python3");
    assert!(
        p.exists(),
        "no Python test environment at {}: run scripts/test.sh (it creates .venv)",
        p.display()
    );
    p
}

/// A daemon running as the built `kvtier` binary.
pub struct Daemon {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub arena: PathBuf,
    child: Option<Child>,
    pub log: PathBuf,
}

/// The `kvtier` binary the tests run: `KVTIER_BIN` where set (a prebuilt test binary
/// copied to another machine, as `scripts/gpu-bundle.sh` does), else the one cargo built.
pub fn kvtier_bin() -> PathBuf {
    std::env::var_os("KVTIER_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kvtier")), PathBuf::from)
}

impl Daemon {
    pub fn start(dir: &Path, arena_bytes: u64) -> Self {
        let mut d = Self {
            dir: dir.to_owned(),
            socket: dir.join("kvtier.sock"),
            arena: dir.join("arena"),
            child: None,
            log: dir.join("daemon.log"),
        };
        d.restart(arena_bytes);
        d
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
            .arg("--arena-path")
            .arg(&self.arena)
            .args(["--arena-bytes", &arena_bytes.to_string()])
            .args([
                "--set",
                "lock_arena=false",
                "--set",
                "prefault=false",
                "--set",
                "pool_bytes=8388608",
            ])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
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

/// An engine rank running as a separate OS process, driven line by line.
pub struct RankProc {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl RankProc {
    pub fn spawn(socket: &Path, instance: &str, tp: u16, pp: u16, tps: u16, pps: u16) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["rank_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("KVT_RANK", "1")
            .env("KVT_SOCKET", socket)
            .env("KVT_INSTANCE", instance)
            .env("KVT_TP", format!("{tp},{pp},{tps},{pps}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // The test harness may have printed on the same line first.
                if let Some(at) = line.find("@@ ") {
                    let _ = tx.send(line[at + 3..].to_owned());
                }
            }
        });
        let mut r = Self { child, stdin, lines };
        assert_eq!(r.cmd("ready"), "ready");
        r
    }

    /// Sends one command and returns its answer line.
    pub fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        self.lines.recv_timeout(Duration::from_secs(20)).expect("rank answered")
    }

    /// Sends a command and parses the numbers of its answer.
    pub fn nums(&mut self, line: &str) -> Vec<u64> {
        let a = self.cmd(line);
        a.split_whitespace()
            .skip(1)
            .map(|w| w.parse().unwrap_or_else(|_| panic!("{line:?} -> {a:?}")))
            .collect()
    }

    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn exit(mut self) {
        let _ = writeln!(self.stdin, "exit");
        self.child.wait().unwrap();
    }
}

impl Drop for RankProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The rank process: reads commands on stdin, answers `@@ …` lines on stdout.
pub fn rank_main() {
    let env = |k: &str| std::env::var(k).unwrap();
    let r: Vec<u16> = env("KVT_TP").split(',').map(|v| v.parse().unwrap()).collect();
    let (tp, pp, tps, pps) = (r[0], r[1], r[2], r[3]);
    let layout = spec(tps, pps);
    let cfg = ClientConfig::new(
        env("KVT_SOCKET"),
        identity(&env("KVT_INSTANCE"), tp, pp, tps, pps),
        layout.clone(),
    );
    let client = Client::connect(cfg.with_timeout(Duration::from_secs(10))).unwrap();
    let built = layout.build().unwrap();
    let dev = Arc::new(EmulatedDevice::new(&built, pp, 256));
    client.register_device(dev.clone()).unwrap();
    let mut plans = Vec::new();
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let hs = hashes(num(1), num(2) as usize);
        let slots: Vec<u32> = (0..hs.len() as u32).collect();
        let answer = match w.first().copied() {
            Some("ready") => Ok("ready".to_string()),
            Some("store") => {
                for (i, h) in hs.iter().enumerate() {
                    dev.fill_page(i as u32, seed(h, tp, pp)).unwrap();
                }
                client
                    .store(&hs, &slots, "s")
                    .map(|r| format!("stored {} {} {}", r.written, r.complete, r.ticket))
            }
            Some("begin") => {
                for (i, h) in hs.iter().enumerate() {
                    dev.fill_page(i as u32, seed(h, tp, pp)).unwrap();
                }
                client.begin_store(&hs, "s").and_then(|p| {
                    client.write_plan(&p, &slots)?;
                    let n = p.pages.len();
                    plans.push(p);
                    Ok(format!("begun {n}"))
                })
            }
            Some("lookup") => client
                .lookup(&hs)
                .map(|h| format!("hit {} {} {}", h.device, h.host, h.pool)),
            Some("load") => {
                let fresh = Arc::new(EmulatedDevice::new(&built, pp, 256));
                client.register_device(fresh.clone()).unwrap();
                let r = client.load(&hs, &slots, LoadWait::BestEffort).map(|n| {
                    let ok = (0..n)
                        .filter(|&i| fresh.page_matches(i as u32, seed(&hs[i], tp, pp)).unwrap())
                        .count();
                    format!("loaded {n} {ok}")
                });
                client.register_device(dev.clone()).unwrap();
                r
            }
            Some("wait") => client
                .wait(num(1), Duration::from_millis(num(2)))
                .map(|t| format!("ticket {} {} {}", t.complete, t.total, t.failed)),
            Some("exit") | None => break,
            Some(other) => Ok(format!("unknown {other}")),
        };
        match answer {
            Ok(a) => println!("@@ {a}"),
            Err(e) => println!("@@ err {e}"),
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
