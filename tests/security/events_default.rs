//! Issue 27, "events without content": with no event keys set, the KV and pool event
//! endpoints are `ipc` sockets in the daemon's private runtime directory, which another
//! local user (uid 65534) cannot connect to; TCP is opt-in and warned about.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::kvtier_bin;
use crate::common::require::require;
use crate::serve::{Serve, mode, tempdir};

const NOBODY: u32 = 65534;

/// `kvtier serve` with every event key at its default (the other tests turn them off).
fn serve_default_events(dir: &Path, name: &str, extra: &[&str]) -> Serve {
    let rt = dir.join(format!("{name}-rt"));
    let socket = rt.join("kvtier.sock");
    let out = dir.join(format!("{name}.out"));
    let err = dir.join(format!("{name}.err"));
    let child = Command::new(kvtier_bin())
        .arg("serve")
        .args(["--socket", socket.to_str().unwrap()])
        .args(["--set", "host.bytes=4194304", "--set", "host.slot_bytes=2048"])
        .args([
            "--set",
            "lock_arena=false",
            "--set",
            "prefault=false",
            "--set",
            "pool_bytes=0",
        ])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    Serve {
        child: Some(child),
        socket,
        out,
        err,
    }
}

/// Waits for the banner to name the KV event endpoint; returns it.
fn kv_events_endpoint(d: &Serve) -> String {
    let t = Instant::now();
    loop {
        if let Some(line) = d.banner().lines().find(|l| l.starts_with("kvtier serve: KV events ")) {
            return line.trim_start_matches("kvtier serve: KV events ").to_owned();
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no KV events line: {}",
            d.banner()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn default_event_endpoints_are_private_ipc_sockets_and_tcp_is_warned_about() {
    let dir = tempdir();
    let mut d = serve_default_events(dir.path(), "ev", &[]).ready();
    let endpoint = kv_events_endpoint(&d);
    let rt = dir.path().join("ev-rt");
    assert_eq!(endpoint, format!("ipc://{}", rt.join("kv-events.ipc").display()));
    assert!(
        d.banner().contains(&format!(
            "KV event replay ipc://{}",
            rt.join("kv-events-replay.ipc").display()
        )),
        "{}",
        d.banner()
    );
    assert_eq!(mode(&rt), 0o700, "the runtime directory is the daemon's alone");
    assert!(!d.log().contains("event endpoint on TCP"), "{}", d.log());
    if require("root", "connects as uid 65534") {
        let path = rt.join("kv-events.ipc");
        let out = Command::new("python3")
            .args([
                "-c",
                "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ntry:\n s.connect(sys.argv[1]); print('connected')\nexcept OSError as e: print(type(e).__name__)",
            ])
            .arg(&path)
            .uid(NOBODY)
            .gid(NOBODY)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            said.trim(),
            "PermissionError",
            "uid 65534 reaching {}: {said}",
            path.display()
        );
    }
    d.stop(libc::SIGTERM);

    // Opted into TCP: it binds there, and says who can read it.
    let mut d = serve_default_events(
        dir.path(),
        "tcp",
        &[
            "--set",
            "events_endpoint=tcp://127.0.0.1:*",
            "--set",
            "events_replay_endpoint=",
        ],
    )
    .ready();
    let endpoint = kv_events_endpoint(&d);
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");
    assert!(
        d.log().contains("event endpoint on TCP") && d.log().contains("token ids"),
        "{}",
        d.log()
    );
    d.stop(libc::SIGTERM);
}
