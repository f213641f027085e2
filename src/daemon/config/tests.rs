use super::*;
use crate::pool::mooncake::ExistsVia;

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn set(k: &str, v: &str) -> Result<DaemonConfig, ConfigError> {
    DaemonConfig::load(None, Vec::new(), &pairs(&[(k, v)]))
}

#[test]
fn file_env_and_flags_layer_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kvtier.toml");
    std::fs::write(
        &file,
        "socket = \"/a.sock\"\n[host]\nbytes = 8192\nslot_bytes = 4096\n[control]\nmax_connections = 7\n",
    )
    .unwrap();
    let env = pairs(&[
        ("KVTIER_CONTROL_MAX_CONNECTIONS", "9"),
        ("KVTIER_HOST_RECOVER", "false"),
        ("KVTIER_UNRELATED", "x"),
    ]);
    let flags = pairs(&[("socket", "/b.sock")]);
    let (c, old) = DaemonConfig::load_noting(Some(&file), env, &flags).unwrap();
    assert!(old.is_empty(), "{old:?}");
    assert_eq!(c.host.bytes, 8192);
    assert_eq!(c.control.max_connections, 9);
    assert!(!c.host.recover);
    assert_eq!(c.socket, PathBuf::from("/b.sock"));
    assert_eq!(c.pool.bytes, 2 << 30);
    let d = DaemonConfig::load(None, Vec::new(), &[]).unwrap();
    assert_eq!(d, DaemonConfig::default());
    assert_eq!(d.host.bytes, 1 << 30);
    assert!(d.socket.ends_with("kvtier/kvtier.sock") || d.socket.ends_with(".kvtier/kvtier.sock"));
    assert!(set("nope", "1").is_err());
    assert!(set("tiers.pin_budget", "2.0").is_err());
    // The one rule: `section.key` in `--set`, `section-key` as a flag, any case of
    // `SECTION_KEY` in the environment.
    assert_eq!(set("host.bytes", "8388608").unwrap().host.bytes, 8388608);
    assert_eq!(set("host-bytes", "8388608").unwrap().host.bytes, 8388608);
    let c = DaemonConfig::load(None, pairs(&[("KVTIER_HOST_BYTES", "8388608")]), &[]).unwrap();
    assert_eq!(c.host.bytes, 8388608);
    // A text key keeps its value as written; a quoted value is the string inside.
    assert_eq!(set("socket", "123").unwrap().socket, PathBuf::from("123"));
    assert_eq!(set("events.endpoint", "\"\"").unwrap().events.endpoint, "");
}

#[test]
fn keys_come_from_the_section_structs_and_map_one_to_one_onto_flags_and_env() {
    let keys = DaemonConfig::keys();
    let names: Vec<String> = keys.iter().map(Key::dotted).collect();
    for k in [
        "socket",
        "instance",
        "host.bytes",
        "pool.kind",
        "mooncake.master",
        "trace.path",
    ] {
        assert!(names.contains(&k.to_string()), "{k} in {names:?}");
    }
    // Flags and environment variables are unique: the rule is reversible.
    let mut flats: Vec<String> = keys.iter().map(Key::flat).collect();
    flats.sort();
    flats.dedup();
    assert_eq!(flats.len(), keys.len());
    for k in &keys {
        assert_eq!(keys::find(&keys, &k.flat()), Some(*k));
        assert_eq!(keys::find(&keys, &k.dotted()), Some(*k));
        assert_eq!(keys::find(&keys, &k.flag()[2..]), Some(*k));
        assert_eq!(
            keys::find(&keys, &k.env()["KVTIER_".len()..].to_ascii_lowercase()),
            Some(*k)
        );
    }
    // The sections are exactly the tables of the printed defaults, key for key.
    let printed: toml::Table = DaemonConfig::default().to_toml().unwrap().parse().unwrap();
    let mut from_print: Vec<String> = Vec::new();
    for (s, v) in &printed {
        match v.as_table() {
            Some(t) => from_print.extend(t.keys().map(|k| format!("{s}.{k}"))),
            None => from_print.push(s.clone()),
        }
    }
    let mut want = names.clone();
    want.sort();
    from_print.sort();
    assert_eq!(from_print, want);
    // Every old name lands on a key, and never on the key of another old name's flat name.
    for (old, s, k) in keys::RENAMED {
        let key = keys::renamed(&keys, old).unwrap_or_else(|| panic!("{old}"));
        assert_eq!((key.section, key.name), (Some(*s), *k));
        if let Some(same) = keys::find(&keys, old) {
            assert_eq!(same, key, "{old} is another key's flat name");
        }
    }
}

#[test]
fn an_option_field_is_a_key_although_its_default_prints_nothing() {
    #[derive(Deserialize, Serialize, Default)]
    #[serde(default, deny_unknown_fields)]
    #[allow(dead_code)]
    struct WithOption {
        always: u32,
        sometimes: Option<u32>,
    }
    assert_eq!(keys::fields_of::<WithOption>(), &["always", "sometimes"]);
    let printed = toml::to_string(&WithOption::default()).unwrap();
    assert!(!printed.contains("sometimes"), "{printed}");
}

#[test]
fn old_flat_names_still_work_from_every_source_with_a_warning_naming_the_new_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kvtier.toml");
    std::fs::write(
        &file,
        "arena_bytes = 8388608\npool = \"none\"\nrequest_trace_files = 7\n[host]\nslot_bytes = 4096\n",
    )
    .unwrap();
    let env = pairs(&[("KVTIER_LOCK_ARENA", "false"), ("KVTIER_MAX_SESSIONS", "99")]);
    let flags = pairs(&[("arena-path", "/x/arena"), ("event_ring", "77"), ("pool_bytes", "0")]);
    let (c, old) = DaemonConfig::load_noting(Some(&file), env, &flags).unwrap();
    assert_eq!(c.host.bytes, 8388608);
    assert_eq!(c.host.slot_bytes, 4096);
    assert_eq!(c.pool.kind, PoolKind::None);
    assert_eq!(c.trace.files, 7);
    assert!(!c.host.lock);
    assert_eq!(c.sessions.max, 99);
    assert_eq!(c.host.path, PathBuf::from("/x/arena"));
    assert_eq!(c.events.ring, 77);
    // `pool_bytes` is `[pool] bytes` by the rule itself: not an old name in flags.
    assert_eq!(c.pool.bytes, 0);
    let said: Vec<String> = old.iter().map(ToString::to_string).collect();
    let expect = [
        ("arena_bytes", "[host] bytes", "--host-bytes"),
        ("pool", "[pool] kind", "--pool-kind"),
        ("request_trace_files", "[trace] files", "--trace-files"),
        ("KVTIER_LOCK_ARENA", "[host] lock", "KVTIER_HOST_LOCK"),
        ("KVTIER_MAX_SESSIONS", "[sessions] max", "KVTIER_SESSIONS_MAX"),
        ("arena-path", "[host] path", "--host-path"),
        ("event_ring", "[events] ring", "--events-ring"),
    ];
    assert_eq!(said.len(), expect.len(), "{said:#?}");
    for (given, new, alt) in expect {
        assert!(
            said.iter()
                .any(|s| s.contains(given) && s.contains(new) && s.contains(alt) && s.contains("deprecated")),
            "{given} -> {new}: {said:#?}"
        );
    }
    // An old name that is wrong is refused under its new key's rules.
    let e = set("pin_budget", "2.0").unwrap_err().to_string();
    assert!(e.contains("tiers.pin_budget"), "{e}");
}

#[test]
fn an_unknown_enum_value_is_refused_from_every_source_with_the_allowed_list() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kvtier.toml");
    std::fs::write(&file, "[events]\nencoding = \"binary\"\n").unwrap();
    let env = |v: &str| pairs(&[("KVTIER_EVENTS_ENCODING", v)]);
    let flag = |v: &str| pairs(&[("events.encoding", v)]);
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
    std::fs::write(&file, "[events]\nencoding = \"vllm-legacy\"\n").unwrap();
    let c = DaemonConfig::load(Some(&file), Vec::new(), &[]).unwrap();
    assert_eq!(c.events.encoding, EventsEncoding::VllmLegacy);
    let c = DaemonConfig::load(Some(&file), env("vllm"), &[]).unwrap();
    assert_eq!(c.events.encoding, EventsEncoding::Vllm);
    // The old name of the positional form still works; `named` (a map batch no vLLM
    // version decoded) is refused with the allowed list.
    let c = DaemonConfig::load(Some(&file), env("vllm"), &flag("positional")).unwrap();
    assert_eq!(c.events.encoding, EventsEncoding::VllmLegacy);
    let named = DaemonConfig::load(None, Vec::new(), &flag("named"))
        .unwrap_err()
        .to_string();
    assert!(named.contains("named") && named.contains("vllm-legacy"), "{named}");
    assert_eq!(DaemonConfig::default().events.encoding, EventsEncoding::Vllm);
    // `device` configured nothing (engines choose their device) and is gone.
    let old = set("device", "cuda");
    assert!(old.unwrap_err().to_string().contains("device"));
    let printed = DaemonConfig::default().to_toml().unwrap();
    assert!(printed.contains("[events]\nendpoint"), "{printed}");
    assert!(printed.contains("encoding = \"vllm\""), "{printed}");
}

#[test]
fn the_default_arena_follows_the_socket_and_instance_and_security_keys_are_checked() {
    let at = |socket: &str, instance: &str| {
        let mut flags = pairs(&[("socket", socket)]);
        if !instance.is_empty() {
            flags.push(("instance".into(), instance.into()));
        }
        DaemonConfig::load(None, Vec::new(), &flags).unwrap().host.path
    };
    assert_ne!(at("/a/kvtier.sock", ""), at("/b/kvtier.sock", ""));
    assert_eq!(at("/a/kvtier.sock", ""), at("/a/other.sock", ""));
    assert!(at("/a/kvtier.sock", "prod-1").ends_with("prod-1/arena"));
    // An explicit arena path is kept as given.
    assert_eq!(
        set("host.path", "/x/arena").unwrap().host.path,
        PathBuf::from("/x/arena")
    );
    assert!(set("instance", "../up").is_err());
    assert!(set("access.socket_mode", "0o1777").is_err());
    assert_eq!(set("access.socket_mode", "0o660").unwrap().access.socket_mode, 0o660);
    assert_eq!(set("access.socket_group", "0").unwrap().socket_gid().unwrap(), Some(0));
    assert_eq!(
        set("access.socket_group", "root").unwrap().socket_gid().unwrap(),
        Some(0)
    );
    let e = set("access.socket_group", "no-such-group-kvtier")
        .unwrap_err()
        .to_string();
    assert!(e.contains("no-such-group-kvtier"), "{e}");
    let c = DaemonConfig::load(None, pairs(&[("KVTIER_ACCESS_ALLOW_UIDS", "[1001, 1002]")]), &[]).unwrap();
    let p = c.peers();
    assert!(p.uids.contains(&1001) && p.uids.contains(&1002) && p.uids.contains(&0));
    assert!(
        set("host.slot_bytes", &(2u64 << 30).to_string()).is_err(),
        "larger than the arena"
    );
    // The slot size is configuration; its default, 0, fits it to the first layout.
    assert_eq!(DEFAULT_SLOT_BYTES, 0);
    assert_eq!(DaemonConfig::default().tiers().slot_bytes, 0);
    assert_eq!(set("host.slot_bytes", "4096").unwrap().tiers().slot_bytes, 4096);
    let e = DaemonConfig::load(
        None,
        Vec::new(),
        &pairs(&[
            ("host.bytes", "8388608"),
            ("host.slot_bytes", "2097152"),
            ("pool.bytes", "1048576"),
        ]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("pool.bytes") && e.contains("slot_bytes"), "{e}");
    // The engines' group opens the socket and the arena to it, and lets it through.
    let c = set("access.engine_group", "0").unwrap();
    assert_eq!(c.socket_access().unwrap(), (0o660, Some(0)));
    assert_eq!(c.tiers().arena.group, Some(0));
    assert!(c.peers().gids.contains(&0));
    assert_eq!(DaemonConfig::default().socket_access().unwrap(), (0o600, None));
    assert_eq!(DaemonConfig::default().tiers().arena.group, None);
    let e = set("access.engine_group", "no-such-group-kvtier")
        .unwrap_err()
        .to_string();
    assert!(e.contains("engine_group") && e.contains("no-such-group-kvtier"), "{e}");
}

#[test]
fn pool_keys_come_from_file_env_and_flags_and_bad_values_fail_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kvtier.toml");
    std::fs::write(
        &file,
        "[pool]\nkind = \"mooncake\"\n[mooncake]\nmaster = \"10.0.0.1:50051\"\nreplicas = 2\n",
    )
    .unwrap();
    let c = DaemonConfig::load(Some(&file), Vec::new(), &[]).unwrap();
    assert_eq!(
        (c.pool.kind, c.mooncake.master.as_str(), c.mooncake.replicas),
        (PoolKind::Mooncake, "10.0.0.1:50051", 2)
    );
    let env = pairs(&[
        ("KVTIER_MOONCAKE_MASTER", "10.0.0.2:1"),
        ("KVTIER_MOONCAKE_KEY_TAG", ""),
        ("KVTIER_MOONCAKE_MASTER_BIN", "ignored"),
    ]);
    let c = DaemonConfig::load(Some(&file), env.clone(), &[]).unwrap();
    assert_eq!(
        (c.mooncake.master.as_str(), c.mooncake.key_tag.as_str()),
        ("10.0.0.2:1", "")
    );
    let flags = pairs(&[("mooncake-master", "10.0.0.3:2")]);
    let c = DaemonConfig::load(Some(&file), env.clone(), &flags).unwrap();
    assert_eq!(c.mooncake.master, "10.0.0.3:2");
    let flags = pairs(&[("mooncake.lookup_budget_pages", "9")]);
    let c = DaemonConfig::load(Some(&file), env.clone(), &flags).unwrap();
    assert_eq!(c.mooncake.lookup_budget_pages, 9);
    assert!(c.tiers().shared_pool.is_some());
    // Existence queries go to the master unless the helper is named.
    assert_eq!(c.mooncake.exists_via, ExistsVia::Master);
    let flags = pairs(&[("mooncake.exists_via", "helper")]);
    let c = DaemonConfig::load(Some(&file), env, &flags).unwrap();
    assert_eq!(c.mooncake.exists_via, ExistsVia::Helper);
    // Refusals name what is wrong.
    let err = |p: &[(&str, &str)]| DaemonConfig::load(None, Vec::new(), &pairs(p)).unwrap_err().to_string();
    let e = err(&[("pool.kind", "redis")]);
    assert!(
        e.contains("redis") && e.contains("none") && e.contains("local") && e.contains("mooncake"),
        "{e}"
    );
    assert!(err(&[("pool-kind", "mooncake")]).contains("needs mooncake.master"));
    assert!(err(&[("pool.kind", "mooncake"), ("mooncake.master", "nohost")]).contains("not host:port"));
    let e = err(&[
        ("pool.kind", "mooncake"),
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
    assert_eq!(d.pool.kind, PoolKind::Local);
    assert!(d.tiers().shared_pool.is_none());
    let none = DaemonConfig {
        pool: PoolSection {
            kind: PoolKind::None,
            ..d.pool.clone()
        },
        ..d
    };
    assert_eq!(none.tiers().pool_bytes, 0);
}
