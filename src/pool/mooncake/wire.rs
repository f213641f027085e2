//! The control protocol between the backend and its helper process.
//!
//! Frames are little-endian `u32 length | u64 request id | u8 op-or-status | body`, the
//! length counting everything after itself. Requests carry keys and `(region, offset,
//! length)` triples; object bytes never cross the socket. A reader thread routes each
//! reply to its caller by request id, so a caller that gave up (timeout) never reads a
//! reply meant for someone else, and every wait is bounded.

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
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("helper did not answer within {0:?}")]
    Timeout(Duration),
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

type Pending = Arc<Mutex<HashMap<u64, Sender<Reply>>>>;

/// One control connection to a helper, shared by every caller.
pub struct Conn {
    writer: Mutex<UnixStream>,
    pending: Pending,
    next_id: AtomicU64,
    open: Arc<AtomicBool>,
    born: Instant,
    /// Milliseconds after `born` of the last reply of any kind.
    last_reply: Arc<AtomicU64>,
}

impl Conn {
    /// Wraps an accepted stream and starts its reader thread.
    pub fn new(stream: UnixStream) -> std::io::Result<Arc<Self>> {
        let reader = stream.try_clone()?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        let pending: Pending = Arc::default();
        let open = Arc::new(AtomicBool::new(true));
        let born = Instant::now();
        let last_reply = Arc::new(AtomicU64::new(0));
        let (p, o, l) = (pending.clone(), open.clone(), last_reply.clone());
        std::thread::Builder::new()
            .name("kvtier-mooncake-reader".into())
            .spawn(move || read_loop(reader, p, o, l, born))?;
        Ok(Arc::new(Self {
            writer: Mutex::new(stream),
            pending,
            next_id: AtomicU64::new(1),
            open,
            born,
            last_reply,
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
        let len = 9 + body.len();
        if len > MAX_FRAME {
            return Err(WireError::TooLarge(len));
        }
        if !self.is_open() {
            return Err(WireError::Closed);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let rx: Receiver<Reply> = {
            let (tx, rx) = bounded(1);
            self.pending.lock().insert(id, tx);
            rx
        };
        let mut head = [0u8; 13];
        head[..4].copy_from_slice(&(len as u32).to_le_bytes());
        head[4..12].copy_from_slice(&id.to_le_bytes());
        head[12] = op as u8;
        let sent = {
            let mut w = self.writer.lock();
            w.write_all(&head).and_then(|_| w.write_all(&body.0))
        };
        if let Err(e) = sent {
            self.pending.lock().remove(&id);
            self.shutdown();
            return Err(e.into());
        }
        let got = rx.recv_timeout(timeout);
        self.pending.lock().remove(&id);
        match got {
            Ok(r) => Ok(r),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(WireError::Timeout(timeout)),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(WireError::Closed),
        }
    }

    /// Closes the connection; the reader thread ends and pending callers see `Closed`.
    pub fn shutdown(&self) {
        self.open.store(false, Ordering::Release);
        let _ = self.writer.lock().shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn read_loop(mut s: UnixStream, pending: Pending, open: Arc<AtomicBool>, last: Arc<AtomicU64>, born: Instant) {
    let mut head = [0u8; 13];
    loop {
        if s.read_exact(&mut head).is_err() {
            break;
        }
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if !(9..=MAX_FRAME).contains(&len) {
            tracing::warn!(len, "mooncake helper sent a bad frame length; closing");
            break;
        }
        let id = u64::from_le_bytes(head[4..12].try_into().unwrap_or([0; 8]));
        let mut body = vec![0u8; len - 9];
        if s.read_exact(&mut body).is_err() {
            break;
        }
        let reply = match head[12] {
            0 => Reply::Ok(body),
            1 => Reply::Unavailable(String::from_utf8_lossy(&body).into_owned()),
            _ => Reply::Bad(String::from_utf8_lossy(&body).into_owned()),
        };
        last.store(born.elapsed().as_millis() as u64, Ordering::Relaxed);
        // A caller that timed out has removed its entry; its late reply is dropped here.
        if let Some(tx) = pending.lock().remove(&id) {
            let _ = tx.try_send(reply);
        }
    }
    open.store(false, Ordering::Release);
    // Dropping the senders wakes every waiting caller with `Closed`.
    pending.lock().clear();
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
}
