//! Encoding and decoding of [`Response`] bodies (field order is the wire order).

use crate::wire::PrefixHit;

use super::codec::{DecodeError, Reader, Writer};
use super::error::{ErrorCode, RemoteError};
use super::frame::encode_frame;
use super::hint::{decode_outcome, encode_outcome};
use super::message::{MAX_PING, Response, kind};
use super::types::*;

impl Response {
    pub fn kind(&self) -> u8 {
        use kind::*;
        match self {
            Response::Connected { .. } => R_CONNECTED,
            Response::Ok => R_OK,
            Response::Lookup(_) => R_LOOKUP,
            Response::StoreGrant { .. } => R_STORE_GRANT,
            Response::Committed { .. } => R_COMMITTED,
            Response::LoadGrant { .. } => R_LOAD_GRANT,
            Response::Ticket(_) => R_TICKET,
            Response::Hint(_) => R_HINT,
            Response::Stats(_) => R_STATS,
            Response::Pong { .. } => R_PONG,
            Response::Advice(_) => R_ADVICE,
            Response::KvHints { .. } => R_KV_HINTS,
            Response::Error(_) => R_ERROR,
        }
    }

    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Response::Error(RemoteError::new(code, message))
    }

    /// Appends the whole frame for this response to `out`.
    pub fn encode(&self, request_id: u64, out: &mut Vec<u8>) {
        encode_frame(out, self.kind(), request_id, |buf| {
            self.encode_body(&mut Writer::new(buf))
        });
    }

    fn encode_body(&self, w: &mut Writer) {
        match self {
            Response::Connected {
                connection,
                arena,
                objects,
                namespace,
            } => {
                w.u64(*connection);
                w.str(&arena.path);
                w.u64(arena.slot_bytes);
                w.u32(arena.slots);
                w.count(objects.len());
                objects.iter().for_each(|&o| w.u16(o));
                w.u16(*namespace);
            }
            Response::Ok => {}
            Response::Lookup(h) => {
                for v in [h.device, h.host, h.pool] {
                    w.u32(v.min(u32::MAX as usize) as u32);
                }
            }
            Response::StoreGrant { grant, pages } => {
                w.u64(*grant);
                w.count(pages.len());
                for p in pages {
                    w.u32(p.index);
                    encode_slots(w, &p.slots);
                }
            }
            Response::Committed { ticket, complete } => {
                w.u64(*ticket);
                w.u32(*complete);
            }
            Response::LoadGrant { grant, pages } => {
                w.u64(*grant);
                w.count(pages.len());
                pages.iter().for_each(|p| encode_slots(w, p));
            }
            Response::Ticket(t) => {
                w.u32(t.complete);
                w.u32(t.total);
                w.u32(t.failed);
            }
            Response::Hint(o) => encode_outcome(w, o),
            Response::Stats(s) => s.fields().iter().for_each(|&v| w.u64(v)),
            Response::Pong { payload } => w.bytes(payload),
            Response::Advice(a) => a.encode(w),
            Response::KvHints { report } => w.bytes(report.as_bytes()),
            Response::Error(e) => {
                w.u16(e.code.code());
                w.str(&e.message);
            }
        }
    }

    /// Decodes a response body of the given kind. Never panics; every byte must be used.
    pub fn decode(kind: u8, body: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(body);
        let resp = match kind {
            kind::R_CONNECTED => {
                let connection = r.u64()?;
                let arena = ArenaInfo {
                    path: r.str("arena path", MAX_STR)?,
                    slot_bytes: r.u64()?,
                    slots: r.u32()?,
                };
                let n = r.count("objects", crate::layout::MAX_OBJECTS_PER_PAGE, 2)?;
                let objects = (0..n).map(|_| r.u16()).collect::<Result<_, _>>()?;
                Response::Connected {
                    connection,
                    arena,
                    objects,
                    namespace: r.u16()?,
                }
            }
            kind::R_OK => Response::Ok,
            kind::R_LOOKUP => Response::Lookup(PrefixHit {
                device: r.u32()? as usize,
                host: r.u32()? as usize,
                pool: r.u32()? as usize,
            }),
            kind::R_STORE_GRANT => {
                let grant = r.u64()?;
                let n = r.count("grant pages", MAX_PAGES, 8)?;
                let pages = (0..n)
                    .map(|_| {
                        Ok(GrantPage {
                            index: r.u32()?,
                            slots: decode_slots(&mut r)?,
                        })
                    })
                    .collect::<Result<_, DecodeError>>()?;
                Response::StoreGrant { grant, pages }
            }
            kind::R_COMMITTED => Response::Committed {
                ticket: r.u64()?,
                complete: r.u32()?,
            },
            kind::R_LOAD_GRANT => {
                let grant = r.u64()?;
                let n = r.count("load pages", MAX_PAGES, 4)?;
                let pages = (0..n).map(|_| decode_slots(&mut r)).collect::<Result<_, _>>()?;
                Response::LoadGrant { grant, pages }
            }
            kind::R_TICKET => Response::Ticket(TicketStatus {
                complete: r.u32()?,
                total: r.u32()?,
                failed: r.u32()?,
            }),
            kind::R_HINT => Response::Hint(decode_outcome(&mut r)?),
            kind::R_STATS => {
                let mut f = [0u64; 7];
                for v in &mut f {
                    *v = r.u64()?;
                }
                Response::Stats(DaemonStats::from_fields(f))
            }
            kind::R_PONG => Response::Pong {
                payload: r.bytes("pong payload", MAX_PING)?.to_vec(),
            },
            kind::R_ADVICE => Response::Advice(AdviceBatch::decode(&mut r)?),
            kind::R_KV_HINTS => Response::KvHints {
                report: super::message::utf8(r.bytes("KvHint report", super::message::MAX_ENVELOPE)?, "KvHint report")?,
            },
            kind::R_ERROR => {
                let code = ErrorCode::from_code(r.u16()?);
                Response::Error(RemoteError::new(code, r.str("error message", MAX_STR)?))
            }
            tag => {
                return Err(DecodeError::BadTag {
                    what: "response kind",
                    tag,
                });
            }
        };
        r.finish()?;
        Ok(resp)
    }
}
