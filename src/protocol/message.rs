//! Requests and responses, with their one-byte kinds and body encodings.
//!
//! Request kinds are `0x01..=0x7f`, response kinds `0x80..=0xff`; field order on the
//! wire is the order of the struct fields below. Request bodies are coded here, response
//! bodies in `response.rs`.

use crate::hints::{Hint, HintOutcome};
use crate::layout::LayoutSpec;
use crate::page::PageHash;
use crate::wire::{LookupTally, PrefixHit};

use super::codec::{DecodeError, Reader, Writer};
use super::error::RemoteError;
use super::frame::encode_frame;
use super::hint::{decode_hint, encode_hint};
use super::types::*;

/// A request from an engine rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Connect {
        identity: Identity,
        layout: LayoutSpec,
    },
    RegisterDevice(DeviceInfo),
    Lookup {
        hashes: Vec<PageHash>,
    },
    Store {
        hashes: Vec<PageHash>,
        session: String,
    },
    /// One flag per page of the grant: whether its objects were written.
    Commit {
        grant: u64,
        written: Vec<bool>,
    },
    Abort {
        grant: u64,
    },
    Load {
        hashes: Vec<PageHash>,
        wait: LoadWait,
    },
    /// The rank has copied the first `loaded` pages of a load grant into its device; the
    /// grant's slots may be evicted again.
    LoadDone {
        grant: u64,
        loaded: u32,
    },
    Poll {
        ticket: u64,
    },
    Wait {
        ticket: u64,
        timeout_ms: u32,
    },
    Removed {
        hashes: Vec<PageHash>,
    },
    Session {
        id: String,
        parent: Option<String>,
        phase: SessionPhase,
    },
    Hint(Hint),
    Stats,
    Ping {
        payload: Vec<u8>,
    },
    /// Takes the advice waiting for the rank's namespace, at most `max_pages` page hashes
    /// (1 to [`MAX_PAGES`]); an entry that does not fit is split.
    TakeAdvice {
        max_pages: u32,
    },
    /// Token ids of pages the rank is about to store (or stored), for the KV events:
    /// `tokens[i]` belongs to `hashes[i]`; the chain's parents are `parent`, then
    /// `hashes[i - 1]`. Sent before the `Store` it goes with.
    Tokens {
        parent: Option<PageHash>,
        hashes: Vec<PageHash>,
        tokens: Vec<Vec<u32>>,
    },
    /// A Dynamo KvHint envelope, as JSON text (see `crate::router_hint`).
    KvHints {
        envelope: String,
    },
    /// A request finished: its session (and parent), token counts and prompt page
    /// hashes. No content. Feeds the session policy's lineage and the request traces.
    RequestEnd {
        session: String,
        parent: Option<String>,
        input_length: u64,
        output_length: u64,
        hashes: Vec<PageHash>,
    },
    /// The client library's restart-fence token (random, the same for the library's
    /// whole life, across reconnects), sent after `Connect`: the daemon marks the slots
    /// of this connection's store grants with it. `done`: no copy into a slot of a grant
    /// of an earlier connection is still running (each finished or was abandoned), so
    /// the slots a restarted daemon quarantined for this token may be freed now.
    Fence {
        token: u64,
        done: bool,
    },
    /// Lookups the library answered itself from the lookup file since its last report, for
    /// the daemon's counters (answered `Ok`).
    LookupTally(LookupTally),
}

/// The daemon's answer to one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    Connected {
        connection: u64,
        arena: ArenaInfo,
        objects: Vec<u16>,
        /// The daemon's id for the rank's namespace: what the lookup file's views are
        /// keyed by (see `directory::shared`).
        namespace: u16,
    },
    Ok,
    Lookup(PrefixHit),
    StoreGrant {
        grant: u64,
        pages: Vec<GrantPage>,
    },
    Committed {
        ticket: u64,
        complete: u32,
    },
    /// `pages[i]` are the rank's slots of page `i`; exactly `pages.len()` leading pages load.
    LoadGrant {
        grant: u64,
        pages: Vec<Vec<ObjectSlot>>,
    },
    Ticket(TicketStatus),
    Hint(HintOutcome),
    Stats(DaemonStats),
    Pong {
        payload: Vec<u8>,
    },
    Advice(AdviceBatch),
    /// What came of a KvHint envelope: a `router_hint::EnvelopeReport` as JSON text.
    KvHints {
        report: String,
    },
    Error(RemoteError),
}

macro_rules! kinds {
    ($($name:ident = $v:expr),* $(,)?) => {
        /// Message kinds (frame header byte 3).
        pub mod kind { $(pub const $name: u8 = $v;)* }
    };
}

kinds! {
    CONNECT = 0x01, REGISTER_DEVICE = 0x02, LOOKUP = 0x03, STORE = 0x04, COMMIT = 0x05,
    ABORT = 0x06, LOAD = 0x07, LOAD_DONE = 0x08, POLL = 0x09, WAIT = 0x0a, REMOVED = 0x0b,
    SESSION = 0x0c, HINT = 0x0d, STATS = 0x0e, PING = 0x0f, TAKE_ADVICE = 0x10, TOKENS = 0x11,
    KV_HINTS = 0x12,
    REQUEST_END = 0x1c, FENCE = 0x1d, LOOKUP_TALLY = 0x1e,
    R_CONNECTED = 0x81, R_OK = 0x82, R_LOOKUP = 0x83, R_STORE_GRANT = 0x84, R_COMMITTED = 0x85,
    R_LOAD_GRANT = 0x86, R_TICKET = 0x87, R_HINT = 0x88, R_STATS = 0x89, R_PONG = 0x8a,
    R_ADVICE = 0x8b, R_KV_HINTS = 0x8c, R_ERROR = 0xff,
}

/// Largest ping payload.
pub(crate) const MAX_PING: usize = 1 << 20;
/// Largest KvHint envelope or report text (a frame bounds it too).
pub const MAX_ENVELOPE: usize = 4 << 20;
/// Most token ids per page in a `Tokens` request (a vLLM/SGLang page is 16 to 64 tokens,
/// a Mooncake trace block 512).
pub const MAX_PAGE_TOKENS: usize = 4096;

/// Text carried as bytes (longer than a `u16`-length string allows).
pub(crate) fn utf8(b: &[u8], what: &'static str) -> Result<String, DecodeError> {
    std::str::from_utf8(b)
        .map(str::to_owned)
        .map_err(|_| DecodeError::BadUtf8 { what })
}

/// A `TakeAdvice` page budget: 1 to [`MAX_PAGES`].
fn advice_budget(max_pages: u32) -> Result<u32, DecodeError> {
    match max_pages as usize {
        0 => Err(DecodeError::Invalid {
            what: "advice page budget",
            why: "0 pages; ask for at least 1".into(),
        }),
        n if n > MAX_PAGES => Err(DecodeError::TooLong {
            what: "advice page budget",
            len: n,
            max: MAX_PAGES,
        }),
        _ => Ok(max_pages),
    }
}

impl Request {
    pub fn kind(&self) -> u8 {
        use kind::*;
        match self {
            Request::Connect { .. } => CONNECT,
            Request::RegisterDevice(_) => REGISTER_DEVICE,
            Request::Lookup { .. } => LOOKUP,
            Request::Store { .. } => STORE,
            Request::Commit { .. } => COMMIT,
            Request::Abort { .. } => ABORT,
            Request::Load { .. } => LOAD,
            Request::LoadDone { .. } => LOAD_DONE,
            Request::Poll { .. } => POLL,
            Request::Wait { .. } => WAIT,
            Request::Removed { .. } => REMOVED,
            Request::Session { .. } => SESSION,
            Request::Hint(_) => HINT,
            Request::Stats => STATS,
            Request::Ping { .. } => PING,
            Request::TakeAdvice { .. } => TAKE_ADVICE,
            Request::Tokens { .. } => TOKENS,
            Request::KvHints { .. } => KV_HINTS,
            Request::RequestEnd { .. } => REQUEST_END,
            Request::Fence { .. } => FENCE,
            Request::LookupTally(_) => LOOKUP_TALLY,
        }
    }

    /// Appends the whole frame for this request to `out`.
    pub fn encode(&self, request_id: u64, out: &mut Vec<u8>) {
        encode_frame(out, self.kind(), request_id, |buf| {
            self.encode_body(&mut Writer::new(buf))
        });
    }

    fn encode_body(&self, w: &mut Writer) {
        match self {
            Request::Connect { identity, layout } => {
                identity.encode(w);
                encode_layout(w, layout);
            }
            Request::RegisterDevice(d) => {
                w.str(&d.kind);
                w.u32(d.pages);
                w.u64(d.object_bytes);
            }
            Request::Lookup { hashes } | Request::Removed { hashes } => w.hashes(hashes),
            Request::Store { hashes, session } => {
                w.hashes(hashes);
                w.str(session);
            }
            Request::Commit { grant, written } => {
                w.u64(*grant);
                w.count(written.len());
                written.iter().for_each(|&b| w.bool(b));
            }
            Request::Abort { grant } => w.u64(*grant),
            Request::LoadDone { grant, loaded } => {
                w.u64(*grant);
                w.u32(*loaded);
            }
            Request::Load { hashes, wait } => {
                w.hashes(hashes);
                wait.encode(w);
            }
            Request::Poll { ticket } => w.u64(*ticket),
            Request::Wait { ticket, timeout_ms } => {
                w.u64(*ticket);
                w.u32(*timeout_ms);
            }
            Request::Session { id, parent, phase } => {
                w.str(id);
                w.bool(parent.is_some());
                w.str(parent.as_deref().unwrap_or(""));
                w.u8(phase.code());
            }
            Request::Hint(h) => encode_hint(w, h),
            Request::Stats => {}
            Request::Ping { payload } => w.bytes(payload),
            Request::TakeAdvice { max_pages } => w.u32(*max_pages),
            Request::Tokens { parent, hashes, tokens } => {
                w.bool(parent.is_some());
                if let Some(p) = parent {
                    w.hash(p);
                }
                w.hashes(hashes);
                w.count(tokens.len());
                for t in tokens {
                    w.count(t.len());
                    t.iter().for_each(|&id| w.u32(id));
                }
            }
            // Envelopes outgrow a u16 string length: bytes with a u32 one.
            Request::KvHints { envelope } => w.bytes(envelope.as_bytes()),
            Request::RequestEnd {
                session,
                parent,
                input_length,
                output_length,
                hashes,
            } => {
                w.str(session);
                w.bool(parent.is_some());
                w.str(parent.as_deref().unwrap_or(""));
                w.u64(*input_length);
                w.u64(*output_length);
                w.hashes(hashes);
            }
            Request::Fence { token, done } => {
                w.u64(*token);
                w.bool(*done);
            }
            Request::LookupTally(t) => {
                for v in [t.lookups, t.pages, t.device, t.host, t.pool] {
                    w.u64(v);
                }
            }
        }
    }

    /// Decodes a request body of the given kind. Never panics; every byte must be used.
    pub fn decode(kind: u8, body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let req = match kind {
            kind::CONNECT => Request::Connect {
                identity: Identity::decode(&mut r)?,
                layout: decode_layout(&mut r)?,
            },
            kind::REGISTER_DEVICE => Request::RegisterDevice(DeviceInfo {
                kind: r.str("device kind", 64)?,
                pages: r.u32()?,
                object_bytes: r.u64()?,
            }),
            kind::LOOKUP => Request::Lookup {
                hashes: r.hashes(MAX_PAGES)?,
            },
            kind::STORE => Request::Store {
                hashes: r.hashes(MAX_PAGES)?,
                session: r.str("session", MAX_STR)?,
            },
            kind::COMMIT => {
                let grant = r.u64()?;
                let n = r.count("written flags", MAX_PAGES, 1)?;
                let written = (0..n).map(|_| r.bool()).collect::<Result<_, _>>()?;
                Request::Commit { grant, written }
            }
            kind::ABORT => Request::Abort { grant: r.u64()? },
            kind::LOAD => Request::Load {
                hashes: r.hashes(MAX_PAGES)?,
                wait: LoadWait::decode(&mut r)?,
            },
            kind::FENCE => Request::Fence {
                token: r.u64()?,
                done: r.bool()?,
            },
            kind::LOOKUP_TALLY => Request::LookupTally(LookupTally {
                lookups: r.u64()?,
                pages: r.u64()?,
                device: r.u64()?,
                host: r.u64()?,
                pool: r.u64()?,
            }),
            kind::LOAD_DONE => Request::LoadDone {
                grant: r.u64()?,
                loaded: r.u32()?,
            },
            kind::POLL => Request::Poll { ticket: r.u64()? },
            kind::WAIT => Request::Wait {
                ticket: r.u64()?,
                timeout_ms: r.u32()?,
            },
            kind::REMOVED => Request::Removed {
                hashes: r.hashes(MAX_PAGES)?,
            },
            kind::SESSION => {
                let id = r.str("session", MAX_STR)?;
                let has_parent = r.bool()?;
                let parent = r.str("parent session", MAX_STR)?;
                Request::Session {
                    id,
                    parent: has_parent.then_some(parent),
                    phase: SessionPhase::from_code(r.u8()?)?,
                }
            }
            kind::HINT => Request::Hint(decode_hint(&mut r)?),
            kind::STATS => Request::Stats,
            kind::PING => Request::Ping {
                payload: r.bytes("ping payload", MAX_PING)?.to_vec(),
            },
            kind::TAKE_ADVICE => Request::TakeAdvice {
                max_pages: advice_budget(r.u32()?)?,
            },
            kind::TOKENS => {
                let parent = if r.bool()? { Some(r.hash()?) } else { None };
                let hashes = r.hashes(MAX_PAGES)?;
                let n = r.count("token lists", MAX_PAGES, 4)?;
                let mut tokens = Vec::with_capacity(n);
                for _ in 0..n {
                    let len = r.count("page tokens", MAX_PAGE_TOKENS, 4)?;
                    tokens.push((0..len).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?);
                }
                if tokens.len() != hashes.len() {
                    return Err(DecodeError::Invalid {
                        what: "token lists",
                        why: format!("{} lists for {} pages", tokens.len(), hashes.len()),
                    });
                }
                Request::Tokens { parent, hashes, tokens }
            }
            kind::KV_HINTS => Request::KvHints {
                envelope: utf8(r.bytes("KvHint envelope", MAX_ENVELOPE)?, "KvHint envelope")?,
            },
            kind::REQUEST_END => {
                let session = r.str("session", MAX_STR)?;
                let has_parent = r.bool()?;
                let parent = r.str("parent session", MAX_STR)?;
                Request::RequestEnd {
                    session,
                    parent: has_parent.then_some(parent),
                    input_length: r.u64()?,
                    output_length: r.u64()?,
                    hashes: r.hashes(MAX_PAGES)?,
                }
            }
            tag => {
                return Err(DecodeError::BadTag {
                    what: "request kind",
                    tag,
                });
            }
        };
        r.finish()?;
        Ok(req)
    }
}
