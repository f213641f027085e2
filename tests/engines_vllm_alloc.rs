//! `kvtier.vllm.KvtierConnector` on the KV tensors vLLM 0.33's own allocator makes (the
//! GPU build's Python code, on CPU), against a real daemon (`python/tests/vllm_allocator.py`
//! says how): for every attention backend of vLLM's registry whose module imports without
//! a GPU, and every KV cache layout it declares, `get_kv_cache_configs` and the model
//! runner's `allocate_kv_cache` give the tensors the connector registers, every layout
//! (heads outside blocks, `LHBNC`/`BHLNC`, as pages of head runs) with 2 and 4 KV heads;
//! per distinct geometry (packed NHD/HND, layer- and block-outermost, heads outside
//! blocks, K/V head slots, MHA and MLA) a store and a load through vLLM's Scheduler and
//! the worker side, in the model runner's call order, give blocks bit-identical to the
//! stored ones and no stray bytes elsewhere in the buffer; pages an `LHBNC`/`BHLNC` engine
//! stored load into an `LBHNC` engine with the same logical blocks.

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
    // Heads outside blocks round-trip with one head run a half (2 heads) and two (4), and
    // their pages load into an LBHNC engine.
    for layout in ["LHBNC", "BHLNC"] {
        for heads in [2, 4] {
            assert!(
                out.lines().any(|l| l.starts_with(&format!("round trip {layout} MHA "))
                    && l.ends_with(&format!(" heads {heads}: ok"))),
                "no {layout} MHA round trip with {heads} heads:\n{out}"
            );
            assert!(
                out.lines()
                    .any(|l| l.starts_with(&format!("shared {layout} -> LBHNC MHA "))
                        && l.ends_with(&format!(" heads {heads}: ok"))),
                "no {layout} page with {heads} heads loaded into LBHNC:\n{out}"
            );
        }
    }
    // Nothing vLLM allocates without a GPU is refused, and heads outside blocks and K/V
    // head slots were among what registered.
    let line = out.lines().find(|l| l.starts_with("OK registered ")).unwrap();
    let count = |after: &str| -> u32 {
        line.split(after)
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).find(|n| !n.is_empty()))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no count after {after:?} in {line}"))
    };
    assert_eq!(count("refused "), 0, "{line}");
    assert!(
        count("MLA; ") > 0,
        "no MHA layout with heads outside blocks registered: {line}"
    );
    assert!(count("blocks, ") > 0, "no K/V head slot layout registered: {line}");
}
