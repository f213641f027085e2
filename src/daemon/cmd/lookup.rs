//! `Lookup`: the contiguous prefix of complete pages, credited per tier.

use std::time::Duration;

use crate::manager::LookupStep;
use crate::page::PageHash;
use crate::pool::PoolError;
use crate::protocol::{ErrorCode, Response};

use super::super::backend::BackendError;
use super::super::connection::{Conn, Rank, Shared};

/// A lookup on a daemon with a shared pool, run on the connection task: the pool's
/// existence query is awaited there, so no blocking-pool thread takes the lookup and wakes
/// the task with its answer. The query is bounded by its own op timeouts and, as a whole,
/// by `limit`, past which it counts as failed: no pool credit. `None`: the pool's query
/// cannot be awaited (it would block a thread); run the lookup off the runtime instead.
pub(crate) async fn awaited(shared: &Shared, conn: &Conn, hashes: &[PageHash], limit: Duration) -> Option<Response> {
    let Some(rank) = conn.rank.as_ref() else {
        return Some(Response::error(ErrorCode::NotConnected, "send Connect first"));
    };
    let ns = rank.ns;
    let step = match shared.backend.lookup_begin(ns, hashes) {
        Ok(s) => s,
        Err(e) => return Some(super::error_response(&e)),
    };
    match step {
        LookupStep::Done(hit) => Some(Response::Lookup(hit)),
        LookupStep::Blocking => None,
        LookupStep::Query(mut pending) => {
            let answers = match tokio::time::timeout(limit, pending.answers()).await {
                Ok(answers) => answers?,
                Err(_) => vec![Err(PoolError::Unavailable(format!(
                    "no existence answer within {limit:?}"
                )))],
            };
            let hit = shared.backend.lookup_finish(ns, hashes, pending, answers);
            Some(hit.map_or_else(|e| super::error_response(&e), Response::Lookup))
        }
    }
}

pub(super) fn lookup(shared: &Shared, rank: &Rank, hashes: &[PageHash]) -> Result<Response, BackendError> {
    shared.backend.lookup(rank.ns, hashes).map(Response::Lookup)
}
