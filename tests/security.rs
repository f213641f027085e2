//! Issue 15's safety cases, through real `kvtier serve` processes: one owner per arena,
//! private directories and files (never a planted symlink, never another user's
//! directory) and the control socket's peer check. The two-user cases switch to uid
//! 65534 (`nobody`) and need root: they skip loudly without it, and fail where
//! `KVTIER_REQUIRE` lists `root`. Slot size, arena size and the manifest: tests/recovery.rs.

mod cluster_support;
mod common;
#[path = "security/events_default.rs"]
mod events_default;
#[path = "security/fake_daemon.rs"]
mod fake_daemon;
#[path = "security/mooncake_paths.rs"]
mod mooncake_paths;
#[path = "security/pool_geometry.rs"]
mod pool_geometry;
#[path = "security/serve.rs"]
mod serve;

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::require::require;
use common::{hashes, small_spec};
use kvtier::client::Client;
use kvtier::protocol::{Request, Response, read_frame};
use serve::*;

const NOBODY: u32 = 65534;

#[test]
fn a_second_daemon_on_the_same_arena_refuses_naming_the_holder() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let arena_arg = arena.to_str().unwrap();
    let a = serve(
        dir.path(),
        "a",
        &["--arena-path", arena_arg, "--arena-bytes", "4194304"],
    )
    .ready();
    let c = a.client("one", small_spec()).unwrap();
    let hs = hashes(100, 64);
    store(&c, &small_spec(), &hs, 1);

    let b = serve(
        dir.path(),
        "b",
        &["--arena-path", arena_arg, "--arena-bytes", "4194304"],
    );
    let (failed, log) = b.refused();
    assert!(failed, "the second daemon must not start: {log}");
    assert!(
        log.contains(&format!("pid {}", a.pid())),
        "the holder's pid is named: {log}"
    );
    assert!(log.contains("arena.lock"), "{log}");
    assert!(!dir.path().join("b.sock").exists(), "a refused daemon leaves no socket");
    assert_eq!(
        load_verified(&c, &small_spec(), &hs, 1),
        64,
        "the owner's 64 pages are intact"
    );
}

#[test]
fn daemons_with_different_runtime_dirs_get_different_arenas() {
    let dir = tempdir();
    let mut daemons = Vec::new();
    for (i, name) in ["rt1", "rt2"].iter().enumerate() {
        let rt = dir.path().join(name);
        std::fs::create_dir(&rt).unwrap();
        chmod(&rt, 0o700);
        let socket = rt.join("kvtier/kvtier.sock");
        let d = spawn(
            dir.path(),
            name,
            &socket,
            &["--arena-bytes", "4194304"],
            &[("XDG_RUNTIME_DIR", Some(rt.to_str().unwrap()))],
        )
        .ready();
        assert_eq!(mode(&rt.join("kvtier")), 0o700, "the runtime dir's kvtier is private");
        daemons.push((d, i as u64 + 1));
    }
    let arena_of = |d: &Serve| {
        let b = d.banner();
        let line = b
            .lines()
            .find(|l| l.contains("host arena"))
            .unwrap_or_default()
            .to_owned();
        let path = line.split("host arena ").nth(1).and_then(|r| r.split(" (").next());
        PathBuf::from(path.unwrap_or_default())
    };
    let (p1, p2) = (arena_of(&daemons[0].0), arena_of(&daemons[1].0));
    assert_ne!(p1, p2, "each runtime dir has its own arena");
    assert!(
        p1.starts_with("/dev/shm") || p1.starts_with(dir.path()),
        "{}",
        p1.display()
    );
    // The same page hashes with different bytes in each: each daemon serves its own.
    let hs = hashes(500, 64);
    let clients: Vec<Client> = daemons
        .iter()
        .map(|(d, salt)| {
            let c = d.client("rt", small_spec()).unwrap();
            store(&c, &small_spec(), &hs, *salt);
            c
        })
        .collect();
    for (c, (_, salt)) in clients.iter().zip(&daemons) {
        assert_eq!(load_verified(c, &small_spec(), &hs, *salt), 64);
    }
    drop(clients);
    for (mut d, _) in daemons {
        d.stop(libc::SIGTERM);
    }
    for p in [p1, p2] {
        if p.starts_with("/dev/shm")
            && let Some(parent) = p.parent()
        {
            let _ = std::fs::remove_dir_all(parent);
        }
    }
}

#[test]
fn files_and_directories_are_private_and_a_planted_symlink_is_never_followed() {
    let dir = tempdir();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    chmod(&state, 0o700);
    // Planted: the arena and the manifest's temporary file point at files of value.
    let victim = dir.path().join("victim");
    let victim_tmp = dir.path().join("victim-tmp");
    std::fs::write(&victim, b"precious").unwrap();
    std::fs::write(&victim_tmp, b"precious too").unwrap();
    std::os::unix::fs::symlink(&victim, state.join("arena")).unwrap();
    std::os::unix::fs::symlink(&victim_tmp, state.join("arena.tmp")).unwrap();
    let run = dir.path().join("run/kvtier.sock");
    let arena = state.join("arena");
    let args = [
        "--socket",
        run.to_str().unwrap(),
        "--arena-path",
        arena.to_str().unwrap(),
        "--arena-bytes",
        "4194304",
        "--set",
        "pool_bytes=4194304",
    ];
    let mut d = spawn(dir.path(), "p", &run, &args, &[]).ready();
    let c = d.client("p", small_spec()).unwrap();
    let hs = hashes(700, 16);
    store(&c, &small_spec(), &hs, 3);
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        b"precious",
        "the arena symlink was not followed"
    );
    assert_eq!(std::fs::read(&victim_tmp).unwrap(), b"precious too");
    assert_eq!(mode(&dir.path().join("run")), 0o700);
    assert_eq!(mode(&run), 0o600, "control socket");
    for f in ["arena", "arena.manifest", "arena.pool", "arena.lock", "arena.lookup"] {
        let p = state.join(f);
        let md = std::fs::symlink_metadata(&p).unwrap();
        assert!(md.file_type().is_file(), "{f} is a regular file");
        assert_eq!(md.mode() & 0o7777, 0o600, "{f}");
    }
    drop(c);
    d.stop(libc::SIGTERM);
    // A manifest replaced by a symlink is refused at start, naming it, and not followed.
    let victim_m = dir.path().join("victim-m");
    std::fs::write(&victim_m, b"keep me").unwrap();
    std::fs::remove_file(state.join("arena.manifest")).unwrap();
    std::os::unix::fs::symlink(&victim_m, state.join("arena.manifest")).unwrap();
    let again = spawn(dir.path(), "p2", &run, &args, &[]);
    let (failed, log) = again.refused();
    assert!(
        failed && log.contains("arena.manifest") && log.contains("symbolic link"),
        "{log}"
    );
    assert_eq!(std::fs::read(&victim_m).unwrap(), b"keep me");
}

#[test]
fn another_users_loose_directory_and_file_are_refused() {
    if !require("root", "chowns a directory to uid 65534") {
        return;
    }
    let dir = tempdir();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    chmod(&shared, 0o1777);
    let evil = shared.join("evil");
    // What another local user would leave in a shared directory: a 0777 directory and a
    // 0666 arena file.
    let made = Command::new("sh")
        .args(["-c", "mkdir -m 777 evil && : > evil/arena && chmod 666 evil/arena"])
        .current_dir(&shared)
        .uid(NOBODY)
        .gid(NOBODY)
        .status()
        .unwrap();
    assert!(made.success());
    let arena = evil.join("arena");
    let d = serve(
        dir.path(),
        "e",
        &["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "4194304"],
    );
    let (failed, log) = d.refused();
    assert!(failed, "{log}");
    assert!(
        log.contains(&evil.display().to_string()) && log.contains("uid 65534") && log.contains("777"),
        "the message names the directory, its owner and its mode: {log}"
    );
    assert_eq!(
        std::fs::metadata(&arena).unwrap().len(),
        0,
        "the planted file is untouched"
    );
}

#[test]
fn a_shared_sticky_cwd_with_another_users_kvtier_dir_is_refused() {
    if !require("root", "plants a directory as uid 65534") {
        return;
    }
    let dir = tempdir();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    chmod(&shared, 0o1777);
    let made = Command::new("mkdir")
        .args(["-m", "777", ".kvtier"])
        .current_dir(&shared)
        .uid(NOBODY)
        .gid(NOBODY)
        .status()
        .unwrap();
    assert!(made.success());
    let arena = dir.path().join("own/arena");
    let socket = shared.join(".kvtier/kvtier.sock");
    // No XDG_RUNTIME_DIR, and the shared directory as the working directory.
    let args = ["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "4194304"];
    let start = |name: &str| {
        spawn_in(
            dir.path(),
            name,
            &socket,
            &args,
            &[("XDG_RUNTIME_DIR", None)],
            Some(&shared),
        )
    };
    let (failed, log) = start("s1").refused();
    assert!(failed, "{log}");
    assert!(log.contains(".kvtier") && log.contains("uid 65534"), "{log}");
    assert!(!socket.exists(), "nothing was bound in the other user's directory");
    // Without the planted directory, the daemon makes its own, private.
    std::fs::remove_dir(shared.join(".kvtier")).unwrap();
    let mut ok = start("s2").ready();
    assert_eq!(mode(&shared.join(".kvtier")), 0o700);
    assert_eq!(std::fs::metadata(shared.join(".kvtier")).unwrap().uid(), 0);
    ok.stop(libc::SIGTERM);
}

/// Run as uid 65534 by [`the_control_socket_serves_only_allowed_peers`]: pings the socket
/// named in `KVTIER_TEST_PEER_SOCKET` and prints what came back. Does nothing otherwise.
#[test]
fn peer_helper_process() {
    let Some(socket) = std::env::var_os("KVTIER_TEST_PEER_SOCKET") else {
        return;
    };
    let answer = match UnixStream::connect(&socket) {
        Err(e) => format!("connect-failed {e}"),
        Ok(mut s) => {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut ping = Vec::new();
            Request::Ping {
                payload: b"who".to_vec(),
            }
            .encode(1, &mut ping);
            let _ = s.write_all(&ping);
            let mut body = Vec::new();
            match read_frame(&mut s, 1 << 20, &mut body)
                .ok()
                .and_then(|h| Response::decode(h.kind, &body).ok())
            {
                Some(Response::Pong { payload }) => format!("pong {}", String::from_utf8_lossy(&payload)),
                Some(Response::Error(e)) => format!("error {:?} {}", e.code, e.message),
                other => format!("other {other:?}"),
            }
        }
    };
    println!("PEER-ANSWER: {answer}");
}

/// Runs this test binary's `helper` test as uid 65534 (primary group 65534) with `env`,
/// and returns what it printed after `PEER-ANSWER: `.
fn as_nobody(helper: &str, env: &[(&str, &std::ffi::OsStr)]) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([helper, "--exact", "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .find_map(|l| l.split_once("PEER-ANSWER: "))
        .map(|(_, a)| a.to_owned())
        .unwrap_or_else(|| format!("no answer: {text} {}", String::from_utf8_lossy(&out.stderr)))
}

/// What uid 65534 gets from the control socket at `socket`.
fn ping_as_nobody(socket: &Path) -> String {
    as_nobody(
        "peer_helper_process",
        &[("KVTIER_TEST_PEER_SOCKET", socket.as_os_str())],
    )
}

#[test]
fn the_control_socket_serves_only_allowed_peers() {
    if !require("root", "connects as uid 65534") {
        return;
    }
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let base = ["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "4194304"];
    // The file mode lets anyone connect: the peer check alone keeps uid 65534 out.
    let mut d = serve(dir.path(), "c", &[&base[..], &["--set", "socket_mode=0o666"]].concat()).ready();
    assert_eq!(mode(&dir.path().join("c.sock")), 0o666);
    let a = ping_as_nobody(&d.socket);
    assert!(a.starts_with("error BadRequest") && a.contains("uid 65534"), "{a}");
    // The owner (root here) is served.
    let mut s = UnixStream::connect(&d.socket).unwrap();
    let mut ping = Vec::new();
    Request::Ping {
        payload: b"me".to_vec(),
    }
    .encode(1, &mut ping);
    s.write_all(&ping).unwrap();
    assert_eq!(
        common::answer(&mut s),
        Some(Response::Pong {
            payload: b"me".to_vec()
        })
    );
    d.stop(libc::SIGTERM);
    // Allowed by uid.
    let mut d = serve(
        dir.path(),
        "c",
        &[
            &base[..],
            &["--set", "socket_mode=0o666", "--set", "allow_uids=[65534]"],
        ]
        .concat(),
    )
    .ready();
    assert_eq!(ping_as_nobody(&d.socket), "pong who");
    d.stop(libc::SIGTERM);
    // Allowed by the socket's group, which the mode opens to.
    let d = serve(
        dir.path(),
        "c",
        &[
            &base[..],
            &["--set", "socket_mode=0o660", "--set", "socket_group=65534"],
        ]
        .concat(),
    )
    .ready();
    let md = std::fs::metadata(&d.socket).unwrap();
    assert_eq!((md.mode() & 0o777, md.gid()), (0o660, NOBODY));
    assert_eq!(ping_as_nobody(&d.socket), "pong who");
    // An unknown group is refused at start.
    let (failed, log) = serve(
        dir.path(),
        "g",
        &[&base[..], &["--set", "socket_group=no-such-group-kvtier"]].concat(),
    )
    .refused();
    assert!(failed && log.contains("no-such-group-kvtier"), "{log}");
}

/// Run as uid 65534 by [`an_engine_of_another_uid_maps_the_arena_only_with_engine_group`]:
/// connects to `KVTIER_TEST_ENGINE_SOCKET` as a one-rank engine, stores 16 pages with
/// bytes from `KVTIER_TEST_ENGINE_SALT`, loads them back into a fresh device and checks
/// every byte, and prints what happened. Does nothing otherwise.
#[test]
fn engine_helper_process() {
    let Some(socket) = std::env::var_os("KVTIER_TEST_ENGINE_SOCKET") else {
        return;
    };
    let salt: u64 = std::env::var("KVTIER_TEST_ENGINE_SALT").unwrap().parse().unwrap();
    let mut id = common::identity("other-uid", 0, 0, 1, 1);
    id.namespace = kvtier::page::Namespace::model("other-uid");
    let cfg = kvtier::client::ClientConfig::new(Path::new(&socket), id, small_spec())
        .with_timeout(Duration::from_secs(10))
        .with_daemon_uid(0);
    match Client::connect(cfg) {
        Err(e) => println!("PEER-ANSWER: refused {e}"),
        Ok(c) => {
            let hs = hashes(4200, 16);
            store(&c, &small_spec(), &hs, salt);
            let n = load_verified(&c, &small_spec(), &hs, salt);
            // SAFETY: geteuid has no preconditions and cannot fail.
            let uid = unsafe { libc::geteuid() };
            // Its lookups are answered in this process from the daemon's lookup file, which
            // it may read and never write.
            let found = c.lookup(&hs).map(|h| h.total()).unwrap_or(0);
            let local = c.engine_lookups().answered();
            let lookup_file = format!("{}.lookup", c.arena().unwrap().path);
            let writable = std::fs::OpenOptions::new().write(true).open(&lookup_file).is_ok();
            println!(
                "PEER-ANSWER: stored 16, loaded {n} intact as uid {uid}; looked up {found} in the engine ({local}), lookup file writable: {writable}"
            );
        }
    }
}

/// What an engine running as uid 65534 (primary group 65534) reports against `socket`.
fn engine_as_nobody(socket: &Path, salt: u64) -> String {
    let salt = salt.to_string();
    as_nobody(
        "engine_helper_process",
        &[
            ("KVTIER_TEST_ENGINE_SOCKET", socket.as_os_str()),
            ("KVTIER_TEST_ENGINE_SALT", salt.as_ref()),
        ],
    )
}

#[test]
fn an_engine_of_another_uid_maps_the_arena_only_with_engine_group() {
    if !require("root", "runs an engine as uid 65534") {
        return;
    }
    let dir = tempdir();
    let arena = dir.path().join("shared/arena");
    let args = [
        "--arena-path",
        arena.to_str().unwrap(),
        "--arena-bytes",
        "4194304",
        "--set",
        "engine_group=65534",
    ];
    let d = serve(dir.path(), "eg", &args).ready();
    // The arena and its directory open to the group; the socket too; the rest stays private.
    let md = |p: &Path| std::fs::metadata(p).unwrap();
    assert_eq!((mode(&arena), md(&arena).gid()), (0o660, NOBODY), "arena");
    let shared = dir.path().join("shared");
    assert_eq!((mode(&shared), md(&shared).gid()), (0o750, NOBODY), "arena directory");
    assert_eq!(
        (mode(&d.socket), md(&d.socket).gid()),
        (0o660, NOBODY),
        "control socket"
    );
    assert!(
        d.banner().contains("mode 0660 for access.engine_group 65534"),
        "{}",
        d.banner()
    );
    let answer = engine_as_nobody(&d.socket, 11);
    assert_eq!(
        answer,
        "stored 16, loaded 16 intact as uid 65534; looked up 16 in the engine (1), lookup file writable: false"
    );
    // The lookup file: the group reads it, only the daemon writes it.
    let lookup = dir.path().join("shared/arena.lookup");
    assert_eq!((mode(&lookup), md(&lookup).gid()), (0o640, NOBODY), "lookup file");
    for f in ["arena.manifest", "arena.lock"] {
        assert_eq!(mode(&shared.join(f)), 0o600, "{f}");
    }
    // The bytes uid 65534 wrote are in the daemon's arena: a rank of the daemon's own uid
    // of the same model loads them, every byte as written.
    let root = d.client("other-uid", small_spec()).unwrap();
    assert_eq!(load_verified(&root, &small_spec(), &hashes(4200, 16), 11), 16);
    drop(root);
    drop(d);

    // Without engine_group, an engine of another uid that the socket lets in still cannot
    // map the arena: a clear refusal naming the key, and the daemon serves others on.
    let arena = dir.path().join("private/arena");
    let d = serve(
        dir.path(),
        "np",
        &[
            "--arena-path",
            arena.to_str().unwrap(),
            "--arena-bytes",
            "4194304",
            "--set",
            "socket_mode=0o666",
            "--set",
            "allow_uids=[65534]",
        ],
    )
    .ready();
    assert_eq!(mode(&arena), 0o600);
    assert_eq!(mode(&dir.path().join("private")), 0o700);
    let answer = engine_as_nobody(&d.socket, 12);
    assert!(
        answer.starts_with("refused")
            && answer.contains(&arena.display().to_string())
            && answer.contains("permission denied for uid 65534")
            && answer.contains("engine_group"),
        "{answer}"
    );
    let own = d.client("own", small_spec()).unwrap();
    store(&own, &small_spec(), &hashes(4300, 8), 13);
    assert_eq!(load_verified(&own, &small_spec(), &hashes(4300, 8), 13), 8);
}
