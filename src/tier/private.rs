//! Private directories and files: where the daemon keeps what only it may touch.
//!
//! The host arena holds KV bytes derived from users' prompts, the manifest says which slot
//! holds which page, and the sockets decide who talks to the daemon. Each lives in a
//! directory that is created `0700`, or accepted only when it is owned by the daemon's
//! uid with no group or other permission bits ([`private_dir`], for the directories
//! kvtier names itself: the runtime directory's `kvtier`, `.kvtier`,
//! `/dev/shm/kvtier-<uid>/…`), and whose ancestors no other user can rename entries in
//! (owned by the daemon's uid or root, and not group/other-writable unless sticky). A
//! directory an operator chose explicitly ([`trusted_dir`]) may be readable by others
//! (a 0755 home or temporary directory) but never writable by them: nobody else can
//! plant or swap an entry in it, and the files inside are private themselves. Files are opened with `O_NOFOLLOW`, created `0600` with `O_EXCL`, and
//! an existing one is accepted only when it is a regular file owned by the daemon's uid
//! with no group or other permission bits. [`OwnerLock`] makes one daemon the only owner
//! of an arena for its whole life.
//!
//! Engines that run as another uid must map the host arena, so where an operator names a
//! group for them (`engine_group`), the arena file is `0660` with that group and the
//! directories kvtier names itself above it are `0750` with it ([`shared_dir`],
//! [`open_existing_shared`], [`share_file`]); a group's bits are accepted on an existing
//! directory or file only when its group is that one. Nothing else is ever shared.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Why a directory or file was refused.
#[derive(Debug, thiserror::Error)]
pub enum PrivateError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "directory {path} is owned by uid {owner} with mode {mode:o}; kvtier needs it owned by uid {uid} \
         with no group or other permissions (chmod 700 it, or remove it)"
    )]
    UnsafeDir {
        path: PathBuf,
        owner: u32,
        mode: u32,
        uid: u32,
    },
    #[error(
        "directory {path}, above {target}, is owned by uid {owner} with mode {mode:o}: another user could \
         replace what is inside it"
    )]
    UnsafeAncestor {
        path: PathBuf,
        target: PathBuf,
        owner: u32,
        mode: u32,
    },
    #[error(
        "file {path} is owned by uid {owner} with mode {mode:o}; kvtier needs a regular file owned by uid \
         {uid} with no group or other permissions"
    )]
    UnsafeFile {
        path: PathBuf,
        owner: u32,
        mode: u32,
        uid: u32,
    },
    #[error("{path} is a symbolic link or not a regular file; refusing to use it")]
    NotAFile { path: PathBuf },
    #[error("{path} is held by another kvtier daemon (pid {holder}); one daemon owns an arena at a time")]
    Locked { path: PathBuf, holder: String },
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> PrivateError + '_ {
    move |source| PrivateError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The uid the daemon's files belong to (its effective uid).
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Makes `dir` a private directory: creates it (and missing parents) `0700`, or accepts
/// an existing one only when it is owned by the daemon's uid with no group or other
/// permission bits. Every ancestor must be owned by the daemon's uid or root and not be
/// writable by group or others unless it is sticky (`/tmp`, `/dev/shm`). An empty path
/// means the working directory.
pub fn private_dir(dir: &Path) -> Result<(), PrivateError> {
    checked_dir(dir, 0o077)
}

/// Like [`private_dir`] for a directory engines of `group` must reach: created `0700`,
/// then given `group` and mode `0750` (its members may enter and list it, never create,
/// rename or remove an entry). An existing one is accepted when it is private, or owned
/// by the daemon's uid with group bits (never group write) and its group is `group`;
/// either way it leaves with `group` and `0750`. Without a group this is [`private_dir`].
pub fn shared_dir(dir: &Path, group: Option<u32>) -> Result<(), PrivateError> {
    let Some(gid) = group else {
        return private_dir(dir);
    };
    let ours = std::fs::metadata(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    })
    .is_ok_and(|md| md.gid() == gid);
    checked_dir(dir, if ours { 0o027 } else { 0o077 })?;
    // Group first, then the bits: no moment where another group may enter.
    std::os::unix::fs::chown(dir, None, Some(gid)).map_err(io(dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).map_err(io(dir))
}

/// Like [`private_dir`] for a directory an operator named explicitly: an existing one
/// may be readable and searchable by group and others, but not writable by them.
pub fn trusted_dir(dir: &Path) -> Result<(), PrivateError> {
    checked_dir(dir, 0o022)
}

/// Creates `dir` `0700`, or accepts it when owned by the daemon's uid with none of the
/// `refused` mode bits; then checks its ancestors.
fn checked_dir(dir: &Path, refused: u32) -> Result<(), PrivateError> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let uid = euid();
    match std::fs::symlink_metadata(dir) {
        Ok(md) if md.file_type().is_symlink() && md.uid() != uid && md.uid() != 0 => {
            return Err(PrivateError::UnsafeDir {
                path: dir.to_owned(),
                owner: md.uid(),
                mode: md.mode() & 0o7777,
                uid,
            });
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(dir))?,
        Err(e) => return Err(io(dir)(e)),
    }
    let md = std::fs::metadata(dir).map_err(io(dir))?;
    if !md.is_dir() || md.uid() != uid || md.mode() & refused != 0 {
        return Err(PrivateError::UnsafeDir {
            path: dir.to_owned(),
            owner: md.uid(),
            mode: md.mode() & 0o7777,
            uid,
        });
    }
    let real = std::fs::canonicalize(dir).map_err(io(dir))?;
    for up in real.ancestors().skip(1) {
        let md = std::fs::metadata(up).map_err(io(up))?;
        let sticky = md.mode() & libc::S_ISVTX != 0;
        if (md.uid() != uid && md.uid() != 0) || (md.mode() & 0o022 != 0 && !sticky) {
            return Err(PrivateError::UnsafeAncestor {
                path: up.to_owned(),
                target: dir.to_owned(),
                owner: md.uid(),
                mode: md.mode() & 0o7777,
            });
        }
    }
    Ok(())
}

/// The parent directory of a file path ("." for a bare name).
pub fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

fn options(write: bool) -> OpenOptions {
    let mut o = OpenOptions::new();
    o.read(true)
        .write(write)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    o
}

/// Checks an open file: a regular file owned by the daemon's uid with no group or other
/// permission bits; group bits too when its group is `group`.
fn check_owned(path: &Path, file: &File, group: Option<u32>) -> Result<(), PrivateError> {
    let md = file.metadata().map_err(io(path))?;
    let uid = euid();
    if !md.file_type().is_file() {
        return Err(PrivateError::NotAFile { path: path.to_owned() });
    }
    let refused = if group.is_some_and(|g| g == md.gid()) {
        0o007
    } else {
        0o077
    };
    if md.uid() != uid || md.mode() & refused != 0 {
        return Err(PrivateError::UnsafeFile {
            path: path.to_owned(),
            owner: md.uid(),
            mode: md.mode() & 0o7777,
            uid,
        });
    }
    Ok(())
}

fn nofollow(path: &Path) -> impl Fn(std::io::Error) -> PrivateError + '_ {
    // O_NOFOLLOW on a symlink fails with ELOOP: say what it is.
    move |e| match e.raw_os_error() {
        Some(libc::ELOOP) => PrivateError::NotAFile { path: path.to_owned() },
        _ => io(path)(e),
    }
}

/// Opens an existing private file for reading (and writing), never through a symlink,
/// and only when the daemon's uid owns it with no group or other permission bits.
/// `Ok(None)` when there is no file.
pub fn open_existing(path: &Path, write: bool) -> Result<Option<File>, PrivateError> {
    open_existing_shared(path, write, None)
}

/// [`open_existing`] for a file shared with `group` ([`share_file`]): group bits are
/// accepted too when the file's group is `group`.
pub fn open_existing_shared(path: &Path, write: bool, group: Option<u32>) -> Result<Option<File>, PrivateError> {
    match options(write).open(path) {
        Ok(f) => {
            check_owned(path, &f, group)?;
            Ok(Some(f))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(nofollow(path)(e)),
    }
}

/// Creates a new private file (`0600`, `O_EXCL`, `O_NOFOLLOW`) for reading and writing.
pub fn create_new(path: &Path) -> Result<File, PrivateError> {
    options(true).create_new(true).open(path).map_err(nofollow(path))
}

/// Opens a private file for appending, creating it `0600` when missing, never through a
/// symlink; an existing one only when the daemon's uid owns it with no group or other
/// permission bits. For files an operator names (a log), whose directory [`trusted_dir`]
/// has checked: nobody else can plant or swap an entry there between create and check.
pub fn open_append(path: &Path) -> Result<File, PrivateError> {
    let file = options(true)
        .append(true)
        .create(true)
        .open(path)
        .map_err(nofollow(path))?;
    check_owned(path, &file, None)?;
    Ok(file)
}

/// Gives an open file of the daemon's to `group` (`0660` with that group), or makes it
/// private again (`0600`) without one. The group is set before the mode opens to it.
pub fn share_file(path: &Path, file: &File, group: Option<u32>) -> Result<(), PrivateError> {
    share_as(path, file, group, 0o660)
}

/// Gives `file` to `group` with `group_mode` where one is set; `0600` otherwise.
fn share_as(path: &Path, file: &File, group: Option<u32>, group_mode: u32) -> Result<(), PrivateError> {
    if let Some(g) = group {
        std::os::unix::fs::fchown(file, None, Some(g)).map_err(io(path))?;
    }
    let mode = if group.is_some() { group_mode } else { 0o600 };
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(io(path))
}

/// Makes `file` (at `path`) readable by `group` where one is set, writable by its owner
/// alone: `0640`, or `0600` without a group.
pub fn share_read_only(path: &Path, file: &File, group: Option<u32>) -> Result<(), PrivateError> {
    share_as(path, file, group, 0o640)
}

/// Replaces whatever is at `path` with a new, empty private file. A symlink is removed,
/// never followed; a directory is refused. Processes that mapped the old file keep their
/// mapping of it, untouched.
pub fn replace(path: &Path) -> Result<File, PrivateError> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() || md.file_type().is_socket() => {
            return Err(PrivateError::NotAFile { path: path.to_owned() });
        }
        Ok(_) => std::fs::remove_file(path).map_err(io(path))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(path)(e)),
    }
    create_new(path)
}

/// An exclusive `flock` on `<path>.lock`, held for as long as the value lives: one
/// daemon owns an arena (and its manifest and pool beside it) at a time. The lock file
/// holds the owner's pid, for the refusal message of the next one to try.
#[derive(Debug)]
pub struct OwnerLock {
    path: PathBuf,
    _file: File,
}

impl OwnerLock {
    /// Takes the lock of `arena`, or says which pid holds it.
    pub fn acquire(arena: &Path) -> Result<Self, PrivateError> {
        let mut path = arena.as_os_str().to_owned();
        path.push(".lock");
        let path = PathBuf::from(path);
        let mut file = match open_existing(&path, true)? {
            Some(f) => f,
            None => match create_new(&path) {
                Ok(f) => f,
                // Another daemon created it between our two calls: open theirs.
                Err(PrivateError::Io { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists => {
                    open_existing(&path, true)?.ok_or_else(|| io(&path)(source))?
                }
                Err(e) => return Err(e),
            },
        };
        // SAFETY: a valid open descriptor; LOCK_NB never blocks.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io(&path)(e));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() || holder.len() > 20 {
                "unknown".to_owned()
            } else {
                holder.to_owned()
            };
            return Err(PrivateError::Locked { path, holder });
        }
        let pid = std::process::id().to_string();
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| file.write_all(pid.as_bytes()))
            .map_err(io(&path))?;
        Ok(Self { path, _file: file })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirs_are_created_private_and_loose_ones_refused() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("a/b");
        private_dir(&d).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o750)).unwrap();
        let e = private_dir(&d).unwrap_err().to_string();
        assert!(e.contains("mode 750") && e.contains(&d.display().to_string()), "{e}");
        // A group-writable ancestor lets others swap the directory.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(t.path().join("a"), std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(matches!(private_dir(&d), Err(PrivateError::UnsafeAncestor { .. })));
        // An explicitly named directory may be readable by others, never writable.
        std::fs::set_permissions(t.path().join("a"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(private_dir(&d).is_err());
        trusted_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o775)).unwrap();
        assert!(matches!(trusted_dir(&d), Err(PrivateError::UnsafeDir { .. })));
    }

    #[test]
    fn files_are_new_0600_never_followed_and_checked_when_reopened() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("f");
        create_new(&f).unwrap().write_all(b"x").unwrap();
        assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o777, 0o600);
        assert!(create_new(&f).is_err(), "O_EXCL");
        assert!(open_existing(&f, true).unwrap().is_some());
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(open_existing(&f, true), Err(PrivateError::UnsafeFile { .. })));
        let victim = t.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        assert!(matches!(open_existing(&link, true), Err(PrivateError::NotAFile { .. })));
        assert!(create_new(&link).is_err());
        replace(&link).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert!(!std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    }

    #[test]
    fn a_configured_group_may_reach_shared_dirs_and_files_and_no_other_group() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("shm/arena-dir");
        // The daemon's own primary group stands for the engines' group here.
        // SAFETY: getegid has no preconditions and cannot fail.
        let gid = unsafe { libc::getegid() };
        shared_dir(&d, Some(gid)).unwrap();
        let md = std::fs::metadata(&d).unwrap();
        assert_eq!((md.mode() & 0o777, md.gid()), (0o750, gid));
        // Accepted again as it is; without the group it is refused as not private.
        shared_dir(&d, Some(gid)).unwrap();
        assert!(matches!(
            private_dir(&d),
            Err(PrivateError::UnsafeDir { mode: 0o750, .. })
        ));
        assert!(matches!(shared_dir(&d, None), Err(PrivateError::UnsafeDir { .. })));
        // Group bits of another group, or group write, are refused.
        assert!(matches!(
            shared_dir(&d, Some(gid.wrapping_add(1))),
            Err(PrivateError::UnsafeDir { .. })
        ));
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(matches!(shared_dir(&d, Some(gid)), Err(PrivateError::UnsafeDir { .. })));
        // A private directory is given the group.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        shared_dir(&d, Some(gid)).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o750);

        let f = d.join("arena");
        let file = create_new(&f).unwrap();
        share_file(&f, &file, Some(gid)).unwrap();
        let md = std::fs::metadata(&f).unwrap();
        assert_eq!((md.mode() & 0o777, md.gid()), (0o660, gid));
        assert!(open_existing_shared(&f, true, Some(gid)).unwrap().is_some());
        assert!(matches!(open_existing(&f, true), Err(PrivateError::UnsafeFile { .. })));
        assert!(matches!(
            open_existing_shared(&f, true, Some(gid.wrapping_add(1))),
            Err(PrivateError::UnsafeFile { .. })
        ));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o664)).unwrap();
        assert!(
            matches!(
                open_existing_shared(&f, true, Some(gid)),
                Err(PrivateError::UnsafeFile { .. })
            ),
            "others' bits are never accepted"
        );
        share_file(&f, &file, None).unwrap();
        assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o777, 0o600);
    }

    #[test]
    fn one_owner_lock_at_a_time_naming_the_holder() {
        let t = tempfile::tempdir().unwrap();
        let arena = t.path().join("arena");
        let held = OwnerLock::acquire(&arena).unwrap();
        let e = OwnerLock::acquire(&arena).unwrap_err().to_string();
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(held);
        OwnerLock::acquire(&arena).unwrap();
    }
}
