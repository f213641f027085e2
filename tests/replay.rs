//! End-to-end checks of the replay library: a small generated agentic workload, the first
//! 300 requests of the shared Mooncake trace, and a round trip through request traces.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use kvtier::replay::engine::run_policy;
use kvtier::replay::export::request_traces;
use kvtier::replay::generate::{AgenticSpec, agentic};
use kvtier::replay::{Capacity, CostModel, EngineConfig, PolicyKind, Report, Workload, replay};
use kvtier::session::pressure::PressureConfig;
use kvtier::session::trace::TraceWriter;

fn config(w: &Workload, device_frac: f64, host_ratio: f64) -> EngineConfig {
    let device = ((w.distinct_blocks() as f64 * device_frac).ceil() as usize).max(1);
    EngineConfig {
        capacity: Capacity {
            device_pages: device,
            host_pages: (device as f64 * host_ratio).round() as usize,
            pool_pages: 0,
        },
        page_bytes: 64 << 20,
        page_layout: "test".into(),
        cost: CostModel::default(),
        pressure: PressureConfig::default(),
        idle_timeout_ms: 300_000,
        tool_end_lead_ms: 500,
    }
}

fn run(w: &Workload, cfg: &EngineConfig) -> Report {
    let mut ticks = 0usize;
    let r = replay(w, cfg, &PolicyKind::ALL, &mut || ticks += 1).expect("replay");
    assert_eq!(
        ticks,
        PolicyKind::ALL.len() * w.requests.len(),
        "progress is told once per request and policy"
    );
    r
}

/// The invariants every report must satisfy.
fn check_bounds(r: &Report) {
    let b = &r.bounds;
    assert!(b.belady_hit_tokens <= b.infinite_hit_tokens);
    assert!(b.belady_hit_tokens > 0);
    for (name, p) in &r.policies {
        assert!(p.hit_tokens <= b.belady_hit_tokens, "{name} beat Belady: {p:?}");
        assert_eq!(p.hit_tokens + p.recomputed_tokens, r.workload.input_tokens, "{name}");
        assert_eq!(p.hit_tokens, p.hit_tokens_by_tier.total(), "{name}");
        assert!(p.hit_fraction_of_belady <= 1.0 && p.hit_fraction_of_infinite <= p.hit_fraction_of_belady);
        assert!(p.fairness_jain > 0.0 && p.fairness_jain <= 1.0 + 1e-9);
    }
    let lru = &r.policies["device-lru"];
    assert_eq!(
        lru.hit_tokens_by_tier.host + lru.hit_tokens_by_tier.pool,
        0,
        "device-lru has one tier"
    );
    assert_eq!(lru.bytes_moved.device_host, 0);
}

#[test]
fn generated_agentic_sessions() {
    let w = agentic(&AgenticSpec {
        sessions: 24,
        concurrency: 24,
        subagent_chance: 0.3,
        ..AgenticSpec::default()
    });
    assert!(w.sessions.iter().any(|s| s.parent.is_some()), "subagents");
    // A device of 1/20 of the blocks: the 24 live working sets outgrow device plus host when
    // host holds copies (write-through), and fit when the tiers hold distinct pages.
    let r = run(&w, &config(&w, 0.05, 2.0));
    check_bounds(&r);
    let (sa, wt, lru) = (
        &r.policies["session-aware"],
        &r.policies["write-through"],
        &r.policies["device-lru"],
    );
    assert!(
        sa.hit_tokens > lru.hit_tokens,
        "{} vs {}",
        sa.hit_tokens,
        lru.hit_tokens
    );
    assert!(sa.hit_fraction_of_belady >= 0.90, "{}", sa.hit_fraction_of_belady);
    assert!(
        (sa.recomputed_tokens as f64) <= 0.8 * wt.recomputed_tokens as f64,
        "session-aware {} vs write-through {}",
        sa.recomputed_tokens,
        wt.recomputed_tokens
    );
    assert!(sa.bytes_moved.device_host > 0 && sa.bytes_moved.host_device > 0);
    assert!(sa.pauses.count > 0, "host is under pressure, so sessions pause");
    // The session signals add to what the exclusive tiers alone give.
    let ex = &r.policies["exclusive-lru"];
    assert!(
        sa.recomputed_tokens < ex.recomputed_tokens,
        "session-aware {} vs exclusive-lru {}",
        sa.recomputed_tokens,
        ex.recomputed_tokens
    );
    for signal in ["lineage", "phases", "pressure", "ended"] {
        let row = &r.policies[format!("session-aware-no-{signal}").as_str()];
        assert!(
            row.recomputed_tokens >= ex.recomputed_tokens.min(sa.recomputed_tokens),
            "{signal}"
        );
    }
    assert_eq!(r.policies["session-aware-no-pressure"].pauses.count, 0);
    let goals = r.goals.expect("both policies ran");
    assert!(goals.met);
    assert!(goals.recompute_reduction_vs_exclusive_lru.is_some_and(|x| x > 0.0));
}

/// Tool ends are signalled when they happen: the default policies never see a tool's end
/// early, so their figures do not move with the lookahead lead; the lookahead oracle is a
/// separate, named policy that is not run by default.
#[test]
fn tool_ends_are_not_known_early_unless_the_lookahead_variant_is_asked_for() {
    let w = agentic(&AgenticSpec {
        sessions: 16,
        concurrency: 16,
        ..AgenticSpec::default()
    });
    assert!(!PolicyKind::ALL.contains(&PolicyKind::SessionAwareLookahead));
    let mut early = config(&w, 0.05, 2.0);
    early.tool_end_lead_ms = 60_000;
    let mut late = early.clone();
    late.tool_end_lead_ms = 0;
    let hits = |cfg: &EngineConfig, p| {
        run_policy(&w, cfg, p, &mut || {})
            .expect("run")
            .requests
            .iter()
            .map(|o| o.hit_pages)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        hits(&early, PolicyKind::SessionAware),
        hits(&late, PolicyKind::SessionAware)
    );
    assert_eq!(
        hits(&late, PolicyKind::SessionAwareLookahead),
        hits(&late, PolicyKind::SessionAware),
        "a lead of 0 is no lookahead"
    );
}

fn mooncake_head(lines: usize) -> Workload {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/mooncake_synthetic_trace.jsonl");
    let file = File::open(&path).unwrap_or_else(|e| {
        panic!(
            "this test replays Mooncake's public trace, kept at {}: {e}",
            path.display()
        )
    });
    let reader = BufReader::new(file);
    assert!(
        reader.lines().take(lines).count() == lines,
        "the trace has fewer than {lines} lines"
    );
    let file = File::open(&path).expect("reopen");
    Workload::from_mooncake(BufReader::new(file), 512, lines).expect("parse the trace")
}

#[test]
fn mooncake_trace_head() {
    let w = mooncake_head(300);
    assert_eq!(w.requests.len(), 300);
    assert!(w.sessions.len() < 300, "some requests continue an earlier session");
    let r = run(&w, &config(&w, 0.10, 2.0));
    check_bounds(&r);
    let (sa, wt, lru) = (
        &r.policies["session-aware"],
        &r.policies["write-through"],
        &r.policies["device-lru"],
    );
    assert!(
        sa.hit_tokens > lru.hit_tokens,
        "{} vs {}",
        sa.hit_tokens,
        lru.hit_tokens
    );
    assert!(sa.hit_tokens > wt.hit_tokens, "{} vs {}", sa.hit_tokens, wt.hit_tokens);
    assert!(r.bounds.infinite_hit_tokens > 0);
}

#[test]
fn exported_request_traces_replay_to_the_same_figures() {
    let w = agentic(&AgenticSpec {
        sessions: 12,
        concurrency: 12,
        ..AgenticSpec::default()
    });
    let cfg = config(&w, 0.10, 2.0);
    let sa = run_policy(&w, &cfg, PolicyKind::SessionAware, &mut || {}).expect("run");
    let mut out = TraceWriter::new(Vec::new());
    for rec in request_traces(&w, &sa) {
        out.write(&rec).expect("write");
    }
    let bytes = out.into_inner();
    let text = String::from_utf8(bytes.clone()).expect("utf-8");
    for banned in ["prompt", "response", "content", "arguments"] {
        assert!(!text.contains(banned), "trace mentions {banned}");
    }
    let back = Workload::from_request_traces(&bytes[..], 1_000_000).expect("read back");
    assert_eq!(back.requests.len(), w.requests.len());
    let a = run(&w, &cfg);
    let b = run(&back, &cfg);
    assert_eq!(a.bounds, b.bounds);
    for (name, p) in &a.policies {
        assert_eq!(p.hit_tokens, b.policies[name].hit_tokens, "{name}");
    }
}
