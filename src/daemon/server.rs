//! The accept loop: `run(listener, shutdown)` serves until the token fires.
//!
//! A thread per connection, at most `max_connections` at once (one over the limit gets a
//! `too_many_connections` error and is closed). The loop also drives the backend's
//! periodic work. On shutdown it stops accepting, lets every handler notice within its
//! idle poll, and waits for them (bounded) so grants are released before it returns.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::protocol::{ErrorCode, Response, frame};

use super::connection::{self, Shared};
use super::shutdown::Shutdown;

/// How long shutdown waits for connection handlers to finish.
const DRAIN: Duration = Duration::from_secs(3);

/// Serves `listener` until `shutdown` fires. Returns once every handler has finished (or
/// the drain deadline passed).
pub fn run(listener: UnixListener, shutdown: Shutdown, shared: Arc<Shared>, tick: Duration) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let mut handlers: Vec<JoinHandle<()>> = Vec::new();
    let mut last_tick = Instant::now();
    while !shutdown.is_fired() {
        if wait_readable(&listener, 100) {
            loop {
                match listener.accept() {
                    Ok((stream, _)) => {
                        if let Some(h) = admit(stream, &shared, &shutdown) {
                            handlers.push(h);
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        break;
                    }
                }
            }
        }
        if last_tick.elapsed() >= tick {
            shared.backend.tick();
            last_tick = Instant::now();
            handlers.retain(|h| !h.is_finished());
        }
    }
    tracing::info!(
        connections = shared.connections(),
        "shutting down: draining connections"
    );
    let deadline = Instant::now() + DRAIN;
    while handlers.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    for h in handlers.into_iter().filter(|h| h.is_finished()) {
        let _ = h.join();
    }
    Ok(())
}

fn admit(stream: UnixStream, shared: &Arc<Shared>, shutdown: &Shutdown) -> Option<JoinHandle<()>> {
    if stream.set_nonblocking(false).is_err() {
        return None;
    }
    let n = shared.connections.fetch_add(1, Ordering::SeqCst);
    if n as usize >= shared.limits.max_connections {
        shared.connections.fetch_sub(1, Ordering::SeqCst);
        let mut out = Vec::new();
        Response::error(
            ErrorCode::TooManyConnections,
            "the daemon serves its maximum number of connections",
        )
        .encode(0, &mut out);
        let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
        let _ = frame::write_all(&mut &stream, &out);
        return None;
    }
    let (shared, shutdown) = (shared.clone(), shutdown.clone());
    let spawned = std::thread::Builder::new().name("kvtier-conn".into()).spawn(move || {
        connection::handle(stream, shared.clone(), shutdown);
        shared.connections.fetch_sub(1, Ordering::SeqCst);
    });
    match spawned {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!(error = %e, "cannot start a connection thread");
            None
        }
    }
}

/// Waits up to `ms` for the listener to have a pending connection.
fn wait_readable(listener: &UnixListener, ms: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut pfd, 1, ms) > 0 }
}
