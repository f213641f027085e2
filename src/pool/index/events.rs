//! Reading Store/Remove object events in Mooncake's format.
//!
//! Mooncake's publisher (`kv_event_publisher.cpp`) and kvtier's own
//! ([`crate::publish::mooncake`]) send ZMQ PUB `[topic, seq (8 bytes big-endian), payload]`
//! with `payload` msgpack `[timestamp_ms, [event, …], dp_rank]`. An event is a map; what the
//! index needs is its kind, from `event_type` (`stored` / `removed` / `cleared`) or, where
//! only the legacy field is sent, `type` (`BlockStored` / `BlockRemoved` /
//! `AllBlocksCleared`), and its `object_key` (Mooncake's master sends it with
//! `--kv_events_emit_object_key=true`). An event without an object key cannot be mapped to
//! a page and is counted as skipped.

/// One object event, as the index applies it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ObjectEvent {
    Stored(String),
    Removed(String),
    /// Everything the publisher described is gone (a pool clear).
    Cleared,
}

/// Why a message was not read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EventFormatError {
    #[error("message has {0} frames; want topic, sequence and payload")]
    Frames(usize),
    #[error("sequence frame of {0} bytes; want 8")]
    Sequence(usize),
    #[error("payload is not msgpack [timestamp, [event, ...], dp_rank]: {0}")]
    Payload(String),
}

/// A decoded message: its sequence, its events, and how many events had no usable key or
/// kind.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub seq: u64,
    pub events: Vec<ObjectEvent>,
    pub skipped: usize,
}

/// Decodes one multipart message.
pub fn decode(frames: &[Vec<u8>]) -> Result<Batch, EventFormatError> {
    let [_topic, seq, payload] = frames else {
        return Err(EventFormatError::Frames(frames.len()));
    };
    let seq: [u8; 8] = seq
        .as_slice()
        .try_into()
        .map_err(|_| EventFormatError::Sequence(seq.len()))?;
    let (events, skipped) = decode_payload(payload)?;
    Ok(Batch {
        seq: u64::from_be_bytes(seq),
        events,
        skipped,
    })
}

/// The longest object key an event may name. Far above any key kvtier renders (a tag, a
/// namespace of at most three 4 KiB strings, escaped, a layout field, a page hash and a
/// suffix) or SGLang does; a longer one is skipped, so a peer cannot make the index hold
/// keys of any size.
pub const MAX_KEY_BYTES: usize = 64 << 10;

/// Decodes a payload into its object events and the count of events skipped.
///
/// The payload is walked in place, one value at a time: nothing is built for what the
/// index does not read, so a peer's message costs memory in proportion to the keys it
/// names, never to how its msgpack nests (a tree of the whole message cost 40 bytes per
/// 1-byte element).
pub fn decode_payload(payload: &[u8]) -> Result<(Vec<ObjectEvent>, usize), EventFormatError> {
    let bad = |m: &str| EventFormatError::Payload(m.to_owned());
    let mut c = Cursor { rest: payload };
    let Head::Array(top) = c.head()? else {
        return Err(bad("not an array"));
    };
    if top < 2 {
        return Err(bad("no event list"));
    }
    c.skip(1)?;
    let Head::Array(n) = c.head()? else {
        return Err(bad("no event list"));
    };
    let mut out = Vec::new();
    let mut skipped = 0;
    for _ in 0..n {
        match event(&mut c)? {
            Some(e) => out.push(e),
            None => skipped += 1,
        }
    }
    Ok((out, skipped))
}

/// One event: a map whose `event_type` (or legacy `type`) and `object_key` fields are
/// strings; the first of each name counts, any other field is skipped unread.
fn event(c: &mut Cursor<'_>) -> Result<Option<ObjectEvent>, EventFormatError> {
    let pairs = match c.head()? {
        Head::Map(n) => n,
        other => {
            c.skip_rest(other)?;
            return Ok(None);
        }
    };
    let (mut kind, mut legacy, mut key) = (None, None, None);
    for _ in 0..pairs {
        let name = match c.head()? {
            Head::Str(s) => Some(s),
            other => {
                c.skip_rest(other)?;
                None
            }
        };
        let value = match c.head()? {
            Head::Str(s) => Some(s),
            other => {
                c.skip_rest(other)?;
                None
            }
        };
        let slot = match name {
            Some(b"event_type") => &mut kind,
            Some(b"type") => &mut legacy,
            Some(b"object_key") => &mut key,
            _ => continue,
        };
        if slot.is_none() {
            *slot = Some(value);
        }
    }
    fn text(v: Option<Option<&[u8]>>) -> Option<&str> {
        v.flatten().and_then(|b| std::str::from_utf8(b).ok())
    }
    let key = || {
        text(key)
            .filter(|k| !k.is_empty() && k.len() <= MAX_KEY_BYTES)
            .map(str::to_owned)
    };
    Ok(match text(kind).or_else(|| text(legacy)) {
        Some("stored" | "BlockStored") => key().map(ObjectEvent::Stored),
        Some("removed" | "BlockRemoved") => key().map(ObjectEvent::Removed),
        Some("cleared" | "AllBlocksCleared") => Some(ObjectEvent::Cleared),
        _ => None,
    })
}

/// A msgpack value's header, with a string's bytes.
enum Head<'a> {
    Array(u32),
    Map(u32),
    Str(&'a [u8]),
    /// A scalar, binary or extension value, already consumed whole.
    Other,
}

/// Reads msgpack in place.
struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EventFormatError> {
        if n > self.rest.len() {
            return Err(EventFormatError::Payload("truncated".into()));
        }
        let (a, b) = self.rest.split_at(n);
        self.rest = b;
        Ok(a)
    }

    fn len(&mut self, bytes: usize) -> Result<usize, EventFormatError> {
        Ok(self.take(bytes)?.iter().fold(0usize, |n, &b| n << 8 | usize::from(b)))
    }

    fn head(&mut self) -> Result<Head<'a>, EventFormatError> {
        use rmp::Marker as M;
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let marker = M::from_u8(self.take(1)?[0]);
        Ok(match marker {
            M::FixArray(n) => Head::Array(n.into()),
            M::Array16 => Head::Array(count(self.len(2)?)),
            M::Array32 => Head::Array(count(self.len(4)?)),
            M::FixMap(n) => Head::Map(n.into()),
            M::Map16 => Head::Map(count(self.len(2)?)),
            M::Map32 => Head::Map(count(self.len(4)?)),
            M::FixStr(n) => Head::Str(self.take(n.into())?),
            M::Str8 => {
                let n = self.len(1)?;
                Head::Str(self.take(n)?)
            }
            M::Str16 => {
                let n = self.len(2)?;
                Head::Str(self.take(n)?)
            }
            M::Str32 => {
                let n = self.len(4)?;
                Head::Str(self.take(n)?)
            }
            M::Reserved => return Err(EventFormatError::Payload("reserved marker 0xc1".into())),
            other => {
                // Scalars, binaries and extensions: their size is in the marker or follows it.
                let n = match other {
                    M::U8 | M::I8 => 1,
                    M::U16 | M::I16 => 2,
                    M::U32 | M::I32 | M::F32 => 4,
                    M::U64 | M::I64 | M::F64 => 8,
                    M::Bin8 => self.len(1)?,
                    M::Bin16 => self.len(2)?,
                    M::Bin32 => self.len(4)?,
                    M::FixExt1 => 2,
                    M::FixExt2 => 3,
                    M::FixExt4 => 5,
                    M::FixExt8 => 9,
                    M::FixExt16 => 17,
                    M::Ext8 => self.len(1)? + 1,
                    M::Ext16 => self.len(2)? + 1,
                    M::Ext32 => self.len(4)? + 1,
                    _ => 0,
                };
                self.take(n)?;
                Head::Other
            }
        })
    }

    /// Skips what is left of a value whose header was read.
    fn skip_rest(&mut self, head: Head<'a>) -> Result<(), EventFormatError> {
        match head {
            Head::Array(n) => self.skip(u64::from(n)),
            Head::Map(n) => self.skip(2 * u64::from(n)),
            Head::Str(_) | Head::Other => Ok(()),
        }
    }

    /// Skips `n` whole values, nested ones included, keeping only a count: every header
    /// takes at least a byte, so a count past what is left fails at once.
    fn skip(&mut self, mut n: u64) -> Result<(), EventFormatError> {
        while n > 0 {
            if n > self.rest.len() as u64 {
                return Err(EventFormatError::Payload("truncated".into()));
            }
            n -= 1;
            match self.head()? {
                Head::Array(k) => n += u64::from(k),
                Head::Map(k) => n += 2 * u64::from(k),
                Head::Str(_) | Head::Other => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn payload(events: Vec<Vec<(&str, Value)>>) -> Vec<u8> {
        let evs: Vec<Value> = events
            .into_iter()
            .map(|e| Value::Map(e.into_iter().map(|(k, v)| (Value::from(k), v)).collect()))
            .collect();
        let v = Value::Array(vec![Value::from(1u64), Value::Array(evs), Value::from(0u64)]);
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, &v).unwrap();
        buf
    }

    #[test]
    fn reads_rfc_and_legacy_kinds_and_skips_keyless() {
        let p = payload(vec![
            vec![("event_type", "stored".into()), ("object_key", "a_1_k".into())],
            vec![("type", "BlockRemoved".into()), ("object_key", "a_1_v".into())],
            // Mooncake's master without --kv_events_emit_object_key: nothing to map.
            vec![
                ("event_type", "stored".into()),
                ("seq_hashes", Value::Array(vec![7.into()])),
            ],
            vec![("event_type", "cleared".into())],
        ]);
        let frames = vec![Vec::new(), 5u64.to_be_bytes().to_vec(), p];
        let b = decode(&frames).unwrap();
        assert_eq!(b.seq, 5);
        assert_eq!(b.skipped, 1);
        assert_eq!(
            b.events,
            vec![
                ObjectEvent::Stored("a_1_k".into()),
                ObjectEvent::Removed("a_1_v".into()),
                ObjectEvent::Cleared
            ]
        );
        assert_eq!(decode(&frames[..2]), Err(EventFormatError::Frames(2)));
        let short = vec![Vec::new(), vec![1, 2], Vec::new()];
        assert_eq!(decode(&short), Err(EventFormatError::Sequence(2)));
        assert!(matches!(decode_payload(b"\xc1"), Err(EventFormatError::Payload(_))));
    }

    fn encode(v: &Value) -> Vec<u8> {
        let mut buf = Vec::new();
        rmpv::encode::write_value(&mut buf, v).unwrap();
        buf
    }

    #[test]
    fn what_the_index_does_not_read_is_skipped_in_place() {
        let ev = |fields: Vec<(Value, Value)>| Value::Map(fields);
        let s = |x: &str| Value::from(x);
        let nested = Value::Array(vec![Value::Map(vec![(s("k"), Value::Array(vec![Value::Nil; 3]))]); 2]);
        let events = vec![
            // Not a map: skipped whole, nesting and all.
            nested.clone(),
            // Non-string names and values, a binary and an extension between the fields.
            ev(vec![
                (Value::from(7), nested.clone()),
                (s("blob"), Value::Binary(vec![1; 300])),
                (s("ext"), Value::Ext(3, vec![9; 70_000])),
                (s("type"), s("BlockStored")),
                (s("object_key"), s("a_0_k")),
                (s("object_key"), s("ignored, the first counts")),
                (s("f"), Value::F64(1.5)),
            ]),
            // A key at the bound is read; one byte past it is skipped.
            ev(vec![
                (s("event_type"), s("removed")),
                (s("object_key"), s(&"k".repeat(MAX_KEY_BYTES))),
            ]),
            ev(vec![
                (s("event_type"), s("stored")),
                (s("object_key"), s(&"k".repeat(MAX_KEY_BYTES + 1))),
            ]),
            // A kind that is not a string.
            ev(vec![(s("event_type"), Value::from(1)), (s("object_key"), s("b_0_k"))]),
        ];
        let p = encode(&Value::Array(vec![Value::from(9u64), Value::Array(events), Value::Nil]));
        let (got, skipped) = decode_payload(&p).unwrap();
        assert_eq!(
            got,
            vec![
                ObjectEvent::Stored("a_0_k".into()),
                ObjectEvent::Removed("k".repeat(MAX_KEY_BYTES))
            ]
        );
        assert_eq!(skipped, 3);
        // A list of a million one-byte events is a million skips, and any cut of a message
        // before its last event ends is an error, never a panic or a partial answer (the
        // trailing dp_rank is not read).
        let p = encode(&Value::Array(vec![
            Value::from(1u64),
            Value::Array(vec![Value::Nil; 1 << 20]),
        ]));
        assert_eq!(decode_payload(&p).unwrap(), (Vec::new(), 1 << 20));
        let whole = payload(vec![vec![
            ("event_type", "stored".into()),
            ("object_key", "a_1_k".into()),
        ]]);
        for cut in 0..whole.len() - 1 {
            assert!(decode_payload(&whole[..cut]).is_err(), "cut at {cut}");
        }
        // A count far past the bytes left fails at once.
        let mut lie = vec![0x92, 0x01, 0xdd];
        lie.extend(u32::MAX.to_be_bytes());
        assert!(decode_payload(&lie).is_err());
        let map_lie = [0x92, 0x01, 0x91, 0xdf, 0xff, 0xff, 0xff, 0xff];
        assert!(decode_payload(&map_lie).is_err());
    }
}
