//! `Lookup`: the contiguous prefix of complete pages, credited per tier.

use crate::page::PageHash;
use crate::protocol::Response;

use super::super::backend::BackendError;
use super::super::connection::{Rank, Shared};

pub(super) fn lookup(shared: &Shared, rank: &Rank, hashes: &[PageHash]) -> Result<Response, BackendError> {
    shared.backend.lookup(rank.ns, hashes).map(Response::Lookup)
}
