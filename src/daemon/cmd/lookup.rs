//! `Lookup`: the contiguous prefix of complete pages, credited per tier.

use crate::page::PageHash;
use crate::protocol::Response;

use super::super::backend::BackendError;
use super::super::connection::{Conn, Rank, Shared};
use crate::manager::LookupStep;

/// A lookup on a daemon with a shared pool, run on the connection task: the pool's
/// existence query is awaited there, so no blocking-pool thread takes the lookup and wakes
/// the task with its answer. `None`: the pool's query cannot be awaited (it would block a
/// thread); run the lookup off the runtime instead.
pub(crate) async fn awaited(shared: &Shared, conn: &Conn, hashes: &[PageHash]) -> Option<Response> {
    let ns = match super::rank(conn) {
        Ok(r) => r.ns,
        Err(e) => return Some(super::error_response(&e)),
    };
    let step = match shared.backend.lookup_begin(ns, hashes) {
        Ok(s) => s,
        Err(e) => return Some(super::error_response(&e)),
    };
    match step {
        LookupStep::Done(hit) => Some(Response::Lookup(hit)),
        LookupStep::Blocking => None,
        LookupStep::Query(mut pending) => {
            let answers = pending.answers().await?;
            let hit = shared.backend.lookup_finish(ns, hashes, pending, answers);
            Some(hit.map_or_else(|e| super::error_response(&e), Response::Lookup))
        }
    }
}

pub(super) fn lookup(shared: &Shared, rank: &Rank, hashes: &[PageHash]) -> Result<Response, BackendError> {
    shared.backend.lookup(rank.ns, hashes).map(Response::Lookup)
}
