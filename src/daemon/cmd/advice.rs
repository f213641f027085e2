//! `TakeAdvice`: hand the rank the advice waiting for its namespace (pages to evict
//! first, to offload, or ready to load), within the page budget it asked for.

use crate::protocol::Response;

use super::super::connection::{Rank, Shared};

pub(super) fn take_advice(shared: &Shared, rank: &Rank, max_pages: u32) -> Response {
    let batch = shared.backend.take_advice(rank.ns, max_pages as usize);
    if !batch.advice.is_empty() {
        tracing::debug!(
            entries = batch.advice.len(),
            pages = batch.pages(),
            more = batch.more,
            "advice taken"
        );
    }
    Response::Advice(batch)
}
