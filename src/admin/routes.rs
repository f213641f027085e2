//! The admin endpoints. Each reads the manager (or the daemon's [`EngineView`](super::EngineView)) and
//! answers JSON; errors are `{"code": <stable string>, "message": …}`.
//!
//! | method | path | answer |
//! | --- | --- | --- |
//! | GET | `/v1/status` | version, uptime, tiers, connected engines and ranks |
//! | GET | `/v1/tiers` | per tier: capacity, used, complete/pinned/in-flight pages, evictions |
//! | GET | `/v1/sessions?after=<id>&offset=<n>&limit=<n>` | sessions the daemon tracks, one page of them in id order |
//! | GET | `/v1/pages?hash=<hex>` or `?prefix=<hex,hex,…>` | per-tier completeness, missing objects |
//! | POST | `/v1/pages` with a form body `prefix=<hex,hex,…>` | the same, for prefixes over the head limit |
//! | POST | `/v1/hints` | a JSON hint → its outcome, as on the engine path |
//! | POST | `/v1/sessions/phase` | a router reports a session's phase (`{"session_id", "parent_session_id"?, "phase"}`) |
//! | GET | `/v1/sessions/advice` | pause/resume advice of the pressure controller since the last call, and its counters |
//! | GET, PUT | `/v1/config` | the tunables; PUT changes only those, validated |
//! | GET | `/v1/events?from=<seq>&limit=<n>` | page events as JSON lines (chunked) |
//! | GET | `/v1/sessions/events?from=<seq>&limit=<n>` | the pressure controller's pauses and resumes as JSON lines (chunked); nothing is taken from the advice queues |
//! | GET | `/metrics` | Prometheus text format |
//!
//! Pages and hints take `ns=<namespace id>` (default 0).
//!
//! The handlers are synchronous: they take the manager's locks, and the server runs them
//! on tokio's blocking pool so a large render never holds a runtime worker. The event
//! stream is the exception; `handle` only validates it and `events` streams it.

use serde_json::{Value, json};

use super::api::{ApiError, Reply, Source};
use super::config::SessionInfo;
use super::request::Request;
use super::state::AdminState;
use super::{kv_hints, metrics, session_routes};
use crate::hints::Hint;
use crate::manager::Tunables;
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;

/// Sessions in one `/v1/sessions` answer unless `limit` says otherwise, and the most it
/// may say: a node with a million interned sessions still answers in bounded memory.
pub const SESSIONS_DEFAULT_LIMIT: usize = 1000;
pub const SESSIONS_MAX_LIMIT: usize = 10_000;

/// Answers one request that has been read completely.
pub(crate) fn handle(ctx: &AdminState, req: &Request) -> Reply {
    let r = match (req.method.as_str(), req.path.trim_end_matches('/')) {
        ("GET", "/v1/status") => Ok(status(ctx)),
        ("GET", "/v1/tiers") => Ok(json!({ "tiers": ctx.manager.stats().tiers })),
        ("GET", "/v1/sessions") => sessions(ctx, req),
        // POST takes `prefix=` in a form body, for prefixes too long for a request head.
        ("GET" | "POST", "/v1/pages") => pages(ctx, req),
        ("POST", "/v1/hints") => hint(ctx, req),
        ("POST", "/v1/kv-hints") => namespace(req).and_then(|ns| kv_hints::post(ctx, req, ns)),
        ("GET", "/v1/kv-hints") => kv_hints::list(ctx, req),
        ("POST", "/v1/sessions/phase") => session_routes::phase(ctx, req),
        ("GET", "/v1/sessions/advice") => Ok(session_routes::advice(ctx)),
        ("GET", "/v1/config") => Ok(json!(ctx.manager.tunables())),
        ("PUT", "/v1/config") => put_config(ctx, req),
        ("GET", "/v1/events") => return events(ctx, req, Source::Pages).unwrap_or_else(ApiError::reply),
        ("GET", "/v1/sessions/events") => return events(ctx, req, Source::Sessions).unwrap_or_else(ApiError::reply),
        ("GET", "/metrics" | "/v1/metrics") => {
            let mut text = metrics::render(&ctx.manager.stats(), ctx.started.elapsed(), ctx.engines.engines().len());
            metrics::render_pool(&mut text, &ctx.manager.discovery().report());
            if let Some(q) = ctx.manager.stores().pool().and_then(|p| p.helper_queue()) {
                metrics::render_helper_queue(&mut text, &q);
            }
            metrics::render_session_events(&mut text, ctx.manager.session_policy().events());
            if let Some(k) = ctx.engines.host_keep() {
                metrics::render_host_keep(&mut text, &k);
            }
            metrics::render_policy_moves(&mut text, &ctx.manager.session_policy().move_counts());
            if let Some(p) = ctx.manager.session_policy().stats() {
                metrics::render_session_table(&mut text, &p);
            }
            return Reply::Text(200, "text/plain; version=0.0.4; charset=utf-8", text);
        }
        (
            _,
            "/v1/status"
            | "/v1/tiers"
            | "/v1/sessions"
            | "/v1/pages"
            | "/v1/hints"
            | "/v1/kv-hints"
            | "/v1/config"
            | "/v1/events"
            | "/metrics"
            | "/v1/sessions/phase"
            | "/v1/sessions/advice"
            | "/v1/sessions/events",
        ) => Err(ApiError::new(
            405,
            "method_not_allowed",
            format!("{} is not served here", req.method),
        )),
        _ => Err(ApiError::new(404, "not_found", format!("no endpoint {}", req.path))),
    };
    match r {
        Ok(v) => Reply::Json(200, v),
        Err(e) => e.reply(),
    }
}

/// The arena's slots and what its stored pages cost: `bytes_per_stored_page` is the
/// bytes of the slots in use over the pages complete on host, `page_bytes` a page's own
/// bytes when every registered layout has the same (else null), `overhead` their ratio,
/// `models` the same per registered namespace (a complete page's slots against its own
/// bytes: a layout with smaller objects than the slots shows its waste there);
/// `mapping` is the page size backing the arena's memory (`page_bytes`: 4096, or the huge
/// page size where the host gave huge pages), its bytes in huge pages, and why it has
/// none when it has none.
fn host_arena(ctx: &AdminState, stats: &crate::manager::StatsSnapshot) -> Value {
    let Some(a) = ctx.manager.stores().arena() else {
        return Value::Null;
    };
    let used_bytes = a.used() as u64 * a.slot_bytes() as u64;
    let stored = stats
        .tiers
        .iter()
        .find(|t| t.tier == crate::tier::TierKind::Host)
        .map_or(0, |t| t.complete_pages);
    let per_page = (stored > 0).then(|| used_bytes as f64 / stored as f64);
    let sizes: std::collections::BTreeSet<u64> = ctx
        .manager
        .pages()
        .namespaces()
        .iter()
        .map(|(_, _, l)| l.page_bytes())
        .collect();
    let page_bytes = (sizes.len() == 1).then(|| sizes.first().copied().unwrap_or(0));
    let overhead = per_page.zip(page_bytes).map(|(p, b)| p / b.max(1) as f64);
    // What a complete page of each model takes: one slot per object, against its own bytes.
    let models: Vec<Value> = ctx
        .manager
        .pages()
        .namespaces()
        .iter()
        .map(|(_, ns, l)| {
            let arena_bytes = l.object_count() as u64 * a.slot_bytes() as u64;
            json!({
                "model": ns.model, "lora": ns.lora, "page_bytes": l.page_bytes(),
                "arena_bytes_per_page": arena_bytes,
                "overhead": arena_bytes as f64 / l.page_bytes().max(1) as f64,
            })
        })
        .collect();
    let r = a.report();
    json!({
        "slot_bytes": a.slot_bytes(), "slots": a.slots(), "used_slots": a.used(),
        "stored_pages": stored, "bytes_per_stored_page": per_page, "page_bytes": page_bytes,
        "overhead": overhead, "models": models,
        "mapping": {
            "page_bytes": r.page_bytes, "huge_bytes": r.huge_bytes,
            "small_pages_why": r.small_pages_why, "gpu_pin_refusal": r.gpu_pin_refusal,
        },
    })
}

fn status(ctx: &AdminState) -> Value {
    let stats = ctx.manager.stats();
    let (held, bytes) = ctx.manager.session_registry().size();
    json!({
        "sessions": {"held": held, "max": ctx.manager.tunables().max_sessions, "table_bytes": bytes},
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_s": ctx.started.elapsed().as_secs_f64(),
        "tiers": stats.tiers,
        "host_arena": host_arena(ctx, &stats),
        "pages": stats.pages,
        "open_grants": stats.open_grants,
        "leased_pages": stats.leased_pages,
        "deferred_hints": stats.deferred_hints,
        "event_seq": stats.event_seq,
        "upkeep_ticks": stats.upkeep_ticks,
        "lookups": {
            "count": stats.lookups,
            "latency": stats.lookup_latency,
            "bounds_s": crate::manager::LOOKUP_BUCKETS_S,
        },
        "memory": ctx.engines.memory(),
        "pool": ctx.manager.discovery().report(),
        "host_keep": ctx.engines.host_keep(),
        "engines": ctx.engines.engines(),
    })
}

/// One page of the daemon's sessions, or of the manager's when the daemon reports none.
/// `truncated`, `next_offset`, `next_after` (the cursor for `after=`) and `total` appear
/// only when sessions remain past this page, so a small node's answer is the bare
/// `{"sessions": […]}` it always was. The manager's rows are copied out of the session
/// table (only this page of them, by cursor) and rendered after its lock is let go.
fn sessions(ctx: &AdminState, req: &Request) -> Result<Value, ApiError> {
    let offset = count_param(req, "offset", 0, usize::MAX)?;
    let limit = count_param(req, "limit", SESSIONS_DEFAULT_LIMIT, SESSIONS_MAX_LIMIT)?;
    let after = req.param("after");
    // One row past the page says whether more remain.
    let from_daemon = ctx.engines.sessions();
    let (mut page, total) = if from_daemon.is_empty() {
        let (rows, total) = ctx.manager.session_registry().page(after, offset, limit + 1);
        // The policy's phase, parent and chain length, for this page's rows only.
        let views = ctx
            .manager
            .session_policy()
            .views_of(rows.iter().map(|(id, _, _)| id.as_str()));
        let page: Vec<SessionInfo> = rows
            .into_iter()
            .zip(views)
            .map(|((session_id, idle, ended), v)| SessionInfo {
                session_id,
                parent_session_id: v.as_ref().and_then(|v| v.parent_session_id.clone()),
                phase: if ended {
                    Some("ended".to_owned())
                } else {
                    v.as_ref().map(|v| v.phase.name().to_owned())
                },
                idle,
                pages: v.map(|v| v.pages as u64),
            })
            .collect();
        (page, total)
    } else {
        let total = from_daemon.len();
        let skip = after.map_or(0, |a| {
            from_daemon.iter().take_while(|s| s.session_id.as_str() <= a).count()
        });
        let page: Vec<SessionInfo> = from_daemon.into_iter().skip(skip + offset).take(limit + 1).collect();
        (page, total)
    };
    let more = page.len() > limit;
    page.truncate(limit);
    let next_after = page.last().map(|s| s.session_id.clone());
    let end = offset.saturating_add(page.len());
    let mut v = json!({ "sessions": page });
    if more {
        v["truncated"] = json!(true);
        if after.is_none() {
            v["next_offset"] = json!(end);
        }
        v["next_after"] = json!(next_after);
        v["total"] = json!(total);
    }
    Ok(v)
}

/// A non-negative integer parameter, `default` when absent, refused above `max`.
fn count_param(req: &Request, name: &str, default: usize, max: usize) -> Result<usize, ApiError> {
    let Some(v) = req.param(name) else {
        return Ok(default);
    };
    match v.parse::<usize>() {
        Ok(n) if n <= max => Ok(n),
        Ok(n) => Err(ApiError::new(
            400,
            "bad_query",
            format!("{name}={n} is over the maximum of {max}"),
        )),
        Err(_) => Err(ApiError::new(
            400,
            "bad_query",
            format!("{name} must be a non-negative integer"),
        )),
    }
}

fn namespace(req: &Request) -> Result<NamespaceId, ApiError> {
    match req.param("ns") {
        None => Ok(NamespaceId(0)),
        Some(v) => v
            .parse()
            .map(NamespaceId)
            .map_err(|_| ApiError::new(400, "bad_namespace", "ns must be a namespace id (0..65535)")),
    }
}

fn parse_hashes(list: &str, max: usize) -> Result<Vec<PageHash>, ApiError> {
    let parts: Vec<&str> = list.split(',').filter(|p| !p.trim().is_empty()).collect();
    if parts.is_empty() {
        return Err(ApiError::new(400, "bad_hash", "no page hash given"));
    }
    if parts.len() > max {
        return Err(ApiError::new(
            413,
            "batch_too_large",
            format!("{} hashes; at most {max}", parts.len()),
        ));
    }
    parts
        .iter()
        .map(|p| PageHash::from_hex(p.trim()).map_err(|e| ApiError::new(400, "bad_hash", e.to_string())))
        .collect()
}

fn pages(ctx: &AdminState, req: &Request) -> Result<Value, ApiError> {
    let ns = namespace(req)?;
    let (hashes, is_prefix) = match (req.param("hash"), req.param("prefix")) {
        (Some(h), None) => (parse_hashes(h, 1)?, false),
        (None, Some(p)) => (parse_hashes(p, ctx.cfg.max_prefix)?, true),
        _ => {
            return Err(ApiError::new(
                400,
                "bad_query",
                "give exactly one of hash=<hex> or prefix=<hex,hex,…>",
            ));
        }
    };
    let layout = ctx.manager.pages().layout(ns)?;
    let mut run = [true; 3];
    let mut prefix = [0usize; 3];
    let mut out = Vec::with_capacity(hashes.len());
    for h in &hashes {
        let st = ctx.manager.page_status(ns, h)?;
        for t in TierKind::ALL {
            let complete = st.as_ref().is_some_and(|s| s.tiers[t.index()].complete);
            run[t.index()] &= complete;
            prefix[t.index()] += usize::from(run[t.index()]);
        }
        out.push(match st {
            None => json!({ "hash": h, "known": false }),
            Some(s) => {
                let tiers: Vec<Value> = s
                    .tiers
                    .iter()
                    .map(|t| {
                        let missing: Vec<Value> = t
                            .missing
                            .iter()
                            .map(|&i| json!({ "index": i, "object": layout.objects().get(i) }))
                            .collect();
                        json!({
                            "tier": t.tier, "complete": t.complete, "pinned": t.pinned,
                            "missing": missing, "inflight": t.inflight,
                        })
                    })
                    .collect();
                json!({
                    "hash": h, "known": true, "hits": s.hits, "retain": s.retain, "tiers": tiers,
                    "pool_origin": ctx.manager.discovery().origin(ns, h),
                })
            }
        });
    }
    let mut v = json!({ "ns": ns.0, "objects_per_page": layout.object_count(), "pages": out });
    if is_prefix {
        v["complete_prefix"] = json!({ "device": prefix[0], "host": prefix[1], "pool": prefix[2] });
    }
    Ok(v)
}

fn hint(ctx: &AdminState, req: &Request) -> Result<Value, ApiError> {
    let ns = namespace(req)?;
    let h: Hint = serde_json::from_slice(&req.body).map_err(|e| ApiError::new(400, "malformed_hint", e.to_string()))?;
    let kind = h.kind();
    let outcome = ctx.manager.hint(ns, h)?;
    let mut v = serde_json::to_value(&outcome).map_err(|e| ApiError::new(500, "internal", e.to_string()))?;
    v["kind"] = json!(kind);
    Ok(v)
}

fn put_config(ctx: &AdminState, req: &Request) -> Result<Value, ApiError> {
    let patch: Value = serde_json::from_slice(&req.body).map_err(|e| ApiError::new(400, "bad_json", e.to_string()))?;
    let mut cur =
        serde_json::to_value(ctx.manager.tunables()).map_err(|e| ApiError::new(500, "internal", e.to_string()))?;
    merge(&mut cur, &patch, "")?;
    let t: Tunables = serde_json::from_value(cur).map_err(|e| ApiError::new(422, "invalid_config", e.to_string()))?;
    ctx.manager.set_tunables(t)?;
    tracing::info!("admin: tunables changed");
    Ok(json!(ctx.manager.tunables()))
}

/// Applies `patch` onto `cur`, refusing keys `cur` does not have (they are not tunable).
fn merge(cur: &mut Value, patch: &Value, at: &str) -> Result<(), ApiError> {
    let Value::Object(p) = patch else {
        *cur = patch.clone();
        return Ok(());
    };
    let Value::Object(c) = cur else {
        return Err(ApiError::new(422, "invalid_config", format!("{at} is not an object")));
    };
    if p.contains_key("mode") {
        // A tagged enum (the write policy): replace it whole.
        *cur = patch.clone();
        return Ok(());
    }
    for (k, v) in p {
        let path = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
        match c.get_mut(k) {
            Some(slot) => merge(slot, v, &path)?,
            None => {
                return Err(ApiError::new(
                    422,
                    "not_tunable",
                    format!("{path} is not a tunable setting"),
                ));
            }
        }
    }
    Ok(())
}

/// Validates an event stream request: `from` defaults to the next event, `limit` to
/// no limit.
fn events(ctx: &AdminState, req: &Request, source: Source) -> Result<Reply, ApiError> {
    let parse = |name: &str| req.param(name).map(|v| v.parse::<u64>());
    match (parse("from"), parse("limit")) {
        (Some(Err(_)), _) | (_, Some(Err(_))) => {
            Err(ApiError::new(400, "bad_query", "from and limit must be integers"))
        }
        (f, l) => Ok(Reply::Events {
            source,
            from: f.and_then(Result::ok).unwrap_or_else(|| match source {
                Source::Pages => ctx.manager.pages().events().last_seq() + 1,
                Source::Sessions => ctx.manager.session_policy().events().last_seq() + 1,
            }),
            limit: l.and_then(Result::ok).unwrap_or(u64::MAX),
        }),
    }
}
