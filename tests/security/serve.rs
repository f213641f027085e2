//! `kvtier serve` as a process for the security and recovery tests: flags, banner and
//! log in files, readiness, refusals, signals, the admin socket, and pages stored and
//! loaded with their bytes checked.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{identity, kvtier_bin, seed};
use kvtier::client::{Client, ClientConfig, ClientError};
use kvtier::layout::LayoutSpec;
use kvtier::page::PageHash;
use kvtier::protocol::LoadWait;
use kvtier::tier::device::EmulatedDevice;

/// One `kvtier serve` process with its stdout (the banner) and stderr (the log) in files.
pub struct Serve {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub out: PathBuf,
    pub err: PathBuf,
}

/// Starts `kvtier serve` with `args` (flags), no event publishers and no pool unless the
/// args say otherwise, slots of 2 KiB for the small layouts these tests store (a test's
/// own `--set slot_bytes` wins), and `env` on top of the test's environment.
pub fn spawn(dir: &Path, name: &str, socket: &Path, args: &[&str], env: &[(&str, Option<&str>)]) -> Serve {
    spawn_in(dir, name, socket, args, env, None)
}

/// [`spawn`] with `cwd` as the daemon's working directory (where a default `.kvtier`
/// goes without `XDG_RUNTIME_DIR`).
pub fn spawn_in(
    dir: &Path,
    name: &str,
    socket: &Path,
    args: &[&str],
    env: &[(&str, Option<&str>)],
    cwd: Option<&Path>,
) -> Serve {
    let mut all = vec!["--set", "slot_bytes=2048"];
    all.extend_from_slice(args);
    spawn_default_slots(dir, name, socket, &all, env, cwd)
}

/// [`spawn_in`] with the daemon's default slot size.
pub fn spawn_default_slots(
    dir: &Path,
    name: &str,
    socket: &Path,
    args: &[&str],
    env: &[(&str, Option<&str>)],
    cwd: Option<&Path>,
) -> Serve {
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
    if let Some(cwd) = cwd {
        cmd.current_dir(cwd);
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
pub fn serve(dir: &Path, name: &str, args: &[&str]) -> Serve {
    let mut all = vec!["--set", "slot_bytes=2048"];
    all.extend_from_slice(args);
    serve_default_slots(dir, name, &all)
}

/// [`serve`] with the daemon's default slot size.
pub fn serve_default_slots(dir: &Path, name: &str, args: &[&str]) -> Serve {
    let socket = dir.join(format!("{name}.sock"));
    let admin = format!("admin_socket={}", dir.join(format!("{name}.admin.sock")).display());
    let mut all = vec!["--socket", socket.to_str().unwrap(), "--set", &admin];
    all.extend_from_slice(args);
    spawn_default_slots(dir, name, &socket, &all, &[], None)
}

impl Serve {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits until the control socket answers; panics with the log if the daemon exits.
    pub fn ready(mut self) -> Self {
        let t = Instant::now();
        while !crate::common::serving(&self.socket) {
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
    pub fn refused(mut self) -> (bool, String) {
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

    pub fn stop(&mut self, sig: i32) {
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

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    pub fn banner(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// A single-rank client; its instance name is also its model's name.
    pub fn client(&self, instance: &str, layout: LayoutSpec) -> Result<Client, ClientError> {
        let mut id = identity(instance, 0, 0, 1, 1);
        id.namespace = kvtier::page::Namespace::model(instance);
        Client::connect(ClientConfig::new(&self.socket, id, layout).with_timeout(Duration::from_secs(10)))
    }

    /// `GET path` on the admin socket beside the control socket: the whole answer.
    pub fn admin_get(&self, path: &str) -> String {
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
pub fn store(c: &Client, layout: &LayoutSpec, hs: &[PageHash], salt: u64) {
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
pub fn load_verified(c: &Client, layout: &LayoutSpec, hs: &[PageHash], salt: u64) -> usize {
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

pub fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

pub fn chmod(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

/// A directory tree the test owns (0755, so uid 65534 can reach sockets in it).
pub fn tempdir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    chmod(d.path(), 0o755);
    d
}
