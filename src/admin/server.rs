//! The admin server's accept loop and per-connection handling.
//!
//! One thread accepts (polling the listener with a timeout so shutdown is noticed), one
//! thread serves each connection, at most `max_connections` at once. Peer credentials
//! are checked before the request is read; a refused peer is logged by uid, gid and pid
//! only, never with what it sent.

use std::io::Read;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::http::{self, HttpError};
use super::{AdminConfig, AdminError, EngineView, routes, security};
use crate::manager::Manager;
use tokio_util::sync::CancellationToken;

/// How long the accept loop waits before looking at the shutdown signal again.
const ACCEPT_POLL_MS: i32 = 100;
/// After answering, the most a connection is drained (so the client reads our answer
/// rather than a reset) and for how long.
const DRAIN_BYTES: usize = 16 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// What every connection handler shares.
pub(crate) struct Ctx {
    pub cfg: AdminConfig,
    pub manager: Manager,
    pub engines: Arc<dyn EngineView>,
    pub started: Instant,
    pub shutdown: CancellationToken,
    pub stop: AtomicBool,
    pub active: AtomicUsize,
}

impl Ctx {
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.shutdown.is_cancelled()
    }
}

/// A running admin server.
pub struct AdminHandle {
    ctx: Arc<Ctx>,
    thread: Option<JoinHandle<()>>,
}

impl AdminHandle {
    /// The socket path clients connect to.
    pub fn socket(&self) -> PathBuf {
        self.ctx.cfg.socket.clone()
    }

    /// Stops accepting, waits for the accept loop to end and removes the socket file.
    /// Open event streams end within their poll interval.
    pub fn stop(mut self) {
        self.ctx.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for AdminHandle {
    fn drop(&mut self) {
        self.ctx.stop.store(true, Ordering::Relaxed);
    }
}

/// Binds the admin socket and serves it on a background thread until `shutdown` is
/// triggered or the handle is stopped.
pub fn spawn(
    cfg: AdminConfig,
    manager: Manager,
    engines: Arc<dyn EngineView>,
    shutdown: CancellationToken,
) -> Result<AdminHandle, AdminError> {
    cfg.validate()?;
    let listener = security::bind(&cfg)?;
    let ctx = Arc::new(Ctx {
        cfg,
        manager,
        engines,
        started: Instant::now(),
        shutdown,
        stop: AtomicBool::new(false),
        active: AtomicUsize::new(0),
    });
    let c = ctx.clone();
    let thread = std::thread::Builder::new()
        .name("kvtier-admin".into())
        .spawn(move || accept_loop(listener, c))?;
    tracing::info!(socket = %ctx.cfg.socket.display(), "admin socket listening");
    Ok(AdminHandle {
        ctx,
        thread: Some(thread),
    })
}

fn accept_loop(listener: UnixListener, ctx: Arc<Ctx>) {
    while !ctx.stopping() {
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the listener, which outlives the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, ACCEPT_POLL_MS) };
        if ready <= 0 {
            continue;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "admin accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let _ = stream.set_read_timeout(Some(ctx.cfg.read_timeout));
        let _ = stream.set_write_timeout(Some(ctx.cfg.read_timeout));
        if ctx.active.fetch_add(1, Ordering::AcqRel) >= ctx.cfg.max_connections {
            ctx.active.fetch_sub(1, Ordering::AcqRel);
            let mut s = stream;
            let _ = http::write_error(&mut s, 503, "too_many_connections", "the admin socket is at its limit");
            continue;
        }
        let c = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("kvtier-admin-conn".into())
            .spawn(move || {
                serve(&c, stream);
                c.active.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            ctx.active.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(error = %e, "admin: cannot start a connection thread");
        }
    }
    let _ = std::fs::remove_file(&ctx.cfg.socket);
    tracing::info!(socket = %ctx.cfg.socket.display(), "admin socket closed");
}

fn serve(ctx: &Ctx, mut stream: UnixStream) {
    let peer = match security::peer_cred(&stream) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "admin: no peer credentials; refused");
            let _ = http::write_error(&mut stream, 403, "peer_not_allowed", "peer credentials unavailable");
            return;
        }
    };
    if !security::allowed(&ctx.cfg, &peer) {
        tracing::warn!(
            uid = peer.uid,
            gid = peer.gid,
            pid = peer.pid,
            "admin: refused a peer not on the allowlist"
        );
        let _ = http::write_error(
            &mut stream,
            403,
            "peer_not_allowed",
            &format!("uid {} is not allowed on this socket", peer.uid),
        );
        drain(stream);
        return;
    }
    match http::read_request(&mut stream, ctx.cfg.max_header, ctx.cfg.max_body) {
        Ok(req) => {
            tracing::debug!(method = %req.method, path = %req.path, uid = peer.uid, "admin request");
            if let Err(e) = routes::handle(ctx, &req, &mut stream) {
                tracing::debug!(error = %e, "admin: connection ended while answering");
            }
        }
        Err(HttpError::Reply { status, code, message }) => {
            tracing::info!(status, code, uid = peer.uid, "admin: request refused");
            let _ = http::write_error(&mut stream, status, code, &message);
        }
        Err(HttpError::Io(e)) => {
            tracing::debug!(error = %e, "admin: request not read");
            return;
        }
    }
    drain(stream);
}

/// Half-closes and reads what the client still sends (bounded in bytes and time), so it
/// sees our answer instead of a connection reset. What is read is discarded unseen.
fn drain(mut stream: UnixStream) {
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let deadline = Instant::now() + DRAIN_TIME;
    let mut buf = [0u8; 8192];
    let mut total = 0;
    while total < DRAIN_BYTES && Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
}
