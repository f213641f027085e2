//! Reclaiming the arenas of daemons whose runtime directory is gone.
//!
//! A daemon with the default arena path keeps its arena, manifest and local pool in
//! `/dev/shm/kvtier-<uid>/rt-<hash>/`, where the hash is that of its control socket's
//! directory, and writes that directory's path into `runtime` there
//! ([`mark_runtime_dir`]). A daemon that was killed leaves about an arena's size of RAM
//! behind; once its runtime directory no longer exists, nothing can reach that arena
//! again. At start, [`reclaim`] removes such arenas under the same rules as the Mooncake
//! run directories: only directories of kvtier's naming (`rt-` and 16 hex digits, the
//! hash of the path the marker names), owned by the daemon's uid, never a symlink, whose
//! owner lock no live daemon holds; only the files kvtier puts there, each a regular file
//! of the daemon's uid. Directories named by an `instance` are the operator's and are
//! never reclaimed.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::tier::private::{self, OwnerLock, PrivateError};

/// The marker file naming the runtime directory an arena belongs to.
pub const MARKER: &str = "runtime";
/// What a daemon keeps in its arena directory besides the marker (the lock goes last).
const FILES: [&str; 9] = [
    "arena",
    "arena.fence",
    "arena.stamps",
    "arena.lookup",
    "arena.manifest",
    "arena.manifest.tmp",
    "arena.pool",
    "arena.pool.slots",
    "arena.lock",
];

/// An arena directory that was reclaimed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reclaimed {
    pub dir: PathBuf,
    /// The runtime directory that no longer exists.
    pub runtime: PathBuf,
    pub bytes: u64,
}

/// Writes the marker of `arena_dir`: the absolute path of `runtime_dir`. The directory
/// is the daemon's own (private, checked before); the file is created afresh, never
/// followed through a symlink.
pub fn mark_runtime_dir(arena_dir: &Path, runtime_dir: &Path) -> Result<(), PrivateError> {
    let abs = std::path::absolute(runtime_dir).unwrap_or_else(|_| runtime_dir.to_owned());
    let marker = arena_dir.join(MARKER);
    let mut f = private::replace(&marker)?;
    std::io::Write::write_all(&mut f, abs.as_os_str().as_encoded_bytes()).map_err(|source| PrivateError::Io {
        path: marker.clone(),
        source,
    })
}

/// The name kvtier gives the arena directory of a daemon whose socket is in `runtime_dir`
/// (see [`crate::daemon::config::default_arena_path`]).
pub fn dir_name(runtime_dir: &Path) -> String {
    let h = xxhash_rust::xxh3::xxh3_64(runtime_dir.as_os_str().as_encoded_bytes());
    format!("rt-{h:016x}")
}

fn kvtier_named(name: &str) -> bool {
    name.strip_prefix("rt-")
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A regular file of `uid` (not a symlink, not a FIFO): its size.
fn owned_file(path: &Path, uid: u32) -> Option<u64> {
    let md = std::fs::symlink_metadata(path).ok()?;
    (md.file_type().is_file() && md.uid() == uid).then_some(md.len())
}

/// Reclaims every orphaned arena directory in `base` (`/dev/shm/kvtier-<uid>`) but `own`
/// (this daemon's), logging each. See the module docs for the rules.
pub fn reclaim(base: &Path, own: &Path) -> Vec<Reclaimed> {
    let uid = private::euid();
    let Ok(entries) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let dir = e.path();
        let name = e.file_name();
        let Some(name) = name.to_str().filter(|n| kvtier_named(n)) else {
            continue;
        };
        if dir == own {
            continue;
        }
        let Ok(md) = std::fs::symlink_metadata(&dir) else {
            continue;
        };
        if !md.file_type().is_dir() || md.uid() != uid || md.mode() & 0o002 != 0 {
            continue;
        }
        let marker = dir.join(MARKER);
        if owned_file(&marker, uid).is_none_or(|len| len > 4096) {
            continue;
        }
        let Ok(runtime) = std::fs::read(&marker) else { continue };
        let runtime = PathBuf::from(String::from_utf8_lossy(&runtime).into_owned());
        if dir_name(&runtime) != name || !runtime.is_absolute() {
            continue;
        }
        match std::fs::symlink_metadata(&runtime) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            _ => continue,
        }
        // A daemon still running holds the lock (its runtime directory was removed under
        // it): its arena is in use.
        let lock = match OwnerLock::acquire(&dir.join("arena")) {
            Ok(l) => l,
            Err(_) => continue,
        };
        let mut bytes = 0;
        for f in FILES.iter().chain([&MARKER]) {
            let p = dir.join(f);
            if let Some(len) = owned_file(&p, uid)
                && std::fs::remove_file(&p).is_ok()
            {
                bytes += len;
            }
        }
        drop(lock);
        let removed = std::fs::remove_dir(&dir).is_ok();
        tracing::info!(
            dir = %dir.display(),
            runtime = %runtime.display(),
            bytes,
            dir_removed = removed,
            "reclaimed the arena of a daemon whose runtime directory is gone"
        );
        out.push(Reclaimed { dir, runtime, bytes });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn arena_dir(base: &Path, runtime: &Path) -> PathBuf {
        let d = base.join(dir_name(runtime));
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(d.join("arena"), vec![1u8; 8192]).unwrap();
        std::fs::write(d.join("arena.pool"), vec![1u8; 4096]).unwrap();
        mark_runtime_dir(&d, runtime).unwrap();
        d
    }

    #[test]
    fn only_unlocked_arenas_of_missing_runtime_dirs_of_our_naming_are_reclaimed() {
        let base = tempfile::tempdir().unwrap();
        let rt = tempfile::tempdir().unwrap();
        let alive_rt = rt.path().join("alive");
        std::fs::create_dir(&alive_rt).unwrap();
        let gone_rt = rt.path().join("gone");
        let gone = arena_dir(base.path(), &gone_rt);
        let alive = arena_dir(base.path(), &alive_rt);
        let locked_rt = rt.path().join("locked");
        let locked = arena_dir(base.path(), &locked_rt);
        let held = OwnerLock::acquire(&locked.join("arena")).unwrap();
        // An operator's instance directory, and a marker naming a path of another hash.
        let instance = base.path().join("prod");
        std::fs::create_dir(&instance).unwrap();
        mark_runtime_dir(&instance, &gone_rt).unwrap();
        let wrong = base.path().join(dir_name(&rt.path().join("other")));
        std::fs::create_dir(&wrong).unwrap();
        mark_runtime_dir(&wrong, &gone_rt).unwrap();
        // A symlink of our naming to a directory that would qualify.
        let target = tempfile::tempdir().unwrap();
        let linked_rt = rt.path().join("linked");
        let real = arena_dir(target.path(), &linked_rt);
        std::os::unix::fs::symlink(&real, base.path().join(dir_name(&linked_rt))).unwrap();
        let own_rt = rt.path().join("own");
        let own = arena_dir(base.path(), &own_rt);

        let got = reclaim(base.path(), &own);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((&got[0].dir, &got[0].runtime), (&gone, &gone_rt));
        assert!(got[0].bytes >= 8192 + 4096, "{}", got[0].bytes);
        assert!(!gone.exists(), "the orphan's directory is gone");
        for kept in [&alive, &locked, &instance, &wrong, &own] {
            assert!(kept.join(MARKER).exists(), "{} kept", kept.display());
        }
        assert!(real.join("arena").exists(), "a symlink is never followed");
        drop(held);
        // Unlocked now, the locked one's runtime dir is missing too: reclaimed next time.
        let got = reclaim(base.path(), &own);
        assert_eq!(got.iter().map(|r| r.dir.clone()).collect::<Vec<_>>(), vec![locked]);
    }
}
