//! Envelope parsing: the shape Dynamo's own `kv_hints` tests write, versions, limits.

use super::*;
use serde_json::json;

/// An envelope as Dynamo's router writes it for one `kv.fetch` (u64 hashes, `mode`).
fn dynamo_envelope(version: &str, hashes: Value) -> Value {
    json!({
        "protocol_version": "0.1",
        "message_id": "msg-1",
        "actions": [{
            "action_id": "act-1",
            "action_type": "kv.fetch",
            "action_version": version,
            "payload": {"source_control_endpoint": "tcp://10.0.0.7:25000", "block_hashes": hashes, "mode": "copy"}
        }]
    })
}

#[test]
fn kv_fetch_1x_becomes_a_prefetch_with_its_source() {
    for version in ["1.0", "1.3"] {
        let plan = parse(&dynamo_envelope(version, json!([1, -1])), 64).unwrap();
        assert_eq!(
            (plan.message_id.as_str(), plan.protocol_version.as_str()),
            ("msg-1", "0.1")
        );
        let a = &plan.actions[0];
        assert_eq!(a.source_control_endpoint.as_deref(), Some("tcp://10.0.0.7:25000"));
        assert_eq!(
            a.step,
            Ok(Hint::Prefetch {
                target: HintTarget::Pages(vec![PageHash::from_u64(1), PageHash::from_u64(u64::MAX)]),
                to: TierKind::Host,
                deadline_ms: None
            })
        );
    }
}

#[test]
fn wide_hashes_travel_as_hex() {
    let wide = "ab".repeat(32);
    let plan = parse(
        &dynamo_envelope("1.0", json!([wide, format!("0x{}", "01".repeat(8))])),
        64,
    )
    .unwrap();
    let Ok(Hint::Prefetch {
        target: HintTarget::Pages(p),
        ..
    }) = &plan.actions[0].step
    else {
        panic!("{:?}", plan.actions[0].step)
    };
    assert_eq!(p[0].as_bytes(), &[0xab; 32][..]);
    assert_eq!(p[1], PageHash::from_u64(0x0101_0101_0101_0101));
}

#[test]
fn other_versions_and_actions_are_ignored_with_reasons() {
    let mut v = dynamo_envelope("2.0", json!([1]));
    v["actions"].as_array_mut().unwrap().push(json!({
        "action_id": "a2", "action_type": "kv.future", "action_version": "1.0", "payload": {}
    }));
    let plan = parse(&v, 64).unwrap();
    assert_eq!(plan.actions[0].step, Err(Reason::UnsupportedVersion));
    assert_eq!(
        plan.actions[0].source_control_endpoint.as_deref(),
        Some("tcp://10.0.0.7:25000")
    );
    assert_eq!(plan.actions[1].step, Err(Reason::UnknownAction));
    let report = apply(plan, |_| -> Result<HintOutcome, String> {
        unreachable!("nothing to run")
    });
    let got: Vec<_> = report
        .actions
        .iter()
        .map(|a| (a.action_id.as_str(), a.outcome.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                "act-1",
                Some(HintOutcome::Ignored {
                    reason: Reason::UnsupportedVersion
                })
            ),
            (
                "a2",
                Some(HintOutcome::Ignored {
                    reason: Reason::UnknownAction
                })
            ),
        ]
    );
    // A protocol major version kvtier does not know ignores even kv.fetch@1.0.
    let mut v = dynamo_envelope("1.0", json!([1]));
    v["protocol_version"] = json!("1.0");
    assert_eq!(parse(&v, 64).unwrap().actions[0].step, Err(Reason::UnsupportedVersion));
}

#[test]
fn malformed_envelopes_are_errors() {
    for bad in [
        json!(null),
        json!({"actions": []}),
        json!({"protocol_version": "0.1", "actions": "x"}),
        json!({"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch"}]}),
        json!({"protocol_version": "0.1", "actions": [{"action_id": "a", "action_type": "kv.fetch", "action_version": "1.0", "payload": "x"}]}),
        dynamo_envelope("1.0", json!([true])),
        dynamo_envelope("1.0", json!(["xyz"])),
        dynamo_envelope("1.0", json!([])),
    ] {
        assert!(parse(&bad, 64).is_err(), "{bad}");
    }
    assert!(matches!(parse_str("{not json", 64), Err(RouterHintError::Json(_))));
    let many = json!({"protocol_version": "0.1", "actions": vec![json!({}); MAX_ACTIONS + 1]});
    assert_eq!(
        parse(&many, 64),
        Err(RouterHintError::TooManyActions {
            got: MAX_ACTIONS + 1,
            max: MAX_ACTIONS
        })
    );
    let huge: Vec<u64> = (0..1_000_000).collect();
    assert_eq!(
        parse(&dynamo_envelope("1.0", json!(huge)), 65_536),
        Err(RouterHintError::TooManyHashes {
            action_id: "act-1".into(),
            got: 1_000_000,
            max: 65_536
        })
    );
}

#[test]
fn the_log_numbers_records_and_keeps_the_newest() {
    let log = KvHintLog::default();
    let report = |id: &str| EnvelopeReport {
        protocol_version: "0.1".into(),
        message_id: id.into(),
        actions: Vec::new(),
    };
    for i in 0..KV_HINT_LOG + 2 {
        assert_eq!(log.push("admin", 0, report(&i.to_string())), i as u64 + 1);
    }
    let all = log.since(0, usize::MAX);
    assert_eq!(all.len(), KV_HINT_LOG);
    assert_eq!(all[0].seq, 3);
    assert_eq!(all[0].report.message_id, "2");
    let tail = log.since(KV_HINT_LOG as u64 + 1, 10);
    assert_eq!(
        tail.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![KV_HINT_LOG as u64 + 2]
    );
}
