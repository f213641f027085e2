//! Wire-shape tests of the vLLM encoder and decoder.

use super::*;
use crate::tier::TierKind;

fn ev(seq: u64, kind: PageEventKind, tier: TierKind, hash: PageHash) -> PageEvent {
    PageEvent {
        seq,
        kind,
        tier,
        ns: NamespaceId(0),
        hash,
        at_ms: 0,
    }
}

#[test]
fn positional_and_tagged_shapes() {
    let long = PageHash::new(&[7u8; 32]).unwrap();
    let evs = [
        ev(
            1,
            PageEventKind::Stored,
            TierKind::Host,
            PageHash::from_u64(0xdead_beef),
        ),
        ev(2, PageEventKind::Removed, TierKind::Pool, long),
        ev(3, PageEventKind::Cleared, TierKind::Device, PageHash::from_u64(0)),
    ];
    let legacy = VllmConfig {
        encoding: Encoding::Positional,
        hashes: HashFormat::Auto,
        ..VllmConfig::default()
    };
    let mut buf = Vec::new();
    encode_batch(&mut buf, &legacy, 1.25, &evs, |_| 16);
    let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
    let b = v.as_array().unwrap();
    assert_eq!((b[0].as_f64(), b[2].as_u64()), (Some(1.25), Some(0)));
    let e = b[1].as_array().unwrap();
    let s = e[0].as_array().unwrap();
    assert_eq!(s.len(), 8);
    assert_eq!(s[0].as_str(), Some("BlockStored"));
    assert_eq!(s[1].as_array().unwrap()[0].as_u64(), Some(0xdead_beef));
    assert!(s[2].is_nil() && s[3].as_array().unwrap().is_empty() && s[5].is_nil() && s[7].is_nil());
    assert_eq!((s[4].as_u64(), s[6].as_str()), (Some(16), Some("CPU_PINNED")));
    let r = e[1].as_array().unwrap();
    assert_eq!(r[0].as_str(), Some("BlockRemoved"));
    assert_eq!(r[1].as_array().unwrap()[0].as_slice(), Some(&[7u8; 32][..]));
    assert_eq!(r[2].as_str(), Some("SHARED"));
    assert_eq!(e[2].as_array().unwrap().len(), 1);

    // Tagged (vLLM 0.24+): the batch stays an array, each event is a map tagged by type.
    let cfg = VllmConfig {
        hashes: HashFormat::Bytes,
        dp_rank: 3,
        ..VllmConfig::default()
    };
    assert_eq!(cfg.encoding, Encoding::Tagged);
    buf.clear();
    encode_batch(&mut buf, &cfg, 2.0, &evs[..1], |_| 16);
    let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
    let m = v.as_array().unwrap();
    assert_eq!((m.len(), m[0].as_f64(), m[2].as_u64()), (3, Some(2.0), Some(3)));
    let s = m[1].as_array().unwrap()[0].as_map().unwrap();
    let keys: Vec<_> = s.iter().map(|(k, _)| k.as_str().unwrap()).collect();
    let want = [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ];
    assert_eq!(keys, want);
    assert_eq!(
        s[1].1.as_array().unwrap()[0].as_slice(),
        Some(&0xdead_beefu64.to_be_bytes()[..])
    );
}

#[test]
fn stored_events_carry_the_engines_tokens_and_wide_hashes_their_low_64_bits() {
    let wide: Vec<u8> = (1..=32).collect();
    let wide = PageHash::new(&wide).unwrap();
    let parent = PageHash::from_u64(77);
    let evs = [
        ev(1, PageEventKind::Stored, TierKind::Host, wide),
        ev(2, PageEventKind::Stored, TierKind::Pool, PageHash::from_u64(5)),
    ];
    let table = crate::publish::tokens::TokenTable::default();
    table.record(NamespaceId(0), Some(parent), &[wide], &[vec![10, 11, 12]]);
    let mut buf = Vec::new();
    encode_batch_with(&mut buf, &VllmConfig::default(), 1.0, &evs, &mut |_| 3, &mut |e| {
        table.get(e.ns, &e.hash)
    });
    let b = decode_batch(&buf).unwrap();
    // The low 64 bits: bytes 25..=32, big-endian.
    assert_eq!(low_u64(&wide), 0x191a_1b1c_1d1e_1f20);
    assert_eq!(b.events[0].hashes, vec![BlockHash::Int(0x191a_1b1c_1d1e_1f20)]);
    assert_eq!(b.events[0].parent, Some(BlockHash::Int(77)));
    assert_eq!(b.events[0].token_ids, vec![10, 11, 12]);
    // A page stored without tokens: `[]` and no parent, as before.
    assert_eq!((b.events[1].parent, b.events[1].token_ids.len()), (None, 0));
}

#[test]
fn decoder_reads_both_encodings_back() {
    let long = PageHash::new(&[7u8; 32]).unwrap();
    let evs = [
        ev(1, PageEventKind::Stored, TierKind::Host, PageHash::from_u64(u64::MAX)),
        ev(2, PageEventKind::Removed, TierKind::Pool, long),
        ev(3, PageEventKind::Cleared, TierKind::Device, PageHash::from_u64(0)),
    ];
    let want = vec![
        VllmEvent {
            kind: PageEventKind::Stored,
            hashes: vec![BlockHash::Int(u64::MAX)],
            block_size: 16,
            parent: None,
            token_ids: vec![],
            medium: Some(TierKind::Host),
        },
        VllmEvent {
            kind: PageEventKind::Removed,
            hashes: vec![BlockHash::Bytes(long)],
            block_size: 0,
            parent: None,
            token_ids: vec![],
            medium: Some(TierKind::Pool),
        },
        VllmEvent {
            kind: PageEventKind::Cleared,
            hashes: vec![],
            block_size: 0,
            parent: None,
            token_ids: vec![],
            medium: None,
        },
    ];
    for encoding in [Encoding::Positional, Encoding::Tagged] {
        let cfg = VllmConfig {
            encoding,
            hashes: HashFormat::Auto,
            dp_rank: 5,
            ..VllmConfig::default()
        };
        let mut buf = Vec::new();
        encode_batch(&mut buf, &cfg, 3.5, &evs, |_| 16);
        let b = decode_batch(&buf).unwrap();
        assert_eq!((b.ts, b.dp_rank), (3.5, Some(5)));
        assert_eq!(b.events, want);
        assert!(decode_batch(&buf[..buf.len() - 1]).is_err());
    }
}

#[test]
fn malformed_batches_are_typed_errors() {
    use crate::publish::wire::{ReadError, Writer};
    let evs = [ev(1, PageEventKind::Stored, TierKind::Host, PageHash::from_u64(9))];
    for encoding in [Encoding::Positional, Encoding::Tagged] {
        let cfg = VllmConfig {
            encoding,
            ..VllmConfig::default()
        };
        let mut buf = Vec::new();
        encode_batch(&mut buf, &cfg, 1.0, &evs, |_| 16);
        // Every cut of a batch is an error, never a panic.
        for cut in 0..buf.len() {
            let e = decode_batch(&buf[..cut]).unwrap_err();
            assert!(
                matches!(e, DecodeError::Read(ReadError::Truncated | ReadError::Oversized { .. })),
                "{encoding:?} cut at {cut}: {e}"
            );
        }
    }
    // An events array claiming 2^32 - 1 events in a few bytes is refused at its header.
    let huge = [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x00];
    assert_eq!(
        decode_batch(&huge),
        Err(DecodeError::Read(ReadError::Oversized {
            what: "an array",
            len: u32::MAX as u64,
            left: 1,
        }))
    );
    // A timestamp that is a string, and an event tag that is an integer.
    let mut buf = Vec::new();
    let mut w = Writer::new(&mut buf);
    w.array(3);
    w.str("now");
    drop(w);
    assert_eq!(
        decode_batch(&buf),
        Err(DecodeError::Read(ReadError::Type {
            want: "a float",
            found: 0xa3,
        }))
    );
    let positional = |event: &dyn Fn(&mut Writer<'_>)| {
        let mut buf = Vec::new();
        let mut w = Writer::new(&mut buf);
        w.array(3);
        w.f64(1.0);
        w.array(1);
        event(&mut w);
        w.uint(0);
        drop(w);
        decode_batch(&buf)
    };
    let e = positional(&|w: &mut Writer<'_>| {
        w.array(1);
        w.uint(7);
    });
    assert!(
        matches!(e, Err(DecodeError::Read(ReadError::Type { found: 7, .. }))),
        "{e:?}"
    );
    let e = positional(&|w: &mut Writer<'_>| {
        w.array(1);
        w.str("BlockMoved");
    });
    assert_eq!(e, Err(DecodeError::UnknownTag("BlockMoved".into())));
    // Extra fields after `BlockRemoved`'s are skipped, but arrays nested deeper than the
    // format's own are refused rather than followed (bounded recursion).
    let removed = |w: &mut Writer<'_>, nesting: usize| {
        w.array(4);
        w.str("BlockRemoved");
        w.array(1);
        w.uint(5);
        w.str("SHARED");
        for _ in 0..nesting {
            w.array(1);
        }
        w.uint(1);
    };
    let b = positional(&|w: &mut Writer<'_>| removed(w, 2)).unwrap();
    assert_eq!(b.events[0].hashes, vec![BlockHash::Int(5)]);
    assert_eq!(b.events[0].medium, Some(TierKind::Pool));
    let e = positional(&|w: &mut Writer<'_>| removed(w, 5_000));
    assert_eq!(e, Err(DecodeError::Malformed("arrays nested too deep")));
}

#[test]
fn local_pool_pages_say_storage_and_local() {
    let h = PageHash::from_u64(0x1234);
    let evs = [
        ev(1, PageEventKind::Stored, TierKind::Pool, h),
        ev(2, PageEventKind::Removed, TierKind::Pool, h),
        ev(3, PageEventKind::Stored, TierKind::Host, h),
    ];
    let local = VllmConfig {
        pool_medium: PoolMedium::Local,
        ..VllmConfig::default()
    };
    let mut buf = Vec::new();
    encode_batch(&mut buf, &local, 1.0, &evs, |_| 16);
    let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
    let e = v.as_array().unwrap()[1].as_array().unwrap();
    let fields = |i: usize| -> Vec<(String, rmpv::Value)> {
        e[i].as_map()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.clone()))
            .collect()
    };
    let get = |f: &[(String, rmpv::Value)], k: &str| f.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let stored = fields(0);
    assert_eq!(stored.len(), 9);
    assert_eq!(stored.last().unwrap().0, "locality");
    assert_eq!(get(&stored, "medium").unwrap().as_str(), Some("STORAGE"));
    assert_eq!(get(&stored, "locality").unwrap().as_str(), Some("LOCAL"));
    let removed = fields(1);
    assert_eq!(removed.len(), 4);
    assert_eq!(get(&removed, "medium").unwrap().as_str(), Some("STORAGE"));
    assert_eq!(get(&removed, "locality").unwrap().as_str(), Some("LOCAL"));
    // Other tiers are as before: no locality.
    let host = fields(2);
    assert_eq!(host.len(), 8);
    assert_eq!(get(&host, "medium").unwrap().as_str(), Some("CPU_PINNED"));
    assert!(get(&host, "locality").is_none());
    // Our own decoder reads both back as the pool tier.
    let b = decode_batch(&buf).unwrap();
    assert_eq!(b.events[0].medium, Some(TierKind::Pool));
    assert_eq!(b.events[1].medium, Some(TierKind::Pool));

    // The legacy positional form has no locality field: 8 and 3 fields, medium STORAGE.
    let legacy = VllmConfig {
        encoding: Encoding::Positional,
        ..local.clone()
    };
    buf.clear();
    encode_batch(&mut buf, &legacy, 1.0, &evs[..2], |_| 16);
    let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
    let e = v.as_array().unwrap()[1].as_array().unwrap();
    let s = e[0].as_array().unwrap();
    assert_eq!((s.len(), s[6].as_str()), (8, Some("STORAGE")));
    let r = e[1].as_array().unwrap();
    assert_eq!((r.len(), r[2].as_str()), (3, Some("STORAGE")));

    // A shared store's pages keep SHARED and no locality.
    buf.clear();
    encode_batch(&mut buf, &VllmConfig::default(), 1.0, &evs[..1], |_| 16);
    let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
    let s = v.as_array().unwrap()[1].as_array().unwrap()[0]
        .as_map()
        .unwrap()
        .clone();
    assert_eq!(s.len(), 8);
    assert!(
        s.iter()
            .any(|(k, v)| k.as_str() == Some("medium") && v.as_str() == Some("SHARED"))
    );
}
