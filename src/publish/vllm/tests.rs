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
fn positional_and_named_shapes() {
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
    let mut buf = Vec::new();
    encode_batch(&mut buf, &VllmConfig::default(), 1.25, &evs, |_| 16);
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

    let cfg = VllmConfig {
        encoding: Encoding::Named,
        hashes: HashFormat::Bytes,
        dp_rank: 3,
        ..VllmConfig::default()
    };
    buf.clear();
    encode_batch(&mut buf, &cfg, 2.0, &evs[..1], |_| 16);
    let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
    let m = v.as_map().unwrap();
    let keys: Vec<_> = m.iter().map(|(k, _)| k.as_str().unwrap()).collect();
    assert_eq!(keys, ["ts", "events", "data_parallel_rank"]);
    assert_eq!(m[2].1.as_u64(), Some(3));
    let s = m[1].1.as_array().unwrap()[0].as_map().unwrap();
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
            medium: Some(TierKind::Host),
        },
        VllmEvent {
            kind: PageEventKind::Removed,
            hashes: vec![BlockHash::Bytes(long)],
            block_size: 0,
            medium: Some(TierKind::Pool),
        },
        VllmEvent {
            kind: PageEventKind::Cleared,
            hashes: vec![],
            block_size: 0,
            medium: None,
        },
    ];
    for encoding in [Encoding::Positional, Encoding::Named] {
        let cfg = VllmConfig {
            encoding,
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
