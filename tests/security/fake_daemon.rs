//! Issue 27, break 3: a fake daemon where an engine looks for the real one. Another local
//! user (uid 65534) runs her own `kvtier serve` on the socket an engine of this uid would
//! use by default in a shared working directory (`./.kvtier/kvtier.sock`); the engine must
//! refuse her before sending a byte, with an error naming both uids, and accept her only
//! when told that the daemon runs as her uid.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::kvtier_bin;
use crate::common::require::require;
use crate::common::{identity, small_spec};
use crate::serve::{chmod, tempdir};
use kvtier::client::{Client, ClientConfig, ClientError};

const NOBODY: u32 = 65534;

fn connect(socket: &Path, daemon_uid: Option<u32>) -> Result<Client, ClientError> {
    let mut id = identity("victim", 0, 0, 1, 1);
    id.namespace = kvtier::page::Namespace::model("victim");
    let mut cfg = ClientConfig::new(socket, id, small_spec()).with_timeout(Duration::from_secs(10));
    if let Some(uid) = daemon_uid {
        cfg = cfg.with_daemon_uid(uid);
    }
    Client::connect(cfg)
}

#[test]
fn an_engine_refuses_a_daemon_of_another_uid_on_its_default_socket() {
    if !require("root", "runs a daemon as uid 65534") {
        return;
    }
    let dir = tempdir();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    chmod(&shared, 0o1777);
    let err = dir.path().join("mallory.err");
    let her_arena = shared.join("mallory/arena");
    // Mallory's daemon in the shared directory, on the default socket, with no runtime dir.
    let mut mallory = Command::new(kvtier_bin())
        .arg("serve")
        .args(["--arena-path", her_arena.to_str().unwrap(), "--arena-bytes", "4194304"])
        .args([
            "--set",
            "slot_bytes=2048",
            "--set",
            "lock_arena=false",
            "--set",
            "prefault=false",
        ])
        .args([
            "--set",
            "pool_bytes=0",
            "--set",
            "events_endpoint=",
            "--set",
            "events_replay_endpoint=",
        ])
        .args(["--set", "pool_events_endpoint="])
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("KVTIER_SOCKET")
        .current_dir(&shared)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let socket = shared.join(".kvtier/kvtier.sock");
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        let log = || std::fs::read_to_string(&err).unwrap_or_default();
        assert!(mallory.try_wait().unwrap().is_none(), "her daemon exited: {}", log());
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "her daemon did not start: {}",
            log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let refused = connect(&socket, None);
    let accepted = connect(&socket, Some(NOBODY)).map(|c| c.arena().map(|a| a.path));
    // The admin CLI, run in that directory, refuses her admin socket the same way
    // (exit 2, both uids named), and talks to it only when told her uid.
    let admin = shared.join(".kvtier/admin.sock");
    let cli = |daemon_uid: Option<u32>| {
        let mut c = Command::new(kvtier_bin());
        c.args(["status", "--json", "--socket", admin.to_str().unwrap()])
            .env_remove("KVTIER_DAEMON_UID");
        if let Some(u) = daemon_uid {
            c.env("KVTIER_DAEMON_UID", u.to_string());
        }
        c.output().unwrap()
    };
    let t = Instant::now();
    while !admin.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "her admin socket never appeared");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (cli_refused, cli_told) = (cli(None), cli(Some(NOBODY)));
    let _ = mallory.kill();
    let _ = mallory.wait();
    match refused {
        Err(e @ ClientError::Untrusted { expected, found, .. }) => {
            assert_eq!((expected, found), (0, NOBODY));
            let msg = e.to_string();
            assert!(msg.contains("uid 0") && msg.contains(&format!("uid {NOBODY}")), "{msg}");
        }
        Err(e) => panic!("refused, but not as untrusted: {e}"),
        Ok(_) => panic!("the engine connected to uid {NOBODY}'s daemon and would map her arena"),
    }
    let said = String::from_utf8_lossy(&cli_refused.stderr);
    assert_eq!(cli_refused.status.code(), Some(2), "{said}");
    assert!(
        said.contains(&format!("runs as uid {NOBODY}, not the daemon's uid 0")),
        "{said}"
    );
    assert!(cli_refused.stdout.is_empty(), "nothing of hers was printed");
    // Told her uid, it talks to her daemon, which refuses uid 0 on her admin socket (her
    // allowlist): the request got there.
    let told = String::from_utf8_lossy(&cli_told.stderr);
    assert_eq!(cli_told.status.code(), Some(3), "{told}");
    assert!(told.contains("uid 0 is not allowed"), "{told}");
    // Told explicitly that the daemon runs as uid 65534, the engine maps her arena (hers,
    // not a file of anybody else's).
    let arena = accepted.expect("connects when the daemon's uid is named").unwrap();
    assert_eq!(Path::new(&arena), her_arena, "her arena");
}
