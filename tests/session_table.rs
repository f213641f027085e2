//! The daemon's session table through its sockets: a million ended sessions with
//! 1,000-byte ids leave the table at its configured bound and the daemon's memory with
//! it; an id over the limit gets a typed error and the daemon keeps serving; the admin
//! listing pages through the table by cursor.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{identity, kvtier_bin, small_spec};
use kvtier::client::{Client, ClientConfig, ClientError};
use kvtier::protocol::{ErrorCode, SessionPhase};
use serde_json::Value;

/// The table bound the daemon runs with.
const MAX_SESSIONS: usize = 20_000;
const ID_BYTES: usize = 1_000;

struct Serve {
    child: Child,
    dir: PathBuf,
}

impl Serve {
    fn start(dir: &Path) -> Self {
        let quote = |p: PathBuf| format!("{:?}", p.display().to_string());
        let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
        let child = Command::new(kvtier_bin())
            .arg("serve")
            .arg("--socket")
            .arg(dir.join("kvtier.sock"))
            .arg("--arena-path")
            .arg(dir.join("arena"))
            .args(["--arena-bytes", "16777216"])
            .args([
                "--set",
                "pool_bytes=0",
                "--set",
                "recover=false",
                "--set",
                "slot_bytes=128",
            ])
            .args(["--set", "lock_arena=false", "--set", "prefault=false"])
            .args(["--set", "events_endpoint=\"\"", "--set", "events_replay_endpoint=\"\""])
            .args(["--set", "pool_events_endpoint=\"\""])
            .args(["--set", &format!("max_sessions={MAX_SESSIONS}")])
            .arg("--set")
            .arg(format!("admin_socket={}", quote(dir.join("admin.sock"))))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(dir.join("kvtier.sock")).is_err()
            || std::os::unix::net::UnixStream::connect(dir.join("admin.sock")).is_err()
        {
            assert!(t.elapsed() < Duration::from_secs(30), "daemon did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self {
            child,
            dir: dir.to_owned(),
        }
    }

    fn client(&self, instance: &str) -> Client {
        let cfg = ClientConfig::new(
            self.dir.join("kvtier.sock"),
            identity(instance, 0, 0, 1, 1),
            small_spec(),
        )
        .with_timeout(Duration::from_secs(30));
        Client::connect(cfg).unwrap()
    }

    fn get(&self, path: &str) -> Value {
        let answer = kvtier::cli::client::request(
            &self.dir.join("admin.sock"),
            "GET",
            path,
            None,
            Some(Duration::from_secs(30)),
        )
        .unwrap();
        assert_eq!(answer.status, 200, "{path}");
        serde_json::from_slice(&answer.body().unwrap()).unwrap()
    }

    /// Resident memory of the daemon, from `/proc`.
    fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        kb * 1024
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A 1,000-byte id, unique per `i`, whose leading digits sort by `i`.
fn long_id(i: usize) -> String {
    let head = format!("s{i:09}-");
    format!("{head}{}", "x".repeat(ID_BYTES - head.len()))
}

#[test]
fn a_million_ended_sessions_stay_within_the_table_bound() {
    let dir = tempfile::tempdir().unwrap();
    let d = Serve::start(dir.path());
    let total: usize = std::env::var("KVTIER_TEST_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    // Warm the daemon up to a full table first, so the baseline includes its allocator's
    // steady state, then send the rest: growth past the baseline is what a leak adds.
    assert!(
        total >= 2 * MAX_SESSIONS,
        "KVTIER_TEST_SESSIONS must be at least {}",
        2 * MAX_SESSIONS
    );
    let send = |from: usize, to: usize, threads: usize| {
        std::thread::scope(|s| {
            for t in 0..threads {
                let c = d.client(&format!("sessions-{t}"));
                s.spawn(move || {
                    for i in (from + t..to).step_by(threads) {
                        c.session(&long_id(i), None, SessionPhase::Ended).unwrap();
                    }
                });
            }
        });
    };
    send(0, MAX_SESSIONS, 4);
    let warm_rss = d.rss_bytes();
    send(MAX_SESSIONS, total - MAX_SESSIONS, 4);
    // The last table-full in order from one client, so which ones are held is known.
    send(total - MAX_SESSIONS, total, 1);
    let rss = d.rss_bytes();

    // An id over the limit: a typed error, and the daemon keeps serving.
    let c = d.client("probe");
    let long = "y".repeat(1025);
    match c.session(&long, None, SessionPhase::Reasoning) {
        Err(ClientError::Remote(e)) => assert_eq!(e.code, ErrorCode::BadRequest, "{e}"),
        other => panic!("an over-long id was answered {other:?}"),
    }
    // Sorts after every long id, and frees the oldest ended session.
    c.session("zz-after-the-bad-one", None, SessionPhase::Reasoning)
        .unwrap();

    let st = d.get("/v1/status");
    let held = st["sessions"]["held"].as_u64().unwrap() as usize;
    let bytes = st["sessions"]["table_bytes"].as_u64().unwrap() as usize;
    assert_eq!(held, MAX_SESSIONS, "the table is full, not past its bound");
    assert_eq!(st["sessions"]["max"].as_u64(), Some(MAX_SESSIONS as u64));
    assert!(bytes <= MAX_SESSIONS * (ID_BYTES + 200), "table of {bytes} bytes");
    // A million 1,000-byte ids kept would be a gigabyte; the bound allows the table's
    // own size a few times over (allocator slack) on top of the warmed-up daemon.
    let allowed = warm_rss + 4 * (MAX_SESSIONS * (ID_BYTES + 200)) as u64;
    assert!(rss <= allowed, "daemon RSS {rss} over {allowed} (warm {warm_rss})");

    // The newest sessions are the ones held (oldest ended freed first), and the listing
    // pages through them in id order by cursor.
    let first = d.get("/v1/sessions?limit=3");
    // Ids compared by their number (a failure prints three numbers, not 3,000 bytes).
    let num = |v: &Value| -> usize {
        let id = v.as_str().unwrap();
        assert_eq!(id.len(), ID_BYTES);
        id[1..10].parse().unwrap()
    };
    let ids: Vec<usize> = first["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| num(&s["session_id"]))
        .collect();
    let oldest_held = total - MAX_SESSIONS + 1;
    assert_eq!(ids, vec![oldest_held, oldest_held + 1, oldest_held + 2]);
    assert_eq!(first["sessions"][0]["phase"], "ended");
    assert_eq!(first["total"].as_u64(), Some(MAX_SESSIONS as u64));
    let cursor = first["next_after"].as_str().unwrap();
    let next = d.get(&format!("/v1/sessions?limit=2&after={cursor}"));
    assert_eq!(num(&next["sessions"][0]["session_id"]), oldest_held + 3);
    assert_eq!(num(&next["next_after"]), oldest_held + 4);
}
