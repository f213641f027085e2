//! `kvtier serve` configuration: one struct, documented defaults, three sources.
//!
//! Precedence, lowest first: the defaults below, a TOML file (`--config`), `KVTIER_*`
//! environment variables (the key in upper case: `KVTIER_ARENA_BYTES=…`), then flags
//! (`--socket`, `--arena-path`, `--arena-bytes`, and `--set key=value` for any key).
//! The daemon runs with no configuration at all.
//!
//! Keys with a fixed set of values are serde enums ([`EventsEncoding`]): an unknown value
//! is refused at start, from any of the three sources, with the allowed values in the
//! message. (The pool backend, `none | local | mooncake`, becomes one such enum beside
//! `pool_bytes` when the cluster work lands.)

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::manager::Tunables;
use crate::tier::host::ArenaOptions;

use super::backend::TiersConfig;
use super::connection::Limits;

/// Every key the daemon reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// Control socket. Default: `$XDG_RUNTIME_DIR/kvtier/kvtier.sock`, or
    /// `./.kvtier/kvtier.sock` when `XDG_RUNTIME_DIR` is unset.
    pub socket: PathBuf,
    /// Host arena file (shared memory). Default: `/dev/shm/kvtier-<uid>/arena` where
    /// `/dev/shm` exists, else `arena` beside the socket. The manifest sits beside it.
    pub arena_path: PathBuf,
    /// Host arena size in bytes. Default: 1 GiB.
    pub arena_bytes: u64,
    /// Local shared-memory pool size in bytes (G3), beside the arena (`<arena>.pool`);
    /// 0 runs without a pool. Default: 2 GiB.
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
    /// Longest pin/retain TTL in ms; longer ones are clipped. Default: 600,000.
    pub max_pin_ttl_ms: u64,
    /// Share of host slots pins may hold. Default: 0.25.
    pub pin_budget: f64,
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
    /// vLLM-format KV event PUB endpoint; empty disables it. Default: `tcp://127.0.0.1:5570`.
    pub events_endpoint: String,
    /// Replay (ROUTER) endpoint of the KV events; empty disables it. Default: `tcp://127.0.0.1:5571`.
    pub events_replay_endpoint: String,
    /// KV event encoding: `positional` (vLLM's array form) or `named` (maps).
    /// Default: `positional`.
    pub events_encoding: EventsEncoding,
    /// Mooncake-style pool object event PUB endpoint; empty disables it. Default: `tcp://127.0.0.1:5572`.
    pub pool_events_endpoint: String,
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
#[serde(rename_all = "snake_case")]
pub enum EventsEncoding {
    /// vLLM's own array form (what its subscribers decode).
    #[default]
    Positional,
    /// Maps with field names (readable, larger).
    Named,
}

impl From<EventsEncoding> for crate::publish::vllm::Encoding {
    fn from(e: EventsEncoding) -> Self {
        match e {
            EventsEncoding::Positional => Self::Positional,
            EventsEncoding::Named => Self::Named,
        }
    }
}

fn runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("kvtier"),
        _ => PathBuf::from(".kvtier"),
    }
}

impl Default for DaemonConfig {
    fn default() -> Self {
        let dir = runtime_dir();
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        let shm = Path::new("/dev/shm");
        let arena_path = if shm.is_dir() {
            shm.join(format!("kvtier-{uid}")).join("arena")
        } else {
            dir.join("arena")
        };
        Self {
            socket: dir.join("kvtier.sock"),
            arena_path,
            arena_bytes: 1 << 30,
            pool_bytes: 2 << 30,
            max_connections: 256,
            max_ranks: 64,
            max_frame_bytes: crate::protocol::DEFAULT_MAX_BODY,
            max_pages: 1 << 22,
            max_wait_ms: 5_000,
            max_pin_ttl_ms: 600_000,
            pin_budget: 0.25,
            recover: true,
            lock_arena: true,
            prefault: true,
            tick_ms: 1_000,
            admin_socket: dir.join("admin.sock"),
            events_endpoint: "tcp://127.0.0.1:5570".into(),
            events_replay_endpoint: "tcp://127.0.0.1:5571".into(),
            events_encoding: EventsEncoding::Positional,
            pool_events_endpoint: "tcp://127.0.0.1:5572".into(),
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
        for (k, v) in env {
            if let Some(key) = k.strip_prefix("KVTIER_").map(str::to_ascii_lowercase)
                && keys.contains(&key)
            {
                table.insert(key, value(&v));
            }
        }
        for (k, v) in flags {
            table.insert(k.replace('-', "_"), value(v));
        }
        let cfg: Self = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
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
        if let Some(p) = self.session_policy()
            && let Err(e) = p.pressure.validate()
        {
            return Err(ConfigError::Invalid(format!(
                "policy_pause_at, policy_target, policy_resume_at: {e}"
            )));
        }
        Ok(())
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
            pool_bytes: self.pool_bytes,
            max_pages: self.max_pages,
            max_wait: Duration::from_millis(self.max_wait_ms),
            recover: self.recover,
            arena: ArenaOptions {
                lock: self.lock_arena,
                prefault: self.prefault,
                ..ArenaOptions::default()
            },
            tunables: Tunables {
                max_pin_ttl_ms: self.max_pin_ttl_ms,
                pin_budget: self.pin_budget,
                ..Tunables::default()
            },
            policy: self.session_policy(),
            request_traces: (!self.request_trace_path.as_os_str().is_empty()).then(|| {
                crate::session::trace_log::TraceLogConfig {
                    path: self.request_trace_path.clone(),
                    max_bytes: self.request_trace_max_bytes.max(1),
                    files: self.request_trace_files.max(1),
                }
            }),
        }
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_connections: self.max_connections,
            max_frame_bytes: self.max_frame_bytes,
            max_ranks: self.max_ranks,
            max_wait: Duration::from_millis(self.max_wait_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_env_and_flags_layer_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kvtier.toml");
        std::fs::write(&file, "arena_bytes = 8192\nmax_connections = 7\nsocket = \"/a.sock\"\n").unwrap();
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
                msg.contains("binary") && msg.contains("positional") && msg.contains("named"),
                "{msg}"
            );
        }
        // The same sources with an allowed value, in precedence order file < env < flag.
        std::fs::write(&file, "events_encoding = \"named\"\n").unwrap();
        let c = DaemonConfig::load(Some(&file), Vec::new(), &[]).unwrap();
        assert_eq!(c.events_encoding, EventsEncoding::Named);
        let c = DaemonConfig::load(Some(&file), env("positional"), &[]).unwrap();
        assert_eq!(c.events_encoding, EventsEncoding::Positional);
        let c = DaemonConfig::load(Some(&file), env("positional"), &flag("named")).unwrap();
        assert_eq!(c.events_encoding, EventsEncoding::Named);
        assert_eq!(DaemonConfig::default().events_encoding, EventsEncoding::Positional);
        // `device` configured nothing (engines choose their device) and is gone.
        let old = DaemonConfig::load(None, Vec::new(), &[("device".into(), "cuda".into())]);
        assert!(old.unwrap_err().to_string().contains("device"));
        let printed = toml::to_string(&DaemonConfig::default()).unwrap();
        assert!(printed.contains("events_encoding = \"positional\""), "{printed}");
    }
}
