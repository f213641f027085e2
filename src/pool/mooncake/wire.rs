//! The control protocol between the backend and its helper process.
//!
//! Frames are little-endian `u32 length | u64 request id | u8 op-or-status | body`, the
//! length counting everything after itself. A request's body starts with its deadline
//! (`u64` nanoseconds of `CLOCK_MONOTONIC`, which `Instant` and Python's `time.monotonic`
//! both read), so the helper never starts a request whose caller has given up. Requests carry keys and `(region, offset,
//! length)` triples; object bytes never cross the socket. Replies are routed to their
//! callers by request id (a waiting caller reads the socket and hands on what is not its
//! own), so a caller that gave up (timeout) never reads a reply meant for someone else,
//! and every wait is bounded.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded};
use parking_lot::Mutex;

/// Largest frame either side accepts.
pub const MAX_FRAME: usize = 16 << 20;
/// Longest key the protocol carries (u16 length prefix; Mooncake keys are far shorter).
pub const MAX_KEY: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Put = 1,
    Get = 2,
    Exists = 3,
    Remove = 4,
    Status = 5,
    RawBench = 6,
}

/// A decoded reply.
#[derive(Debug)]
pub enum Reply {
    /// Per-item results (Mooncake codes), or a JSON document for `Status`/`RawBench`.
    Ok(Vec<u8>),
    /// The helper is up but the store cannot serve (master down, setup pending).
    Unavailable(String),
    /// The helper refused the request as malformed.
    Bad(String),
    /// The helper did not run the request (its queue was full, or the deadline passed
    /// while it waited there): nothing was read or written.
    Busy(String),
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("helper did not answer within {0:?}")]
    Timeout(Duration),
    /// The reply came after the deadline (see [`Conn::call_settled`]): the helper is done
    /// with the request and touches none of its memory any more.
    #[error("helper answered after the deadline of {0:?}")]
    Late(Duration),
    #[error("control connection closed")]
    Closed,
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("malformed reply: {0}")]
    Malformed(&'static str),
}

/// Builds a request body.
#[derive(Default)]
pub struct Body(Vec<u8>);

impl Body {
    pub fn with_capacity(n: usize) -> Self {
        Self(Vec::with_capacity(n))
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A key with its u16 length; callers check [`MAX_KEY`] first.
    pub fn key(&mut self, k: &str) -> &mut Self {
        self.0.extend_from_slice(&(k.len() as u16).to_le_bytes());
        self.0.extend_from_slice(k.as_bytes());
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Decodes the per-item results of an `Ok` reply: `u32 n`, then `n` i64.
pub fn decode_results(body: &[u8], expect: usize) -> Result<Vec<i64>, WireError> {
    let n = body
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or(WireError::Malformed("short results"))?;
    if n != expect || body.len() != 4 + n * 8 {
        return Err(WireError::Malformed("result count differs from the request"));
    }
    Ok(body[4..]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect())
}

type Pending = Mutex<HashMap<u64, Sender<Reply>>>;

/// How soon a caller waiting while another reads first looks whether the read half is
/// free; the wait doubles up to [`FOLLOW_SLICE_MAX`], so a caller waiting beside a long
/// transfer does not spin. (Its own reply, when another caller reads it, wakes it at once.)
const FOLLOW_SLICE: Duration = Duration::from_micros(200);
const FOLLOW_SLICE_MAX: Duration = Duration::from_millis(10);

/// The read side of the connection and the bytes read past the last whole frame.
struct ReadHalf {
    stream: UnixStream,
    buf: Vec<u8>,
}

/// One control connection to a helper, shared by every caller.
///
/// There is no reader thread: a caller waiting for its reply reads the socket itself
/// while it holds the read half, and routes every other caller's reply to that caller's
/// channel. A reader thread cost one more wake-up per call (helper → reader → caller),
/// on the path of every existence query a lookup sends.
pub struct Conn {
    writer: Mutex<UnixStream>,
    reader: Mutex<ReadHalf>,
    pending: Pending,
    next_id: AtomicU64,
    open: AtomicBool,
    born: Instant,
    /// Milliseconds after `born` of the last reply of any kind.
    last_reply: AtomicU64,
}

/// How a turn at the read half ended.
enum Turn {
    /// This caller's reply.
    Mine(Reply),
    /// The turn's time ran out without it (other replies may have been routed).
    NotYet,
}

impl Conn {
    /// Wraps an accepted stream.
    pub fn new(stream: UnixStream) -> std::io::Result<Arc<Self>> {
        let reader = stream.try_clone()?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        Ok(Arc::new(Self {
            writer: Mutex::new(stream),
            reader: Mutex::new(ReadHalf {
                stream: reader,
                buf: Vec::with_capacity(64 << 10),
            }),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            open: AtomicBool::new(true),
            born: Instant::now(),
            last_reply: AtomicU64::new(0),
        }))
    }

    /// How long ago the helper last answered anything: a helper busy with a long transfer
    /// answers a probe late but is not hung.
    pub fn since_last_reply(&self) -> Duration {
        let at = Duration::from_millis(self.last_reply.load(Ordering::Relaxed));
        self.born.elapsed().saturating_sub(at)
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Sends one request and waits at most `timeout` for its reply.
    pub fn call(&self, op: Op, body: &Body, timeout: Duration) -> Result<Reply, WireError> {
        self.call_settled(op, body, timeout, Duration::ZERO)
    }

    /// [`Conn::call`] for a request that moves bytes in caller memory: when `timeout`
    /// passes, it waits up to `settle` more for the reply (the helper may be running it),
    /// so that a caller never reuses memory the helper may still write. A reply in that
    /// time is [`WireError::Late`]; none is [`WireError::Timeout`], and the caller must
    /// then stop the helper before it reuses the memory.
    pub fn call_settled(&self, op: Op, body: &Body, timeout: Duration, settle: Duration) -> Result<Reply, WireError> {
        let len = 9 + 8 + body.len();
        if len > MAX_FRAME {
            return Err(WireError::TooLarge(len));
        }
        if !self.is_open() {
            return Err(WireError::Closed);
        }
        let deadline = Instant::now() + timeout;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let rx: Receiver<Reply> = {
            let (tx, rx) = bounded(1);
            self.pending.lock().insert(id, tx);
            rx
        };
        // One write for head and body: written apart, the helper woke on the head, read
        // it, and slept again until the body came, one more wake-up per call.
        let mut frame = Vec::with_capacity(len + 4);
        frame.extend_from_slice(&(len as u32).to_le_bytes());
        frame.extend_from_slice(&id.to_le_bytes());
        frame.push(op as u8);
        frame.extend_from_slice(&monotonic_ns(deadline).to_le_bytes());
        frame.extend_from_slice(&body.0);
        let sent = self.writer.lock().write_all(&frame);
        if let Err(e) = sent {
            self.pending.lock().remove(&id);
            self.shutdown();
            return Err(e.into());
        }
        let mut got = self.wait_reply(id, &rx, deadline);
        if matches!(got, Err(WireError::Timeout(_))) && !settle.is_zero() {
            got = match self.wait_reply(id, &rx, Instant::now() + settle) {
                Ok(_) => Err(WireError::Late(timeout)),
                Err(e) => Err(e),
            };
        }
        self.pending.lock().remove(&id);
        got.map_err(|e| match e {
            WireError::Timeout(_) => WireError::Timeout(timeout),
            e => e,
        })
    }

    /// Waits for reply `id`: from `rx` when another caller read it, else by taking the
    /// read half and reading until it comes. Every wait ends by `deadline`.
    fn wait_reply(&self, id: u64, rx: &Receiver<Reply>, deadline: Instant) -> Result<Reply, WireError> {
        let mut slice = FOLLOW_SLICE;
        loop {
            match rx.try_recv() {
                Ok(r) => return Ok(r),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(WireError::Closed),
                Err(crossbeam_channel::TryRecvError::Empty) => {}
            }
            if !self.is_open() {
                return Err(WireError::Closed);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(WireError::Timeout(Duration::ZERO));
            }
            // While another caller reads, it routes this reply to `rx`: wait there, and
            // look again at the read half every slice in case that caller is done.
            let Some(mut half) = self.reader.try_lock() else {
                match rx.recv_timeout(left.min(slice)) {
                    Ok(r) => return Ok(r),
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return Err(WireError::Closed),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        slice = (slice * 2).min(FOLLOW_SLICE_MAX);
                        continue;
                    }
                }
            };
            if let Ok(r) = rx.try_recv() {
                return Ok(r);
            }
            match self.read_turn(&mut half, id, deadline) {
                Ok(Turn::Mine(r)) => return Ok(r),
                Ok(Turn::NotYet) => {}
                Err(e) => {
                    drop(half);
                    self.close_reads();
                    return Err(e);
                }
            }
        }
    }

    /// Reads frames until reply `id` arrives or `deadline` passes, routing the others.
    /// Bytes of a frame not yet whole stay in the buffer for the next turn, so a turn
    /// that times out mid-frame never loses the stream's framing.
    fn read_turn(&self, half: &mut ReadHalf, id: u64, deadline: Instant) -> Result<Turn, WireError> {
        let mut chunk = [0u8; 64 << 10];
        loop {
            while let Some(frame) = take_frame(&mut half.buf)? {
                self.last_reply
                    .store(self.born.elapsed().as_millis() as u64, Ordering::Relaxed);
                if frame.0 == id {
                    return Ok(Turn::Mine(frame.1));
                }
                // A caller that timed out has removed its entry; its late reply is dropped.
                if let Some(tx) = self.pending.lock().remove(&frame.0) {
                    let _ = tx.try_send(frame.1);
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(Turn::NotYet);
            }
            half.stream.set_read_timeout(Some(left))?;
            match half.stream.read(&mut chunk) {
                Ok(0) => return Err(WireError::Closed),
                Ok(n) => half.buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    return Ok(Turn::NotYet);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The helper closed the socket or broke the framing: every caller sees `Closed`.
    fn close_reads(&self) {
        self.open.store(false, Ordering::Release);
        // Dropping the senders wakes every waiting caller with `Closed`.
        self.pending.lock().clear();
    }

    /// Closes the connection; pending callers see `Closed`.
    pub fn shutdown(&self) {
        self.open.store(false, Ordering::Release);
        let _ = self.writer.lock().shutdown(std::net::Shutdown::Both);
        self.pending.lock().clear();
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// `at` as nanoseconds of `CLOCK_MONOTONIC`, the clock the helper reads its deadlines on.
fn monotonic_ns(at: Instant) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given and nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now = Instant::now();
    let base = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    match at.checked_duration_since(now) {
        Some(ahead) => base.saturating_add(ahead.as_nanos() as u64),
        None => base.saturating_sub(now.duration_since(at).as_nanos() as u64),
    }
}

/// Takes one whole frame off the front of `buf`: `(request id, reply)`, or `None` while
/// the frame is still incomplete.
fn take_frame(buf: &mut Vec<u8>) -> Result<Option<(u64, Reply)>, WireError> {
    if buf.len() < 13 {
        return Ok(None);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if !(9..=MAX_FRAME).contains(&len) {
        tracing::warn!(len, "mooncake helper sent a bad frame length; closing");
        return Err(WireError::Malformed("reply frame length out of range"));
    }
    if buf.len() < 4 + len {
        return Ok(None);
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&buf[4..12]);
    let status = buf[12];
    let body = buf[13..4 + len].to_vec();
    buf.drain(..4 + len);
    let reply = match status {
        0 => Reply::Ok(body),
        1 => Reply::Unavailable(String::from_utf8_lossy(&body).into_owned()),
        3 => Reply::Busy(String::from_utf8_lossy(&body).into_owned()),
        _ => Reply::Bad(String::from_utf8_lossy(&body).into_owned()),
    };
    Ok(Some((u64::from_le_bytes(id), reply)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_and_reply_round_trip_over_a_socket_pair() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let conn = Conn::new(a).unwrap();
        let echo = std::thread::spawn(move || {
            let mut head = [0u8; 13];
            b.read_exact(&mut head).unwrap();
            let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len - 9];
            b.read_exact(&mut body).unwrap();
            assert_eq!(head[12], Op::Exists as u8);
            assert!(body.len() >= 8, "a request carries its deadline");
            let mut out = Vec::new();
            out.extend_from_slice(&1u32.to_le_bytes());
            out.extend_from_slice(&(-704i64).to_le_bytes());
            let mut frame = ((out.len() + 9) as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(&head[4..12]);
            frame.push(0);
            frame.extend_from_slice(&out);
            b.write_all(&frame).unwrap();
            b
        });
        let mut body = Body::default();
        body.u32(1).key("abc");
        let r = conn.call(Op::Exists, &body, Duration::from_secs(5)).unwrap();
        let Reply::Ok(bytes) = r else { panic!("{r:?}") };
        assert_eq!(decode_results(&bytes, 1).unwrap(), vec![-704]);
        let b = echo.join().unwrap();
        // No reply: the wait is bounded.
        assert!(matches!(
            conn.call(Op::Status, &Body::default(), Duration::from_millis(50)),
            Err(WireError::Timeout(_))
        ));
        drop(b);
        std::thread::sleep(Duration::from_millis(50));
        assert!(matches!(
            conn.call(Op::Status, &Body::default(), Duration::from_millis(50)),
            Err(WireError::Closed) | Err(WireError::Io(_))
        ));
    }

    /// Reads one request frame: (request id, body).
    fn request(b: &mut UnixStream) -> (u64, Vec<u8>) {
        let mut head = [0u8; 13];
        b.read_exact(&mut head).unwrap();
        let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len - 9];
        b.read_exact(&mut body).unwrap();
        // The deadline leads the body.
        (u64::from_le_bytes(head[4..12].try_into().unwrap()), body.split_off(8))
    }

    fn reply(id: u64, body: &[u8]) -> Vec<u8> {
        let mut frame = ((body.len() + 9) as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&id.to_le_bytes());
        frame.push(0);
        frame.extend_from_slice(body);
        frame
    }

    #[test]
    fn concurrent_callers_get_their_own_replies_whoever_reads() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let conn = Conn::new(a).unwrap();
        // The helper answers in the reverse order of the requests, so the caller that
        // reads first meets the other's reply before its own.
        let helper = std::thread::spawn(move || {
            let first = request(&mut b);
            let second = request(&mut b);
            for (id, body) in [second, first] {
                b.write_all(&reply(id, &body)).unwrap();
            }
            b
        });
        let callers: Vec<_> = (0..2u8)
            .map(|i| {
                let c = conn.clone();
                std::thread::spawn(move || {
                    let mut body = Body::default();
                    body.bytes(&[i; 7]);
                    c.call(Op::Status, &body, Duration::from_secs(10)).unwrap()
                })
            })
            .collect();
        for (i, t) in callers.into_iter().enumerate() {
            let Reply::Ok(got) = t.join().unwrap() else {
                panic!("not ok")
            };
            assert_eq!(got, vec![i as u8; 7], "caller {i} got its own reply");
        }
        drop(helper.join().unwrap());
    }

    #[test]
    fn a_reply_split_across_a_timeout_keeps_the_framing() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let conn = Conn::new(a).unwrap();
        let (go, wait) = crossbeam_channel::bounded::<()>(1);
        let helper = std::thread::spawn(move || {
            let (late, _) = request(&mut b);
            let frame = reply(late, b"late");
            // Half a frame, then nothing until the caller has timed out.
            b.write_all(&frame[..9]).unwrap();
            wait.recv().unwrap();
            b.write_all(&frame[9..]).unwrap();
            let (id, body) = request(&mut b);
            b.write_all(&reply(id, &body)).unwrap();
            b
        });
        assert!(matches!(
            conn.call(Op::Status, &Body::default(), Duration::from_millis(100)),
            Err(WireError::Timeout(_))
        ));
        go.send(()).unwrap();
        let mut body = Body::default();
        body.bytes(b"next");
        // The late reply's rest is read and dropped; this caller gets its own.
        let r = conn.call(Op::Status, &body, Duration::from_secs(10)).unwrap();
        assert!(matches!(r, Reply::Ok(ref b) if b == b"next"), "{r:?}");
        drop(helper.join().unwrap());
    }

    #[test]
    fn a_request_carries_its_deadline_and_a_late_reply_settles_the_call() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let conn = Conn::new(a).unwrap();
        let (go, wait) = crossbeam_channel::bounded::<()>(1);
        let helper = std::thread::spawn(move || {
            let mut head = [0u8; 13];
            b.read_exact(&mut head).unwrap();
            let len = u32::from_le_bytes(head[..4].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len - 9];
            b.read_exact(&mut body).unwrap();
            let deadline = u64::from_le_bytes(body[..8].try_into().unwrap());
            let now = monotonic_ns(Instant::now());
            // The caller allowed 100 ms: the deadline lies that far ahead on this clock.
            assert!(deadline > now && deadline <= now + 100_000_000, "{deadline} vs {now}");
            assert_eq!(&body[8..], b"payload");
            // Answer only after the caller's deadline has passed.
            wait.recv().unwrap();
            b.write_all(&reply(u64::from_le_bytes(head[4..12].try_into().unwrap()), b"done"))
                .unwrap();
            b
        });
        let mut body = Body::default();
        body.bytes(b"payload");
        let c = conn.clone();
        let caller = std::thread::spawn(move || {
            c.call_settled(Op::Get, &body, Duration::from_millis(100), Duration::from_secs(30))
        });
        // The caller is still waiting past its deadline: it returns only once the reply came.
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(300) && !caller.is_finished() {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!caller.is_finished(), "a call past its deadline waits for its reply");
        go.send(()).unwrap();
        assert!(matches!(caller.join().unwrap(), Err(WireError::Late(_))));
        let _b = helper.join().unwrap();
        // No reply at all within the settle time: a timeout, and the caller stops the helper.
        let mut body = Body::default();
        body.bytes(b"x");
        assert!(matches!(
            conn.call_settled(Op::Get, &body, Duration::from_millis(20), Duration::from_millis(50)),
            Err(WireError::Timeout(_))
        ));
    }
}
