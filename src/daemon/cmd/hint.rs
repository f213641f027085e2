//! `Hint`: apply a KV hint; a malformed one is a `bad_hint` error, anything else an outcome.
//! `KvHints`: apply a Dynamo KvHint envelope (`crate::router_hint`); a malformed envelope
//! is a `bad_hint` error, anything else a report of every action's outcome, which is also
//! kept in the daemon's KvHint log (admin `GET /v1/kv-hints`).

use crate::hints::Hint;
use crate::protocol::{ErrorCode, MAX_PAGES, Response};

use super::super::backend::BackendError;
use super::super::connection::{Rank, Shared};

pub(super) fn hint(shared: &Shared, rank: &Rank, hint: &Hint) -> Result<Response, BackendError> {
    Ok(match shared.backend.hint(rank.ns, hint) {
        Ok(outcome) => {
            tracing::debug!(kind = hint.kind().name(), outcome = outcome.name(), "hint");
            Response::Hint(outcome)
        }
        Err(e @ BackendError::Hint(_)) => Response::error(ErrorCode::BadHint, e.to_string()),
        Err(e) => super::error_response(&e),
    })
}

pub(super) fn kv_hints(shared: &Shared, rank: &Rank, envelope: &str) -> Result<Response, BackendError> {
    let plan = match crate::router_hint::parse_str(envelope, MAX_PAGES) {
        Ok(p) => p,
        Err(e) => return Ok(Response::error(ErrorCode::BadHint, e.to_string())),
    };
    let report = crate::router_hint::apply(plan, |h| shared.backend.hint(rank.ns, h));
    tracing::debug!(
        message_id = %report.message_id,
        actions = report.actions.len(),
        "KvHint envelope"
    );
    shared.kv_hints.push("client", rank.ns.0, report.clone());
    match serde_json::to_string(&report) {
        Ok(report) => Ok(Response::KvHints { report }),
        Err(e) => Ok(Response::error(ErrorCode::Internal, e.to_string())),
    }
}
