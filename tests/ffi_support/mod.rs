//! Helpers for the FFI integration tests: compile the C++ test engine against the bridge,
//! find the engine build of `libkvtier.so`, run child processes with a deadline.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The `libkvtier.so` engines load: the engine build, not the cdylib `cargo test` built
/// beside the binary (see `common::engine_lib`).
pub fn cdylib() -> PathBuf {
    crate::common::engine_lib::engine_cdylib()
}

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Compiles `cpp/test_engine.cpp` with the bridge's generated C++ and cxx's runtime,
/// linked to `libkvtier.so`.
pub fn build_engine(dir: &Path) -> PathBuf {
    let out = Path::new(env!("OUT_DIR")).join("cxxbridge");
    let cxx_header = PathBuf::from(env!("KVTIER_CXX_HEADER"));
    let cxx_src = cxx_header
        .parent()
        .and_then(Path::parent)
        .expect("cxx source tree")
        .join("src/cxx.cc");
    let so = cdylib();
    let lib = so.parent().expect("library directory").to_owned();
    let exe = dir.join("test_engine");
    let mut cmd = Command::new(crate::common::require::tool("CXX", "g++"));
    cmd.args(["-std=c++17", "-O1", "-Wall", "-Werror"])
        .arg("-I")
        .arg(repo("include"))
        .arg("-I")
        .arg(out.join("include"))
        .arg(repo("cpp/test_engine.cpp"))
        .arg(repo("cpp/client.cc"))
        .arg(out.join("sources/kvtier/src/ffi/cxx.rs.cc"))
        .arg(&cxx_src)
        .arg("-L")
        .arg(&lib)
        // DT_RPATH, searched before LD_LIBRARY_PATH: `cargo test` puts its own deps/ (with
        // the daemon build's libkvtier.so) there, and the engine build is the one to test.
        .arg("-Wl,--disable-new-dtags")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lkvtier", "-lpthread", "-ldl", "-o"])
        .arg(&exe);
    let o = cmd.output().expect("run the C++ compiler");
    assert!(
        o.status.success(),
        "C++ build failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    exe
}

/// Waits for a child with a deadline; kills it when the deadline passes.
pub fn run_with_deadline(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let t = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// The seed the C++ engine and the Python examples write for a page (u64 block hash).
pub fn seed_of(hash: u64, tp_rank: u16) -> u64 {
    hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((tp_rank as u64) << 8)
}
