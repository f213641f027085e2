//! One admin connection: the peer-credential check, hyper serving one request, and the
//! whole-request deadline that hyper's per-head timeout alone does not give.
//!
//! A client has `read_timeout` from being accepted to having sent its whole request
//! (head and body); a client that trickles a byte at a time is cut off at that deadline
//! however often it sends. Once the request is in, the answer (computed on the blocking
//! pool) must be written within a fresh `read_timeout`. An event stream has no deadline
//! while it runs (it ends itself when the client stops reading or hangs up, checked
//! every [`PEER_CHECK`]), and gets one again when it ends.

use std::convert::Infallible;
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, TRANSFER_ENCODING};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::api::{ApiError, Reply};
use super::deadline::Deadline;
use super::events::{EventBody, Stream};
use super::readers::{ReaderGuard, Readers};
use super::request::Request;
use super::state::AdminState;
use super::{routes, security};

/// While an event stream runs, how often the connection looks whether the client hung up
/// (a stream with no new events writes nothing that would fail).
pub(crate) const PEER_CHECK: Duration = Duration::from_secs(1);
/// After answering, the most a connection is drained (so the client reads our answer
/// rather than a reset) and for how long.
const DRAIN_BYTES: usize = 16 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(2);

type AdminBody = Either<Full<Bytes>, EventBody>;

/// What one connection's task holds.
pub(crate) struct Conn {
    pub state: Arc<AdminState>,
    pub http: http1::Builder,
    pub cancel: CancellationToken,
    pub tracker: TaskTracker,
    /// Connections still sending their request (see `readers`).
    pub readers: Arc<Readers>,
}

impl Conn {
    /// Checks the peer, then serves its one request within the deadlines.
    pub async fn serve(self, mut stream: UnixStream) {
        let cfg = &self.state.cfg;
        let refusal = match security::peer_cred(&stream) {
            Ok(peer) if security::allowed(cfg, &peer) => None,
            Ok(peer) => {
                tracing::warn!(
                    uid = peer.uid,
                    gid = peer.gid,
                    pid = peer.pid,
                    "admin: refused a peer not on the allowlist"
                );
                Some(format!("uid {} is not allowed on this socket", peer.uid))
            }
            Err(e) => {
                tracing::warn!(error = %e, "admin: no peer credentials; refused");
                Some("peer credentials unavailable".to_owned())
            }
        };
        if let Some(message) = refusal {
            // Answered before a byte of the request is read; what it sent is drained unseen.
            let answer = raw_error(403, "peer_not_allowed", &message);
            if let Ok(Ok(())) = tokio::time::timeout(cfg.read_timeout, stream.write_all(&answer)).await {
                drain(stream).await;
            }
            return;
        }
        let fd = stream.as_raw_fd();
        let deadline = Arc::new(Deadline::new(cfg.read_timeout));
        // Displaceable by a newcomer at the limit until the request is in.
        let (reading, displaced) = self.readers.enter();
        let reading = Arc::new(reading);
        let (state, tracker, cancel, d) = (
            self.state.clone(),
            self.tracker.clone(),
            self.cancel.clone(),
            deadline.clone(),
        );
        let r = reading.clone();
        let service = service_fn(move |req| {
            let h = Handler {
                state: state.clone(),
                tracker: tracker.clone(),
                cancel: cancel.clone(),
                deadline: d.clone(),
                reading: r.clone(),
            };
            // Boxed: hyper needs an `Unpin` future to hand the socket back afterwards.
            Box::pin(async move { Ok::<_, Infallible>(h.respond(req).await) })
        });
        let mut conn = self.http.serve_connection(TokioIo::new(stream), service);
        let mut shutting_down = false;
        let served = loop {
            let wake = deadline.at().unwrap_or_else(|| Instant::now() + PEER_CHECK);
            tokio::select! {
                r = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)) => break r,
                _ = displaced.cancelled() => {
                    tracing::info!("admin: a connection still sending its request was displaced by a newer one");
                    return;
                }
                _ = self.cancel.cancelled(), if !shutting_down => {
                    // Ends an idle connection now and an answering one after its answer.
                    shutting_down = true;
                    std::pin::Pin::new(&mut conn).graceful_shutdown();
                }
                _ = tokio::time::sleep_until(wake.into()) => {
                    match deadline.at() {
                        Some(at) if Instant::now() >= at => {
                            tracing::info!("admin: a connection passed its deadline; cut off");
                            return;
                        }
                        None if peer_closed(fd) => return,
                        _ => {}
                    }
                }
            }
        };
        match served {
            Err(e) if e.is_timeout() => tracing::info!("admin: a request head was not sent in time; cut off"),
            r => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "admin: connection ended with an error");
                }
                drain(conn.into_parts().io.into_inner()).await;
            }
        }
    }
}

/// One request's context.
struct Handler {
    state: Arc<AdminState>,
    tracker: TaskTracker,
    cancel: CancellationToken,
    deadline: Arc<Deadline>,
    /// The connection's place among those still sending a request.
    reading: Arc<ReaderGuard>,
}

impl Handler {
    async fn respond(self, req: hyper::Request<Incoming>) -> Response<AdminBody> {
        let cfg = &self.state.cfg;
        if let Err(e) = check_head(&req, cfg.max_header, cfg.max_body) {
            tracing::info!(status = e.status(), "admin: request refused");
            return error(e);
        }
        let (parts, body) = req.into_parts();
        let body = match Limited::new(body, cfg.max_body).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) if e.is::<LengthLimitError>() => {
                let message = format!("a body over the limit of {}", cfg.max_body);
                return error(ApiError::new(413, "body_too_large", message));
            }
            Err(e) => {
                tracing::debug!(error = %e, "admin: request body not read");
                return error(ApiError::new(400, "bad_request", "the request body could not be read"));
            }
        };
        self.deadline.extend(cfg.read_timeout);
        self.reading.done();
        let req = Request::new(parts.method.as_str(), parts.uri.path(), parts.uri.query(), body);
        tracing::debug!(method = %req.method, path = %req.path, "admin request");
        let st = self.state.clone();
        let reply = match tokio::task::spawn_blocking(move || {
            let _blocking = crate::pool::io_guard::allow_blocking();
            routes::handle(&st, &req)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "admin: a handler failed");
                ApiError::new(500, "internal", "the handler failed").reply()
            }
        };
        match reply {
            Reply::Events { source, from, limit } => {
                self.deadline.lift();
                let body = Stream {
                    state: self.state.clone(),
                    source,
                    from,
                    limit,
                    cancel: self.cancel.clone(),
                    deadline: self.deadline.clone(),
                }
                .start(&self.tracker);
                let mut r = Response::new(Either::Right(body));
                r.headers_mut().insert(
                    CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("application/x-ndjson"),
                );
                r
            }
            Reply::Json(status, v) => answer(status, "application/json", json_body(&v)),
            Reply::Text(status, content_type, text) => answer(status, content_type, Bytes::from(text)),
        }
    }
}

/// Refuses what can be refused from the head alone: a head over `max_header` (431), a
/// chunked body (411: bodies need a length), a declared body over `max_body` (413,
/// before any of it is read).
fn check_head(req: &hyper::Request<Incoming>, max_header: usize, max_body: usize) -> Result<(), ApiError> {
    // The request line and header lines as they were sent, give or take spacing.
    let head = req.method().as_str().len()
        + req.uri().to_string().len()
        + 12
        + req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len() + 4)
            .sum::<usize>()
        + 2;
    if head > max_header {
        return Err(ApiError::new(
            431,
            "header_too_large",
            format!("request head over {max_header} bytes"),
        ));
    }
    if req
        .headers()
        .get(TRANSFER_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"))
    {
        return Err(ApiError::new(411, "length_required", "send bodies with Content-Length"));
    }
    let length = req
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match length {
        Some(n) if n > max_body as u64 => Err(ApiError::new(
            413,
            "body_too_large",
            format!("a body of {n} bytes is over the limit of {max_body}"),
        )),
        _ => Ok(()),
    }
}

/// A whole answer with its length.
fn answer(status: u16, content_type: &'static str, body: Bytes) -> Response<AdminBody> {
    let mut r = Response::new(Either::Left(Full::new(body)));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut()
        .insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    r
}

/// The JSON error answer `{"code": …, "message": …}`.
fn error(e: ApiError) -> Response<AdminBody> {
    let (status, v) = e.into_json();
    answer(status, "application/json", json_body(&v))
}

fn json_body(v: &Value) -> Bytes {
    let mut b = serde_json::to_vec(v).unwrap_or_default();
    b.push(b'\n');
    Bytes::from(b)
}

/// A complete HTTP/1.1 error answer, for connections refused before hyper sees them.
fn raw_error(status: u16, code: &str, message: &str) -> Vec<u8> {
    let body = json_body(&json!({ "code": code, "message": message }));
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// How long writing a refusal may take.
const REFUSAL_WRITE: Duration = Duration::from_secs(1);

/// Answers `503 too_many_connections` and drains the connection, so the client reads
/// the answer rather than failing to send its request to a closed socket.
pub(crate) async fn refuse_busy(mut stream: UnixStream) {
    tracing::info!("admin: connection refused, at the connection limit");
    let answer = raw_error(503, "too_many_connections", "the admin socket is at its limit");
    if let Ok(Ok(())) = tokio::time::timeout(REFUSAL_WRITE, stream.write_all(&answer)).await {
        drain(stream).await;
    }
}

/// Half-closes and reads what the client still sends (bounded in bytes and time), so it
/// sees our answer instead of a connection reset. What is read is discarded unseen.
async fn drain(mut stream: UnixStream) {
    let _ = stream.shutdown().await;
    let mut buf = [0u8; 8192];
    let mut total = 0;
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        while total < DRAIN_BYTES {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
    })
    .await;
}

/// Whether the client hung up (its end reads as closed), without blocking.
fn peer_closed(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd; zero timeout. The caller holds the connection that owns
    // `fd`, so it is open and still this connection's descriptor.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}
