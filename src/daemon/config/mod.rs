//! `kvtier serve` configuration: typed sections, documented defaults, three sources.
//!
//! Precedence, lowest first: the defaults (each section's `Default`, documented on its
//! fields in [`sections`]), a TOML file (`--config`), `KVTIER_*` environment variables,
//! then flags. One rule names a key everywhere ([`keys`]): key `k` of section `[s]` is
//! `--s-k` as a flag, `KVTIER_S_K` in the environment and `s.k` in `--set s.k=value`
//! (`[host] bytes` is `--host-bytes`, `KVTIER_HOST_BYTES`, `--set host.bytes=…`); the root
//! keys `socket` and `instance` are `--socket`, `KVTIER_SOCKET` and so on.
//! The daemon runs with no configuration at all.
//!
//! Keys with a fixed set of values are serde enums ([`EventsEncoding`], [`PoolKind`]): an
//! unknown value is refused at start, from any of the three sources, with the allowed
//! values in the message. The flat names of the release before sections (`arena_bytes`,
//! `--arena-bytes`, `KVTIER_LOCK_ARENA`) still work for one release, each with a warning
//! naming its new key ([`keys::RENAMED`]).

mod keys;
mod sections;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::manager::Tunables;
use crate::tier::host::ArenaOptions;

use super::backend::{SharedPool, TiersConfig};
use super::connection::Limits;
pub use keys::{Deprecated, Key};
pub use sections::*;

/// Every key the daemon reads: the root keys, then one table per section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// Control socket. Default: `$XDG_RUNTIME_DIR/kvtier/kvtier.sock`, else
    /// `/run/user/<uid>/kvtier/kvtier.sock` when `/run/user/<uid>` is ours and private, else
    /// `./.kvtier/kvtier.sock` (what the client library
    /// and `kvtier` commands look for, also through `KVTIER_SOCKET`).
    pub socket: PathBuf,
    /// Name of this daemon among several of one uid on a node (letters, digits, `.`, `_`,
    /// `-`; at most 64): names the default arena directory. Default: empty (a hash of the
    /// control socket's directory).
    pub instance: String,
    pub access: AccessSection,
    pub host: HostSection,
    pub control: ControlSection,
    pub tiers: TiersSection,
    pub pool: PoolSection,
    pub mooncake: MooncakeSection,
    pub sessions: SessionsSection,
    pub policy: PolicySection,
    pub events: EventsSection,
    pub admin: AdminSection,
    pub trace: TraceSection,
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

impl Default for DaemonConfig {
    fn default() -> Self {
        let socket = crate::paths::runtime_dir().join("kvtier.sock");
        Self {
            host: HostSection {
                path: default_arena_path(&socket, ""),
                ..HostSection::default()
            },
            socket,
            instance: String::new(),
            access: AccessSection::default(),
            control: ControlSection::default(),
            tiers: TiersSection::default(),
            pool: PoolSection::default(),
            mooncake: MooncakeSection::default(),
            sessions: SessionsSection::default(),
            policy: PolicySection::default(),
            events: EventsSection::default(),
            admin: AdminSection::default(),
            trace: TraceSection::default(),
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

/// A value as given in the environment or a flag. A quoted TOML string is that string; a
/// key whose default is text (paths, names, enum values) takes the rest as written, so
/// `--socket 123` is a path and `--pool-kind 7` is refused naming the allowed values;
/// other keys take a TOML literal (numbers, booleans, arrays), or the text when it is not
/// one. `text` is `None` for a key with no default to tell (an absent `Option`).
fn value(raw: &str, text: Option<bool>) -> toml::Value {
    let literal = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"));
    match literal {
        Some(v @ toml::Value::String(_)) => v,
        Some(v) if text != Some(true) => v,
        _ => toml::Value::String(raw.to_owned()),
    }
}

/// Whether each key's default is text, from the serialized defaults (a hint for
/// [`value`] only: keys themselves come from [`keys::all`]).
fn text_keys() -> toml::Table {
    match toml::Value::try_from(DaemonConfig::default()) {
        Ok(toml::Value::Table(t)) => t,
        _ => toml::Table::new(),
    }
}

fn is_text(defaults: &toml::Table, key: Key) -> Option<bool> {
    let v = match key.section {
        Some(s) => defaults.get(s).and_then(|t| t.get(key.name)),
        None => defaults.get(key.name),
    };
    v.map(toml::Value::is_str)
}

/// Sets `key` in `table`, creating its section.
fn put(table: &mut toml::Table, key: Key, v: toml::Value) {
    match key.section {
        Some(s) => {
            section(table, s).insert(key.name.to_owned(), v);
        }
        None => {
            table.insert(key.name.to_owned(), v);
        }
    }
}

impl DaemonConfig {
    /// Builds the configuration from a file, the environment (`KVTIER_*`) and flag pairs
    /// (`(name, value)`: a flag's name without `--`, or a `--set` key), and logs a warning
    /// for each old flat name used.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &[(String, String)],
    ) -> Result<Self, ConfigError> {
        let (cfg, old) = Self::load_noting(file, env, flags)?;
        for d in old {
            tracing::warn!("{d}");
        }
        Ok(cfg)
    }

    /// [`load`](Self::load), returning the old names used instead of logging them.
    pub fn load_noting(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &[(String, String)],
    ) -> Result<(Self, Vec<Deprecated>), ConfigError> {
        let keys = keys::all();
        let defaults = text_keys();
        let mut old = Vec::new();
        let mut table = toml::Table::new();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?;
            let parsed = text
                .parse::<toml::Table>()
                .map_err(|e| ConfigError::Parse(e.to_string()))?;
            for (k, v) in parsed {
                let is_section = keys::section_fields(&k).is_some() && v.is_table();
                let is_root = keys.iter().any(|key| key.section.is_none() && key.name == k);
                match keys::renamed(&keys, &k).filter(|_| !is_section && !is_root) {
                    Some(key) => {
                        old.push(Deprecated {
                            given: format!("`{k}` in {}", path.display()),
                            key,
                        });
                        put(&mut table, key, v);
                    }
                    None => {
                        // A section's table merges with old names already moved into it.
                        match (table.get_mut(&k), v) {
                            (Some(toml::Value::Table(have)), toml::Value::Table(new)) => have.extend(new),
                            (_, v) => {
                                table.insert(k, v);
                            }
                        }
                    }
                }
            }
        }
        for (name, v) in env {
            let Some(rest) = name.strip_prefix("KVTIER_") else {
                continue;
            };
            let rest = rest.to_ascii_lowercase();
            // Other `KVTIER_*` variables (the client's, the tests') are not keys.
            if let Some(key) = keys::find(&keys, &rest) {
                put(&mut table, key, value(&v, is_text(&defaults, key)));
            } else if let Some(key) = keys::renamed(&keys, &rest) {
                old.push(Deprecated {
                    given: name.clone(),
                    key,
                });
                put(&mut table, key, value(&v, is_text(&defaults, key)));
            }
        }
        for (name, v) in flags {
            if let Some(key) = keys::find(&keys, name) {
                put(&mut table, key, value(v, is_text(&defaults, key)));
            } else if let Some(key) = keys::renamed(&keys, name) {
                old.push(Deprecated {
                    given: format!("`{name}`"),
                    key,
                });
                put(&mut table, key, value(v, is_text(&defaults, key)));
            } else {
                // Unknown: serde refuses it with the section's valid keys.
                let norm = name.replace('-', "_");
                match norm.split_once('.') {
                    Some((s, k)) => section(&mut table, s).insert(k.to_owned(), value(v, None)),
                    None => table.insert(norm, value(v, None)),
                };
            }
        }
        let derive_arena = !table
            .get("host")
            .and_then(toml::Value::as_table)
            .is_some_and(|h| h.contains_key("path"));
        let mut cfg: Self = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
        if derive_arena {
            // Derived from the socket and instance as finally configured, so a daemon
            // given its own socket (or runtime dir) gets its own arena too.
            cfg.host.path = default_arena_path(&cfg.socket, &cfg.instance);
        }
        cfg.validate()?;
        Ok((cfg, old))
    }

    /// Every key, root keys first: what `deny_unknown_fields` accepts, section by section.
    pub fn keys() -> Vec<Key> {
        keys::all()
    }

    /// The effective configuration as TOML, one table per section (`--print-config`).
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|e| ConfigError::Invalid(format!("printing the configuration: {e}")))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.into()));
        let (host, control, tiers) = (&self.host, &self.control, &self.tiers);
        if host.bytes < 4096 {
            return bad("host.bytes must be at least 4096");
        }
        if self.sessions.max == 0 || self.sessions.max_id_bytes == 0 {
            return bad("sessions.max and sessions.max_id_bytes must be at least 1");
        }
        if control.max_connections == 0 || control.max_ranks == 0 {
            return bad("control.max_connections and control.max_ranks must be at least 1");
        }
        if control.max_frame_bytes < 1024 || control.max_frame_bytes > crate::protocol::DEFAULT_MAX_BODY * 16 {
            return bad("control.max_frame_bytes must be between 1 KiB and 64 MiB");
        }
        if !(0.0..=1.0).contains(&tiers.pin_budget) {
            return bad("tiers.pin_budget must be between 0 and 1");
        }
        if tiers.tick_ms == 0 {
            return bad("tiers.tick_ms must be at least 1");
        }
        if !(self.events.replay_per_sec > 0.0 && self.events.replay_per_sec.is_finite()) {
            return bad("events.replay_per_sec must be a positive number");
        }
        let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if self.instance.len() > 64
            || !self.instance.chars().all(name_ok)
            || matches!(self.instance.as_str(), "." | "..")
        {
            return bad("instance may hold only letters, digits, '.', '_' and '-' (at most 64), and not be . or ..");
        }
        if self.access.socket_mode > 0o777 {
            return bad("access.socket_mode must be permission bits (at most 0o777), e.g. 0o660");
        }
        if host.slot_bytes > host.bytes {
            return Err(ConfigError::Invalid(format!(
                "host.slot_bytes must be at most host.bytes ({}), got {}; the default, {}, fits the slots \
                 to the first engine's objects",
                host.bytes, host.slot_bytes, DEFAULT_SLOT_BYTES
            )));
        }
        let pool = &self.pool;
        if pool.kind == PoolKind::Local && pool.bytes != 0 && pool.bytes < host.slot_bytes {
            return Err(ConfigError::Invalid(format!(
                "pool.bytes ({}) holds no slot of host.slot_bytes ({}); raise it, or set it to 0 for no pool",
                pool.bytes, host.slot_bytes
            )));
        }
        self.socket_gid()?;
        self.engine_gid()?;
        if i32::from(control.worker_nice) > crate::priority::MAX_NICE {
            return bad("control.worker_nice must be between 0 and 19");
        }
        crate::affinity::check_allowed(&control.worker_cores)
            .map_err(|e| ConfigError::Invalid(format!("control.worker_cores names {e}")))?;
        if control.frame_body_timeout_ms == 0 || control.connect_timeout_ms == 0 || self.events.ring == 0 {
            return bad("control.frame_body_timeout_ms, control.connect_timeout_ms and events.ring must be at least 1");
        }
        if let Some(p) = self.session_policy()
            && let Err(e) = p.pressure.validate()
        {
            return Err(ConfigError::Invalid(format!(
                "policy.pause_at, policy.target, policy.resume_at: {e}"
            )));
        }
        if pool.kind == PoolKind::Mooncake {
            self.mooncake
                .validate()
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        Ok(())
    }

    /// Whether the control socket's directory is one kvtier names itself (the runtime
    /// directory's `kvtier`, or `.kvtier`): then it must be strictly private.
    pub fn socket_dir_is_default(&self) -> bool {
        crate::tier::private::parent_of(&self.socket) == crate::paths::runtime_dir()
    }

    /// Whether the arena path is the derived default (`/dev/shm/kvtier-<uid>/…`): then its
    /// directory must be strictly private.
    pub fn arena_is_default(&self) -> bool {
        self.host.path == default_arena_path(&self.socket, &self.instance)
    }

    /// The control socket's group, when one is configured.
    pub fn socket_gid(&self) -> Result<Option<u32>, ConfigError> {
        if self.access.socket_group.is_empty() {
            return Ok(None);
        }
        resolve_group("access.socket_group", &self.access.socket_group).map(Some)
    }

    /// The group of engines that run as another uid, when one is configured.
    pub fn engine_gid(&self) -> Result<Option<u32>, ConfigError> {
        if self.access.engine_group.is_empty() {
            return Ok(None);
        }
        resolve_group("access.engine_group", &self.access.engine_group).map(Some)
    }

    /// The control socket's mode and group: `socket_mode` and `socket_group`, opened to
    /// `engine_group` (its group and group read/write) when that is set and
    /// `socket_group` is not.
    pub fn socket_access(&self) -> Result<(u32, Option<u32>), ConfigError> {
        match (self.socket_gid()?, self.engine_gid()?) {
            (None, Some(g)) => Ok((self.access.socket_mode | 0o060, Some(g))),
            (g, _) => Ok((self.access.socket_mode, g)),
        }
    }

    /// Who the control socket serves: the daemon's uid, root, `allow_uids`, and members of
    /// `allow_gids`, `socket_group` and `engine_group`.
    pub fn peers(&self) -> crate::admin::security::PeerPolicy {
        let mut gids = self.access.allow_gids.clone();
        // Both resolved at validation; a name that stopped resolving since lets no one in.
        gids.extend(self.socket_gid().ok().flatten());
        gids.extend(self.engine_gid().ok().flatten());
        crate::admin::security::PeerPolicy::owner_and_root(&self.access.allow_uids, &gids)
    }

    /// The session policy these keys describe, or `None` when it is off.
    pub fn session_policy(&self) -> Option<crate::policy::SessionPolicyConfig> {
        use crate::policy::SessionPolicyConfig;
        use crate::session::pressure::PressureConfig;
        if self.sessions.policy == SessionPolicyMode::Off {
            return None;
        }
        let (d, p) = (SessionPolicyConfig::default(), &self.policy);
        Some(SessionPolicyConfig {
            pressure: PressureConfig {
                watermarks: crate::policy::Watermarks {
                    high: p.pause_at,
                    target: p.target,
                    resume: p.resume_at,
                },
                resume_buffer_tokens: p.resume_buffer_pages,
                boost_ms: p.resume_boost_ms,
                forced_resume_ms: p.forced_resume_ms,
                ..d.pressure
            },
            demote_after_ms: p.demote_after_ms,
            exclusive: p.exclusive,
            idle_timeout_ms: self.sessions.idle_timeout_ms,
            ..d
        })
    }

    pub fn tiers(&self) -> TiersConfig {
        let (host, tiers, trace) = (&self.host, &self.tiers, &self.trace);
        TiersConfig {
            arena_path: host.path.clone(),
            arena_bytes: host.bytes,
            slot_bytes: host.slot_bytes,
            max_pages: tiers.max_pages,
            max_wait: Duration::from_millis(self.control.max_wait_ms),
            recover: host.recover,
            fence_timeout: Duration::from_millis(host.fence_timeout_ms),
            arena: ArenaOptions {
                lock: host.lock,
                prefault: host.prefault,
                group: self.engine_gid().ok().flatten(),
                ..ArenaOptions::default()
            },
            tunables: Tunables {
                max_pin_ttl_ms: tiers.max_pin_ttl_ms,
                pin_budget: tiers.pin_budget,
                stage_protect_ms: tiers.stage_protect_ms,
                max_sessions: self.sessions.max,
                max_session_id_bytes: self.sessions.max_id_bytes,
                pool_fault_delay_ms: self.pool.fault_delay_ms,
                ..Tunables::default()
            },
            event_ring: self.events.ring,
            policy: self.session_policy(),
            request_traces: (!trace.path.as_os_str().is_empty()).then(|| crate::session::trace_log::TraceLogConfig {
                path: trace.path.clone(),
                max_bytes: trace.max_bytes.max(1),
                files: trace.files.max(1),
            }),
            pool_bytes: if self.pool.kind == PoolKind::None {
                0
            } else {
                self.pool.bytes
            },
            shared_pool: (self.pool.kind == PoolKind::Mooncake).then(|| SharedPool {
                pool: super::pool_config::build(self.pool.kind, crate::manager::PoolConfig::None, &self.mooncake),
                key_tag: self.mooncake.key_tag.clone(),
                key_format: self.mooncake.key_format,
                remote: self.mooncake.remote(),
                sealed: self.mooncake.integrity_key.is_some(),
                index_pages: self.mooncake.index_max_keys,
            }),
            worker_nice: self.control.worker_nice,
            worker_cores: self.control.worker_cores.clone(),
        }
    }

    pub fn limits(&self) -> Limits {
        let c = &self.control;
        Limits {
            max_connections: c.max_connections,
            max_frame_bytes: c.max_frame_bytes,
            max_ranks: c.max_ranks,
            max_wait: Duration::from_millis(c.max_wait_ms),
            frame_body_timeout: Duration::from_millis(c.frame_body_timeout_ms),
            idle_timeout: (c.idle_timeout_ms > 0).then(|| Duration::from_millis(c.idle_timeout_ms)),
            connect_timeout: Duration::from_millis(c.connect_timeout_ms),
        }
    }
}

#[cfg(test)]
mod tests;

/// The flat names of the release before sections, and `(section, key)` of each now.
pub fn keys_renamed() -> &'static [(&'static str, &'static str, &'static str)] {
    keys::RENAMED
}
