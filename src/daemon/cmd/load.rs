//! `Load` and `LoadDone`: the engine-driven load of host pages into device slots.
//!
//! The answer names exactly the leading pages that may be read; they stay held against
//! eviction until `LoadDone` (or until the connection closes).

use crate::page::PageHash;
use crate::protocol::{ErrorCode, LoadWait, Response};

use super::super::backend::BackendError;
use super::super::connection::{Conn, MAX_DEVICE_PAGES, Shared};

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
    let (tp, pp) = (rank.identity.tp_rank, rank.identity.pp_rank);
    let (grant, pages) = shared.backend.begin_load(rank.ns, tp, pp, hashes, wait, conn.id)?;
    conn.load_grants.insert(grant);
    // Remembered until LoadDone says how many made it to the device.
    conn.loads.insert(grant, hashes[..pages.len()].to_vec());
    Ok(Response::LoadGrant { grant, pages })
}

pub(super) fn done(shared: &Shared, conn: &mut Conn, grant: u64, loaded: u32) -> Result<Response, BackendError> {
    if !conn.load_grants.remove(&grant) {
        return Err(BackendError::UnknownGrant(grant));
    }
    let pages = conn.loads.remove(&grant).unwrap_or_default();
    let loaded = (loaded as usize).min(pages.len());
    shared.backend.finish_load(grant, loaded)?;
    if conn.device.len() + loaded <= MAX_DEVICE_PAGES {
        conn.device.extend(pages[..loaded].iter().copied());
    }
    Ok(Response::Ok)
}
