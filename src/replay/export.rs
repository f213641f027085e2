//! Request traces from a replayed run: what kvtier would have recorded for each request.
//!
//! Useful to turn a generated workload into traces that `--request-traces` reads back, and
//! to check that the trace format carries everything the replay needs.

use super::engine::PolicyRun;
use super::workload::Workload;
use crate::session::trace::{FinishReason, RequestTrace, TierTokens};

/// One record per request, in arrival order.
pub fn request_traces(w: &Workload, run: &PolicyRun) -> Vec<RequestTrace> {
    let mut last = vec![None; w.sessions.len()];
    for (i, r) in w.requests.iter().enumerate() {
        last[r.session] = Some(i);
    }
    let bt = u64::from(w.block_tokens);
    w.requests
        .iter()
        .zip(&run.requests)
        .enumerate()
        .map(|(i, (r, o))| {
            let spec = &w.sessions[r.session];
            let tokens = |pages: usize| (pages as u64 * bt).min(r.input_tokens);
            let d = tokens(o.hit_pages[0]);
            let h = tokens(o.hit_pages[0] + o.hit_pages[1]);
            let all = tokens(o.hit_pages.iter().sum());
            RequestTrace {
                session_id: spec.id.clone(),
                parent_session_id: spec.parent.map(|p| w.sessions[p].id.clone()),
                arrival_ms: r.arrival_ms,
                end_ms: o.end_ms.max(r.arrival_ms),
                input_tokens: r.input_tokens,
                output_tokens: r.output_tokens,
                finish_reason: if r.tool_end_ms.is_some() {
                    FinishReason::ToolCalls
                } else {
                    FinishReason::Stop
                },
                session_end: spec.ends_explicitly && last[r.session] == Some(i),
                hit_tokens: TierTokens {
                    device: d,
                    host: h - d,
                    pool: all - h,
                },
                recomputed_tokens: r.input_tokens - all,
                pause_ms: o.pause_ms.clone(),
                tool_names: r.tool_names.clone(),
                block_tokens: w.block_tokens,
                block_hashes: r.blocks.clone(),
            }
            .bounded()
        })
        .collect()
}
