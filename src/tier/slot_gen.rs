//! Slot generations: what guards a host slot against a copy that lands after the slot
//! changed hands (a store grant's copy still running when the daemon died, or when its
//! connection dropped, and landing after the slot went to another page).
//!
//! The daemon numbers every allocation of a slot from one counter that never repeats
//! within an arena file's life (a restart that reopens the arena goes on above the
//! highest number given, kept in the file's header). Each allocation writes its number
//! twice: in the daemon's own table (`expected`, in its memory, which no engine can
//! write) and in the slot's stamp, a `u64` in `<arena>.stamps`, a file beside the
//! arena that engines map as they map the arena. A store grant carries each slot's
//! number `g`; a load grant carries it again.
//!
//! A store's copy stamps in two phases ([`SlotStamps::begin_copy`],
//! [`SlotStamps::end_copy`]): before its bytes it swaps in `marker(g)` (`g` with the top
//! bit set, a value no grant ever carries: the counter never reaches 2^63), then a full
//! fence, then the bytes, then a compare-and-swap from `marker(g)` back to `g` (release:
//! after the bytes). A load copies its bytes out, then a full fence, then reads the
//! stamps: a page counts only when every stamp is exactly its grant's `g`. A commit (the
//! daemon) and a load grant (the daemon) check the same. Why that closes the window of a
//! late copy `L` (number `o`) against the current occupant `W` (number `g`) and a load
//! `R` of `W`'s page (every store to one stamp is in one modification order):
//!
//! * `R` read a byte of `L`'s: `L`'s marker precedes that byte (fence), and `R`'s stamp
//!   read follows it (fence), so `R` reads `L`'s marker or a later value. Later values are
//!   `L`'s `o`, another late copy's, or `W`'s `g` only if `W`'s final CAS came after `L`'s
//!   marker: but that CAS expects `marker(g)` and fails on anything `L` wrote, and then
//!   `W` reports the page not written and the daemon's commit check sees no `g`. So `R`
//!   sees something other than `g`, and reports the page (and every later one) missing.
//! * `L`'s marker came before `W`'s swap: `W`'s swap returns it (or `o`), not `g`. A
//!   foreign marker means a copy is still running: `W` reports the page not written and
//!   its CAS puts that marker back (so the next writer sees it too); the commit drops the
//!   page. (A number other than `g`, not a marker, means that copy ended before `W`'s
//!   began: its bytes are all under `W`'s, and `W` stamps `g`.)
//! * `L`'s marker came before the daemon numbered the allocation: [`Generations::bump`]
//!   leaves a marker in place (compare-and-swap), so `W` sees it as above.
//!
//! So a copy of the library that overlaps a load's copy or a writer's copy is seen by
//! that load's check or that commit's. What remains: a marker the daemon overwrites: a
//! slot found in copy at allocation is taken over once `host.fence_timeout_ms` has passed
//! since the daemon first found it so (a copy that never ends, its process killed
//! mid-copy, would keep the slot from every page otherwise); a copy still running after
//! that lands unseen until its final stamp. Libraries of earlier versions, which stamp
//! only after their bytes, are seen only once that stamp lands. The restart fence
//! (`daemon::backend::fence`) keeps slots of open grants out of use after a restart, so a
//! late copy must also outlast that.
//!
//! The cost on the copy path is two 8-byte atomic read-modify-writes per object around a
//! store's copy (one more than a plain stamp after it) and a fence per batch, and one
//! 8-byte load per object after a load's copy.
//!
//! File: `KVTSTMP1`, `u64` slot count, `u64` highest number given so far (64-byte
//! header), then one `u64` per slot. The highest number is kept apart from the stamps:
//! a late stamp may overwrite the highest one in a slot, and a reopen must not give it
//! out again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;

use super::host::SlotId;
use super::private::{self, PrivateError};

const MAGIC: &[u8; 8] = b"KVTSTMP1";
const HEADER: usize = 64;
/// The bit a stamp carries while a store's copy into its slot runs (no generation has it).
const IN_COPY: u64 = 1 << 63;

/// Whether `stamp` says a store's copy into the slot is running.
pub fn in_copy(stamp: u64) -> bool {
    stamp & IN_COPY != 0
}

/// The stamp of a slot while the copy of generation `g` into it runs.
pub fn marker(g: u64) -> u64 {
    g | IN_COPY
}

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

    /// Phase one of a store's copy of generation `g` into `slot`: swaps in `marker(g)` and
    /// returns what the stamp held. The caller fences ([`copy_fence`]) before its bytes.
    pub fn begin_copy(&self, slot: u32, g: u64) -> u64 {
        self.cell(slot).map_or(g, |c| c.swap(marker(g), Ordering::AcqRel))
    }

    /// Phase two, after the bytes: stamps `g` where the stamp is still `marker(g)`, unless
    /// phase one found another copy's marker, which goes back (that copy still runs).
    /// Returns whether the slot now vouches for this copy's bytes: phase one found no
    /// other copy running and no store to the stamp came between the two phases.
    pub fn end_copy(&self, slot: u32, g: u64, before: u64) -> bool {
        let Some(c) = self.cell(slot) else { return false };
        let other = in_copy(before) && before != marker(g);
        let end = if other { before } else { g };
        c.compare_exchange(marker(g), end, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            && !other
    }

    /// The stamp of `slot` (0 outside the arena).
    pub fn read(&self, slot: u32) -> u64 {
        self.cell(slot).map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Whether every slot's stamp is `generation` (0 is never checked; a marker never
    /// holds). After a load's copy, call [`copy_fence`] first.
    pub fn hold(&self, slots: impl IntoIterator<Item = (u32, u64)>) -> bool {
        slots
            .into_iter()
            .all(|(s, g)| g == 0 || (!in_copy(g) && self.read(s) == g))
    }
}

/// The fence between a copy's bytes and its stamps: after a store's markers and before
/// its bytes; after a load's bytes and before its check. Full, so that neither the byte
/// stores (or loads) nor the stamp accesses move across it on any CPU.
pub fn copy_fence() {
    std::sync::atomic::fence(Ordering::SeqCst);
}

/// The daemon's side: the stamps, the generation each slot was last allocated at, and
/// the counter. Attached to the daemon's [`super::host::HostArena`], which numbers every
/// allocation through it.
#[derive(Debug)]
pub struct Generations {
    stamps: SlotStamps,
    expected: Box<[AtomicU64]>,
    next: AtomicU64,
    /// How long a slot found in copy at allocation keeps its marker (the fence timeout).
    patience: Duration,
    /// Slots found in copy at an allocation: the marker, and when it was first found.
    in_copy: Mutex<HashMap<u32, (u64, Instant)>>,
}

impl Generations {
    /// Starts from `stamps`: with `kept` (a reopened file), each slot is expected at the
    /// stamp it holds (what recovered pages were written at; a marker, which never holds,
    /// for a slot a copy was writing) and numbering goes on above the highest; otherwise
    /// from 1. A slot found in copy at an allocation keeps its marker for `patience`.
    pub fn new(stamps: SlotStamps, kept: bool, patience: Duration) -> Self {
        let n = stamps.slots;
        let expected: Box<[AtomicU64]> = (0..n)
            .map(|s| AtomicU64::new(if kept { stamps.read(s) } else { 0 }))
            .collect();
        let stamped = expected
            .iter()
            .map(|e| e.load(Ordering::Relaxed) & !IN_COPY)
            .max()
            .unwrap_or(0);
        let top = if kept {
            stamped.max(stamps.high().load(Ordering::Relaxed))
        } else {
            stamped
        };
        Self {
            stamps,
            expected,
            next: AtomicU64::new(top + 1),
            patience,
            in_copy: Mutex::new(HashMap::new()),
        }
    }

    /// Numbers a new allocation of `slot`. A slot still in another copy (its stamp a
    /// marker) keeps the marker, so the new writer's copy and its commit see it, until
    /// `patience` has passed since an allocation first found it.
    pub fn bump(&self, slot: SlotId) {
        let (Some(e), Some(cell)) = (self.expected.get(slot.0 as usize), self.stamps.cell(slot.0)) else {
            return;
        };
        let g = self.next.fetch_add(1, Ordering::Relaxed);
        self.stamps.high().fetch_max(g, Ordering::Relaxed);
        e.store(g, Ordering::Relaxed);
        let mut cur = cell.load(Ordering::Acquire);
        loop {
            if in_copy(cur) && !self.overdue(slot.0, cur) {
                return;
            }
            match cell.compare_exchange_weak(cur, g, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// Whether the marker `stamp` of `slot` has outlasted `patience` (found first now: no).
    fn overdue(&self, slot: u32, stamp: u64) -> bool {
        let mut seen = self.in_copy.lock();
        seen.retain(|&s, &mut (m, _)| self.stamps.read(s) == m);
        match seen.get(&slot) {
            Some(&(m, since)) if m == stamp => {
                let over = since.elapsed() >= self.patience;
                if over {
                    seen.remove(&slot);
                    tracing::warn!("a host slot stayed in another copy past the fence timeout; it is taken over");
                }
                over
            }
            _ => {
                seen.insert(slot, (stamp, Instant::now()));
                tracing::warn!(
                    "a host slot is still being written by another grant's copy; pages granted it are not kept until that copy ends"
                );
                false
            }
        }
    }

    /// The generation `slot` was last allocated at.
    pub fn expected(&self, slot: SlotId) -> u64 {
        self.expected
            .get(slot.0 as usize)
            .map_or(0, |e| e.load(Ordering::Relaxed))
    }

    /// Whether `slot`'s stamp is still the generation it was allocated at (never while a
    /// copy is running into it).
    pub fn holds(&self, slot: SlotId) -> bool {
        let stamp = self.stamps.read(slot.0);
        stamp == self.expected(slot) && !in_copy(stamp)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    #[test]
    fn a_late_stamp_of_an_earlier_allocation_is_seen_and_a_reopen_numbers_above_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = stamps_path(&dir.path().join("arena"));
        let (s, kept) = SlotStamps::create(&path, 4, None, true).unwrap();
        assert!(!kept);
        let g = Generations::new(s, false, Duration::from_secs(30));
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
        let g = Generations::new(s, true, Duration::from_secs(30));
        assert_eq!(g.expected(SlotId(2)), old, "slot 2 is expected at what it holds");
        g.bump(SlotId(1));
        assert!(g.expected(SlotId(1)) > top);
        engine.stamp(1, 7);
        assert!(!g.holds(SlotId(1)));
        // Another slot count is another file.
        assert!(SlotStamps::open(&path, 5).unwrap().is_none());
    }

    /// A daemon's generations over 4 slots (with `patience`) and two engines' mappings.
    fn engines(dir: &Path, patience: Duration) -> (Generations, SlotStamps, SlotStamps) {
        let path = stamps_path(&dir.join("arena"));
        let (s, _) = SlotStamps::create(&path, 4, None, false).unwrap();
        let g = Generations::new(s, false, patience);
        let open = || SlotStamps::open(&path, 4).unwrap().unwrap();
        (g, open(), open())
    }

    /// A load's copy of a slot into `out`, a byte at a time, with `between` run after the
    /// first half (another copy landing while it runs); then the fence and the check.
    fn load(slot: &RefCell<Vec<u8>>, out: &mut Vec<u8>, between: impl FnOnce(), stamps: &SlotStamps, g: u64) -> bool {
        out.clear();
        out.extend_from_slice(&slot.borrow()[..32]);
        between();
        out.extend_from_slice(&slot.borrow()[32..]);
        copy_fence();
        stamps.hold([(1, g)])
    }

    #[test]
    fn a_late_copy_whose_bytes_land_during_a_load_is_seen_by_that_loads_check() {
        let dir = tempfile::tempdir().unwrap();
        let (gens, w, l) = engines(dir.path(), Duration::from_secs(3600));
        // The late copy's grant had slot 1 first; the slot now holds W's page.
        gens.bump(SlotId(1));
        let old = gens.expected(SlotId(1));
        gens.bump(SlotId(1));
        let g = gens.expected(SlotId(1));
        let slot = RefCell::new(vec![0u8; 64]);
        let before = w.begin_copy(1, g);
        assert_eq!(before, g, "nobody else is in copy");
        copy_fence();
        slot.borrow_mut().fill(0xbb);
        assert!(w.end_copy(1, g, before), "W's copy vouches for its bytes");
        assert!(gens.holds(SlotId(1)), "W's commit keeps the page");
        let mut out = Vec::new();
        assert!(load(&slot, &mut out, || (), &w, g));
        assert_eq!(out, vec![0xbb; 64]);
        // L's marker and bytes land while a load copies; its final stamp comes after the
        // load's check (the window a single stamp after the bytes left open).
        let mut l_before = 0;
        let held = load(
            &slot,
            &mut out,
            || {
                l_before = l.begin_copy(1, old);
                copy_fence();
                slot.borrow_mut().fill(0xee);
            },
            &w,
            g,
        );
        let mut torn = vec![0xbb; 32];
        torn.extend([0xee; 32]);
        assert_eq!(out, torn, "half of what the load copied is L's");
        assert!(!held, "the load sees L's marker, not W's number");
        assert!(!load(&slot, &mut out, || (), &w, g), "and so does every later load");
        assert_eq!(w.read(1), marker(old));
        assert!(!gens.holds(SlotId(1)), "the daemon's check at a load grant sees it too");
        // L ends: its own, older number; the page still never holds.
        assert_eq!(l_before, g);
        l.end_copy(1, old, l_before);
        assert_eq!(w.read(1), old);
        assert!(!gens.holds(SlotId(1)) && !w.hold([(1, g)]));
    }

    #[test]
    fn a_writer_overlapped_by_another_copy_does_not_vouch_for_its_page() {
        let dir = tempfile::tempdir().unwrap();
        let (gens, w, l) = engines(dir.path(), Duration::from_secs(3600));
        gens.bump(SlotId(1));
        let old = gens.expected(SlotId(1));
        // L starts before W: W's swap finds L's marker, puts it back, and reports the page
        // not written; the commit check drops it.
        gens.bump(SlotId(1));
        let g = gens.expected(SlotId(1));
        let lb = l.begin_copy(1, old);
        let wb = w.begin_copy(1, g);
        assert_eq!((lb, wb), (g, marker(old)));
        assert!(!w.end_copy(1, g, wb), "another copy was running");
        assert_eq!(w.read(1), marker(old), "its marker goes back");
        assert!(!gens.holds(SlotId(1)));
        l.end_copy(1, old, lb);
        assert!(!gens.holds(SlotId(1)));
        // L starts while W copies: W's final compare-and-swap fails.
        gens.bump(SlotId(1));
        let g = gens.expected(SlotId(1));
        let wb = w.begin_copy(1, g);
        assert_eq!(wb, g);
        let lb = l.begin_copy(1, old);
        assert!(!w.end_copy(1, g, wb), "a store to the stamp came between W's phases");
        assert!(!gens.holds(SlotId(1)));
        assert!(!l.end_copy(1, old, lb), "L found W's marker: it vouches for nothing");
        assert!(in_copy(w.read(1)), "and leaves W's marker: W may still be copying");
        assert!(!gens.holds(SlotId(1)));
        // L ended before W started (its number, no marker): its bytes are all under W's.
        let path = stamps_path(&dir.path().join("arena"));
        let (s, _) = SlotStamps::create(&path, 4, None, false).unwrap();
        let gens = Generations::new(s, false, Duration::from_secs(3600));
        let (w, l) = (
            SlotStamps::open(&path, 4).unwrap().unwrap(),
            SlotStamps::open(&path, 4).unwrap().unwrap(),
        );
        gens.bump(SlotId(1));
        let old = gens.expected(SlotId(1));
        gens.bump(SlotId(1));
        let g = gens.expected(SlotId(1));
        let lb = l.begin_copy(1, old);
        l.end_copy(1, old, lb);
        let wb = w.begin_copy(1, g);
        assert_eq!(wb, old);
        assert!(w.end_copy(1, g, wb));
        assert!(gens.holds(SlotId(1)) && w.hold([(1, g)]));
    }

    #[test]
    fn an_allocation_keeps_another_copys_marker_until_the_fence_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let (gens, w, l) = engines(dir.path(), Duration::from_secs(3600));
        gens.bump(SlotId(1));
        let old = gens.expected(SlotId(1));
        let lb = l.begin_copy(1, old);
        // The slot is allocated again while L is still copying into it (its marker landed
        // before the allocation): the marker stays, so W and the commit see it.
        gens.bump(SlotId(1));
        let g = gens.expected(SlotId(1));
        assert_eq!(w.read(1), marker(old));
        let wb = w.begin_copy(1, g);
        assert!(!w.end_copy(1, g, wb));
        assert!(!gens.holds(SlotId(1)));
        gens.bump(SlotId(1));
        assert_eq!(w.read(1), marker(old), "still within the timeout");
        // Once L ends, the next allocation stamps its own number.
        l.end_copy(1, old, lb);
        gens.bump(SlotId(1));
        assert_eq!(w.read(1), gens.expected(SlotId(1)));
        assert!(gens.holds(SlotId(1)));
        // A copy that never ends (its process killed mid-copy) is taken over once the
        // timeout has passed since an allocation first found it (here: at once).
        let dir = tempfile::tempdir().unwrap();
        let (gens, w, l) = engines(dir.path(), Duration::ZERO);
        gens.bump(SlotId(2));
        l.begin_copy(2, gens.expected(SlotId(2)));
        gens.bump(SlotId(2));
        assert!(in_copy(w.read(2)), "first found in copy: kept");
        gens.bump(SlotId(2));
        assert_eq!(w.read(2), gens.expected(SlotId(2)), "past the timeout: taken over");
        assert!(gens.holds(SlotId(2)));
    }

    #[test]
    fn a_slot_reopened_in_copy_never_holds_and_numbering_ignores_the_marker_bit() {
        let dir = tempfile::tempdir().unwrap();
        let path = stamps_path(&dir.path().join("arena"));
        let (s, _) = SlotStamps::create(&path, 4, None, false).unwrap();
        let gens = Generations::new(s, false, Duration::from_secs(3600));
        gens.bump(SlotId(3));
        let g = gens.expected(SlotId(3));
        let engine = SlotStamps::open(&path, 4).unwrap().unwrap();
        engine.begin_copy(3, g);
        drop(gens);
        let (s, kept) = SlotStamps::create(&path, 4, None, true).unwrap();
        assert!(kept);
        let gens = Generations::new(s, true, Duration::from_secs(3600));
        assert_eq!(gens.expected(SlotId(3)), marker(g));
        assert!(!gens.holds(SlotId(3)), "a slot in copy at the restart never holds");
        assert!(
            !engine.hold([(3, marker(g))]),
            "nor does a grant that carries its marker"
        );
        gens.bump(SlotId(0));
        assert_eq!(gens.expected(SlotId(0)), g + 1, "numbering goes on above g, not 2^63");
    }
}
