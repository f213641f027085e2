//! `Poll` and `Wait`: whether a committed store's pages are complete across every rank.

use std::time::Duration;

use crate::protocol::Response;

use super::super::backend::BackendError;
use super::super::connection::Shared;

pub(super) fn status(shared: &Shared, ticket: u64, timeout_ms: u32) -> Result<Response, BackendError> {
    shared
        .backend
        .ticket(ticket, Duration::from_millis(timeout_ms as u64))
        .map(Response::Ticket)
}
