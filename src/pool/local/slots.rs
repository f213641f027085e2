//! The local pool's slot table: one fixed-size record per pool slot, updated in place,
//! so that a restarted daemon finds which object each slot holds.
//!
//! The file sits beside the pool file (`<pool>.slots`) and is mapped shared: a record is
//! a plain memory write under the index lock, and it survives a SIGKILL like the pool's
//! bytes do (both are in the page cache of the same file system). A record is written
//! only after its object's bytes are in place, and cleared before its slot is reused or
//! as soon as its object leaves the index, so a record that checks out always describes
//! the bytes in its slot. The file never grows: it is `HEADER + RECORD * slots` bytes.
//!
//! Header: `KVTPSLT1`, `u64` slot size, `u64` slot count. Record (256 bytes): `u64`
//! sequence (0: empty; later puts have larger ones, so of two records of one key the
//! later wins), `u32` object length, `u16` key length, 2 reserved bytes, `u64` xxh3 of
//! the object's bytes, `u64` xxh3 of the record's first 24 bytes and its key, then the
//! key. A key longer than [`KEY_MAX`] is not recorded (the object is lost on restart,
//! and counted).

use std::path::Path;

use memmap2::{MmapOptions, MmapRaw};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

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
    pub sum: u64,
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
    pub fn open(path: &Path, slots: u32, slot_bytes: u64) -> std::io::Result<Option<(Self, Vec<Found>)>> {
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
        for slot in 0..slots {
            if let Some(f) = t.read(slot, slot_bytes) {
                t.next_seq = t.next_seq.max(f.seq + 1);
                found.push(f);
            } else {
                t.clear(slot);
            }
        }
        Ok(Some((t, found)))
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

    fn read(&self, slot: u32, slot_bytes: u64) -> Option<Found> {
        let r = self.bytes(Self::at(slot), RECORD);
        let u64_at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().unwrap_or_default());
        let seq = u64_at(0);
        let len = u32::from_le_bytes(r[8..12].try_into().ok()?) as usize;
        let key_len = u16::from_le_bytes(r[12..14].try_into().ok()?) as usize;
        if seq == 0 || key_len > KEY_MAX || len as u64 > slot_bytes {
            return None;
        }
        let key = &r[FIXED..FIXED + key_len];
        if record_sum(&r[..24], key) != u64_at(24) {
            return None;
        }
        Some(Found {
            slot,
            seq,
            key: std::str::from_utf8(key).ok()?.to_owned(),
            len,
            sum: u64_at(16),
        })
    }

    /// Records that `slot` holds `key`'s object of `len` bytes whose xxh3 is `sum`. The
    /// bytes must already be in the slot. A key too long to record leaves the slot empty
    /// here (and is counted): the object lives until a restart.
    pub fn set(&mut self, slot: u32, key: &str, len: usize, sum: u64) {
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
        fixed[16..24].copy_from_slice(&sum.to_le_bytes());
        let check = record_sum(&fixed, key.as_bytes());
        // The object's bytes were written before this record: keep the compiler from
        // moving those stores past it (a SIGKILL keeps every store made before it).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let r = self.bytes_mut(Self::at(slot), RECORD);
        r[..24].copy_from_slice(&fixed);
        r[24..32].copy_from_slice(&check.to_le_bytes());
        r[FIXED..FIXED + key.len()].copy_from_slice(key.as_bytes());
    }

    /// The slot holds nothing any more (its object was removed, replaced or evicted).
    pub fn clear(&mut self, slot: u32) {
        if slot >= self.slots {
            return;
        }
        let r = self.bytes_mut(Self::at(slot), FIXED);
        if r[..8] != [0u8; 8] {
            r.fill(0);
        }
        // The slot's next bytes go in only after this.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

fn record_sum(fixed: &[u8], key: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(fixed);
    h.update(key);
    h.digest()
}

/// The xxh3 of an object's bytes, as records keep it.
pub(super) fn object_sum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_a_reopen_and_broken_ones_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.slots");
        let mut t = SlotTable::create(&path, 8, 4096).unwrap();
        t.set(1, "a", 100, 7);
        t.set(3, "b", 4096, 9);
        t.set(5, "c", 1, 1);
        t.clear(5);
        t.set(6, &"x".repeat(KEY_MAX + 1), 10, 1);
        assert_eq!(t.unrecorded, 1);
        t.set(2, "a", 50, 8);
        drop(t);
        // Break slot 3's record.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[HEADER + RECORD * 3 + FIXED] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let (t, found) = SlotTable::open(&path, 8, 4096).unwrap().unwrap();
        let got: Vec<_> = found.iter().map(|f| (f.slot, f.key.as_str(), f.len, f.sum)).collect();
        assert_eq!(got, vec![(1, "a", 100, 7), (2, "a", 50, 8)]);
        assert!(
            found[1].seq > found[0].seq,
            "the later put of a key has the larger sequence"
        );
        assert!(t.next_seq > found[1].seq);
        // Another geometry is not this table.
        assert!(SlotTable::open(&path, 9, 4096).unwrap().is_none());
        assert!(SlotTable::open(&path, 8, 2048).unwrap().is_none());
        assert!(SlotTable::open(&dir.path().join("none"), 8, 4096).unwrap().is_none());
    }
}
