//! `Session`: an agent session's phase changed (tool call started or ended, paused, ended).

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
