//! One live connection to the daemon: the socket, the mapped arena, request framing.
//!
//! Any transport failure drops the connection; the next call reconnects, replays the
//! handshake (`Connect`, then `RegisterDevice` when a device is registered) and remaps
//! the arena. Connecting to a socket nobody serves fails at once (`ECONNREFUSED` or
//! `ENOENT`), so a dead daemon is reported in well under 100 ms.
//!
//! Nothing is sent before the peer is known to be the daemon: its credentials must name
//! the expected uid, and the arena file it names must be that uid's, not a symlink and
//! not writable by others, before it is mapped (see [`super::paths`]).

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use crate::directory::shared::lookup_path;
use crate::protocol::{ArenaInfo, ErrorCode, FrameError, Request, Response, frame, read_frame};
use crate::tier::host::{ArenaOptions, HostArena};
use crate::tier::slot_gen::{SlotStamps, stamps_path};

use super::local::LocalLookup;

use super::{ClientConfig, ClientError};
use crate::paths::{self, ArenaRefusal};

/// [`paths::arena_identity`] as a client error.
fn arena_identity(path: &std::path::Path, expected: u32) -> Result<(u64, u64), ClientError> {
    paths::arena_identity(path, expected).map_err(|r| match r {
        ArenaRefusal::Owner(found) => ClientError::Untrusted {
            what: format!("arena file {}", path.display()),
            expected,
            found,
        },
        ArenaRefusal::Mode(mode) => ClientError::Protocol(format!(
            "arena file {} has mode {mode:o}: writable by others, refusing to map it",
            path.display()
        )),
        ArenaRefusal::NotAFile => ClientError::Protocol(format!(
            "arena {} is a symbolic link or not a regular file, refusing to map it",
            path.display()
        )),
        // What mapping it would have said: the daemon did not share it with this uid.
        ArenaRefusal::Io(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            ClientError::Arena(crate::tier::host::ArenaError::NoAccess {
                path: path.to_owned(),
                uid: crate::tier::private::euid(),
            })
        }
        ArenaRefusal::Io(e) => ClientError::Unavailable(format!("arena {}: {e}", path.display())),
    })
}

/// The daemon's file `what` at `path` beside its arena, held to the arena's rules (owner,
/// mode, not a link; the same file before and after `open` maps it); `None` when there is
/// none, or `open` finds it is not one.
fn beside_arena<T>(
    path: &std::path::Path,
    what: &str,
    expected: u32,
    open: impl FnOnce(&std::path::Path) -> std::io::Result<Option<T>>,
) -> Result<Option<Arc<T>>, ClientError> {
    let before = match arena_identity(path, expected) {
        Err(ClientError::Unavailable(_)) if !path.exists() => return Ok(None),
        other => other?,
    };
    let mapped = open(path).map_err(|e| ClientError::Unavailable(format!("{what} {}: {e}", path.display())))?;
    if arena_identity(path, expected)? != before {
        return Err(ClientError::Protocol(format!(
            "{what} {} changed while it was being mapped",
            path.display()
        )));
    }
    Ok(mapped.map(Arc::new))
}

pub(super) struct Conn {
    raw: RawConn,
    pub arena: Arc<HostArena>,
    /// The arena's slot stamps (`crate::tier::slot_gen`); `None` from a daemon that
    /// keeps none (its grants carry generation 0, never checked).
    pub stamps: Option<Arc<SlotStamps>>,
    /// Store plans of this connection still alive (a copy into their slots may run).
    pub plans: Arc<std::sync::atomic::AtomicUsize>,
    pub arena_info: ArenaInfo,
    pub objects: Vec<u16>,
    pub connection: u64,
    /// The daemon's lookup file, mapped; `None` when it keeps none.
    pub lookup: Option<Arc<LocalLookup>>,
}

/// How soon an open that met a recovering daemon is tried again.
const RECOVERING_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

fn unavailable(e: impl std::fmt::Display) -> ClientError {
    ClientError::Unavailable(e.to_string())
}

impl Conn {
    /// Opens the socket and performs the handshake. A daemon still rebuilding its index
    /// after a restart answers `recovering`: the open is tried again every
    /// [`RECOVERING_RETRY`] until the call timeout, then fails with
    /// [`ClientError::Recovering`].
    pub fn open(cfg: &ClientConfig, hello: Request, device: Option<Request>) -> Result<Self, ClientError> {
        let deadline = std::time::Instant::now() + cfg.timeout;
        loop {
            match Self::open_once(cfg, hello.clone(), device.clone()) {
                Err(ClientError::Recovering(m)) => {
                    if std::time::Instant::now() + RECOVERING_RETRY >= deadline {
                        return Err(ClientError::Recovering(m));
                    }
                    std::thread::sleep(RECOVERING_RETRY);
                }
                other => return other,
            }
        }
    }

    fn open_once(cfg: &ClientConfig, hello: Request, device: Option<Request>) -> Result<Self, ClientError> {
        let (socket, timeout, max_frame) = (&cfg.socket, cfg.timeout, cfg.max_frame_bytes);
        let expected = cfg.expected_daemon_uid();
        let stream = UnixStream::connect(socket).map_err(unavailable)?;
        let found = paths::peer_uid(&stream).map_err(unavailable)?;
        if found != expected {
            return Err(ClientError::Untrusted {
                what: format!("the process serving socket {}", socket.display()),
                expected,
                found,
            });
        }
        stream.set_read_timeout(Some(timeout)).map_err(unavailable)?;
        stream.set_write_timeout(Some(timeout)).map_err(unavailable)?;
        let reader = BufReader::with_capacity(64 << 10, stream.try_clone().map_err(unavailable)?);
        let mut raw = RawConn {
            stream,
            reader,
            out: Vec::with_capacity(4096),
            body: Vec::new(),
            next_id: 1,
        };
        let (connection, arena_info, objects, ns) = match raw.call(&hello, max_frame)? {
            Response::Connected {
                connection,
                arena,
                objects,
                namespace,
            } => (connection, arena, objects, namespace),
            Response::Error(e) => return Err(ClientError::Remote(e)),
            other => {
                return Err(ClientError::Protocol(format!(
                    "unexpected answer to Connect: {other:?}"
                )));
            }
        };
        if let Some(dev) = device {
            match raw.call(&dev, max_frame)? {
                Response::Ok => {}
                Response::Error(e) => return Err(ClientError::Remote(e)),
                other => return Err(ClientError::Protocol(format!("unexpected answer: {other:?}"))),
            }
        }
        let opts = ArenaOptions {
            lock: false,
            prefault: false,
            touch_threads: 1,
            group: None,
        };
        let arena_path = std::path::Path::new(&arena_info.path);
        let before = arena_identity(arena_path, expected)?;
        let arena = HostArena::open(arena_path, arena_info.slot_bytes, &opts)?;
        // The file mapped is the file checked (nobody swapped it in between).
        if arena_identity(arena_path, expected)? != before {
            return Err(ClientError::Protocol(format!(
                "arena {} changed while it was being mapped",
                arena_path.display()
            )));
        }
        let stamps = Self::stamps(arena_path, arena.slots(), expected)?;
        let lookup = if cfg.local_lookup {
            Self::lookup_file(arena_path, ns, expected)?
        } else {
            None
        };
        Ok(Self {
            raw,
            stamps,
            lookup,
            plans: Arc::default(),
            arena: Arc::new(arena),
            arena_info,
            objects,
            connection,
        })
    }

    /// The stamps beside the arena at `arena`, held to the arena's rules; `None` when
    /// there are none.
    fn stamps(arena: &std::path::Path, slots: u32, expected: u32) -> Result<Option<Arc<SlotStamps>>, ClientError> {
        beside_arena(&stamps_path(arena), "slot stamps", expected, |p| {
            SlotStamps::open(p, slots)
        })
    }

    /// The lookup file beside the arena at `arena`, held to the arena's rules; `None`
    /// when there is none.
    fn lookup_file(arena: &std::path::Path, ns: u16, expected: u32) -> Result<Option<Arc<LocalLookup>>, ClientError> {
        beside_arena(&lookup_path(arena), "lookup file", expected, |p| {
            LocalLookup::open(p, ns)
        })
    }

    /// Whether the socket has nothing to read and no hang-up pending: the daemon that
    /// wrote the lookup file is still this connection's (a dead or restarted daemon
    /// hangs up; a notice it sent is read by the next call).
    pub fn quiet(&self) -> bool {
        use std::os::fd::AsRawFd;
        let mut p = libc::pollfd {
            fd: self.raw.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid `pollfd` for a socket this value owns; zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n == 0
    }

    /// One request, one response. Any error here leaves the connection unusable.
    pub fn call(&mut self, req: &Request, max_frame: usize) -> Result<Response, ClientError> {
        self.raw.call(req, max_frame)
    }
}

struct RawConn {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    out: Vec<u8>,
    body: Vec<u8>,
    next_id: u64,
}

impl RawConn {
    fn call(&mut self, req: &Request, max_frame: usize) -> Result<Response, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        self.out.clear();
        req.encode(id, &mut self.out);
        frame::write_all(&mut self.stream, &self.out).map_err(map_frame)?;
        loop {
            let h = read_frame(&mut self.reader, max_frame, &mut self.body).map_err(map_frame)?;
            let resp = Response::decode(h.kind, &self.body)
                .map_err(|e| ClientError::Protocol(format!("bad response: {e}")))?;
            // Id 0 is an unsolicited notice (e.g. shutting down); anything else must match.
            if h.request_id == id {
                return Ok(resp);
            }
            if h.request_id == 0
                && let Response::Error(e) = resp
            {
                if e.code == ErrorCode::Recovering {
                    return Err(ClientError::Recovering(e.message));
                }
                return Err(ClientError::Unavailable(e.to_string()));
            }
        }
    }
}

fn map_frame(e: FrameError) -> ClientError {
    match e {
        FrameError::Timeout => ClientError::Timeout,
        FrameError::TooLarge { .. } | FrameError::BadMagic(_) | FrameError::Version(_) => {
            ClientError::Protocol(e.to_string())
        }
        other => ClientError::Unavailable(other.to_string()),
    }
}
