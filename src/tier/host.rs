//! The host arena: a shared-memory file cut into fixed-size object slots.
//!
//! The slot size is either given ([`HostArena::create`]) or fitted to the first layout
//! that needs it: [`HostArena::create_unfitted`] maps and touches the file at start,
//! before any engine has said how large its objects are, and [`Unfitted::fit`] cuts it
//! into slots of one object each, so a slot holds an object with under 64 bytes to
//! spare instead of a fixed 2 MiB.
//!
//! The daemon creates the file (under `/dev/shm` by default) and maps it; engine processes
//! map the same file to copy device pages in and out without the bytes ever crossing the
//! control socket. Slots are allocated from a free stack in O(1). The mapping is touched
//! in parallel at start so that the first copies do not pay page faults, and locked in
//! memory where the system allows it (when it does not, that is reported, not fatal).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::mapping::SharedMap;

mod free_list;

use free_list::FreeList;

/// Index of one fixed-size slot in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct SlotId(pub u32);

#[derive(Debug, thiserror::Error)]
pub enum ArenaError {
    #[error("arena file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("arena of {capacity} bytes holds no slot of {slot_bytes} bytes")]
    TooSmall { capacity: u64, slot_bytes: u64 },
    #[error("slot size must be a non-zero multiple of 64 bytes, got {0}")]
    SlotSize(u64),
    #[error("slot {0} is outside the arena")]
    BadSlot(u32),
    #[error("{len} bytes do not fit a slot of {slot_bytes} bytes")]
    WrongSize { len: usize, slot_bytes: usize },
    #[error(
        "arena file {path}: permission denied for uid {uid}; an engine that runs as another uid than \
         the daemon's needs the daemon's `engine_group` to be one of its groups"
    )]
    NoAccess { path: PathBuf, uid: u32 },
    #[error(transparent)]
    Private(#[from] super::private::PrivateError),
}

/// An arena the daemon reopened after a restart ([`HostArena::reopen`]).
#[derive(Debug)]
pub struct Reopened {
    pub arena: HostArena,
    /// The file's length before it was fitted to the configured size.
    pub found_bytes: u64,
}

/// How the mapping went, for logs and `bench`.
#[derive(Clone, Debug)]
pub struct MapReport {
    pub bytes: u64,
    pub touch_threads: usize,
    pub map_time: Duration,
    /// `Ok(())` when locked; otherwise why not (e.g. `RLIMIT_MEMLOCK`).
    pub locked: Result<(), String>,
    /// The page size backing the mapping after its first touch: the huge page size when
    /// the host handed out huge pages for it (see `tier::mapping`), else 4096.
    pub page_bytes: u64,
    /// Bytes mapped by transparent huge pages after the first touch.
    pub huge_bytes: u64,
    /// Why the mapping has no huge pages, when it has none.
    pub small_pages_why: Option<String>,
    /// Why a GPU driver cannot pin the mapping, when it cannot
    /// ([`super::mapping::gpu_pin_refusal`]): engines with CUDA tensors then fail to
    /// register.
    pub gpu_pin_refusal: Option<String>,
}

/// An arena file mapped and touched but not yet cut into slots
/// ([`HostArena::create_unfitted`]); no slot exists until [`Unfitted::fit`].
#[derive(Debug)]
pub struct Unfitted {
    arena: HostArena,
}

impl Unfitted {
    /// Bytes mapped, which [`Unfitted::fit`] cuts into slots.
    pub fn bytes(&self) -> u64 {
        self.arena.map.len() as u64
    }

    pub fn path(&self) -> &Path {
        &self.arena.path
    }

    /// Whether slots of `slot_bytes` can be cut (a non-zero multiple of 64, at least one).
    pub fn fits(&self, slot_bytes: u64) -> Result<(), ArenaError> {
        slot_count(self.bytes(), slot_bytes).map(|_| ())
    }

    /// Cuts the mapping into as many `slot_bytes` slots as fit, all free; what is left
    /// past the last whole slot (less than one slot) stays unused.
    pub fn fit(self, slot_bytes: u64) -> Result<HostArena, ArenaError> {
        let slots = slot_count(self.bytes(), slot_bytes)?;
        let mut arena = self.arena;
        arena.slot_bytes = slot_bytes as usize;
        arena.slots = slots as u32;
        arena.free = Mutex::new(FreeList::new(slots as u32));
        arena.report.bytes = slots * slot_bytes;
        tracing::info!(path = %arena.path.display(), slot_bytes, slots, "host arena slots fitted");
        Ok(arena)
    }
}

/// Options for [`HostArena::create`].
#[derive(Clone, Debug)]
pub struct ArenaOptions {
    /// Lock the mapping in memory. Default: true.
    pub lock: bool,
    /// Touch every page at start, in parallel. Default: true.
    pub prefault: bool,
    /// Threads for the first touch. Default: the machine's parallelism, at most 8.
    pub touch_threads: usize,
    /// The group of engines that run as another uid: the arena file is `0660` with this
    /// group instead of `0600`, so they can map it. Default: none.
    pub group: Option<u32>,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        Self {
            lock: true,
            prefault: true,
            touch_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            group: None,
        }
    }
}

/// A mapped arena of `slots` slots of `slot_bytes` each.
#[derive(Debug)]
pub struct HostArena {
    path: PathBuf,
    map: SharedMap,
    slot_bytes: usize,
    slots: u32,
    free: Mutex<FreeList>,
    report: MapReport,
    /// The daemon's slot generations (`super::slot_gen`): every allocation is numbered.
    gens: std::sync::OnceLock<std::sync::Arc<super::slot_gen::Generations>>,
}

/// How many `slot_bytes` slots fit in `capacity`: slots are a non-zero multiple of 64
/// bytes, and at least one must fit.
fn slot_count(capacity: u64, slot_bytes: u64) -> Result<u64, ArenaError> {
    if slot_bytes == 0 || !slot_bytes.is_multiple_of(64) {
        return Err(ArenaError::SlotSize(slot_bytes));
    }
    let slots = (capacity / slot_bytes).min(u32::MAX as u64 - 1);
    if slots == 0 {
        return Err(ArenaError::TooSmall { capacity, slot_bytes });
    }
    Ok(slots)
}

impl HostArena {
    /// Creates the file at `path` afresh (private: `0600`, or `0660` with
    /// [`ArenaOptions::group`]; `O_EXCL`; whatever was at the path, a symlink included, is
    /// removed first and never followed) with room for as many `slot_bytes` slots as fit
    /// in `capacity` bytes, and maps it. A process that still maps an old file at the path
    /// keeps its own, untouched.
    pub fn create(path: &Path, capacity: u64, slot_bytes: u64, opts: &ArenaOptions) -> Result<Self, ArenaError> {
        let slots = slot_count(capacity, slot_bytes)?;
        let io = |source| ArenaError::Io {
            path: path.to_owned(),
            source,
        };
        let start = Instant::now();
        let file = super::private::replace(path)?;
        super::private::share_file(path, &file, opts.group)?;
        file.set_len(slots * slot_bytes).map_err(io)?;
        Self::map(path, file, slot_bytes as usize, slots as u32, opts, start)
    }

    /// Creates, maps and touches the file as [`HostArena::create`] does, `capacity`
    /// bytes (rounded down to 64), without cutting it into slots yet: the slot size is
    /// fitted later to the objects of the first layout registered ([`Unfitted::fit`]),
    /// while the costly first touch of a large arena stays at start.
    pub fn create_unfitted(path: &Path, capacity: u64, opts: &ArenaOptions) -> Result<Unfitted, ArenaError> {
        let bytes = capacity / 64 * 64;
        if bytes == 0 {
            return Err(ArenaError::TooSmall {
                capacity,
                slot_bytes: 64,
            });
        }
        let start = Instant::now();
        let file = super::private::replace(path)?;
        super::private::share_file(path, &file, opts.group)?;
        file.set_len(bytes).map_err(|source| ArenaError::Io {
            path: path.to_owned(),
            source,
        })?;
        // One slot spanning the mapping, taken away below: nothing is allocated until fit.
        let mut arena = Self::map(path, file, bytes as usize, 1, opts, start)?;
        arena.slots = 0;
        arena.slot_bytes = 0;
        arena.free = Mutex::new(FreeList::default());
        Ok(Unfitted { arena })
    }

    /// Reopens the daemon's own arena file after a restart, keeping its bytes, fitted to
    /// the configured `capacity`: the file must be a private file of the daemon's uid
    /// (never followed through a symlink; `0660` is accepted too when its group is
    /// [`ArenaOptions::group`], and the file leaves with the mode and group the options
    /// say), and is cut or extended to as many `slot_bytes` slots as fit in `capacity`.
    /// Slots past the old end read as zeros (a truncated file);
    /// slots past the new end are gone. `found_bytes` says what the file held, so the
    /// caller can tell what did not fit.
    pub fn reopen(path: &Path, capacity: u64, slot_bytes: u64, opts: &ArenaOptions) -> Result<Reopened, ArenaError> {
        let slots = slot_count(capacity, slot_bytes)?;
        let io = |source| ArenaError::Io {
            path: path.to_owned(),
            source,
        };
        let start = Instant::now();
        let file = super::private::open_existing_shared(path, true, opts.group)?
            .ok_or_else(|| io(std::io::Error::from(std::io::ErrorKind::NotFound)))?;
        super::private::share_file(path, &file, opts.group)?;
        let found_bytes = file.metadata().map_err(io)?.len();
        if found_bytes != slots * slot_bytes {
            file.set_len(slots * slot_bytes).map_err(io)?;
        }
        let arena = Self::map(path, file, slot_bytes as usize, slots as u32, opts, start)?;
        Ok(Reopened { arena, found_bytes })
    }

    /// Maps an existing arena file (the daemon after a restart, or an engine process).
    /// Every slot starts free; the caller recovers ownership from its own records.
    pub fn open(path: &Path, slot_bytes: u64, opts: &ArenaOptions) -> Result<Self, ArenaError> {
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(64) {
            return Err(ArenaError::SlotSize(slot_bytes));
        }
        let io = |source| ArenaError::Io {
            path: path.to_owned(),
            source,
        };
        // Never through a symlink: an engine maps what the daemon created, nothing else.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::PermissionDenied => ArenaError::NoAccess {
                    path: path.to_owned(),
                    uid: super::private::euid(),
                },
                _ => io(e),
            })?;
        let len = file.metadata().map_err(io)?.len();
        let slots = len / slot_bytes;
        if slots == 0 {
            return Err(ArenaError::TooSmall {
                capacity: len,
                slot_bytes,
            });
        }
        Self::map(path, file, slot_bytes as usize, slots as u32, opts, Instant::now())
    }

    fn map(
        path: &Path,
        file: File,
        slot_bytes: usize,
        slots: u32,
        opts: &ArenaOptions,
        start: Instant,
    ) -> Result<Self, ArenaError> {
        let bytes = slot_bytes as u64 * slots as u64;
        let map = SharedMap::map(&file, bytes as usize, true).map_err(|source| ArenaError::Io {
            path: path.to_owned(),
            source,
        })?;
        let threads = opts.touch_threads.max(1);
        let locked = populate(map.as_ptr(), bytes as usize, threads, opts.prefault, opts.lock);
        let (page_bytes, huge_bytes, small_pages_why) = map.page_size(path, opts.prefault);
        let gpu_pin_refusal = super::mapping::gpu_pin_refusal(&file);
        let report = MapReport {
            bytes,
            touch_threads: threads,
            map_time: start.elapsed(),
            locked,
            page_bytes,
            huge_bytes,
            small_pages_why,
            gpu_pin_refusal,
        };
        tracing::info!(
            path = %path.display(),
            bytes,
            slots,
            ms = report.map_time.as_millis() as u64,
            locked = report.locked.is_ok(),
            page_bytes,
            huge_bytes,
            "host arena mapped"
        );
        if let Err(why) = &report.locked {
            tracing::warn!(%why, "host arena is not locked in memory; pages may be swapped");
        }
        if let Some(why) = &report.gpu_pin_refusal {
            tracing::warn!(path = %path.display(), %why, "engines with GPU tensors cannot pin this host arena");
        }
        if let Some(why) = &report.small_pages_why {
            tracing::info!(path = %path.display(), %why, "no huge pages for this mapping; it uses 4 KiB pages");
        }
        Ok(Self {
            path: path.to_owned(),
            map,
            slot_bytes,
            slots,
            free: Mutex::new(FreeList::new(slots)),
            report,
            gens: std::sync::OnceLock::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn slots(&self) -> u32 {
        self.slots
    }

    pub fn report(&self) -> &MapReport {
        &self.report
    }

    /// Slots currently allocated.
    pub fn used(&self) -> u32 {
        self.slots - self.free.lock().len() as u32
    }

    pub fn free_slots(&self) -> u32 {
        self.free.lock().len() as u32
    }

    /// Allocates one slot, O(1).
    pub fn alloc(&self) -> Option<SlotId> {
        let s = self.free.lock().pop().map(SlotId)?;
        self.generations().inspect(|g| g.bump(s));
        Some(s)
    }

    /// Allocates `n` slots, all or none.
    pub fn alloc_n(&self, n: usize) -> Option<Vec<SlotId>> {
        let slots: Vec<SlotId> = self.free.lock().pop_n(n)?.into_iter().map(SlotId).collect();
        self.generations().inspect(|g| slots.iter().for_each(|&s| g.bump(s)));
        Some(slots)
    }

    /// Numbers every allocation from now on through `gens` (the daemon's arena, once).
    pub fn attach_generations(&self, gens: std::sync::Arc<super::slot_gen::Generations>) {
        let _ = self.gens.set(gens);
    }

    pub fn generations(&self) -> Option<&super::slot_gen::Generations> {
        self.gens.get().map(|g| g.as_ref())
    }

    /// Takes a specific slot out of the free stack (recovery after a restart), O(1):
    /// false when it is not free (adopted twice, or outside the arena).
    pub fn claim(&self, slot: SlotId) -> bool {
        self.free.lock().take(slot.0)
    }

    /// Replaces the free stack with every slot not in `used` (recovery, O(slots)).
    pub fn reset_free(&self, used: &[SlotId]) {
        *self.free.lock() = FreeList::without(self.slots, used.iter().map(|s| s.0));
    }

    pub fn free(&self, slot: SlotId) {
        debug_assert!(slot.0 < self.slots);
        self.free.lock().push(slot.0);
    }

    pub fn free_all(&self, slots: impl IntoIterator<Item = SlotId>) {
        let mut free = self.free.lock();
        for s in slots {
            free.push(s.0);
        }
    }

    /// Total mapped bytes (slots times slot size).
    pub fn len_bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes as u64
    }

    /// Base address of the mapping in this process, for registering it with a transport
    /// (e.g. Mooncake's `register_buffer`). Valid as long as the arena lives.
    pub fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Where `bytes` lies in the arena file, when it lies wholly inside this mapping: lets
    /// another process that maps the same file (a pool helper) reach the same memory.
    pub fn offset_of(&self, bytes: &[u8]) -> Option<u64> {
        let base = self.map.as_ptr() as usize;
        let start = (bytes.as_ptr() as usize).checked_sub(base)?;
        let end = start.checked_add(bytes.len())?;
        (end as u64 <= self.len_bytes()).then_some(start as u64)
    }

    /// Byte offset of a slot within the arena file.
    pub fn offset(&self, slot: SlotId) -> u64 {
        slot.0 as u64 * self.slot_bytes as u64
    }

    fn ptr(&self, slot: SlotId) -> Result<*mut u8, ArenaError> {
        if slot.0 >= self.slots {
            return Err(ArenaError::BadSlot(slot.0));
        }
        // SAFETY: in bounds of the mapping, checked above.
        Ok(unsafe { self.map.as_mut_ptr().add(slot.0 as usize * self.slot_bytes) })
    }

    /// The first `len` bytes of a slot, for reading.
    ///
    /// # Safety
    /// The caller must own the slot (it allocated it and has not freed it) and no one may
    /// write the slot while the slice lives.
    pub unsafe fn slot(&self, slot: SlotId, len: usize) -> Result<&[u8], ArenaError> {
        self.check_len(len)?;
        let p = self.ptr(slot)?;
        // SAFETY: bounds checked; exclusivity is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(p, len) })
    }

    /// The first `len` bytes of a slot, for writing.
    ///
    /// # Safety
    /// The caller must own the slot and be its only reader or writer while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_mut(&self, slot: SlotId, len: usize) -> Result<&mut [u8], ArenaError> {
        self.check_len(len)?;
        let p = self.ptr(slot)?;
        // SAFETY: bounds checked; exclusivity is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
    }

    fn check_len(&self, len: usize) -> Result<(), ArenaError> {
        if len > self.slot_bytes {
            return Err(ArenaError::WrongSize {
                len,
                slot_bytes: self.slot_bytes,
            });
        }
        Ok(())
    }

    /// Flushes the mapping to its file (a no-op for tmpfs, useful on disk-backed paths).
    pub fn flush(&self) -> std::io::Result<()> {
        self.map.flush()
    }
}

/// Maps every page before the first copy, spread over `threads` threads: each thread
/// locks its range (which faults it in) and, with `touch`, maps it writable with
/// `MADV_POPULATE_WRITE`. On a shared mapping both locking and reading fault pages in
/// read-only, so every page's first write would still take a fault (16 per 64 KiB
/// object; a first pass over a fresh arena ran at about half its later speed). Where
/// the kernel lacks `MADV_POPULATE_WRITE` (before 5.14) it reads one byte per 4 KiB page
/// instead. Neither changes a reopened arena's data. Returns whether the whole range is
/// locked, or why not.
fn populate(base: *const u8, len: usize, threads: usize, touch: bool, lock: bool) -> Result<(), String> {
    const PAGE: usize = 4096;
    if !lock && !touch {
        return Err("locking disabled by configuration".into());
    }
    let per = len.div_ceil(threads).div_ceil(PAGE) * PAGE;
    let base = base as usize;
    let errors: Vec<Option<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| t * per)
            .filter(|&start| start < len)
            .map(|start| {
                let n = per.min(len - start);
                s.spawn(move || {
                    // Touched for writing before it is locked: `mlock` first faults a
                    // shared mapping's pages in for reading, and on some virtual machines
                    // the first write to each page then ran at about 60 % of memcpy speed
                    // (the first round of every copy into a fresh arena or local pool).
                    if touch {
                        // SAFETY: a page-aligned range inside our live, writable mapping;
                        // the advice only populates page tables and never changes data.
                        let ok =
                            unsafe { libc::madvise((base + start) as *mut libc::c_void, n, libc::MADV_POPULATE_WRITE) }
                                == 0;
                        if !ok {
                            for off in (start..start + n).step_by(PAGE) {
                                // SAFETY: inside the mapping; volatile so it is not elided.
                                unsafe { std::ptr::read_volatile((base + off) as *const u8) };
                            }
                        }
                    }
                    if !lock {
                        return Some("locking disabled by configuration".to_string());
                    }
                    // SAFETY: the range lies inside our live mapping.
                    (unsafe { libc::mlock((base + start) as *const libc::c_void, n) } != 0)
                        .then(|| format!("mlock: {}", std::io::Error::last_os_error()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Some("populate thread panicked".into())))
            .collect()
    });
    match errors.into_iter().flatten().next() {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_allocate_and_hold_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arena");
        let a = HostArena::create(&path, 1 << 20, 64 << 10, &ArenaOptions::default()).unwrap();
        assert_eq!(a.slots(), 16);
        let s = a.alloc_n(16).unwrap();
        assert!(a.alloc().is_none());
        assert!(a.alloc_n(1).is_none());
        // SAFETY: this test allocated s[3] and is its only user; the slice ends with the line.
        unsafe { a.slot_mut(s[3], 5).unwrap() }.copy_from_slice(b"hello");
        // A second mapping of the same file (another process would do the same) sees it.
        let b = HostArena::open(&path, 64 << 10, &ArenaOptions::default()).unwrap();
        // SAFETY: s[3] is this test's slot and nothing writes it while it is read here.
        assert_eq!(unsafe { b.slot(s[3], 5).unwrap() }, b"hello");
        // SAFETY: as above; `inside` is only compared, and s[3] is written no more.
        let inside = unsafe { a.slot(s[3], 5).unwrap() };
        assert_eq!(a.offset_of(inside), Some(a.offset(s[3])));
        assert_eq!(a.offset_of(b"hello"), None);
        a.free(s[3]);
        assert_eq!(a.used(), 15);
        // SAFETY: an out-of-range slot is refused before any memory is touched.
        assert!(matches!(unsafe { a.slot(SlotId(16), 1) }, Err(ArenaError::BadSlot(16))));
        assert!(matches!(
            // SAFETY: an oversized length is refused before any memory is touched.
            unsafe { a.slot(SlotId(0), (64 << 10) + 1) },
            Err(ArenaError::WrongSize { .. })
        ));
        assert!(HostArena::create(&path, 100, 64, &ArenaOptions::default()).is_ok());
        assert!(matches!(
            HostArena::create(&path, 10, 64, &ArenaOptions::default()),
            Err(ArenaError::TooSmall { .. })
        ));
        assert!(matches!(
            HostArena::create(&path, 1000, 100, &ArenaOptions::default()),
            Err(ArenaError::SlotSize(100))
        ));
    }

    #[test]
    fn an_unfitted_arena_is_cut_to_the_object_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("arena");
        let u = HostArena::create_unfitted(&path, (1 << 20) + 100, &ArenaOptions::default()).unwrap();
        assert_eq!(u.bytes(), (1 << 20) + 64);
        assert!(matches!(u.fits(100), Err(ArenaError::SlotSize(100))));
        assert!(matches!(u.fits(2 << 20), Err(ArenaError::TooSmall { .. })));
        // 16 KiB objects: 64 slots, none of them larger than the object.
        let a = u.fit(16 << 10).unwrap();
        assert_eq!((a.slots(), a.slot_bytes(), a.used()), (64, 16 << 10, 0));
        assert_eq!(a.len_bytes(), 1 << 20);
        let s = a.alloc_n(64).unwrap();
        assert!(a.alloc().is_none());
        // SAFETY: slot s[63] was just allocated to this test and nothing else maps it.
        unsafe { a.slot_mut(s[63], 16 << 10).unwrap() }.fill(7);
        // An engine maps the same file with the fitted slot size and sees the bytes.
        let b = HostArena::open(&path, 16 << 10, &ArenaOptions::default()).unwrap();
        // SAFETY: no writer holds the slot while it is read.
        assert!(unsafe { b.slot(s[63], 16 << 10).unwrap() }.iter().all(|&x| x == 7));
        assert!(matches!(
            HostArena::create_unfitted(&path, 63, &ArenaOptions::default()),
            Err(ArenaError::TooSmall { .. })
        ));
    }
}
