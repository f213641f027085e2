//! Explicit wire encoding of KV hints and their outcomes.
//!
//! Every enum gets a stable one-byte tag written out here rather than derived, so the
//! C ABI and other languages can produce the same bytes from this table.
//!
//! | hint     | tag | fields after the target             |
//! |----------|-----|-------------------------------------|
//! | share    | 0   | —                                   |
//! | prefetch | 1   | to: tier, deadline: bool + u64 ms   |
//! | demote   | 2   | to: tier                            |
//! | pin      | 3   | tier, ttl_ms: u64                   |
//! | retain   | 4   | priority: i8, ttl_ms: u64           |
//!
//! A target is `0` + hashes (pages), `1` + hashes (prefix) or `2` + string (session).
//! Tiers are 0 device, 1 host, 2 pool.

use crate::hints::{Hint, HintOutcome, HintTarget, Reason};
use crate::tier::TierKind;

use super::codec::{DecodeError, Reader, Writer};
use super::types::{MAX_PAGES, MAX_STR};

fn tier(r: &mut Reader) -> Result<TierKind, DecodeError> {
    let tag = r.u8()?;
    TierKind::from_index(tag as usize).ok_or(DecodeError::BadTag { what: "tier", tag })
}

fn encode_target(w: &mut Writer, t: &HintTarget) {
    match t {
        HintTarget::Pages(h) => {
            w.u8(0);
            w.hashes(h);
        }
        HintTarget::Prefix(h) => {
            w.u8(1);
            w.hashes(h);
        }
        HintTarget::Session(s) => {
            w.u8(2);
            w.str(s);
        }
    }
}

fn decode_target(r: &mut Reader) -> Result<HintTarget, DecodeError> {
    Ok(match r.u8()? {
        0 => HintTarget::Pages(r.hashes(MAX_PAGES)?),
        1 => HintTarget::Prefix(r.hashes(MAX_PAGES)?),
        2 => HintTarget::Session(r.str("session", MAX_STR)?),
        tag => {
            return Err(DecodeError::BadTag {
                what: "hint target",
                tag,
            });
        }
    })
}

pub(crate) fn encode_hint(w: &mut Writer, h: &Hint) {
    match h {
        Hint::Share { target } => {
            w.u8(0);
            encode_target(w, target);
        }
        Hint::Prefetch {
            target,
            to,
            deadline_ms,
        } => {
            w.u8(1);
            encode_target(w, target);
            w.u8(to.index() as u8);
            w.bool(deadline_ms.is_some());
            w.u64(deadline_ms.unwrap_or(0));
        }
        Hint::Demote { target, to } => {
            w.u8(2);
            encode_target(w, target);
            w.u8(to.index() as u8);
        }
        Hint::Pin { target, tier, ttl_ms } => {
            w.u8(3);
            encode_target(w, target);
            w.u8(tier.index() as u8);
            w.u64(*ttl_ms);
        }
        Hint::Retain {
            target,
            priority,
            ttl_ms,
        } => {
            w.u8(4);
            encode_target(w, target);
            w.i8(*priority);
            w.u64(*ttl_ms);
        }
    }
}

pub(crate) fn decode_hint(r: &mut Reader) -> Result<Hint, DecodeError> {
    let tag = r.u8()?;
    if tag > 4 {
        return Err(DecodeError::BadTag { what: "hint", tag });
    }
    let target = decode_target(r)?;
    Ok(match tag {
        0 => Hint::Share { target },
        1 => {
            let to = tier(r)?;
            let has = r.bool()?;
            let deadline = r.u64()?;
            Hint::Prefetch {
                target,
                to,
                deadline_ms: has.then_some(deadline),
            }
        }
        2 => Hint::Demote { target, to: tier(r)? },
        3 => Hint::Pin {
            target,
            tier: tier(r)?,
            ttl_ms: r.u64()?,
        },
        _ => Hint::Retain {
            target,
            priority: r.i8()?,
            ttl_ms: r.u64()?,
        },
    })
}

/// Stable codes of [`Reason`]; never reorder, only append.
const REASONS: [Reason; 14] = [
    Reason::UnknownPages,
    Reason::PinBudget,
    Reason::MaxTtl,
    Reason::QueueFull,
    Reason::PoolDegraded,
    Reason::NoSpace,
    Reason::AlreadyThere,
    Reason::NotComplete,
    Reason::UnknownSession,
    Reason::WrongTier,
    Reason::InFlight,
    Reason::NoPool,
    Reason::UnknownAction,
    Reason::UnsupportedVersion,
];

fn reason_code(r: Reason) -> u8 {
    REASONS.iter().position(|&x| x == r).unwrap_or(0) as u8
}

fn reason(r: &mut Reader) -> Result<Reason, DecodeError> {
    let tag = r.u8()?;
    REASONS
        .get(tag as usize)
        .copied()
        .ok_or(DecodeError::BadTag { what: "reason", tag })
}

pub(crate) fn encode_outcome(w: &mut Writer, o: &HintOutcome) {
    match *o {
        HintOutcome::Accepted { pages } => {
            w.u8(0);
            w.u64(pages as u64);
        }
        HintOutcome::Clipped {
            applied,
            requested,
            reason,
        } => {
            w.u8(1);
            w.u64(applied as u64);
            w.u64(requested as u64);
            w.u8(reason_code(reason));
        }
        HintOutcome::Deferred { pages, reason } => {
            w.u8(2);
            w.u64(pages as u64);
            w.u8(reason_code(reason));
        }
        HintOutcome::Ignored { reason } => {
            w.u8(3);
            w.u8(reason_code(reason));
        }
    }
}

pub(crate) fn decode_outcome(r: &mut Reader) -> Result<HintOutcome, DecodeError> {
    Ok(match r.u8()? {
        0 => HintOutcome::Accepted {
            pages: r.u64()? as usize,
        },
        1 => HintOutcome::Clipped {
            applied: r.u64()? as usize,
            requested: r.u64()? as usize,
            reason: reason(r)?,
        },
        2 => HintOutcome::Deferred {
            pages: r.u64()? as usize,
            reason: reason(r)?,
        },
        3 => HintOutcome::Ignored { reason: reason(r)? },
        tag => {
            return Err(DecodeError::BadTag {
                what: "hint outcome",
                tag,
            });
        }
    })
}
