//! Session endpoints for routers: report a session's phase (as engines do through their
//! client), and read the pressure controller's pause/resume advice.

use serde::Deserialize;
use serde_json::{Value, json};

use super::api::ApiError;
use super::request::Request;
use super::state::AdminState;
use crate::policy::Phase;

/// The body of `POST /v1/sessions/phase`. Unknown fields and phases are refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PhaseBody {
    session_id: String,
    #[serde(default)]
    parent_session_id: Option<String>,
    phase: Phase,
}

/// A router reports a session's phase; the answer is the session as the policy now keeps
/// it (absent once it ended).
pub(super) fn phase(ctx: &AdminState, req: &Request) -> Result<Value, ApiError> {
    let b: PhaseBody =
        serde_json::from_slice(&req.body).map_err(|e| ApiError::new(400, "bad_session", e.to_string()))?;
    ctx.manager
        .session_policy()
        .phase(&ctx.manager, &b.session_id, b.parent_session_id.as_deref(), b.phase)?;
    let session = ctx
        .manager
        .session_policy()
        .views()
        .into_iter()
        .find(|v| v.session_id == b.session_id);
    Ok(json!({ "session": session }))
}

/// Pause and resume advice since the last call (each is answered once), with the
/// controller's counters (pauses, resumes, paused time, pages demoted and staged).
pub(super) fn advice(ctx: &AdminState) -> Value {
    json!({
        "advice": ctx.manager.session_policy().take_advice(),
        "stats": ctx.manager.session_policy().stats(),
        "moves": ctx.manager.session_policy().move_counts(),
    })
}
