//! Keeping the index in sync: one subscriber thread per event source and a supervisor
//! that watches the pool and the master and resyncs.
//!
//! - Each subscriber reads one ZMQ PUB stream (a peer's `events.pool_endpoint`, this
//!   node's own, or a master's `--kv_events_bind_endpoint`) and checks its sequence: the
//!   first message must be number 1 (else events were missed before this node joined),
//!   and each next one the last plus one. A gap, a restarted publisher (a lower number),
//!   a `cleared` event or a message that does not decode makes the index lose sync.
//! - The supervisor polls every [`IndexConfig::poll`]: while the pool is unhealthy or the
//!   master's admin HTTP port does not answer, the index is not in sync; a master whose
//!   request counters went down has restarted (it lost every object). When a resync is
//!   wanted and the master answers, it lists the store (`GET /get_all_keys` on the
//!   master's admin port, one bounded request with a deadline) and hands the listing to
//!   [`PoolIndex::finish_resync`], then calls the daemon back (its directory stops
//!   believing the store holds pages the listing lacks).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::PoolIndex;
use super::events::{ObjectEvent, decode};

/// Where the index's events and listings come from.
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// ZMQ endpoints to subscribe to (peers' pool event endpoints, a master's).
    pub sources: Vec<String>,
    /// The master's admin HTTP address, `host:port` (its `--metrics_port`).
    pub admin: String,
    /// How often the supervisor checks the pool and the master. Default: 50 ms.
    pub poll: Duration,
    /// Deadline of one request to the master's admin port. Default: 5 s.
    pub http_timeout: Duration,
}

/// The largest event message a subscriber takes (ZMQ drops larger ones). A publisher's
/// message holds at most 1,024 events (kvtier's) of keys of a few hundred bytes.
pub const MAX_MESSAGE_BYTES: i64 = 4 << 20;
/// Messages a subscriber's socket queues before dropping (per source).
pub const RCV_HWM: i32 = 64;

/// Is the pool backend healthy (the daemon asks its manager).
pub type Healthy = Box<dyn Fn() -> bool + Send>;

/// Runs after each completed resync (the daemon brings its directory in line).
pub type OnResync = Box<dyn Fn(&PoolIndex) + Send>;

/// Starts the subscribers and the supervisor; they stop with `cancel`.
pub fn spawn(
    cfg: IndexConfig,
    index: Arc<PoolIndex>,
    healthy: Healthy,
    on_resync: OnResync,
    cancel: CancellationToken,
) -> std::io::Result<Vec<JoinHandle<()>>> {
    let ctx = zmq::Context::new();
    let mut threads = Vec::new();
    for (i, ep) in cfg.sources.iter().enumerate() {
        let sock = ctx.socket(zmq::SUB).map_err(std::io::Error::other)?;
        sock.set_subscribe(b"").map_err(std::io::Error::other)?;
        sock.set_rcvtimeo(100).map_err(std::io::Error::other)?;
        // A peer's stream is untrusted input: a message past MAX_MESSAGE_BYTES is
        // dropped by ZMQ, and at most RCV_HWM messages wait here, so what a peer can make
        // this daemon hold is bounded; a message dropped either way is a sequence gap,
        // and the index resyncs.
        sock.set_maxmsgsize(MAX_MESSAGE_BYTES).map_err(std::io::Error::other)?;
        sock.set_rcvhwm(RCV_HWM).map_err(std::io::Error::other)?;
        sock.connect(ep)
            .map_err(|e| std::io::Error::other(format!("{ep}: {e}")))?;
        let (index, cancel, ep) = (index.clone(), cancel.clone(), ep.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("kvtier-index-sub{i}"))
                .spawn(move || subscribe(sock, &ep, &index, &cancel))?,
        );
    }
    threads.push(
        std::thread::Builder::new()
            .name("kvtier-index-sync".into())
            .spawn(move || supervise(&cfg, &index, &*healthy, &*on_resync, &cancel))?,
    );
    Ok(threads)
}

fn subscribe(sock: zmq::Socket, ep: &str, index: &PoolIndex, cancel: &CancellationToken) {
    let mut last: Option<u64> = None;
    while !cancel.is_cancelled() {
        let frames = match sock.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) | Err(zmq::Error::EINTR) => continue,
            Err(e) => {
                tracing::warn!(error = %e, endpoint = ep, "pool index: subscriber stopped");
                index.lose_sync("an event subscriber failed");
                return;
            }
        };
        let batch = match decode(&frames) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, endpoint = ep, "pool index: undecodable event message");
                index.lose_sync("an event message did not decode");
                continue;
            }
        };
        let expected = last.map_or(Some(1), |l| l.checked_add(1));
        if Some(batch.seq) != expected {
            index.lose_sync(&format!(
                "event sequence from {ep}: got {}, expected {}",
                batch.seq,
                expected.map_or("none (past the last)".into(), |e| e.to_string())
            ));
        }
        last = Some(batch.seq);
        for ev in batch.events {
            match ev {
                ObjectEvent::Stored(k) => index.apply(true, &k),
                ObjectEvent::Removed(k) => index.apply(false, &k),
                ObjectEvent::Cleared => index.lose_sync("a publisher cleared its objects"),
            }
        }
    }
}

fn supervise(
    cfg: &IndexConfig,
    index: &PoolIndex,
    healthy: &dyn Fn() -> bool,
    on_resync: &dyn Fn(&PoolIndex),
    cancel: &CancellationToken,
) {
    let mut requests: Option<u64> = None;
    let mut retry_at = Instant::now();
    while !cancel.is_cancelled() {
        std::thread::sleep(cfg.poll);
        if !healthy() {
            index.lose_sync("pool unhealthy");
            continue;
        }
        // The master's request counters: unreachable means not in sync; lower than last
        // time means a restarted master, which holds none of the old objects.
        match get(&cfg.admin, "/metrics", cfg.http_timeout, 4 << 20).map(|b| request_count(&b)) {
            Ok(n) => {
                if requests.is_some_and(|prev| n < prev) {
                    index.lose_sync("the master restarted");
                }
                requests = Some(n);
            }
            Err(e) => {
                index.lose_sync(&format!("master admin {}: {e}", cfg.admin));
                requests = None;
                continue;
            }
        }
        if Instant::now() < retry_at || !index.take_resync_wanted() {
            continue;
        }
        let started = Instant::now();
        index.begin_resync();
        let cap = index.max_keys().saturating_mul(1024).max(1 << 20);
        match get(&cfg.admin, "/get_all_keys", cfg.http_timeout, cap) {
            Ok(body) => {
                let text = String::from_utf8_lossy(&body);
                let keys = text.lines().filter(|l| !l.is_empty()).map(str::to_owned);
                if index.finish_resync(keys, started) {
                    on_resync(index);
                } else {
                    retry_at = Instant::now() + Duration::from_millis(500);
                }
            }
            Err(e) => {
                index.fail_resync(&format!("listing the store: {e}"));
                retry_at = Instant::now() + Duration::from_millis(500);
            }
        }
    }
}

/// The sum of the master's `master_*_requests_total` counters (they only grow while it runs).
fn request_count(metrics: &[u8]) -> u64 {
    String::from_utf8_lossy(metrics)
        .lines()
        .filter(|l| l.starts_with("master_") && !l.starts_with('#'))
        .filter_map(|l| {
            let (name, v) = l.split_once(' ')?;
            name.ends_with("_requests_total")
                .then(|| v.trim().parse::<f64>().ok())?
        })
        .map(|v| v as u64)
        .sum()
}

/// `GET path` on `addr` over HTTP/1.0, with one deadline for the whole exchange and at
/// most `cap` bytes of answer: the body of a 200, else an error.
pub fn get(addr: &str, path: &str, timeout: Duration, cap: usize) -> std::io::Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let sa = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other("no address"))?;
    let mut s = TcpStream::connect_timeout(&sa, timeout)?;
    s.set_write_timeout(Some(timeout))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut out = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "deadline passed"));
        }
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if out.len() > cap {
            return Err(std::io::Error::other(format!("answer larger than {cap} bytes")));
        }
        // A server that keeps the connection open after a complete answer.
        if let Some(h) = out.windows(4).position(|w| w == b"\r\n\r\n")
            && let Some(len) = content_length(&out[..h])
            && out.len() >= h + 4 + len
        {
            out.truncate(h + 4 + len);
            break;
        }
    }
    let head_end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no HTTP header"))?;
    let status = out.split(|&b| b == b'\n').next().unwrap_or_default();
    if !status.windows(5).any(|w| w == b" 200 ") {
        return Err(std::io::Error::other(format!(
            "HTTP {}",
            String::from_utf8_lossy(status).trim()
        )));
    }
    Ok(out.split_off(head_end + 4))
}

fn content_length(head: &[u8]) -> Option<usize> {
    String::from_utf8_lossy(head).lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subscriber applies a stream's events in order and loses sync on a gap in its
    /// sequence and on a publisher that restarted (its sequence went down).
    #[test]
    fn subscriber_applies_events_and_loses_sync_on_gaps() {
        use std::time::Instant;
        let ctx = zmq::Context::new();
        // XPUB: the subscription arrives as a message, so nothing is sent before the
        // subscriber listens (no fixed sleep for ZMQ's slow joiner).
        let publ = ctx.socket(zmq::XPUB).unwrap();
        publ.bind("tcp://127.0.0.1:*").unwrap();
        let ep = publ.get_last_endpoint().unwrap().unwrap();
        let index = Arc::new(PoolIndex::new(100));
        index.begin_resync();
        assert!(index.finish_resync(Vec::<String>::new(), Instant::now()));
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"").unwrap();
        sub.set_rcvtimeo(100).unwrap();
        sub.connect(&ep).unwrap();
        let cancel = CancellationToken::new();
        let (ix, c, e) = (index.clone(), cancel.clone(), ep.clone());
        let t = std::thread::spawn(move || subscribe(sub, &e, &ix, &c));
        publ.set_rcvtimeo(10_000).unwrap();
        assert_eq!(publ.recv_bytes(0).unwrap(), vec![1u8], "subscription arrived");
        let send = |seq: u64, kind: &str, key: &str| {
            let mut p = Vec::new();
            rmp::encode::write_array_len(&mut p, 3).unwrap();
            rmp::encode::write_uint(&mut p, 1).unwrap();
            rmp::encode::write_array_len(&mut p, 1).unwrap();
            rmp::encode::write_map_len(&mut p, 2).unwrap();
            for (f, v) in [("type", kind), ("object_key", key)] {
                rmp::encode::write_str(&mut p, f).unwrap();
                rmp::encode::write_str(&mut p, v).unwrap();
            }
            rmp::encode::write_uint(&mut p, 0).unwrap();
            publ.send_multipart([&b""[..], &seq.to_be_bytes()[..], &p[..]], 0)
                .unwrap();
        };
        let key = |i: u64| format!("t_m_{}_0_k", crate::page::PageHash::from_u64(i).to_hex());
        let until = |f: &dyn Fn() -> bool| {
            let end = Instant::now() + Duration::from_secs(10);
            while !f() {
                assert!(Instant::now() < end, "condition not met in time");
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        send(1, "BlockStored", &key(1));
        send(2, "BlockStored", &key(2));
        send(3, "BlockRemoved", &key(1));
        until(&|| index.snapshot().events == 3);
        assert!(index.contains_all(&[key(2)]) && !index.contains_all(&[key(1)]));
        assert_eq!(
            (index.mode(), index.snapshot().sync_losses),
            (super::super::IndexMode::InSync, 0)
        );
        send(5, "BlockStored", &key(3));
        until(&|| index.snapshot().events == 4);
        assert_eq!(index.mode(), super::super::IndexMode::Syncing, "gap 3 -> 5");
        assert_eq!(index.snapshot().sync_losses, 1);
        index.take_resync_wanted();
        index.begin_resync();
        assert!(index.finish_resync(Vec::<String>::new(), Instant::now()));
        send(1, "BlockStored", &key(4));
        until(&|| index.snapshot().events == 5);
        assert_eq!(index.mode(), super::super::IndexMode::Syncing, "publisher restarted");
        cancel.cancel();
        t.join().unwrap();
    }

    #[test]
    fn request_count_sums_only_request_counters() {
        let m = b"# HELP x\nmaster_put_start_requests_total 3\nmaster_key_count 99\nmaster_remove_requests_total 4\nother_requests_total 100\n";
        assert_eq!(request_count(m), 7);
    }
}
