//! `kvtier.vllm.KvtierConnector` inside vLLM 0.33's own code on CPU, against a real daemon:
//! vLLM's `KVConnectorFactory` builds it from a `KVTransferConfig` naming the module path,
//! vLLM's v1 `Scheduler` runs a request whose blocks the connector stores, and two fresh
//! vLLM instances (asynchronous and synchronous load) get `num_computed_tokens` from
//! kvtier's hit for a request sharing that prefix, with the loaded KV checked element for
//! element (`python/tests/vllm_connector.py`).

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
    let d = Daemon::start(tmp.path(), 16 << 20);
    let mut cmd = script(&py, "vllm_connector.py");
    cmd.arg(&d.socket)
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_LOGGING_LEVEL", "WARNING");
    let out = run_ok(cmd, 600, &|| d.log_text());
    assert_lines(
        &out,
        &[
            "OK engine 1 stored 3 blocks; BlockStored event with the request's hashes and session",
            "OK engine 2 async load: num_computed_tokens 48, 6144 elements checked",
            "OK engine 3 sync load: num_computed_tokens 48, 6144 elements checked",
            "OK done",
        ],
    );
}
