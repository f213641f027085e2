//! Helpers for the tests that run the `kvtier` Python package: the package made importable
//! from the source tree without installing it (PYTHONPATH at `python/`, `KVTIER_LIB` at the
//! engine build of `libkvtier.so`), and a script run with a deadline whose `OK` lines the
//! test checks.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The `libkvtier.so` engines load: the engine build the Python package ships (see
/// `common::engine_lib`).
pub fn cdylib() -> PathBuf {
    crate::common::engine_lib::engine_cdylib()
}

/// What a finished child left: its status (`None` when the deadline killed it) and output.
pub struct Ran {
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` with its output in files (an engine's logs would fill a pipe and stall it),
/// killing it when `limit` passes.
pub fn run_with_deadline(mut cmd: Command, limit: Duration) -> Ran {
    let dir = tempfile::tempdir().expect("temp dir");
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("spawn");
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| String::from_utf8_lossy(&std::fs::read(p).unwrap_or_default()).into_owned();
    Ran {
        status,
        stdout: read(&out),
        stderr: read(&err),
    }
}

/// A file of the repository.
pub fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// `python` running `python/tests/<script>` with the source package importable.
pub fn script(python: &Path, script: &str) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg(repo("python/tests").join(script))
        .env("PYTHONPATH", repo("python"))
        .env("KVTIER_LIB", cdylib())
        .env("PYTHONUNBUFFERED", "1");
    cmd
}

/// Runs `cmd` for at most `secs`; panics with its output (and `context`) unless it exits
/// 0. Returns stdout.
pub fn run_ok(cmd: Command, secs: u64, context: &dyn Fn() -> String) -> String {
    let o = run_with_deadline(cmd, Duration::from_secs(secs));
    assert!(
        o.status.is_some_and(|s| s.success()),
        "exit {:?} (None: killed after {secs} s)\nstdout:\n{}\nstderr:\n{}\n{}",
        o.status,
        o.stdout,
        o.stderr,
        context()
    );
    o.stdout
}

/// Asserts every line of `want` appears in `out` as its own line's start.
pub fn assert_lines(out: &str, want: &[&str]) {
    for w in want {
        assert!(out.lines().any(|l| l.starts_with(w)), "missing {w:?} in:\n{out}");
    }
}
