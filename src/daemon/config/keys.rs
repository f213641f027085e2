//! Which keys exist, how each source names them, and the old flat names.
//!
//! The one rule: key `k` of section `[s]` is `s.k` in `--set`, `--s-k` as a flag and
//! `KVTIER_S_K` in the environment (dashes and underscores are the same in flags and
//! `--set`); a root key `k` (`socket`, `instance`) is `--k` and `KVTIER_K`.
//!
//! Keys are read from the section structs' own serde field lists (what `deny_unknown_fields`
//! checks against), never from a serialized `Default`, so a key whose default is absent
//! (an `Option`) is a key like any other.

use serde::de::{self, Deserialize, Deserializer, Visitor};

use super::sections::{
    AccessSection, AdminSection, ControlSection, EventsSection, HostSection, MooncakeSection, PolicySection,
    PoolSection, SessionsSection, TiersSection, TraceSection,
};

/// A key: its section (`None` at the root) and its name in that section.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub section: Option<&'static str>,
    pub name: &'static str,
}

impl Key {
    /// `section.name`, as `--set` and `--print-config`'s reader write it.
    pub fn dotted(&self) -> String {
        match self.section {
            Some(s) => format!("{s}.{}", self.name),
            None => self.name.to_owned(),
        }
    }

    /// `section_name`: the flag without `--` and with `_`, and the environment variable
    /// without `KVTIER_` and in lower case.
    pub fn flat(&self) -> String {
        match self.section {
            Some(s) => format!("{s}_{}", self.name),
            None => self.name.to_owned(),
        }
    }

    /// The flag: `--section-name`.
    pub fn flag(&self) -> String {
        format!("--{}", self.flat().replace('_', "-"))
    }

    /// The environment variable: `KVTIER_SECTION_NAME`.
    pub fn env(&self) -> String {
        format!("KVTIER_{}", self.flat().to_ascii_uppercase())
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.dotted())
    }
}

/// The field names serde expects for `T` (a struct with named fields), as its derived
/// `Deserialize` hands them to the deserializer.
pub fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(FieldProbe(&mut fields));
    fields
}

/// A deserializer that only records the field list of the struct asked of it.
struct FieldProbe<'a>(&'a mut &'static [&'static str]);

impl<'de> Deserializer<'de> for FieldProbe<'_> {
    type Error = de::value::Error;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Self::Error> {
        *self.0 = fields;
        Err(de::Error::custom("fields recorded"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// The keys of section `name`, or `None` when the root key of that name is not a section.
pub fn section_fields(name: &str) -> Option<&'static [&'static str]> {
    Some(match name {
        "access" => fields_of::<AccessSection>(),
        "host" => fields_of::<HostSection>(),
        "control" => fields_of::<ControlSection>(),
        "tiers" => fields_of::<TiersSection>(),
        "pool" => fields_of::<PoolSection>(),
        "mooncake" => fields_of::<MooncakeSection>(),
        "sessions" => fields_of::<SessionsSection>(),
        "policy" => fields_of::<PolicySection>(),
        "events" => fields_of::<EventsSection>(),
        "admin" => fields_of::<AdminSection>(),
        "trace" => fields_of::<TraceSection>(),
        _ => return None,
    })
}

/// Every key, root keys first, then each section's in declaration order.
pub fn all() -> Vec<Key> {
    let root = fields_of::<super::DaemonConfig>();
    let mut keys: Vec<Key> = root
        .iter()
        .filter(|f| section_fields(f).is_none())
        .map(|&name| Key { section: None, name })
        .collect();
    for &s in root {
        for &name in section_fields(s).unwrap_or(&[]) {
            keys.push(Key { section: Some(s), name });
        }
    }
    keys
}

/// The key a `--set` name, a flag name (without `--`) or an environment variable name
/// (without `KVTIER_`) names under the one rule: `section.key`, or `section_key` with
/// dashes or underscores, in any case for the environment.
pub fn find(keys: &[Key], given: &str) -> Option<Key> {
    let norm = given.replace('-', "_");
    keys.iter()
        .copied()
        .find(|k| k.dotted() == norm || k.flat() == norm || k.flat().eq_ignore_ascii_case(&norm))
}

/// The flat keys of the release before sections, and where each lives now. They keep
/// working, with a warning, for one release.
pub const RENAMED: &[(&str, &str, &str)] = &[
    ("arena_path", "host", "path"),
    ("arena_bytes", "host", "bytes"),
    ("slot_bytes", "host", "slot_bytes"),
    ("recover", "host", "recover"),
    ("lock_arena", "host", "lock"),
    ("prefault", "host", "prefault"),
    ("socket_mode", "access", "socket_mode"),
    ("socket_group", "access", "socket_group"),
    ("engine_group", "access", "engine_group"),
    ("allow_uids", "access", "allow_uids"),
    ("allow_gids", "access", "allow_gids"),
    ("pool", "pool", "kind"),
    ("pool_bytes", "pool", "bytes"),
    ("max_connections", "control", "max_connections"),
    ("max_ranks", "control", "max_ranks"),
    ("max_frame_bytes", "control", "max_frame_bytes"),
    ("max_wait_ms", "control", "max_wait_ms"),
    ("frame_body_timeout_ms", "control", "frame_body_timeout_ms"),
    ("idle_timeout_ms", "control", "idle_timeout_ms"),
    ("connect_timeout_ms", "control", "connect_timeout_ms"),
    ("max_pages", "tiers", "max_pages"),
    ("max_pin_ttl_ms", "tiers", "max_pin_ttl_ms"),
    ("pin_budget", "tiers", "pin_budget"),
    ("stage_protect_ms", "tiers", "stage_protect_ms"),
    ("tick_ms", "tiers", "tick_ms"),
    ("event_ring", "events", "ring"),
    ("events_endpoint", "events", "endpoint"),
    ("events_replay_endpoint", "events", "replay_endpoint"),
    ("events_encoding", "events", "encoding"),
    ("events_hashes", "events", "hashes"),
    ("events_replay_protocol", "events", "replay_protocol"),
    ("events_replay_per_sec", "events", "replay_per_sec"),
    ("pool_events_endpoint", "events", "pool_endpoint"),
    ("pool_events_tenant", "events", "pool_tenant"),
    ("session_events_endpoint", "events", "session_endpoint"),
    ("admin_socket", "admin", "socket"),
    ("session_policy", "sessions", "policy"),
    ("max_sessions", "sessions", "max"),
    ("max_session_id_bytes", "sessions", "max_id_bytes"),
    ("policy_idle_timeout_ms", "sessions", "idle_timeout_ms"),
    ("policy_pause_at", "policy", "pause_at"),
    ("policy_target", "policy", "target"),
    ("policy_resume_at", "policy", "resume_at"),
    ("policy_resume_buffer_pages", "policy", "resume_buffer_pages"),
    ("policy_resume_boost_ms", "policy", "resume_boost_ms"),
    ("policy_forced_resume_ms", "policy", "forced_resume_ms"),
    ("policy_demote_after_ms", "policy", "demote_after_ms"),
    ("policy_exclusive", "policy", "exclusive"),
    ("request_trace_path", "trace", "path"),
    ("request_trace_max_bytes", "trace", "max_bytes"),
    ("request_trace_files", "trace", "files"),
];

/// The key an old flat name moved to. Many old names are also the new key's flat name
/// (`pool_bytes` is `[pool] bytes` by the rule): those are found by [`find`] first and
/// are not old at all in flags and the environment.
pub fn renamed(keys: &[Key], old: &str) -> Option<Key> {
    let norm = old.replace('-', "_").to_ascii_lowercase();
    let (_, s, k) = RENAMED.iter().find(|(o, _, _)| *o == norm)?;
    keys.iter()
        .copied()
        .find(|key| key.section == Some(s) && key.name == *k)
}

/// An old name that was used, and the key it stands for (the warning names both).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deprecated {
    /// The name as given: `arena_bytes` in the file, `--arena-bytes`, `KVTIER_LOCK_ARENA`.
    pub given: String,
    pub key: Key,
}

impl std::fmt::Display for Deprecated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "configuration name {} is deprecated and will be removed in the next release: use `[{}] {}` \
             ({} or {}, or --set {})",
            self.given,
            self.key.section.unwrap_or(""),
            self.key.name,
            self.key.flag(),
            self.key.env(),
            self.key.dotted()
        )
    }
}
