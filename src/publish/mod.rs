//! Event publishers: kvtier's page events, re-encoded in formats that routers and
//! indexers already consume.
//!
//! - [`vllm`]: vLLM-compatible KV events (ZMQ PUB `[topic, seq, msgpack batch]` plus a
//!   ROUTER replay socket), with `medium` naming the tier.
//! - [`tokens`]: token ids and chain parents engines send with stores, for `BlockStored`.
//! - [`mooncake`]: per pool object key `stored`/`removed` events, in the Mooncake store
//!   event shape, for a shared-pool indexer.
//! - [`sessions`]: the pressure controller's pauses and resumes for routers, on a socket
//!   of their own (KV event decoders are strict).
//!
//! Publishers read only [`Pages::events`](crate::manager::Pages::events) (the session
//! publisher [`SessionPolicyPart::events`](crate::manager::SessionPolicyPart::events)), from the
//! sequence at which they start, on their own thread; the ZMQ sockets never leave it.
//! Every wait is bounded, so a stop or a daemon shutdown is seen within one poll.

#[cfg(test)]
mod golden;
pub mod mooncake;
pub mod sessions;
pub mod tokens;
pub mod vllm;
pub mod wire;

use std::sync::Arc;
use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{Acquire, Relaxed},
};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// How long a publisher waits for new events before looking at its stop signals.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// Why a publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("zmq {what}: {source}")]
    Zmq {
        what: String,
        #[source]
        source: zmq::Error,
    },
    #[error("publisher configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

pub(crate) fn zmq_err(what: impl Into<String>) -> impl FnOnce(zmq::Error) -> PublishError {
    let what = what.into();
    move |source| PublishError::Zmq { what, source }
}

/// Counters of one publisher.
#[derive(Debug, Default)]
pub struct PublisherStats {
    batches: AtomicU64,
    events: AtomicU64,
    /// Page events the publisher fell too far behind to read (the ring dropped them).
    lost: AtomicU64,
    replays: AtomicU64,
    /// Replay requests refused: over the peer's rate limit, or malformed.
    replays_refused: AtomicU64,
    /// Replay requests whose start the buffer no longer held.
    replays_too_old: AtomicU64,
    /// The page event sequence the publisher has read, sent and counted up to (exclusive).
    next_event: AtomicU64,
}

/// A point-in-time copy of [`PublisherStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PublisherCounts {
    /// Batches (messages) sent; the next batch carries this sequence number.
    pub batches: u64,
    /// Events sent (vLLM: page events; Mooncake: object events).
    pub events: u64,
    pub lost: u64,
    pub replays: u64,
    pub replays_refused: u64,
    pub replays_too_old: u64,
    pub next_event: u64,
}

impl PublisherStats {
    pub fn counts(&self) -> PublisherCounts {
        // Read first, with the publishers' store after their sends: the counts below are
        // at least those of every event before it.
        let next_event = self.next_event.load(Acquire);
        PublisherCounts {
            batches: self.batches.load(Relaxed),
            events: self.events.load(Relaxed),
            lost: self.lost.load(Relaxed),
            replays: self.replays.load(Relaxed),
            replays_refused: self.replays_refused.load(Relaxed),
            replays_too_old: self.replays_too_old.load(Relaxed),
            next_event,
        }
    }
}

/// A running publisher.
pub struct PublisherHandle {
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) stats: Arc<PublisherStats>,
    pub(crate) thread: Option<JoinHandle<()>>,
    pub(crate) endpoint: String,
    pub(crate) replay_endpoint: Option<String>,
}

impl PublisherHandle {
    /// The endpoint the PUB socket is bound to (with the real port when `*` was asked).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay ROUTER endpoint, if any.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    pub fn counts(&self) -> PublisherCounts {
        self.stats.counts()
    }

    /// Stops the publisher thread and waits for it (it notices within one poll).
    pub fn stop(mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for PublisherHandle {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

/// A ZMQ context with the bound PUB socket every publisher sends on: its high-water mark,
/// and a short linger so a stop is not held up by a slow subscriber. Returns the socket
/// and the endpoint it is bound to.
pub(crate) fn pub_socket(ctx: &zmq::Context, endpoint: &str, hwm: i32) -> Result<(zmq::Socket, String), PublishError> {
    let publ = ctx.socket(zmq::PUB).map_err(zmq_err("PUB socket"))?;
    publ.set_sndhwm(hwm).map_err(zmq_err("PUB hwm"))?;
    publ.set_linger(500).map_err(zmq_err("PUB linger"))?;
    let bound = bind(&publ, endpoint)?;
    Ok((publ, bound))
}

/// Binds a PUB socket at `endpoint` and starts a publisher's thread on it (see [`start`]),
/// for publishers without a replay socket; `what` names it in the start-up log line.
pub(crate) fn start_bound(
    name: &str,
    what: &str,
    endpoint: &str,
    hwm: i32,
    first_event: u64,
    body: impl FnOnce(zmq::Socket, Arc<AtomicBool>, Arc<PublisherStats>) + Send + 'static,
) -> Result<PublisherHandle, PublishError> {
    let ctx = zmq::Context::new();
    let (publ, endpoint) = pub_socket(&ctx, endpoint, hwm)?;
    let handle = start(name, first_event, endpoint, None, move |stop, stats| {
        // The context outlives the socket: both live on the publisher's thread.
        let _ctx = ctx;
        body(publ, stop, stats)
    })?;
    tracing::info!(endpoint = %handle.endpoint, "{what} publisher started");
    Ok(handle)
}

/// Starts a publisher's thread, which gets the stop flag and the counters, with the counters
/// starting at `first_event` (the event log's next sequence when the publisher started).
pub(crate) fn start(
    name: &str,
    first_event: u64,
    endpoint: String,
    replay_endpoint: Option<String>,
    body: impl FnOnce(Arc<AtomicBool>, Arc<PublisherStats>) + Send + 'static,
) -> Result<PublisherHandle, PublishError> {
    let stop = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(PublisherStats::default());
    stats.next_event.store(first_event, Relaxed);
    let (s, st) = (stop.clone(), stats.clone());
    let thread = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || body(s, st))?;
    Ok(PublisherHandle {
        stop,
        stats,
        thread: Some(thread),
        endpoint,
        replay_endpoint,
    })
}

/// Binds a socket and returns the endpoint it is bound to.
pub(crate) fn bind(sock: &zmq::Socket, endpoint: &str) -> Result<String, PublishError> {
    sock.bind(endpoint).map_err(zmq_err(format!("bind {endpoint}")))?;
    match sock.get_last_endpoint() {
        Ok(Ok(e)) => Ok(e),
        _ => Ok(endpoint.to_owned()),
    }
}

/// Sends one `[topic, seq (8 bytes, big-endian), payload]` message.
pub(crate) fn send_batch(sock: &zmq::Socket, topic: &[u8], seq: u64, payload: &[u8]) -> Result<(), zmq::Error> {
    sock.send(topic, zmq::SNDMORE)?;
    sock.send(&seq.to_be_bytes()[..], zmq::SNDMORE)?;
    sock.send(payload, 0)
}

/// Wall-clock time since the Unix epoch (event timestamps are for consumers, who compare
/// them with their own clocks).
pub(crate) fn wall_clock() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default()
}
