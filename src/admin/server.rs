//! The admin server's accept loop, on tokio: [`serve`] takes a bound listener, its state
//! and a cancellation token; [`spawn`] binds the socket, checks it and runs [`serve`] as a
//! task on the current runtime.
//!
//! Each accepted connection is one task (`conn`), at most `max_connections` at
//! once (a semaphore). A newcomer that finds them all taken first displaces the oldest
//! connection that is still sending its request after [`DISPLACE_AFTER`] (`readers`), and
//! takes its slot: slow clients cannot lock out the others. When none can be displaced,
//! as many more at once get `503 too_many_connections`, and any beyond those are closed
//! unanswered.
//! On cancellation the loop stops accepting, connections finish what they answer (each
//! has a deadline) and event streams end; [`serve`] waits for them, bounded, and returns.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper_util::rt::TokioTimer;
use tokio::net::UnixListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::config::{AdminConfig, AdminError, EngineView};
use super::readers::{DISPLACE_AFTER, Readers};
use super::state::AdminState;
use super::{conn, security};
use crate::manager::Manager;

/// How long the accept loop pauses after a failed accept (e.g. out of descriptors), so
/// it does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// hyper's read buffer may not be smaller than this (its `max_buf_size` panics below it).
const HYPER_MIN_BUF: usize = 8192;
/// How long a newcomer waits for the slot of the connection it displaced to be freed.
const SLOT_WAIT: Duration = Duration::from_secs(1);

/// The HTTP/1 settings every connection is served with. hyper cuts a head that
/// takes longer than `read_timeout` and answers a bare 431 to one over the hard cap
/// (twice `max_header`, at least hyper's minimum buffer); heads between
/// `max_header` and that cap get the typed JSON 431 from `conn`.
fn http(state: &AdminState) -> http1::Builder {
    let cap = (state.cfg.max_header * 2).max(HYPER_MIN_BUF);
    let mut b = http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(state.cfg.read_timeout)
        .keep_alive(false)
        .half_close(true)
        .max_header_size(cap)
        .max_buf_size(cap);
    b
}

/// Serves admin requests on `listener` until `cancel` is cancelled, then waits (at most
/// `read_timeout`) for open connections to finish and returns. The listener must be
/// bound already ([`spawn`] does it, with the socket's security checks).
pub async fn serve(listener: UnixListener, state: AdminState, cancel: CancellationToken) -> Result<(), AdminError> {
    let http = http(&state);
    let grace = state.cfg.read_timeout;
    let state = Arc::new(state);
    let slots = Arc::new(Semaphore::new(state.cfg.max_connections));
    let refusals = Arc::new(Semaphore::new(state.cfg.max_connections));
    let readers = Arc::new(Readers::default());
    let tracker = TaskTracker::new();
    loop {
        let stream = tokio::select! {
            _ = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let c = conn::Conn {
            state: state.clone(),
            http: http.clone(),
            cancel: cancel.clone(),
            tracker: tracker.clone(),
            readers: readers.clone(),
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            // Waiting for a slot and refusing are done in a task of their own (the
            // client must be drained to see a refusal), capped: past that, a connection
            // is closed unanswered.
            let Ok(p) = refusals.clone().try_acquire_owned() else {
                tracing::warn!("admin: connection closed unanswered, far over the limit");
                continue;
            };
            if readers.displace_oldest(DISPLACE_AFTER) {
                tracing::info!("admin: at the limit; a slow connection gives its slot to a newer one");
                let slots = slots.clone();
                tracker.spawn(async move {
                    match tokio::time::timeout(SLOT_WAIT, slots.acquire_owned()).await {
                        Ok(Ok(permit)) => {
                            drop(p);
                            c.serve(stream).await;
                            drop(permit);
                        }
                        _ => {
                            conn::refuse_busy(stream).await;
                            drop(p);
                        }
                    }
                });
            } else {
                tracker.spawn(async move {
                    conn::refuse_busy(stream).await;
                    drop(p);
                });
            }
            continue;
        };
        tracker.spawn(async move {
            c.serve(stream).await;
            drop(permit);
        });
    }
    // Refuse new clients at once (connection refused) while the open ones finish.
    drop(listener);
    tracker.close();
    if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
        tracing::warn!(open = tracker.len(), "admin: connections still open at shutdown");
    }
    Ok(())
}

/// A running admin server.
pub struct AdminHandle {
    socket: PathBuf,
    cancel: CancellationToken,
    task: Option<JoinHandle<Result<(), AdminError>>>,
}

impl AdminHandle {
    /// The socket path clients connect to.
    pub fn socket(&self) -> PathBuf {
        self.socket.clone()
    }

    /// Asks the server to stop, without waiting: it stops accepting, ends event streams
    /// and removes its socket file once open connections are done.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Stops the server and waits until it has ended and removed its socket file.
    pub async fn stop(mut self) -> Result<(), AdminError> {
        self.cancel.cancel();
        match self.task.take() {
            Some(t) => t
                .await
                .map_err(|e| AdminError::Io(std::io::Error::other(e.to_string())))?,
            None => Ok(()),
        }
    }
}

impl Drop for AdminHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Binds the admin socket (mode, directory and stale-socket checks: [`security::bind`])
/// and serves it in a task on the current tokio runtime until `cancel` (or the handle's
/// own [`AdminHandle::stop`]) ends it; the socket file is removed then. Must be called
/// from within a runtime.
pub fn spawn(
    cfg: AdminConfig,
    manager: Manager,
    engines: Arc<dyn EngineView>,
    cancel: CancellationToken,
) -> Result<AdminHandle, AdminError> {
    let state = AdminState::new(cfg, manager, engines)?;
    let std_listener = security::bind(&state.cfg)?;
    let socket = state.cfg.socket.clone();
    let placed = std_listener
        .set_nonblocking(true)
        .and_then(|_| UnixListener::from_std(std_listener));
    let listener = match placed {
        Ok(l) => l,
        Err(e) => {
            let _ = std::fs::remove_file(&socket);
            return Err(AdminError::Socket(socket, format!("registering with tokio: {e}")));
        }
    };
    // A child token: stopping this server does not cancel the caller's other services.
    let cancel = cancel.child_token();
    let (c, path) = (cancel.clone(), socket.clone());
    let task = tokio::spawn(async move {
        let r = serve(listener, state, c).await;
        let _ = std::fs::remove_file(&path);
        tracing::info!(socket = %path.display(), "admin socket closed");
        r
    });
    tracing::info!(socket = %socket.display(), "admin socket listening");
    Ok(AdminHandle {
        socket,
        cancel,
        task: Some(task),
    })
}
