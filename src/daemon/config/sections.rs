//! The sections of `kvtier serve`'s configuration: one serde struct per `[section]`, whose
//! doc comments are the documentation of its keys and whose `Default` holds their defaults.
//!
//! Every struct denies unknown fields, so a misspelt key is refused at start wherever it
//! came from. The root table keeps only what names the daemon (`socket`, `instance`).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::publish::vllm::{HashFormat, ReplayProtocol};

pub use super::super::pool_config::{MooncakeSection, PoolKind};

/// The default slot size, 0: the arena's slots are fitted to the first layout that
/// registers (its largest object, plus the 32-byte integrity trailer where a Mooncake pool
/// seals objects, rounded up to 64), so a stored page takes its own bytes of host memory
/// and at most 64 more per object, whatever the model and page size. A layout with
/// larger objects after it is refused at `Connect` (`bad_layout`, naming both sizes and
/// `host.slot_bytes`); a node that serves models of several sizes sets `host.slot_bytes`
/// to the largest object among them.
pub const DEFAULT_SLOT_BYTES: u64 = 0;

/// `[access]`: who may use the control socket and map the host arena.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccessSection {
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
}

impl Default for AccessSection {
    fn default() -> Self {
        Self {
            socket_mode: 0o600,
            socket_group: String::new(),
            engine_group: String::new(),
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
        }
    }
}

/// `[host]`: the host arena, the shared-memory file engines copy KV bytes into.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HostSection {
    /// Host arena file (shared memory). Default: `/dev/shm/kvtier-<uid>/<instance>/arena`
    /// where `/dev/shm` exists, else `arena` beside the socket; without an `instance`, the
    /// name is `rt-` and a hash of the control socket's directory, so daemons with
    /// different runtime directories never share an arena. The manifest (`.manifest`),
    /// the local pool (`.pool`) and the owner lock (`.lock`) sit beside it; one daemon
    /// holds the lock for its whole life, and a second one on the same arena refuses to
    /// start, naming the holder's pid.
    pub path: PathBuf,
    /// Host arena size in bytes. Honoured on recovery too: an arena file of another size
    /// is cut or extended to it, and pages in slots that no longer exist (or read as
    /// zeros) are discarded and counted. Default: 1 GiB.
    pub bytes: u64,
    /// Size of each host arena slot in bytes (one object of a page per slot: K or V of one
    /// TP/PP rank, or an MLA latent), rounded up to 64, and of the local pool's slots.
    /// 0 (the default) fits the slots to the first layout that registers: the arena is
    /// created and touched at start and cut at that registration into slots of the
    /// layout's largest object (plus 32 bytes where a Mooncake pool checks integrity),
    /// rounded up to 64, so arena bytes per stored page are the page's own within 64 bytes
    /// per object. Later layouts with objects as large or smaller are served in those
    /// slots (`kvtier status` shows each model's arena bytes per page against its own);
    /// one with larger objects is refused at `Connect` (`bad_layout`, naming both sizes
    /// and this key). A set size is used whichever engine connects first, for a node
    /// that serves several geometries (e.g. a draft model beside a large one): set it to
    /// the largest object among them. A restart with 0 keeps the manifest's slot size
    /// (every recovered page stays where it was); one with another set size starts a
    /// fresh arena (the old pages are discarded and counted). Default: 0
    /// ([`DEFAULT_SLOT_BYTES`]).
    pub slot_bytes: u64,
    /// Recover the arena from its manifest at start. Default: true.
    pub recover: bool,
    /// After a restart that recovered the arena, how long the slots that store grants
    /// held when the daemon stopped stay quarantined (never granted), so that an engine's
    /// copy still landing in them cannot become another page's bytes. Default: 30000.
    pub fence_timeout_ms: u64,
    /// Lock the arena in memory (failure is reported, not fatal). Default: true.
    pub lock: bool,
    /// Touch the arena at start so first copies do not fault. Default: true.
    pub prefault: bool,
    /// Test only: wait this long before opening the tiers (recovery) at start, while the
    /// bound socket answers `recovering`. Default: 0.
    pub test_open_delay_ms: u64,
}

impl Default for HostSection {
    fn default() -> Self {
        Self {
            // Derived from the socket and instance at load when not given.
            path: PathBuf::new(),
            bytes: 1 << 30,
            slot_bytes: DEFAULT_SLOT_BYTES,
            recover: true,
            fence_timeout_ms: 30_000,
            lock: true,
            prefault: true,
            test_open_delay_ms: 0,
        }
    }
}

/// `[control]`: the control socket's connections and frames.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlSection {
    /// Most client connections at once. Default: 256.
    pub max_connections: usize,
    /// Most ranks one instance may connect. Default: 64.
    pub max_ranks: usize,
    /// Largest frame body accepted. Default: 4 MiB.
    pub max_frame_bytes: usize,
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
    /// Nice steps below the control thread's CPU priority for the threads that move
    /// bytes and do pool I/O: the transfer workers and the blocking pool's threads (which
    /// run connects, stores, commits, loads that wait, session moves, hints and upkeep),
    /// and what they start (a Mooncake helper started at an engine's first connect).
    /// Their nice value is the daemon's plus this, at most 19; it is only ever lowered,
    /// never raised. 0 (the default) leaves every thread at the daemon's: on a machine
    /// loaded far past its cores, lowered blocking threads made an engine's first
    /// connect (which creates the local pool) miss its client's deadline. Default: 0.
    pub worker_nice: u8,
    /// Cores the transfer workers pin themselves to, one worker per listed core in turn
    /// (a list shorter than the workers is reused from its start). Each must be a core
    /// the daemon may run on. On a machine with few cores,
    /// workers woken together by one request can otherwise wait in one core's queue while
    /// another idles, for up to a millisecond or two. Default: empty (unpinned).
    pub worker_cores: Vec<usize>,
}

impl Default for ControlSection {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_ranks: 64,
            max_frame_bytes: crate::protocol::DEFAULT_MAX_BODY,
            max_wait_ms: 5_000,
            frame_body_timeout_ms: 10_000,
            idle_timeout_ms: 600_000,
            connect_timeout_ms: 10_000,
            worker_nice: 0,
            worker_cores: Vec::new(),
        }
    }
}

/// `[tiers]`: the page directory and what keeps pages in place.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TiersSection {
    /// Most pages the directory tracks. Default: 4,194,304.
    pub max_pages: usize,
    /// Longest pin/retain TTL in ms; longer ones are clipped. Default: 600,000.
    pub max_pin_ttl_ms: u64,
    /// Share of host slots pins may hold. Default: 0.25.
    pub pin_budget: f64,
    /// How long pages staged from the pool (a prefetch, a best-effort load) are protected
    /// from eviction unless a load takes them first, in ms; 0 turns it off. Default: 5000.
    pub stage_protect_ms: u64,
    /// Period of the upkeep task's fallback run, in ms: what no event announces (pin and
    /// retain TTLs expiring, the pool's own evictions) is noticed within this. Eviction
    /// by watermark does not wait for it: the manager wakes upkeep when a watermark is
    /// crossed. Default: 1000.
    pub tick_ms: u64,
}

impl Default for TiersSection {
    fn default() -> Self {
        Self {
            max_pages: 1 << 22,
            max_pin_ttl_ms: 600_000,
            pin_budget: 0.25,
            stage_protect_ms: 5_000,
            tick_ms: 1_000,
        }
    }
}

/// `[pool]`: the tier below host.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolSection {
    /// The pool backend: `none`, `local` (a shared-memory pool on this node) or
    /// `mooncake` (a Mooncake Store shared by a cluster, see `[mooncake]`). Default: `local`.
    pub kind: PoolKind,
    /// Local shared-memory pool size in bytes, beside the arena (`<arena>.pool`); 0 runs
    /// without a pool. Used with `kind = "local"`. Default: 2 GiB.
    pub bytes: u64,
    /// Fault injection for benches and failure tests: every pool batch call (put, get,
    /// exists, remove) waits this many milliseconds before it runs. Never set it in
    /// production. Default: 0 (off).
    pub fault_delay_ms: u64,
}

impl Default for PoolSection {
    fn default() -> Self {
        Self {
            kind: PoolKind::Local,
            bytes: 2 << 30,
            fault_delay_ms: 0,
        }
    }
}

/// `[sessions]`: the session table and whether the session policy runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionsSection {
    /// The session policy: `session-aware` (phases, lineage and pressure move pages, see
    /// `[policy]`) or `off` (sessions only order eviction). Default: `session-aware`.
    pub policy: SessionPolicyMode,
    /// Most sessions the daemon tracks; a new one in a full table frees the oldest ended
    /// session first. Default: 65,536.
    pub max: usize,
    /// Longest session id in bytes; a longer one is refused with `bad_request`.
    /// Default: 1024.
    pub max_id_bytes: usize,
    /// A session with no activity this long (ms) ends. Default: 300,000.
    pub idle_timeout_ms: u64,
}

impl Default for SessionsSection {
    fn default() -> Self {
        Self {
            policy: SessionPolicyMode::SessionAware,
            max: crate::manager::DEFAULT_MAX_SESSIONS,
            max_id_bytes: crate::manager::DEFAULT_MAX_ID_BYTES,
            idle_timeout_ms: 300_000,
        }
    }
}

/// Whether the daemon runs the session-aware policy (`sessions.policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SessionPolicyMode {
    /// Phases, lineage and the pressure controller decide demotions and staging.
    #[default]
    SessionAware,
    /// Session phases only order eviction (idle sessions' pages go first).
    Off,
}

/// `[policy]`: the pressure controller and demotions of the session-aware policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicySection {
    /// Host utilisation at which the pressure controller pauses acting sessions. Default: 0.95.
    pub pause_at: f64,
    /// Host utilisation it reclaims down to; above it, acting sessions' private pages are
    /// demoted to the pool and reasoning sessions lose priority. Default: 0.80.
    pub target: f64,
    /// Paused sessions come back at or below this host utilisation. Default: 0.85.
    pub resume_at: f64,
    /// Room kept per resumed session, in pages. Default: 16.
    pub resume_buffer_pages: u64,
    /// How long a resumed session is not paused again, in ms. Default: 1000.
    pub resume_boost_ms: u64,
    /// Longest pause, in ms, whatever the utilisation. Default: 1,800,000 (30 minutes).
    pub forced_resume_ms: u64,
    /// An acting session's private pages are demoted once it has acted this long (ms)
    /// and host is above `target`. Default: 0.
    pub demote_after_ms: u64,
    /// Drop a page's host copy once it is loaded to device (exclusive tiers). Default: false.
    pub exclusive: bool,
}

impl Default for PolicySection {
    fn default() -> Self {
        Self {
            pause_at: 0.95,
            target: 0.80,
            resume_at: 0.85,
            resume_buffer_pages: 16,
            resume_boost_ms: 1_000,
            forced_resume_ms: 30 * 60 * 1_000,
            demote_after_ms: 0,
            exclusive: false,
        }
    }
}

/// `[events]`: the event streams (ZMQ) and the in-memory ring they replay from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventsSection {
    /// vLLM-format KV event PUB endpoint; empty disables it, `ipc` binds
    /// `ipc://<control socket dir>/kv-events.ipc` (the daemon's 0700 runtime dir, so only
    /// its user can subscribe). A `tcp://` endpoint is opt-in: anyone who can connect to it
    /// reads the token ids engines sent (the daemon warns at start). Default: `ipc`.
    pub endpoint: String,
    /// Replay (ROUTER) endpoint of the KV events; empty disables it, `ipc` binds
    /// `kv-events-replay.ipc` in the runtime dir; `tcp://` is opt-in, as above. Default: `ipc`.
    pub replay_endpoint: String,
    /// KV event encoding: `vllm` (tagged map events, what vLLM 0.24 and later decode) or
    /// `vllm-legacy` (positional array events, vLLM 0.23 and earlier; `positional` is
    /// accepted as its old name). Default: `vllm`.
    pub encoding: EventsEncoding,
    /// Block hashes in KV events: `int` (the low 64 bits, as vLLM sends a wide hash),
    /// `auto` (8-byte hashes as integers, wider ones as bytes) or `bytes`. Default: `int`.
    pub hashes: HashFormat,
    /// Replay answer form: `auto` (follows `encoding`: `topic` for `vllm`, `legacy` for
    /// `vllm-legacy`), `topic` (vLLM 0.26+: `[topic, seq, payload]`) or `legacy` (vLLM ≤
    /// 0.25: `[seq, payload]`). Default: `auto`.
    pub replay_protocol: ReplayProtocol,
    /// Replay requests a subscriber (per TCP address, or per connection on ipc) may send
    /// per second after a burst of 4. Default: 2.
    pub replay_per_sec: f64,
    /// Page events kept in memory for replay (the events replay endpoint, admin
    /// `/v1/events`); the oldest go first. Its memory grows with use up to this bound
    /// (about 80 bytes an event). Default: 1,048,576.
    pub ring: usize,
    /// Mooncake-style pool object event PUB endpoint (published with a shared pool only);
    /// empty disables it, `ipc` binds `pool-events.ipc` in the runtime dir; `tcp://` is
    /// opt-in (object keys name models and page hashes). Default: `ipc`.
    pub pool_endpoint: String,
    /// `tenant_id` of pool object events. Default: `default` (Mooncake's own).
    pub pool_tenant: String,
    /// Session event PUB endpoint: the pressure controller's pauses and resumes for
    /// routers (`docs/events.md`); empty disables it, `ipc` binds `session-events.ipc` in
    /// the runtime dir (0700: only the daemon's user subscribes, since events carry
    /// session ids). Default: `ipc`.
    pub session_endpoint: String,
}

impl Default for EventsSection {
    fn default() -> Self {
        Self {
            endpoint: "ipc".into(),
            replay_endpoint: "ipc".into(),
            encoding: EventsEncoding::Vllm,
            hashes: HashFormat::Int,
            replay_protocol: ReplayProtocol::Auto,
            replay_per_sec: 2.0,
            ring: 1 << 20,
            pool_endpoint: "ipc".into(),
            pool_tenant: "default".into(),
            session_endpoint: "ipc".into(),
        }
    }
}

/// How the vLLM-format KV events are encoded (`events.encoding`).
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

/// `[admin]`: the operator's HTTP socket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminSection {
    /// Admin socket (HTTP/1.1, mode 0600). Default: `admin.sock` in the default runtime
    /// directory (`$XDG_RUNTIME_DIR/kvtier`, else `/run/user/<uid>/kvtier` when ours and
    /// private, else `.kvtier`), where `kvtier admin` looks.
    pub socket: PathBuf,
}

impl Default for AdminSection {
    fn default() -> Self {
        Self {
            socket: crate::admin::default_socket_path(),
        }
    }
}

/// `[trace]`: request traces for `kvtier replay`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TraceSection {
    /// Request traces (JSON lines in the Mooncake trace format plus session ids, no
    /// content) appended here as engines report request ends; empty writes none.
    /// Default: empty (off).
    pub path: PathBuf,
    /// Rotate the request traces past this many bytes. Default: 64 MiB.
    pub max_bytes: u64,
    /// Request trace files kept, the current one included. Default: 4.
    pub files: usize,
}

impl Default for TraceSection {
    fn default() -> Self {
        Self {
            path: PathBuf::new(),
            max_bytes: 64 << 20,
            files: 4,
        }
    }
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
