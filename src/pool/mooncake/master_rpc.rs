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
//! tells the pool to use the helper instead for a while: the client backs off (1 s,
//! doubling to 60 s while the master keeps answering so) and tries the master again, so one
//! garbled reply does not switch modes for the daemon's life.
//!
//! Every new connection first asks the master's version (`ServiceReady`, as the wheel's
//! client does, see [`version`]); a master of a version this client was not written for is
//! refused with [`RpcError::Version`], which names the version, and the pool asks the
//! helper instead, with the same back-off.
//!
//! Every query has one deadline, the op timeout, for the whole call: connecting, writing
//! and reading every byte of every reply. A master that trickles its reply a byte at a
//! time holds a caller no longer than one that does not answer.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

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
/// The first back-off after a reply this client does not speak; it doubles with each
/// such reply in a row, up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// Why a query got no answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum RpcError {
    /// The master could not be reached or hung up: the store is down for now.
    #[error("Mooncake master at {addr}: {source}")]
    Io { addr: String, source: io::Error },
    /// The master answered in a form this client does not speak.
    #[error("Mooncake master at {addr} does not speak this BatchExistKey: {why}")]
    Protocol { addr: String, why: String },
    /// The master's store version is not one this client speaks ([`version::KNOWN_VERSIONS`]).
    #[error(
        "Mooncake master at {addr} is version {version}; this client speaks only {known:?}: existence queries go through the helper",
        known = version::KNOWN_VERSIONS
    )]
    Version { addr: String, version: String },
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
    /// Until when queries go to the helper: the master answered in a form this client
    /// does not speak (see [`MasterRpc::refuse`]).
    refused_until: Mutex<Option<Instant>>,
    /// Such answers in a row (the back-off doubles with each); a good answer resets it.
    refusals: AtomicU32,
    /// The first back-off ([`BACKOFF_MIN`]; shorter in tests).
    backoff: Duration,
    /// The version the master last answered `ServiceReady` with, known or not.
    version: Mutex<Option<String>>,
}

impl MasterRpc {
    /// `addr` is the master's `host:port`; `timeout` bounds one whole query (connect,
    /// write, every read). Nothing connects until the first query.
    pub(super) fn new(addr: &str, timeout: Duration) -> Self {
        Self {
            addr: addr.to_owned(),
            timeout,
            seq: AtomicU32::new(1),
            idle: Mutex::new(Vec::new()),
            #[cfg(feature = "daemon")]
            idle_async: Mutex::new(Vec::new()),
            refused_until: Mutex::new(None),
            refusals: AtomicU32::new(0),
            backoff: BACKOFF_MIN,
            version: Mutex::new(None),
        }
    }

    /// The version the master last answered with (`None` before the first connection).
    pub(super) fn master_version(&self) -> Option<String> {
        self.version.lock().clone()
    }

    /// Whether queries go to the helper for now: the master's last reply was in a form this
    /// client does not speak, and its back-off has not passed (see [`MasterRpc::refuse`]).
    pub(super) fn refused(&self) -> bool {
        let mut until = self.refused_until.lock();
        match *until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                // Past the back-off: the next query tries the master again.
                *until = None;
                false
            }
            None => false,
        }
    }

    /// Sends queries to the helper for a while after `e`, a [`RpcError::Protocol`]: the
    /// back-off starts at 1 s and doubles with each such reply in a row, up to 60 s.
    pub(super) fn refuse(&self, e: &RpcError) {
        let n = self.refusals.fetch_add(1, Ordering::Relaxed).min(16);
        let wait = self.backoff.saturating_mul(1 << n).min(BACKOFF_MAX);
        *self.refused_until.lock() = Some(Instant::now() + wait);
        if matches!(e, RpcError::Version { .. }) {
            tracing::error!(error = %e, backoff = ?wait, "refusing the Mooncake master's version");
        } else {
            tracing::warn!(error = %e, backoff = ?wait, "existence queries go through the helper until the back-off passes");
        }
        self.reset();
    }

    /// A reply this client spoke: the back-off starts over.
    fn answered(&self) {
        if self.refusals.load(Ordering::Relaxed) != 0 {
            self.refusals.store(0, Ordering::Relaxed);
        }
    }

    /// One answer per key, in order: `Ok(true)` complete in the store, `Ok(false)` absent,
    /// `Err(code)` the master's negative `ErrorCode` for that key.
    ///
    /// The master answers one request on one of its threads, at about a microsecond a key;
    /// a batch goes out as up to [`MAX_REQUESTS`] requests of at least [`KEYS_PER_REQUEST`]
    /// keys on as many connections, all sent before any answer is read, so that many of its
    /// threads answer at once.
    pub(super) fn batch_exists(&self, keys: &[&str]) -> Result<Vec<Result<bool, i64>>, RpcError> {
        let deadline = Instant::now() + self.timeout;
        let mut calls = Vec::with_capacity(MAX_REQUESTS);
        for part in split(keys) {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            let frame = encode_request(seq, part)?;
            let pooled = self.idle.lock().pop();
            let (conn, reused) = match pooled {
                Some(c) => (c, true),
                None => (self.connect(deadline)?, false),
            };
            let mut call = Call {
                conn,
                reused,
                frame,
                seq,
                n: part.len(),
            };
            if let Err(e) = self.send(&mut call.conn, &call.frame, deadline) {
                if !call.reused {
                    return Err(e);
                }
                call.conn = self.connect(deadline)?;
                call.reused = false;
                self.send(&mut call.conn, &call.frame, deadline)?;
            }
            calls.push(call);
        }
        let mut out = Vec::with_capacity(keys.len());
        for mut call in calls {
            let body = match self.receive(&mut call, deadline) {
                // A pooled connection the master closed meanwhile (it restarted): one fresh try.
                Err(RpcError::Io { .. }) if call.reused && Instant::now() < deadline => {
                    call.conn = self.connect(deadline)?;
                    self.send(&mut call.conn, &call.frame, deadline)?;
                    self.receive(&mut call, deadline)
                }
                r => r,
            }?;
            out.extend(decode_response(&body, call.n).map_err(|why| self.protocol(why))?);
            self.answered();
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

    /// A new connection's `ServiceReady` reply: the master's version, which must be known.
    fn verify(&self, body: Result<Vec<u8>, String>) -> Result<(), RpcError> {
        let v = match version::decode_reply(&body.map_err(|why| self.protocol(why))?) {
            Ok(Ok(v)) => v,
            Ok(Err(code)) => return Err(self.protocol(format!("ServiceReady answered ErrorCode {code}"))),
            Err(why) => return Err(self.protocol(why)),
        };
        let mut known = self.version.lock();
        if known.as_deref() != Some(v.as_str()) {
            tracing::info!(master = %self.addr, version = %v, "Mooncake master version");
            *known = Some(v.clone());
        }
        drop(known);
        version::check(&self.addr, &v)
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

    /// Reads `call`'s reply and returns its body, all of it by `deadline`.
    fn receive(&self, call: &mut Call<TcpStream>, deadline: Instant) -> Result<Vec<u8>, RpcError> {
        let mut head = [0u8; RESP_HEAD];
        self.read_by(&mut call.conn, &mut head, deadline)?;
        let mut body = vec![0u8; reply_len(&head, call.frame.len()).map_err(|why| self.protocol(why))?];
        self.read_by(&mut call.conn, &mut body, deadline)?;
        reply_body(&head, call.seq, body).map_err(|why| self.protocol(why))
    }

    /// The time left until `deadline`, or the timeout error once it has passed.
    fn left(&self, deadline: Instant) -> Result<Duration, RpcError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(self.io(io::Error::new(
                io::ErrorKind::TimedOut,
                "no whole answer within the op timeout",
            )));
        }
        Ok(left)
    }

    /// Fills `buf` by `deadline`: each read may wait only for what is left of the call's
    /// time, so a reply trickled a byte at a time ends at the deadline too.
    fn read_by(&self, conn: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), RpcError> {
        let mut at = 0;
        while at < buf.len() {
            conn.set_read_timeout(Some(self.left(deadline)?))
                .map_err(|e| self.io(e))?;
            match conn.read(&mut buf[at..]) {
                Ok(0) => return Err(self.io(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => at += n,
                // A read timeout (EAGAIN on Linux) or a signal: `left` says whether any
                // time remains.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(self.io(e)),
            }
        }
        Ok(())
    }

    /// Writes `frame` by `deadline`.
    fn send(&self, conn: &mut TcpStream, frame: &[u8], deadline: Instant) -> Result<(), RpcError> {
        conn.set_write_timeout(Some(self.left(deadline)?))
            .map_err(|e| self.io(e))?;
        conn.write_all(frame).map_err(|e| self.io(e))
    }

    fn connect(&self, deadline: Instant) -> Result<TcpStream, RpcError> {
        let addrs: Vec<SocketAddr> = self.addr.to_socket_addrs().map_err(|e| self.io(e))?.collect();
        let mut last = io::Error::new(io::ErrorKind::NotFound, "the address resolves to nothing");
        for a in addrs {
            match TcpStream::connect_timeout(&a, self.left(deadline)?) {
                Ok(mut s) => {
                    s.set_nodelay(true).map_err(|e| self.io(e))?;
                    let seq = self.seq.fetch_add(1, Ordering::Relaxed);
                    let frame = version::encode_request(seq);
                    self.send(&mut s, &frame, deadline)?;
                    let mut head = [0u8; RESP_HEAD];
                    self.read_by(&mut s, &mut head, deadline)?;
                    let mut body = vec![0u8; reply_len(&head, frame.len()).map_err(|why| self.protocol(why))?];
                    self.read_by(&mut s, &mut body, deadline)?;
                    self.verify(reply_body(&head, seq, body))?;
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
    /// [`MasterRpc::batch_exists`], awaited: the same requests, split the same way, and
    /// the same one deadline for the whole call. A call cut off mid-reply leaves no
    /// connection behind for the next (its streams are dropped with it).
    pub(super) async fn batch_exists_async(&self, keys: &[&str]) -> Result<Vec<Result<bool, i64>>, RpcError> {
        match tokio::time::timeout(self.timeout, self.batch_exists_awaited(keys)).await {
            Ok(r) => r,
            Err(_) => Err(self.io(io::Error::new(
                io::ErrorKind::TimedOut,
                "no whole answer within the op timeout",
            ))),
        }
    }

    async fn batch_exists_awaited(&self, keys: &[&str]) -> Result<Vec<Result<bool, i64>>, RpcError> {
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
            self.answered();
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
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = self.bounded(tokio::net::TcpStream::connect(self.addr.as_str())).await?;
        s.set_nodelay(true).map_err(|e| self.io(e))?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let frame = version::encode_request(seq);
        self.bounded(s.write_all(&frame)).await?;
        let mut head = [0u8; RESP_HEAD];
        self.bounded(s.read_exact(&mut head)).await?;
        let mut body = vec![0u8; reply_len(&head, frame.len()).map_err(|why| self.protocol(why))?];
        self.bounded(s.read_exact(&mut body)).await?;
        self.verify(reply_body(&head, seq, body))?;
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
mod tests;
pub mod version;
