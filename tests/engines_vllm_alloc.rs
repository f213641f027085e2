//! `kvtier.vllm.KvtierConnector` on the KV tensors vLLM 0.33's own allocator makes (the
//! GPU build's Python code, on CPU), against a real daemon (`python/tests/vllm_allocator.py`
//! says how): for every attention backend of vLLM's registry whose module imports without
//! a GPU, and every KV cache layout it declares, `get_kv_cache_configs` and the model
//! runner's `allocate_kv_cache` give the tensors the connector registers (or, for heads
//! outside blocks, refuses with a `LayoutError` naming the layout); per distinct geometry
//! (packed NHD/HND, layer- and block-outermost, MHA and MLA) a store and a load through
//! vLLM's Scheduler and the worker side, in the model runner's call order, give blocks
//! bit-identical to the stored ones and no stray bytes elsewhere in the buffer.

mod common;
mod pkg_support;

use common::Daemon;
use common::require::engine_python;
use pkg_support::{assert_lines, run_ok, script};

#[test]
fn vllm_allocator_tensors_register_and_round_trip() {
    let Some(py) = engine_python(
        "vllm",
        &["vllm", "torch"],
        "registers the KV tensors of vLLM's own allocator with KvtierConnector",
    ) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // Every backend's objects fit one slot (the largest: 73,728 bytes, MLA blocks of 256
    // tokens); the arena is sparse (not prefaulted).
    let d = Daemon::start_with(
        tmp.path(),
        256 << 20,
        &[
            "host.slot_bytes=262144",
            "events_endpoint=",
            "events_replay_endpoint=",
            "pool_events_endpoint=",
        ],
    );
    let mut cmd = script(&py, "vllm_allocator.py");
    cmd.arg(&d.socket)
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_LOGGING_LEVEL", "WARNING");
    let out = run_ok(cmd, 900, &|| d.log_text());
    eprintln!("{out}");
    assert_lines(
        &out,
        &[
            "round trip LBHNC MHA",
            "round trip LBNHC MHA",
            "round trip BLHNC MHA",
            "round trip BLNHC MHA",
            "OK registered ",
            "OK round trips: ",
            "OK done",
        ],
    );
    assert!(
        out.lines().any(|l| l.starts_with("round trip ") && l.contains(" MLA ")),
        "no MLA round trip:\n{out}"
    );
    // The refusals are counted: heads outside blocks exist among vLLM's backends (ROCm's
    // LHBNC, the Triton backends' BHLNC/LHBNC).
    let line = out.lines().find(|l| l.starts_with("OK registered ")).unwrap();
    let refused: u32 = line
        .split("refused ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("the refused count");
    assert!(refused > 0, "{line}");
}
