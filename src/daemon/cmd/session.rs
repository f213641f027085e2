//! `Session`: an agent session's phase changed (tool call started or ended, paused,
//! ended). `RequestEnd`: one of its requests finished (lengths and page hashes only).

use crate::protocol::{Response, SessionPhase};

use super::super::backend::BackendError;
use super::super::connection::Shared;

pub(super) fn session(
    shared: &Shared,
    id: &str,
    parent: Option<&str>,
    phase: SessionPhase,
) -> Result<Response, BackendError> {
    shared.backend.session(id, parent, phase)?;
    Ok(Response::Ok)
}

/// A request ended on the rank's namespace: the policy learns the session's chain and,
/// when request traces are on, a content-free line is appended.
pub(super) fn request_end(
    shared: &Shared,
    rank: &super::super::connection::Rank,
    mut end: crate::policy::RequestEnd,
) -> Result<Response, BackendError> {
    end.ns = rank.ns;
    shared.backend.request_end(&end)?;
    Ok(Response::Ok)
}
