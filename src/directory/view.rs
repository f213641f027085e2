//! The directory's read view: everything a prefix lookup reads, kept in atomics so that
//! lookups run without the directory lock and never wait behind a store or an eviction
//! round.
//!
//! Two fixed-capacity arrays, allocated zeroed (so memory nobody touched costs nothing)
//! and never reallocated, which is what lets a reader use them while the writer changes
//! them:
//!
//! - **The index.** Open addressing with linear probing over 8-byte slots: a 32-bit tag
//!   from the page's table hash (it also picks the home slot) and the record index plus
//!   one, so an all-zero slot is empty. Its capacity is fixed from `max_pages` (load at
//!   most 3/4), so it never grows under a reader. Inserting fills one empty slot with one
//!   store; deleting shifts later entries of the run backward, which can carry an entry
//!   past a reader's probe. So a deletion bumps a counter before each slot it rewrites,
//!   and a probe that ends on an empty slot without a match is believed only when the
//!   counter did not move (it saw the table at one instant); otherwise it probes again.
//! - **The cells.** Per record, the fields a lookup reads (hash bytes, length, namespace,
//!   per-tier state) in five atomic words, guarded by a sequence counter in the first
//!   word (a seqlock). The state sits in that same word, so a change of completeness is
//!   one store; a record reused for another page goes odd, writes the hash words, and
//!   goes even again. A reader takes the first word, the hash words, then the first word
//!   again, and retries when the two differ.
//!
//! There is one writer at a time: the directory's owner holds its write lock around
//! every change. Every shared word is an atomic, so a reader racing the writer sees old
//! or new values, never a data race. A reader answers each page as it was at one instant
//! during the call: a page is credited only when its cell said complete with the
//! queried hash and namespace in one consistent read. A reader that keeps losing races
//! (bounded retries) reports the page as not found, the conservative answer: a shorter
//! prefix, never a page that is not complete.

use std::alloc::Layout as AllocLayout;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicU64, fence};

use super::{COMPLETE, DirectoryError};
use crate::page::{MAX_HASH_BYTES, NamespaceId, PageHash};
use crate::wire::PrefixHit;

/// The page size `DirView::make_index_resident` works in (the smallest the kernel maps).
const INDEX_PAGE: usize = 4096;

/// An empty index slot.
const EMPTY: u64 = 0;
/// Smallest index.
const MIN_SLOTS: usize = 1024;
/// Hash words per cell.
const WORDS: usize = MAX_HASH_BYTES / 8;
/// Atomic words per cell: the meta word, then the hash words.
const CELL: usize = 1 + WORDS;
/// Bytes of one cell.
pub(super) const CELL_BYTES: usize = CELL * 8;
/// Control words of a view: the deletion counter and the namespace count.
pub(crate) const CTL_WORDS: usize = 2;
/// Attempts at one consistent read before a reader gives up on a page.
const RETRIES: usize = 64;
/// Record indices the index can hold (stored plus one in 32 bits).
pub(super) const MAX_RECORDS: usize = u32::MAX as usize - 1;

// Meta word: bits 0..32 sequence (odd while the hash words change), 32..48 namespace,
// 48..56 tier states (two bits per tier), 56..64 hash length.
const SEQ_MASK: u64 = 0xffff_ffff;
const STATE_SHIFT: u32 = 48;
const STATE_MASK: u64 = 0xff << STATE_SHIFT;
/// The bits that say which page a cell holds (namespace and hash length).
const ID_MASK: u64 = !(SEQ_MASK | STATE_MASK);

#[inline]
fn tag(h: u64) -> u32 {
    (h >> 32) as u32
}

fn id_bits(ns: NamespaceId, len: usize) -> u64 {
    ((ns.0 as u64) << 32) | ((len as u64) << 56)
}

fn hash_words(hash: &PageHash) -> [u64; WORDS] {
    let mut bytes = [0u8; MAX_HASH_BYTES];
    bytes[..hash.len()].copy_from_slice(hash.as_bytes());
    std::array::from_fn(|w| u64::from_le_bytes(bytes[w * 8..w * 8 + 8].try_into().unwrap_or_default()))
}

/// Where a view's atomic words live: a zeroed heap allocation (from the allocator's
/// zeroed path: large arrays come straight from fresh mappings, so pages nobody writes
/// are never made resident), or a range of a shared file mapping (see
/// [`super::shared`]), which engines map too and read with the same code.
pub(crate) struct Words {
    ptr: *const AtomicU64,
    len: usize,
    _owner: Owner,
}

/// What keeps a view's words alive: held, never read.
#[allow(dead_code)]
enum Owner {
    Heap(Box<[AtomicU64]>),
    Map(std::sync::Arc<memmap2::MmapRaw>),
}

// SAFETY: the words are only ever accessed through `AtomicU64`, and the owner keeps the
// memory alive for as long as the value lives.
unsafe impl Send for Words {}
// SAFETY: as for `Send`.
unsafe impl Sync for Words {}

impl std::fmt::Debug for Words {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Words({})", self.len)
    }
}

impl std::ops::Deref for Words {
    type Target = [AtomicU64];
    fn deref(&self) -> &[AtomicU64] {
        // SAFETY: `ptr` and `len` describe memory `_owner` keeps alive, 8-byte aligned,
        // accessed only as atomics.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Words {
    /// `n` zeroed words on the heap.
    pub(crate) fn zeroed(n: usize) -> Result<Self, DirectoryError> {
        let b: Box<[AtomicU64]> = if n == 0 {
            Box::new([])
        } else {
            let bytes = n.saturating_mul(8);
            let layout = AllocLayout::array::<AtomicU64>(n).map_err(|_| DirectoryError::Alloc(bytes))?;
            // SAFETY: `layout` has a non-zero size (n > 0).
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<AtomicU64>();
            if ptr.is_null() {
                return Err(DirectoryError::Alloc(bytes));
            }
            // SAFETY: `ptr` is a live allocation of the global allocator with the layout of
            // `[AtomicU64; n]`, which is what `Box<[AtomicU64]>` frees it with; all-zero
            // bytes are a valid `AtomicU64` (0), and nothing else owns the memory.
            unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n)) }
        };
        Ok(Self {
            ptr: b.as_ptr(),
            len: b.len(),
            _owner: Owner::Heap(b),
        })
    }

    /// Maps every page of these words that the file already holds into this process's
    /// page tables now, readable, where the kernel can (5.14 and later), so that reads
    /// take no page fault: a lookup probes slots at random, and an engine that had not
    /// touched them paid a fault for nearly every page of a window. For words the writer
    /// made resident (see [`DirView::make_index_resident`]).
    pub(crate) fn populate_read(&self) {
        let (at, bytes) = (self.ptr as usize, self.len * 8);
        let start = at.next_multiple_of(INDEX_PAGE);
        let end = (at + bytes) / INDEX_PAGE * INDEX_PAGE;
        if end > start {
            // SAFETY: a page-aligned range inside the mapping `_owner` keeps alive;
            // populating changes no data.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_READ) };
        }
    }

    /// Words `at..at + n` (in words) of `map`, or `None` past its end.
    pub(crate) fn mapped(map: &std::sync::Arc<memmap2::MmapRaw>, at: usize, n: usize) -> Option<Self> {
        let end = at.checked_add(n)?.checked_mul(8)?;
        if end > map.len() || !(map.as_ptr() as usize).is_multiple_of(8) {
            return None;
        }
        Some(Self {
            // SAFETY: inside the mapping (checked just above).
            ptr: unsafe { map.as_ptr().add(at * 8) }.cast::<AtomicU64>(),
            len: n,
            _owner: Owner::Map(map.clone()),
        })
    }
}

/// What a reader found in one cell.
enum Probe {
    /// The cell holds another page.
    Other,
    /// The cell holds the page; its tier states.
    Page(u8),
    /// No consistent read within [`RETRIES`].
    Torn,
}

/// A queried page in the cells' encoding.
struct Key {
    id: u64,
    words: [u64; WORDS],
}

impl Key {
    fn new(ns: NamespaceId, hash: &PageHash) -> Self {
        Self {
            id: id_bits(ns, hash.len()),
            words: hash_words(hash),
        }
    }
}

/// The read view: the index and the cells. Shared (`Arc`) between the directory, which
/// writes it under its owner's write lock, and lookups, which read it with no lock.
#[derive(Debug)]
pub struct DirView {
    slots: Words,
    mask: usize,
    /// Two words: `[0]` is bumped before every slot store of a deletion (each move and
    /// the final empty), so a probe that saw it unchanged saw no entry move; `[1]` counts
    /// the namespaces registered (they are never removed).
    ctl: Words,
    cells: Words,
}

impl DirView {
    /// A view for up to `max_records` records (at most [`MAX_RECORDS`]).
    pub(super) fn new(max_records: usize) -> Result<Self, DirectoryError> {
        let max_records = max_records.min(MAX_RECORDS);
        let slots = Self::slots_for(max_records);
        Ok(Self {
            slots: Words::zeroed(slots)?,
            mask: slots - 1,
            ctl: Words::zeroed(CTL_WORDS)?,
            cells: Words::zeroed(max_records.saturating_mul(CELL))?,
        })
    }

    /// Records this view has cells for.
    pub fn records(&self) -> usize {
        self.cells.len() / CELL
    }

    /// Index slots for up to `max_records` records: a power of two, the table at most
    /// 3/4 full.
    pub(crate) fn slots_for(max_records: usize) -> usize {
        (max_records.min(MAX_RECORDS).saturating_mul(4) / 3 + 1)
            .max(MIN_SLOTS)
            .next_power_of_two()
    }

    /// Cell words for up to `max_records` records.
    pub(crate) fn cell_words(max_records: usize) -> usize {
        max_records.min(MAX_RECORDS).saturating_mul(CELL)
    }

    /// A view over words that live elsewhere (a shared file, see [`super::shared`]):
    /// `slots` of [`Self::slots_for`] words (a power of two), `ctl` of [`CTL_WORDS`] and
    /// `cells` of [`Self::cell_words`]. `None` when the sizes are not a view's.
    pub(crate) fn from_words(slots: Words, ctl: Words, cells: Words) -> Option<Self> {
        if !slots.len().is_power_of_two() || ctl.len() != CTL_WORDS || !cells.len().is_multiple_of(CELL) {
            return None;
        }
        Some(Self {
            mask: slots.len() - 1,
            slots,
            ctl,
            cells,
        })
    }

    /// Makes the whole index resident and writable now. Lookups probe it at random
    /// slots, so every 4 KiB page of it becomes resident soon in a daemon that serves
    /// (see [`super::Directory::try_new`]); until then, a lookup of pages new to the node
    /// took one page fault per page it probed, and entering them a second, copying the
    /// shared zero page (a 64-page lookup answered from the pool index spent about
    /// 130 µs in them, and its directory work about 300 µs). The cells fill in record
    /// order and are left to fault as records are first used.
    pub(crate) fn make_index_resident(&self) {
        let (start, range) = self.index_whole_pages();
        // Huge pages first, where the kernel gives them (refused or not, the index works
        // the same): a lookup probes slots at random, and with 4 KiB pages nearly every
        // probe of a large index also missed the TLB.
        // SAFETY: a page-aligned range inside the live allocation `slots`, which this view
        // owns; the advice changes no data.
        unsafe { libc::madvise(start as *mut libc::c_void, range, libc::MADV_HUGEPAGE) };
        // SAFETY: as above; populating changes no data (zero pages stay zero).
        let advised =
            range > 0 && unsafe { libc::madvise(start as *mut libc::c_void, range, libc::MADV_POPULATE_WRITE) } == 0;
        // Where the kernel lacks the advice (before 5.14), one write per page; and the
        // partial pages at either end either way. Adding zero changes no slot.
        let step = if advised {
            self.slots.len().max(1)
        } else {
            INDEX_PAGE / 8
        };
        for w in self.slots.iter().step_by(step).chain(self.slots.last()) {
            w.fetch_add(0, Relaxed);
        }
    }

    /// The whole 4 KiB pages inside the index's allocation: the first one's address and
    /// their bytes (0 when the index spans none whole).
    fn index_whole_pages(&self) -> (usize, usize) {
        let (at, bytes) = (self.slots.as_ptr() as usize, self.slots.len() * 8);
        let (start, end) = (at.next_multiple_of(INDEX_PAGE), (at + bytes) / INDEX_PAGE * INDEX_PAGE);
        (start, end.saturating_sub(start))
    }

    /// [`Words::populate_read`] of the index (a reader's mapping of a view the writer made
    /// resident).
    pub(crate) fn populate_index(&self) {
        self.slots.populate_read();
    }

    /// Pages of the index in memory, and its whole pages in all (`mincore`).
    #[cfg(test)]
    pub(super) fn index_residency(&self) -> (usize, usize) {
        let (start, range) = self.index_whole_pages();
        let n = range / INDEX_PAGE;
        let mut v = vec![0u8; n];
        // SAFETY: a page-aligned range inside the live allocation `slots`; `v` holds one
        // byte per page of it, as `mincore` writes.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, range, v.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        (v.iter().filter(|b| *b & 1 == 1).count(), n)
    }

    #[inline]
    fn home(&self, t: u32) -> usize {
        t as usize & self.mask
    }

    /// Whether namespace `ns` is registered.
    pub fn knows(&self, ns: NamespaceId) -> bool {
        (ns.0 as u64) < self.ctl[1].load(Acquire)
    }

    pub(crate) fn set_namespaces(&self, n: usize) {
        self.ctl[1].store(n as u64, Release);
    }

    /// The view's moves counter (see `ctl`).
    #[inline]
    fn moves(&self) -> &AtomicU64 {
        &self.ctl[0]
    }

    fn cell(&self, i: u32) -> &[AtomicU64] {
        let at = i as usize * CELL;
        self.cells.get(at..at + CELL).unwrap_or(&[])
    }

    /// Reads cell `i` against `key`: one consistent snapshot of hash, namespace and state.
    #[inline]
    fn probe(&self, i: u32, key: &Key) -> Probe {
        let c = self.cell(i);
        let [meta, words @ ..] = c else { return Probe::Other };
        for _ in 0..RETRIES {
            let m1 = meta.load(Acquire);
            if m1 & 1 == 1 {
                // Mid-reuse: a cell is published before the index names it, so an odd
                // cell is no indexed page (a stale slot of a freed one led here).
                return Probe::Other;
            }
            if m1 & ID_MASK != key.id {
                // One atomic load says the cell held another namespace or length then.
                return Probe::Other;
            }
            let mut same = true;
            for (w, k) in words.iter().zip(&key.words) {
                same &= w.load(Relaxed) == *k;
            }
            // Orders the hash loads before the second meta load (the seqlock's read side).
            fence(Acquire);
            if meta.load(Relaxed) != m1 {
                std::hint::spin_loop();
                continue;
            }
            return if same {
                Probe::Page((m1 >> STATE_SHIFT) as u8)
            } else {
                Probe::Other
            };
        }
        Probe::Torn
    }

    /// The record holding `key` and its tier states, if any. `h` is the page's table hash.
    fn find_key(&self, h: u64, key: &Key) -> Option<(u32, u8)> {
        let t = tag(h);
        for _ in 0..RETRIES {
            let before = self.moves().load(Acquire);
            let mut i = self.home(t);
            // The table is at most 3/4 full, so a probe meets an empty slot well before
            // this bound; the bound keeps a reader finite whatever the writer does.
            for _ in 0..=self.mask {
                let s = self.slots[i].load(Acquire);
                if s == EMPTY {
                    break;
                }
                if tag(s) == t {
                    let idx = (s as u32).wrapping_sub(1);
                    match self.probe(idx, key) {
                        Probe::Page(state) => return Some((idx, state)),
                        Probe::Other => {}
                        Probe::Torn => return None,
                    }
                }
                i = (i + 1) & self.mask;
            }
            // Orders the slot loads before the second counter load: a miss is believed
            // only when no slot was rewritten during the probe, so the probe saw the table
            // as it was at one instant (every state between two stores is a valid table).
            // A writer stalled mid-deletion leaves the table still: the miss is believed.
            fence(Acquire);
            if self.moves().load(Relaxed) == before {
                return None;
            }
            std::hint::spin_loop();
        }
        None
    }

    /// The record of page `hash` in `ns` and its tier states (writer or reader).
    #[inline]
    pub(crate) fn find(&self, ns: NamespaceId, hash: &PageHash, h: u64) -> Option<(u32, u8)> {
        self.find_key(h, &Key::new(ns, hash))
    }

    /// Starts loading where a find of each of `hashes` will look (the directory's `find`
    /// reads this index), so that the finds that follow overlap their memory reads
    /// instead of waiting on one at a time.
    pub fn prefetch_pages(&self, ns: NamespaceId, hashes: &[PageHash]) {
        for h in hashes {
            self.prefetch(h.table_hash(ns));
        }
    }

    /// Starts loading, for each table hash of `hs`, its home slot and then the cell that
    /// slot names (when its tag matches), so that finds of these pages that follow find
    /// both in cache: each pass's loads are independent, so their misses overlap, where a
    /// find per page waits on two misses in a row. The slot words read here only steer
    /// the hints; finds read everything again.
    pub fn prefetch_cells(&self, hs: &[u64]) {
        for &h in hs {
            self.prefetch(h);
        }
        #[cfg(target_arch = "x86_64")]
        for &h in hs {
            let s = self.slots[self.home(tag(h))].load(Relaxed);
            if s != EMPTY && tag(s) == tag(h) {
                let at = ((s as u32).wrapping_sub(1) as usize).saturating_mul(CELL);
                if let Some(c) = self.cells.get(at) {
                    // SAFETY: prefetch never faults, and `c` is inside the cell array.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch(
                            (c as *const AtomicU64).cast::<i8>(),
                            std::arch::x86_64::_MM_HINT_T0,
                        )
                    };
                }
            }
        }
    }

    /// Hints the CPU to fetch the home slot of `h`.
    #[inline]
    pub(super) fn prefetch(&self, h: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = self.slots.as_ptr().wrapping_add(self.home(tag(h)));
            // SAFETY: prefetch never faults, and `p` is inside the slot array.
            unsafe { std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = h;
    }

    /// Contiguous-prefix lookup (see [`super::Directory::lookup_prefix`]), with no lock.
    /// An unregistered namespace matches nothing.
    pub fn lookup_prefix(&self, ns: NamespaceId, hashes: &[PageHash]) -> PrefixHit {
        // Prefix lengths where every page so far is complete on device, on device-or-host,
        // and anywhere. Each is monotone, so credit per tier is a difference.
        let (mut d, mut hn, mut p) = (0usize, 0usize, 0usize);
        let mut d_open = true;
        let mut h_open = true;
        // Hash a window ahead and prefetch its index slots, so that the misses of several
        // pages are in flight at once.
        const AHEAD: usize = 8;
        let mut ring = [0u64; AHEAD];
        for (i, hash) in hashes.iter().take(AHEAD).enumerate() {
            ring[i] = hash.table_hash(ns);
            self.prefetch(ring[i]);
        }
        for (i, hash) in hashes.iter().enumerate() {
            let h = ring[i % AHEAD];
            if let Some(next) = hashes.get(i + AHEAD) {
                let nh = next.table_hash(ns);
                ring[i % AHEAD] = nh;
                self.prefetch(nh);
            }
            let Some((_, s)) = self.find(ns, hash, h) else { break };
            let dev = s & 3 == COMPLETE;
            let host = (s >> 2) & 3 == COMPLETE;
            let pool = (s >> 4) & 3 == COMPLETE;
            if !(dev || host || pool) {
                break;
            }
            d_open &= dev;
            h_open &= dev || host;
            d += usize::from(d_open);
            hn += usize::from(h_open);
            p += 1;
        }
        PrefixHit {
            device: d,
            host: hn - d,
            pool: p - hn,
        }
    }

    // Writer side: called only by the directory, whose owner holds the write lock, so
    // there is one writer at a time.

    /// Makes cell `i` hold page `hash` of `ns` with no state, before the index names it.
    pub(crate) fn publish(&self, i: u32, ns: NamespaceId, hash: &PageHash) {
        let [meta, words @ ..] = self.cell(i) else { return };
        let m = meta.load(Relaxed);
        let seq = m & SEQ_MASK;
        meta.store((m & !SEQ_MASK) | ((seq + 1) & SEQ_MASK), Relaxed);
        // Orders the odd store before the hash stores (the seqlock's write side).
        fence(Release);
        for (w, v) in words.iter().zip(hash_words(hash)) {
            w.store(v, Relaxed);
        }
        meta.store(id_bits(ns, hash.len()) | ((seq + 2) & SEQ_MASK), Release);
    }

    /// Sets cell `i`'s tier states: one store, since they share the meta word.
    pub(crate) fn set_state(&self, i: u32, state: u8) {
        let [meta, ..] = self.cell(i) else { return };
        let m = meta.load(Relaxed);
        meta.store((m & !STATE_MASK) | ((state as u64) << STATE_SHIFT), Release);
    }

    /// The hash cell `i` holds (writer side: nothing changes it meanwhile).
    pub(crate) fn hash(&self, i: u32) -> PageHash {
        let [meta, words @ ..] = self.cell(i) else {
            return PageHash::from_u64(0);
        };
        let len = (meta.load(Relaxed) >> 56) as usize;
        let mut bytes = [0u8; MAX_HASH_BYTES];
        for (k, w) in words.iter().enumerate() {
            bytes[k * 8..k * 8 + 8].copy_from_slice(&w.load(Relaxed).to_le_bytes());
        }
        PageHash::new(&bytes[..len.min(MAX_HASH_BYTES)]).unwrap_or_else(|_| PageHash::from_u64(0))
    }

    /// Adds record `idx` under table hash `h`. The caller has published its cell and
    /// checked the page is not present; the table is never full (capacity from
    /// `max_records`).
    pub(crate) fn insert(&self, h: u64, idx: u32) {
        let s = ((tag(h) as u64) << 32) | (idx as u64 + 1);
        let mut i = self.home(tag(h));
        for _ in 0..=self.mask {
            if self.slots[i].load(Relaxed) == EMPTY {
                // Release: a reader that sees the slot sees the published cell.
                self.slots[i].store(s, Release);
                return;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Removes record `idx` stored under `h`. Returns whether it was there.
    pub(crate) fn remove(&self, h: u64, idx: u32) -> bool {
        let t = tag(h);
        let want = ((t as u64) << 32) | (idx as u64 + 1);
        let mut i = self.home(t);
        loop {
            let s = self.slots[i].load(Relaxed);
            if s == EMPTY {
                return false;
            }
            if s == want {
                break;
            }
            i = (i + 1) & self.mask;
        }
        // Every store below is announced by a bump of `moves` first, fenced, so a reader
        // that sees the store sees the bump (the seqlock's write side, per store). Each
        // state between two stores is a valid table: an entry moves to a hole nearer its
        // home while still at its old slot, and the one new empty slot comes last.
        let mut moves = self.moves().load(Relaxed);
        let put = |slot: &AtomicU64, v: u64, moves: &mut u64| {
            *moves += 1;
            self.moves().store(*moves, Relaxed);
            fence(Release);
            slot.store(v, Release);
        };
        // Backward-shift deletion: pull later entries of the run into the hole when
        // their home does not lie cyclically in (hole, j].
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j].load(Relaxed);
            if s == EMPTY {
                break;
            }
            let home = self.home(tag(s));
            let between = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !between {
                put(&self.slots[hole], s, &mut moves);
                hole = j;
            }
        }
        put(&self.slots[hole], EMPTY, &mut moves);
        true
    }

    /// Bytes of the index (all of it: slots are spread over the whole table) and of the
    /// cells of the first `records` records (cells are used from the front).
    pub(super) fn heap_bytes(&self, records: usize) -> usize {
        self.slots.len() * 8 + records.min(self.cells.len() / CELL) * CELL_BYTES
    }
}
