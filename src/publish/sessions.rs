//! Session events for routers: every pause and resume of the pressure controller, on a
//! ZMQ PUB socket of its own.
//!
//! Its own socket, not a topic on the KV event socket: vLLM's and Dynamo's KV event
//! subscribers subscribe to every topic and decode each message with a strict
//! `KVEventBatch` schema, so a session message there would break them. A router that
//! wants both subscribes to both endpoints.
//!
//! Wire format: frames `[topic, seq (8 bytes big-endian), payload]`, one event a message;
//! `seq` is the event's own sequence (from 1, no gaps while the daemon runs, so a gap
//! means this subscriber missed messages). `payload` is a MessagePack map:
//!
//! | key | value |
//! | --- | --- |
//! | `type` | `"session_pause"` or `"session_resume"` |
//! | `seq` | the same sequence as the frame |
//! | `timestamp_ms` | wall clock, ms since the Unix epoch |
//! | `session_id` | the session's id as the engine or router gave it (an identifier, never content) |
//! | `reason` | `pressure`, `tool_boundary` (pauses); `room`, `cap_expired`, `reported` (resumes) |
//! | `utilisation` | host utilisation the decision was taken at (float, 0..1) |
//! | `host_used_pages`, `host_capacity_pages` | the same, in pages |
//! | `paused_ms` | how long the session was paused (0 for a pause) |
//!
//! The publisher reads [`SessionPolicyPart::events`](crate::manager::SessionPolicyPart::events)
//! from its own position: it takes nothing from the engines' advice stream or from
//! `/v1/sessions/advice`.

use std::sync::Arc;
use std::sync::atomic::{
    AtomicBool,
    Ordering::{Relaxed, Release},
};

use tokio_util::sync::CancellationToken;

use super::wire::Writer;
use super::{POLL, PublishError, PublisherHandle, PublisherStats, send_batch, start_bound, wall_clock};
use crate::manager::{Manager, SessionEvent, SessionEventKind};

/// Settings of the session event publisher.
#[derive(Clone, Debug)]
pub struct SessionEventsConfig {
    /// PUB endpoint to bind.
    pub endpoint: String,
    /// Topic frame. Default: `kvtier.sessions`.
    pub topic: String,
    /// ZMQ send high-water mark (messages). Default: 10 000.
    pub hwm: i32,
}

impl Default for SessionEventsConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:5573".into(),
            topic: "kvtier.sessions".into(),
            hwm: 10_000,
        }
    }
}

/// The event's `type`.
pub fn type_name(kind: SessionEventKind) -> &'static str {
    match kind {
        SessionEventKind::Pause => "session_pause",
        SessionEventKind::Resume => "session_resume",
    }
}

/// Encodes one event as the payload map (see the module docs).
pub fn encode(buf: &mut Vec<u8>, ev: &SessionEvent, ts_ms: u64) {
    let mut w = Writer::new(buf);
    w.map(9);
    w.str("type");
    w.str(type_name(ev.kind));
    w.str("seq");
    w.uint(ev.seq);
    w.str("timestamp_ms");
    w.uint(ts_ms);
    w.str("session_id");
    w.str(&ev.session_id);
    w.str("reason");
    w.str(ev.reason.name());
    w.str("utilisation");
    w.f64(ev.utilisation);
    w.str("host_used_pages");
    w.uint(ev.host_used_pages);
    w.str("host_capacity_pages");
    w.uint(ev.host_capacity_pages);
    w.str("paused_ms");
    w.uint(ev.paused_ms);
}

/// Starts the publisher: binds its socket, then publishes every session event from the
/// log's next sequence on, until stopped or `shutdown`.
pub fn spawn(
    cfg: SessionEventsConfig,
    manager: Manager,
    shutdown: CancellationToken,
) -> Result<PublisherHandle, PublishError> {
    let first = manager.session_policy().events().last_seq() + 1;
    let endpoint = cfg.endpoint.clone();
    start_bound(
        "kvtier-pub-sessions",
        "session event",
        &endpoint,
        cfg.hwm,
        first,
        move |publ, stop, stats| run(cfg, manager, publ, stop, shutdown, stats),
    )
}

fn run(
    cfg: SessionEventsConfig,
    manager: Manager,
    publ: zmq::Socket,
    stop: Arc<AtomicBool>,
    shutdown: CancellationToken,
    stats: Arc<PublisherStats>,
) {
    let topic = cfg.topic.as_bytes().to_vec();
    let mut next = stats.next_event.load(Relaxed);
    let mut payload = Vec::with_capacity(256);
    while !stop.load(Relaxed) && !shutdown.is_cancelled() {
        let batch = manager.session_policy().events().read_from(next, 256, POLL);
        if batch.lost > 0 {
            stats.lost.fetch_add(batch.lost, Relaxed);
            tracing::warn!(
                lost = batch.lost,
                "session publisher fell behind the session event ring"
            );
        }
        next = batch.next;
        for ev in &batch.events {
            payload.clear();
            encode(&mut payload, ev, wall_clock().as_millis() as u64);
            if let Err(e) = send_batch(&publ, &topic, ev.seq, &payload) {
                tracing::warn!(error = %e, seq = ev.seq, "session publisher: send failed");
            }
            stats.batches.fetch_add(1, Relaxed);
            stats.events.fetch_add(1, Relaxed);
        }
        // After the events are sent and counted: whoever sees the log read this far sees
        // their counts too.
        stats.next_event.store(next, Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::SessionEventReason;

    #[test]
    fn payload_is_the_documented_map() {
        let ev = SessionEvent {
            seq: 3,
            at_ms: 0,
            kind: SessionEventKind::Resume,
            session_id: "agent-7".into(),
            reason: SessionEventReason::CapExpired,
            host_used_pages: 97,
            host_capacity_pages: 100,
            utilisation: 0.97,
            paused_ms: 1800,
        };
        let mut buf = Vec::new();
        encode(&mut buf, &ev, 1234);
        let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
        let got: Vec<(String, String)> = v
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.to_string()))
            .collect();
        let want = [
            ("type", "\"session_resume\""),
            ("seq", "3"),
            ("timestamp_ms", "1234"),
            ("session_id", "\"agent-7\""),
            ("reason", "\"cap_expired\""),
            ("utilisation", "0.97"),
            ("host_used_pages", "97"),
            ("host_capacity_pages", "100"),
            ("paused_ms", "1800"),
        ];
        let want: Vec<(String, String)> = want.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        assert_eq!(got, want);
    }
}
