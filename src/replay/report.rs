//! Turns policy runs and bounds into the report `kvtier replay` prints.
//!
//! Hit tokens are the reusable prefix of each request (pages times block tokens, capped at
//! the request's input length); recomputed tokens are the rest of the input. Session
//! completion time is the time from a session's first arrival to its last request's end
//! under the cost model; a session's slowdown divides it by the same session's time with
//! an infinite cache and no copy cost, and the fairness figure is Jain's index over the
//! slowdowns (1 is perfectly even).

use std::collections::BTreeMap;

use serde::Serialize;

use super::ReplayError;
use super::bounds::{belady_hits, hit_tokens, infinite_hits};
use super::engine::{BytesMoved, Capacity, CostModel, EngineConfig, PolicyKind, PolicyRun, run_policy};
use super::workload::Workload;
use crate::session::trace::TierTokens;

/// Median, 99th percentile and maximum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles; all zero for no values.
    pub fn of(values: &[f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Self {
            p50: rank(0.50),
            p99: rank(0.99),
            max: v[v.len() - 1],
        }
    }
}

/// Jain's fairness index: `(sum x)^2 / (n * sum x^2)`, 1 when all are equal.
pub fn jain(values: &[f64]) -> f64 {
    let sum: f64 = values.iter().sum();
    let sq: f64 = values.iter().map(|x| x * x).sum();
    if values.is_empty() || sq == 0.0 {
        return 1.0;
    }
    sum * sum / (values.len() as f64 * sq)
}

/// Pauses the pressure controller made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PauseReport {
    pub count: usize,
    pub forced_resumes: u64,
    pub marked_at_tool_boundary: u64,
    pub duration_ms: Percentiles,
}

/// Figures for one policy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyReport {
    pub hit_tokens: u64,
    pub hit_tokens_by_tier: TierTokens,
    pub recomputed_tokens: u64,
    pub hit_fraction_of_belady: f64,
    pub hit_fraction_of_infinite: f64,
    pub bytes_moved: BytesMoved,
    pub session_completion_ms: Percentiles,
    pub session_slowdown: Percentiles,
    pub fairness_jain: f64,
    pub pauses: PauseReport,
}

/// The two bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Bounds {
    pub infinite_hit_tokens: u64,
    pub belady_hit_tokens: u64,
    /// Belady's capacity: every page of every tier.
    pub belady_capacity_pages: usize,
}

/// What was replayed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkloadSummary {
    pub name: String,
    pub requests: usize,
    pub sessions: usize,
    pub distinct_blocks: usize,
    pub block_tokens: u32,
    pub input_tokens: u64,
}

/// The goals, checked on this run (only when both policies ran).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Goals {
    /// session-aware hit tokens over Belady's; the goal is at least 0.90.
    pub session_aware_fraction_of_belady: f64,
    /// 1 - session-aware recomputed / write-through recomputed; the goal is at least 0.20.
    pub recompute_reduction_vs_write_through: f64,
    /// 1 - session-aware recomputed / exclusive-lru recomputed (what the session signals
    /// add to the tiers alone); the goal is at least 0.10 on the agentic workload. `None`
    /// when exclusive-lru did not run.
    pub recompute_reduction_vs_exclusive_lru: Option<f64>,
    /// Both goals above that every workload has (Belady fraction, write-through).
    pub met: bool,
}

/// The whole report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub workload: WorkloadSummary,
    pub capacity: Capacity,
    pub page_bytes: u64,
    pub page_layout: String,
    pub cost_model: CostModel,
    pub policies: BTreeMap<&'static str, PolicyReport>,
    pub bounds: Bounds,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub goals: Option<Goals>,
}

fn tokens(w: &Workload, hits: &[usize]) -> u64 {
    w.requests
        .iter()
        .zip(hits)
        .map(|(r, &h)| hit_tokens(h, w.block_tokens, r.input_tokens))
        .sum()
}

/// Per-session completion (ms) and slowdown against the infinite-cache reference.
///
/// Arrivals are replayed open loop, so a slow turn would not delay the next one. Where
/// the workload says a turn waited on the previous one (`tool_end_ms` known: generated
/// sessions and request traces), each turn's latency beyond the reference delays every
/// later turn of its session; Mooncake's inferred sessions stay open loop.
fn sessions(w: &Workload, run: &PolicyRun, reference: &[f64]) -> (Vec<f64>, Vec<f64>) {
    #[derive(Default)]
    struct Span {
        first: Option<u64>,
        end: f64,
        end_ref: f64,
        delay: f64,
    }
    let mut spans: BTreeMap<usize, Span> = BTreeMap::new();
    for (i, r) in w.requests.iter().enumerate() {
        let lat = run.requests[i].latency_ms;
        let sp = spans.entry(r.session).or_default();
        let first = *sp.first.get_or_insert(r.arrival_ms);
        let start = r.arrival_ms as f64 + sp.delay;
        sp.end = sp.end.max(start + lat);
        sp.end_ref = sp.end_ref.max(r.arrival_ms as f64 + reference[i]);
        if r.tool_end_ms.is_some() {
            sp.delay += (lat - reference[i]).max(0.0);
        }
        debug_assert!(first <= r.arrival_ms);
    }
    let mut done = Vec::with_capacity(spans.len());
    let mut slow = Vec::with_capacity(spans.len());
    for sp in spans.values() {
        let first = sp.first.unwrap_or(0) as f64;
        let t = sp.end - first;
        done.push(t);
        slow.push(t / (sp.end_ref - first).max(1.0));
    }
    (done, slow)
}

/// Runs `policies` and both bounds over the workload. `progress` is told after every
/// request of every policy run.
pub fn replay(
    w: &Workload,
    cfg: &EngineConfig,
    policies: &[PolicyKind],
    progress: &mut dyn FnMut(),
) -> Result<Report, ReplayError> {
    if cfg.capacity.device_pages == 0 {
        return Err(ReplayError::Config("the device needs at least one page".into()));
    }
    cfg.cost.validate()?;
    let inf = infinite_hits(w);
    let inf_tokens = tokens(w, &inf);
    let belady_cap = cfg.capacity.total();
    let belady_tokens = tokens(w, &belady_hits(w, belady_cap));
    let reference: Vec<f64> = w
        .requests
        .iter()
        .zip(&inf)
        .map(|(r, &h)| {
            let hit = hit_tokens(h, w.block_tokens, r.input_tokens);
            cfg.cost.latency_ms(r.input_tokens - hit, 0, 0, r.output_tokens)
        })
        .collect();
    let frac = |x: u64, of: u64| if of == 0 { 1.0 } else { x as f64 / of as f64 };
    let mut out = BTreeMap::new();
    for &p in policies {
        let run = run_policy(w, cfg, p, progress)?;
        let mut by_tier = TierTokens::default();
        for (r, o) in w.requests.iter().zip(&run.requests) {
            let bt = w.block_tokens;
            let d = hit_tokens(o.hit_pages[0], bt, r.input_tokens);
            let h = hit_tokens(o.hit_pages[0] + o.hit_pages[1], bt, r.input_tokens);
            let all = hit_tokens(o.hit_pages.iter().sum(), bt, r.input_tokens);
            by_tier.device += d;
            by_tier.host += h - d;
            by_tier.pool += all - h;
        }
        let hit = by_tier.total();
        let (done, slow) = sessions(w, &run, &reference);
        let pauses: Vec<f64> = run.pauses_ms.iter().map(|&x| x as f64).collect();
        out.insert(
            p.name(),
            PolicyReport {
                hit_tokens: hit,
                hit_tokens_by_tier: by_tier,
                recomputed_tokens: w.input_tokens() - hit,
                hit_fraction_of_belady: frac(hit, belady_tokens),
                hit_fraction_of_infinite: frac(hit, inf_tokens),
                bytes_moved: run.bytes,
                session_completion_ms: Percentiles::of(&done),
                session_slowdown: Percentiles::of(&slow),
                fairness_jain: jain(&slow),
                pauses: PauseReport {
                    count: run.pauses_ms.len(),
                    forced_resumes: run.forced_resumes,
                    marked_at_tool_boundary: run.marked_pauses,
                    duration_ms: Percentiles::of(&pauses),
                },
            },
        );
    }
    let goals = match (out.get("session-aware"), out.get("write-through")) {
        (Some(sa), Some(wt)) => {
            let reduction = 1.0 - frac(sa.recomputed_tokens, wt.recomputed_tokens);
            Some(Goals {
                session_aware_fraction_of_belady: sa.hit_fraction_of_belady,
                recompute_reduction_vs_write_through: reduction,
                recompute_reduction_vs_exclusive_lru: out
                    .get("exclusive-lru")
                    .map(|ex| 1.0 - frac(sa.recomputed_tokens, ex.recomputed_tokens)),
                met: sa.hit_fraction_of_belady >= 0.90 && reduction >= 0.20,
            })
        }
        _ => None,
    };
    Ok(Report {
        workload: WorkloadSummary {
            name: w.name.clone(),
            requests: w.requests.len(),
            sessions: w.sessions.len(),
            distinct_blocks: w.distinct_blocks(),
            block_tokens: w.block_tokens,
            input_tokens: w.input_tokens(),
        },
        capacity: cfg.capacity,
        page_bytes: cfg.page_bytes,
        page_layout: cfg.page_layout.clone(),
        cost_model: cfg.cost,
        policies: out,
        bounds: Bounds {
            infinite_hit_tokens: inf_tokens,
            belady_hit_tokens: belady_tokens,
            belady_capacity_pages: belady_cap,
        },
        goals,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_jain() {
        let p = Percentiles::of(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!((p.p50, p.p99, p.max), (3.0, 5.0, 5.0));
        assert_eq!(Percentiles::of(&[]), Percentiles::default());
        assert!((jain(&[2.0, 2.0, 2.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0]) - 0.5).abs() < 1e-12);
    }
}
