//! The admin socket's security: where it may live, who may create it, who may talk to it.
//!
//! - The parent directory must not be world-writable (anyone could replace the socket).
//!   A directory we create is made `0700`.
//! - The socket is bound under a temporary name, given its mode, then renamed into place,
//!   so it never appears at its path with looser permissions.
//! - Every connection's peer credentials (`SO_PEERCRED`) are checked against the uid/gid
//!   allowlist before a byte of the request is read.
//!
//! The control socket shares the peer check ([`PeerPolicy`]) and the binding
//! ([`bind_socket`], with a group for engines that run as another uid).

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use super::config::{AdminConfig, AdminError};

pub use crate::paths::{PeerCred, peer_cred};

/// Who may talk to a socket: a peer is allowed when its uid or its gid is listed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerPolicy {
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

impl PeerPolicy {
    /// The daemon's own uid and root, plus `uids` and `gids`.
    pub fn owner_and_root(uids: &[u32], gids: &[u32]) -> Self {
        let mut all = vec![crate::tier::private::euid(), 0];
        all.extend_from_slice(uids);
        all.sort_unstable();
        all.dedup();
        Self {
            uids: all,
            gids: gids.to_vec(),
        }
    }

    pub fn allows(&self, peer: &PeerCred) -> bool {
        self.uids.contains(&peer.uid) || self.gids.contains(&peer.gid)
    }

    /// Reads the peer's credentials and checks them: `Ok(peer)` when allowed, else why
    /// not (for the refusal and the log).
    pub fn check(&self, stream: &impl AsRawFd) -> Result<PeerCred, String> {
        match peer_cred(stream) {
            Ok(peer) if self.allows(&peer) => Ok(peer),
            Ok(peer) => Err(format!(
                "uid {} (gid {}) is not allowed on this socket",
                peer.uid, peer.gid
            )),
            Err(e) => Err(format!("peer credentials unavailable: {e}")),
        }
    }
}

/// Whether a peer is on the allowlist (its uid, or its gid).
pub fn allowed(cfg: &AdminConfig, peer: &PeerCred) -> bool {
    cfg.allow_uids.contains(&peer.uid) || cfg.allow_gids.contains(&peer.gid)
}

/// Makes sure the socket's directory exists and nobody but the daemon's uid can plant or
/// swap an entry in it ([`crate::tier::private::trusted_dir`]: created `0700`, or owned
/// by the daemon's uid, not writable by group or others, under ancestors no other user
/// can rename in). A directory another user made first, or may write, is refused: a
/// socket there could be displaced by theirs, and the CLI would talk to it.
pub fn prepare_dir(dir: &Path) -> Result<(), AdminError> {
    crate::tier::private::trusted_dir(dir).map_err(|e| AdminError::Directory(dir.to_path_buf(), e.to_string()))
}

/// Binds the admin socket at `cfg.socket` with `cfg.mode`. A stale socket (nobody
/// listening) is replaced; a live one, or any other file at the path, is an error.
pub fn bind(cfg: &AdminConfig) -> Result<UnixListener, AdminError> {
    bind_socket(&cfg.socket, cfg.mode, None)
}

/// Binds a Unix socket at `path` with permission bits `mode` and, with `gid`, that group,
/// both set before the socket appears at its path. A stale socket (nobody listening) is
/// replaced; a live one is [`AdminError::InUse`]; any other file at the path is an error.
pub fn bind_socket(path: &Path, mode: u32, gid: Option<u32>) -> Result<UnixListener, AdminError> {
    let err = |m: String| AdminError::Socket(path.to_path_buf(), m);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    prepare_dir(&dir)?;
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(AdminError::InUse(path.to_path_buf()));
            }
            std::fs::remove_file(path).map_err(|e| err(format!("removing a stale socket: {e}")))?;
        }
        Ok(_) => return Err(err("exists and is not a socket".into())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e.to_string())),
    }
    let name = path
        .file_name()
        .ok_or_else(|| err("has no file name".into()))?
        .to_string_lossy()
        .into_owned();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(|e| err(format!("bind: {e}")))?;
    let placed = std::os::unix::fs::lchown(&tmp, None, gid)
        .and_then(|_| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)))
        .and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(format!("setting mode and placing the socket: {e}")));
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_world_writable_dir_and_creates_private_one() {
        let t = tempfile::tempdir().unwrap();
        let open = t.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(prepare_dir(&open), Err(AdminError::Directory(..))));
        // Group-writable is refused too, and so is a directory of another uid.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(matches!(prepare_dir(&open), Err(AdminError::Directory(..))));
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        prepare_dir(&open).unwrap();
        if crate::tier::private::euid() == 0 {
            std::os::unix::fs::chown(&open, Some(65534), None).unwrap();
            let err = prepare_dir(&open).unwrap_err().to_string();
            assert!(err.contains("uid 65534"), "{err}");
        }
        let new = t.path().join("a/b");
        prepare_dir(&new).unwrap();
        assert_eq!(std::fs::metadata(&new).unwrap().permissions().mode() & 0o777, 0o700);
    }

    #[test]
    fn binds_with_mode_and_replaces_only_stale_sockets() {
        let t = tempfile::tempdir().unwrap();
        let cfg = AdminConfig::at(t.path().join("s/admin.sock"));
        let l = bind(&cfg).unwrap();
        let md = std::fs::metadata(&cfg.socket).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o600);
        assert!(matches!(bind(&cfg), Err(AdminError::InUse(_))));
        drop(l);
        let _l2 = bind(&cfg).unwrap();
        let me = UnixStream::connect(&cfg.socket).unwrap();
        let cred = peer_cred(&me).unwrap();
        // SAFETY: no preconditions.
        assert_eq!(cred.uid, unsafe { libc::getuid() });
        assert!(allowed(&cfg, &cred));
    }
}
