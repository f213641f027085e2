//! `kvtier.sglang.KvtierStorage` inside SGLang 0.5.23's own code on CPU, against a real
//! daemon: SGLang's `StorageBackendFactory` creates it through the dynamic backend, SGLang's
//! `MHATokenToKVPoolHost` is registered as the memory kvtier copies into and out of, and a
//! `batch_set_v1` / `batch_exists` / `batch_get_v1` round trip between two backends checks
//! every element (`python/tests/sglang_storage.py`). A session SGLang names in a batch's
//! `extra_info` reaches the daemon's session table.

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
    let admin = tmp.path().join("admin.sock");
    let d = Daemon::start_with(tmp.path(), 16 << 20, &[&format!("admin_socket={}", admin.display())]);
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
}

/// Issue 24 item 4: SGLang's own `HiCacheController` with the dynamic backend, for each
/// host layout KvtierStorage registers (`layer_first`, `page_first` (SGLang 0.5.23's
/// default), `page_first_direct`), MHA and MLA: write back, evict, prefetch, every element
/// equal (`python/tests/sglang_controller.py`).
#[test]
fn sglang_hicache_controller_round_trips_every_host_layout() {
    let Some(py) = engine_python(
        "sglang",
        &["sglang", "torch"],
        "runs SGLang's HiCacheController over kvtier",
    ) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(tmp.path(), 16 << 20, &[]);
    let mut cmd = script(&py, "sglang_controller.py");
    cmd.arg(&d.socket);
    let out = run_ok(cmd, 600, &|| d.log_text());
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
    assert_lines(&out, &want);
}
