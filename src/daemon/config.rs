//! `kvtier serve` configuration: one struct, documented defaults, three sources.
//!
//! Precedence, lowest first: the defaults below, a TOML file (`--config`), `KVTIER_*`
//! environment variables (the key in upper case: `KVTIER_ARENA_BYTES=…`), then flags
//! (`--socket`, `--arena-path`, `--arena-bytes`, and `--set key=value` for any key).
//! The daemon runs with no configuration at all.
//!
//! Keys with a fixed set of values are serde enums ([`EventsEncoding`], [`PoolKind`]): an
//! unknown value is refused at start, from any of the three sources, with the allowed
//! values in the message. Keys of a section (`[mooncake]`) are `section.key` in `--set`,
//! `--section-key` as flags where one exists, and `KVTIER_SECTION_KEY` in the environment.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::manager::Tunables;
use crate::tier::host::ArenaOptions;

use super::backend::{SharedPool, TiersConfig};
use super::connection::Limits;
pub use super::pool_config::{MooncakeSection, PoolKind};

/// The default slot size: 2 MiB holds one object (K or V of a rank, or an MLA latent) of
/// a 16-token page for Llama 3.1 8B and Mistral 7B (1 MiB), Qwen2.5 7B (448 KiB), Qwen3
/// 32B (2 MiB), Llama 3.1 70B at TP 2 or more (1.25 MiB at TP 2) and DeepSeek V3's
/// latent (1.07 MiB), all in bf16. Larger pages (SGLang's 64 tokens, Mooncake's 512)
/// need `slot_bytes` set; `slot_bytes = 0` fits the slots to the first engine's objects.
pub const DEFAULT_SLOT_BYTES: u64 = 2 << 20;

/// Every key the daemon reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// Control socket. Default: `$XDG_RUNTIME_DIR/kvtier/kvtier.sock`, else
    /// `/run/user/<uid>/kvtier/kvtier.sock` when `/run/user/<uid>` is ours and private, else
    /// `./.kvtier/kvtier.sock`.
    pub socket: PathBuf,
    /// Host arena file (shared memory). Default: `/dev/shm/kvtier-<uid>/<instance>/arena`
    /// where `/dev/shm` exists, else `arena` beside the socket; without an `instance`, the
    /// name is `rt-` and a hash of the control socket's directory, so daemons with
    /// different runtime directories never share an arena. The manifest (`.manifest`),
    /// the local pool (`.pool`) and the owner lock (`.lock`) sit beside it; one daemon
    /// holds the lock for its whole life, and a second one on the same arena refuses to
    /// start, naming the holder's pid.
    pub arena_path: PathBuf,
    /// Name of this daemon among several of one uid on a node (letters, digits, `.`, `_`,
    /// `-`; at most 64): names the default arena directory. Default: empty (a hash of the
    /// control socket's directory).
    pub instance: String,
    /// Host arena size in bytes. Honoured on recovery too: an arena file of another size
    /// is cut or extended to it, and pages in slots that no longer exist (or read as
    /// zeros) are discarded and counted. Default: 1 GiB.
    pub arena_bytes: u64,
    /// Size of each host arena slot in bytes (one object of a page per slot: K or V of one
    /// TP/PP rank, or an MLA latent), rounded up to 64, and of the local pool's slots.
    /// A set size is used whichever engine connects first, so a tiny or draft layout that
    /// connects first locks out no larger model. 0 fits the slots to the first engine that
    /// registers instead: the arena is created at start and cut into slots of that
    /// layout's largest object (rounded up to 64), for a node that serves one geometry
    /// (arena bytes per page within 64 bytes per object of the page's own). Either way a
    /// layout whose objects are larger than the slots is refused at `Connect`
    /// (`bad_layout`, naming both sizes and this key); a restart with another set size
    /// starts a fresh arena (the old pages are discarded and counted), a restart with 0
    /// keeps the manifest's. Default: 2 MiB ([`DEFAULT_SLOT_BYTES`]).
    pub slot_bytes: u64,
    /// Permission bits of the control socket, e.g. `0o660` with `socket_group` for
    /// engines that run as another uid. Default: `0o600`.
    pub socket_mode: u32,
    /// Group of the control socket (a name or a numeric gid); its members are also let
    /// through the peer check. Empty: the daemon's own group. Default: empty.
    #[serde(deserialize_with = "name_or_number")]
    pub socket_group: String,
    /// Group (a name or a numeric gid) of engines that run as another uid than the
    /// daemon's: its members pass the control socket's peer check, the control socket
    /// gets this group and group read/write (unless `socket_group` names another), and
    /// the host arena is `0660` with this group, its directories under `/dev/shm` `0750`
    /// with it, so they can map it. The local pool, manifest and owner lock stay `0600`.
    /// Empty: engines run as the daemon's uid (or root). Default: empty.
    #[serde(deserialize_with = "name_or_number")]
    pub engine_group: String,
    /// Peer uids the control socket serves besides the daemon's own uid and root
    /// (checked with `SO_PEERCRED` at accept). Default: none.
    pub allow_uids: Vec<u32>,
    /// Peer gids the control socket serves (a peer is served when its uid or its gid is
    /// allowed). Default: none.
    pub allow_gids: Vec<u32>,
    /// The pool backend (G3): `none`, `local` (a shared-memory pool on this node) or
    /// `mooncake` (a Mooncake Store shared by a cluster, see `[mooncake]`). Default: `local`.
    pub pool: PoolKind,
    /// Local shared-memory pool size in bytes, beside the arena (`<arena>.pool`); 0 runs
    /// without a pool. Used with `pool = "local"`. Default: 2 GiB.
    pub pool_bytes: u64,
    /// Most client connections at once. Default: 256.
    pub max_connections: usize,
    /// Most ranks one instance may connect. Default: 64.
    pub max_ranks: usize,
    /// Largest frame body accepted. Default: 4 MiB.
    pub max_frame_bytes: usize,
    /// Most pages the directory tracks. Default: 4,194,304.
    pub max_pages: usize,
    /// Longest a load or ticket wait may block, in ms. Default: 5000.
    pub max_wait_ms: u64,
    /// Longest a control frame may take to arrive once its first byte has, in ms: a
    /// client may pause inside a frame, but one that does not complete within this is
    /// answered `bad_frame` and closed. Independent of the idle timeouts. Default: 10000.
    pub frame_body_timeout_ms: u64,
    /// Longest a connected rank's connection may sit idle between requests, in ms; 0
    /// never closes it. The client library reconnects on its next call; the rank's device
    /// pages are forgotten as on any close. Default: 600000.
    pub idle_timeout_ms: u64,
    /// Longest a connection may stay open without having sent `Connect`, in ms (counted
    /// from its last request), so idle sockets cannot hold the `max_connections` slots.
    /// Default: 10000.
    pub connect_timeout_ms: u64,
    /// Page events kept in memory for replay (the events replay endpoint, admin
    /// `/v1/events`); the oldest go first. Its memory grows with use up to this bound
    /// (about 80 bytes an event). Default: 1,048,576.
    pub event_ring: usize,
    /// Longest pin/retain TTL in ms; longer ones are clipped. Default: 600,000.
    pub max_pin_ttl_ms: u64,
    /// Share of host slots pins may hold. Default: 0.25.
    pub pin_budget: f64,
    /// How long pages staged from the pool (a prefetch, a best-effort load) are protected
    /// from eviction unless a load takes them first, in ms; 0 turns it off. Default: 5000.
    pub stage_protect_ms: u64,
    /// Most sessions the daemon tracks; a new one in a full table frees the oldest ended
    /// session first. Default: 65,536.
    pub max_sessions: usize,
    /// Longest session id in bytes; a longer one is refused with `bad_request`.
    /// Default: 1024.
    pub max_session_id_bytes: usize,
    /// Recover the arena from its manifest at start. Default: true.
    pub recover: bool,
    /// Lock the arena in memory (failure is reported, not fatal). Default: true.
    pub lock_arena: bool,
    /// Touch the arena at start so first copies do not fault. Default: true.
    pub prefault: bool,
    /// Period of the upkeep task's fallback run, in ms: what no event announces (pin and
    /// retain TTLs expiring, the pool's own evictions) is noticed within this. Eviction
    /// by watermark does not wait for it: the manager wakes upkeep when a watermark is
    /// crossed. Default: 1000.
    pub tick_ms: u64,
    /// Admin socket (HTTP/1.1, mode 0600). Default: `admin.sock` beside the control socket.
    pub admin_socket: PathBuf,
    /// vLLM-format KV event PUB endpoint; empty disables it, `ipc` binds
    /// `ipc://<control socket dir>/kv-events.ipc` (the daemon's 0700 runtime dir, so only
    /// its user can subscribe). A `tcp://` endpoint is opt-in: anyone who can connect to it
    /// reads the token ids engines sent (the daemon warns at start). Default: `ipc`.
    pub events_endpoint: String,
    /// Replay (ROUTER) endpoint of the KV events; empty disables it, `ipc` binds
    /// `kv-events-replay.ipc` in the runtime dir; `tcp://` is opt-in, as above. Default: `ipc`.
    pub events_replay_endpoint: String,
    /// KV event encoding: `vllm` (tagged map events, what vLLM 0.24 and later decode) or
    /// `vllm-legacy` (positional array events, vLLM 0.23 and earlier; `positional` is
    /// accepted as its old name). Default: `vllm`.
    pub events_encoding: EventsEncoding,
    /// Block hashes in KV events: `int` (the low 64 bits, as vLLM sends a wide hash),
    /// `auto` (8-byte hashes as integers, wider ones as bytes) or `bytes`. Default: `int`.
    pub events_hashes: crate::publish::vllm::HashFormat,
    /// Replay answer form: `auto` (follows `events_encoding`: `topic` for `vllm`,
    /// `legacy` for `vllm-legacy`), `topic` (vLLM 0.26+: `[topic, seq, payload]`) or
    /// `legacy` (vLLM ≤ 0.25: `[seq, payload]`). Default: `auto`.
    pub events_replay_protocol: crate::publish::vllm::ReplayProtocol,
    /// Replay requests a subscriber (per TCP address, or per connection on ipc) may send
    /// per second after a burst of 4. Default: 2.
    pub events_replay_per_sec: f64,
    /// Mooncake-style pool object event PUB endpoint; empty disables it, `ipc` binds
    /// `pool-events.ipc` in the runtime dir; `tcp://` is opt-in (object keys name models and
    /// page hashes). Default: `ipc`.
    pub pool_events_endpoint: String,
    /// `tenant_id` of pool object events. Default: `default` (Mooncake's own).
    pub pool_events_tenant: String,
    /// Session event PUB endpoint: the pressure controller's pauses and resumes for
    /// routers (`docs/events.md`); empty disables it, `ipc` binds `session-events.ipc` in
    /// the runtime dir (0700: only the daemon's user subscribes, since events carry
    /// session ids). Default: `ipc`.
    pub session_events_endpoint: String,
    /// The session policy: `session-aware` (phases, lineage and pressure move pages) or
    /// `off` (sessions only order eviction). Default: `session-aware`.
    pub session_policy: SessionPolicyMode,
    /// Host utilisation at which the pressure controller pauses acting sessions. Default: 0.95.
    pub policy_pause_at: f64,
    /// Host utilisation it reclaims down to; above it, acting sessions' private pages are
    /// demoted to the pool and reasoning sessions lose priority. Default: 0.80.
    pub policy_target: f64,
    /// Paused sessions come back at or below this host utilisation. Default: 0.85.
    pub policy_resume_at: f64,
    /// Room kept per resumed session, in pages. Default: 16.
    pub policy_resume_buffer_pages: u64,
    /// How long a resumed session is not paused again, in ms. Default: 1000.
    pub policy_resume_boost_ms: u64,
    /// Longest pause, in ms, whatever the utilisation. Default: 1,800,000 (30 minutes).
    pub policy_forced_resume_ms: u64,
    /// An acting session's private pages are demoted once it has acted this long (ms)
    /// and host is above `policy_target`. Default: 0.
    pub policy_demote_after_ms: u64,
    /// Drop a page's host copy once it is loaded to device (exclusive tiers). Default: false.
    pub policy_exclusive: bool,
    /// A session with no activity this long (ms) ends. Default: 300,000.
    pub policy_idle_timeout_ms: u64,
    /// Request traces (JSON lines in the Mooncake trace format plus session ids, no
    /// content) appended here as engines report request ends; empty writes none.
    /// Default: empty (off).
    pub request_trace_path: PathBuf,
    /// Rotate the request traces past this many bytes. Default: 64 MiB.
    pub request_trace_max_bytes: u64,
    /// Request trace files kept, the current one included. Default: 4.
    pub request_trace_files: usize,
    /// The Mooncake Store, with `pool = "mooncake"`.
    pub mooncake: MooncakeSection,
}

/// Whether the daemon runs the session-aware policy (`session_policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SessionPolicyMode {
    /// Phases, lineage and the pressure controller decide demotions and staging.
    #[default]
    SessionAware,
    /// Session phases only order eviction (idle sessions' pages go first).
    Off,
}

/// How the vLLM-format KV events are encoded (`events_encoding`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventsEncoding {
    /// vLLM 0.24 and later: the batch an array, each event a map tagged by `type`.
    #[default]
    Vllm,
    /// vLLM 0.23 and earlier: every event an array (msgspec `array_like`).
    #[serde(alias = "positional")]
    VllmLegacy,
}

impl From<EventsEncoding> for crate::publish::vllm::Encoding {
    fn from(e: EventsEncoding) -> Self {
        match e {
            EventsEncoding::Vllm => Self::Tagged,
            EventsEncoding::VllmLegacy => Self::Positional,
        }
    }
}

/// The table of section `name` in `table`, created when absent (a non-table value under
/// that name is replaced: the section's keys win, and serde then checks them).
fn section<'a>(table: &'a mut toml::Table, name: &str) -> &'a mut toml::Table {
    if !table.get(name).is_some_and(toml::Value::is_table) {
        table.insert(name.to_owned(), toml::Value::Table(toml::Table::new()));
    }
    let entry = table
        .entry(name.to_owned())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let toml::Value::Table(t) = entry {
        return t;
    }
    // Not reached: the entry was made a table above. A fresh table keeps the types honest.
    *entry = toml::Value::Table(toml::Table::new());
    entry.as_table_mut().expect("a table was just stored")
}

/// An event endpoint as configured, with `ipc` resolved to `ipc://<dir>/<name>` in the
/// daemon's runtime dir (the control socket's, created 0700).
pub fn event_endpoint(configured: &str, runtime_dir: &Path, name: &str) -> String {
    if configured.starts_with("tcp://") {
        tracing::warn!(
            endpoint = configured,
            "event endpoint on TCP: anyone who can connect to it reads what it publishes (page hashes, and \
             the token ids engines sent); use `ipc` (the default) unless subscribers are on other hosts \
             and the network is isolated"
        );
    }
    if configured == "ipc" {
        format!("ipc://{}", runtime_dir.join(name).display())
    } else {
        configured.to_owned()
    }
}

/// The default arena for a daemon whose control socket is `socket`: under `/dev/shm`
/// where it exists (else beside the socket), in a directory named by `instance` or by a
/// hash of the socket's directory.
pub fn default_arena_path(socket: &Path, instance: &str) -> PathBuf {
    let sock_dir = crate::tier::private::parent_of(socket);
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        return sock_dir.join("arena");
    }
    let name = if instance.is_empty() {
        let abs = std::path::absolute(sock_dir).unwrap_or_else(|_| sock_dir.to_path_buf());
        let h = xxhash_rust::xxh3::xxh3_64(abs.as_os_str().as_encoded_bytes());
        format!("rt-{h:016x}")
    } else {
        instance.to_owned()
    };
    shm.join(format!("kvtier-{}", crate::tier::private::euid()))
        .join(name)
        .join("arena")
}

/// A group given as a name or a number (`socket_group = 1001` or `"render"`), as text.
fn name_or_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Name(String),
        Number(u32),
    }
    Ok(match Either::deserialize(d)? {
        Either::Name(s) => s,
        Either::Number(n) => n.to_string(),
    })
}

/// A group name or numeric gid, as the system knows it.
pub fn resolve_group(key: &str, group: &str) -> Result<u32, ConfigError> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let name = std::ffi::CString::new(group).map_err(|_| ConfigError::Invalid(format!("{key} {group:?}")))?;
    // SAFETY: `group` is plain C data; all-zero is a valid (empty) value.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the sizes given; `out` is set to `&mut grp` or null.
    let rc = unsafe { libc::getgrnam_r(name.as_ptr(), &mut grp, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc != 0 || out.is_null() {
        return Err(ConfigError::Invalid(format!(
            "{key} {group:?} is not a known group name or a numeric gid"
        )));
    }
    Ok(grp.gr_gid)
}

/// Where the daemon's sockets go by default: `$XDG_RUNTIME_DIR/kvtier`, else
/// `/run/user/<uid>/kvtier` when that directory is ours and private, else `.kvtier`; the
/// clients' default is the same function ([`crate::paths::runtime_dir`]).
pub fn runtime_dir() -> PathBuf {
    crate::paths::runtime_dir()
}

impl Default for DaemonConfig {
    fn default() -> Self {
        let dir = runtime_dir();
        let socket = dir.join("kvtier.sock");
        Self {
            arena_path: default_arena_path(&socket, ""),
            socket,
            instance: String::new(),
            arena_bytes: 1 << 30,
            slot_bytes: DEFAULT_SLOT_BYTES,
            socket_mode: 0o600,
            socket_group: String::new(),
            engine_group: String::new(),
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
            pool: PoolKind::Local,
            pool_bytes: 2 << 30,
            max_connections: 256,
            max_ranks: 64,
            max_frame_bytes: crate::protocol::DEFAULT_MAX_BODY,
            max_pages: 1 << 22,
            max_wait_ms: 5_000,
            frame_body_timeout_ms: 10_000,
            idle_timeout_ms: 600_000,
            connect_timeout_ms: 10_000,
            event_ring: 1 << 20,
            max_pin_ttl_ms: 600_000,
            pin_budget: 0.25,
            stage_protect_ms: 5_000,
            max_sessions: crate::manager::DEFAULT_MAX_SESSIONS,
            max_session_id_bytes: crate::manager::DEFAULT_MAX_ID_BYTES,
            recover: true,
            lock_arena: true,
            prefault: true,
            tick_ms: 1_000,
            admin_socket: dir.join("admin.sock"),
            events_endpoint: "ipc".into(),
            events_replay_endpoint: "ipc".into(),
            events_encoding: EventsEncoding::Vllm,
            events_hashes: crate::publish::vllm::HashFormat::Int,
            events_replay_protocol: crate::publish::vllm::ReplayProtocol::Auto,
            events_replay_per_sec: 2.0,
            pool_events_endpoint: "ipc".into(),
            pool_events_tenant: "default".into(),
            session_events_endpoint: "ipc".into(),
            session_policy: SessionPolicyMode::SessionAware,
            policy_pause_at: 0.95,
            policy_target: 0.80,
            policy_resume_at: 0.85,
            policy_resume_buffer_pages: 16,
            policy_resume_boost_ms: 1_000,
            policy_forced_resume_ms: 30 * 60 * 1_000,
            policy_demote_after_ms: 0,
            policy_exclusive: false,
            policy_idle_timeout_ms: 300_000,
            request_trace_path: PathBuf::new(),
            request_trace_max_bytes: 64 << 20,
            request_trace_files: 4,
            mooncake: MooncakeSection::default(),
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config: {0}")]
    Parse(String),
    #[error("--set {0:?}: expected key=value")]
    BadSet(String),
    #[error("{0}")]
    Invalid(String),
}

/// A value as given in the environment or a flag: a TOML literal when it parses as one
/// (numbers, booleans), a string otherwise.
fn value(raw: &str) -> toml::Value {
    format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_owned()))
}

impl DaemonConfig {
    /// Builds the configuration from a file, the environment (`KVTIER_*`) and flag pairs.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &[(String, String)],
    ) -> Result<Self, ConfigError> {
        let mut table = toml::Table::new();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?;
            table = text
                .parse::<toml::Table>()
                .map_err(|e| ConfigError::Parse(e.to_string()))?;
        }
        let keys = Self::keys();
        let sections = Self::section_keys();
        for (k, v) in env {
            let Some(key) = k.strip_prefix("KVTIER_").map(str::to_ascii_lowercase) else {
                continue;
            };
            if keys.contains(&key) && !sections.iter().any(|(s, _)| *s == key) {
                table.insert(key, value(&v));
            } else if let Some((s, f)) = sections.iter().find(|(s, f)| key == format!("{s}_{f}")) {
                section(&mut table, s).insert(f.clone(), value(&v));
            }
        }
        for (k, v) in flags {
            let key = k.replace('-', "_");
            let dotted = key.split_once('.').map(|(s, f)| (s.to_owned(), f.to_owned()));
            let nested = dotted.or_else(|| {
                sections
                    .iter()
                    .find(|(s, f)| key == format!("{s}_{f}"))
                    .map(|(s, f)| (s.clone(), f.clone()))
            });
            match nested {
                Some((s, f)) => {
                    section(&mut table, &s).insert(f, value(v));
                }
                None => {
                    table.insert(key, value(v));
                }
            }
        }
        let derive_arena = !table.contains_key("arena_path");
        let mut cfg: Self = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
        if derive_arena {
            // Derived from the socket and instance as finally configured, so a daemon
            // given its own socket (or runtime dir) gets its own arena too.
            cfg.arena_path = default_arena_path(&cfg.socket, &cfg.instance);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// (section, key) of every key inside a section (`[mooncake]`).
    pub fn section_keys() -> Vec<(String, String)> {
        let Ok(toml::Value::Table(t)) = toml::Value::try_from(Self::default()) else {
            return Vec::new();
        };
        t.iter()
            .filter_map(|(s, v)| v.as_table().map(|inner| (s, inner)))
            .flat_map(|(s, inner)| inner.keys().map(move |k| (s.clone(), k.clone())))
            .collect()
    }

    /// Every key, as written in the file.
    pub fn keys() -> Vec<String> {
        match toml::Value::try_from(Self::default()) {
            Ok(toml::Value::Table(t)) => t.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.into()));
        if self.arena_bytes < 4096 {
            return bad("arena_bytes must be at least 4096");
        }
        if self.max_sessions == 0 || self.max_session_id_bytes == 0 {
            return bad("max_sessions and max_session_id_bytes must be at least 1");
        }
        if self.max_connections == 0 || self.max_ranks == 0 {
            return bad("max_connections and max_ranks must be at least 1");
        }
        if self.max_frame_bytes < 1024 || self.max_frame_bytes > crate::protocol::DEFAULT_MAX_BODY * 16 {
            return bad("max_frame_bytes must be between 1 KiB and 64 MiB");
        }
        if !(0.0..=1.0).contains(&self.pin_budget) {
            return bad("pin_budget must be between 0 and 1");
        }
        if self.tick_ms == 0 {
            return bad("tick_ms must be at least 1");
        }
        if !(self.events_replay_per_sec > 0.0 && self.events_replay_per_sec.is_finite()) {
            return bad("events_replay_per_sec must be a positive number");
        }
        let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if self.instance.len() > 64
            || !self.instance.chars().all(name_ok)
            || matches!(self.instance.as_str(), "." | "..")
        {
            return bad("instance may hold only letters, digits, '.', '_' and '-' (at most 64), and not be . or ..");
        }
        if self.socket_mode > 0o777 {
            return bad("socket_mode must be permission bits (at most 0o777), e.g. 0o660");
        }
        if self.slot_bytes > self.arena_bytes {
            return Err(ConfigError::Invalid(format!(
                "slot_bytes must be at most arena_bytes ({}), got {}; the default, {}, holds an object of \
                 most models at 16-token pages, and 0 fits the slots to the first engine's objects",
                self.arena_bytes, self.slot_bytes, DEFAULT_SLOT_BYTES
            )));
        }
        if self.pool == PoolKind::Local && self.pool_bytes != 0 && self.pool_bytes < self.slot_bytes {
            return Err(ConfigError::Invalid(format!(
                "pool_bytes ({}) holds no slot of slot_bytes ({}); raise it, or set it to 0 for no pool",
                self.pool_bytes, self.slot_bytes
            )));
        }
        self.socket_gid()?;
        self.engine_gid()?;
        if self.frame_body_timeout_ms == 0 || self.connect_timeout_ms == 0 || self.event_ring == 0 {
            return bad("frame_body_timeout_ms, connect_timeout_ms and event_ring must be at least 1");
        }
        if let Some(p) = self.session_policy()
            && let Err(e) = p.pressure.validate()
        {
            return Err(ConfigError::Invalid(format!(
                "policy_pause_at, policy_target, policy_resume_at: {e}"
            )));
        }
        if self.pool == PoolKind::Mooncake {
            self.mooncake
                .validate()
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        Ok(())
    }

    /// Whether the control socket's directory is one kvtier names itself (the runtime
    /// directory's `kvtier`, or `.kvtier`): then it must be strictly private.
    pub fn socket_dir_is_default(&self) -> bool {
        crate::tier::private::parent_of(&self.socket) == runtime_dir()
    }

    /// Whether the arena path is the derived default (`/dev/shm/kvtier-<uid>/…`): then its
    /// directory must be strictly private.
    pub fn arena_is_default(&self) -> bool {
        self.arena_path == default_arena_path(&self.socket, &self.instance)
    }

    /// The control socket's group, when one is configured.
    pub fn socket_gid(&self) -> Result<Option<u32>, ConfigError> {
        if self.socket_group.is_empty() {
            return Ok(None);
        }
        resolve_group("socket_group", &self.socket_group).map(Some)
    }

    /// The group of engines that run as another uid, when one is configured.
    pub fn engine_gid(&self) -> Result<Option<u32>, ConfigError> {
        if self.engine_group.is_empty() {
            return Ok(None);
        }
        resolve_group("engine_group", &self.engine_group).map(Some)
    }

    /// The control socket's mode and group: `socket_mode` and `socket_group`, opened to
    /// `engine_group` (its group and group read/write) when that is set and
    /// `socket_group` is not.
    pub fn socket_access(&self) -> Result<(u32, Option<u32>), ConfigError> {
        match (self.socket_gid()?, self.engine_gid()?) {
            (None, Some(g)) => Ok((self.socket_mode | 0o060, Some(g))),
            (g, _) => Ok((self.socket_mode, g)),
        }
    }

    /// Who the control socket serves: the daemon's uid, root, `allow_uids`, and members of
    /// `allow_gids`, `socket_group` and `engine_group`.
    pub fn peers(&self) -> crate::admin::security::PeerPolicy {
        let mut gids = self.allow_gids.clone();
        // Both resolved at validation; a name that stopped resolving since lets no one in.
        gids.extend(self.socket_gid().ok().flatten());
        gids.extend(self.engine_gid().ok().flatten());
        crate::admin::security::PeerPolicy::owner_and_root(&self.allow_uids, &gids)
    }

    /// The session policy these keys describe, or `None` when it is off.
    pub fn session_policy(&self) -> Option<crate::policy::SessionPolicyConfig> {
        use crate::policy::SessionPolicyConfig;
        use crate::session::pressure::PressureConfig;
        if self.session_policy == SessionPolicyMode::Off {
            return None;
        }
        let d = SessionPolicyConfig::default();
        Some(SessionPolicyConfig {
            pressure: PressureConfig {
                watermarks: crate::policy::Watermarks {
                    high: self.policy_pause_at,
                    target: self.policy_target,
                    resume: self.policy_resume_at,
                },
                resume_buffer_tokens: self.policy_resume_buffer_pages,
                boost_ms: self.policy_resume_boost_ms,
                forced_resume_ms: self.policy_forced_resume_ms,
                ..d.pressure
            },
            demote_after_ms: self.policy_demote_after_ms,
            exclusive: self.policy_exclusive,
            idle_timeout_ms: self.policy_idle_timeout_ms,
            ..d
        })
    }

    pub fn tiers(&self) -> TiersConfig {
        TiersConfig {
            arena_path: self.arena_path.clone(),
            arena_bytes: self.arena_bytes,
            slot_bytes: self.slot_bytes,
            max_pages: self.max_pages,
            max_wait: Duration::from_millis(self.max_wait_ms),
            recover: self.recover,
            arena: ArenaOptions {
                lock: self.lock_arena,
                prefault: self.prefault,
                group: self.engine_gid().ok().flatten(),
                ..ArenaOptions::default()
            },
            tunables: Tunables {
                max_pin_ttl_ms: self.max_pin_ttl_ms,
                pin_budget: self.pin_budget,
                stage_protect_ms: self.stage_protect_ms,
                max_sessions: self.max_sessions,
                max_session_id_bytes: self.max_session_id_bytes,
                ..Tunables::default()
            },
            event_ring: self.event_ring,
            policy: self.session_policy(),
            request_traces: (!self.request_trace_path.as_os_str().is_empty()).then(|| {
                crate::session::trace_log::TraceLogConfig {
                    path: self.request_trace_path.clone(),
                    max_bytes: self.request_trace_max_bytes.max(1),
                    files: self.request_trace_files.max(1),
                }
            }),
            pool_bytes: if self.pool == PoolKind::None {
                0
            } else {
                self.pool_bytes
            },
            shared_pool: (self.pool == PoolKind::Mooncake).then(|| SharedPool {
                pool: super::pool_config::build(self.pool, crate::manager::PoolConfig::None, &self.mooncake),
                key_tag: self.mooncake.key_tag.clone(),
                key_format: self.mooncake.key_format,
                remote: self.mooncake.remote(),
            }),
        }
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_connections: self.max_connections,
            max_frame_bytes: self.max_frame_bytes,
            max_ranks: self.max_ranks,
            max_wait: Duration::from_millis(self.max_wait_ms),
            frame_body_timeout: Duration::from_millis(self.frame_body_timeout_ms),
            idle_timeout: (self.idle_timeout_ms > 0).then(|| Duration::from_millis(self.idle_timeout_ms)),
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::mooncake::ExistsVia;

    #[test]
    fn file_env_and_flags_layer_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kvtier.toml");
        std::fs::write(
            &file,
            "arena_bytes = 8192\nslot_bytes = 4096\nmax_connections = 7\nsocket = \"/a.sock\"\n",
        )
        .unwrap();
        let env = vec![
            ("KVTIER_MAX_CONNECTIONS".to_string(), "9".to_string()),
            ("KVTIER_RECOVER".to_string(), "false".to_string()),
            ("KVTIER_UNRELATED".to_string(), "x".to_string()),
        ];
        let flags = vec![("socket".to_string(), "/b.sock".to_string())];
        let c = DaemonConfig::load(Some(&file), env, &flags).unwrap();
        assert_eq!(c.arena_bytes, 8192);
        assert_eq!(c.max_connections, 9);
        assert!(!c.recover);
        assert_eq!(c.socket, PathBuf::from("/b.sock"));
        assert_eq!(c.pool_bytes, 2 << 30);
        let d = DaemonConfig::load(None, Vec::new(), &[]).unwrap();
        assert_eq!(d, DaemonConfig::default());
        assert_eq!(d.arena_bytes, 1 << 30);
        assert!(d.socket.ends_with("kvtier/kvtier.sock") || d.socket.ends_with(".kvtier/kvtier.sock"));
        assert!(DaemonConfig::load(None, Vec::new(), &[("nope".into(), "1".into())]).is_err());
        assert!(DaemonConfig::load(None, Vec::new(), &[("pin_budget".into(), "2.0".into())]).is_err());
        assert!(DaemonConfig::keys().contains(&"arena_path".to_string()));
    }

    #[test]
    fn an_unknown_enum_value_is_refused_from_every_source_with_the_allowed_list() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kvtier.toml");
        std::fs::write(&file, "events_encoding = \"binary\"\n").unwrap();
        let env = |v: &str| vec![("KVTIER_EVENTS_ENCODING".to_string(), v.to_string())];
        let flag = |v: &str| vec![("events_encoding".to_string(), v.to_string())];
        let refusals = [
            DaemonConfig::load(Some(&file), Vec::new(), &[]),
            DaemonConfig::load(None, env("binary"), &[]),
            DaemonConfig::load(None, Vec::new(), &flag("binary")),
        ];
        for r in refusals {
            let msg = r.unwrap_err().to_string();
            assert!(
                msg.contains("binary") && msg.contains("vllm") && msg.contains("vllm-legacy"),
                "{msg}"
            );
        }
        // The same sources with an allowed value, in precedence order file < env < flag.
        std::fs::write(&file, "events_encoding = \"vllm-legacy\"\n").unwrap();
        let c = DaemonConfig::load(Some(&file), Vec::new(), &[]).unwrap();
        assert_eq!(c.events_encoding, EventsEncoding::VllmLegacy);
        let c = DaemonConfig::load(Some(&file), env("vllm"), &[]).unwrap();
        assert_eq!(c.events_encoding, EventsEncoding::Vllm);
        // The old name of the positional form still works; `named` (a map batch no vLLM
        // version decoded) is refused with the allowed list.
        let c = DaemonConfig::load(Some(&file), env("vllm"), &flag("positional")).unwrap();
        assert_eq!(c.events_encoding, EventsEncoding::VllmLegacy);
        let named = DaemonConfig::load(None, Vec::new(), &flag("named"))
            .unwrap_err()
            .to_string();
        assert!(named.contains("named") && named.contains("vllm-legacy"), "{named}");
        assert_eq!(DaemonConfig::default().events_encoding, EventsEncoding::Vllm);
        // `device` configured nothing (engines choose their device) and is gone.
        let old = DaemonConfig::load(None, Vec::new(), &[("device".into(), "cuda".into())]);
        assert!(old.unwrap_err().to_string().contains("device"));
        let printed = toml::to_string(&DaemonConfig::default()).unwrap();
        assert!(printed.contains("events_encoding = \"vllm\""), "{printed}");
    }

    #[test]
    fn the_default_arena_follows_the_socket_and_instance_and_security_keys_are_checked() {
        let at = |socket: &str, instance: &str| {
            let mut flags = vec![("socket".to_string(), socket.to_string())];
            if !instance.is_empty() {
                flags.push(("instance".into(), instance.into()));
            }
            DaemonConfig::load(None, Vec::new(), &flags).unwrap().arena_path
        };
        assert_ne!(at("/a/kvtier.sock", ""), at("/b/kvtier.sock", ""));
        assert_eq!(at("/a/kvtier.sock", ""), at("/a/other.sock", ""));
        assert!(at("/a/kvtier.sock", "prod-1").ends_with("prod-1/arena"));
        // An explicit arena path is kept as given.
        let flags = vec![("arena_path".to_string(), "/x/arena".to_string())];
        assert_eq!(
            DaemonConfig::load(None, Vec::new(), &flags).unwrap().arena_path,
            PathBuf::from("/x/arena")
        );
        let set = |k: &str, v: &str| DaemonConfig::load(None, Vec::new(), &[(k.to_string(), v.to_string())]);
        assert!(set("instance", "../up").is_err());
        assert!(set("socket_mode", "0o1777").is_err());
        assert_eq!(set("socket_mode", "0o660").unwrap().socket_mode, 0o660);
        assert_eq!(set("socket_group", "0").unwrap().socket_gid().unwrap(), Some(0));
        assert_eq!(set("socket_group", "root").unwrap().socket_gid().unwrap(), Some(0));
        let e = set("socket_group", "no-such-group-kvtier").unwrap_err().to_string();
        assert!(e.contains("no-such-group-kvtier"), "{e}");
        let c = DaemonConfig::load(
            None,
            vec![("KVTIER_ALLOW_UIDS".to_string(), "[1001, 1002]".to_string())],
            &[],
        )
        .unwrap();
        let p = c.peers();
        assert!(p.uids.contains(&1001) && p.uids.contains(&1002) && p.uids.contains(&0));
        assert!(
            set("slot_bytes", &(2u64 << 30).to_string()).is_err(),
            "larger than the arena"
        );
        // The slot size is configuration with a default; 0 fits it to the first layout.
        assert_eq!(DaemonConfig::default().tiers().slot_bytes, DEFAULT_SLOT_BYTES);
        assert_eq!(set("slot_bytes", "0").unwrap().tiers().slot_bytes, 0);
        let e = DaemonConfig::load(
            None,
            Vec::new(),
            &[
                ("arena_bytes".into(), "8388608".into()),
                ("pool_bytes".into(), "1048576".into()),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("pool_bytes") && e.contains("slot_bytes"), "{e}");
        // The engines' group opens the socket and the arena to it, and lets it through.
        let c = set("engine_group", "0").unwrap();
        assert_eq!(c.socket_access().unwrap(), (0o660, Some(0)));
        assert_eq!(c.tiers().arena.group, Some(0));
        assert!(c.peers().gids.contains(&0));
        assert_eq!(DaemonConfig::default().socket_access().unwrap(), (0o600, None));
        assert_eq!(DaemonConfig::default().tiers().arena.group, None);
        let e = set("engine_group", "no-such-group-kvtier").unwrap_err().to_string();
        assert!(e.contains("engine_group") && e.contains("no-such-group-kvtier"), "{e}");
    }

    #[test]
    fn pool_keys_come_from_file_env_and_flags_and_bad_values_fail_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kvtier.toml");
        std::fs::write(
            &file,
            "pool = \"mooncake\"\n[mooncake]\nmaster = \"10.0.0.1:50051\"\nreplicas = 2\n",
        )
        .unwrap();
        let c = DaemonConfig::load(Some(&file), Vec::new(), &[]).unwrap();
        assert_eq!(
            (c.pool, c.mooncake.master.as_str(), c.mooncake.replicas),
            (PoolKind::Mooncake, "10.0.0.1:50051", 2)
        );
        let env = vec![
            ("KVTIER_MOONCAKE_MASTER".to_string(), "10.0.0.2:1".to_string()),
            ("KVTIER_MOONCAKE_KEY_TAG".to_string(), "".to_string()),
            ("KVTIER_MOONCAKE_MASTER_BIN".to_string(), "ignored".to_string()),
        ];
        let c = DaemonConfig::load(Some(&file), env.clone(), &[]).unwrap();
        assert_eq!(
            (c.mooncake.master.as_str(), c.mooncake.key_tag.as_str()),
            ("10.0.0.2:1", "")
        );
        let flags = vec![("mooncake-master".to_string(), "10.0.0.3:2".to_string())];
        let c = DaemonConfig::load(Some(&file), env.clone(), &flags).unwrap();
        assert_eq!(c.mooncake.master, "10.0.0.3:2");
        let flags = vec![("mooncake.lookup_budget_pages".to_string(), "9".to_string())];
        let c = DaemonConfig::load(Some(&file), env.clone(), &flags).unwrap();
        assert_eq!(c.mooncake.lookup_budget_pages, 9);
        assert!(c.tiers().shared_pool.is_some());
        // Existence queries go to the master unless the helper is named.
        assert_eq!(c.mooncake.exists_via, ExistsVia::Master);
        let flags = vec![("mooncake.exists_via".to_string(), "helper".to_string())];
        let c = DaemonConfig::load(Some(&file), env, &flags).unwrap();
        assert_eq!(c.mooncake.exists_via, ExistsVia::Helper);
        // Refusals name what is wrong.
        let err = |pairs: &[(&str, &str)]| {
            let f: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            DaemonConfig::load(None, Vec::new(), &f).unwrap_err().to_string()
        };
        let e = err(&[("pool", "redis")]);
        assert!(
            e.contains("redis") && e.contains("none") && e.contains("local") && e.contains("mooncake"),
            "{e}"
        );
        assert!(err(&[("pool", "mooncake")]).contains("needs mooncake.master"));
        assert!(err(&[("pool", "mooncake"), ("mooncake.master", "nohost")]).contains("not host:port"));
        let e = err(&[
            ("pool", "mooncake"),
            ("mooncake.master", "h:1"),
            ("mooncake.key_tag", "a_b"),
        ]);
        assert!(e.contains("key_tag") && e.contains("a_b"), "{e}");
        assert!(err(&[("mooncake.nope", "1")]).contains("nope"));
        let e = err(&[("mooncake.exists_via", "python")]);
        assert!(
            e.contains("python") && e.contains("master") && e.contains("helper"),
            "{e}"
        );
        // The default stays the local pool, with no shared-pool discovery.
        let d = DaemonConfig::default();
        assert_eq!(d.pool, PoolKind::Local);
        assert!(d.tiers().shared_pool.is_none());
        let none = DaemonConfig {
            pool: PoolKind::None,
            ..d
        };
        assert_eq!(none.tiers().pool_bytes, 0);
    }
}
