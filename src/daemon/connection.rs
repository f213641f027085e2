//! One client connection: read frames, dispatch commands, write answers, clean up.
//!
//! Responses to requests that arrived together are written together (one write when the
//! read buffer is drained), so a pipelining client pays one system call per batch. When
//! the peer goes away (EOF, a reset, or a frame error) every grant the connection still
//! holds is released at once: store slots go back to the arena, load holds are dropped.

use std::collections::{HashMap, HashSet};
use std::io::{BufReader, ErrorKind};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::layout::{Layout, LayoutSpec};
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::protocol::{ErrorCode, FrameError, Identity, Request, Response, frame, read_frame};

use super::backend::Backend;
use super::cmd;
use super::shutdown::Shutdown;

/// How often an idle handler looks at the shutdown token.
const IDLE_POLL: Duration = Duration::from_millis(100);

/// Limits the server applies to every connection.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub max_frame_bytes: usize,
    /// Most ranks (connections) one instance may hold.
    pub max_ranks: usize,
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
    pub(crate) connections: AtomicU64,
    next_conn: AtomicU64,
}

impl Shared {
    pub fn new(backend: Arc<dyn Backend>, limits: Limits) -> Self {
        Self {
            backend,
            limits,
            instances: Mutex::new(HashMap::new()),
            connections: AtomicU64::new(0),
            next_conn: AtomicU64::new(1),
        }
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

/// Serves one connection until the peer leaves or shutdown fires.
pub fn handle(stream: UnixStream, shared: Arc<Shared>, shutdown: Shutdown) {
    let mut conn = Conn {
        id: shared.next_conn.fetch_add(1, Ordering::Relaxed),
        rank: None,
        store_grants: HashSet::new(),
        load_grants: HashSet::new(),
        device: HashSet::new(),
        loads: HashMap::new(),
    };
    tracing::debug!(conn = conn.id, "connection opened");
    if let Err(e) = serve(&stream, &shared, &mut conn, &shutdown) {
        tracing::debug!(conn = conn.id, error = %e, "connection ended");
    }
    release(&shared, &mut conn);
}

fn serve(stream: &UnixStream, shared: &Shared, conn: &mut Conn, shutdown: &Shutdown) -> Result<(), FrameError> {
    stream.set_read_timeout(Some(IDLE_POLL)).map_err(FrameError::Io)?;
    stream
        .set_write_timeout(Some(Duration::from_secs(5)))
        .map_err(FrameError::Io)?;
    let mut reader = BufReader::with_capacity(64 << 10, stream);
    let mut writer = stream;
    let mut body = Vec::new();
    let mut out = Vec::with_capacity(64 << 10);
    loop {
        if shutdown.is_fired() {
            Response::error(ErrorCode::ShuttingDown, "the daemon is shutting down").encode(0, &mut out);
            let _ = frame::write_all(&mut writer, &out);
            return Ok(());
        }
        let header = match read_frame(&mut reader, shared.limits.max_frame_bytes, &mut body) {
            Ok(h) => h,
            Err(FrameError::Timeout) => continue,
            Err(FrameError::Closed) => return Ok(()),
            Err(e) => {
                // The stream is no longer at a frame boundary: answer once, then close.
                let code = match &e {
                    FrameError::TooLarge { .. } => ErrorCode::FrameTooLarge,
                    FrameError::Version(_) => ErrorCode::UnsupportedVersion,
                    _ => ErrorCode::BadFrame,
                };
                if !matches!(e, FrameError::Io(_) | FrameError::Truncated) {
                    Response::error(code, e.to_string()).encode(0, &mut out);
                    let _ = frame::write_all(&mut writer, &out);
                }
                return Err(e);
            }
        };
        let resp = match Request::decode(header.kind, &body) {
            Ok(req) => cmd::dispatch(shared, conn, req),
            // A body that does not decode leaves the stream intact: answer and go on.
            Err(e) if header.kind < 0x80 => Response::error(ErrorCode::BadFrame, e.to_string()),
            Err(_) => Response::error(
                ErrorCode::UnknownMessage,
                format!("kind {:#04x} is not a request", header.kind),
            ),
        };
        resp.encode(header.request_id, &mut out);
        if reader.buffer().is_empty() || out.len() >= 32 << 10 {
            match frame::write_all(&mut writer, &out) {
                Ok(()) => out.clear(),
                Err(e) if matches!(&e, FrameError::Io(io) if io.kind() == ErrorKind::BrokenPipe) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }
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
    if let Some(rank) = conn.rank.take() {
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
