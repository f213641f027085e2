//! `Load` and `LoadDone`: the engine-driven load of host pages into device slots.
//!
//! The answer names exactly the leading pages that may be read; they stay held against
//! eviction until `LoadDone` (or until the connection closes).

use crate::page::PageHash;
use crate::protocol::{ErrorCode, LoadWait, Response};

use super::super::backend::BackendError;
use super::super::connection::{Conn, Shared};

const MAX_OPEN: usize = 1024;

pub(super) fn load(
    shared: &Shared,
    conn: &mut Conn,
    hashes: &[PageHash],
    wait: LoadWait,
) -> Result<Response, BackendError> {
    if conn.load_grants.len() >= MAX_OPEN {
        return Ok(Response::error(
            ErrorCode::NoSpace,
            "too many open load grants on this connection",
        ));
    }
    let rank = super::rank(conn)?;
    let (grant, pages) =
        shared
            .backend
            .begin_load(rank.ns, rank.identity.tp_rank, rank.identity.pp_rank, hashes, wait)?;
    conn.load_grants.insert(grant);
    Ok(Response::LoadGrant { grant, pages })
}

pub(super) fn done(shared: &Shared, conn: &mut Conn, grant: u64) -> Result<Response, BackendError> {
    if !conn.load_grants.remove(&grant) {
        return Err(BackendError::UnknownGrant(grant));
    }
    shared.backend.finish_load(grant)?;
    Ok(Response::Ok)
}
