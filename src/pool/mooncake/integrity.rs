//! Pool integrity: every object kvtier puts in a Mooncake Store ends with a 32-byte keyed
//! BLAKE3 MAC over its key and its bytes, under a cluster key only the daemons hold.
//!
//! The master has no authentication: anyone who reaches it can put an object under a
//! page's key. Such an object (or one too short to carry a MAC, or written under another
//! key) fails the check, is never reported loaded, and is counted. The MAC gives
//! integrity, not secrecy: who reaches the store still reads its bytes.
//!
//! Value layout: `page bytes ‖ MAC(32)`, where MAC = BLAKE3-keyed(cluster key,
//! `len(key) as u64 LE ‖ key ‖ page bytes`). The cluster key is derived from the key
//! file's contents (at least 32 bytes) with BLAKE3's `derive_key`.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of the MAC trailer at the end of every object.
pub const MAC_LEN: usize = 32;

/// Fewest bytes a key file holds.
pub const MIN_KEY_FILE_BYTES: usize = 32;

const CONTEXT: &str = "kvtier 2026 Mooncake pool object MAC v1";

/// The cluster key and the count of objects refused.
pub struct Integrity {
    key: [u8; 32],
    rejected: AtomicU64,
}

impl std::fmt::Debug for Integrity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Integrity")
            .field("rejected", &self.rejected())
            .finish_non_exhaustive()
    }
}

impl Integrity {
    /// Under the cluster key derived from a key file's contents.
    pub fn new(key_material: &[u8]) -> Self {
        Self {
            key: blake3::derive_key(CONTEXT, key_material),
            rejected: AtomicU64::new(0),
        }
    }

    fn mac(&self, key: &str, bytes: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(&(key.len() as u64).to_le_bytes());
        h.update(key.as_bytes());
        h.update(bytes);
        h.finalize()
    }

    /// The MAC of page bytes `bytes` stored under `key`.
    pub fn tag(&self, key: &str, bytes: &[u8]) -> [u8; MAC_LEN] {
        *self.mac(key, bytes).as_bytes()
    }

    /// Whether `tag` is the MAC of `bytes` under `key`; a mismatch is counted.
    pub fn verify(&self, key: &str, bytes: &[u8], tag: &[u8; MAC_LEN]) -> bool {
        // `Hash`'s equality is constant-time.
        let ok = self.mac(key, bytes) == blake3::Hash::from(*tag);
        if !ok {
            self.reject();
        }
        ok
    }

    /// Writes the MAC of `obj[..len - MAC_LEN]` under `key` into its last `MAC_LEN` bytes.
    pub fn seal(&self, key: &str, obj: &mut [u8]) {
        let len = obj.len();
        let n = len.saturating_sub(MAC_LEN);
        let mac = self.mac(key, &obj[..n]);
        obj[n..].copy_from_slice(&mac.as_bytes()[..len - n]);
    }

    /// The page bytes of `obj` when its trailer is the MAC of them under `key`; `None`
    /// (and counted) otherwise, a too-short object included.
    pub fn open<'a>(&self, key: &str, obj: &'a [u8]) -> Option<&'a [u8]> {
        let ok = obj.len() >= MAC_LEN && {
            let (bytes, tag) = obj.split_at(obj.len() - MAC_LEN);
            let tag: [u8; MAC_LEN] = tag.try_into().expect("MAC_LEN bytes");
            // `Hash`'s equality is constant-time.
            self.mac(key, bytes) == blake3::Hash::from(tag)
        };
        if ok {
            Some(&obj[..obj.len() - MAC_LEN])
        } else {
            self.reject();
            None
        }
    }

    /// Counts one object refused.
    pub fn reject(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }

    /// Objects refused since start.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }
}

/// A key file's contents, held between reading the configuration and starting the pool;
/// its `Debug` never shows them.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyMaterial(pub Vec<u8>);

impl std::fmt::Debug for KeyMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyMaterial({} bytes)", self.0.len())
    }
}

/// Why a key file was refused.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("mooncake.integrity_key_file {path:?} must be an absolute path")]
    Relative { path: PathBuf },
    #[error("mooncake.integrity_key_file {path:?}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("mooncake.integrity_key_file {path:?} is not a regular file (symlinks are not followed)")]
    NotAFile { path: PathBuf },
    #[error(
        "mooncake.integrity_key_file {path:?} is owned by uid {owner}, not the daemon's uid {daemon}; \
         chown it to the daemon's user"
    )]
    Owner { path: PathBuf, owner: u32, daemon: u32 },
    #[error(
        "mooncake.integrity_key_file {path:?} has mode {mode:04o}; it must be 0600 or stricter (chmod 600 {path:?})"
    )]
    Mode { path: PathBuf, mode: u32 },
    #[error(
        "mooncake.integrity_key_file {path:?} holds {len} bytes; it needs at least {MIN_KEY_FILE_BYTES} \
         (head -c 32 /dev/urandom > {path:?}; chmod 600 {path:?})"
    )]
    Short { path: PathBuf, len: usize },
}

/// Reads a key file: an absolute path to a regular file (not a symlink) owned by the
/// daemon's uid, with no group or other permission bits, holding at least 32 bytes.
pub fn read_key_file(path: &Path) -> Result<Vec<u8>, KeyFileError> {
    let p = || path.to_owned();
    if !path.is_absolute() {
        return Err(KeyFileError::Relative { path: p() });
    }
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                KeyFileError::NotAFile { path: p() }
            } else {
                KeyFileError::Io { path: p(), source: e }
            }
        })?;
    let md = f.metadata().map_err(|e| KeyFileError::Io { path: p(), source: e })?;
    if !md.is_file() {
        return Err(KeyFileError::NotAFile { path: p() });
    }
    let daemon = crate::tier::private::euid();
    if md.uid() != daemon {
        return Err(KeyFileError::Owner {
            path: p(),
            owner: md.uid(),
            daemon,
        });
    }
    if md.mode() & 0o077 != 0 {
        return Err(KeyFileError::Mode {
            path: p(),
            mode: md.mode() & 0o7777,
        });
    }
    let mut buf = Vec::new();
    f.by_ref()
        .take(1 << 16)
        .read_to_end(&mut buf)
        .map_err(|e| KeyFileError::Io { path: p(), source: e })?;
    if buf.len() < MIN_KEY_FILE_BYTES {
        return Err(KeyFileError::Short {
            path: p(),
            len: buf.len(),
        });
    }
    Ok(buf)
}

/// The single-node default key file: `pool.key` in this uid's private Mooncake directory
/// (`/dev/shm/kvtier-mooncake-<uid>/`), created with 32 random bytes, `0600`, exclusively,
/// when absent. Every daemon of this uid on this node shares it; other nodes do not, so a
/// cluster must configure one key file for all its daemons.
pub fn default_key_file() -> Result<PathBuf, KeyFileError> {
    let base = super::run_dir::base().map_err(|e| KeyFileError::Io {
        path: PathBuf::from("/dev/shm"),
        source: std::io::Error::other(e.to_string()),
    })?;
    let path = base.join("pool.key");
    let mut key = [0u8; 32];
    let io = |e: std::io::Error| KeyFileError::Io {
        path: path.clone(),
        source: e,
    };
    std::fs::File::open("/dev/urandom")
        .and_then(|mut r| r.read_exact(&mut key))
        .map_err(io)?;
    match crate::tier::private::create_new(&path) {
        Ok(mut f) => {
            std::io::Write::write_all(&mut f, &key).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        // Another daemon made it first: read (and check) that one.
        Err(crate::tier::private::PrivateError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io(std::io::Error::other(e.to_string()))),
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_object_opens_and_any_change_is_refused_and_counted() {
        let i = Integrity::new(&[7u8; 32]);
        let mut obj = vec![0u8; 100 + MAC_LEN];
        obj[..100].iter_mut().enumerate().for_each(|(n, b)| *b = n as u8);
        i.seal("k1", &mut obj);
        assert_eq!(i.open("k1", &obj).map(<[u8]>::len), Some(100));
        assert_eq!(i.rejected(), 0);
        assert!(i.open("k2", &obj).is_none(), "another key's object");
        let mut bad = obj.clone();
        bad[3] ^= 1;
        assert!(i.open("k1", &bad).is_none(), "a flipped bit");
        assert!(i.open("k1", &obj[..MAC_LEN - 1]).is_none(), "too short for a MAC");
        assert!(
            Integrity::new(&[8u8; 32]).open("k1", &obj).is_none(),
            "another cluster key"
        );
        assert_eq!(i.rejected(), 3);
    }

    #[test]
    fn key_files_must_be_private_owned_and_long_enough() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("key");
        std::fs::write(&f, [1u8; 32]).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_key_file(&f).unwrap().len(), 32);
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_key_file(&f).unwrap_err();
        assert!(matches!(e, KeyFileError::Mode { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().contains("0644") && e.to_string().contains("key"), "{e}");
        std::fs::write(&f, [1u8; 31]).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(read_key_file(&f), Err(KeyFileError::Short { len: 31, .. })));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        assert!(matches!(read_key_file(&link), Err(KeyFileError::NotAFile { .. })));
        assert!(matches!(
            read_key_file(Path::new("key")),
            Err(KeyFileError::Relative { .. })
        ));
    }
}
