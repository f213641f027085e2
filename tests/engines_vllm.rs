//! `kvtier.vllm.KvtierConnector` inside vLLM 0.33's own code on CPU, against a real daemon:
//! vLLM's `KVConnectorFactory` builds it from a `KVTransferConfig` naming the module path,
//! vLLM's v1 `Scheduler` runs a request whose blocks the connector stores, and two fresh
//! vLLM instances (asynchronous and synchronous load) get `num_computed_tokens` from
//! kvtier's hit for a request sharing that prefix, with the loaded KV checked element for
//! element (`python/tests/vllm_connector.py`). The stores carry token ids (the daemon's
//! KV events, decoded by vLLM, hold them), a Dynamo KvHint envelope on vLLM's
//! `Request.kv_hints` reaches the daemon (kv.fetch@1.0 accepted, @2.0 ignored), and a
//! finished request of a session reaches the daemon's request traces. A prompt of exactly
//! the stored blocks is a whole-prompt hit (every block loads, vLLM computes the last
//! token: `num_computed_tokens` 47 of 48), or with `whole_prompt_hit` off a hit one block
//! shorter (32).

mod common;
mod pkg_support;

use common::Daemon;
use common::require::engine_python;
use pkg_support::{assert_lines, run_ok, script};

#[test]
fn vllm_scheduler_stores_and_loads_through_kvtier_connector() {
    let Some(py) = engine_python("vllm", &["vllm", "torch"], "runs KvtierConnector in vLLM's scheduler") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let admin = tmp.path().join("admin.sock");
    let admin_set = format!("admin_socket={}", admin.display());
    let traces = tmp.path().join("requests.jsonl");
    let traces_set = format!("request_trace_path={}", traces.display());
    // The KV event publishers on ipc endpoints in the daemon's directory (tests run side by
    // side), the replay socket included: the script reads the daemon's events through it.
    let d = Daemon::start_with(
        tmp.path(),
        16 << 20,
        &[
            "events_endpoint=ipc",
            "events_replay_endpoint=ipc",
            "pool_events_endpoint=",
            &admin_set,
            &traces_set,
        ],
    );
    let replay = tmp.path().join("kv-events-replay.ipc");
    let t = std::time::Instant::now();
    while !replay.exists() || !admin.exists() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the daemon's sockets did not appear"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let mut cmd = script(&py, "vllm_connector.py");
    cmd.arg(&d.socket)
        .arg(format!("ipc://{}", replay.display()))
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_LOGGING_LEVEL", "WARNING");
    let out = run_ok(cmd, 600, &|| d.log_text());
    assert_lines(
        &out,
        &[
            "OK engine 1 stored 3 blocks; BlockStored event with the request's hashes and session",
            "OK daemon events: 48 token ids of 3 blocks, decoded by vLLM",
            "OK kv_hints: kv.fetch@1.0 accepted for 3 pages, kv.fetch@2.0 ignored, unknown page ignored",
            "OK engine 2 async load: num_computed_tokens 48, 6144 elements checked",
            "OK engine 3 sync load: num_computed_tokens 48, 6144 elements checked",
            "OK vllm-4 prompt of 3 whole blocks: num_computed_tokens 47, 3 blocks loaded, 6144 elements checked",
            "OK vllm-5 prompt of 3 whole blocks: num_computed_tokens 32, 2 blocks loaded, 6144 elements checked",
            "OK whole_prompt_hit takes only true or false",
            "OK done",
        ],
    );
    // request_finished reported A's end to its session: one content-free trace line with its
    // token counts and prompt pages (B and B3 carry no session, so they add none).
    let want: serde_json::Value = out
        .lines()
        .find_map(|l| l.strip_prefix("A-TRACE "))
        .map(|j| serde_json::from_str(j).unwrap())
        .expect("the script prints A's trace");
    let text = std::fs::read_to_string(&traces).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 1, "{text}");
    for key in ["session_id", "input_length", "output_length", "hash_ids"] {
        assert_eq!(lines[0][key], want[key], "{key} in {text}");
    }
    assert_eq!(lines[0]["hash_ids"].as_array().map(Vec::len), Some(3), "{text}");
}
