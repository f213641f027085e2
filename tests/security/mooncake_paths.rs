//! Issue 27, breaks 1 and 2: code execution through the Mooncake helper's paths. Another
//! local user (uid 65534) plants a run directory under the name the daemon's pid makes
//! predictable, or a `.venv/bin/python3` in a shared working directory; the daemon must
//! run neither her files nor anything in her directories.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::require::require;
use crate::common::{kvtier_bin, small_spec};
use crate::serve::{Serve, chmod, tempdir};

const NOBODY: u32 = 65534;

/// A port nothing listens on: the master stays unreachable, the helper is still launched.
fn dead_master() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", l.local_addr().unwrap().port())
}

/// `kvtier serve --pool mooncake` behind `sh -c 'read; exec …'`: its pid is known before
/// it runs, as an attacker predicts it; it runs once a line is written to the returned pipe.
fn gated_serve(dir: &Path, name: &str, args: &[&str], cwd: &Path) -> (Serve, ChildStdin) {
    let socket = dir.join(format!("{name}.sock"));
    let out = dir.join(format!("{name}.out"));
    let err = dir.join(format!("{name}.err"));
    let master = dead_master();
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "read _ && exec \"$0\" \"$@\""])
        .arg(kvtier_bin())
        .arg("serve")
        .args(["--socket", socket.to_str().unwrap()])
        .args([
            "--arena-bytes",
            "4194304",
            "--pool",
            "mooncake",
            "--mooncake-master",
            &master,
        ]);
    for kv in [
        "lock_arena=false",
        "prefault=false",
        "events_endpoint=",
        "events_replay_endpoint=",
        "pool_events_endpoint=",
        "mooncake.global_segment_bytes=1048576",
    ] {
        cmd.args(["--set", kv]);
    }
    let admin = format!("admin_socket={}", dir.join(format!("{name}.admin.sock")).display());
    cmd.args(["--set", &admin])
        .args(args)
        .env("RUST_LOG", "info")
        .current_dir(cwd)
        .stdin(Stdio::piped())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap());
    let mut child = cmd.spawn().unwrap();
    let gate = child.stdin.take().unwrap();
    (
        Serve {
            child: Some(child),
            socket,
            out,
            err,
        },
        gate,
    )
}

fn as_nobody(script: &str, cwd: &Path) {
    let out = Command::new("sh")
        .args(["-c", script])
        .current_dir(cwd)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Waits for `done` with a deadline; panics with the daemon's log after it.
fn wait_for(d: &Serve, what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(60), "{what}: {}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fake interpreter the test owns (root, 0755, in a 0755 directory): it records its
/// arguments, then exits, as a helper that cannot start.
fn recording_python(dir: &Path) -> (PathBuf, PathBuf) {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).unwrap();
    chmod(&bin, 0o755);
    let args = dir.join("helper-args");
    let py = bin.join("python3");
    std::fs::write(&py, format!("#!/bin/sh\necho \"$@\" >> {}\nexit 3\n", args.display())).unwrap();
    chmod(&py, 0o755);
    (py, args)
}

#[test]
fn a_run_dir_planted_under_the_daemons_predictable_name_is_never_used() {
    if !require("root", "plants a run directory as uid 65534") {
        return;
    }
    let dir = tempdir();
    let (py, args) = recording_python(dir.path());
    let set_py = format!("mooncake.python={:?}", py.display().to_string());
    let (d, mut gate) = gated_serve(dir.path(), "m", &["--set", &set_py], dir.path());
    let pid = d.pid();
    // Mallory's directory under the name the daemon's pid gives, world-writable, with her
    // own "helper script" in it.
    let planted = PathBuf::from(format!("/dev/shm/kvtier-mooncake-{pid}-0"));
    let _ = std::fs::remove_dir_all(&planted);
    as_nobody(
        &format!(
            "mkdir -m 777 {p} && printf 'mallory' > {p}/kvtier_mooncake_helper.py && chmod 666 {p}/kvtier_mooncake_helper.py",
            p = planted.display()
        ),
        dir.path(),
    );
    writeln!(gate).unwrap();
    // The pool, and so the helper, starts with the first engine.
    let d = d.ready();
    let _engine = d.client("m", small_spec()).unwrap();
    wait_for(&d, "the helper was never launched", || {
        std::fs::read_to_string(&args).is_ok_and(|a| a.contains("--socket"))
    });
    let launched = std::fs::read_to_string(&args).unwrap();
    let word_after = |flag: &str| {
        let mut w = launched.split_whitespace();
        w.by_ref().find(|x| *x == flag);
        PathBuf::from(w.next().unwrap_or_default())
    };
    let run_dir = word_after("--socket").parent().unwrap().to_owned();
    let script = PathBuf::from(launched.split_whitespace().next().unwrap());
    let planted_files: Vec<_> = std::fs::read_dir(&planted)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let mallorys = std::fs::read_to_string(planted.join("kvtier_mooncake_helper.py")).unwrap();
    drop(_engine);
    let mut d = d;
    d.stop(libc::SIGTERM);
    let _ = std::fs::remove_dir_all(&planted);
    assert!(
        !run_dir.starts_with(&planted),
        "the helper ran in {}",
        run_dir.display()
    );
    assert!(script.starts_with(&run_dir), "{launched}");
    assert_eq!(planted_files.len(), 1, "nothing was created in the planted directory");
    assert_eq!(mallorys, "mallory", "the planted file was not written to");
    let md = std::fs::symlink_metadata(run_dir.parent().unwrap()).unwrap();
    assert_eq!(
        (md.uid(), md.mode() & 0o7777),
        (0, 0o700),
        "the per-user parent is private"
    );
}

#[test]
fn a_python_planted_in_the_working_directory_never_runs() {
    if !require("root", "plants an interpreter as uid 65534") {
        return;
    }
    let dir = tempdir();
    // A shared working directory, as /tmp is: sticky and world-writable.
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    chmod(&shared, 0o1777);
    let marker = shared.join("mallory-ran");
    as_nobody(
        &format!(
            "mkdir -p .venv/bin && printf '#!/bin/sh\\ntouch {}\\n' > .venv/bin/python3 && chmod 755 .venv/bin/python3",
            marker.display()
        ),
        &shared,
    );
    // The default interpreter: whatever happens, the helper's launch is logged.
    let (d, mut gate) = gated_serve(dir.path(), "w", &[], &shared);
    writeln!(gate).unwrap();
    let d = d.ready();
    let _engine = d.client("w", small_spec()).unwrap();
    wait_for(&d, "the helper was never launched", || {
        marker.exists() || d.log().contains("mooncake helper")
    });
    assert!(
        !marker.exists(),
        "the daemon ran the planted .venv/bin/python3: {}",
        d.log()
    );
    drop(d);

    // Named explicitly as a relative path: refused at start, naming the key.
    let (d, mut gate) = gated_serve(
        dir.path(),
        "r",
        &["--set", "mooncake.python=\".venv/bin/python3\""],
        &shared,
    );
    writeln!(gate).unwrap();
    let (failed, log) = d.refused();
    assert!(
        failed && log.contains("mooncake.python") && log.contains("relative"),
        "{log}"
    );
    assert!(!marker.exists(), "the planted interpreter never ran");
}
