//! `Removed`: the engine freed device pages.

use crate::page::PageHash;
use crate::protocol::Response;

use super::super::backend::BackendError;
use super::super::connection::{Conn, Shared};

pub(super) fn removed(shared: &Shared, conn: &mut Conn, hashes: &[PageHash]) -> Result<Response, BackendError> {
    let rank = super::rank(conn)?;
    let known = shared
        .backend
        .removed(rank.ns, rank.identity.tp_rank, rank.identity.pp_rank, hashes)?;
    for h in hashes {
        conn.device.remove(h);
    }
    tracing::trace!(pages = hashes.len(), known, "device pages removed");
    Ok(Response::Ok)
}
