//! Pool integrity: every object kvtier puts in a Mooncake Store ends with a 32-byte
//! trailer that authenticates its key and its bytes under a cluster key only the daemons
//! hold.
//!
//! The master has no authentication: anyone who reaches it can put an object under a
//! page's key. Such an object (or one too short to carry a trailer, written under another
//! key, or in an older format) fails the check, is never reported loaded, and is counted.
//! The MAC gives integrity, not secrecy: who reaches the store still reads its bytes.
//!
//! Value layout: `page bytes ‖ FORMAT(4) ‖ nonce(12) ‖ tag(16)`. The tag is the AES-GCM-SIV
//! construction's (RFC 8452): `S = POLYVAL_H(header ‖ page bytes ‖ lengths)`, each part
//! zero-padded to 16 bytes, where `header = FORMAT ‖ len(key) as u64 LE ‖ key` and
//! `lengths = 8·len(header) as u64 LE ‖ 8·len(page bytes) as u64 LE`; then
//! `tag = AES-256_K(S ⊕ nonce, top bit cleared)`. POLYVAL is a universal hash that runs at
//! about the speed of a copy ([`super::polyval_hash`]); AES runs once per object. The
//! nonce is 96 bits, random at start and counted up per object. `K` and `H` are derived
//! from the key file's contents (at least 32 bytes) with BLAKE3's `derive_key`, one
//! context each.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use aes::cipher::{BlockEncrypt, KeyInit};

use super::polyval_hash::PolyvalKey;

/// Bytes of the trailer at the end of every object.
pub const MAC_LEN: usize = 32;

/// Fewest bytes a key file holds.
pub const MIN_KEY_FILE_BYTES: usize = 32;

/// The trailer's first bytes: format 2, POLYVAL + AES-256 (format 1, keyed BLAKE3, had
/// no such field; its objects fail the check).
pub const FORMAT: [u8; 4] = *b"kvM2";

const NONCE_LEN: usize = 12;

const AES_CONTEXT: &str = "kvtier 2026 Mooncake pool object MAC v2 AES-256 key";
const POLYVAL_CONTEXT: &str = "kvtier 2026 Mooncake pool object MAC v2 POLYVAL key";

/// The cluster key and the count of objects refused.
pub struct Integrity {
    aes: aes::Aes256,
    polyval: PolyvalKey,
    /// The first nonce's high 32 bits (random at start).
    nonce_hi: u32,
    /// The next nonce's low 64 bits (random at start, counted up).
    nonce_lo: AtomicU64,
    rejected: AtomicU64,
}

impl std::fmt::Debug for Integrity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Integrity")
            .field("rejected", &self.rejected())
            .field("polyval", &self.polyval.engine())
            .finish_non_exhaustive()
    }
}

/// 12 random bytes from the kernel; where it refuses (never on a Linux that has booted),
/// the time and process instead: a nonce that repeats lets no one forge (the tag is a
/// block cipher's output on the hash), it only shows that two objects are equal.
fn random_seed() -> [u8; NONCE_LEN] {
    let mut seed = [0u8; NONCE_LEN];
    // SAFETY: `seed` is NONCE_LEN writable bytes.
    let n = unsafe { libc::getrandom(seed.as_mut_ptr().cast(), NONCE_LEN, 0) };
    if n != NONCE_LEN as isize {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let h = blake3::hash(format!("{t:?} {}", std::process::id()).as_bytes());
        seed.copy_from_slice(&h.as_bytes()[..NONCE_LEN]);
    }
    seed
}

impl Integrity {
    /// Under the cluster key derived from a key file's contents.
    pub fn new(key_material: &[u8]) -> Self {
        let k = blake3::derive_key(AES_CONTEXT, key_material);
        let h = blake3::derive_key(POLYVAL_CONTEXT, key_material);
        let seed = random_seed();
        Self {
            aes: aes::Aes256::new(&k.into()),
            polyval: PolyvalKey::new(h[..16].try_into().expect("16 bytes")),
            nonce_hi: u32::from_le_bytes(seed[8..].try_into().expect("4 bytes")),
            nonce_lo: AtomicU64::new(u64::from_le_bytes(seed[..8].try_into().expect("8 bytes"))),
            rejected: AtomicU64::new(0),
        }
    }

    /// Which code computes POLYVAL here (`"vpclmulqdq"`, `"vpclmulqdq-avx2"`, `"pclmulqdq"`,
    /// `"portable"`).
    pub fn engine(&self) -> &'static str {
        self.polyval.engine()
    }

    fn next_nonce(&self) -> [u8; NONCE_LEN] {
        let mut n = [0u8; NONCE_LEN];
        n[..8].copy_from_slice(&self.nonce_lo.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        n[8..].copy_from_slice(&self.nonce_hi.to_le_bytes());
        n
    }

    /// The tag of page bytes `bytes` stored under `key` with `nonce`.
    fn mac(&self, key: &str, bytes: &[u8], nonce: &[u8; NONCE_LEN]) -> [u8; 16] {
        let mut header = Vec::with_capacity(FORMAT.len() + 8 + key.len());
        header.extend_from_slice(&FORMAT);
        header.extend_from_slice(&(key.len() as u64).to_le_bytes());
        header.extend_from_slice(key.as_bytes());
        let mut lengths = [0u8; 16];
        lengths[..8].copy_from_slice(&((header.len() as u64) * 8).to_le_bytes());
        lengths[8..].copy_from_slice(&((bytes.len() as u64) * 8).to_le_bytes());
        let mut s = self.polyval.hash_padded(&[&header, bytes, &lengths]);
        s.iter_mut().zip(nonce).for_each(|(a, b)| *a ^= b);
        s[15] &= 0x7f;
        let mut block = s.into();
        self.aes.encrypt_block(&mut block);
        block.into()
    }

    /// A fresh trailer (format, new nonce, tag) for page bytes `bytes` stored under `key`.
    pub fn tag(&self, key: &str, bytes: &[u8]) -> [u8; MAC_LEN] {
        let nonce = self.next_nonce();
        let mut t = [0u8; MAC_LEN];
        t[..4].copy_from_slice(&FORMAT);
        t[4..16].copy_from_slice(&nonce);
        t[16..].copy_from_slice(&self.mac(key, bytes, &nonce));
        t
    }

    fn check(&self, key: &str, bytes: &[u8], trailer: &[u8; MAC_LEN]) -> bool {
        let nonce: &[u8; NONCE_LEN] = trailer[4..16].try_into().expect("12 bytes");
        let want = self.mac(key, bytes, nonce);
        // Constant time: every byte is compared, whatever the first mismatch.
        let diff = want
            .iter()
            .zip(&trailer[16..])
            .chain(FORMAT.iter().zip(&trailer[..4]))
            .fold(0u8, |d, (a, b)| d | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    /// Whether `trailer` authenticates `bytes` under `key`; a mismatch is counted.
    pub fn verify(&self, key: &str, bytes: &[u8], trailer: &[u8; MAC_LEN]) -> bool {
        let ok = self.check(key, bytes, trailer);
        if !ok {
            self.reject();
        }
        ok
    }

    /// Writes the trailer of `obj[..len - MAC_LEN]` under `key` into its last `MAC_LEN`
    /// bytes (what fits, for an object shorter than a trailer).
    pub fn seal(&self, key: &str, obj: &mut [u8]) {
        let len = obj.len();
        let n = len.saturating_sub(MAC_LEN);
        let t = self.tag(key, &obj[..n]);
        obj[n..].copy_from_slice(&t[..len - n]);
    }

    /// The page bytes of `obj` when its trailer authenticates them under `key`; `None`
    /// (and counted) otherwise, a too-short object included.
    pub fn open<'a>(&self, key: &str, obj: &'a [u8]) -> Option<&'a [u8]> {
        let ok = obj.len() >= MAC_LEN && {
            let (bytes, t) = obj.split_at(obj.len() - MAC_LEN);
            self.check(key, bytes, t.try_into().expect("MAC_LEN bytes"))
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
        for at in [100, 104, 116, 131] {
            let mut bad = obj.clone();
            bad[at] ^= 0x80;
            assert!(i.open("k1", &bad).is_none(), "a flipped bit in the trailer at {at}");
        }
        assert!(i.open("k1", &obj[..obj.len() - 1]).is_none(), "one byte short");
        assert_eq!(i.rejected(), 8);
        // Another daemon of the cluster (same key file, its own nonces) opens it.
        assert!(Integrity::new(&[7u8; 32]).open("k1", &obj).is_some());
        // Each seal draws a new nonce: the same page sealed twice has two trailers, both good.
        let mut again = obj.clone();
        i.seal("k1", &mut again);
        assert_ne!(again[100..], obj[100..]);
        assert!(i.open("k1", &again).is_some());
        assert_eq!(i.rejected(), 8);
    }

    #[test]
    fn an_old_format_object_is_refused_and_counted() {
        // Format 1: the page bytes, then keyed BLAKE3 of `len(key) ‖ key ‖ bytes`.
        let material = [7u8; 32];
        let old_key = blake3::derive_key("kvtier 2026 Mooncake pool object MAC v1", &material);
        let page = vec![5u8; 4096];
        let mut h = blake3::Hasher::new_keyed(&old_key);
        h.update(&2u64.to_le_bytes());
        h.update(b"k1");
        h.update(&page);
        let mut obj = page.clone();
        obj.extend_from_slice(h.finalize().as_bytes());
        let i = Integrity::new(&material);
        assert!(i.open("k1", &obj).is_none());
        // Even with the new format's first bytes.
        obj[4096..4100].copy_from_slice(&FORMAT);
        assert!(i.open("k1", &obj).is_none());
        assert_eq!(i.rejected(), 2);
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
