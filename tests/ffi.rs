//! FFI end to end: the C++ test engine (cxx bridge) as two TP ranks, with byte-exact checks
//! made again from Rust on what it stored, and the Python bad-input example (the C ABI
//! through the kvtier package's ctypes declarations), each against a real daemon.

mod common;
mod ffi_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::Daemon;
use common::require::{python, require};
use ffi_support::{build_engine, run_with_deadline, seed_of};
use kvtier::layout::LayoutSpec;
use kvtier::page::{Namespace, PageHash};
use kvtier::protocol::{Identity, LoadWait};
use kvtier::tier::device::EmulatedDevice;

/// Loads pages as a fresh Rust rank and checks they hold the pattern of `seed_of`.
fn verify_from_rust(d: &Daemon, instance: &str, model: &str, spec: LayoutSpec, tp: u16, tps: u16, ids: &[u64]) {
    let id = Identity {
        instance: instance.into(),
        namespace: Namespace::model(model),
        tp_rank: tp,
        tp_size: tps,
        pp_rank: 0,
        pp_size: 1,
        dp_rank: 0,
    };
    let c = d.client(id, spec.clone());
    let dev = Arc::new(EmulatedDevice::new(&spec.build().unwrap(), 0, ids.len() as u32));
    c.register_device(dev.clone()).unwrap();
    let hashes: Vec<PageHash> = ids.iter().map(|&h| PageHash::from_u64(h)).collect();
    let slots: Vec<u32> = (0..ids.len() as u32).collect();
    assert_eq!(c.load(&hashes, &slots, LoadWait::BestEffort).unwrap(), ids.len());
    for (i, &h) in ids.iter().enumerate() {
        assert!(
            dev.page_matches(i as u32, seed_of(h, tp)).unwrap(),
            "rank {tp} page {h}"
        );
        assert!(!dev.page_matches(i as u32, seed_of(h, tp ^ 1)).unwrap());
    }
}

/// Runs the C++ test engine as TP ranks 0 and 1 of one instance (with `extra` arguments)
/// and checks each rank's report; then loads every page again as a fresh Rust rank with an
/// emulated region, which must find `fill_page`'s pattern.
fn run_cpp_ranks(exe: &Path, d: &Daemon, first: u64, pages: u32, extra: &[&str]) -> Vec<String> {
    let ranks: Vec<_> = (0..2u16)
        .map(|tp| {
            let mut cmd = Command::new(exe);
            cmd.arg(&d.socket)
                .args([tp.to_string(), "2".into(), first.to_string(), pages.to_string()])
                .args(extra);
            std::thread::spawn(move || run_with_deadline(cmd, Duration::from_secs(60)))
        })
        .collect();
    let mut outs = Vec::new();
    for (tp, r) in ranks.into_iter().enumerate() {
        let o = r.join().unwrap();
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "rank {tp}: {out}\n{}\ndaemon log:\n{}",
            String::from_utf8_lossy(&o.stderr),
            d.log_text()
        );
        assert!(out.contains(&format!("OK rank={tp} loaded={pages}")), "{out}");
        assert_eq!(out.matches("hint kind=").count(), 5, "{out}");
        assert!(out.contains("advice ok"), "the advice stream through the bridge: {out}");
        outs.push(out);
    }
    let ids: Vec<u64> = (first..first + pages as u64).collect();
    let spec = LayoutSpec::mha(4, 4, 16, 2, 4).with_parallel(2, 1);
    for tp in 0..2 {
        verify_from_rust(d, "cpp-engine", "cpp-model", spec.clone(), tp, 2, &ids);
    }
    outs
}

/// The C++ test engine, compiled once for this test binary (its two tests run at once),
/// into cargo's temporary folder for integration tests, so nothing is left elsewhere.
fn cpp_engine() -> &'static Path {
    static ENGINE: OnceLock<PathBuf> = OnceLock::new();
    ENGINE.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ffi-cpp-engine");
        std::fs::create_dir_all(&dir).unwrap();
        build_engine(&dir)
    })
}

#[test]
fn cpp_engine_runs_as_two_tp_ranks() {
    if !require("cxx", "compiles the C++ test engine") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 16 << 20);
    run_cpp_ranks(cpp_engine(), &d, 0x5000, 12, &[]);
}

/// The bridge's `register_host_tensor_runs`: each C++ rank's KV is its own host tensors
/// with the heads outside the blocks (vLLM's `LHBNC`), 2 heads a rank, so each page of a
/// (part, layer) is 2 runs a whole tensor of blocks apart. The C++ side writes and checks
/// the bytes at that layout's addresses itself; the Rust rank that loads the pages after it
/// has one contiguous run a page, so a run addressed in the wrong place or order shows as
/// a pattern mismatch on one side or the other.
#[test]
fn cpp_engine_registers_head_runs_in_host_memory() {
    if !require("cxx", "compiles the C++ test engine") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 16 << 20);
    for out in run_cpp_ranks(cpp_engine(), &d, 0x9000, 12, &["host-runs"]) {
        assert!(
            out.contains("host runs=2"),
            "the C++ rank registered 2 runs a page: {out}"
        );
    }
}

/// Runs one script of `examples/python` against the daemon; returns its stdout.
fn run_python(python: &Path, d: &Daemon, script: &str) -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = Command::new(python);
    cmd.arg(repo.join("examples/python").join(script))
        .arg("--socket")
        .arg(&d.socket)
        .arg("--lib")
        .arg(ffi_support::cdylib());
    let o = run_with_deadline(cmd, Duration::from_secs(60));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{script}: {out}\n{}\ndaemon log:\n{}",
        String::from_utf8_lossy(&o.stderr),
        d.log_text()
    );
    out
}

#[test]
fn python_bad_input_gets_codes_and_survives() {
    let Some(py) = python(&[], "runs examples/python/ffi_bad_input.py") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 16 << 20);
    let out = run_python(&py, &d, "ffi_bad_input.py");
    for case in [
        "null-handle -1",
        "null-options -1",
        "wrong-struct-size -2",
        "closed-daemon -5",
        "zero-length-batch -3",
        "null-hashes -1",
        "bad-hash-length -2",
        "mismatched-lengths -4",
        "bad-slot -9",
        "wrong-object-size -9",
        "tensors-null -1",
        "tensors-wrong-count -4",
        "tensors-zero-stride -2",
        "double-close -14",
        "use-after-close -14",
    ] {
        assert!(out.contains(&format!("case {case}")), "{case}: {out}");
    }
    assert!(out.contains("OK bad-input"), "{out}");
}
