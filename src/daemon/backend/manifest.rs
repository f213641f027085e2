//! The arena manifest: an append-only log of which host slots hold which committed object.
//!
//! It lives beside the arena file. Each record is `[b"KVR2"][u32 body length][u64 xxh3 of
//! the body][body]`, checked on its own: a record whose framing or checksum is bad is
//! skipped and the replay finds the next record by its marker (one whose checksum holds),
//! so a bad record costs that record only; each skip is counted ([`Replay::bad_records`]).
//! A file that is not a manifest at all is reported ([`Replay::garbage`]), not taken for
//! an empty one. Bodies:
//!
//! * `1` namespace: `u16 id`, model, lora, salt, layout (protocol encoding)
//! * `2` object: `u16 ns`, hash, `u16 object`, `u32 slot`, `u64 len`, `u64 xxh3 of the bytes`
//! * `3` release: `u32 slot`, hash (only undoes the slot's record when it names that page)
//!
//! The file starts with `KVTMANI2` and the arena's slot size. On a clean shutdown the
//! daemon rewrites it with only the live objects (compaction). A `KVTMANI1` file (records
//! without the marker) is still read, up to its first bad record, which ends it.
//! The file is private (`0600`, written through a new temporary file created with
//! `O_EXCL`, renamed into place, and reopened with `O_NOFOLLOW`).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use crate::layout::LayoutSpec;
use crate::page::{Namespace, PageHash};
use crate::protocol::codec::{DecodeError, Reader, Writer};
use crate::protocol::types::{MAX_STR, decode_layout, encode_layout};

use super::BackendError;

const MAGIC: &[u8; 8] = b"KVTMANI2";
const MAGIC_V1: &[u8; 8] = b"KVTMANI1";
const MARK: &[u8; 4] = b"KVR2";
/// Marker, length and checksum.
const HEAD: usize = 16;
const MAX_RECORD: usize = 1 << 16;

/// One committed object as the manifest remembers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectRecord {
    pub ns: u16,
    pub hash: PageHash,
    pub object: u16,
    pub slot: u32,
    pub len: u64,
    pub checksum: u64,
}

/// What a replay found.
#[derive(Debug, Default)]
pub struct Replay {
    pub slot_bytes: u64,
    pub namespaces: Vec<(u16, Namespace, LayoutSpec)>,
    /// Live objects by slot (a later record for a slot replaces an earlier one).
    pub objects: HashMap<u32, ObjectRecord>,
    /// Records skipped because their framing, checksum or contents were bad (a torn
    /// last record counts too).
    pub bad_records: u64,
    /// Bytes skipped while looking for the next good record.
    pub skipped_bytes: u64,
    /// The file exists but is not a manifest (no magic, or too short): nothing was read.
    pub garbage: bool,
}

/// An open manifest being appended to.
#[derive(Debug)]
pub struct Manifest {
    path: PathBuf,
    file: File,
    buf: Vec<u8>,
    /// Bytes in the file, and in the buffer not yet written.
    bytes: u64,
    /// Bytes of the last object record (every object record of one hash size has it).
    object_bytes: u64,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> BackendError + '_ {
    move |source| BackendError::Manifest {
        path: path.display().to_string(),
        source,
    }
}

impl Manifest {
    /// Writes a fresh manifest (atomically, through a temporary file) holding `namespaces`
    /// and `objects`, and opens it for appending.
    pub fn create(
        path: &Path,
        slot_bytes: u64,
        namespaces: &[(u16, Namespace, LayoutSpec)],
        objects: &[ObjectRecord],
    ) -> Result<Self, BackendError> {
        let tmp = path.with_extension("tmp");
        let mut m = Self {
            path: path.to_owned(),
            file: crate::tier::private::replace(&tmp).map_err(private(path))?,
            buf: Vec::with_capacity(4096),
            bytes: 0,
            object_bytes: 0,
        };
        m.buf.extend_from_slice(MAGIC);
        m.buf.extend_from_slice(&slot_bytes.to_le_bytes());
        m.bytes = m.buf.len() as u64;
        for (id, ns, spec) in namespaces {
            m.namespace(*id, ns, spec);
        }
        for o in objects {
            m.object(o);
        }
        m.flush()?;
        m.file.sync_all().map_err(io(path))?;
        std::fs::rename(&tmp, path).map_err(io(path))?;
        m.file = OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(io(path))?;
        Ok(m)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size once the buffered records are written.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes of one object record (0 before the first).
    pub fn object_record_bytes(&self) -> u64 {
        self.object_bytes
    }

    fn record(&mut self, body: impl FnOnce(&mut Writer)) {
        let before = self.buf.len();
        self.record_inner(body);
        self.bytes += (self.buf.len() - before) as u64;
    }

    fn record_inner(&mut self, body: impl FnOnce(&mut Writer)) {
        let start = self.buf.len();
        self.buf.extend_from_slice(MARK);
        self.buf.extend_from_slice(&[0u8; HEAD - 4]);
        body(&mut Writer::new(&mut self.buf));
        let len = (self.buf.len() - start - HEAD) as u32;
        let sum = xxh3_64(&self.buf[start + HEAD..]);
        self.buf[start + 4..start + 8].copy_from_slice(&len.to_le_bytes());
        self.buf[start + 8..start + HEAD].copy_from_slice(&sum.to_le_bytes());
    }

    /// Buffers a namespace record.
    pub fn namespace(&mut self, id: u16, ns: &Namespace, spec: &LayoutSpec) {
        self.record(|w| {
            w.u8(1);
            w.u16(id);
            w.str(&ns.model);
            w.str(&ns.lora);
            w.str(&ns.salt);
            encode_layout(w, spec);
        });
    }

    /// Buffers an object record.
    pub fn object(&mut self, o: &ObjectRecord) {
        let before = self.bytes;
        self.record(|w| {
            w.u8(2);
            w.u16(o.ns);
            w.hash(&o.hash);
            w.u16(o.object);
            w.u32(o.slot);
            w.u64(o.len);
            w.u64(o.checksum);
        });
        self.object_bytes = self.bytes - before;
    }

    /// Buffers a release record: the slot no longer holds `hash`'s object.
    pub fn release(&mut self, slot: u32, hash: &PageHash) {
        self.record(|w| {
            w.u8(3);
            w.u32(slot);
            w.hash(hash);
        });
    }

    /// Writes the buffered records with one system call.
    pub fn flush(&mut self) -> Result<(), BackendError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let r = self.file.write_all(&self.buf).map_err(io(&self.path));
        self.buf.clear();
        r
    }

    /// Reads a manifest back (never through a symlink, and only a private file of the
    /// daemon's uid). A missing file is `Ok(None)`.
    pub fn replay(path: &Path) -> Result<Option<Replay>, BackendError> {
        let mut bytes = Vec::new();
        match crate::tier::private::open_existing(path, false).map_err(private(path))? {
            Some(mut f) => f.read_to_end(&mut bytes).map_err(io(path))?,
            None => return Ok(None),
        };
        let v1 = bytes.get(..8) == Some(MAGIC_V1.as_slice());
        if bytes.len() < 16 || (&bytes[..8] != MAGIC && !v1) {
            return Ok(Some(Replay {
                garbage: true,
                ..Replay::default()
            }));
        }
        let mut out = Replay {
            slot_bytes: u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default()),
            ..Replay::default()
        };
        if v1 {
            replay_v1(&mut out, &bytes);
            return Ok(Some(out));
        }
        let mut at = 16;
        while at < bytes.len() {
            match next_record(&bytes, at) {
                Some(body) => {
                    at += HEAD + body.len();
                    if apply(&mut out, body).is_err() {
                        out.bad_records += 1;
                    }
                }
                None => {
                    // Skip to the next marker whose record checks out.
                    out.bad_records += 1;
                    let from = at + 1;
                    let next = (from..bytes.len())
                        .find(|&i| bytes[i..].starts_with(MARK) && next_record(&bytes, i).is_some())
                        .unwrap_or(bytes.len());
                    out.skipped_bytes += (next - at) as u64;
                    at = next;
                }
            }
        }
        Ok(Some(out))
    }
}

fn private(path: &Path) -> impl Fn(crate::tier::private::PrivateError) -> BackendError + '_ {
    move |e| BackendError::Manifest {
        path: path.display().to_string(),
        source: std::io::Error::other(e.to_string()),
    }
}

/// A marked record at `at` whose length is sane and whose body matches its checksum.
fn next_record(bytes: &[u8], at: usize) -> Option<&[u8]> {
    let head = bytes.get(at..at + HEAD)?;
    if &head[..4] != MARK {
        return None;
    }
    let len = u32::from_le_bytes(head[4..8].try_into().ok()?) as usize;
    let sum = u64::from_le_bytes(head[8..HEAD].try_into().ok()?);
    if len > MAX_RECORD {
        return None;
    }
    let body = bytes.get(at + HEAD..at + HEAD + len)?;
    (xxh3_64(body) == sum).then_some(body)
}

/// The first format: `[u32 len][u64 xxh3][body]` without a marker, so the first bad record
/// ends what can be read.
fn replay_v1(out: &mut Replay, bytes: &[u8]) {
    let mut at = 16;
    while at < bytes.len() {
        let body = bytes.get(at..at + 12).and_then(|head| {
            let len = u32::from_le_bytes(head[..4].try_into().ok()?) as usize;
            let sum = u64::from_le_bytes(head[4..12].try_into().ok()?);
            let body = bytes.get(at + 12..at + 12 + len.min(MAX_RECORD + 1))?;
            (len <= MAX_RECORD && xxh3_64(body) == sum).then_some(body)
        });
        match body {
            Some(b) if apply(out, b).is_ok() => at += 12 + b.len(),
            _ => {
                out.bad_records += 1;
                out.skipped_bytes += (bytes.len() - at) as u64;
                return;
            }
        }
    }
}

fn apply(out: &mut Replay, body: &[u8]) -> Result<(), DecodeError> {
    let mut r = Reader::new(body);
    match r.u8()? {
        1 => {
            let id = r.u16()?;
            let ns = Namespace {
                model: r.str("model", MAX_STR)?,
                lora: r.str("lora", MAX_STR)?,
                salt: r.str("salt", MAX_STR)?,
            };
            let spec = decode_layout(&mut r)?;
            out.namespaces.push((id, ns, spec));
        }
        2 => {
            let o = ObjectRecord {
                ns: r.u16()?,
                hash: r.hash()?,
                object: r.u16()?,
                slot: r.u32()?,
                len: r.u64()?,
                checksum: r.u64()?,
            };
            out.objects.insert(o.slot, o);
        }
        3 => {
            let slot = r.u32()?;
            let hash = r.hash()?;
            if out.objects.get(&slot).is_some_and(|o| o.hash == hash) {
                out.objects.remove(&slot);
            }
        }
        tag => {
            return Err(DecodeError::BadTag {
                what: "manifest record",
                tag,
            });
        }
    }
    r.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_keeps_live_objects_and_stops_at_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arena.manifest");
        let spec = LayoutSpec::mha(2, 2, 32, 2, 4);
        let rec = |slot, n| ObjectRecord {
            ns: 0,
            hash: PageHash::from_u64(n),
            object: 0,
            slot,
            len: 512,
            checksum: n * 7,
        };
        let mut m = Manifest::create(&path, 512, &[(0, Namespace::model("m"), spec.clone())], &[rec(1, 1)]).unwrap();
        m.object(&rec(2, 2));
        m.object(&rec(3, 3));
        m.release(2, &PageHash::from_u64(2));
        m.object(&rec(1, 4)); // slot 1 reused
        m.release(1, &PageHash::from_u64(1)); // a late release of the old page: ignored
        m.flush().unwrap();
        drop(m);
        // A half-written record at the end.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[b'K', b'V', b'R', b'2', 40, 0, 0, 0, 1, 2, 3]).unwrap();
        let r = Manifest::replay(&path).unwrap().unwrap();
        assert_eq!(r.slot_bytes, 512);
        assert_eq!(r.namespaces, vec![(0, Namespace::model("m"), spec)]);
        assert_eq!(r.bad_records, 1);
        let mut live: Vec<_> = r.objects.values().map(|o| (o.slot, o.hash.prefix_u64())).collect();
        live.sort();
        assert_eq!(live, vec![(1, 4), (3, 3)]);
        assert!(Manifest::replay(&dir.path().join("none")).unwrap().is_none());
    }

    #[test]
    fn a_record_with_a_broken_length_is_skipped_and_the_next_one_found_by_its_marker() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arena.manifest");
        let rec = |slot| ObjectRecord {
            ns: 0,
            hash: PageHash::from_u64(slot as u64),
            object: 0,
            slot,
            len: 64,
            checksum: 1,
        };
        let recs: Vec<ObjectRecord> = (0..10).map(rec).collect();
        drop(Manifest::create(&path, 64, &[], &recs).unwrap());
        let mut bytes = std::fs::read(&path).unwrap();
        // Every record has the same size here; break the length of the fourth.
        let size = (bytes.len() - 16) / 10;
        let at = 16 + 3 * size;
        assert_eq!(&bytes[at..at + 4], MARK);
        bytes[at + 4..at + 8].copy_from_slice(&60_000u32.to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let r = Manifest::replay(&path).unwrap().unwrap();
        assert_eq!((r.bad_records, r.skipped_bytes), (1, size as u64));
        let mut slots: Vec<u32> = r.objects.keys().copied().collect();
        slots.sort();
        assert_eq!(slots, vec![0, 1, 2, 4, 5, 6, 7, 8, 9]);
        // Not a manifest at all: reported as such.
        std::fs::write(&path, [0xa5u8; 64]).unwrap();
        assert!(Manifest::replay(&path).unwrap().unwrap().garbage);
    }
}
