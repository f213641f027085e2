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

use rmpv::Value;

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

/// Decodes a payload into its object events and the count of events skipped.
pub fn decode_payload(payload: &[u8]) -> Result<(Vec<ObjectEvent>, usize), EventFormatError> {
    let bad = |m: &str| EventFormatError::Payload(m.to_owned());
    let v = rmpv::decode::read_value(&mut &payload[..]).map_err(|e| EventFormatError::Payload(e.to_string()))?;
    let top = v.as_array().ok_or_else(|| bad("not an array"))?;
    let list = top
        .get(1)
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no event list"))?;
    let mut out = Vec::with_capacity(list.len());
    let mut skipped = 0;
    for ev in list {
        match event(ev) {
            Some(e) => out.push(e),
            None => skipped += 1,
        }
    }
    Ok((out, skipped))
}

fn event(ev: &Value) -> Option<ObjectEvent> {
    let map = ev.as_map()?;
    let field = |name: &str| map.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v);
    let kind = field("event_type")
        .and_then(Value::as_str)
        .or_else(|| field("type").and_then(Value::as_str))?;
    let key = || field("object_key").and_then(Value::as_str).filter(|k| !k.is_empty());
    match kind {
        "stored" | "BlockStored" => Some(ObjectEvent::Stored(key()?.to_owned())),
        "removed" | "BlockRemoved" => Some(ObjectEvent::Removed(key()?.to_owned())),
        "cleared" | "AllBlocksCleared" => Some(ObjectEvent::Cleared),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
