//! `/v1/kv-hints`: Dynamo KvHint envelopes.
//!
//! `POST /v1/kv-hints?ns=N` applies an envelope (the body, JSON) in namespace `N`
//! (default 0) and answers its report: every action with its outcome (`accepted`,
//! `clipped`, `deferred`, `ignored` with a reason) or the error its hint met, and the
//! `source_control_endpoint` it named. A malformed envelope is a 400 `malformed_envelope`.
//! `GET /v1/kv-hints?since=S&limit=L` lists the delivered envelopes (from engines through
//! the client API and from this socket) numbered after `S`, oldest first: a router or a
//! script polls it with the last `seq` it saw.

use serde_json::{Value, json};

use super::api::ApiError;
use super::request::Request;
use super::state::AdminState;
use crate::page::NamespaceId;
use crate::protocol::MAX_PAGES;

pub(crate) fn post(ctx: &AdminState, req: &Request, ns: NamespaceId) -> Result<Value, ApiError> {
    let text = std::str::from_utf8(&req.body)
        .map_err(|_| ApiError::new(400, "malformed_envelope", "the body is not UTF-8"))?;
    let plan = crate::router_hint::parse_str(text, MAX_PAGES)
        .map_err(|e| ApiError::new(400, "malformed_envelope", e.to_string()))?;
    // A namespace the daemon does not know is the caller's mistake, not an outcome.
    ctx.manager.pages().layout(ns).map_err(ApiError::from)?;
    let report = crate::router_hint::apply(plan, |h| ctx.manager.hint(ns, h.clone()));
    let seq = ctx
        .engines
        .kv_hints()
        .map(|log| log.push("admin", ns.0, report.clone()));
    let mut v = serde_json::to_value(&report).map_err(|e| ApiError::new(500, "internal", e.to_string()))?;
    v["seq"] = json!(seq);
    v["ns"] = json!(ns.0);
    Ok(v)
}

pub(crate) fn list(ctx: &AdminState, req: &Request) -> Result<Value, ApiError> {
    let num = |name: &str, default: u64| match req.param(name) {
        None => Ok(default),
        Some(v) => v
            .parse::<u64>()
            .map_err(|_| ApiError::new(400, "bad_param", format!("{name} must be a non-negative integer"))),
    };
    let since = num("since", 0)?;
    let limit = num("limit", 100)?.clamp(1, crate::router_hint::KV_HINT_LOG as u64) as usize;
    let records = ctx
        .engines
        .kv_hints()
        .map(|l| l.since(since, limit))
        .unwrap_or_default();
    Ok(json!({ "records": records }))
}
