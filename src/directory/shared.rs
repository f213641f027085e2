//! The lookup file: the directory's read view and the pool index's page table in one
//! file beside the arena, which engines map read-only and answer prefix lookups from
//! with no round trip to the daemon.
//!
//! A lookup through the daemon's socket costs a socket round trip and a wake-up of the
//! daemon's connection task on top of the directory's work; across cores on a busy node
//! that is tens to hundreds of microseconds, where the work itself is a few. The
//! directory's view ([`DirView`]) was already built for readers that take no lock and
//! tolerate any concurrent writer (seqlocked cells, a deletion counter over the index),
//! so a reader in another process runs the same code over the same words.
//!
//! Layout, all little-endian 64-bit words: a header of [`HEADER_WORDS`] (one 4 KiB page),
//! then the directory view's slots, its control words and its cells, then the pool page
//! table's (a second view, keyed the same way, whose cells say "every object of this page
//! is in the shared pool for this namespace's layout", kept by the pool index). Each part
//! starts on a 4 KiB boundary. The header:
//!
//! | word | meaning |
//! | --- | --- |
//! | 0 | magic `KVTLKUP1` |
//! | 1 | format version (1) |
//! | 2, 3 | the directory view's slots and records |
//! | 4, 5 | the pool table's slots and records |
//! | 6 | pages a lookup may discover past device and host (the remote budget) |
//! | 7 | flags: [`LIVE`] (the daemon set the file up), [`REMOTE`] (a shared pool with discovery) |
//! | 8 | the pool index is in sync and the table holds all of it ([`POOL_INDEXED`]) |
//! | 9 | the pool is healthy ([`POOL_HEALTHY`]) |
//! | 10 | most pages in one lookup (larger ones are the daemon's to refuse) |
//!
//! The daemon creates the file afresh at every start (a restarted daemon's engines
//! reconnect and map the new one), readable by the arena's group where one is set, writable
//! by the daemon alone: an engine can read what the daemon knows, never change it. Engines
//! check its owner and mode as they check the arena's before they map it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::{Acquire, Release};

use memmap2::{MmapOptions, MmapRaw};

use super::view::{CTL_WORDS, DirView, Words};
use crate::tier::mapping::fs_type;
use crate::tier::private::{self, PrivateError};

/// Words of the header.
pub const HEADER_WORDS: usize = 512;
const MAGIC: u64 = u64::from_le_bytes(*b"KVTLKUP1");
const VERSION: u64 = 1;
/// Words per 4 KiB page: every part starts on one.
const PAGE_WORDS: usize = 512;

const W_MAGIC: usize = 0;
const W_VERSION: usize = 1;
const W_DIR_SLOTS: usize = 2;
const W_DIR_RECORDS: usize = 3;
const W_POOL_SLOTS: usize = 4;
const W_POOL_RECORDS: usize = 5;
const W_BUDGET: usize = 6;
const W_FLAGS: usize = 7;
const W_POOL_INDEXED: usize = 8;
const W_POOL_HEALTHY: usize = 9;
const W_MAX_BATCH: usize = 10;

/// The daemon finished setting the file up: its views are the daemon's.
pub const LIVE: u64 = 1;
/// The daemon discovers pages on a shared pool past device and host.
pub const REMOTE: u64 = 2;
/// Word 8's value while the pool table may be trusted.
pub const POOL_INDEXED: u64 = 1;
/// Word 9's value while the pool is healthy.
pub const POOL_HEALTHY: u64 = 1;

/// Where the lookup file of the arena at `arena` lives.
pub fn lookup_path(arena: &Path) -> PathBuf {
    let mut p = arena.as_os_str().to_owned();
    p.push(".lookup");
    p.into()
}

/// The word offsets of the parts, from the two views' record counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Parts {
    dir_slots: usize,
    dir_records: usize,
    pool_slots: usize,
    pool_records: usize,
}

impl Parts {
    fn new(dir_records: usize, pool_records: usize) -> Self {
        Self {
            dir_slots: DirView::slots_for(dir_records),
            dir_records,
            pool_slots: DirView::slots_for(pool_records),
            pool_records,
        }
    }

    /// Each part's start and length, in words: directory slots, control, cells; then the
    /// pool table's.
    fn spans(&self) -> [(usize, usize); 6] {
        let lens = [
            self.dir_slots,
            CTL_WORDS,
            DirView::cell_words(self.dir_records),
            self.pool_slots,
            CTL_WORDS,
            DirView::cell_words(self.pool_records),
        ];
        let mut at = HEADER_WORDS;
        lens.map(|n| {
            let here = at;
            at = (at + n).next_multiple_of(PAGE_WORDS);
            (here, n)
        })
    }

    fn words(&self) -> usize {
        let (at, n) = self.spans()[5];
        (at + n).next_multiple_of(PAGE_WORDS)
    }

    /// The two views over `map`.
    fn views(&self, map: &Arc<MmapRaw>) -> Option<(DirView, DirView)> {
        let w = |i: usize| {
            let (at, n) = self.spans()[i];
            Words::mapped(map, at, n)
        };
        Some((
            DirView::from_words(w(0)?, w(1)?, w(2)?)?,
            DirView::from_words(w(3)?, w(4)?, w(5)?)?,
        ))
    }
}

/// One mapping of a lookup file: its header, and the views over it.
#[derive(Debug)]
pub struct LookupFile {
    head: Words,
    /// The file lies on a tmpfs: memory, so making its indexes resident writes no disk.
    on_tmpfs: bool,
}

/// A lookup file's header and its two views: the directory's and the pool table's.
pub type Mapped = (LookupFile, DirView, DirView);

impl LookupFile {
    /// The daemon's file at `path`, created afresh (whatever was there is replaced), for
    /// a directory of `dir_records` records and a pool table of `pool_records`. Shared
    /// read-only with `group` where one is set, private otherwise. Not [`LIVE`] yet.
    pub fn create(
        path: &Path,
        group: Option<u32>,
        dir_records: usize,
        pool_records: usize,
    ) -> Result<Mapped, PrivateError> {
        let io = |source| PrivateError::Io {
            path: path.to_owned(),
            source,
        };
        let parts = Parts::new(dir_records, pool_records);
        let file = private::replace(path)?;
        private::share_read_only(path, &file, group)?;
        file.set_len(parts.words() as u64 * 8).map_err(io)?;
        let map = Arc::new(MmapOptions::new().len(parts.words() * 8).map_raw(&file).map_err(io)?);
        let bad = || io(std::io::Error::other("the lookup file's parts do not fit its mapping"));
        let head = Words::mapped(&map, 0, HEADER_WORDS).ok_or_else(bad)?;
        let (dir, pool) = parts.views(&map).ok_or_else(bad)?;
        for (w, v) in [
            (W_VERSION, VERSION),
            (W_DIR_SLOTS, parts.dir_slots as u64),
            (W_DIR_RECORDS, parts.dir_records as u64),
            (W_POOL_SLOTS, parts.pool_slots as u64),
            (W_POOL_RECORDS, parts.pool_records as u64),
        ] {
            head[w].store(v, Release);
        }
        // The pool table holds every namespace's pages: none is unknown to it.
        pool.set_namespaces(1 << 16);
        head[W_MAGIC].store(MAGIC, Release);
        Ok((
            Self {
                head,
                on_tmpfs: fs_type(&file) == Some(libc::TMPFS_MAGIC),
            },
            dir,
            pool,
        ))
    }

    /// An engine's read-only mapping of the daemon's file at `path` (the caller checked
    /// its owner and mode). `None` when the file is not a lookup file of this format.
    pub fn open(path: &Path) -> std::io::Result<Option<Mapped>> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        let len = file.metadata()?.len() as usize;
        if len < HEADER_WORDS * 8 {
            return Ok(None);
        }
        let map = Arc::new(MmapOptions::new().len(len).map_raw_read_only(&file)?);
        let Some(head) = Words::mapped(&map, 0, HEADER_WORDS) else {
            return Ok(None);
        };
        if head[W_MAGIC].load(Acquire) != MAGIC || head[W_VERSION].load(Acquire) != VERSION {
            return Ok(None);
        }
        let n = |w: usize| head[w].load(Acquire) as usize;
        let parts = Parts::new(n(W_DIR_RECORDS), n(W_POOL_RECORDS));
        if parts.dir_slots != n(W_DIR_SLOTS) || parts.pool_slots != n(W_POOL_SLOTS) || parts.words() * 8 != len {
            return Ok(None);
        }
        let Some((dir, pool)) = parts.views(&map) else {
            return Ok(None);
        };
        // The daemon made both indexes resident: map them now, not one fault per probe.
        dir.populate_index();
        pool.populate_index();
        Ok(Some((
            Self {
                head,
                on_tmpfs: fs_type(&file) == Some(libc::TMPFS_MAGIC),
            },
            dir,
            pool,
        )))
    }

    /// Whether the file lies on a tmpfs: memory, so making its indexes resident writes no
    /// disk (elsewhere they are left to fill as lookups first probe them).
    pub fn on_tmpfs(&self) -> bool {
        self.on_tmpfs
    }

    /// Sets the flags ([`LIVE`], [`REMOTE`]), the discovery budget and the batch limit
    /// (daemon).
    pub fn set_flags(&self, flags: u64, budget_pages: usize, max_batch: usize) {
        self.head[W_BUDGET].store(budget_pages as u64, Release);
        self.head[W_MAX_BATCH].store(max_batch as u64, Release);
        self.head[W_FLAGS].store(flags, Release);
    }

    pub fn flags(&self) -> u64 {
        self.head[W_FLAGS].load(Acquire)
    }

    pub fn max_batch(&self) -> usize {
        self.head[W_MAX_BATCH].load(Acquire) as usize
    }

    pub fn budget_pages(&self) -> usize {
        self.head[W_BUDGET].load(Acquire) as usize
    }

    /// Whether the pool table may be trusted: set by the pool index (daemon).
    pub fn set_pool_indexed(&self, yes: bool) {
        self.head[W_POOL_INDEXED].store(u64::from(yes) * POOL_INDEXED, Release);
    }

    pub fn pool_indexed(&self) -> bool {
        self.head[W_POOL_INDEXED].load(Acquire) == POOL_INDEXED
    }

    /// Whether the pool is healthy: set by the daemon's upkeep and its lookups.
    pub fn set_pool_healthy(&self, yes: bool) {
        self.head[W_POOL_HEALTHY].store(u64::from(yes) * POOL_HEALTHY, Release);
    }

    pub fn pool_healthy(&self) -> bool {
        self.head[W_POOL_HEALTHY].load(Acquire) == POOL_HEALTHY
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::page::{NamespaceId, PageHash};

    /// What the daemon writes, an engine's read-only mapping of the same file reads:
    /// pages and their states as they change, pages removed, and the header's words.
    #[test]
    fn an_engines_mapping_reads_what_the_daemon_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = lookup_path(&dir.path().join("arena"));
        let (file, dir_w, pool_w) = LookupFile::create(&path, None, 1000, 500).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777, 0o600);
        let (engine, dir_r, pool_r) = LookupFile::open(&path).unwrap().expect("a lookup file");
        assert_eq!((engine.flags(), engine.budget_pages()), (0, 0), "not live yet");
        file.set_flags(LIVE | REMOTE, 256, 4096);
        assert_eq!(
            (engine.flags(), engine.budget_pages(), engine.max_batch()),
            (LIVE | REMOTE, 256, 4096)
        );
        assert!(!engine.pool_indexed() && !engine.pool_healthy());
        file.set_pool_indexed(true);
        file.set_pool_healthy(true);
        assert!(engine.pool_indexed() && engine.pool_healthy());

        let ns = NamespaceId(0);
        let hs: Vec<PageHash> = (0..300u64).map(PageHash::from_u64).collect();
        dir_w.set_namespaces(1);
        for (i, h) in hs.iter().enumerate() {
            dir_w.publish(i as u32, ns, h);
            // Device complete for the first 10, host for the next 20, nothing after.
            let state = match i {
                0..10 => 2,
                10..30 => 2 << 2,
                _ => 0,
            };
            dir_w.set_state(i as u32, state);
            dir_w.insert(h.table_hash(ns), i as u32);
        }
        let hit = dir_r.lookup_prefix(ns, &hs);
        assert_eq!((hit.device, hit.host, hit.pool), (10, 20, 0));
        dir_w.set_state(5, 0);
        assert_eq!(dir_r.lookup_prefix(ns, &hs).device, 5, "a state change is seen at once");
        assert!(dir_w.remove(hs[2].table_hash(ns), 2));
        assert_eq!(dir_r.lookup_prefix(ns, &hs).device, 2);
        assert_eq!(dir_r.find(ns, &hs[40], hs[40].table_hash(ns)).map(|(i, _)| i), Some(40));
        assert!(!dir_r.knows(NamespaceId(1)));

        // The pool table: every namespace is known to it; an entry is there or not.
        assert!(pool_r.knows(NamespaceId(7)));
        pool_w.publish(0, NamespaceId(7), &hs[9]);
        pool_w.insert(hs[9].table_hash(NamespaceId(7)), 0);
        assert!(
            pool_r
                .find(NamespaceId(7), &hs[9], hs[9].table_hash(NamespaceId(7)))
                .is_some()
        );
        assert!(
            pool_r.find(ns, &hs[9], hs[9].table_hash(ns)).is_none(),
            "another namespace's"
        );
    }

    /// A file that is not a lookup file of this format, or whose parts do not match its
    /// header, is not mapped as one.
    #[test]
    fn a_file_that_is_not_a_lookup_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.lookup");
        std::fs::write(&path, vec![7u8; HEADER_WORDS * 8 * 2]).unwrap();
        assert!(LookupFile::open(&path).unwrap().is_none());
        std::fs::write(&path, b"short").unwrap();
        assert!(LookupFile::open(&path).unwrap().is_none());
        let (_file, ..) = LookupFile::create(&path, None, 100, 0).unwrap();
        assert!(LookupFile::open(&path).unwrap().is_some());
        // A header whose record count says a larger file than there is.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[W_DIR_RECORDS * 8..W_DIR_RECORDS * 8 + 8].copy_from_slice(&1_000_000u64.to_le_bytes());
        let other = dir.path().join("y.lookup");
        std::fs::write(&other, &bytes).unwrap();
        assert!(LookupFile::open(&other).unwrap().is_none());
        // A symbolic link is never followed.
        let link = dir.path().join("z.lookup");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(LookupFile::open(&link).is_err());
    }
}
