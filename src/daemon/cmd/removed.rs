//! `Removed`: the engine freed device pages.

use crate::page::PageHash;
use crate::protocol::Response;

use super::super::backend::BackendError;
use super::super::connection::{Rank, Shared};

pub(super) fn removed(shared: &Shared, rank: &Rank, hashes: &[PageHash]) -> Result<Response, BackendError> {
    let known = shared.backend.removed(rank.ns, hashes)?;
    tracing::trace!(pages = hashes.len(), known, "device pages removed");
    Ok(Response::Ok)
}
