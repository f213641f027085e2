//! Session events through the daemon's sockets: the pressure controller pauses a session
//! and resumes it (the scenario of tests/sessions.rs), and routers hear both without
//! polling — two real ZMQ subscribers on the session event endpoint get a
//! `session_pause` then a `session_resume` for that session, in order, with sequence
//! numbers, reasons and utilisation — while the engine's advice stream and
//! `/v1/sessions/advice` still get every decision (reading events takes nothing from
//! them), `/v1/sessions/events` and `kvtier events --sessions` replay the same events,
//! and `/metrics` counts them. Before the scenario a probe session is resumed on its
//! report until both subscribers heard it: their subscriptions have reached the
//! publisher, and the probes' events are the first sequences.

mod common;
mod session_support;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::rank::RankProc;
use serde_json::{Value, json};
use session_support::{http, pause_then_resume, serve};

/// One session event as a subscriber got it: topic, frame sequence, payload fields.
struct Got {
    topic: String,
    seq: u64,
    fields: Value,
}

fn recv(sub: &zmq::Socket) -> Got {
    got(sub
        .recv_multipart(0)
        .expect("a session event within the receive timeout"))
}

fn got(frames: Vec<Vec<u8>>) -> Got {
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    let seq = u64::from_be_bytes(frames[1].as_slice().try_into().expect("an 8-byte sequence"));
    let v = rmpv::decode::read_value(&mut frames[2].as_slice()).expect("a MessagePack payload");
    let mut fields = serde_json::Map::new();
    for (k, v) in v.as_map().expect("a map payload") {
        let val = match v {
            rmpv::Value::String(s) => json!(s.as_str().unwrap()),
            rmpv::Value::Integer(i) => json!(i.as_u64().unwrap()),
            rmpv::Value::F64(f) => json!(f),
            other => panic!("unexpected value {other}"),
        };
        fields.insert(k.as_str().unwrap().to_owned(), val);
    }
    Got {
        topic: String::from_utf8(frames[0].clone()).unwrap(),
        seq,
        fields: Value::Object(fields),
    }
}

/// The probe session's id: never part of the scenario.
const PROBE: &str = "probe";

/// Whether `g` is a probe's event: session [`PROBE`] resumed on its report.
fn is_probe(g: &Got) -> bool {
    g.fields["type"] == "session_resume" && g.fields["session_id"] == PROBE && g.fields["reason"] == "reported"
}

/// A PUB socket drops what it sends before a subscription reaches it. Until every one of
/// `subs` has heard one, session [`PROBE`] is reported paused and then reasoning again,
/// which the controller answers with one `session_resume` (reason `reported`); then each
/// subscriber reads on up to the last probe's event, so its next message is whatever
/// follows the probes. Returns how many probes were sent (the daemon's first session
/// events, so the last one's sequence).
fn probe_until_heard(admin: &std::path::Path, subs: &[&zmq::Socket]) -> u64 {
    let start = Instant::now();
    let mut seen = vec![0u64; subs.len()];
    let mut probes = 0u64;
    for sub in subs {
        sub.set_rcvtimeo(200).unwrap();
    }
    while seen.contains(&0) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no probe event reached every subscriber (last seen: {seen:?})"
        );
        for phase in ["paused", "reasoning"] {
            let (st, v) = http(
                admin,
                "POST",
                "/v1/sessions/phase",
                &json!({"session_id": PROBE, "phase": phase}).to_string(),
            );
            assert_eq!(st, 200, "{v}");
        }
        probes += 1;
        for (sub, seen) in subs.iter().zip(&mut seen) {
            if *seen == 0
                && let Ok(frames) = sub.recv_multipart(0)
            {
                let g = got(frames);
                assert!(is_probe(&g) && g.seq <= probes, "{} {}", g.seq, g.fields);
                *seen = g.seq;
            }
        }
    }
    for (sub, seen) in subs.iter().zip(&mut seen) {
        sub.set_rcvtimeo(15_000).unwrap();
        while *seen < probes {
            let g = recv(sub);
            assert!(is_probe(&g) && g.seq == *seen + 1, "{} {}", g.seq, g.fields);
            *seen = g.seq;
        }
    }
    // The probe is done with: ended, it holds nothing in the policy.
    let (st, v) = http(
        admin,
        "POST",
        "/v1/sessions/phase",
        &json!({"session_id": PROBE, "phase": "ended"}).to_string(),
    );
    assert_eq!(st, 200, "{v}");
    probes
}

fn subscriber(ctx: &zmq::Context, endpoint: &str, topic: &[u8]) -> zmq::Socket {
    let sub = ctx.socket(zmq::SUB).unwrap();
    sub.set_subscribe(topic).unwrap();
    sub.set_rcvtimeo(15_000).unwrap();
    sub.connect(endpoint).unwrap();
    sub
}

/// The chunked JSON lines of `/v1/sessions/events?from=1&limit=n`.
fn streamed(admin: &std::path::Path, n: u64) -> Vec<Value> {
    let mut s = UnixStream::connect(admin).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /v1/sessions/events?from=1&limit={n} HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn routers_hear_the_controllers_pause_and_resume_on_the_session_event_socket() {
    let dir = tempfile::tempdir().unwrap();
    let d = serve(
        dir.path(),
        &["policy_exclusive=true".into(), "session_events_endpoint=ipc".into()],
    );
    let endpoint = format!("ipc://{}", dir.path().join("session-events.ipc").display());
    let ctx = zmq::Context::new();
    let by_topic = subscriber(&ctx, &endpoint, b"kvtier.sessions");
    let everything = subscriber(&ctx, &endpoint, b"");
    // Both subscriptions are in place before the controller decides anything; the
    // probes' events come first (sequences 1..=probes) and are all read.
    let probes = probe_until_heard(&d.admin, &[&by_topic, &everything]);
    // Routers polling `/v1/sessions/advice` got the probes' resumes too; take them.
    let (_, a) = http(&d.admin, "GET", "/v1/sessions/advice", "");
    let taken = a["advice"].as_array().unwrap_or_else(|| panic!("advice in {a}"));
    assert_eq!(taken.len() as u64, probes, "{a}");
    assert!(
        taken
            .iter()
            .all(|x| x["advice"] == "resume" && x["session_id"] == PROBE),
        "{a}"
    );
    let (pause_seq, resume_seq) = (probes + 1, probes + 2);

    let mut e = RankProc::spawn(&d.socket, "engine", 0, 0, 1, 1);
    let (paused, resumed) = pause_then_resume(&d, &mut e);
    // The engine's advice stream got both decisions: the events took nothing from it.
    assert_eq!(paused, ["pause:tool-user"]);
    assert_eq!(resumed, ["readytoload:10", "resume:tool-user"]);

    for sub in [&by_topic, &everything] {
        let pause = recv(sub);
        let resume = recv(sub);
        assert_eq!(
            (pause.topic.as_str(), resume.topic.as_str()),
            ("kvtier.sessions", "kvtier.sessions")
        );
        assert_eq!(
            (pause.seq, resume.seq),
            (pause_seq, resume_seq),
            "numbered on from the probes, in order"
        );
        let p = &pause.fields;
        assert_eq!(
            (&p["type"], &p["seq"], &p["session_id"], &p["reason"], &p["paused_ms"]),
            (
                &json!("session_pause"),
                &json!(pause_seq),
                &json!("tool-user"),
                &json!("pressure"),
                &json!(0)
            ),
            "{p}"
        );
        // 10 + 86 pages of a 100-page host: at or over the 0.95 pause watermark.
        assert_eq!(p["host_capacity_pages"], json!(100), "{p}");
        assert!(p["host_used_pages"].as_u64().unwrap() >= 95, "{p}");
        assert!(p["utilisation"].as_f64().unwrap() >= 0.95, "{p}");
        let r = &resume.fields;
        assert_eq!(
            (&r["type"], &r["seq"], &r["session_id"], &r["reason"]),
            (
                &json!("session_resume"),
                &json!(resume_seq),
                &json!("tool-user"),
                &json!("room")
            ),
            "{r}"
        );
        assert!(r["utilisation"].as_f64().unwrap() <= 0.85, "{r}");
        assert!(r["timestamp_ms"].as_u64().unwrap() >= p["timestamp_ms"].as_u64().unwrap());
    }
    let replayed = {
        // Nothing else was published.
        by_topic.set_rcvtimeo(300).unwrap();
        assert!(by_topic.recv_multipart(0).is_err(), "only the two events");
        streamed(&d.admin, resume_seq)
    };

    // `/v1/sessions/events` replays from sequence 1 the probes' resumes, then the same
    // two ...
    let kinds: Vec<(Value, Value, Value, Value)> = replayed
        .iter()
        .map(|v| {
            (
                v["seq"].clone(),
                v["kind"].clone(),
                v["reason"].clone(),
                v["session_id"].clone(),
            )
        })
        .collect();
    let mut want: Vec<(Value, Value, Value, Value)> = (1..=probes)
        .map(|s| (json!(s), json!("resume"), json!("reported"), json!(PROBE)))
        .collect();
    want.push((json!(pause_seq), json!("pause"), json!("pressure"), json!("tool-user")));
    want.push((json!(resume_seq), json!("resume"), json!("room"), json!("tool-user")));
    assert_eq!(kinds, want);
    let replayed = &replayed[probes as usize..];
    // `kvtier events --sessions` prints them, one line each.
    let from = pause_seq.to_string();
    let out = std::process::Command::new(common::kvtier_bin())
        .args(["events", "--sessions", "--from", &from, "--limit", "2", "--socket"])
        .arg(&d.admin)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines.len(), 2, "{text}");
    let to = resume_seq.to_string();
    assert_eq!(
        (&lines[0][..3], lines[0].last(), &lines[1][..3], lines[1].last()),
        (
            &[from.as_str(), "pause", "pressure"][..],
            Some(&"tool-user"),
            &[to.as_str(), "resume", "room"][..],
            Some(&"tool-user")
        ),
        "{text}"
    );

    // ... and routers polling `/v1/sessions/advice` still get both decisions, the resume
    // with the same paused time the event carried.
    let (_, a) = http(&d.admin, "GET", "/v1/sessions/advice", "");
    let advice = a["advice"].as_array().unwrap_or_else(|| panic!("advice in {a}"));
    assert_eq!(advice.len(), 2, "{a}");
    assert_eq!(
        (&advice[0]["advice"], &advice[1]["advice"], &advice[1]["session_id"]),
        (&json!("pause"), &json!("resume"), &json!("tool-user"))
    );
    assert_eq!(advice[1]["paused_ms"], replayed[1]["paused_ms"], "{a}");

    // `/metrics` counts them by reason.
    let mut s = UnixStream::connect(&d.admin).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    for line in [
        "kvtier_session_events_total{type=\"pause\",reason=\"pressure\"} 1".to_owned(),
        "kvtier_session_events_total{type=\"resume\",reason=\"room\"} 1".to_owned(),
        "kvtier_session_events_total{type=\"resume\",reason=\"cap_expired\"} 0".to_owned(),
        format!("kvtier_session_events_total{{type=\"resume\",reason=\"reported\"}} {probes}"),
        format!("kvtier_session_events_last_seq {resume_seq}"),
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
}
