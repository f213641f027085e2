//! `Store`, `Commit`, `Abort`: the engine-driven offload of a rank's objects to host.
//!
//! The connection remembers every grant it opened so that a client that dies between
//! `Store` and `Commit` has its slots reclaimed the moment its socket closes.

use crate::page::PageHash;
use crate::protocol::{ErrorCode, Response};

use super::super::backend::BackendError;
use super::super::connection::{Conn, MAX_DEVICE_PAGES, Shared};

/// Most grants one connection may hold open.
const MAX_OPEN: usize = 1024;

pub(super) fn store(
    shared: &Shared,
    conn: &mut Conn,
    hashes: &[PageHash],
    session: &str,
) -> Result<Response, BackendError> {
    if conn.store_grants.len() >= MAX_OPEN {
        return Ok(Response::error(
            ErrorCode::NoSpace,
            "too many open store grants on this connection",
        ));
    }
    let rank = super::rank(conn)?;
    let (tp, pp) = (rank.identity.tp_rank, rank.identity.pp_rank);
    let (grant, pages) = shared.backend.begin_store(rank.ns, tp, pp, hashes, session, conn.id)?;
    conn.store_grants.insert(grant);
    // The rank has these pages on device now (that is what it is storing from).
    if conn.device.len() + hashes.len() <= MAX_DEVICE_PAGES {
        conn.device.extend(hashes.iter().copied());
    }
    Ok(Response::StoreGrant { grant, pages })
}

pub(super) fn commit(shared: &Shared, conn: &mut Conn, grant: u64, written: &[bool]) -> Result<Response, BackendError> {
    if !conn.store_grants.contains(&grant) {
        return Err(BackendError::UnknownGrant(grant));
    }
    let (ticket, complete) = shared.backend.commit_store(grant, written)?;
    conn.store_grants.remove(&grant);
    Ok(Response::Committed { ticket, complete })
}

pub(super) fn abort(shared: &Shared, conn: &mut Conn, grant: u64) -> Result<Response, BackendError> {
    if !conn.store_grants.remove(&grant) {
        return Err(BackendError::UnknownGrant(grant));
    }
    shared.backend.abort_store(grant)?;
    Ok(Response::Ok)
}
