//! Slot generations: what guards a host slot against a copy that lands after the slot
//! changed hands (a store grant's copy still running when the daemon died, and landing
//! after a restart gave the slot to another page).
//!
//! The daemon numbers every allocation of a slot from one counter that never repeats
//! within an arena file's life (a restart that reopens the arena goes on above the
//! highest number given, kept in the file's header). Each allocation writes its number
//! twice: in the daemon's own table (`expected`, in its memory, which no engine can
//! write) and in the slot's stamp, a `u64` in `<arena>.stamps`, a file beside the
//! arena that engines map as they map the arena. A store grant carries each slot's
//! number; the client library stamps it after its copy into the slot is complete. A
//! commit keeps only pages whose stamps still
//! hold the numbers granted; a load grant carries them again, and the client library
//! checks the stamps after its copy out: a page with a stamp that differs is reported not
//! loaded (the engine recomputes it), never used.
//!
//! A late copy stamps its own, older number after its bytes: if those land in a slot
//! after another allocation, the stamp no longer matches and every later load of that
//! page misses. What remains: a late copy whose bytes land while a load or a new writer
//! is copying the slot, but whose stamp lands only after that copy's check. The restart
//! fence (`daemon::backend::fence`) keeps slots of open grants out of use after a
//! restart to make that window one the late copy must hit after its fence ended.
//!
//! The cost on the copy path is one 8-byte store per object after a store's copy and
//! one 8-byte load per object after a load's copy.
//!
//! File: `KVTSTMP1`, `u64` slot count, `u64` highest number given so far (64-byte
//! header), then one `u64` per slot. The highest number is kept apart from the stamps:
//! a late stamp may overwrite the highest one in a slot, and a reopen must not give it
//! out again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};

use super::host::SlotId;
use super::private::{self, PrivateError};

const MAGIC: &[u8; 8] = b"KVTSTMP1";
const HEADER: usize = 64;

/// Where the stamps of the arena at `arena` live.
pub fn stamps_path(arena: &Path) -> PathBuf {
    let mut p = arena.as_os_str().to_owned();
    p.push(".stamps");
    p.into()
}

/// Whether `map` (at least [`HEADER`] bytes) starts with the stamps header of `slots` slots.
fn header_is(map: &MmapRaw, slots: u32) -> bool {
    // SAFETY: every mapping of stamps is at least `HEADER` bytes long.
    let head = unsafe { std::slice::from_raw_parts(map.as_ptr(), 16) };
    &head[..8] == MAGIC && head[8..16] == (slots as u64).to_le_bytes()
}

/// One stamp per slot, in a mapping shared with every engine of the arena.
#[derive(Debug)]
pub struct SlotStamps {
    map: MmapRaw,
    slots: u32,
}

// SAFETY: every access to the mapping after set-up is through an `AtomicU64`.
unsafe impl Send for SlotStamps {}
// SAFETY: as for `Send`.
unsafe impl Sync for SlotStamps {}

fn io(path: &Path) -> impl Fn(std::io::Error) -> PrivateError + '_ {
    move |source| PrivateError::Io {
        path: path.to_owned(),
        source,
    }
}

impl SlotStamps {
    fn len(slots: u32) -> usize {
        HEADER + 8 * slots as usize
    }

    fn map(path: &Path, file: &std::fs::File, slots: u32) -> Result<Self, PrivateError> {
        let map = MmapOptions::new()
            .len(Self::len(slots))
            .map_raw(file)
            .map_err(io(path))?;
        Ok(Self { map, slots })
    }

    /// The daemon's stamps for an arena of `slots` slots, shared like the arena (with
    /// `group`, or private). `reopen`: the arena file was reopened, so engines of the
    /// earlier life may still hold this file mapped: it is kept, in place, when it is
    /// the daemon's own and of this arena's slot count (`Ok((stamps, true))`); otherwise
    /// it is replaced by a fresh one (and a late copy stamps the old inode, as its bytes
    /// land in the old arena's).
    pub fn create(path: &Path, slots: u32, group: Option<u32>, reopen: bool) -> Result<(Self, bool), PrivateError> {
        if reopen
            && let Ok(Some(file)) = private::open_existing_shared(path, true, group)
            && file.metadata().is_ok_and(|m| m.len() == Self::len(slots) as u64)
        {
            let s = Self::map(path, &file, slots)?;
            if header_is(&s.map, slots) {
                private::share_file(path, &file, group)?;
                return Ok((s, true));
            }
        }
        let file = private::replace(path)?;
        private::share_file(path, &file, group)?;
        file.set_len(Self::len(slots) as u64).map_err(io(path))?;
        let s = Self::map(path, &file, slots)?;
        // SAFETY: a fresh mapping that nobody else has yet.
        let head = unsafe { std::slice::from_raw_parts_mut(s.map.as_mut_ptr(), 16) };
        head[..8].copy_from_slice(MAGIC);
        head[8..16].copy_from_slice(&(slots as u64).to_le_bytes());
        Ok((s, false))
    }

    /// An engine's mapping of the daemon's stamps (the caller has checked the file's owner
    /// and mode, as for the arena). `None` when the file is not stamps of `slots` slots.
    pub fn open(path: &Path, slots: u32) -> std::io::Result<Option<Self>> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        if file.metadata()?.len() != Self::len(slots) as u64 {
            return Ok(None);
        }
        let map = MmapOptions::new().len(Self::len(slots)).map_raw(&file)?;
        if !header_is(&map, slots) {
            return Ok(None);
        }
        Ok(Some(Self { map, slots }))
    }

    fn cell(&self, slot: u32) -> Option<&AtomicU64> {
        if slot >= self.slots {
            return None;
        }
        // SAFETY: inside the mapping (checked above), 8-byte aligned (a page-aligned map,
        // a 64-byte header), and only ever accessed atomically.
        Some(unsafe { &*(self.map.as_ptr().add(HEADER + 8 * slot as usize) as *const AtomicU64) })
    }

    /// The highest number given so far (header bytes 16..24).
    fn high(&self) -> &AtomicU64 {
        // SAFETY: inside the header, 8-byte aligned, only ever accessed atomically.
        unsafe { &*(self.map.as_ptr().add(16) as *const AtomicU64) }
    }

    /// Stamps `slot` with `generation`, after the bytes written before it.
    pub fn stamp(&self, slot: u32, generation: u64) {
        if let Some(c) = self.cell(slot) {
            c.store(generation, Ordering::Release);
        }
    }

    /// The stamp of `slot` (0 outside the arena).
    pub fn read(&self, slot: u32) -> u64 {
        self.cell(slot).map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Whether every slot's stamp is `generation` (0 is never checked).
    pub fn hold(&self, slots: impl IntoIterator<Item = (u32, u64)>) -> bool {
        slots.into_iter().all(|(s, g)| g == 0 || self.read(s) == g)
    }
}

/// The daemon's side: the stamps, the generation each slot was last allocated at, and
/// the counter. Attached to the daemon's [`super::host::HostArena`], which numbers every
/// allocation through it.
#[derive(Debug)]
pub struct Generations {
    stamps: SlotStamps,
    expected: Box<[AtomicU64]>,
    next: AtomicU64,
}

impl Generations {
    /// Starts from `stamps`: with `kept` (a reopened file), each slot is expected at the
    /// stamp it holds (what recovered pages were written at) and numbering goes on above
    /// the highest; otherwise from 1.
    pub fn new(stamps: SlotStamps, kept: bool) -> Self {
        let n = stamps.slots;
        let expected: Box<[AtomicU64]> = (0..n)
            .map(|s| AtomicU64::new(if kept { stamps.read(s) } else { 0 }))
            .collect();
        let stamped = expected.iter().map(|e| e.load(Ordering::Relaxed)).max().unwrap_or(0);
        let top = if kept {
            stamped.max(stamps.high().load(Ordering::Relaxed))
        } else {
            stamped
        };
        Self {
            stamps,
            expected,
            next: AtomicU64::new(top + 1),
        }
    }

    /// Numbers a new allocation of `slot`.
    pub fn bump(&self, slot: SlotId) {
        if let Some(e) = self.expected.get(slot.0 as usize) {
            let g = self.next.fetch_add(1, Ordering::Relaxed);
            self.stamps.high().fetch_max(g, Ordering::Relaxed);
            e.store(g, Ordering::Relaxed);
            self.stamps.stamp(slot.0, g);
        }
    }

    /// The generation `slot` was last allocated at.
    pub fn expected(&self, slot: SlotId) -> u64 {
        self.expected
            .get(slot.0 as usize)
            .map_or(0, |e| e.load(Ordering::Relaxed))
    }

    /// Whether `slot`'s stamp is still the generation it was allocated at.
    pub fn holds(&self, slot: SlotId) -> bool {
        self.stamps.read(slot.0) == self.expected(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_stamp_of_an_earlier_allocation_is_seen_and_a_reopen_numbers_above_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = stamps_path(&dir.path().join("arena"));
        let (s, kept) = SlotStamps::create(&path, 4, None, true).unwrap();
        assert!(!kept);
        let g = Generations::new(s, false);
        g.bump(SlotId(2));
        let old = g.expected(SlotId(2));
        assert!(old > 0 && g.holds(SlotId(2)));
        g.bump(SlotId(2));
        assert!(g.holds(SlotId(2)) && g.expected(SlotId(2)) > old);
        // An engine's mapping: a writer of the first allocation stamps late.
        let engine = SlotStamps::open(&path, 4).unwrap().unwrap();
        assert!(engine.hold([(2, g.expected(SlotId(2)))]));
        engine.stamp(2, old);
        assert!(!g.holds(SlotId(2)));
        assert!(!engine.hold([(2, g.expected(SlotId(2)))]));
        assert!(engine.hold([(2, 0)]), "generation 0 is never checked");
        // A reopen keeps the file (the engine's mapping still counts) and numbers above it.
        let top = g.expected(SlotId(2));
        drop(g);
        let (s, kept) = SlotStamps::create(&path, 4, None, true).unwrap();
        assert!(kept);
        let g = Generations::new(s, true);
        assert_eq!(g.expected(SlotId(2)), old, "slot 2 is expected at what it holds");
        g.bump(SlotId(1));
        assert!(g.expected(SlotId(1)) > top);
        engine.stamp(1, 7);
        assert!(!g.holds(SlotId(1)));
        // Another slot count is another file.
        assert!(SlotStamps::open(&path, 5).unwrap().is_none());
    }
}
