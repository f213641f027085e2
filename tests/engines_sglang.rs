//! `kvtier.sglang.KvtierStorage` inside SGLang 0.5.23's own code on CPU, against a real
//! daemon: SGLang's `StorageBackendFactory` creates it through the dynamic backend, SGLang's
//! `MHATokenToKVPoolHost` is registered as the memory kvtier copies into and out of, and a
//! `batch_set_v1` / `batch_exists` / `batch_get_v1` round trip between two backends checks
//! every element (`python/tests/sglang_storage.py`).

mod common;
mod pkg_support;

use common::Daemon;
use common::require::engine_python;
use pkg_support::{assert_lines, run_ok, script};

#[test]
fn sglang_hicache_round_trips_through_kvtier_storage() {
    let Some(py) = engine_python("sglang", &["sglang", "torch"], "runs KvtierStorage in SGLang's HiCache") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 16 << 20);
    let mut cmd = script(&py, "sglang_storage.py");
    cmd.arg(&d.socket);
    let out = run_ok(cmd, 600, &|| d.log_text());
    assert_lines(
        &out,
        &[
            "OK engine 1 stored 4 pages; batch_exists counts the leading hits",
            "OK engine 2 loaded 4 pages into its host pool: 3072 elements equal, other pages untouched",
            "OK misaligned indices and unknown config keys refused; the backend keeps serving",
            "OK legacy set/get round trip",
            "OK done",
        ],
    );
}
