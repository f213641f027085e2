//! `kvtier::client`: the engine-side library one rank links.
//!
//! Blocking and thread-safe (calls on one client are serialised; share it behind an
//! `Arc`). Every call has a timeout. The client maps the daemon's host arena and runs the
//! device↔host copies of its own rank through the [`DeviceRegion`] trait (the emulated
//! device here, CUDA later), then reports completion; bulk bytes never cross the socket.
//! A dead daemon is a typed [`ClientError::Unavailable`] returned at once, and the next
//! call reconnects when the daemon is back.

mod conn;
mod copy;
mod fence;
mod local;
mod routing;

pub use local::EngineLookups;

pub use crate::paths::{default_socket, runtime_dir};
pub use routing::MAX_PAGE_TOKENS;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use crate::hints::{Hint, HintOutcome};
use crate::layout::{Layout, LayoutError, LayoutSpec};
use crate::page::PageHash;
use crate::protocol::{
    AdviceBatch, ArenaInfo, DaemonStats, DeviceInfo, GrantPage, Identity, LoadWait, MAX_ADVICE, MAX_PAGES, RemoteError,
    Request, Response, SessionPhase, TicketStatus,
};
use crate::tier::device::{DeviceError, DeviceRegion};
use crate::tier::host::{ArenaError, HostArena};
use crate::tier::slot_gen::SlotStamps;
use crate::wire::{LookupTally, PrefixHit};

use conn::Conn;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon is not reachable (not running, restarting, or the connection broke).
    #[error("kvtier daemon unavailable: {0}")]
    Unavailable(String),
    #[error("the daemon did not answer in time")]
    Timeout,
    /// The daemon is up but rebuilding its index after a restart; retry shortly.
    #[error("kvtier daemon recovering: {0}")]
    Recovering(String),
    /// The daemon refused the request.
    #[error("daemon refused: {0}")]
    Remote(#[from] RemoteError),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error(transparent)]
    Arena(#[from] ArenaError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("{0}")]
    BadInput(String),
    /// The socket's peer, or the arena file it named, belongs to another user than the
    /// daemon's: a process of that user may be posing as the daemon.
    #[error(
        "{what} belongs to uid {found}, but the kvtier daemon is expected to run as uid {expected}; refusing it \
         (if the daemon really runs as uid {found}, name that uid as the expected daemon uid)"
    )]
    Untrusted { what: String, expected: u32, found: u32 },
}

/// How to reach the daemon, and who this rank is.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub socket: PathBuf,
    pub identity: Identity,
    pub layout: LayoutSpec,
    /// Timeout of every call (and of the daemon-side waits it asks for). Default: 5 s.
    pub timeout: Duration,
    /// Largest response frame accepted. Default: 4 MiB.
    pub max_frame_bytes: usize,
    /// The uid the daemon runs as: the socket's peer credentials (`SO_PEERCRED`) and the
    /// arena file's owner must be it, or the connection is refused
    /// ([`ClientError::Untrusted`]). Default: `None`, this process's effective uid.
    pub daemon_uid: Option<u32>,
    /// Answers lookups in this process from the daemon's lookup file where it can
    /// (see `local`); off, every lookup asks the daemon. Default: on.
    pub local_lookup: bool,
}

impl ClientConfig {
    pub fn new(socket: impl Into<PathBuf>, identity: Identity, layout: LayoutSpec) -> Self {
        Self {
            socket: socket.into(),
            identity,
            layout,
            timeout: Duration::from_secs(5),
            max_frame_bytes: crate::protocol::DEFAULT_MAX_BODY,
            daemon_uid: None,
            local_lookup: true,
        }
    }

    /// [`Self::local_lookup`].
    pub fn with_local_lookup(mut self, on: bool) -> Self {
        self.local_lookup = on;
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Expect the daemon to run as `uid` (an engine of another user than the daemon's).
    /// Default: this process's effective uid.
    pub fn with_daemon_uid(mut self, uid: u32) -> Self {
        self.daemon_uid = Some(uid);
        self
    }

    /// The uid the daemon must run as.
    pub fn expected_daemon_uid(&self) -> u32 {
        self.daemon_uid.unwrap_or_else(crate::tier::private::euid)
    }
}

/// Slots granted for a store; write them, then [`Client::commit`] or [`Client::abort`].
#[derive(Debug)]
pub struct StorePlan {
    pub grant: u64,
    /// Pages (by position in the request) whose objects this rank must write.
    pub pages: Vec<GrantPage>,
    arena: Arc<HostArena>,
    stamps: Option<Arc<SlotStamps>>,
    /// Counted on its connection while alive (restart fencing: see `fence`).
    _live: fence::Live,
}

/// What a finished store did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreReceipt {
    /// Wait on it for the pages to be complete across every rank.
    pub ticket: u64,
    /// Pages this rank wrote objects for (the others were already on host).
    pub written: usize,
    /// Pages of the request complete across every rank at commit time.
    pub complete: u32,
}

/// What a transfer works on: the arena, its stamps, and its plan's place on the
/// connection ([`fence::Live`]).
type Mapped = (Arc<HostArena>, Option<Arc<SlotStamps>>, fence::Live);

fn unexpected(r: Response) -> ClientError {
    ClientError::Protocol(format!("unexpected response {r:?}"))
}

/// The rank of a connected client.
pub struct Client {
    cfg: ClientConfig,
    layout: Layout,
    conn: Mutex<Option<Conn>>,
    device: RwLock<Option<Arc<dyn DeviceRegion>>>,
    /// This library's restart-fence token (see `fence`).
    token: u64,
    /// Live-plan counts of earlier connections that still had plans alive.
    stale: Mutex<Vec<Arc<std::sync::atomic::AtomicUsize>>>,
    /// A `Fence` with `done` is still to be sent.
    owes_done: std::sync::atomic::AtomicBool,
    /// Lookups answered from the lookup file, and their report to the daemon.
    engine_lookups: EngineLookups,
}

impl Client {
    /// Connects (the daemon must be up: otherwise `Unavailable` at once).
    pub fn connect(cfg: ClientConfig) -> Result<Self, ClientError> {
        let layout = cfg.layout.clone().build()?;
        layout.rank_objects(cfg.identity.tp_rank, cfg.identity.pp_rank)?;
        let c = Self {
            cfg,
            layout,
            conn: Mutex::new(None),
            device: RwLock::new(None),
            token: fence::new_token(),
            stale: Mutex::new(Vec::new()),
            owes_done: Default::default(),
            engine_lookups: Default::default(),
        };
        c.call(Request::Ping { payload: Vec::new() })?;
        Ok(c)
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn identity(&self) -> &Identity {
        &self.cfg.identity
    }

    fn device_request(dev: &dyn DeviceRegion) -> Request {
        Request::RegisterDevice(DeviceInfo {
            kind: dev.kind().into(),
            pages: dev.pages(),
            object_bytes: dev.object_bytes() as u64,
        })
    }

    fn ensure<'a>(&self, slot: &'a mut Option<Conn>) -> Result<&'a mut Conn, ClientError> {
        if let Some(c) = slot.as_mut()
            && self.may_say_done()
            && self.announce(c).is_err()
        {
            self.retire(slot.take());
        }
        if slot.is_none() {
            let hello = Request::Connect {
                identity: self.cfg.identity.clone(),
                layout: self.cfg.layout.clone(),
            };
            let dev = self.device.read().as_deref().map(Self::device_request);
            let conn = Conn::open(&self.cfg, hello, dev)?;
            // A new connection may bring a new mapping of the arena (a restarted daemon).
            if let Some(dev) = self.device.read().as_deref() {
                Self::pin_arena(&conn.arena, dev)?;
            }
            let mut conn = conn;
            self.announce(&mut conn)?;
            *slot = Some(conn);
        }
        slot.as_mut()
            .ok_or_else(|| ClientError::Unavailable("no connection".into()))
    }

    /// One round trip; reconnects first when needed. A remote error is returned as
    /// `Remote`; a transport error drops the connection.
    fn call(&self, req: Request) -> Result<Response, ClientError> {
        let mut guard = self.conn.lock();
        // A kept connection may have been closed by a daemon that restarted since the last
        // call: that failure says nothing about the daemon now, so reconnect and try once
        // more. A request the old daemon never answered is safe to resend: its grants died
        // with the connection.
        let mut retry = guard.is_some();
        loop {
            let conn = self.ensure(&mut guard)?;
            match conn.call(&req, self.cfg.max_frame_bytes) {
                Ok(Response::Error(e)) => return Err(ClientError::Remote(e)),
                Ok(r) => return Ok(r),
                Err(e) => {
                    self.retire(guard.take());
                    if !(retry && matches!(e, ClientError::Unavailable(_))) {
                        return Err(e);
                    }
                    retry = false;
                }
            }
        }
    }

    /// Where the daemon's arena is (connects if needed).
    pub fn arena(&self) -> Result<ArenaInfo, ClientError> {
        let mut guard = self.conn.lock();
        Ok(self.ensure(&mut guard)?.arena_info.clone())
    }

    /// The daemon's id for the current connection, and the objects this rank writes.
    pub fn connection(&self) -> Result<(u64, Vec<u16>), ClientError> {
        let mut guard = self.conn.lock();
        let c = self.ensure(&mut guard)?;
        Ok((c.connection, c.objects.clone()))
    }

    /// The arena, its stamps, and a store plan counted on the connection.
    fn mapped(&self) -> Result<Mapped, ClientError> {
        let mut guard = self.conn.lock();
        let c = self.ensure(&mut guard)?;
        Ok((c.arena.clone(), c.stamps.clone(), fence::Live::new(&c.plans)))
    }

    /// Registers this rank's device region; copies go through it from now on.
    pub fn register_device(&self, dev: Arc<dyn DeviceRegion>) -> Result<(), ClientError> {
        let req = Self::device_request(dev.as_ref());
        *self.device.write() = Some(dev.clone());
        match self.call(req)? {
            Response::Ok => {
                let arena = {
                    let mut guard = self.conn.lock();
                    self.ensure(&mut guard)?.arena.clone()
                };
                Self::pin_arena(&arena, dev.as_ref())
            }
            r => Err(unexpected(r)),
        }
    }

    /// Hands this process's mapping of the arena to the device region (a GPU region
    /// registers it as pinned memory; the emulated one ignores it).
    fn pin_arena(arena: &HostArena, dev: &dyn DeviceRegion) -> Result<(), ClientError> {
        let len = arena.slots() as usize * arena.slot_bytes();
        if len == 0 {
            return Ok(());
        }
        // SAFETY: an empty view of slot 0 only yields the mapping's base address.
        let base = unsafe { arena.slot(crate::tier::host::SlotId(0), 0)? }
            .as_ptr()
            .cast_mut();
        dev.register_host(base, len)
            .map_err(|e| match (&e, &arena.report().gpu_pin_refusal) {
                (crate::tier::device::DeviceError::Copy(what), Some(why)) => {
                    ClientError::from(crate::tier::device::DeviceError::Copy(format!(
                        "{what}: host arena {}: {why}",
                        arena.path().display()
                    )))
                }
                _ => e.into(),
            })
    }

    /// The contiguous prefix of `hashes` complete across every rank, credited per tier.
    /// Answered here from the daemon's lookup file where it can be (see `local`), else by
    /// the daemon.
    pub fn lookup(&self, hashes: &[PageHash]) -> Result<PrefixHit, ClientError> {
        if self.cfg.local_lookup {
            // The connection must be up and quiet: no hang-up of a daemon that died, and no
            // notice waiting to be read, before its file is believed.
            let local = {
                let mut guard = self.conn.lock();
                let c = self.ensure(&mut guard)?;
                c.quiet().then(|| c.lookup.clone()).flatten()
            };
            if let Some(hit) = local.and_then(|l| l.lookup(hashes)) {
                // A report due goes now; one that fails is kept for the next.
                if let Some(t) = self.engine_lookups.add(hashes.len(), &hit) {
                    let _ = send_tally(self, t);
                }
                return Ok(hit);
            }
        }
        self.lookup_remote(hashes)
    }

    /// The lookups this client answered itself from the daemon's lookup file.
    pub fn engine_lookups(&self) -> &EngineLookups {
        &self.engine_lookups
    }

    /// Reports the lookups answered here that the daemon has not been told of yet, now
    /// (it is told at most every second otherwise, by a lookup).
    pub fn report_lookups(&self) -> Result<(), ClientError> {
        self.engine_lookups.take().map_or(Ok(()), |t| send_tally(self, t))
    }

    /// [`Self::lookup`], always asked of the daemon.
    pub fn lookup_remote(&self, hashes: &[PageHash]) -> Result<PrefixHit, ClientError> {
        match self.call(Request::Lookup {
            hashes: hashes.to_vec(),
        })? {
            Response::Lookup(h) => Ok(h),
            r => Err(unexpected(r)),
        }
    }

    /// Asks for slots to store this rank's objects of `hashes`.
    pub fn begin_store(&self, hashes: &[PageHash], session: &str) -> Result<StorePlan, ClientError> {
        let (arena, stamps, live) = self.mapped()?;
        match self.call(Request::Store {
            hashes: hashes.to_vec(),
            session: session.into(),
        })? {
            Response::StoreGrant { grant, pages } => Ok(StorePlan {
                grant,
                pages,
                arena,
                stamps,
                _live: live,
            }),
            r => Err(unexpected(r)),
        }
    }

    /// Marks the plan's pages written (`written[i]` for `plan.pages[i]`).
    pub fn commit(&self, plan: &StorePlan, written: &[bool]) -> Result<StoreReceipt, ClientError> {
        match self.call(Request::Commit {
            grant: plan.grant,
            written: written.to_vec(),
        })? {
            Response::Committed { ticket, complete } => Ok(StoreReceipt {
                ticket,
                written: written.iter().filter(|&&w| w).count(),
                complete,
            }),
            r => Err(unexpected(r)),
        }
    }

    pub fn abort(&self, plan: &StorePlan) -> Result<(), ClientError> {
        match self.call(Request::Abort { grant: plan.grant })? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }

    /// Offloads pages: `device_slots[i]` holds page `hashes[i]` in this rank's region.
    /// Copies the rank's objects into the arena, then commits them.
    pub fn store(&self, hashes: &[PageHash], device_slots: &[u32], session: &str) -> Result<StoreReceipt, ClientError> {
        if hashes.len() != device_slots.len() {
            return Err(ClientError::BadInput("one device slot per page hash".into()));
        }
        let plan = self.begin_store(hashes, session)?;
        let written = match self.write_plan(&plan, device_slots) {
            Ok(w) => w,
            Err(e) => {
                let _ = self.abort(&plan);
                return Err(e);
            }
        };
        self.commit(&plan, &written)
    }

    /// Loads the leading pages that are complete on host into `device_slots`. Returns how
    /// many leading pages were loaded: exactly those, never a partial prefix taken whole.
    pub fn load(&self, hashes: &[PageHash], device_slots: &[u32], wait: LoadWait) -> Result<usize, ClientError> {
        if hashes.len() != device_slots.len() {
            return Err(ClientError::BadInput("one device slot per page hash".into()));
        }
        let (arena, stamps, _) = self.mapped()?;
        // The daemon must answer before this call times out, so waits are bounded by it.
        let budget = self.cfg.timeout.saturating_sub(Duration::from_millis(100)).as_millis() as u32;
        let wait = match wait {
            LoadWait::WaitComplete => LoadWait::Timeout(budget),
            LoadWait::Timeout(ms) => LoadWait::Timeout(ms.min(budget)),
            LoadWait::BestEffort => LoadWait::BestEffort,
        };
        let (grant, pages) = match self.call(Request::Load {
            hashes: hashes.to_vec(),
            wait,
        })? {
            Response::LoadGrant { grant, pages } => (grant, pages),
            r => return Err(unexpected(r)),
        };
        let copied = self.read_pages(&arena, &pages, device_slots);
        // Only pages whose slots still hold the generations granted count as loaded (a
        // late copy of an earlier grant stamped its own): the rest are missing.
        let loaded = if copied.is_ok() {
            fence::held(stamps.as_deref(), &pages)
        } else {
            0
        };
        if copied.is_ok() && loaded < pages.len() {
            tracing::warn!(
                loaded,
                granted = pages.len(),
                "a loaded page's slot was stamped by another grant's copy; it is reported missing"
            );
        }
        let done = self.call(Request::LoadDone {
            grant,
            loaded: loaded as u32,
        });
        copied?;
        done?;
        Ok(loaded)
    }

    pub fn poll(&self, ticket: u64) -> Result<TicketStatus, ClientError> {
        match self.call(Request::Poll { ticket })? {
            Response::Ticket(t) => Ok(t),
            r => Err(unexpected(r)),
        }
    }

    /// Waits (at most `timeout`, bounded by the call timeout) for a store's pages to be
    /// complete across every rank.
    pub fn wait(&self, ticket: u64, timeout: Duration) -> Result<TicketStatus, ClientError> {
        let ms = timeout.min(self.cfg.timeout.saturating_sub(Duration::from_millis(50)));
        match self.call(Request::Wait {
            ticket,
            timeout_ms: ms.as_millis() as u32,
        })? {
            Response::Ticket(t) => Ok(t),
            r => Err(unexpected(r)),
        }
    }

    pub fn removed(&self, hashes: &[PageHash]) -> Result<(), ClientError> {
        self.expect_ok(Request::Removed {
            hashes: hashes.to_vec(),
        })
    }

    pub fn session(&self, id: &str, parent: Option<&str>, phase: SessionPhase) -> Result<(), ClientError> {
        self.expect_ok(Request::Session {
            id: id.into(),
            parent: parent.map(str::to_owned),
            phase,
        })
    }

    /// A request of `session` finished: its prompt's page hashes and token counts (no
    /// content). The daemon's session policy learns the session's chain from it, and with
    /// request traces on the daemon appends a line in the Mooncake trace format.
    pub fn request_end(
        &self,
        session: &str,
        parent: Option<&str>,
        input_length: u64,
        output_length: u64,
        hashes: &[PageHash],
    ) -> Result<(), ClientError> {
        self.expect_ok(Request::RequestEnd {
            session: session.into(),
            parent: parent.map(str::to_owned),
            input_length,
            output_length,
            hashes: hashes.to_vec(),
        })
    }

    pub fn hint(&self, hint: Hint) -> Result<HintOutcome, ClientError> {
        match self.call(Request::Hint(hint))? {
            Response::Hint(o) => Ok(o),
            r => Err(unexpected(r)),
        }
    }

    /// Takes the advice the daemon holds for this rank's namespace (pages to evict first,
    /// to offload, or ready to load; sessions the pressure controller paused or let
    /// resume, `AdviceKind::Pause` / `Resume` with a `session_id` and no pages), oldest
    /// first, at most `max_pages` page hashes (and no more than a response frame of this
    /// client holds). Advice goes to whichever rank of the namespace asks first, so ask
    /// from one rank (the scheduler's). When the answer says `more`, ask again.
    pub fn take_advice(&self, max_pages: usize) -> Result<AdviceBatch, ClientError> {
        // Worst case per page: a 32-byte hash and its length byte; per entry, its kind
        // and count; per session entry (at most MAX_SESSION_ADVICE), its kind and id.
        let overhead = crate::protocol::HEADER_BYTES
            + 5
            + 5 * MAX_ADVICE
            + crate::protocol::MAX_SESSION_ADVICE * (3 + crate::protocol::MAX_STR);
        let fits = self.cfg.max_frame_bytes.saturating_sub(overhead) / (1 + crate::page::MAX_HASH_BYTES);
        let budget = max_pages.min(fits).min(MAX_PAGES);
        if budget == 0 {
            return Err(ClientError::BadInput(format!(
                "an advice budget of {max_pages} pages fits no page"
            )));
        }
        match self.call(Request::TakeAdvice {
            max_pages: budget as u32,
        })? {
            Response::Advice(a) => Ok(a),
            r => Err(unexpected(r)),
        }
    }

    pub fn stats(&self) -> Result<DaemonStats, ClientError> {
        match self.call(Request::Stats)? {
            Response::Stats(s) => Ok(s),
            r => Err(unexpected(r)),
        }
    }

    fn expect_ok(&self, req: Request) -> Result<(), ClientError> {
        match self.call(req)? {
            Response::Ok => Ok(()),
            r => Err(unexpected(r)),
        }
    }
}

/// Sends the tally `t` of lookups `c` answered itself; kept for the next report if the
/// daemon does not take it.
fn send_tally(c: &Client, t: LookupTally) -> Result<(), ClientError> {
    c.expect_ok(Request::LookupTally(t))
        .inspect_err(|_| c.engine_lookups.keep(&t))
}
