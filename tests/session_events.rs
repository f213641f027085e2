//! Session events through the daemon's sockets: the pressure controller pauses a session
//! and resumes it (the scenario of tests/sessions.rs), and routers hear both without
//! polling — two real ZMQ subscribers on the session event endpoint get a
//! `session_pause` then a `session_resume` for that session, in order, with sequence
//! numbers, reasons and utilisation — while the engine's advice stream and
//! `/v1/sessions/advice` still get every decision (reading events takes nothing from
//! them), `/v1/sessions/events` and `kvtier events --sessions` replay the same events
//! from sequence 1, and `/metrics` counts them.

mod common;
mod session_support;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

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
    let frames = sub
        .recv_multipart(0)
        .expect("a session event within the receive timeout");
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
    // A PUB socket drops what it sends before a subscription reaches it: give the two
    // subscriptions time to arrive before the controller decides anything.
    std::thread::sleep(Duration::from_millis(500));

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
        assert_eq!((pause.seq, resume.seq), (1, 2), "numbered from 1, in order");
        let p = &pause.fields;
        assert_eq!(
            (&p["type"], &p["seq"], &p["session_id"], &p["reason"], &p["paused_ms"]),
            (
                &json!("session_pause"),
                &json!(1),
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
            (&json!("session_resume"), &json!(2), &json!("tool-user"), &json!("room")),
            "{r}"
        );
        assert!(r["utilisation"].as_f64().unwrap() <= 0.85, "{r}");
        assert!(r["timestamp_ms"].as_u64().unwrap() >= p["timestamp_ms"].as_u64().unwrap());
    }
    let replayed = {
        // Nothing else was published.
        by_topic.set_rcvtimeo(300).unwrap();
        assert!(by_topic.recv_multipart(0).is_err(), "only the two events");
        streamed(&d.admin, 2)
    };

    // `/v1/sessions/events` replays the same two from sequence 1 ...
    let kinds: Vec<(Value, Value, Value)> = replayed
        .iter()
        .map(|v| (v["seq"].clone(), v["kind"].clone(), v["reason"].clone()))
        .collect();
    assert_eq!(
        kinds,
        [
            (json!(1), json!("pause"), json!("pressure")),
            (json!(2), json!("resume"), json!("room"))
        ]
    );
    // `kvtier events --sessions` prints them, one line each.
    let out = std::process::Command::new(common::kvtier_bin())
        .args(["events", "--sessions", "--from", "1", "--limit", "2", "--socket"])
        .arg(&d.admin)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(
        (&lines[0][..3], lines[0].last(), &lines[1][..3], lines[1].last()),
        (
            &["1", "pause", "pressure"][..],
            Some(&"tool-user"),
            &["2", "resume", "room"][..],
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
        "kvtier_session_events_total{type=\"pause\",reason=\"pressure\"} 1",
        "kvtier_session_events_total{type=\"resume\",reason=\"room\"} 1",
        "kvtier_session_events_total{type=\"resume\",reason=\"cap_expired\"} 0",
        "kvtier_session_events_last_seq 2",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
}
