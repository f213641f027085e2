//! Golden bytes of the event encodings: a fixed set of vLLM batches (positional and named,
//! every hash format, 8- and 32-byte hashes, integers and lengths at each MessagePack
//! width boundary) and Mooncake object batches, checked against `golden_batches.txt`.
//! The positional lines were recorded from the hand-written encoder that rmp replaced, so
//! they prove the wire bytes did not change with the library; an intended format change
//! updates the file in the same commit and says so (the tagged vLLM 0.24+ events, the
//! low-64-bit integer hashes and the Mooncake superset fields were such changes).

use super::mooncake::{self, MooncakeConfig, ObjectEvent};
use super::vllm::{self, Encoding, HashFormat, VllmConfig};
use crate::events::{PageEvent, PageEventKind};
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;

const GOLDEN: &str = include_str!("golden_batches.txt");

fn ev(seq: u64, kind: PageEventKind, tier: TierKind, ns: u16, hash: PageHash) -> PageEvent {
    PageEvent {
        seq,
        kind,
        tier,
        ns: NamespaceId(ns),
        hash,
        at_ms: 0,
    }
}

fn long(fill: u8) -> PageHash {
    let bytes: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(fill)).collect();
    PageHash::new(&bytes).unwrap()
}

/// Every event kind on every tier, with 8-byte hashes around each uint width.
fn small_events() -> Vec<PageEvent> {
    let hashes = super::wire::tests::UINTS;
    let tiers = [TierKind::Device, TierKind::Host, TierKind::Pool];
    let mut out = Vec::new();
    for (i, &h) in hashes.iter().enumerate() {
        let kind = if i % 3 == 2 {
            PageEventKind::Removed
        } else {
            PageEventKind::Stored
        };
        out.push(ev(i as u64, kind, tiers[i % 3], i as u16 % 3, PageHash::from_u64(h)));
    }
    out.push(ev(99, PageEventKind::Cleared, TierKind::Host, 0, PageHash::from_u64(0)));
    out
}

/// 32-byte (chain) hashes, and 20 events so the events array needs `array16`.
fn long_events() -> Vec<PageEvent> {
    (0..20u8)
        .map(|i| {
            let kind = if i % 2 == 0 {
                PageEventKind::Stored
            } else {
                PageEventKind::Removed
            };
            ev(i as u64, kind, TierKind::Pool, 1, long(i + 1))
        })
        .collect()
}

fn vllm_case(encoding: Encoding, hashes: HashFormat, dp_rank: u32, events: &[PageEvent]) -> Vec<u8> {
    let cfg = VllmConfig {
        encoding,
        hashes,
        dp_rank,
        ..VllmConfig::default()
    };
    let mut buf = Vec::new();
    // Block sizes across widths: fixint, uint16, uint32.
    vllm::encode_batch(&mut buf, &cfg, 1_700_000_000.125, events, |ns| {
        [16, 300, 70_000][ns.0 as usize % 3]
    });
    buf
}

fn mooncake_case(tenant: &str, key_len: usize, objects: usize, dp_rank: u32) -> Vec<u8> {
    let cfg = MooncakeConfig {
        tenant_id: tenant.into(),
        group_id: "group-a".into(),
        dp_rank,
        ..MooncakeConfig::default()
    };
    let evs: Vec<PageEvent> = (0..objects as u64)
        .map(|i| {
            let kind = [PageEventKind::Stored, PageEventKind::Removed][i as usize % 2];
            let hash = if i % 2 == 0 {
                PageHash::from_u64(i * 1000)
            } else {
                long(i as u8)
            };
            ev(1_000 + i * 70_000, kind, TierKind::Pool, 0, hash)
        })
        .collect();
    let mut objs: Vec<ObjectEvent<'_>> = evs
        .iter()
        .enumerate()
        .map(|(i, e)| ObjectEvent {
            key: format!("{:x>1$}_{i}", "k", key_len),
            ev: e,
            ns: None,
        })
        .collect();
    let cleared = evs.first().map(|e| PageEvent {
        kind: PageEventKind::Cleared,
        ..*e
    });
    if let Some(c) = &cleared {
        objs.push(ObjectEvent {
            key: String::new(),
            ev: c,
            ns: None,
        });
    }
    let mut buf = Vec::new();
    let mut event_id = 1;
    mooncake::encode(&mut buf, &cfg, 1_700_000_000_123, &objs, &mut event_id);
    buf
}

/// The cases, by name, in the order of the golden file.
fn cases() -> Vec<(&'static str, Vec<u8>)> {
    let (small, long) = (small_events(), long_events());
    vec![
        (
            "vllm-positional-auto-8",
            vllm_case(Encoding::Positional, HashFormat::Auto, 0, &small),
        ),
        (
            "vllm-positional-auto-32",
            vllm_case(Encoding::Positional, HashFormat::Auto, 200, &long),
        ),
        (
            "vllm-positional-int-low64-32",
            vllm_case(Encoding::Positional, HashFormat::Int, 70_000, &long),
        ),
        (
            "vllm-tagged-auto-8",
            vllm_case(Encoding::Tagged, HashFormat::Auto, 1, &small),
        ),
        (
            "vllm-tagged-bytes-8",
            vllm_case(Encoding::Tagged, HashFormat::Bytes, 3, &small),
        ),
        (
            "vllm-tagged-int-32",
            vllm_case(Encoding::Tagged, HashFormat::Int, 0, &long),
        ),
        (
            "vllm-positional-empty",
            vllm_case(Encoding::Positional, HashFormat::Auto, 0, &[]),
        ),
        ("mooncake-3", mooncake_case("t", 5, 2, 2)),
        ("mooncake-str8-array16", mooncake_case(&"tenant".repeat(8), 40, 17, 300)),
        ("mooncake-str16", mooncake_case(&"x".repeat(300), 260, 1, u32::MAX)),
    ]
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn encodings_match_the_recorded_bytes() {
    let want: Vec<(&str, &str)> = GOLDEN
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.split_once(' ').expect("a golden line is `name hex`"))
        .collect();
    let got = cases();
    assert_eq!(
        want.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        got.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        "golden case names"
    );
    for ((name, want), (_, got)) in want.iter().zip(&got) {
        assert_eq!(*want, hex(got), "case {name}: bytes differ from the recorded encoding");
    }
}

/// Prints the golden file's contents (run with `--ignored --nocapture` to record it).
#[test]
#[ignore]
fn print_golden_batches() {
    for (name, bytes) in cases() {
        println!("{name} {}", hex(&bytes));
    }
}
