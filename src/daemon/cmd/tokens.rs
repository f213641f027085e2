//! `Tokens`: the token ids (and chain parent) of pages a rank stores, recorded for the
//! KV event publisher's `BlockStored` events. Never an error for a well-formed request:
//! the table forgets its oldest entries when full.

use crate::page::PageHash;
use crate::protocol::Response;

use super::super::backend::BackendError;
use super::super::connection::{Rank, Shared};

pub(super) fn tokens(
    shared: &Shared,
    rank: &Rank,
    parent: Option<PageHash>,
    hashes: &[PageHash],
    tokens: &[Vec<u32>],
) -> Result<Response, BackendError> {
    shared.tokens.record(rank.ns, parent, hashes, tokens);
    Ok(Response::Ok)
}
