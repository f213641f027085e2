//! The `libkvtier.so` engines load, for the tests that load it (C++ test engine, ctypes
//! examples, the Python package, the vLLM and SGLang integrations).
//!
//! `cargo test` builds the crate's cdylib with the default `daemon` feature, which is not
//! what engines get: the Python package builds `cargo rustc --profile engine --lib
//! --no-default-features --crate-type cdylib` (python/setup.py). These tests load that
//! build, so what they check is what engines run. The first call runs the same cargo command (a no-op when it
//! is up to date) with the engine-side features this test binary was built with, into the
//! `engine/` folder of the same target directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The cargo features of the engine build: the engine-side ones this test build has.
fn engine_features() -> Vec<&'static str> {
    let mut f = Vec::new();
    if cfg!(feature = "cuda") {
        f.push("cuda");
    }
    if cfg!(feature = "mooncake-c") {
        f.push("mooncake-c");
    }
    f
}

/// The target directory cargo is building this test run into (`<target>/release/kvtier`).
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_kvtier"))
        .parent()
        .and_then(Path::parent)
        .expect("the kvtier binary sits in <target>/<profile>/")
        .to_owned()
}

/// Builds (once per test process) and returns `<target>/engine/libkvtier.so`.
pub fn engine_cdylib() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(build).clone()
}

fn build() -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let target = target_dir();
    let mut cmd = Command::new(cargo);
    cmd.args(["rustc", "--profile", "engine", "--lib", "--no-default-features"])
        .args(["--crate-type", "cdylib"])
        .arg("--manifest-path")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target);
    let features = engine_features();
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    let o = cmd.output().expect("run cargo for the engine library");
    assert!(
        o.status.success(),
        "building the engine library failed ({cmd:?}):\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let so = target.join("engine/libkvtier.so");
    assert!(so.is_file(), "cargo finished but {} does not exist", so.display());
    so
}
