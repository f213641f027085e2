//! What the cluster tests share: a `mooncake_master` of a test's own (on fresh loopback
//! ports, so a test may kill and restart it without touching anyone else's), and
//! `kvtier serve --pool-kind mooncake` nodes on it, each with its own runtime directory, arena
//! and admin socket.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use std::sync::Arc;

use crate::common::rank::RankProc;
use crate::common::{identity, kvtier_bin, seed, spec};
use kvtier::client::{Client, ClientConfig};
use kvtier::hints::{Hint, HintOutcome, HintTarget};
use kvtier::page::PageHash;
use kvtier::protocol::LoadWait;
use kvtier::tier::device::EmulatedDevice;

/// The wheel's `mooncake_master` binary and the Python its helper runs, as
/// `scripts/mooncake-env.sh env` exports them (call after `require("mooncake", ..)`).
pub fn mooncake_tools() -> (PathBuf, PathBuf) {
    let bin = std::env::var_os("KVTIER_MOONCAKE_MASTER_BIN").map(PathBuf::from);
    let python = std::env::var_os("KVTIER_MOONCAKE_PYTHON").map(PathBuf::from);
    let (Some(bin), Some(python)) = (bin, python) else {
        panic!("scripts/mooncake-env.sh env sets KVTIER_MOONCAKE_MASTER_BIN and KVTIER_MOONCAKE_PYTHON");
    };
    (bin, python)
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// A `mooncake_master` of this test's own, on fresh loopback ports.
pub struct Master {
    bin: PathBuf,
    rpc: u16,
    http: u16,
    metrics: u16,
    log: PathBuf,
    child: Option<Child>,
}

impl Master {
    pub fn start(bin: PathBuf, dir: &Path) -> Self {
        let mut m = Self {
            bin,
            rpc: free_port(),
            http: free_port(),
            metrics: free_port(),
            log: dir.join("master.log"),
            child: None,
        };
        m.restart();
        m
    }

    pub fn restart(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(&self.bin)
            .args(["--rpc_address=127.0.0.1", &format!("--rpc_port={}", self.rpc)])
            .args([
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
            ])
            .arg(format!("--http_metadata_server_port={}", self.http))
            .arg(format!("--metrics_port={}", self.metrics))
            .arg("--client_ttl=3")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let up = eventually(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", self.rpc)).is_ok()
                && std::net::TcpStream::connect(("127.0.0.1", self.http)).is_ok()
                && std::net::TcpStream::connect(("127.0.0.1", self.metrics)).is_ok()
        });
        assert!(up, "mooncake_master did not come up; log {}", self.log.display());
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.rpc)
    }

    /// The master's admin HTTP address (its metrics port: `/get_all_keys`, `/metrics`).
    pub fn admin(&self) -> String {
        format!("127.0.0.1:{}", self.metrics)
    }

    pub fn metadata(&self) -> String {
        format!("http://127.0.0.1:{}/metadata", self.http)
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The daemon's Mooncake helper: its child running `kvtier_mooncake_helper.py`.
pub fn helper_pid(daemon: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        // `pid (comm) state ppid ...`: comm may hold spaces, so read past its ')'.
        let ppid: u32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        (ppid == daemon && String::from_utf8_lossy(&cmd).contains("kvtier_mooncake_helper")).then_some(pid)
    })
}

/// Whether process `pid` still runs: its `/proc` entry exists and it is not a zombie
/// (a killed child that nobody has reaped yet).
pub fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) state ...`: comm may hold spaces, so read past its ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, Some("Z" | "X") | None)
}

/// `pool.key` in `dir`: 32 random bytes, mode 0600, made once (`mooncake.integrity_key_file`).
pub fn cluster_key_file(dir: &Path) -> PathBuf {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("pool.key");
    let mut key = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut key)
        .unwrap();
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
    {
        f.write_all(&key).unwrap();
    }
    path
}

/// `kvtier serve --pool-kind mooncake` with its own runtime directory and arena.
pub struct Node {
    pub socket: PathBuf,
    pub admin: PathBuf,
    pub log: PathBuf,
    child: Child,
}

impl Node {
    pub fn start(dir: &Path, master: &Master, python: &Path) -> Self {
        Self::start_with(dir, master, python, &[])
    }

    /// [`Node::start`] with more `--set key=value` pairs, after (and over) the usual ones.
    pub fn start_with(dir: &Path, master: &Master, python: &Path, extra: &[(&str, String)]) -> Self {
        Self::start_via(dir, master, &master.addr(), python, extra)
    }

    /// [`Node::start_with`], reaching the master's RPC port at `rpc` (a proxy in front of it).
    pub fn start_via(dir: &Path, master: &Master, rpc: &str, python: &Path, extra: &[(&str, String)]) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let log = dir.join("daemon.log");
        let out = std::fs::File::create(dir.join("stdout.log")).unwrap();
        let set = |k: &str, v: &str| ["--set".to_string(), format!("{k}={v}")];
        // One cluster key for every node started beside this one, as an operator gives
        // every node of a store the same file.
        let key = cluster_key_file(dir.parent().unwrap());
        let child = Command::new(kvtier_bin())
            .arg("serve")
            .arg("--socket")
            .arg(dir.join("kvtier.sock"))
            .arg("--arena-path")
            .arg(dir.join("arena"))
            .args(["--arena-bytes", &(16u64 << 20).to_string()])
            // 1,024 slots: room for every test's pages (their objects are at most 16 KiB).
            .args(set("slot_bytes", "16384"))
            .args(["--pool", "mooncake", "--mooncake-master", rpc])
            .args(set("mooncake.metadata", &format!("{:?}", master.metadata())))
            .args(set("mooncake.python", &format!("{:?}", python.display().to_string())))
            .args(set("mooncake.global_segment_bytes", "67108864"))
            .args(set(
                "admin_socket",
                &format!("{:?}", dir.join("admin.sock").display().to_string()),
            ))
            .args(set("lock_arena", "false"))
            .args(set("prefault", "false"))
            .args(set("recover", "false"))
            .args(set("events_endpoint", "\"\""))
            .args(set("events_replay_endpoint", "\"\""))
            .args(if extra.iter().any(|(k, _)| *k == "pool_events_endpoint") {
                Vec::new()
            } else {
                set("pool_events_endpoint", "\"\"").to_vec()
            })
            .args(set(
                "mooncake.integrity_key_file",
                &format!("{:?}", key.display().to_string()),
            ))
            .args(extra.iter().flat_map(|(k, v)| set(k, v)))
            .env("RUST_LOG", "info")
            .stdout(out)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let socket = dir.join("kvtier.sock");
        assert!(
            eventually(Duration::from_secs(20), || crate::common::serving(&socket)),
            "daemon did not start; log {}",
            log.display()
        );
        Self {
            admin: dir.join("admin.sock"),
            socket,
            log,
            child,
        }
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The daemon's log so far, for a failing test's message.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn client(&self, instance: &str, tp: u16) -> Client {
        let cfg = ClientConfig::new(&self.socket, identity(instance, tp, 0, 2, 1), spec(2, 1));
        Client::connect(cfg.with_timeout(Duration::from_secs(20))).unwrap()
    }

    /// `kvtier <args> --socket <admin> --json`, parsed.
    pub fn admin(&self, args: &[&str]) -> serde_json::Value {
        let out = Command::new(kvtier_bin())
            .args(args)
            .arg("--socket")
            .arg(&self.admin)
            .arg("--json")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kvtier {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One engine rank of a reading node, in the test's process: a client (engine
/// "b-engine", TP=2) and an emulated device of 64 pages.
pub struct Rank {
    tp: u16,
    pub client: Client,
    dev: Arc<EmulatedDevice>,
}

impl Rank {
    pub fn new(node: &Node, tp: u16) -> Self {
        let client = node.client("b-engine", tp);
        let dev = Arc::new(EmulatedDevice::new(&spec(2, 1).build().unwrap(), 0, 64));
        client.register_device(dev.clone()).unwrap();
        Self { tp, client, dev }
    }

    /// Loads `hs` into slots 0..; returns (pages loaded, of which hold the bytes the
    /// writing rank of the same TP rank stored, `seed(h, tp, 0)`).
    pub fn load(&self, hs: &[PageHash]) -> (usize, usize) {
        let slots: Vec<u32> = (0..hs.len() as u32).collect();
        let n = self.client.load(hs, &slots, LoadWait::Timeout(10_000)).unwrap();
        let ok = (0..n)
            .filter(|&i| self.dev.page_matches(i as u32, seed(&hs[i], self.tp, 0)).unwrap())
            .count();
        (n, ok)
    }
}

/// Node `a`'s two ranks (engine "a-engine", TP=2) store `hs` as complete pages, and an
/// engine shares them until `a` counts them all complete in the pool; returns the ranks
/// (which hold the pages' engine side).
pub fn store_and_share(a: &Node, hs: &[PageHash]) -> Vec<RankProc> {
    let mut ranks: Vec<RankProc> = (0..2)
        .map(|r| RankProc::spawn(&a.socket, "a-engine", r, 0, 2, 1))
        .collect();
    for r in &mut ranks {
        assert_eq!(r.cmd("ready"), "ready");
        assert_eq!(
            r.nums(&format!("store {} {}", hs[0].prefix_u64(), hs.len()))[0],
            hs.len() as u64
        );
    }
    let ctl = a.client("a-ctl", 0);
    let share = Hint::Share {
        target: HintTarget::Prefix(hs.to_vec()),
    };
    let prefix: Vec<String> = hs.iter().map(PageHash::to_hex).collect();
    let pooled = eventually(Duration::from_secs(60), || {
        matches!(ctl.hint(share.clone()), Ok(HintOutcome::Accepted { .. }))
            && a.admin(&["pages", "--prefix", &prefix.join(",")])["complete_prefix"]["pool"] == hs.len()
    });
    assert!(pooled, "A's pages reached the store; log {}", a.log.display());
    ranks
}
