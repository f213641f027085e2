//! `Stats`: the daemon's counters.

use crate::protocol::Response;

use super::super::connection::Shared;

pub(super) fn stats(shared: &Shared) -> Response {
    let mut s = shared.backend.stats();
    s.connections = shared.connections();
    Response::Stats(s)
}
