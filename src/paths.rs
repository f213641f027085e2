//! Where the daemon's sockets are by default, one answer for the daemon and every client
//! (Rust, the C ABI's `kvtier_default_socket`, and so the Python package), and the checks
//! that the process behind a socket and the arena it names belong to the expected user.
//!
//! The default directory is a private runtime directory whenever one exists: the
//! `kvtier` directory in `$XDG_RUNTIME_DIR`, else in `/run/user/<uid>` when that exists,
//! is owned by this uid and has no group or other permissions (what `pam_systemd` makes
//! for a login, and what a service started without a session still has). Only without
//! either does it fall back to `./.kvtier`: a working directory another user can write
//! would let her serve a socket there first.

use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// The directory of the daemon's sockets by default: see the module doc.
pub fn runtime_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("kvtier"),
        _ => match user_run_dir() {
            Some(d) => d.join("kvtier"),
            None => PathBuf::from(".kvtier"),
        },
    }
}

/// The control socket by default: `KVTIER_SOCKET` when set (the variable the daemon's
/// `socket` key reads too), else `kvtier.sock` in [`runtime_dir`].
pub fn default_socket() -> PathBuf {
    match std::env::var_os("KVTIER_SOCKET") {
        Some(s) if !s.is_empty() => PathBuf::from(s),
        _ => runtime_dir().join("kvtier.sock"),
    }
}

/// `/run/user/<uid>` when it exists as this user's private directory.
fn user_run_dir() -> Option<PathBuf> {
    let uid = crate::tier::private::euid();
    let dir = PathBuf::from(format!("/run/user/{uid}"));
    let md = std::fs::symlink_metadata(&dir).ok()?;
    (md.is_dir() && md.uid() == uid && md.mode() & 0o077 == 0).then_some(dir)
}

/// The uid of the process at the other end of a connected Unix socket (`SO_PEERCRED`).
pub fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    peer_cred(stream).map(|c| c.uid)
}

/// The credentials of the process at the other end of a Unix socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// Reads `SO_PEERCRED` of a connected Unix stream (std's or tokio's).
///
/// Raw `libc`, not rustix: the kernel reports pid 0 for a peer in a pid namespace the
/// reader cannot see (an engine in another container), and rustix's `UCred` holds the
/// pid as a non-zero type, so its `socket_peercred` would build an invalid value there.
pub fn peer_cred(stream: &impl AsRawFd) -> std::io::Result<PeerCred> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes given; the fd is open.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// What an arena file must be before an engine maps it: a regular file (not a symlink)
/// owned by `daemon_uid`, writable by nobody outside its owner and group. Returns its
/// device and inode, to check after mapping that the same file was mapped.
pub fn arena_identity(path: &Path, daemon_uid: u32) -> Result<(u64, u64), ArenaRefusal> {
    let md = std::fs::symlink_metadata(path).map_err(ArenaRefusal::Io)?;
    if !md.file_type().is_file() {
        return Err(ArenaRefusal::NotAFile);
    }
    if md.uid() != daemon_uid {
        return Err(ArenaRefusal::Owner(md.uid()));
    }
    if md.mode() & 0o002 != 0 {
        return Err(ArenaRefusal::Mode(md.mode() & 0o7777));
    }
    Ok((md.dev(), md.ino()))
}

/// Why an arena file was refused ([`arena_identity`]).
#[derive(Debug)]
pub enum ArenaRefusal {
    Io(std::io::Error),
    NotAFile,
    Owner(u32),
    Mode(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_of_a_socket_pair_is_this_process_s_user() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert_eq!(peer_uid(&a).unwrap(), crate::tier::private::euid());
    }

    #[test]
    fn arena_files_of_another_owner_or_loose_mode_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("arena");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let me = crate::tier::private::euid();
        assert!(arena_identity(&f, me).is_ok());
        assert!(matches!(arena_identity(&f, me + 1), Err(ArenaRefusal::Owner(o)) if o == me));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(matches!(arena_identity(&f, me), Err(ArenaRefusal::Mode(0o666))));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        assert!(matches!(arena_identity(&link, me), Err(ArenaRefusal::NotAFile)));
    }
}
