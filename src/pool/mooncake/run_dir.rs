//! The helper's run directory when the configuration names none: a fresh directory in
//! `/dev/shm` (or the temp dir) named after the daemon's pid, and the sweep that removes
//! the ones daemons left behind when they were killed before `Drop` could run.
//!
//! Each run directory holds the staging region (64 MiB by default) in shared memory, so a
//! crashed daemon's leftovers are memory the node no longer has; a killed daemon can't
//! clean up after itself, the next one on the node does. Only directories whose pid is
//! gone and that belong to this user are removed; a reused pid keeps its directory
//! (removed the next time round, once that process is gone too).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

const PREFIX: &str = "kvtier-mooncake-";
static RUN_SEQ: AtomicU64 = AtomicU64::new(0);

/// Where run directories go: `/dev/shm` where it exists, else the temp dir.
pub(super) fn base() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// A run directory name no other pool of this process or a live daemon uses.
pub(super) fn fresh(base: &Path) -> PathBuf {
    let seq = RUN_SEQ.fetch_add(1, Ordering::Relaxed);
    base.join(format!("{PREFIX}{}-{seq}", std::process::id()))
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

/// The pid in `kvtier-mooncake-{pid}-{seq}`, or `None` for any other name.
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
        assert_eq!(owner_pid("kvtier-mooncake-4242-0"), Some(4242));
        assert_eq!(owner_pid("kvtier-mooncake-4242-17"), Some(4242));
        assert_eq!(owner_pid("kvtier-mooncake-4242"), None);
        assert_eq!(owner_pid("kvtier-mooncake-x-0"), None);
        assert_eq!(owner_pid("kvtier-mooncake-0-0"), None);
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
        let live = fresh(base.path());
        std::fs::create_dir(&live).unwrap();
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
}
