//! A real `kvtier serve` for benches that measure the daemon through its sockets.
//!
//! The daemon runs as a child process of this executable (its `serve` subcommand) on a
//! scratch directory, with its own control and admin sockets and no event publishers, so
//! what a bench measures is what engines and operators talk to, however the daemon is
//! built inside. Dropping the handle stops the child and removes the directory.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// How long the child may take to bind its sockets (arena mapping included).
const START_WAIT: Duration = Duration::from_secs(60);
/// How long the child may take to exit after SIGTERM before it is killed.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// A running daemon child.
pub struct DaemonChild {
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl DaemonChild {
    /// Starts `exe serve` with a host arena of `arena_bytes` in slots of `slot_bytes` and
    /// no pool, and waits until both sockets accept connections.
    pub fn start(exe: &Path, arena_bytes: u64, slot_bytes: u64) -> anyhow::Result<Self> {
        Self::start_with(exe, arena_bytes, slot_bytes, &["--set".into(), "pool.bytes=0".into()])
    }

    /// [`DaemonChild::start`] with `pool_args` (flags and `--set`s choosing the pool) in
    /// place of "no pool".
    pub fn start_with(exe: &Path, arena_bytes: u64, slot_bytes: u64, pool_args: &[String]) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("kvtier-bench-")
            .tempdir()
            .context("scratch directory")?;
        let quote = |p: PathBuf| format!("{:?}", p.display().to_string());
        let log = std::fs::File::create(dir.path().join("daemon.log"))?;
        let child = Command::new(exe)
            .arg("serve")
            .arg("--socket")
            .arg(dir.path().join("kvtier.sock"))
            .arg("--host-path")
            .arg(dir.path().join("arena"))
            .arg("--host-bytes")
            .arg(arena_bytes.to_string())
            .arg("--set")
            .arg(format!("host.slot_bytes={slot_bytes}"))
            .args(pool_args)
            .args(["--set", "host.recover=false"])
            .args(["--set", "host.lock=false", "--set", "events.endpoint=\"\""])
            .args([
                "--set",
                "events.replay_endpoint=\"\"",
                "--set",
                "events.pool_endpoint=\"\"",
            ])
            .arg("--set")
            .arg(format!("admin.socket={}", quote(dir.path().join("admin.sock"))))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} serve", exe.display()))?;
        let mut me = Self {
            child: Some(child),
            dir,
        };
        me.wait_ready()?;
        Ok(me)
    }

    /// The control socket engines connect to.
    /// The child's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("kvtier.sock")
    }

    /// The admin socket (HTTP/1.1).
    pub fn admin_socket(&self) -> PathBuf {
        self.dir.path().join("admin.sock")
    }

    /// A scratch path inside the daemon's directory, for the bench's own sockets.
    pub fn scratch(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_WAIT;
        loop {
            if UnixStream::connect(self.socket()).is_ok() && UnixStream::connect(self.admin_socket()).is_ok() {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("kvtier serve exited with {status} before serving: {}", self.log_tail());
            }
            if Instant::now() >= deadline {
                bail!(
                    "kvtier serve did not bind its sockets within {START_WAIT:?}: {}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default();
        let start = text.len().saturating_sub(2000);
        text.get(start..).unwrap_or_default().trim().to_owned()
    }
}

impl Drop for DaemonChild {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + STOP_WAIT;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// `GET path` over the admin socket with the CLI's admin client; returns the status code
/// and the length of the body (read whole, so the render is really done).
pub fn http_get(socket: &Path, path: &str, timeout: Duration) -> anyhow::Result<(u16, usize)> {
    let answer = crate::cli::client::request(socket, "GET", path, None, Some(timeout))?;
    let status = answer.status;
    Ok((status, answer.body()?.len()))
}
