//! What an engine passes on for routers: the token ids of the pages it stores (so the KV
//! events carry `token_ids` and `parent_block_hash`, which token-indexing routers such as
//! Dynamo's need), and the KvHint envelopes a router attached to a request.

use crate::page::PageHash;
use crate::protocol::{MAX_PAGES, Request, Response};
use crate::router_hint::EnvelopeReport;

use super::{Client, ClientError, StoreReceipt};

pub use crate::protocol::MAX_PAGE_TOKENS;

impl Client {
    /// Records the token ids of pages for the KV events: `tokens[i]` are page
    /// `hashes[i]`'s; page 0's chain parent is `parent`, page `i`'s is `hashes[i - 1]`.
    /// Call it before the store of those pages (the event is published when a page turns
    /// complete), or use [`Client::store_with_tokens`].
    pub fn send_tokens(
        &self,
        parent: Option<PageHash>,
        hashes: &[PageHash],
        tokens: &[Vec<u32>],
    ) -> Result<(), ClientError> {
        if hashes.len() != tokens.len() {
            return Err(ClientError::BadInput(format!(
                "{} token lists for {} page hashes; give one per page",
                tokens.len(),
                hashes.len()
            )));
        }
        if hashes.len() > MAX_PAGES {
            return Err(ClientError::BadInput(format!(
                "{} pages, more than {MAX_PAGES}",
                hashes.len()
            )));
        }
        if let Some(t) = tokens.iter().find(|t| t.len() > MAX_PAGE_TOKENS) {
            return Err(ClientError::BadInput(format!(
                "a page of {} token ids, more than {MAX_PAGE_TOKENS}",
                t.len()
            )));
        }
        self.expect_ok(Request::Tokens {
            parent,
            hashes: hashes.to_vec(),
            tokens: tokens.to_vec(),
        })
    }

    /// [`Client::store`] with each page's token ids (and the chain's parent before page 0),
    /// which the KV events then carry. Without tokens it is `store`.
    pub fn store_with_tokens(
        &self,
        hashes: &[PageHash],
        device_slots: &[u32],
        session: &str,
        parent: Option<PageHash>,
        tokens: Option<&[Vec<u32>]>,
    ) -> Result<StoreReceipt, ClientError> {
        if let Some(t) = tokens {
            if hashes.len() != device_slots.len() {
                return Err(ClientError::BadInput("one device slot per page hash".into()));
            }
            self.send_tokens(parent, hashes, t)?;
        }
        self.store(hashes, device_slots, session)
    }

    /// Passes on a Dynamo KvHint envelope (JSON text, as the router attached it to the
    /// request: vLLM's `Request.kv_hints`, SGLang's `kv_hints`). Every action gets an
    /// outcome in the report; a malformed envelope is a `bad_hint` error.
    pub fn kv_hints(&self, envelope: &str) -> Result<EnvelopeReport, ClientError> {
        if envelope.len() > crate::protocol::MAX_ENVELOPE {
            return Err(ClientError::BadInput(format!(
                "a KvHint envelope of {} bytes, more than {}",
                envelope.len(),
                crate::protocol::MAX_ENVELOPE
            )));
        }
        match self.call(Request::KvHints {
            envelope: envelope.to_owned(),
        })? {
            Response::KvHints { report } => {
                serde_json::from_str(&report).map_err(|e| ClientError::Protocol(format!("KvHint report: {e}")))
            }
            r => Err(super::unexpected(r)),
        }
    }
}
