//! `kvtier serve --pool mooncake` with `mooncake.client = "c-abi"`: the daemon loads a
//! `libmooncake_store.so` through upstream's C ABI (`store_c.h`) in its own process. The
//! library here is the stub of `tests/data/mooncake_store_stub.c` (upstream's ABI, objects
//! in the daemon's memory), built by the test with the system C compiler.
#![cfg(feature = "mooncake-c")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::rank::RankProc;
use common::require::{require, tool};
use common::{admin_json, complete_prefix, hashes, identity, kvtier_bin, spec, squeeze_host, until};
use kvtier::client::{Client, ClientConfig};
use kvtier::hints::{Hint, HintOutcome, HintTarget};

/// Builds the stub library (`defines` as `-D` flags) into `dir`.
fn stub(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_store_stub.c");
    let out = dir.join(name);
    let o = Command::new(tool("CC", "cc"))
        .args(["-shared", "-fPIC", "-O1", "-pthread", "-o"])
        .arg(&out)
        .arg(src)
        .args(defines.iter().map(|d| format!("-D{d}")))
        .output()
        .unwrap();
    assert!(o.status.success(), "stub build: {}", String::from_utf8_lossy(&o.stderr));
    out
}

/// `kvtier serve` with the C ABI client and `library`, its logs in `dir`.
fn serve(dir: &Path, library: &Path) -> Command {
    let mut cmd = Command::new(kvtier_bin());
    cmd.args(["serve", "--socket"])
        .arg(dir.join("kvtier.sock"))
        .arg("--arena-path")
        .arg(dir.join("arena"))
        .args([
            "--arena-bytes",
            "4194304",
            "--pool",
            "mooncake",
            "--mooncake-master",
            "127.0.0.1:1",
        ]);
    let key = dir.join("cluster.key");
    std::fs::write(&key, [9u8; 32]).unwrap();
    std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    for s in [
        "lock_arena=false".to_owned(),
        "prefault=false".to_owned(),
        "recover=false".to_owned(),
        "slot_bytes=4096".to_owned(),
        "events_endpoint=".to_owned(),
        "events_replay_endpoint=".to_owned(),
        "pool_events_endpoint=".to_owned(),
        "mooncake.client=c-abi".to_owned(),
        format!("mooncake.library={:?}", library.display().to_string()),
        format!("mooncake.integrity_key_file={:?}", key.display().to_string()),
        format!("admin_socket={:?}", dir.join("admin.sock").display().to_string()),
    ] {
        cmd.args(["--set", &s]);
    }
    cmd.env("RUST_LOG", "info")
        .env("KVTIER_STUB_LOG", dir.join("stub.log"))
        .stdout(Stdio::null());
    cmd
}

struct Serve(std::process::Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Lines of the stub's call log that start with `op`.
fn calls(dir: &Path, op: &str) -> usize {
    let log = std::fs::read_to_string(dir.join("stub.log")).unwrap_or_default();
    log.lines().filter(|l| l.starts_with(op)).count()
}

#[test]
fn pages_stored_shared_evicted_from_host_load_back_bit_identical_through_the_c_abi() {
    if !require("cc", "builds the stub Mooncake library") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = stub(dir.path(), "libmooncake_store.so", &[]);
    let _d = Serve(
        serve(dir.path(), &lib)
            .stderr(std::fs::File::create(dir.path().join("daemon.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let (sock, admin_sock) = (dir.path().join("kvtier.sock"), dir.path().join("admin.sock"));
    let log = || std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default();
    until("the daemon serves", Duration::from_secs(20), || {
        common::serving(&sock) && admin_sock.exists()
    });
    let (_, status) = admin_json(&admin_sock, "GET", "/v1/status", None);
    assert!(
        status.to_string().contains("mooncake-c"),
        "status names the C ABI backend: {status}"
    );

    // An engine rank stores 8 pages; a Share writes them to the store.
    let hs = hashes(7000, 8);
    let mut rank = RankProc::spawn(&sock, "e", 0, 0, 1, 1);
    assert_eq!(rank.cmd("ready"), "ready");
    let stored = rank.nums("store 7000 8");
    assert_eq!(stored[0], 8, "{stored:?}");
    let ctl = Client::connect(
        ClientConfig::new(&sock, identity("ctl", 0, 0, 1, 1), spec(1, 1)).with_timeout(Duration::from_secs(10)),
    )
    .unwrap();
    let share = Hint::Share {
        target: HintTarget::Prefix(hs.clone()),
    };
    until("the pages are complete in the pool", Duration::from_secs(30), || {
        matches!(ctl.hint(share.clone()), Ok(HintOutcome::Accepted { .. }))
            && complete_prefix(&admin_sock, &hs, "pool") == 8
    });
    let puts = calls(dir.path(), "put");
    assert!(puts >= 1, "the stub library saw no put; log:\n{}", log());

    // Host is squeezed until the pages leave it: the pool holds their only copy.
    squeeze_host(&admin_sock, &hs, Duration::from_secs(30));
    assert_eq!(complete_prefix(&admin_sock, &hs, "pool"), 8);

    // A prefetch brings every page back from the store to host, and a load to the
    // engine, each byte the rank wrote.
    let gets = calls(dir.path(), "get");
    let prefetch = Hint::Prefetch {
        target: HintTarget::Pages(hs.clone()),
        to: kvtier::TierKind::Host,
        deadline_ms: None,
    };
    until("the pages are back on host", Duration::from_secs(30), || {
        matches!(ctl.hint(prefetch.clone()), Ok(HintOutcome::Accepted { .. }))
            && complete_prefix(&admin_sock, &hs, "host") == 8
    });
    let loaded = rank.nums("load 7000 8");
    assert_eq!(
        loaded,
        vec![8, 8],
        "pages loaded, of which bit-identical; log:\n{}",
        log()
    );
    assert!(calls(dir.path(), "get") > gets, "the load read through the C library");
    // Every object carried the MAC and none failed it.
    let (_, status) = admin_json(&admin_sock, "GET", "/v1/status", None);
    let text = status.to_string();
    assert!(text.contains("\"integrity\""), "{text}");
    rank.exit();
}

/// Starts `kvtier serve` expecting it to refuse; returns its stderr.
fn refused(dir: &Path, library: &Path) -> String {
    let mut child = serve(dir, library).stderr(Stdio::piped()).spawn().unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("kvtier serve kept running with library {}", library.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "{err}");
    err
}

#[test]
fn a_missing_library_fails_the_start_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere/libmooncake_store.so");
    let err = refused(dir.path(), &missing);
    assert!(
        err.contains("c-abi") && err.contains("no such file") && err.contains(&missing.display().to_string()),
        "{err}"
    );
}

#[test]
fn a_library_built_for_another_abi_fails_the_start_naming_the_missing_function() {
    if !require("cc", "builds the stub Mooncake library") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = stub(dir.path(), "libwrong.so", &["KVTIER_STUB_WRONG_ABI"]);
    let err = refused(dir.path(), &lib);
    assert!(
        err.contains("c-abi") && err.contains("mooncake_store_remove_all"),
        "{err}"
    );
}
