//! The replay side of the vLLM publisher: a ROUTER socket that answers a subscriber's
//! `[start_seq]` (8 bytes, big-endian; a REQ or DEALER peer, so the ROUTER sees
//! `[identity, b"", start_seq]`) with the batches the replay buffer still holds.
//!
//! Two answer forms, the same request in both (vLLM changed only what it answers):
//!
//! - [`ReplayProtocol::Topic`] (vLLM 0.26 and later): `[topic, seq, payload]` per batch,
//!   then `[b"", END, b""]`;
//! - [`ReplayProtocol::Legacy`] (vLLM 0.25 and earlier): `[seq, payload]`, then `[END, b""]`.
//!
//! Since the requests do not differ, the form is configuration; `auto` follows the event
//! encoding (tagged events came with vLLM 0.24, the topic frame with 0.26, so `auto`
//! serves 0.26+ with tagged events and ≤ 0.23 with positional ones).
//!
//! Each request costs the publisher thread a pass over the buffer, so requests are
//! limited per peer (its TCP address, or its identity on `ipc://`) with a token bucket
//! ([`ReplayLimits`]); a refused request is answered with the end marker alone, so the
//! subscriber does not hang, and counted. A start older than the buffer is answered with
//! what is held (the first sequence sent tells the subscriber where its gap stays open)
//! and counted as `replays_too_old`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::END_SEQ;
use crate::publish::PublisherStats;

/// Which answer form replay requests get.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReplayProtocol {
    /// [`Topic`](Self::Topic) with tagged events, [`Legacy`](Self::Legacy) with positional ones.
    #[default]
    Auto,
    /// vLLM 0.26+: `[topic, seq, payload]`, ended by `[b"", END, b""]`.
    Topic,
    /// vLLM ≤ 0.25: `[seq, payload]`, ended by `[END, b""]`.
    Legacy,
}

/// Per-peer limits on replay requests (a token bucket per peer).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplayLimits {
    /// Requests a peer may send at once. Default: 4.
    pub burst: u32,
    /// Requests per second a peer regains. Default: 2.
    pub per_sec: f64,
    /// Peers tracked; beyond, the longest idle is forgotten. Default: 1024.
    pub max_peers: usize,
}

impl Default for ReplayLimits {
    fn default() -> Self {
        Self {
            burst: 4,
            per_sec: 2.0,
            max_peers: 1024,
        }
    }
}

/// Requests answered per call of [`Replayer::serve`], so a flood of requests cannot
/// keep the publisher thread from publishing.
const REQUESTS_PER_CALL: usize = 16;

/// Answers replay requests; owned by the publisher thread with its ROUTER socket.
pub(crate) struct Replayer {
    sock: zmq::Socket,
    form: ReplayProtocol,
    topic: Vec<u8>,
    limits: ReplayLimits,
    buckets: HashMap<Vec<u8>, (f64, Instant)>,
}

impl Replayer {
    /// `form` must be resolved (not `Auto`).
    pub(crate) fn new(sock: zmq::Socket, form: ReplayProtocol, topic: Vec<u8>, limits: ReplayLimits) -> Self {
        Self {
            sock,
            form,
            topic,
            limits,
            buckets: HashMap::new(),
        }
    }

    /// Whether the peer may replay now; takes one token if so.
    fn admit(&mut self, peer: Vec<u8>, now: Instant) -> bool {
        if self.buckets.len() >= self.limits.max_peers && !self.buckets.contains_key(&peer) {
            let idle = self
                .buckets
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| k.clone());
            if let Some(k) = idle {
                self.buckets.remove(&k);
            }
        }
        let burst = f64::from(self.limits.burst.max(1));
        let (tokens, at) = self.buckets.entry(peer).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.limits.per_sec).min(burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Answers the requests waiting (at most [`REQUESTS_PER_CALL`]).
    pub(crate) fn serve(&mut self, buffer: &VecDeque<(u64, Vec<u8>)>, stats: &PublisherStats) {
        for _ in 0..REQUESTS_PER_CALL {
            let Some((id, peer, start)) = self.next_request() else {
                return;
            };
            let Some(start) = start else {
                stats.replays_refused.fetch_add(1, Relaxed);
                let _ = self.end(&id);
                continue;
            };
            if !self.admit(peer, Instant::now()) {
                stats.replays_refused.fetch_add(1, Relaxed);
                tracing::debug!(start, "vLLM replay: request over the peer's rate limit");
                let _ = self.end(&id);
                continue;
            }
            stats.replays.fetch_add(1, Relaxed);
            if buffer.front().is_some_and(|(first, _)| start < *first) {
                stats.replays_too_old.fetch_add(1, Relaxed);
                tracing::info!(
                    start,
                    oldest = buffer.front().map(|b| b.0),
                    "vLLM replay: start older than the buffer"
                );
            }
            for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
                if self.batch(&id, *seq, payload).is_err() {
                    break;
                }
            }
            let _ = self.end(&id);
        }
    }

    /// The next request: the peer's identity, its rate-limit key (TCP address when the
    /// transport has one), and its start sequence (`None` when malformed).
    fn next_request(&self) -> Option<(Vec<u8>, Vec<u8>, Option<u64>)> {
        let mut first = self.sock.recv_msg(zmq::DONTWAIT).ok()?;
        let peer = first
            .gets("Peer-Address")
            .filter(|a| !a.is_empty())
            .map(|a| a.as_bytes().to_vec())
            .unwrap_or_else(|| first.to_vec());
        let id = first.to_vec();
        let mut rest = Vec::new();
        while self.sock.get_rcvmore().unwrap_or(false) && rest.len() < 4 {
            match self.sock.recv_bytes(zmq::DONTWAIT) {
                Ok(f) => rest.push(f),
                Err(_) => break,
            }
        }
        // Drain whatever a malformed request has beyond what we read.
        while self.sock.get_rcvmore().unwrap_or(false) {
            if self.sock.recv_bytes(zmq::DONTWAIT).is_err() {
                break;
            }
        }
        let start = match rest.as_slice() {
            [empty, start] if empty.is_empty() => Some(start),
            [start] => Some(start),
            _ => None,
        }
        .and_then(|s| <[u8; 8]>::try_from(s.as_slice()).ok())
        .map(u64::from_be_bytes);
        if start.is_none() {
            tracing::warn!(
                frames = rest.len() + 1,
                "vLLM replay: malformed request answered with the end marker"
            );
        }
        Some((id, peer, start))
    }

    fn batch(&self, id: &[u8], seq: u64, payload: &[u8]) -> Result<(), zmq::Error> {
        let seq = seq.to_be_bytes();
        match self.form {
            ReplayProtocol::Legacy => self.sock.send_multipart([id, b"", &seq[..], payload], 0),
            ReplayProtocol::Topic | ReplayProtocol::Auto => self
                .sock
                .send_multipart([id, b"", &self.topic[..], &seq[..], payload], 0),
        }
    }

    fn end(&self, id: &[u8]) -> Result<(), zmq::Error> {
        match self.form {
            ReplayProtocol::Legacy => self.sock.send_multipart([id, b"", &END_SEQ[..], b""], 0),
            ReplayProtocol::Topic | ReplayProtocol::Auto => {
                self.sock.send_multipart([id, b"", b"", &END_SEQ[..], b""], 0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A start older than the buffer: what is held, then the end marker, counted; a
    /// malformed request: the end marker alone. Both in the 0.26+ form, over a real pair.
    #[test]
    fn an_old_start_gets_what_is_held_and_a_malformed_one_the_end() {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind("inproc://replay-test").unwrap();
        let dealer = ctx.socket(zmq::DEALER).unwrap();
        dealer.set_rcvtimeo(5000).unwrap();
        dealer.connect("inproc://replay-test").unwrap();
        let mut r = Replayer::new(router, ReplayProtocol::Topic, b"t".to_vec(), ReplayLimits::default());
        let buffer: VecDeque<(u64, Vec<u8>)> = (5..8u64).map(|s| (s, vec![s as u8])).collect();
        let stats = PublisherStats::default();
        dealer.send_multipart([&b""[..], &2u64.to_be_bytes()[..]], 0).unwrap();
        dealer.send_multipart([&b""[..], &b"\x01"[..]], 0).unwrap();
        let t = Instant::now();
        while stats.replays.load(Relaxed) + stats.replays_refused.load(Relaxed) < 2 {
            assert!(t.elapsed() < Duration::from_secs(5), "requests not served");
            r.serve(&buffer, &stats);
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut got = Vec::new();
        for _ in 0..5 {
            got.push(dealer.recv_multipart(0).unwrap());
        }
        let frame = |seq: &[u8], payload: &[u8], topic: &[u8]| {
            vec![b"".to_vec(), topic.to_vec(), seq.to_vec(), payload.to_vec()]
        };
        let mut want: Vec<_> = (5..8u64).map(|s| frame(&s.to_be_bytes(), &[s as u8], b"t")).collect();
        want.push(frame(&END_SEQ, b"", b""));
        want.push(frame(&END_SEQ, b"", b""));
        assert_eq!(got, want);
        assert_eq!(
            (
                stats.replays.load(Relaxed),
                stats.replays_too_old.load(Relaxed),
                stats.replays_refused.load(Relaxed)
            ),
            (1, 1, 1)
        );
    }

    #[test]
    fn a_peer_gets_its_burst_then_its_rate() {
        let ctx = zmq::Context::new();
        let sock = ctx.socket(zmq::ROUTER).unwrap();
        let limits = ReplayLimits {
            burst: 2,
            per_sec: 1.0,
            max_peers: 2,
        };
        let mut r = Replayer::new(sock, ReplayProtocol::Topic, Vec::new(), limits);
        let t0 = Instant::now();
        let a = b"a".to_vec();
        assert!(r.admit(a.clone(), t0));
        assert!(r.admit(a.clone(), t0));
        assert!(!r.admit(a.clone(), t0));
        // Another peer has its own bucket.
        assert!(r.admit(b"b".to_vec(), t0));
        // One second later, one more request for `a`.
        let t1 = t0 + Duration::from_secs(1);
        assert!(r.admit(a.clone(), t1));
        assert!(!r.admit(a.clone(), t1));
        // A third peer pushes out the longest idle one (b), so the table stays bounded.
        assert!(r.admit(b"c".to_vec(), t1));
        assert_eq!(r.buckets.len(), 2);
        assert!(!r.buckets.contains_key(b"b".as_slice()));
    }
}
