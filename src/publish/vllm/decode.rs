//! A consumer's decoder for vLLM KV event batches, with tagged (map) or positional
//! (array) events, in an array batch (or a map batch, as kvtier's old `named` mode sent): what a Rust
//! router would use to read kvtier's (or vLLM's) events. It checks every field's type
//! and borrows from the payload; the only allocations are the output vectors. Malformed
//! input (cut short, wrong types, lengths beyond the payload, nesting deeper than the
//! format has) is a [`DecodeError`], never a panic or an unbounded loop.

use rmp::Marker;

use super::super::wire::{ReadError, Reader};
use crate::events::PageEventKind;
use crate::page::PageHash;
use crate::tier::TierKind;

/// Why a batch could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("malformed batch: {0}")]
    Malformed(&'static str),
    #[error("unknown event tag {0:?}")]
    UnknownTag(String),
    #[error("unknown medium {0:?}")]
    UnknownMedium(String),
}

/// A block hash as vLLM sends it: an integer, or bytes (8 to 32 of them here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockHash {
    Int(u64),
    Bytes(PageHash),
}

/// One decoded `BlockStored`, `BlockRemoved` or `AllBlocksCleared`.
#[derive(Clone, Debug, PartialEq)]
pub struct VllmEvent {
    pub kind: PageEventKind,
    pub hashes: Vec<BlockHash>,
    /// `BlockStored` only; 0 otherwise.
    pub block_size: u64,
    /// `BlockStored` only: the parent block hash, when sent.
    pub parent: Option<BlockHash>,
    /// `BlockStored` only: the token ids sent.
    pub token_ids: Vec<u64>,
    /// `None` when absent or nil.
    pub medium: Option<TierKind>,
}

/// One decoded `EventBatch`.
#[derive(Clone, Debug, PartialEq)]
pub struct VllmBatch {
    pub ts: f64,
    pub events: Vec<VllmEvent>,
    pub dp_rank: Option<u64>,
}

/// Decodes a batch in either encoding.
pub fn decode_batch(payload: &[u8]) -> Result<VllmBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let named = matches!(r.peek()?, Marker::FixMap(_) | Marker::Map16 | Marker::Map32);
    let mut batch = VllmBatch {
        ts: 0.0,
        events: Vec::new(),
        dp_rank: None,
    };
    if named {
        for _ in 0..r.map()? {
            match r.str()? {
                "ts" => batch.ts = r.f64()?,
                "events" => batch.events = events(&mut r)?,
                "data_parallel_rank" => batch.dp_rank = opt_uint(&mut r)?,
                _ => return Err(DecodeError::Malformed("unknown batch field")),
            }
        }
    } else {
        let n = r.array()?;
        if !(2..=3).contains(&n) {
            return Err(DecodeError::Malformed("a batch array has 2 or 3 fields"));
        }
        batch.ts = r.f64()?;
        batch.events = events(&mut r)?;
        if n == 3 {
            batch.dp_rank = opt_uint(&mut r)?;
        }
    }
    if !r.at_end() {
        return Err(DecodeError::Malformed("bytes after the batch"));
    }
    Ok(batch)
}

fn opt_uint(r: &mut Reader<'_>) -> Result<Option<u64>, DecodeError> {
    Ok(if r.nil()? { None } else { Some(r.uint()?) })
}

fn events(r: &mut Reader<'_>) -> Result<Vec<VllmEvent>, DecodeError> {
    let n = r.array()?;
    let mut out = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let tagged = matches!(r.peek()?, Marker::FixMap(_) | Marker::Map16 | Marker::Map32);
        out.push(if tagged { named_event(r)? } else { positional_event(r)? });
    }
    Ok(out)
}

fn kind(tag: &str) -> Result<PageEventKind, DecodeError> {
    match tag {
        "BlockStored" => Ok(PageEventKind::Stored),
        "BlockRemoved" => Ok(PageEventKind::Removed),
        "AllBlocksCleared" => Ok(PageEventKind::Cleared),
        other => Err(DecodeError::UnknownTag(other.chars().take(40).collect())),
    }
}

fn empty(kind: PageEventKind) -> VllmEvent {
    VllmEvent {
        kind,
        hashes: Vec::new(),
        block_size: 0,
        parent: None,
        token_ids: Vec::new(),
        medium: None,
    }
}

/// `["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name, …]`,
/// `["BlockRemoved", hashes, medium, …]`, `["AllBlocksCleared"]`.
fn positional_event(r: &mut Reader<'_>) -> Result<VllmEvent, DecodeError> {
    let n = r.array()?;
    if n == 0 {
        return Err(DecodeError::Malformed("an empty event"));
    }
    let mut ev = empty(kind(r.str()?)?);
    let fields: &[&str] = match ev.kind {
        PageEventKind::Stored => &[
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        ],
        PageEventKind::Removed => &["block_hashes", "medium"],
        PageEventKind::Cleared => &[],
    };
    if n - 1 < fields.len().min(6) {
        return Err(DecodeError::Malformed("an event with too few fields"));
    }
    for name in fields.iter().take(n - 1) {
        field(r, &mut ev, name)?;
    }
    for _ in fields.len() + 1..n {
        skip(r, 0)?;
    }
    Ok(ev)
}

fn named_event(r: &mut Reader<'_>) -> Result<VllmEvent, DecodeError> {
    let n = r.map()?;
    if n == 0 || r.str()? != "type" {
        return Err(DecodeError::Malformed("a named event starts with its type"));
    }
    let mut ev = empty(kind(r.str()?)?);
    for _ in 1..n {
        let name = r.str()?;
        field(r, &mut ev, name)?;
    }
    Ok(ev)
}

fn field(r: &mut Reader<'_>, ev: &mut VllmEvent, name: &str) -> Result<(), DecodeError> {
    match name {
        "block_hashes" => {
            let n = r.array()?;
            ev.hashes.reserve(n.min(1 << 12));
            for _ in 0..n {
                ev.hashes.push(block_hash(r)?);
            }
        }
        "parent_block_hash" => {
            if !r.nil()? {
                ev.parent = Some(block_hash(r)?);
            }
        }
        "block_size" => ev.block_size = r.uint()?,
        "medium" => {
            if !r.nil()? {
                ev.medium = Some(match r.str()? {
                    "GPU" => TierKind::Device,
                    "CPU_PINNED" => TierKind::Host,
                    "SHARED" | "STORAGE" => TierKind::Pool,
                    other => return Err(DecodeError::UnknownMedium(other.chars().take(40).collect())),
                });
            }
        }
        "token_ids" => {
            let n = r.array()?;
            ev.token_ids.reserve(n.min(1 << 12));
            for _ in 0..n {
                ev.token_ids.push(r.uint()?);
            }
        }
        _ => skip(r, 0)?,
    }
    Ok(())
}

fn block_hash(r: &mut Reader<'_>) -> Result<BlockHash, DecodeError> {
    Ok(if r.is_uint()? {
        BlockHash::Int(r.uint()?)
    } else {
        let b = r.bin()?;
        BlockHash::Bytes(PageHash::new(b).map_err(|_| DecodeError::Malformed("a block hash length"))?)
    })
}

/// Deepest nesting of arrays [`skip`] follows (the formats nest two deep); deeper input is
/// malformed, and refusing it bounds the recursion whatever the payload.
const MAX_SKIP_DEPTH: usize = 4;

/// Skips one value of the kinds these formats carry (nil, integers, strings, bytes, and
/// arrays of them), `depth` arrays down.
fn skip(r: &mut Reader<'_>, depth: usize) -> Result<(), DecodeError> {
    if r.nil()? {
        return Ok(());
    }
    if r.is_uint()? {
        r.uint()?;
        return Ok(());
    }
    match r.peek()? {
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
            r.str()?;
        }
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
            r.bin()?;
        }
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            if depth == MAX_SKIP_DEPTH {
                return Err(DecodeError::Malformed("arrays nested too deep"));
            }
            for _ in 0..r.array()? {
                skip(r, depth + 1)?;
            }
        }
        _ => return Err(DecodeError::Malformed("a field of an unexpected type")),
    }
    Ok(())
}
