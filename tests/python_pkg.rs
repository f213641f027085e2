//! The `kvtier` Python package against a real daemon: its low-level client over the C ABI
//! (host tensors registered and filled byte for byte, a missing daemon named by its
//! socket, wrong layouts, closed handles used again and closed twice, none of them a
//! crash), the advice stream's pause and resume of a session, and `pip install ./python`
//! into a fresh venv giving `kvtier.__version__`.

mod common;
mod pkg_support;

use std::process::Command;

use common::Daemon;
use common::require::{engine_python, python};
use pkg_support::{assert_lines, cdylib, repo, run_ok, script};

#[test]
fn package_client_round_trips_and_refuses_bad_input() {
    let Some(py) = python(&[], "runs python/tests/pkg_client.py") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 16 << 20);
    let mut cmd = script(&py, "pkg_client.py");
    cmd.arg(&d.socket);
    let out = run_ok(cmd, 120, &|| d.log_text());
    assert_lines(
        &out,
        &[
            "OK unavailable names the socket",
            "OK a daemon of another uid is untrusted; the default socket is the library's",
            "OK stored 4 pages from host tensors",
            "OK loaded 4 pages into host tensors byte for byte; wrong layouts refused",
            "OK token ids, sessions, request ends and KvHint envelopes through the client",
            "OK closed handles are refused, close twice is harmless",
            "OK version 0.1.0",
        ],
    );
}

#[test]
fn package_client_hears_pause_and_resume_in_its_advice_stream() {
    let Some(py) = python(&[], "runs python/tests/pkg_advice.py") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // 100 pages of host (2 objects of 2,048 bytes a page); exclusive tiers, so the
    // script's loads lower host utilisation.
    let d = Daemon::start_with(
        tmp.path(),
        100 * 2 * 2048,
        &["policy_exclusive=true", "tick_ms=50", "recover=false"],
    );
    let mut cmd = script(&py, "pkg_advice.py");
    cmd.arg(&d.socket);
    let out = run_ok(cmd, 120, &|| d.log_text());
    assert_lines(
        &out,
        &[
            "OK pause advice for the acting session at the pause threshold",
            "OK resume advice and its pages ready to load at the resume threshold",
        ],
    );
}

#[test]
fn package_client_registers_torch_tensors_and_checks_their_layout() {
    // The test venv has no torch; the vLLM venv does.
    let Some(py) = engine_python("vllm", &["torch"], "runs pkg_client.py's torch part") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 16 << 20);
    let mut cmd = script(&py, "pkg_client.py");
    cmd.arg(&d.socket);
    let out = run_ok(cmd, 300, &|| d.log_text());
    assert_lines(
        &out,
        &[
            "OK torch tensors registered and loaded; wrong layout refused",
            "OK closed handles are refused, close twice is harmless",
        ],
    );
}

#[test]
fn pip_install_into_a_fresh_venv_imports_with_no_environment() {
    let Some(py) = python(&[], "creates a venv and pip-installs ./python") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let venv = tmp.path().join("venv");
    let o = Command::new(&py).args(["-m", "venv"]).arg(&venv).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let vpy = venv.join("bin/python3");
    // The build hook runs cargo in a normal install; here the library cargo just built for
    // this test run is handed to it, so the test does not start a second cargo build.
    let mut pip = Command::new(&vpy);
    pip.args(["-m", "pip", "install", "--disable-pip-version-check", "--no-cache-dir"])
        .arg(repo("python"))
        .env("KVTIER_PREBUILT_LIB", cdylib())
        .env_remove("KVTIER_LIB")
        .env_remove("PYTHONPATH");
    run_ok(pip, 300, &String::new);
    // Outside the checkout, with no kvtier variables: the packaged library is the one used.
    let mut check = Command::new(&vpy);
    check
        .args([
            "-c",
            "import kvtier; print(kvtier.__version__); print(kvtier.library_path()); \
             import kvtier._capi as c; print(c.error_name(-14))",
        ])
        .current_dir(tmp.path())
        .env_remove("KVTIER_LIB")
        .env_remove("PYTHONPATH");
    let out = run_ok(check, 60, &String::new);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"0.1.0"), "{out}");
    assert!(
        lines
            .get(1)
            .is_some_and(|l| l.starts_with(venv.to_str().unwrap()) && l.ends_with("kvtier/libkvtier.so")),
        "{out}"
    );
    assert_eq!(lines.get(2), Some(&"closed"), "{out}");
}
