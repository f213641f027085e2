//! `kvtier.sglang.KvtierStorage` inside SGLang 0.5.23's own code on CPU, against a real
//! daemon: SGLang's `StorageBackendFactory` creates it through the dynamic backend, SGLang's
//! `MHATokenToKVPoolHost` is registered as the memory kvtier copies into and out of, and a
//! `batch_set_v1` / `batch_exists` / `batch_get_v1` round trip between two backends checks
//! every element (`python/tests/sglang_storage.py`). A session SGLang names in a batch's
//! `extra_info` reaches the daemon's session table. SGLang's own `HiCacheController` round-
//! trips every host layout (`python/tests/sglang_controller.py`), in the same process as
//! the storage script (`python/tests/sglang_hicache.py`), and in a process of its own that
//! starts with the daemon down.

mod common;
mod pkg_support;

use common::Daemon;
use common::require::engine_python;
use pkg_support::{assert_lines, run_ok, script};

/// Both scripts run in one SGLang process (`python/tests/sglang_hicache.py`: torch and
/// SGLang are imported once, most of either script's cost), each against a daemon of its
/// own, and each script's lines are checked on their own.
///
/// `sglang_storage.py`: engine 1 stores, engine 2 loads every element; bad input is
/// refused and the backend keeps serving; the session SGLang named reaches the daemon.
///
/// `sglang_controller.py` (issue 24 item 4): SGLang's own `HiCacheController` with the
/// dynamic backend, for each host layout KvtierStorage registers (`layer_first`,
/// `page_first` (SGLang 0.5.23's default), `page_first_direct`), MHA and MLA: write back,
/// evict, prefetch, every element equal.
#[test]
fn sglang_hicache_storage_and_controller_round_trip_through_kvtier() {
    let Some(py) = engine_python(
        "sglang",
        &["sglang", "torch"],
        "runs KvtierStorage and SGLang's HiCacheController over kvtier",
    ) else {
        return;
    };
    let (storage_dir, controller_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let admin = storage_dir.path().join("admin.sock");
    let storage = Daemon::start_with(
        storage_dir.path(),
        16 << 20,
        &[&format!("admin_socket={}", admin.display())],
    );
    let controller = Daemon::start_with(controller_dir.path(), 16 << 20, &[]);
    let mut cmd = script(&py, "sglang_hicache.py");
    cmd.arg(&storage.socket).arg(&controller.socket);
    let out = run_ok(cmd, 1200, &|| {
        format!(
            "storage daemon:\n{}\ncontroller daemon:\n{}",
            storage.log_text(),
            controller.log_text()
        )
    });
    assert_lines(
        section(&out, "sglang_storage.py"),
        &[
            "OK engine 1 stored 4 pages; batch_exists counts the leading hits",
            "OK engine 2 loaded 4 pages into its host pool: 3072 elements equal, other pages untouched",
            "OK misaligned indices and unknown config keys refused; the backend keeps serving",
            "OK legacy set/get round trip",
            "OK a batch stored with a session id in extra_info",
            "OK done",
        ],
    );
    // The session SGLang named reached the daemon with the batch's 2 pages, and only it.
    let r = kvtier::cli::client::request(
        &admin,
        "GET",
        "/v1/sessions",
        None,
        Some(std::time::Duration::from_secs(10)),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.body().unwrap()).unwrap();
    let sessions: Vec<(&str, u64)> = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["session_id"].as_str().unwrap(), s["pages"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(sessions, vec![("sg-session", 2)], "{v}");

    // 6 pages of 3 layers x 4 tokens: MHA K and V of 2 heads x 16 (4608 elements), MLA one
    // latent of 24 + 8 (2304 elements).
    let mut want: Vec<String> = Vec::new();
    for (attn, n) in [("mha", 4608), ("mla", 2304)] {
        for layout in ["layer_first", "page_first", "page_first_direct"] {
            want.push(format!(
                "OK {attn} {layout}: wrote back, evicted and prefetched 6 pages, {n} elements equal"
            ));
        }
    }
    want.push("OK layer_first pages loaded into a page_first_direct host pool: 4608 elements equal".into());
    want.push("OK a page_first pool on the layer-first model name is refused".into());
    want.push("OK done".into());
    let want: Vec<&str> = want.iter().map(String::as_str).collect();
    assert_lines(section(&out, "sglang_controller.py"), &want);
}

/// The lines `sglang_hicache.py` printed for `script`: those after its `== script` line,
/// up to the next script's.
fn section<'a>(out: &'a str, script: &str) -> &'a str {
    let head = format!("== {script}\n");
    let from = out.find(&head).unwrap_or_else(|| panic!("no {head:?} in:\n{out}")) + head.len();
    let rest = &out[from..];
    &rest[..rest.find("\n== ").map_or(rest.len(), |e| e + 1)]
}

/// Issue 24 item 3 for SGLang: the daemon is down when SGLang's `HiCacheController`
/// attaches the backend. SGLang starts (one warning), stores nothing and finds no hits
/// (it computes locally); when the daemon appears the backend connects and registers its
/// host pool by itself, and a write-back, eviction and prefetch round-trip every element
/// (`python/tests/sglang_controller.py`, case `down`).
#[test]
fn sglang_hicache_controller_starts_without_the_daemon_and_connects_when_it_appears() {
    let Some(py) = engine_python(
        "sglang",
        &["sglang", "torch"],
        "runs SGLang's HiCacheController over kvtier",
    ) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let mut d = Daemon::start_with(tmp.path(), 16 << 20, &[]);
    // A dead daemon leaves its socket file behind: SGLang starts against a stale socket.
    d.signal(libc::SIGKILL);
    d.wait();
    let mut cmd = script(&py, "sglang_controller.py");
    cmd.arg(&d.socket).arg("down");
    let out = run_answering(cmd, 600, |line| {
        (line == "DAEMON start").then(|| {
            d.restart(16 << 20);
            "ok"
        })
    });
    assert_lines(
        &out,
        &[
            "OK SGLang's controller started with no daemon: one warning, nothing stored, no hits (computed locally)",
            "OK the daemon appeared: the backend connected, wrote back, evicted and prefetched 6 pages, 4608 elements equal",
            "OK done",
        ],
    );
}

/// Runs `cmd` with its stdin and stdout piped, writing `answer(line)` back for each
/// stdout line that has one; returns the stdout. Panics with the output and stderr unless
/// it exits 0 within `secs`.
fn run_answering(
    mut cmd: std::process::Command,
    secs: u64,
    mut answer: impl FnMut(&str) -> Option<&'static str>,
) -> String {
    use std::io::{BufRead, BufReader, Write};
    use std::process::Stdio;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    let err = tempfile::NamedTempFile::new().unwrap();
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(err.reopen().unwrap());
    let mut child = cmd.spawn().expect("spawn the script");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let t = Instant::now();
    let mut out = String::new();
    let fail = |out: &str, why: &str, child: &mut std::process::Child| -> ! {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "{why}\nstdout:\n{out}\nstderr:\n{}",
            std::fs::read_to_string(err.path()).unwrap_or_default()
        )
    };
    loop {
        let left = Duration::from_secs(secs).saturating_sub(t.elapsed());
        match rx.recv_timeout(left.max(Duration::from_millis(1))) {
            Ok(line) => {
                if let Some(a) = answer(&line) {
                    writeln!(stdin, "{a}").unwrap();
                }
                out.push_str(&line);
                out.push('\n');
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => fail(&out, &format!("not done after {secs} s"), &mut child),
        }
    }
    let status = child.wait().unwrap();
    if !status.success() {
        fail(&out, &format!("exit {status:?}"), &mut child);
    }
    out
}
