//! The admin server's settings and errors, and what it may ask the daemon beyond the
//! manager ([`EngineView`]): the leaf every other admin module reads.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

/// Why the admin server could not start.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("admin socket directory {0}: {1}")]
    Directory(PathBuf, String),
    #[error("admin socket {0}: {1}")]
    Socket(PathBuf, String),
    #[error("admin socket {0} is in use by a running process")]
    InUse(PathBuf),
    #[error("admin configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Settings of the admin server. Every field has a documented default ([`Default`]).
#[derive(Clone, Debug)]
pub struct AdminConfig {
    /// Socket path. Default: [`default_socket_path`].
    pub socket: PathBuf,
    /// Permission bits of the socket file. Default: `0o600`.
    pub mode: u32,
    /// Peer uids allowed to talk to the socket. Default: the daemon's own uid.
    pub allow_uids: Vec<u32>,
    /// Peer gids allowed (a peer is allowed when its uid or its gid is listed). Default: none.
    pub allow_gids: Vec<u32>,
    /// Largest request body, in bytes; larger ones get 413. Default: 1 MiB.
    pub max_body: usize,
    /// Largest request line plus headers, in bytes; larger ones get 431 (with the JSON
    /// error up to twice this, a bare 431 from hyper beyond). Default: 16 KiB.
    pub max_header: usize,
    /// Connections served at once; more get 503. Default: 64.
    pub max_connections: usize,
    /// How long a client may take to send its whole request (head and body, however it
    /// trickles), and then how long the answer may take to be written. Default: 10 s.
    pub read_timeout: Duration,
    /// Most pages one `pages?prefix=` query may name. Default: 4096.
    pub max_prefix: usize,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            socket: default_socket_path(),
            mode: 0o600,
            // SAFETY: getuid has no preconditions and cannot fail.
            allow_uids: vec![unsafe { libc::getuid() }],
            allow_gids: Vec::new(),
            max_body: 1 << 20,
            max_header: 16 << 10,
            max_connections: 64,
            read_timeout: Duration::from_secs(10),
            max_prefix: 4096,
        }
    }
}

impl AdminConfig {
    /// The defaults with the socket at `path`.
    pub fn at(path: impl AsRef<Path>) -> Self {
        Self {
            socket: path.as_ref().to_path_buf(),
            ..Self::default()
        }
    }

    pub fn validate(&self) -> Result<(), AdminError> {
        if self.mode & !0o777 != 0 {
            return Err(AdminError::Config(format!(
                "mode {:o} has bits beyond 0o777",
                self.mode
            )));
        }
        if self.max_body == 0 || self.max_header < 64 || self.max_connections == 0 || self.read_timeout.is_zero() {
            return Err(AdminError::Config(
                "max_body, max_connections and read_timeout must be positive, max_header at least 64".into(),
            ));
        }
        Ok(())
    }
}

/// The daemon's default admin socket: `admin.sock` in the runtime directory
/// ([`crate::paths::runtime_dir`]: `$XDG_RUNTIME_DIR/kvtier`, else `/run/user/<uid>/kvtier`
/// when that is ours and private, else `./.kvtier`).
pub fn default_socket_path() -> PathBuf {
    crate::paths::runtime_dir().join("admin.sock")
}

/// One connected engine rank, as the daemon knows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EngineInfo {
    pub instance: String,
    pub namespace: String,
    pub tp_rank: u16,
    pub tp_size: u16,
    pub pp_rank: u16,
    pub pp_size: u16,
    pub dp_rank: u16,
    pub pid: Option<u32>,
    /// Milliseconds since the rank connected.
    pub connected_ms: u64,
}

/// One session, as the daemon (or, failing that, the manager) knows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SessionInfo {
    pub session_id: String,
    pub parent_session_id: Option<String>,
    /// `reasoning` or `acting`, when the daemon knows.
    pub phase: Option<String>,
    /// Paused or waiting on a tool: its pages are evicted first.
    pub idle: bool,
    pub pages: Option<u64>,
}

/// What the admin server may ask the daemon beyond the manager: who is connected, and
/// which sessions it tracks. The default methods report nothing (for sessions, the admin
/// server then lists the manager's own).
pub trait EngineView: Send + Sync {
    fn engines(&self) -> Vec<EngineInfo> {
        Vec::new()
    }

    fn sessions(&self) -> Vec<SessionInfo> {
        Vec::new()
    }

    /// The daemon's log of delivered KvHint envelopes, if it keeps one.
    fn kv_hints(&self) -> Option<&crate::router_hint::KvHintLog> {
        None
    }

    /// How the host tier is kept across restarts, where the daemon keeps it.
    fn host_keep(&self) -> Option<HostKeep> {
        None
    }

    /// The daemon's allocator trims after bursts, where it trims.
    fn memory(&self) -> Option<MemoryReport> {
        None
    }
}

/// The daemon's allocator trims (`/v1/status` `memory`): once its control sockets have been
/// quiet for a second after a burst, it gives the allocator's free memory back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    /// Frames read from control connections since start.
    pub frames: u64,
    /// Times the allocator was asked to return its free memory.
    pub trims: u64,
    /// `frames` when the last trim was decided (0 before the first).
    pub trimmed_after_frames: u64,
}

/// How the host tier is kept across restarts: the manifest's upkeep (its bytes, live
/// object records, compactions, full resyncs after the event ring lost events) and the
/// host slots the restart fence quarantines right now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HostKeep {
    pub manifest_bytes: u64,
    pub manifest_live_records: u64,
    pub manifest_compactions: u64,
    pub manifest_resyncs: u64,
    pub fenced_slots: u64,
}

/// An [`EngineView`] with no engines and no sessions (tests, a daemon without engines).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoEngines;

impl EngineView for NoEngines {}
