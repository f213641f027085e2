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
    /// The Mooncake Store, with `pool = "mooncake"`.
    pub mooncake: MooncakeSection,
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
            pool: PoolKind::Local,
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
        let cfg: Self = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
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
        if self.pool == PoolKind::Mooncake {
            self.mooncake
                .validate()
                .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        Ok(())
    }

    pub fn tiers(&self) -> TiersConfig {
        TiersConfig {
            arena_path: self.arena_path.clone(),
            arena_bytes: self.arena_bytes,
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
            pool_bytes: if self.pool == PoolKind::None {
                0
            } else {
                self.pool_bytes
            },
            shared_pool: (self.pool == PoolKind::Mooncake).then(|| SharedPool {
                pool: super::pool_config::build(self.pool, crate::manager::PoolConfig::None, &self.mooncake),
                key_tag: self.mooncake.key_tag.clone(),
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
        let c = DaemonConfig::load(Some(&file), env, &flags).unwrap();
        assert_eq!(c.mooncake.lookup_budget_pages, 9);
        assert!(c.tiers().shared_pool.is_some());
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
