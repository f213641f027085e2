//! The master's `BatchExistKey`, asked from the daemon's own thread.
//!
//! An existence query needs no transfer engine and no segment: the master alone holds which
//! objects are complete. Asking it through the helper costs two extra wake-ups (the helper's
//! and the wheel's I/O thread), more than the query itself on a busy node, so the pool asks
//! the master directly over its RPC protocol (yalantinglibs `coro_rpc` with `struct_pack`
//! bodies) and keeps the helper for the data path.
//!
//! Only this one call is spoken, in the exact form the pinned wheel's client sends it:
//!
//! ```text
//! request  = magic 0x15 | version 0 | serialize 0 | msg 0 | seq u32 | function u32 | len u32 | attach u32
//!            | struct_pack(tuple<vector<string> keys, string tenant>)
//! response = magic 0x15 | version 0 | errc u8 | msg 0 | seq u32 | len u32 | attach u32
//!            | struct_pack(vector<expected<bool, ErrorCode>>)
//! struct_pack(v) = type hash u32 (low bit: meta follows) | meta u8 | type string '\0' | payload
//! ```
//!
//! Every integer is little-endian. Container lengths in the payload all take the same
//! width, one byte while every container is under 256 and two (meta bit 3) under 65,536.
//! The type hash and type string are fixed by the C++ types; a master built from other
//! sources may answer with another hash or an RPC error, and then [`RpcError::Protocol`]
//! tells the pool to use the helper instead, for good.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

const MAGIC: u8 = 0x15;
const REQ_HEAD: usize = 20;
const RESP_HEAD: usize = 16;
/// `coro_rpc`'s id of `WrappedMasterService::BatchExistKey`.
const FN_BATCH_EXIST_KEY: u32 = 0xb89f_a6b0;
/// `struct_pack` type hash of `tuple<vector<string>, string>`, with the meta flag set.
const ARGS_HASH: u32 = 0x00f7_8d63;
const ARGS_TYPE: &[u8] = b"\xfd\x84\x80\x0c\x80\x0c\xff\x00";
/// `struct_pack` type hash of `vector<expected<bool, ErrorCode>>`, with the meta flag set.
const RESULT_HASH: u32 = 0x2a5f_8c5d;
const RESULT_TYPE: &[u8] = b"\x84\x87\x0b\x01\x00";
/// Meta bit: the type string follows.
const META_TYPE_INFO: u8 = 0x04;
/// The tenant the wheel's client names when it names none.
const TENANT: &[u8] = b"default";
/// Idle connections kept for the next query; more callers at once open more.
const MAX_IDLE: usize = 8;
/// A batch goes out as one request per this many keys (see [`MasterRpc::batch_exists`]) ...
const KEYS_PER_REQUEST: usize = 64;
/// ... on at most this many connections at once.
const MAX_REQUESTS: usize = 4;

/// Why a query got no answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum RpcError {
    /// The master could not be reached or hung up: the store is down for now.
    #[error("Mooncake master at {addr}: {source}")]
    Io { addr: String, source: io::Error },
    /// The master answered in a form this client does not speak.
    #[error("Mooncake master at {addr} does not speak this BatchExistKey: {why}")]
    Protocol { addr: String, why: String },
    /// More keys (or a longer key) than one request can carry.
    #[error("{0}")]
    TooLarge(String),
}

/// A client for the master's `BatchExistKey`, safe to share among threads.
pub(super) struct MasterRpc {
    addr: String,
    timeout: Duration,
    seq: AtomicU32,
    idle: Mutex<Vec<TcpStream>>,
    /// The daemon's connections, for queries its async runtime awaits.
    #[cfg(feature = "daemon")]
    idle_async: Mutex<Vec<tokio::net::TcpStream>>,
    /// Set for good once the master answered in a form this client does not speak.
    refused: AtomicBool,
}

impl MasterRpc {
    /// `addr` is the master's `host:port`; `timeout` bounds the connect and each read or
    /// write of one query. Nothing connects until the first query.
    pub(super) fn new(addr: &str, timeout: Duration) -> Self {
        Self {
            addr: addr.to_owned(),
            timeout,
            seq: AtomicU32::new(1),
            idle: Mutex::new(Vec::new()),
            #[cfg(feature = "daemon")]
            idle_async: Mutex::new(Vec::new()),
            refused: AtomicBool::new(false),
        }
    }

    /// Whether the master was found to speak another protocol (see [`MasterRpc::refuse`]).
    pub(super) fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// Stops using this client for good after `e`, a [`RpcError::Protocol`]; logs once.
    pub(super) fn refuse(&self, e: &RpcError) {
        if !self.refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e, "existence queries go through the helper from now on");
        }
        self.reset();
    }

    /// One answer per key, in order: `Ok(true)` complete in the store, `Ok(false)` absent,
    /// `Err(code)` the master's negative `ErrorCode` for that key.
    ///
    /// The master answers one request on one of its threads, at about a microsecond a key;
    /// a batch goes out as up to [`MAX_REQUESTS`] requests of at least [`KEYS_PER_REQUEST`]
    /// keys on as many connections, all sent before any answer is read, so that many of its
    /// threads answer at once.
    pub(super) fn batch_exists(&self, keys: &[&str]) -> Result<Vec<Result<bool, i64>>, RpcError> {
        let mut calls = Vec::with_capacity(MAX_REQUESTS);
        for part in split(keys) {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            let frame = encode_request(seq, part)?;
            let pooled = self.idle.lock().pop();
            let (conn, reused) = match pooled {
                Some(c) => (c, true),
                None => (self.connect()?, false),
            };
            let mut call = Call {
                conn,
                reused,
                frame,
                seq,
                n: part.len(),
            };
            if let Err(e) = call.conn.write_all(&call.frame) {
                if !call.reused {
                    return Err(self.io(e));
                }
                call.conn = self.connect()?;
                call.reused = false;
                call.conn.write_all(&call.frame).map_err(|e| self.io(e))?;
            }
            calls.push(call);
        }
        let mut out = Vec::with_capacity(keys.len());
        for mut call in calls {
            let body = match self.receive(&mut call) {
                // A pooled connection the master closed meanwhile (it restarted): one fresh try.
                Err(RpcError::Io { .. }) if call.reused => {
                    call.conn = self.connect()?;
                    call.conn.write_all(&call.frame).map_err(|e| self.io(e))?;
                    self.receive(&mut call)
                }
                r => r,
            }?;
            out.extend(decode_response(&body, call.n).map_err(|why| self.protocol(why))?);
            let mut idle = self.idle.lock();
            if idle.len() < MAX_IDLE {
                idle.push(call.conn);
            }
        }
        Ok(out)
    }

    /// Drops every idle connection (the master is known to be gone).
    pub(super) fn reset(&self) {
        #[cfg(feature = "daemon")]
        self.idle_async.lock().clear();
        self.idle.lock().clear();
    }

    fn io(&self, source: io::Error) -> RpcError {
        RpcError::Io {
            addr: self.addr.clone(),
            source,
        }
    }

    fn protocol(&self, why: String) -> RpcError {
        RpcError::Protocol {
            addr: self.addr.clone(),
            why,
        }
    }

    /// Reads `call`'s reply and returns its body.
    fn receive(&self, call: &mut Call<TcpStream>) -> Result<Vec<u8>, RpcError> {
        let mut head = [0u8; RESP_HEAD];
        call.conn.read_exact(&mut head).map_err(|e| self.io(e))?;
        let mut body = vec![0u8; reply_len(&head, call.frame.len()).map_err(|why| self.protocol(why))?];
        call.conn.read_exact(&mut body).map_err(|e| self.io(e))?;
        reply_body(&head, call.seq, body).map_err(|why| self.protocol(why))
    }

    fn connect(&self) -> Result<TcpStream, RpcError> {
        let addrs: Vec<SocketAddr> = self.addr.to_socket_addrs().map_err(|e| self.io(e))?.collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "the address resolves to nothing");
        for a in addrs {
            match TcpStream::connect_timeout(&a, self.timeout) {
                Ok(s) => {
                    s.set_nodelay(true).map_err(|e| self.io(e))?;
                    s.set_read_timeout(Some(self.timeout)).map_err(|e| self.io(e))?;
                    s.set_write_timeout(Some(self.timeout)).map_err(|e| self.io(e))?;
                    return Ok(s);
                }
                Err(e) => last = e,
            }
        }
        Err(self.io(last))
    }
}

/// The same queries on the daemon's async runtime: its connection task awaits the master's
/// answer instead of handing the lookup to a blocking thread and being woken by that thread.
#[cfg(feature = "daemon")]
impl MasterRpc {
    /// [`MasterRpc::batch_exists`], awaited: the same requests, split the same way.
    pub(super) async fn batch_exists_async(&self, keys: &[&str]) -> Result<Vec<Result<bool, i64>>, RpcError> {
        use tokio::io::AsyncWriteExt;
        let mut calls = Vec::with_capacity(MAX_REQUESTS);
        for part in split(keys) {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            let frame = encode_request(seq, part)?;
            let pooled = self.idle_async.lock().pop();
            let (conn, reused) = match pooled {
                Some(c) => (c, true),
                None => (self.connect_async().await?, false),
            };
            let mut call = Call {
                conn,
                reused,
                frame,
                seq,
                n: part.len(),
            };
            if let Err(e) = self.bounded(call.conn.write_all(&call.frame)).await {
                if !call.reused {
                    return Err(e);
                }
                call.conn = self.connect_async().await?;
                call.reused = false;
                self.bounded(call.conn.write_all(&call.frame)).await?;
            }
            calls.push(call);
        }
        let mut out = Vec::with_capacity(keys.len());
        for mut call in calls {
            let body = match self.receive_async(&mut call).await {
                // A pooled connection the master closed meanwhile (it restarted): one fresh try.
                Err(RpcError::Io { .. }) if call.reused => {
                    call.conn = self.connect_async().await?;
                    self.bounded(call.conn.write_all(&call.frame)).await?;
                    self.receive_async(&mut call).await
                }
                r => r,
            }?;
            out.extend(decode_response(&body, call.n).map_err(|why| self.protocol(why))?);
            let mut idle = self.idle_async.lock();
            if idle.len() < MAX_IDLE {
                idle.push(call.conn);
            }
        }
        Ok(out)
    }

    /// `f` within the op timeout.
    async fn bounded<T>(&self, f: impl std::future::Future<Output = io::Result<T>>) -> Result<T, RpcError> {
        match tokio::time::timeout(self.timeout, f).await {
            Ok(r) => r.map_err(|e| self.io(e)),
            Err(_) => Err(self.io(io::Error::new(
                io::ErrorKind::TimedOut,
                "no answer within the op timeout",
            ))),
        }
    }

    async fn connect_async(&self) -> Result<tokio::net::TcpStream, RpcError> {
        let s = self.bounded(tokio::net::TcpStream::connect(self.addr.as_str())).await?;
        s.set_nodelay(true).map_err(|e| self.io(e))?;
        Ok(s)
    }

    /// [`MasterRpc::receive`], awaited, each read within the op timeout.
    async fn receive_async(&self, call: &mut Call<tokio::net::TcpStream>) -> Result<Vec<u8>, RpcError> {
        use tokio::io::AsyncReadExt;
        let mut head = [0u8; RESP_HEAD];
        self.bounded(call.conn.read_exact(&mut head)).await?;
        let mut body = vec![0u8; reply_len(&head, call.frame.len()).map_err(|why| self.protocol(why))?];
        self.bounded(call.conn.read_exact(&mut body)).await?;
        reply_body(&head, call.seq, body).map_err(|why| self.protocol(why))
    }
}

/// The requests a batch of keys goes out as: one per [`KEYS_PER_REQUEST`] keys, at most
/// [`MAX_REQUESTS`], near-equal, in key order.
fn split<'a, 'k>(keys: &'a [&'k str]) -> std::slice::Chunks<'a, &'k str> {
    let parts = (keys.len() / KEYS_PER_REQUEST).clamp(1, MAX_REQUESTS);
    keys.chunks(keys.len().div_ceil(parts).max(1))
}

/// One request in flight on its own connection (a blocking or a tokio stream).
struct Call<S> {
    conn: S,
    reused: bool,
    frame: Vec<u8>,
    seq: u32,
    n: usize,
}

/// Bytes that follow a reply's header, refused where they cannot be the reply to a request
/// of `sent` bytes: an answer is at most 5 bytes a key, so a larger reply is never read in.
fn reply_len(head: &[u8; RESP_HEAD], sent: usize) -> Result<usize, String> {
    if head[0] != MAGIC {
        return Err(format!("reply magic {:#04x}", head[0]));
    }
    let len = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    let attach = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
    if len + attach > 64 + 5 * sent {
        return Err(format!("reply of {} bytes to a {sent}-byte request", len + attach));
    }
    Ok(len + attach)
}

/// The reply's struct_pack body, once the header's status and sequence number are checked.
fn reply_body(head: &[u8; RESP_HEAD], seq: u32, mut body: Vec<u8>) -> Result<Vec<u8>, String> {
    if head[2] != 0 {
        return Err(format!("RPC error {} in reply", head[2]));
    }
    let got_seq = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
    if got_seq != seq {
        return Err(format!("reply to request {got_seq}, not {seq}"));
    }
    body.truncate(u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize);
    Ok(body)
}

/// Width code of the payload's container lengths (meta bits 3–4) and its byte count.
fn len_width(max: usize) -> (u8, usize) {
    match max {
        0..=0xff => (0, 1),
        0x100..=0xffff => (1, 2),
        _ => (2, 4),
    }
}

fn put_len(out: &mut Vec<u8>, n: usize, width: usize) {
    out.extend_from_slice(&(n as u32).to_le_bytes()[..width]);
}

/// The whole request frame for `keys`.
fn encode_request(seq: u32, keys: &[&str]) -> Result<Vec<u8>, RpcError> {
    let max = keys
        .iter()
        .map(|k| k.len())
        .chain([keys.len(), TENANT.len()])
        .max()
        .unwrap_or(0);
    if max > u32::MAX as usize / 2 {
        return Err(RpcError::TooLarge(format!("{} keys of up to {max} bytes", keys.len())));
    }
    let (code, width) = len_width(max);
    let payload: usize = keys.iter().map(|k| width + k.len()).sum::<usize>() + 2 * width + TENANT.len();
    let body_len = 4 + 1 + ARGS_TYPE.len() + payload;
    let mut out = Vec::with_capacity(REQ_HEAD + body_len);
    out.extend_from_slice(&[MAGIC, 0, 0, 0]);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&FN_BATCH_EXIST_KEY.to_le_bytes());
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&ARGS_HASH.to_le_bytes());
    out.push(META_TYPE_INFO | (code << 3));
    out.extend_from_slice(ARGS_TYPE);
    put_len(&mut out, keys.len(), width);
    for k in keys {
        put_len(&mut out, k.len(), width);
        out.extend_from_slice(k.as_bytes());
    }
    put_len(&mut out, TENANT.len(), width);
    out.extend_from_slice(TENANT);
    debug_assert_eq!(out.len(), REQ_HEAD + body_len);
    Ok(out)
}

/// The answers in a reply body, which must hold exactly `n`.
fn decode_response(body: &[u8], n: usize) -> Result<Vec<Result<bool, i64>>, String> {
    let mut r = Reader { buf: body, at: 0 };
    let hash = u32::from_le_bytes(r.take(4)?.try_into().expect("4 bytes"));
    if hash | 1 != RESULT_HASH {
        return Err(format!("reply type hash {hash:#010x}, not {RESULT_HASH:#010x}"));
    }
    let width = if hash & 1 == 1 {
        let meta = r.take(1)?[0];
        if meta & 0x03 != 0 || meta & 0xe0 != 0 {
            return Err(format!("reply meta {meta:#04x}"));
        }
        if meta & META_TYPE_INFO != 0 && r.take(RESULT_TYPE.len())? != RESULT_TYPE {
            return Err("reply type string differs".into());
        }
        [1, 2, 4, 8][((meta >> 3) & 0x03) as usize]
    } else {
        1
    };
    let count = r.uint(width)?;
    if count != n as u64 {
        return Err(format!("{count} answers to {n} keys"));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        match r.take(1)?[0] {
            0 => {
                let code = i32::from_le_bytes(r.take(4)?.try_into().expect("4 bytes"));
                out.push(Err(i64::from(code)));
            }
            _ => out.push(Ok(r.take(1)?[0] != 0)),
        }
    }
    if r.at != body.len() {
        return Err(format!("{} bytes after the answers", body.len() - r.at));
    }
    Ok(out)
}

struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| format!("reply ends at {} of {} bytes", self.buf.len(), self.at + n))?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn uint(&mut self, width: usize) -> Result<u64, String> {
        let mut b = [0u8; 8];
        b[..width].copy_from_slice(self.take(width)?);
        Ok(u64::from_le_bytes(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The request the wheel 0.3.13.post1 sent for `batch_is_exist(["cap_key_a", "cap_key_b"])`,
    /// captured on loopback.
    #[test]
    fn request_matches_the_wheel_byte_for_byte() {
        let want = hex(concat!(
            "1500000006000000b0a69fb82a00000000000000",
            "638df70004fd84800c800cff00",
            "02096361705f6b65795f61096361705f6b65795f62",
            "0764656661756c74"
        ));
        assert_eq!(encode_request(6, &["cap_key_a", "cap_key_b"]).unwrap(), want);
    }

    /// 300 keys need two-byte lengths everywhere (meta 0x0c), as the wheel sent them.
    #[test]
    fn long_batches_use_two_byte_lengths() {
        let keys: Vec<String> = (0..300).map(|i| format!("k{i:03}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let f = encode_request(1, &refs).unwrap();
        assert_eq!(&f[..8], &hex("1500000001000000")[..]);
        assert_eq!(
            u32::from_le_bytes(f[12..16].try_into().unwrap()) as usize,
            f.len() - REQ_HEAD
        );
        assert_eq!(&f[20..33], &hex("638df7000cfd84800c800cff00")[..]);
        assert_eq!(&f[33..43], &hex("2c0104006b3030300400")[..]);
        assert!(f.ends_with(&hex("070064656661756c74")));
    }

    #[test]
    fn replies_decode_to_one_answer_per_key() {
        // The master's reply to the two-key request: present, absent.
        let body = hex("5d8c5f2a0484870b01000201010100");
        assert_eq!(decode_response(&body, 2).unwrap(), vec![Ok(true), Ok(false)]);
        // An error for the second key (OBJECT_NOT_FOUND would be -704: 0x40fdffff).
        let body = hex("5d8c5f2a0484870b01000201010040fdffff");
        assert_eq!(decode_response(&body, 2).unwrap(), vec![Ok(true), Err(-704)]);
        // Two-byte lengths: 300 answers.
        let mut body = hex("5d8c5f2a0c84870b01002c01");
        body.extend(std::iter::repeat_n([1u8, 1], 300).flatten());
        let got = decode_response(&body, 300).unwrap();
        assert_eq!(got.len(), 300);
        assert!(got.iter().all(|a| *a == Ok(true)));
    }

    #[test]
    fn foreign_replies_are_refused() {
        let good = hex("5d8c5f2a0484870b01000201010100");
        assert!(decode_response(&good, 3).unwrap_err().contains("2 answers to 3 keys"));
        let mut other_hash = good.clone();
        other_hash[1] ^= 0x10;
        assert!(decode_response(&other_hash, 2).unwrap_err().contains("type hash"));
        let mut other_type = good.clone();
        other_type[7] = 0x02;
        assert!(decode_response(&other_type, 2).unwrap_err().contains("type string"));
        assert!(
            decode_response(&good[..good.len() - 1], 2)
                .unwrap_err()
                .contains("reply ends")
        );
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(decode_response(&trailing, 2).unwrap_err().contains("after the answers"));
    }

    /// A master that never answers costs one timeout, not a hang; one that is not there is
    /// an I/O error at once.
    #[test]
    fn silent_and_absent_masters_are_io_errors() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let rpc = MasterRpc::new(&addr, Duration::from_millis(200));
        let t = std::time::Instant::now();
        assert!(matches!(rpc.batch_exists(&["a"]), Err(RpcError::Io { .. })));
        assert!(t.elapsed() < Duration::from_secs(5));
        drop(l);
        let rpc = MasterRpc::new(&addr, Duration::from_millis(200));
        assert!(matches!(rpc.batch_exists(&["a"]), Err(RpcError::Io { .. })));
    }

    /// A stand-in master that answers `BatchExistKey` for real: a key exists when it ends
    /// in `y`. Serves `conns` connections, each until it closes.
    fn fake_master(conns: usize) -> (String, std::thread::JoinHandle<usize>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let serve = move |mut s: TcpStream| -> usize {
            let mut asked = 0;
            loop {
                let mut head = [0u8; REQ_HEAD];
                if s.read_exact(&mut head).is_err() {
                    return asked;
                }
                assert_eq!(u32::from_le_bytes(head[8..12].try_into().unwrap()), FN_BATCH_EXIST_KEY);
                let len = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
                let mut body = vec![0u8; len];
                s.read_exact(&mut body).unwrap();
                assert_eq!(&body[..4], &ARGS_HASH.to_le_bytes());
                let width = [1, 2, 4, 8][((body[4] >> 3) & 3) as usize];
                let mut r = Reader {
                    buf: &body,
                    at: 5 + ARGS_TYPE.len(),
                };
                let n = r.uint(width).unwrap() as usize;
                let mut payload = vec![n as u8];
                for _ in 0..n {
                    let k = r.uint(width).unwrap() as usize;
                    let key = r.take(k).unwrap();
                    payload.extend_from_slice(&[1, (key.last() == Some(&b'y')) as u8]);
                }
                asked += n;
                let mut reply = vec![MAGIC, 0, 0, 0];
                reply.extend_from_slice(&head[4..8]);
                reply.extend_from_slice(&((payload.len() + 10) as u32).to_le_bytes());
                reply.extend_from_slice(&0u32.to_le_bytes());
                reply.extend_from_slice(&RESULT_HASH.to_le_bytes());
                reply.push(META_TYPE_INFO);
                reply.extend_from_slice(RESULT_TYPE);
                reply.extend_from_slice(&payload);
                s.write_all(&reply).unwrap();
            }
        };
        let h = std::thread::spawn(move || {
            let workers: Vec<_> = (0..conns)
                .map(|_| {
                    let (s, _) = l.accept().unwrap();
                    std::thread::spawn(move || serve(s))
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).sum()
        });
        (addr, h)
    }

    #[test]
    fn batches_split_into_at_most_four_requests_of_64_keys_or_more() {
        let keys: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let sizes = |n: usize| split(&refs[..n]).map(<[&str]>::len).collect::<Vec<_>>();
        assert_eq!(sizes(1), vec![1]);
        assert_eq!(sizes(127), vec![127]);
        assert_eq!(sizes(128), vec![64, 64]);
        assert_eq!(sizes(200), vec![67, 67, 66]);
        assert_eq!(sizes(256), vec![64; 4]);
        assert_eq!(sizes(1000), vec![250; 4]);
    }

    /// A long batch is asked as three requests on three connections; the answers come back
    /// in key order, and the connections serve the next query.
    #[test]
    fn split_batches_answer_in_key_order() {
        let (addr, master) = fake_master(3);
        let rpc = MasterRpc::new(&addr, Duration::from_secs(5));
        let keys: Vec<String> = (0..200)
            .map(|i| format!("k{i}{}", if i % 3 == 0 { "y" } else { "n" }))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        for _ in 0..2 {
            let got = rpc.batch_exists(&refs).unwrap();
            let want: Vec<Result<bool, i64>> = (0..200).map(|i| Ok(i % 3 == 0)).collect();
            assert_eq!(got, want);
        }
        assert_eq!(
            rpc.batch_exists(&refs[..5]).unwrap(),
            vec![Ok(true), Ok(false), Ok(false), Ok(true), Ok(false)]
        );
        drop(rpc);
        assert_eq!(master.join().unwrap(), 2 * 200 + 5);
    }

    /// The awaited query asks and answers the same, on a single-threaded runtime like the
    /// daemon's control plane, and a master that is gone is an I/O error.
    #[cfg(feature = "daemon")]
    #[test]
    fn awaited_queries_answer_like_blocking_ones() {
        let (addr, master) = fake_master(4);
        let rpc = MasterRpc::new(&addr, Duration::from_secs(5));
        let keys: Vec<String> = (0..300)
            .map(|i| format!("key{i}{}", if i % 4 == 1 { "y" } else { "n" }))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for _ in 0..2 {
            let got = rt.block_on(rpc.batch_exists_async(&refs)).unwrap();
            assert_eq!(got, (0..300).map(|i| Ok(i % 4 == 1)).collect::<Vec<_>>());
        }
        drop(rpc);
        assert_eq!(master.join().unwrap(), 600);
        let gone = MasterRpc::new(&addr, Duration::from_millis(300));
        assert!(matches!(
            rt.block_on(gone.batch_exists_async(&refs[..3])),
            Err(RpcError::Io { .. })
        ));
    }

    /// A peer that answers with an RPC error (a master of another build) is a protocol error.
    #[test]
    fn rpc_errors_are_protocol_errors() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut head = [0u8; REQ_HEAD];
            s.read_exact(&mut head).unwrap();
            let len = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len];
            s.read_exact(&mut body).unwrap();
            let msg = b"function not registered";
            let mut reply = vec![MAGIC, 0, 4, 0];
            reply.extend_from_slice(&head[4..8]);
            reply.extend_from_slice(&(msg.len() as u32).to_le_bytes());
            reply.extend_from_slice(&0u32.to_le_bytes());
            reply.extend_from_slice(msg);
            s.write_all(&reply).unwrap();
        });
        let rpc = MasterRpc::new(&addr, Duration::from_secs(2));
        let e = rpc.batch_exists(&["a", "b"]).unwrap_err();
        assert!(
            matches!(&e, RpcError::Protocol { why, .. } if why.contains("RPC error 4")),
            "{e}"
        );
        server.join().unwrap();
    }
}
