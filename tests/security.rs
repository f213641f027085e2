//! Issue 15's safety cases, through real `kvtier serve` processes: one owner per arena,
//! private directories and files (never a planted symlink, never another user's
//! directory), the control socket's peer check, slot size and arena size as
//! configuration, and a manifest read record by record. The two-user cases switch to uid
//! 65534 (`nobody`) and need root: they skip loudly without it, and fail where
//! `KVTIER_REQUIRE` lists `root`.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::require::require;
use common::{hashes, identity, kvtier_bin, seed, small_spec};
use kvtier::client::{Client, ClientConfig, ClientError};
use kvtier::layout::LayoutSpec;
use kvtier::page::PageHash;
use kvtier::protocol::{ErrorCode, LoadWait, Request, Response, read_frame};
use kvtier::tier::device::EmulatedDevice;

const NOBODY: u32 = 65534;

/// One `kvtier serve` process with its stdout (the banner) and stderr (the log) in files.
struct Serve {
    child: Option<Child>,
    socket: PathBuf,
    out: PathBuf,
    err: PathBuf,
}

/// Starts `kvtier serve` with `args` (flags), no event publishers and no pool unless the
/// args say otherwise, and `env` on top of the test's environment.
fn spawn(dir: &Path, name: &str, socket: &Path, args: &[&str], env: &[(&str, Option<&str>)]) -> Serve {
    let out = dir.join(format!("{name}.out"));
    let err = dir.join(format!("{name}.err"));
    let mut cmd = Command::new(kvtier_bin());
    cmd.arg("serve");
    for kv in [
        "lock_arena=false",
        "prefault=false",
        "pool_bytes=0",
        "events_endpoint=",
        "events_replay_endpoint=",
        "pool_events_endpoint=",
    ] {
        cmd.args(["--set", kv]);
    }
    cmd.args(args)
        .env("RUST_LOG", "info")
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .stdin(Stdio::null());
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    Serve {
        child: Some(cmd.spawn().unwrap()),
        socket: socket.to_owned(),
        out,
        err,
    }
}

/// A daemon with its control socket at `<dir>/<name>.sock`, its admin socket beside it,
/// and `args` added.
fn serve(dir: &Path, name: &str, args: &[&str]) -> Serve {
    let socket = dir.join(format!("{name}.sock"));
    let admin = format!("admin_socket={}", dir.join(format!("{name}.admin.sock")).display());
    let mut all = vec!["--socket", socket.to_str().unwrap(), "--set", &admin];
    all.extend_from_slice(args);
    spawn(dir, name, &socket, &all, &[])
}

impl Serve {
    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits until the control socket answers; panics with the log if the daemon exits.
    fn ready(mut self) -> Self {
        let t = Instant::now();
        while UnixStream::connect(&self.socket).is_err() {
            let exited = self.child.as_mut().unwrap().try_wait().unwrap();
            assert!(exited.is_none(), "daemon exited ({exited:?}): {}", self.log());
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "daemon did not start: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        self
    }

    /// Waits for the daemon to exit by itself (a refused start); returns whether it
    /// failed, with its log.
    fn refused(mut self) -> (bool, String) {
        let mut c = self.child.take().unwrap();
        let t = Instant::now();
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                return (!status.success(), self.log());
            }
            if t.elapsed() > Duration::from_secs(15) {
                let _ = c.kill();
                let _ = c.wait();
                return (false, format!("still running after 15 s: {}", self.log()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn stop(&mut self, sig: i32) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(c.id() as i32, sig) };
            let t = Instant::now();
            while c.try_wait().unwrap().is_none() {
                assert!(t.elapsed() < Duration::from_secs(15), "daemon did not exit");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    fn banner(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// A single-rank client; its instance name is also its model's name.
    fn client(&self, instance: &str, layout: LayoutSpec) -> Result<Client, ClientError> {
        let mut id = identity(instance, 0, 0, 1, 1);
        id.namespace = kvtier::page::Namespace::model(instance);
        Client::connect(ClientConfig::new(&self.socket, id, layout).with_timeout(Duration::from_secs(10)))
    }

    /// `GET path` on the admin socket beside the control socket: the whole answer.
    fn admin_get(&self, path: &str) -> String {
        let admin = self.socket.with_extension("admin.sock");
        let mut s = UnixStream::connect(admin).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: kvtier\r\nConnection: close\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Stores `hs` as the only rank of `layout`, each page's bytes from [`seed`] and `salt`.
fn store(c: &Client, layout: &LayoutSpec, hs: &[PageHash], salt: u64) {
    let layout = layout.clone().build().unwrap();
    let dev = Arc::new(EmulatedDevice::new(&layout, 0, hs.len() as u32));
    c.register_device(dev.clone()).unwrap();
    for (i, h) in hs.iter().enumerate() {
        dev.fill_page(i as u32, seed(h, 0, 0) ^ salt).unwrap();
    }
    let slots: Vec<u32> = (0..hs.len() as u32).collect();
    let r = c.store(hs, &slots, "").unwrap();
    assert_eq!(r.complete as usize, hs.len(), "every page stored");
}

/// Loads `hs` into a fresh device and counts the leading pages loaded whose bytes are
/// exactly the ones stored with `salt`; panics on a loaded page with other bytes.
fn load_verified(c: &Client, layout: &LayoutSpec, hs: &[PageHash], salt: u64) -> usize {
    let layout = layout.clone().build().unwrap();
    let dev = Arc::new(EmulatedDevice::new(&layout, 0, hs.len() as u32));
    c.register_device(dev.clone()).unwrap();
    let slots: Vec<u32> = (0..hs.len() as u32).collect();
    let n = c.load(hs, &slots, LoadWait::BestEffort).unwrap();
    for (i, h) in hs[..n].iter().enumerate() {
        assert!(
            dev.page_matches(i as u32, seed(h, 0, 0) ^ salt).unwrap(),
            "page {i} loaded with wrong bytes"
        );
    }
    n
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

fn chmod(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

/// A directory tree the test owns (0755, so uid 65534 can reach sockets in it).
fn tempdir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    chmod(d.path(), 0o755);
    d
}

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
    for f in ["arena", "arena.manifest", "arena.pool", "arena.lock"] {
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
    let start = |name: &str| {
        let out = dir.path().join(format!("{name}.out"));
        let err = dir.path().join(format!("{name}.err"));
        let child = Command::new(kvtier_bin())
            .args([
                "serve",
                "--arena-path",
                arena.to_str().unwrap(),
                "--arena-bytes",
                "4194304",
            ])
            .args([
                "--set",
                "lock_arena=false",
                "--set",
                "prefault=false",
                "--set",
                "pool_bytes=0",
            ])
            .args([
                "--set",
                "events_endpoint=",
                "--set",
                "events_replay_endpoint=",
                "--set",
                "pool_events_endpoint=",
            ])
            .env_remove("XDG_RUNTIME_DIR")
            .env("RUST_LOG", "info")
            .current_dir(&shared)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        Serve {
            child: Some(child),
            socket: socket.clone(),
            out,
            err,
        }
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

/// What uid 65534 gets from the control socket at `socket`.
fn ping_as_nobody(socket: &Path) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["peer_helper_process", "--exact", "--nocapture", "--test-threads=1"])
        .env("KVTIER_TEST_PEER_SOCKET", socket)
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

#[test]
fn slot_size_is_configuration_not_the_first_layouts() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let base = ["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "4194304"];
    let tiny = small_spec();
    let fits = LayoutSpec::mha(8, 4, 16, 2, 4);
    let big = LayoutSpec::mha(16, 4, 16, 2, 4);
    let size = |l: &LayoutSpec| l.clone().build().unwrap().max_object_bytes();
    assert_eq!((size(&tiny), size(&fits), size(&big)), (128, 4096, 8192));

    let mut d = serve(dir.path(), "s", &[&base[..], &["--set", "slot_bytes=4096"]].concat()).ready();
    // The tiny layout connects first; it does not decide the slot size.
    let c = d.client("tiny", tiny.clone()).unwrap();
    assert_eq!(c.arena().unwrap().slot_bytes, 4096);
    let f = d.client("fits", fits.clone()).unwrap();
    let hs = hashes(900, 8);
    store(&f, &fits, &hs, 9);
    assert_eq!(load_verified(&f, &fits, &hs, 9), 8);
    match d.client("big", big.clone()) {
        Err(ClientError::Remote(e)) => {
            assert_eq!(e.code, ErrorCode::BadLayout);
            assert!(
                e.message.contains("8192") && e.message.contains("4096"),
                "{}",
                e.message
            );
        }
        other => panic!("a layout over the slot size must be refused: {:?}", other.err()),
    }
    drop((c, f));
    d.stop(libc::SIGTERM);
    // A restart with a larger configured size serves the larger layout.
    let d = serve(dir.path(), "s", &[&base[..], &["--set", "slot_bytes=8192"]].concat()).ready();
    let b = d.client("big", big.clone()).unwrap();
    assert_eq!(b.arena().unwrap().slot_bytes, 8192);
    store(&b, &big, &hs, 10);
    assert_eq!(load_verified(&b, &big, &hs, 10), 8);
    assert!(d.log().contains("differs from the arena's"), "{}", d.log());
}

#[test]
fn arena_bytes_is_honoured_on_recovery_and_a_truncated_arena_is_detected() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let start = |bytes: u64| {
        let b = bytes.to_string();
        serve(
            dir.path(),
            "r",
            &[
                "--arena-path",
                arena.to_str().unwrap(),
                "--arena-bytes",
                &b,
                "--set",
                "slot_bytes=65536",
            ],
        )
        .ready()
    };
    // 2 MiB: 32 slots of 64 KiB; 15 pages of two objects fill 30, below the watermark.
    let mut d = start(2 << 20);
    let c = d.client("r", small_spec()).unwrap();
    let hs = hashes(40, 15);
    store(&c, &small_spec(), &hs, 5);
    d.stop(libc::SIGKILL);

    // Restarted at 1 MiB: the old 2 MiB file is not adopted as it is.
    let mut d = start(1 << 20);
    assert_eq!(std::fs::metadata(&arena).unwrap().len(), 1 << 20);
    let s = c.stats().unwrap();
    assert_eq!(
        s.arena_slots, 16,
        "the banner and the arena agree on the configured size"
    );
    assert!(
        d.banner().contains("1 MiB in 16 slots of 65536 bytes"),
        "{}",
        d.banner()
    );
    // Pages take slots from 0 up, two a page: the first 8 pages fit, 7 were cut off.
    assert_eq!((s.recovered_pages, s.discarded_pages), (8, 7));
    assert_eq!(c.lookup(&hs).unwrap().host, 8);
    assert_eq!(load_verified(&c, &small_spec(), &hs, 5), 8);
    d.stop(libc::SIGKILL);

    // Truncated behind the daemon's back to 8 slots: detected, not served as zeros.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&arena)
        .unwrap()
        .set_len(512 << 10)
        .unwrap();
    let _d = start(1 << 20);
    assert_eq!(std::fs::metadata(&arena).unwrap().len(), 1 << 20);
    let s = c.stats().unwrap();
    assert_eq!((s.arena_slots, s.recovered_pages, s.discarded_pages), (16, 4, 4));
    assert_eq!(load_verified(&c, &small_spec(), &hs, 5), 4);
    assert!(_d.log().contains("did not have the configured size"), "{}", _d.log());
}

/// The object records of a `KVTMANI2` manifest: (offset of the body, body length).
fn object_records(bytes: &[u8]) -> Vec<(usize, usize)> {
    assert_eq!(&bytes[..8], b"KVTMANI2");
    let mut at = 16;
    let mut out = Vec::new();
    while at + 16 <= bytes.len() {
        assert_eq!(&bytes[at..at + 4], b"KVR2");
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        if bytes[at + 16] == 2 {
            out.push((at + 16, len));
        }
        at += 16 + len;
    }
    out
}

#[test]
fn a_bad_manifest_record_costs_that_record_only_and_garbage_is_reported() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let manifest = dir.path().join("state/arena.manifest");
    let start = || {
        serve(
            dir.path(),
            "m",
            &["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "4194304"],
        )
        .ready()
    };
    let mut d = start();
    let c = d.client("m", small_spec()).unwrap();
    let hs = hashes(3000, 40);
    store(&c, &small_spec(), &hs, 7);
    d.stop(libc::SIGTERM); // compacts: one record per object

    let mut bytes = std::fs::read(&manifest).unwrap();
    let objects = object_records(&bytes);
    assert_eq!(objects.len(), 80, "40 pages of two objects");
    let (body, len) = objects[21];
    bytes[body + len - 1] ^= 0x5a; // a record in the middle, its checksum no longer holds
    std::fs::write(&manifest, &bytes).unwrap();

    let mut d = start();
    let s = c.stats().unwrap();
    assert_eq!(
        (s.recovered_pages, s.discarded_pages),
        (39, 1),
        "one bad record costs one page"
    );
    let on_host: Vec<&PageHash> = hs.iter().filter(|h| c.lookup(&[**h]).unwrap().host == 1).collect();
    assert_eq!(on_host.len(), 39);
    for h in on_host {
        assert_eq!(load_verified(&c, &small_spec(), &[*h], 7), 1);
    }
    assert!(d.log().contains("manifest records failed their checks"), "{}", d.log());
    let metrics = d.admin_get("/metrics");
    assert!(
        metrics.contains("kvtier_recovery_total{reason=\"bad_manifest_record\"} 1")
            && metrics.contains("kvtier_recovery_total{reason=\"recovered\"} 39")
            && metrics.contains("kvtier_recovery_total{reason=\"incomplete\"} 1"),
        "{metrics}"
    );
    d.stop(libc::SIGTERM);

    // A manifest that is not one at all is reported, not taken for an empty one.
    std::fs::write(&manifest, vec![0xa5u8; 4096]).unwrap();
    let d = start();
    assert_eq!(c.stats().unwrap().recovered_pages, 0);
    assert!(d.log().contains("not a kvtier manifest"), "{}", d.log());
    assert!(d.banner().contains("manifest unreadable"), "{}", d.banner());
    let metrics = d.admin_get("/metrics");
    assert!(
        metrics.contains("kvtier_recovery_total{reason=\"garbage_manifest\"} 1"),
        "{metrics}"
    );
}
