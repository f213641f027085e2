//! The accept loop: `run(listener, shutdown)` serves until the token is cancelled.
//!
//! A tokio task per connection, at most `max_connections` at once (one over the limit
//! gets a `too_many_connections` error and is closed), and the [`upkeep`] task beside
//! them. On shutdown it stops accepting; every connection task sees the token at once,
//! tells its client `shutting_down`, releases its grants and ends; `run` waits for them
//! (bounded by [`DRAIN`]) before it returns.
//!
//! The runtime is a current-thread one ([`runtime`]): one thread runs the accept loop,
//! the connections and the timers, so a request never costs a wake-up of another thread
//! (the round trip stays close to a raw socket echo), while everything that can block
//! goes to the blocking pool (see `cmd::blocks`).
//!
//! [`upkeep`]: super::upkeep

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio_util::codec::Encoder;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::security::PeerPolicy;
use crate::protocol::{ErrorCode, FrameCodec, Outgoing, Response};

use super::connection::{self, Shared};
use super::upkeep;

/// How long shutdown waits for connection tasks to finish.
const DRAIN: Duration = Duration::from_secs(3);
/// Pause after a failed accept (e.g. out of descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Most threads of the blocking pool: commands that may block, and upkeep runs.
const BLOCKING_THREADS: usize = 64;

/// The runtime the daemon's control plane runs on (see the module doc for why one
/// thread), every thread at the caller's priority.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    runtime_with(0)
}

/// [`runtime`], whose blocking pool threads (`kvtier-blocking`: commands that may block,
/// pool I/O, upkeep runs) lower their CPU priority by `worker_nice` steps when they start
/// ([`crate::priority`]), so that the control thread (the caller of `block_on`, left as it
/// is) wins a busy core over them.
pub fn runtime_with(worker_nice: u8) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(BLOCKING_THREADS)
        .thread_name("kvtier-blocking")
        .on_thread_start(move || {
            if let Err(e) = crate::priority::lower_this_thread(worker_nice) {
                tracing::warn!(error = %e, worker_nice, "a blocking thread could not lower its priority");
            }
        })
        .build()
}

/// Serves `listener` until `shutdown` is cancelled, with upkeep every `tick` (and
/// whenever [`Shared::upkeep_waker`] is called). Returns once every connection task has
/// finished or the drain deadline passed.
pub async fn run(
    listener: UnixListener,
    shutdown: CancellationToken,
    shared: Arc<Shared>,
    tick: Duration,
) -> std::io::Result<()> {
    run_with(listener, shutdown, shared, tick, PeerPolicy::owner_and_root(&[], &[])).await
}

/// [`run`], serving only peers that `peers` allows (`SO_PEERCRED`, checked at accept,
/// before a byte is read): others get a `bad_request` error frame naming their uid and
/// are closed. The file mode of the socket is only the first fence; this is the second.
pub async fn run_with(
    listener: UnixListener,
    shutdown: CancellationToken,
    shared: Arc<Shared>,
    tick: Duration,
    peers: PeerPolicy,
) -> std::io::Result<()> {
    let tasks = TaskTracker::new();
    tasks.spawn(upkeep::run(shared.clone(), tick, shutdown.clone()));
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, _)) => match peers.check(&stream) {
                Ok(_) => admit(stream, &shared, &shutdown, &tasks),
                Err(why) => {
                    tracing::warn!(%why, "control: refused a peer not on the allowlist");
                    refuse(&stream, ErrorCode::BadRequest, &format!("peer not allowed: {why}"));
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
    drop(listener);
    tracing::info!(
        connections = shared.connections(),
        "shutting down: draining connections"
    );
    tasks.close();
    if tokio::time::timeout(DRAIN, tasks.wait()).await.is_err() {
        tracing::warn!(
            connections = shared.connections(),
            "connections still open after the drain deadline"
        );
    }
    Ok(())
}

/// [`run`] on a fresh [`runtime`], for callers on a plain thread (tests, benches).
pub fn run_blocking(
    listener: std::os::unix::net::UnixListener,
    shutdown: CancellationToken,
    shared: Arc<Shared>,
    tick: Duration,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    runtime()?.block_on(async move { run(UnixListener::from_std(listener)?, shutdown, shared, tick).await })
}

/// Counts a connection for as long as its task lives, however the task ends.
struct Admitted(Arc<Shared>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Answers a connection with one error frame and drops it (closing it).
fn refuse(stream: &UnixStream, code: ErrorCode, message: &str) {
    let refusal = Response::error(code, message);
    let mut out = bytes::BytesMut::new();
    if FrameCodec::new(0)
        .encode(Outgoing::Response(0, &refusal), &mut out)
        .is_ok()
    {
        // A fresh socket's send buffer takes a small frame whole; if it does not, the
        // refusal is the close itself. Never waits.
        let _ = stream.try_write(&out);
    }
}

fn admit(stream: UnixStream, shared: &Arc<Shared>, shutdown: &CancellationToken, tasks: &TaskTracker) {
    let n = shared.connections.fetch_add(1, Ordering::SeqCst);
    let admitted = Admitted(shared.clone());
    if n as usize >= shared.limits.max_connections {
        drop(admitted);
        refuse(
            &stream,
            ErrorCode::TooManyConnections,
            "the daemon serves its maximum number of connections",
        );
        return;
    }
    let (shared, shutdown) = (shared.clone(), shutdown.clone());
    tasks.spawn(async move {
        // Dropped when the task ends, or when the runtime drops a task it never finished.
        let _admitted = admitted;
        connection::handle(stream, shared, shutdown).await;
    });
}
