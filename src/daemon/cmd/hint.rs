//! `Hint`: apply a KV hint; a malformed one is a `bad_hint` error, anything else an outcome.

use crate::hints::Hint;
use crate::protocol::{ErrorCode, Response};

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
