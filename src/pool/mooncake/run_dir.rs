//! The helper's run directory when the configuration names none: a fresh directory,
//! named after the daemon's pid, inside `kvtier-mooncake-<uid>` in `/dev/shm` (or the temp
//! dir), and the sweep that removes the ones daemons left behind when they were killed
//! before `Drop` could run.
//!
//! The run directory holds the script the daemon's own user executes, so nobody else may
//! plant or swap anything in it: the per-user parent is created `0700` or accepted only
//! when it is ours and private ([`private_dir`]), and each run directory is created
//! exclusively in it (`mkdir`, never "create or reuse") and checked after creation: a
//! directory, owned by the daemon's uid, mode `0700`, not a symlink.
//!
//! Each run directory holds the staging region (64 MiB by default) in shared memory, so a
//! crashed daemon's leftovers are memory the node no longer has; a killed daemon can't
//! clean up after itself, the next one on the node does. Only directories whose pid is
//! gone and that belong to this user are removed; a reused pid keeps its directory
//! (removed the next time round, once that process is gone too).

use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::tier::private::{PrivateError, euid, private_dir};

const PREFIX: &str = "run-";
static RUN_SEQ: AtomicU64 = AtomicU64::new(0);
/// Names tried before giving up on leftovers of earlier processes with our pid.
const ATTEMPTS: u32 = 64;

/// Where run directories go: `kvtier-mooncake-<uid>` in `/dev/shm` where it exists, else
/// in the temp dir; made private (created `0700`, or refused unless ours and private).
pub(super) fn base() -> Result<PathBuf, PrivateError> {
    let shm = Path::new("/dev/shm");
    let root = if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    };
    let dir = root.join(format!("kvtier-mooncake-{}", euid()));
    private_dir(&dir)?;
    Ok(dir)
}

/// Creates a fresh run directory in `base` (a private directory of ours): `mkdir` with mode
/// `0700` that fails on anything already there, then checked (a directory, ours, `0700`).
pub(super) fn fresh(base: &Path) -> Result<PathBuf, PrivateError> {
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let seq = RUN_SEQ.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!("{PREFIX}{}-{seq}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                check_fresh(&dir)?;
                return Ok(dir);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some((dir, e)),
            Err(source) => return Err(PrivateError::Io { path: dir, source }),
        }
    }
    let (path, source) = last.unwrap_or_else(|| (base.to_owned(), std::io::ErrorKind::AlreadyExists.into()));
    Err(PrivateError::Io { path, source })
}

/// What `mkdir` gave us is what we use: a directory (not a symlink), ours, `0700`.
fn check_fresh(dir: &Path) -> Result<(), PrivateError> {
    let md = std::fs::symlink_metadata(dir).map_err(|source| PrivateError::Io {
        path: dir.to_owned(),
        source,
    })?;
    if !md.file_type().is_dir() || md.uid() != euid() || md.mode() & 0o7777 != 0o700 {
        return Err(PrivateError::UnsafeDir {
            path: dir.to_owned(),
            owner: md.uid(),
            mode: md.mode() & 0o7777,
            uid: euid(),
        });
    }
    Ok(())
}

/// Removes run directories in `base` left by processes that no longer exist; returns how
/// many. Errors (a directory another user owns, a race with its owner) leave it be.
pub(super) fn sweep_stale(base: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(base) else {
        return 0;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(owner_pid) else {
            continue;
        };
        let Ok(meta) = e.metadata() else { continue };
        if !meta.is_dir() || meta.uid() != uid || alive(pid) {
            continue;
        }
        if std::fs::remove_dir_all(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The pid in `run-{pid}-{seq}`, or `None` for any other name.
fn owner_pid(name: &str) -> Option<libc::pid_t> {
    let (pid, seq) = name.strip_prefix(PREFIX)?.split_once('-')?;
    seq.parse::<u64>().ok()?;
    pid.parse().ok().filter(|p| *p > 0)
}

/// Whether a process with this pid exists (EPERM: it exists, as another user's).
fn alive(pid: libc::pid_t) -> bool {
    // SAFETY: signal 0 only checks that the pid can be signalled; nothing is sent.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_only_in_the_run_dir_form() {
        assert_eq!(owner_pid("run-4242-0"), Some(4242));
        assert_eq!(owner_pid("run-4242-17"), Some(4242));
        assert_eq!(owner_pid("run-4242"), None);
        assert_eq!(owner_pid("run-x-0"), None);
        assert_eq!(owner_pid("run-0-0"), None);
        assert_eq!(owner_pid("kvtier-0"), None);
    }

    #[test]
    fn sweep_removes_only_dead_owners_directories() {
        let base = tempfile::tempdir().unwrap();
        // A pid that existed and is gone: a child that has been waited for.
        let dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        let mut dead = dead;
        dead.wait().unwrap();
        let gone = base.path().join(format!("{PREFIX}{dead_pid}-3"));
        std::fs::create_dir(&gone).unwrap();
        std::fs::write(gone.join("staging"), vec![7u8; 4096]).unwrap();
        let live = fresh(base.path()).unwrap();
        let other = base.path().join("kvtier-0");
        std::fs::create_dir(&other).unwrap();
        let file = base.path().join(format!("{PREFIX}{dead_pid}-4"));
        std::fs::write(&file, b"not a dir").unwrap();

        assert_eq!(sweep_stale(base.path()), 1);
        assert!(!gone.exists());
        assert!(live.is_dir(), "this process's own run dir stays");
        assert!(other.is_dir(), "names of another form stay");
        assert!(file.is_file(), "plain files stay");
        assert_eq!(sweep_stale(base.path()), 0);
    }

    #[test]
    fn a_fresh_run_dir_is_never_one_that_was_there() {
        let base = tempfile::tempdir().unwrap();
        // Whatever sits under the next names (a directory, a symlink, a FIFO) is skipped,
        // never reused.
        let next = RUN_SEQ.load(Ordering::Relaxed);
        let pid = std::process::id();
        let planted = base.path().join(format!("{PREFIX}{pid}-{next}"));
        std::fs::create_dir(&planted).unwrap();
        std::os::unix::fs::symlink(&planted, base.path().join(format!("{PREFIX}{pid}-{}", next + 1))).unwrap();
        let dir = fresh(base.path()).unwrap();
        assert_ne!(dir, planted);
        let md = std::fs::symlink_metadata(&dir).unwrap();
        assert!(md.is_dir());
        assert_eq!(md.mode() & 0o7777, 0o700);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "a new, empty directory");
    }
}
