//! The local pool's slot table: one fixed-size record per pool slot, updated in place,
//! so that a restarted daemon finds which object each slot holds.
//!
//! The file sits beside the pool file (`<pool>.slots`) and is mapped shared: a record is
//! a plain memory write under the index lock, and it survives a SIGKILL like the pool's
//! bytes do (both are in the page cache of the same file system).
//!
//! **Commit order, not checksums of the bytes.** A slot's record is cleared before the
//! slot is handed to a put (and as soon as its object leaves the index), the put writes
//! the object's bytes, and only then is the record written, behind a release fence and
//! with its sequence number last. A SIGKILL cannot undo a store already made to a shared
//! mapping, so a record that checks out at reopen implies its bytes were all in place
//! first; a record the kill cut short fails its header checksum (or still reads empty)
//! and is dropped. Power loss is out of scope: the pool lives in memory-backed
//! `/dev/shm`, so it is gone after one anyway. (An xxh3 of every object's bytes, taken on
//! every put to check them at reopen, was 44 % of host→pool's samples at 16 and 64 KiB,
//! more than the copy: see docs/ARCHITECTURE.md.)
//!
//! Header: `KVTPSLT1`, `u64` slot size, `u64` slot count. Record (256 bytes): `u64`
//! sequence (0: empty; later puts have larger ones, so of two records of one key the
//! later wins), `u32` object length, `u16` key length, 2 reserved bytes, 8 reserved bytes
//! (written 0; tables of earlier versions kept an xxh3 of the bytes there), `u64` xxh3 of
//! the record's first 24 bytes and its key, then the key. A key longer than [`KEY_MAX`]
//! is not recorded (the object is lost on restart, and counted).

use std::path::Path;

use memmap2::{MmapOptions, MmapRaw};
use std::sync::atomic::{AtomicU64, Ordering, fence};

use xxhash_rust::xxh3::Xxh3;

const MAGIC: &[u8; 8] = b"KVTPSLT1";
const HEADER: usize = 64;
/// Bytes per slot record.
pub(super) const RECORD: usize = 256;
const FIXED: usize = 32;
/// Longest key a record holds.
pub(super) const KEY_MAX: usize = RECORD - FIXED;

/// A record read back at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Found {
    pub slot: u32,
    pub seq: u64,
    pub key: String,
    pub len: usize,
}

/// A table opened at start: the records that check out, and how many were torn.
#[derive(Debug)]
pub(super) struct Opened {
    pub table: SlotTable,
    pub found: Vec<Found>,
    /// Records that were being written or cleared when the earlier life ended (their
    /// header checksum fails): dropped, their slots empty.
    pub torn: u64,
}

/// The mapped slot table. Only the pool's index writes it, under the index lock.
#[derive(Debug)]
pub(super) struct SlotTable {
    map: MmapRaw,
    slots: u32,
    next_seq: u64,
    /// Objects whose key was too long to record.
    pub unrecorded: u64,
}

// SAFETY: the mapping is only written through `&mut self` (the index lock) and read at
// open; the raw pointer is not shared outside this type.
unsafe impl Send for SlotTable {}

fn io_at(path: &Path) -> impl Fn(std::io::Error) -> std::io::Error + '_ {
    move |e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn private(e: crate::tier::private::PrivateError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

fn file_len(slots: u32) -> u64 {
    HEADER as u64 + RECORD as u64 * slots as u64
}

impl SlotTable {
    /// The table file mapped whole, with no record read yet.
    fn mapped(file: &std::fs::File, path: &Path, slots: u32) -> std::io::Result<Self> {
        let map = MmapOptions::new()
            .len(file_len(slots) as usize)
            .map_raw(file)
            .map_err(io_at(path))?;
        Ok(Self {
            map,
            slots,
            next_seq: 1,
            unrecorded: 0,
        })
    }

    /// A fresh, empty table for `slots` slots of `slot_bytes` (whatever was at `path` is
    /// replaced, never followed).
    pub fn create(path: &Path, slots: u32, slot_bytes: u64) -> std::io::Result<Self> {
        let file = crate::tier::private::replace(path).map_err(private)?;
        file.set_len(file_len(slots)).map_err(io_at(path))?;
        let mut t = Self::mapped(&file, path, slots)?;
        let head = t.bytes_mut(0, HEADER);
        head[..8].copy_from_slice(MAGIC);
        head[8..16].copy_from_slice(&slot_bytes.to_le_bytes());
        head[16..24].copy_from_slice(&(slots as u64).to_le_bytes());
        Ok(t)
    }

    /// The daemon's own table at `path` (a private file of its uid, never through a
    /// symlink) when it exists and was written for `slots` slots of `slot_bytes`, with
    /// every record that checks out. `Ok(None)`: no such table (missing, or of another
    /// geometry, or not a slot table), so the pool starts empty.
    pub fn open(path: &Path, slots: u32, slot_bytes: u64) -> std::io::Result<Option<Opened>> {
        let Some(file) = crate::tier::private::open_existing(path, true).map_err(private)? else {
            return Ok(None);
        };
        if file.metadata().map_err(io_at(path))?.len() != file_len(slots) {
            return Ok(None);
        }
        let mut t = Self::mapped(&file, path, slots)?;
        let head = t.bytes(0, HEADER);
        if &head[..8] != MAGIC
            || head[8..16] != slot_bytes.to_le_bytes()
            || head[16..24] != (slots as u64).to_le_bytes()
        {
            return Ok(None);
        }
        let mut found = Vec::new();
        let mut torn = 0;
        for slot in 0..slots {
            match t.read(slot, slot_bytes) {
                Read::Record(f) => {
                    t.next_seq = t.next_seq.max(f.seq + 1);
                    found.push(f);
                }
                Read::Empty => {}
                Read::Torn => {
                    torn += 1;
                    t.clear(slot);
                }
            }
        }
        Ok(Some(Opened { table: t, found, torn }))
    }

    fn bytes(&self, at: usize, len: usize) -> &[u8] {
        debug_assert!(at + len <= self.map.len());
        // SAFETY: in bounds of the mapping; only this type writes it, through `&mut self`.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), len) }
    }

    fn bytes_mut(&mut self, at: usize, len: usize) -> &mut [u8] {
        debug_assert!(at + len <= self.map.len());
        // SAFETY: in bounds of the mapping; `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(at), len) }
    }

    fn at(slot: u32) -> usize {
        HEADER + RECORD * slot as usize
    }

    fn read(&self, slot: u32, slot_bytes: u64) -> Read {
        let r = self.bytes(Self::at(slot), RECORD);
        let u64_at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().unwrap_or_default());
        let seq = u64_at(0);
        if seq == 0 {
            return Read::Empty;
        }
        let len = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default()) as usize;
        let key_len = u16::from_le_bytes(r[12..14].try_into().unwrap_or_default()) as usize;
        if key_len > KEY_MAX || len as u64 > slot_bytes {
            return Read::Torn;
        }
        let key = &r[FIXED..FIXED + key_len];
        if record_sum(&r[..24], key) != u64_at(24) {
            return Read::Torn;
        }
        match std::str::from_utf8(key) {
            Ok(key) => Read::Record(Found {
                slot,
                seq,
                key: key.to_owned(),
                len,
            }),
            Err(_) => Read::Torn,
        }
    }

    /// Records that `slot` holds `key`'s object of `len` bytes. The bytes must already be
    /// in the slot, written by this thread or by one this thread has synchronized with
    /// since (a lock, a channel): the fence below then keeps every one of them ahead of
    /// the record. A key too long to record leaves the slot empty here (and is counted):
    /// the object lives until a restart.
    pub fn set(&mut self, slot: u32, key: &str, len: usize) {
        if slot >= self.slots {
            return;
        }
        if key.len() > KEY_MAX {
            self.unrecorded += 1;
            self.clear(slot);
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut fixed = [0u8; 24];
        fixed[..8].copy_from_slice(&seq.to_le_bytes());
        fixed[8..12].copy_from_slice(&(len as u32).to_le_bytes());
        fixed[12..14].copy_from_slice(&(key.len() as u16).to_le_bytes());
        let check = record_sum(&fixed, key.as_bytes());
        // The object's bytes are in the slot: no store of the record may be made before
        // them (a SIGKILL keeps every store made before it, none after).
        fence(Ordering::Release);
        let r = self.bytes_mut(Self::at(slot), RECORD);
        r[FIXED..FIXED + key.len()].copy_from_slice(key.as_bytes());
        r[8..24].copy_from_slice(&fixed[8..]);
        r[24..32].copy_from_slice(&check.to_le_bytes());
        // The sequence last, published with release ordering: until it is in, the record
        // reads empty, and once it is, everything above (and the bytes) is in too.
        self.seq_word(slot).store(seq.to_le(), Ordering::Release);
    }

    /// The sequence word of `slot`'s record, for its ordered stores.
    fn seq_word(&mut self, slot: u32) -> &AtomicU64 {
        let at = Self::at(slot);
        debug_assert!(at + 8 <= self.map.len());
        // SAFETY: in bounds; 8-aligned (the mapping is page-aligned, the header 64 bytes
        // and records 256); `&mut self` makes this the only access, and the mapping
        // outlives the borrow.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(at).cast::<u64>()) }
    }

    /// The slot holds nothing any more (its object was removed, replaced or evicted).
    pub fn clear(&mut self, slot: u32) {
        if slot >= self.slots {
            return;
        }
        if self.bytes(Self::at(slot), FIXED) != [0u8; FIXED] {
            // The sequence first: from then on the record reads empty.
            self.seq_word(slot).store(0, Ordering::Release);
            fence(Ordering::Release);
            self.bytes_mut(Self::at(slot) + 8, FIXED - 8).fill(0);
        }
        // The slot's next bytes are written only after this: a release fence orders the
        // stores above before every later one (x86 keeps stores in order anyway; on Arm it
        // is a store barrier), and the compiler moves no memory access across it.
        fence(Ordering::Release);
    }
}

/// One slot's record as read at open.
enum Read {
    Record(Found),
    Empty,
    /// Being written or cleared when the earlier life ended.
    Torn,
}

fn record_sum(fixed: &[u8], key: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(fixed);
    h.update(key);
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_a_reopen_and_torn_ones_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.slots");
        let mut t = SlotTable::create(&path, 8, 4096).unwrap();
        t.set(1, "a", 100);
        t.set(3, "b", 4096);
        t.set(5, "c", 1);
        t.clear(5);
        t.set(6, &"x".repeat(KEY_MAX + 1), 10);
        assert_eq!(t.unrecorded, 1);
        t.set(2, "a", 50);
        t.set(4, "d", 7);
        t.set(7, "e", 8);
        drop(t);
        let mut bytes = std::fs::read(&path).unwrap();
        // Slot 3: a key byte changed (a record cut short mid-write).
        bytes[HEADER + RECORD * 3 + FIXED] ^= 1;
        // Slot 4: a clear cut short after its sequence word (reads empty).
        bytes[HEADER + RECORD * 4..HEADER + RECORD * 4 + 8].fill(0);
        // Slot 7: a write cut short before its sequence word: as if its length were
        // still zero.
        bytes[HEADER + RECORD * 7 + 8..HEADER + RECORD * 7 + 12].fill(0);
        std::fs::write(&path, &bytes).unwrap();
        let o = SlotTable::open(&path, 8, 4096).unwrap().unwrap();
        let got: Vec<_> = o.found.iter().map(|f| (f.slot, f.key.as_str(), f.len)).collect();
        assert_eq!(got, vec![(1, "a", 100), (2, "a", 50)]);
        assert_eq!(o.torn, 2, "slots 3 and 7");
        assert!(
            o.found[1].seq > o.found[0].seq,
            "the later put of a key has the larger sequence"
        );
        assert!(o.table.next_seq > o.found[1].seq);
        drop(o);
        // The torn records were cleared at open: a second open finds no torn one.
        let o = SlotTable::open(&path, 8, 4096).unwrap().unwrap();
        assert_eq!((o.found.len(), o.torn), (2, 0));
        drop(o);
        // Another geometry is not this table.
        assert!(SlotTable::open(&path, 9, 4096).unwrap().is_none());
        assert!(SlotTable::open(&path, 8, 2048).unwrap().is_none());
        assert!(SlotTable::open(&dir.path().join("none"), 8, 4096).unwrap().is_none());
    }
}
