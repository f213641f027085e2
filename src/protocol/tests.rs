//! Property tests: every message round-trips, and no byte string makes a decoder panic.

use proptest::prelude::*;

use super::*;
use crate::hints::{Hint, HintOutcome, HintTarget, Reason};
use crate::layout::{AttentionKind, ByteOrder, Dtype, KvOrder, LayoutSpec};
use crate::page::{Namespace, PageHash};
use crate::tier::TierKind;
use crate::wire::PrefixHit;

fn hash() -> impl Strategy<Value = PageHash> {
    prop::collection::vec(any::<u8>(), 8..=32).prop_map(|b| PageHash::new(&b).unwrap())
}

fn hashes() -> impl Strategy<Value = Vec<PageHash>> {
    prop::collection::vec(hash(), 0..8)
}

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_/é-]{0,24}"
}

fn tier() -> impl Strategy<Value = TierKind> {
    prop::sample::select(TierKind::ALL.to_vec())
}

fn layout() -> impl Strategy<Value = LayoutSpec> {
    (
        any::<[u32; 5]>(),
        any::<(u16, u16, bool, bool)>(),
        prop::collection::vec(any::<u32>(), 0..4),
        (
            prop::sample::select(Dtype::ALL.to_vec()),
            prop::sample::select(KvOrder::ALL.to_vec()),
        ),
    )
        .prop_map(|(v, (tp, pp, mla, pf), pp_layers, (dtype, kv_order))| LayoutSpec {
            layers: v[0],
            kv_heads: v[1],
            head_dim: v[2],
            dtype_bytes: v[3],
            page_tokens: v[4],
            tp_size: tp,
            pp_size: pp,
            attention: if mla { AttentionKind::Mla } else { AttentionKind::Mha },
            byte_order: if pf {
                ByteOrder::PageFirst
            } else {
                ByteOrder::LayerFirst
            },
            pp_layers,
            dtype,
            kv_order,
        })
}

fn target() -> impl Strategy<Value = HintTarget> {
    prop_oneof![
        hashes().prop_map(HintTarget::Pages),
        hashes().prop_map(HintTarget::Prefix),
        text().prop_map(HintTarget::Session),
    ]
}

fn hint() -> impl Strategy<Value = Hint> {
    prop_oneof![
        target().prop_map(|target| Hint::Share { target }),
        (target(), tier(), any::<Option<u64>>()).prop_map(|(target, to, deadline_ms)| Hint::Prefetch {
            target,
            to,
            deadline_ms
        }),
        (target(), tier()).prop_map(|(target, to)| Hint::Demote { target, to }),
        (target(), tier(), any::<u64>()).prop_map(|(target, tier, ttl_ms)| Hint::Pin { target, tier, ttl_ms }),
        (target(), any::<i8>(), any::<u64>()).prop_map(|(target, priority, ttl_ms)| Hint::Retain {
            target,
            priority,
            ttl_ms
        }),
    ]
}

fn slots() -> impl Strategy<Value = Vec<ObjectSlot>> {
    prop::collection::vec(
        (any::<u16>(), any::<u32>(), any::<u64>()).prop_map(|(object, slot, generation)| ObjectSlot {
            object,
            slot,
            generation,
        }),
        0..5,
    )
}

fn advice() -> impl Strategy<Value = EngineAdvice> {
    let kind = prop::sample::select(vec![
        AdviceKind::EvictFirst,
        AdviceKind::Offload,
        AdviceKind::ReadyToLoad,
    ]);
    let pages =
        (kind, prop::collection::vec(hash(), 1..6)).prop_map(|(kind, hashes)| EngineAdvice::pages(kind, hashes));
    let session = (
        prop::sample::select(vec![AdviceKind::Pause, AdviceKind::Resume]),
        "[a-z0-9-]{1,40}",
    )
        .prop_map(|(kind, id)| EngineAdvice::session(kind, id));
    prop_oneof![pages, session]
}

fn request() -> impl Strategy<Value = Request> {
    let identity = (text(), text(), text(), text(), any::<[u16; 5]>()).prop_map(|(i, m, l, s, r)| Identity {
        instance: i,
        namespace: Namespace {
            model: m,
            lora: l,
            salt: s,
        },
        tp_rank: r[0],
        tp_size: r[1],
        pp_rank: r[2],
        pp_size: r[3],
        dp_rank: r[4],
    });
    let wait = prop_oneof![
        Just(LoadWait::BestEffort),
        Just(LoadWait::WaitComplete),
        any::<u32>().prop_map(LoadWait::Timeout)
    ];
    let phase = prop::sample::select(vec![
        SessionPhase::Reasoning,
        SessionPhase::Acting,
        SessionPhase::Paused,
        SessionPhase::Ended,
    ]);
    prop_oneof![
        (identity, layout()).prop_map(|(identity, layout)| Request::Connect { identity, layout }),
        (text(), any::<u32>(), any::<u64>()).prop_map(|(kind, pages, object_bytes)| Request::RegisterDevice(
            DeviceInfo {
                kind,
                pages,
                object_bytes
            }
        )),
        hashes().prop_map(|hashes| Request::Lookup { hashes }),
        (hashes(), text()).prop_map(|(hashes, session)| Request::Store { hashes, session }),
        (any::<u64>(), prop::collection::vec(any::<bool>(), 0..9))
            .prop_map(|(grant, written)| Request::Commit { grant, written }),
        any::<u64>().prop_map(|grant| Request::Abort { grant }),
        (hashes(), wait).prop_map(|(hashes, wait)| Request::Load { hashes, wait }),
        (any::<u64>(), any::<u32>()).prop_map(|(grant, loaded)| Request::LoadDone { grant, loaded }),
        any::<u64>().prop_map(|ticket| Request::Poll { ticket }),
        (any::<u64>(), any::<u32>()).prop_map(|(ticket, timeout_ms)| Request::Wait { ticket, timeout_ms }),
        hashes().prop_map(|hashes| Request::Removed { hashes }),
        (text(), prop::option::of(text()), phase).prop_map(|(id, parent, phase)| Request::Session {
            id,
            parent,
            phase
        }),
        hint().prop_map(Request::Hint),
        Just(Request::Stats),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(|payload| Request::Ping { payload }),
        (1..=MAX_PAGES as u32).prop_map(|max_pages| Request::TakeAdvice { max_pages }),
        (any::<u64>(), any::<bool>()).prop_map(|(token, done)| Request::Fence { token, done }),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
            |(lookups, pages, device, host, pool)| Request::LookupTally(crate::wire::LookupTally {
                lookups,
                pages,
                device,
                host,
                pool
            })
        ),
    ]
}

fn response() -> impl Strategy<Value = Response> {
    let reason = prop::sample::select(vec![Reason::UnknownPages, Reason::NoPool, Reason::UnknownAction]);
    let outcome = prop_oneof![
        any::<u32>().prop_map(|p| HintOutcome::Accepted { pages: p as usize }),
        (any::<u32>(), any::<u32>(), reason.clone()).prop_map(|(a, r, reason)| HintOutcome::Clipped {
            applied: a as usize,
            requested: r as usize,
            reason
        }),
        (any::<u32>(), reason.clone()).prop_map(|(p, reason)| HintOutcome::Deferred {
            pages: p as usize,
            reason
        }),
        reason.prop_map(|reason| HintOutcome::Ignored { reason }),
    ];
    prop_oneof![
        (
            any::<u64>(),
            text(),
            any::<u64>(),
            any::<u32>(),
            prop::collection::vec(any::<u16>(), 0..4),
            any::<u16>()
        )
            .prop_map(
                |(connection, path, slot_bytes, slots, objects, namespace)| Response::Connected {
                    connection,
                    arena: ArenaInfo {
                        path,
                        slot_bytes,
                        slots
                    },
                    objects,
                    namespace
                }
            ),
        Just(Response::Ok),
        any::<[u32; 3]>().prop_map(|v| Response::Lookup(PrefixHit {
            device: v[0] as usize,
            host: v[1] as usize,
            pool: v[2] as usize
        })),
        (
            any::<u64>(),
            prop::collection::vec(
                (any::<u32>(), slots()).prop_map(|(index, slots)| GrantPage { index, slots }),
                0..4
            )
        )
            .prop_map(|(grant, pages)| Response::StoreGrant { grant, pages }),
        (any::<u64>(), any::<u32>()).prop_map(|(ticket, complete)| Response::Committed { ticket, complete }),
        (any::<u64>(), prop::collection::vec(slots(), 0..4))
            .prop_map(|(grant, pages)| Response::LoadGrant { grant, pages }),
        any::<[u32; 3]>().prop_map(|v| Response::Ticket(TicketStatus {
            complete: v[0],
            total: v[1],
            failed: v[2]
        })),
        outcome.prop_map(Response::Hint),
        any::<[u64; 7]>().prop_map(|f| Response::Stats(DaemonStats::from_fields(f))),
        prop::collection::vec(any::<u8>(), 0..64).prop_map(|payload| Response::Pong { payload }),
        (any::<bool>(), prop::collection::vec(advice(), 0..4))
            .prop_map(|(more, advice)| Response::Advice(AdviceBatch { advice, more })),
        (prop::sample::select(ErrorCode::ALL.to_vec()), text()).prop_map(|(code, msg)| Response::error(code, msg)),
    ]
}

/// Decodes a whole frame the way the daemon does.
fn decode_request_frame(bytes: &[u8]) -> Result<(Header, Request), String> {
    let mut r = bytes;
    let mut body = Vec::new();
    let h = read_frame(&mut r, 1 << 16, &mut body).map_err(|e| e.to_string())?;
    let req = Request::decode(h.kind, &body).map_err(|e| e.to_string())?;
    Ok((h, req))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_request_round_trips(req in request(), id in any::<u64>()) {
        let mut out = Vec::new();
        req.encode(id, &mut out);
        let (h, back) = decode_request_frame(&out).unwrap();
        prop_assert_eq!(h.request_id, id);
        prop_assert_eq!(back, req);
        // Every strict prefix of a valid frame is an error, never a value or a panic.
        for cut in 0..out.len() {
            prop_assert!(decode_request_frame(&out[..cut]).is_err());
        }
    }

    #[test]
    fn every_response_round_trips(resp in response(), id in any::<u64>()) {
        let mut out = Vec::new();
        resp.encode(id, &mut out);
        let mut body = Vec::new();
        let h = read_frame(&mut &out[..], 1 << 16, &mut body).unwrap();
        prop_assert_eq!(h.request_id, id);
        prop_assert_eq!(Response::decode(h.kind, &body).unwrap(), resp);
        for cut in 0..body.len() {
            prop_assert!(Response::decode(h.kind, &body[..cut]).is_err());
        }
    }

    #[test]
    fn random_bodies_never_panic(kind in any::<u8>(), body in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Request::decode(kind, &body);
        let _ = Response::decode(kind, &body);
    }

    #[test]
    fn random_frames_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_request_frame(&bytes);
    }

    #[test]
    fn mutated_frames_never_panic(req in request(), flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        let mut out = Vec::new();
        req.encode(1, &mut out);
        for (at, v) in flips {
            let i = at % out.len();
            out[i] = v;
        }
        let _ = decode_request_frame(&out);
    }
}

#[test]
fn advice_bounds_are_typed_errors() {
    let decode = |max: u32| Request::decode(kind::TAKE_ADVICE, &max.to_le_bytes());
    assert_eq!(decode(16), Ok(Request::TakeAdvice { max_pages: 16 }));
    assert!(matches!(decode(0), Err(DecodeError::Invalid { .. })));
    assert!(matches!(
        decode(MAX_PAGES as u32 + 1),
        Err(DecodeError::TooLong { len, .. }) if len == MAX_PAGES + 1
    ));
    // An entry with no pages, an unknown kind, and more entries than the cap.
    let body = |more: u8, n: u32, kind: u8, hashes: u32| {
        let mut b = vec![more];
        b.extend_from_slice(&n.to_le_bytes());
        b.push(kind);
        b.extend_from_slice(&hashes.to_le_bytes());
        b.extend_from_slice(&[0u8; 16]);
        b
    };
    let empty = body(0, 1, 0, 0);
    assert!(matches!(
        Response::decode(kind::R_ADVICE, &empty),
        Err(DecodeError::Invalid { what: "advice", .. })
    ));
    assert!(matches!(
        Response::decode(kind::R_ADVICE, &body(0, 1, 9, 1)),
        Err(DecodeError::BadTag {
            what: "advice kind",
            tag: 9
        })
    ));
    assert!(matches!(
        Response::decode(kind::R_ADVICE, &body(1, MAX_ADVICE as u32 + 1, 0, 1)),
        Err(DecodeError::TooLong { what: "advice", .. })
    ));
    // A Pause entry naming no session.
    assert!(matches!(
        Response::decode(kind::R_ADVICE, &body(0, 1, 3, 0)),
        Err(DecodeError::Invalid { what: "advice", .. })
    ));
}

#[test]
fn session_advice_carries_its_session_and_no_pages() {
    let batch = AdviceBatch {
        advice: vec![
            EngineAdvice::session(AdviceKind::Pause, "s-1"),
            EngineAdvice::pages(AdviceKind::ReadyToLoad, vec![PageHash::from_u64(7)]),
            EngineAdvice::session(AdviceKind::Resume, "s-1"),
        ],
        more: false,
    };
    let mut body = Vec::new();
    batch.encode(&mut crate::protocol::codec::Writer::new(&mut body));
    // more, count 3, then kind 3, a u16 length 3 and "s-1".
    assert_eq!(&body[..11], &[0, 3, 0, 0, 0, 3, 3, 0, b's', b'-', b'1']);
    assert_eq!(Response::decode(kind::R_ADVICE, &body), Ok(Response::Advice(batch)));
}
