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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::daemon::{DaemonConfig, ManagedTiers};
    use crate::protocol::{Request, read_frame};

    fn ask(s: &mut UnixStream, req: &Request) -> Option<Response> {
        let mut out = Vec::new();
        req.encode(1, &mut out);
        frame::write_all(&mut &*s, &out).ok()?;
        let mut body = Vec::new();
        let h = read_frame(s, 1 << 20, &mut body).ok()?;
        Response::decode(h.kind, &body).ok()
    }

    #[test]
    fn connections_beyond_the_limit_are_refused_and_shutdown_is_prompt() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = DaemonConfig {
            socket: dir.path().join("s.sock"),
            arena_path: dir.path().join("arena"),
            arena_bytes: 1 << 20,
            pool_bytes: 0,
            max_connections: 2,
            lock_arena: false,
            prefault: false,
            ..DaemonConfig::default()
        };
        let backend = Arc::new(ManagedTiers::open(cfg.tiers(), SystemClock::new()).unwrap());
        let shared = Arc::new(Shared::new(backend, cfg.limits()));
        let listener = UnixListener::bind(&cfg.socket).unwrap();
        let shutdown = Shutdown::new();
        let (sd, sh) = (shutdown.clone(), shared.clone());
        let server = std::thread::spawn(move || run(listener, sd, sh, Duration::from_millis(20)));
        let ping = Request::Ping { payload: vec![1] };
        let mut a = UnixStream::connect(&cfg.socket).unwrap();
        let mut b = UnixStream::connect(&cfg.socket).unwrap();
        assert_eq!(ask(&mut a, &ping), Some(Response::Pong { payload: vec![1] }));
        assert_eq!(ask(&mut b, &ping), Some(Response::Pong { payload: vec![1] }));
        assert_eq!(shared.connections(), 2);
        let mut c = UnixStream::connect(&cfg.socket).unwrap();
        match ask(&mut c, &ping) {
            Some(Response::Error(e)) => assert_eq!(e.code, ErrorCode::TooManyConnections),
            None => {} // refused and closed before the request was read
            other => panic!("third connection served: {other:?}"),
        }
        drop(b);
        let t = Instant::now();
        while shared.connections() > 1 {
            assert!(
                t.elapsed() < Duration::from_secs(2),
                "a closed connection is not released"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut d = UnixStream::connect(&cfg.socket).unwrap();
        assert_eq!(ask(&mut d, &ping), Some(Response::Pong { payload: vec![1] }));
        let t = Instant::now();
        shutdown.fire();
        server.join().unwrap().unwrap();
        assert!(t.elapsed() < Duration::from_secs(1), "shutdown took {:?}", t.elapsed());
        assert_eq!(shared.connections(), 0);
        drop(a);
    }
}
