//! A session the daemon's pressure controller paused has its new requests held in vLLM
//! 0.33's own scheduler by `kvtier.vllm.KvtierConnector` (its `get_num_new_matched_tokens`
//! answers `None`, vLLM's "ask again next step"), bounded by `session_hold_ms`, and
//! scheduled once the daemon resumes the session; the connector hears both on the
//! daemon's session events (`python/tests/vllm_session_hold.py`).

mod common;
mod pkg_support;

use common::Daemon;
use common::require::engine_python;
use pkg_support::{assert_lines, run_ok, script};

#[test]
fn vllm_holds_a_paused_sessions_new_requests_until_the_daemon_resumes_it() {
    let Some(py) = engine_python(
        "vllm",
        &["vllm", "torch", "zmq"],
        "runs KvtierConnector in vLLM's scheduler",
    ) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let admin_set = format!("admin_socket={}", tmp.path().join("admin.sock").display());
    // 100 pages of host (2 objects of 2,048 bytes a page for both layouts the script
    // uses); exclusive tiers, so loading the filler lowers host utilisation.
    let d = Daemon::start_with(
        tmp.path(),
        100 * 2 * 2048,
        &[
            "policy_exclusive=true",
            "tick_ms=50",
            "recover=false",
            "events_endpoint=",
            "events_replay_endpoint=",
            "pool_events_endpoint=",
            "session_events_endpoint=ipc",
            &admin_set,
        ],
    );
    let mut cmd = script(&py, "vllm_session_hold.py");
    cmd.arg(&d.socket)
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_LOGGING_LEVEL", "WARNING");
    let out = run_ok(cmd, 600, &|| d.log_text());
    assert_lines(
        &out,
        &[
            "OK a paused session's new request waits in vLLM's scheduler; another session's is scheduled",
            "OK session_hold_ms bounds the wait: admitted while its session is still paused",
            "OK on resume the held request is scheduled",
            "OK done",
        ],
    );
}
