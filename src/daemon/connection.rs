//! One client connection, a tokio task: read frames, dispatch commands, write answers,
//! clean up.
//!
//! Frames are decoded by [`FrameCodec`] from the socket's read half. Responses to requests
//! that arrived together are written together (one write once no whole frame is left in
//! the read buffer), so a pipelining client pays one system call per batch. Short
//! commands run inline on the task; the few that can block (a ticket or load wait, a
//! store that makes room, a commit that checksums its pages, a prefetch staged from the
//! pool, registering a namespace) run on tokio's blocking pool, with a deadline. When the
//! peer goes away (EOF, a reset, or a frame error) or shutdown fires, every grant the
//! connection still holds is released at once: store slots go back to the arena, load
//! holds are dropped.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures_util::StreamExt;
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{Notify, oneshot};
use tokio_util::codec::{Encoder, FramedRead};
use tokio_util::sync::CancellationToken;

use crate::layout::{Layout, LayoutSpec};
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::protocol::{ErrorCode, FrameCodec, FrameError, Identity, Outgoing, Request, Response};

use super::backend::Backend;
use super::cmd;

/// Longest a write of answers may take before the peer is given up on.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// What a blocking command may take beyond the backend's own wait bound (`max_wait`)
/// before the handler stops waiting for it (and the command's task releases the
/// connection's grants itself when it ends).
const BLOCKING_SLACK: Duration = Duration::from_secs(5);
/// Answers buffered beyond this are written even while more requests are buffered.
const FLUSH_BYTES: usize = 32 << 10;
/// How long a connection that wrote a lookup's answer waits, idle, before it does the
/// directory work the lookup left ([`crate::manager::settle_lookups`]); a request that
/// comes sooner does it first. Written at once, that work (tens of microseconds: 64 pages
/// entered, their events published) ran while the engine that asked waited for the core
/// it shares with the daemon, and doubled the lookup as that engine saw it. Tokio's
/// timers tick in milliseconds: the work is done 1 to 2 ms after the answer.
const SETTLE_IDLE: Duration = Duration::from_millis(1);
/// How long a connection runs frames it already holds (read ahead of its answers) before
/// it lets the other connections on the control thread run: every inline command is
/// short, but a peer that pipelines thousands of them would otherwise hold the thread
/// for all of them at once (2,000 polls of a 4,096-page ticket held it for 3 s).
const TURN: Duration = Duration::from_millis(1);
/// Most loads and lookups on the blocking pool at once. A read from the pool may hold its
/// thread until the pool answers or its helper is replaced as hung (tens of seconds when
/// the master trickles); capped at half of that pool (`BLOCKING_THREADS`, 64), such
/// reads leave the rest to connects, stores and commits, which never wait behind them
/// for a thread.
pub(crate) const POOL_READS: usize = 32;
/// Most session phase changes, request ends and pool hints on the blocking pool at once
/// ([`cmd::pool_work`]): a demote may write to a pool that answers slowly, a resume may
/// wait for its staging. With [`POOL_READS`] this leaves at least 16 of the 64 blocking
/// threads to connects, stores and commits, and none of these waits behind a load.
pub(crate) const POOL_WORK: usize = 16;

/// Limits the server applies to every connection.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub max_frame_bytes: usize,
    /// Most ranks (connections) one instance may hold.
    pub max_ranks: usize,
    /// Longest the backend lets a load or ticket wait block (`max_wait_ms`); a blocking
    /// command's deadline is this plus a margin.
    pub max_wait: Duration,
    /// Longest a frame may take to arrive once its first byte has (`frame_body_timeout_ms`):
    /// pauses inside a frame are fine, a frame that never completes is not.
    pub frame_body_timeout: Duration,
    /// Longest a connection that has sent `Connect` may sit between requests
    /// (`idle_timeout_ms`); `None` never closes it.
    pub idle_timeout: Option<Duration>,
    /// Longest a connection may stay open without having sent `Connect`
    /// (`connect_timeout_ms`), counted from its last request.
    pub connect_timeout: Duration,
}

impl Limits {
    /// When a connection that last finished a request at `last` goes idle for good.
    fn idle_deadline(&self, connected: bool, last: Instant) -> Option<Instant> {
        if connected {
            self.idle_timeout.map(|d| last + d)
        } else {
            Some(last + self.connect_timeout)
        }
    }
}

/// What every rank of an instance must agree on.
#[derive(Debug)]
pub(crate) struct Instance {
    pub namespace: Namespace,
    pub spec: LayoutSpec,
    pub ranks: usize,
}

/// State shared by all connections.
pub struct Shared {
    pub backend: Arc<dyn Backend>,
    pub limits: Limits,
    pub(crate) instances: Mutex<HashMap<String, Instance>>,
    /// Connected ranks by connection id, with when they connected (admin `status`).
    pub(crate) ranks: Mutex<HashMap<u64, (crate::protocol::Identity, std::time::Instant)>>,
    pub(crate) connections: AtomicU64,
    next_conn: AtomicU64,
    /// Wakes the upkeep task ([`super::upkeep`]) before its periodic tick.
    pub(crate) upkeep: Arc<Notify>,
    /// Token ids and parents engines sent with stores, read by the KV event publisher.
    pub(crate) tokens: Arc<crate::publish::tokens::TokenTable>,
    /// Recent KvHint envelopes and their outcomes (client, admin and CLI deliveries).
    pub(crate) kv_hints: Arc<crate::router_hint::KvHintLog>,
    /// Places for loads and lookups on the blocking pool ([`POOL_READS`]).
    pool_reads: Arc<tokio::sync::Semaphore>,
    /// Places for session, request-end and pool-hint commands ([`POOL_WORK`]).
    pool_work: Arc<tokio::sync::Semaphore>,
}

impl Shared {
    pub fn new(backend: Arc<dyn Backend>, limits: Limits) -> Self {
        Self {
            backend,
            limits,
            instances: Mutex::new(HashMap::new()),
            ranks: Mutex::new(HashMap::new()),
            connections: AtomicU64::new(0),
            next_conn: AtomicU64::new(1),
            upkeep: Arc::new(Notify::new()),
            tokens: Arc::default(),
            kv_hints: Arc::default(),
            pool_reads: Arc::new(tokio::sync::Semaphore::new(POOL_READS)),
            pool_work: Arc::new(tokio::sync::Semaphore::new(POOL_WORK)),
        }
    }

    /// A waker for the manager (`Upkeep::set_waker`): called from any thread
    /// when eviction becomes due, it makes the upkeep task run now rather than at its next
    /// periodic tick. Wakes while a run is in progress coalesce into one more run.
    pub fn upkeep_waker(&self) -> Arc<dyn Fn() + Send + Sync> {
        let notify = self.upkeep.clone();
        Arc::new(move || notify.notify_one())
    }

    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }
}

/// The rank a connection speaks for, once connected.
pub(crate) struct Rank {
    pub identity: Identity,
    pub ns: NamespaceId,
    pub layout: Layout,
}

/// Per-connection state the commands read and update.
pub(crate) struct Conn {
    pub id: u64,
    pub rank: Option<Rank>,
    pub store_grants: HashSet<u64>,
    pub load_grants: HashSet<u64>,
    /// Pages the rank holds on device as far as kvtier knows (stored or loaded, not yet
    /// removed): when the connection dies, its device copies are gone with it.
    pub device: HashSet<PageHash>,
    /// Pages of each open load grant, in order.
    pub loads: HashMap<u64, Vec<PageHash>>,
}

/// Most device pages tracked per connection; beyond it the oldest knowledge is kept and
/// new pages are not tracked (the engine's own `removed` still clears them).
pub(crate) const MAX_DEVICE_PAGES: usize = 1 << 22;

/// Serves one connection until the peer leaves or `shutdown` fires, then releases what
/// it held.
pub async fn handle(stream: UnixStream, shared: Arc<Shared>, shutdown: CancellationToken) {
    let mut slot = Some(Box::new(Conn {
        id: shared.next_conn.fetch_add(1, Ordering::Relaxed),
        rank: None,
        store_grants: HashSet::new(),
        load_grants: HashSet::new(),
        device: HashSet::new(),
        loads: HashMap::new(),
    }));
    let id = slot.as_ref().map_or(0, |c| c.id);
    tracing::debug!(conn = id, "connection opened");
    if let Err(e) = serve(stream, &shared, &mut slot, &shutdown).await {
        tracing::debug!(conn = id, error = %e, "connection ended");
    }
    // What its lookups left, if the peer left before the connection went idle.
    shared.backend.settle_lookups();
    // `None` when a blocking command outlived its deadline: it owns the state and
    // releases it when it ends.
    if let Some(conn) = slot {
        release_off_thread(&shared, conn).await;
    }
}

/// [`release`] on the blocking pool, awaited: forgetting a rank's device pages walks each
/// of them (up to [`MAX_DEVICE_PAGES`]) under the directory's lock, which on the control
/// thread held every other connection up (839 ms for a million pages).
async fn release_off_thread(shared: &Arc<Shared>, mut conn: Box<Conn>) {
    let sh = shared.clone();
    let id = conn.id;
    let done = tokio::task::spawn_blocking(move || {
        let _blocking = crate::pool::io_guard::allow_blocking();
        release(&sh, &mut conn);
    })
    .await;
    if let Err(e) = done {
        tracing::warn!(conn = id, error = %e, "releasing a closed connection's state failed");
    }
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("writing answers took longer than {0:?}")]
    WriteTimeout(Duration),
    #[error("a blocking command took longer than {0:?}")]
    CommandTimeout(Duration),
    #[error("a blocking command failed: {0}")]
    CommandFailed(String),
    #[error("a frame was not complete {0:?} after its first byte")]
    BodyTimeout(Duration),
    #[error("idle for {0:?}")]
    Idle(Duration),
}

async fn serve(
    stream: UnixStream,
    shared: &Arc<Shared>,
    slot: &mut Option<Box<Conn>>,
    shutdown: &CancellationToken,
) -> Result<(), ConnError> {
    let (rd, mut wr) = stream.into_split();
    let mut frames = FramedRead::with_capacity(rd, FrameCodec::new(shared.limits.max_frame_bytes), 64 << 10);
    let mut enc = FrameCodec::new(shared.limits.max_frame_bytes);
    let mut out = BytesMut::with_capacity(64 << 10);
    // One waiter on the token for the connection's life, not one per request.
    let cancelled = shutdown.cancelled();
    tokio::pin!(cancelled);
    // One timer for the connection's life too, moved only when it fires (never per
    // request): it checks the frame-body deadline and the idle deadline.
    let limits = &shared.limits;
    let mut last = Instant::now();
    let check = tokio::time::sleep_until(next_check(limits, None, limits.idle_deadline(false, last), last).into());
    tokio::pin!(check);
    // Armed when a written answer was a lookup's on a daemon that discovers in a shared
    // pool: its directory work is done once the connection is idle ([`SETTLE_IDLE`]).
    let settle = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(settle);
    let (mut settle_armed, mut answered_lookup) = (false, false);
    // When this connection last left the thread to others (or waited for its peer).
    let mut turn = Instant::now();
    loop {
        if !frames.decoder().frame_ready(frames.read_buffer()) {
            // The next frame comes from the socket: a wait, or the socket's own budget.
            turn = Instant::now();
        }
        let next = tokio::select! {
            biased;
            _ = &mut cancelled => {
                let notice = Response::error(ErrorCode::ShuttingDown, "the daemon is shutting down");
                enc.encode(Outgoing::Response(0, &notice), &mut out)?;
                return flush(&mut wr, &mut out).await;
            }
            f = frames.next() => f,
            _ = &mut settle, if settle_armed => {
                settle_armed = false;
                shared.backend.settle_lookups();
                continue;
            }
            _ = &mut check => {
                let now = Instant::now();
                let connected = slot.as_ref().is_some_and(|c| c.rank.is_some());
                let idle = limits.idle_deadline(connected, last);
                match frames.decoder().partial_since() {
                    Some(t) if now >= t + limits.frame_body_timeout => {
                        // Not at a frame boundary: say why once, then close.
                        let e = ConnError::BodyTimeout(limits.frame_body_timeout);
                        enc.encode(Outgoing::Response(0, &Response::error(ErrorCode::BadFrame, e.to_string())), &mut out)?;
                        let _ = flush(&mut wr, &mut out).await;
                        return Err(e);
                    }
                    None if idle.is_some_and(|d| now >= d) => {
                        let limit = if connected { limits.idle_timeout.unwrap_or_default() } else { limits.connect_timeout };
                        tracing::info!(conn = slot.as_ref().map_or(0, |c| c.id), ?limit, connected, "closing an idle connection");
                        return Err(ConnError::Idle(limit));
                    }
                    partial => {
                        check.as_mut().reset(next_check(limits, partial, idle, now).into());
                        continue;
                    }
                }
            }
        };
        let frame = match next {
            None => return Ok(()),
            Some(Ok(f)) => f,
            Some(Err(e)) => {
                // The stream is no longer at a frame boundary: answer once, then close.
                let code = match &e {
                    FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
                    FrameError::Version(_) => ErrorCode::UnsupportedVersion,
                    _ => ErrorCode::BadFrame,
                };
                if !matches!(e, FrameError::Io(_) | FrameError::Truncated) {
                    enc.encode(Outgoing::Response(0, &Response::error(code, e.to_string())), &mut out)?;
                    let _ = flush(&mut wr, &mut out).await;
                }
                return Err(e.into());
            }
        };
        let (kind, request_id) = (frame.header.kind, frame.header.request_id);
        let read_at = Instant::now();
        super::memory::frame_read();
        // No request sees the directory behind a lookup answered before it.
        shared.backend.settle_lookups();
        let resp = match Request::decode(kind, &frame.body) {
            // A lookup that asks a shared pool awaits the pool's answer here when it can,
            // and leaves the connection task when the answer would block a thread.
            Ok(Request::Lookup { hashes }) if shared.backend.discovers_remotely() => {
                let awaited = match slot.as_deref() {
                    Some(conn) => cmd::lookup_awaited(shared, conn, &hashes, command_limit(shared)).await,
                    None => return Err(ConnError::CommandFailed("connection state lost".into())),
                };
                match awaited {
                    Some(resp) => resp,
                    None => offload(shared, slot, Request::Lookup { hashes }).await?,
                }
            }
            Ok(req) if cmd::blocks(&req, shared.backend.discovers_remotely()) => offload(shared, slot, req).await?,
            Ok(req) => match slot.as_mut() {
                Some(conn) => cmd::dispatch(shared, conn, req),
                None => return Err(ConnError::CommandFailed("connection state lost".into())),
            },
            // A body that does not decode leaves the stream intact: answer and go on.
            Err(e) if kind < 0x80 => Response::error(ErrorCode::BadFrame, e.to_string()),
            Err(_) => Response::error(ErrorCode::UnknownMessage, format!("kind {kind:#04x} is not a request")),
        };
        enc.encode(Outgoing::Response(request_id, &resp), &mut out)?;
        last = Instant::now();
        if matches!(resp, Response::Lookup(_)) {
            answered_lookup = true;
            shared.backend.lookup_served(last.saturating_duration_since(read_at));
        }
        if !frames.decoder().frame_ready(frames.read_buffer()) || out.len() >= FLUSH_BYTES {
            match flush(&mut wr, &mut out).await {
                Err(ConnError::Frame(FrameError::Io(e))) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                other => other?,
            }
            // Answers are out. The directory work their lookups left (pages found in the
            // pool entered) waits until the connection is idle, so the engine reading the
            // answer gets the core first; the next request, here or on any connection,
            // does it before it runs.
            if std::mem::take(&mut answered_lookup) && shared.backend.discovers_remotely() {
                settle.as_mut().reset((Instant::now() + SETTLE_IDLE).into());
                settle_armed = true;
            }
        } else if last >= turn + TURN {
            // More frames are buffered, and this connection has had its turn: send what is
            // answered, and let the others run before the rest.
            match flush(&mut wr, &mut out).await {
                Err(ConnError::Frame(FrameError::Io(e))) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                other => other?,
            }
            tokio::task::yield_now().await;
            turn = Instant::now();
        }
    }
}

/// When the connection's timer should look next: a frame in progress at its body
/// deadline; otherwise the idle deadline, but no later than one body timeout from now:
/// a frame that starts while the timer waits is then seen in progress before its own
/// deadline, and the timer moves to that deadline.
fn next_check(limits: &Limits, partial: Option<Instant>, idle: Option<Instant>, now: Instant) -> Instant {
    match partial {
        Some(t) => t + limits.frame_body_timeout,
        None => {
            let soon = now + limits.frame_body_timeout;
            idle.map_or(soon, |d| d.min(soon))
        }
    }
}

/// Writes the buffered answers, within [`WRITE_TIMEOUT`].
async fn flush(wr: &mut OwnedWriteHalf, out: &mut BytesMut) -> Result<(), ConnError> {
    match tokio::time::timeout(WRITE_TIMEOUT, wr.write_all(out)).await {
        Ok(Ok(())) => {
            out.clear();
            Ok(())
        }
        Ok(Err(e)) => Err(FrameError::from(e).into()),
        Err(_) => Err(ConnError::WriteTimeout(WRITE_TIMEOUT)),
    }
}

/// Runs a command that may block on tokio's blocking pool, so no runtime worker waits on
/// a ticket, a transfer or pool I/O. The connection's state travels with the command and
/// comes back with its answer. If the answer does not come within the deadline the
/// handler gives up on the connection; the command, when it ends, finds nobody to hand
/// the state back to and releases the connection's grants itself.
///
/// A load or lookup first waits, without a thread, for one of the [`POOL_READS`] places,
/// and a session phase change, request end or pool hint for one of the [`POOL_WORK`]
/// places: work that the pool holds up cannot take every blocking thread.
async fn offload(shared: &Arc<Shared>, slot: &mut Option<Box<Conn>>, req: Request) -> Result<Response, ConnError> {
    let limit = command_limit(shared);
    // One deadline for the wait for a place and the command.
    let deadline = tokio::time::Instant::now() + limit;
    let share = if matches!(req, Request::Load { .. } | Request::Lookup { .. }) {
        Some(&shared.pool_reads)
    } else if cmd::pool_work(&req) {
        Some(&shared.pool_work)
    } else {
        None
    };
    let place = if let Some(share) = share {
        match tokio::time::timeout_at(deadline, share.clone().acquire_owned()).await {
            Ok(Ok(p)) => Some(p),
            Ok(Err(_)) => return Err(ConnError::CommandFailed("the pool places are closed".into())),
            Err(_) => return Err(ConnError::CommandTimeout(limit)),
        }
    } else {
        None
    };
    let Some(mut conn) = slot.take() else {
        return Err(ConnError::CommandFailed("connection state lost".into()));
    };
    let (tx, mut rx) = oneshot::channel::<(Box<Conn>, Response)>();
    let sh = shared.clone();
    tokio::task::spawn_blocking(move || {
        let _place = place;
        let _blocking = crate::pool::io_guard::allow_blocking();
        let resp = cmd::dispatch(&sh, &mut conn, req);
        if let Err((mut conn, _)) = tx.send((conn, resp)) {
            tracing::warn!(
                conn = conn.id,
                "a blocking command outlived its connection; releasing its grants"
            );
            release(&sh, &mut conn);
        }
    });
    match tokio::time::timeout_at(deadline, &mut rx).await {
        Ok(Ok((conn, resp))) => {
            *slot = Some(conn);
            Ok(resp)
        }
        Ok(Err(_)) => Err(ConnError::CommandFailed(
            "the command's task ended without an answer".into(),
        )),
        Err(_) => {
            // Closing first makes the race with a late answer explicit: either it is in
            // the channel now (take it and release here) or its sender sees the close.
            rx.close();
            if let Ok((conn, _)) = rx.try_recv() {
                release_off_thread(shared, conn).await;
            }
            Err(ConnError::CommandTimeout(limit))
        }
    }
}

/// How long one command may take before its connection gives up on it: the longest wait
/// a command may ask for, and some slack.
fn command_limit(shared: &Shared) -> Duration {
    shared.limits.max_wait + BLOCKING_SLACK
}

/// Gives back everything a finished connection held.
fn release(shared: &Shared, conn: &mut Conn) {
    // Device copies first: once the grants are gone (what observers wait for), the
    // rank's device pages must be forgotten too.
    if let Some(rank) = conn.rank.as_ref()
        && !conn.device.is_empty()
    {
        let pages: Vec<PageHash> = conn.device.drain().collect();
        let (tp, pp) = (rank.identity.tp_rank, rank.identity.pp_rank);
        if let Err(e) = shared.backend.removed(rank.ns, tp, pp, &pages) {
            tracing::warn!(conn = conn.id, error = %e, "could not forget a closed rank's device pages");
        }
    }
    let (stores, loads) = (conn.store_grants.len(), conn.load_grants.len());
    for g in conn.store_grants.drain() {
        let _ = shared.backend.abort_store(g);
    }
    for g in conn.load_grants.drain() {
        let _ = shared.backend.finish_load(g, 0);
    }
    shared.backend.forget_conn(conn.id);
    if let Some(rank) = conn.rank.take() {
        shared.ranks.lock().remove(&conn.id);
        let mut inst = shared.instances.lock();
        if let Some(i) = inst.get_mut(&rank.identity.instance) {
            i.ranks = i.ranks.saturating_sub(1);
            if i.ranks == 0 {
                inst.remove(&rank.identity.instance);
            }
        }
    }
    if stores + loads > 0 {
        tracing::info!(conn = conn.id, stores, loads, "reclaimed grants of a closed connection");
    }
    tracing::debug!(conn = conn.id, "connection closed");
}
