//! How the host arena's and the local pool's shared-memory files are mapped: at an
//! address aligned to the huge page size, with transparent huge pages asked for where
//! the host allows them, and a report of the page size the mapping ended up with.
//!
//! A shared file mapping gets huge pages only when its file system hands them out: a
//! tmpfs mounted with `huge=always`, `huge=within_size` or `huge=advise` (the last needs
//! `MADV_HUGEPAGE`, which is asked for here), or any shmem when
//! `/sys/kernel/mm/transparent_hugepage/shmem_enabled` is `force`. The mapping must also
//! start on a huge page boundary for the kernel to map a huge page with one page-table
//! entry, which `mmap` does not promise for a plain file, so the range is reserved with
//! room to spare and the file mapped at its first aligned address. Where the host does
//! not allow them (the default `/dev/shm` is mounted without `huge=`), the mapping uses
//! 4 KiB pages; [`why_not_huge`] says why, for the log and `kvtier status`.
//!
//! The page size is read back from `/proc/self/smaps` once the mapping is populated, so
//! what is reported is what the kernel did, not what was asked.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

/// The base page size.
pub const SMALL_PAGE: u64 = 4096;
/// The transparent huge page size when the kernel does not say (x86-64 and most arm64).
const DEFAULT_HUGE_PAGE: u64 = 2 << 20;

/// Why a GPU driver cannot pin a shared mapping of `file`, if it cannot: Linux (6.5 on)
/// refuses a long-term writable pin (`FOLL_LONGTERM`) of file pages that need dirty
/// tracking, which is every file system's but tmpfs's and hugetlbfs's, and the CUDA
/// driver then fails `cuMemHostRegister` with `CUDA_ERROR_INVALID_VALUE` (seen with
/// driver 580 for an arena on ext4). `None` on tmpfs and hugetlbfs, or when the file
/// system cannot be read.
pub fn gpu_pin_refusal(file: &File) -> Option<String> {
    let kind = fs_type(file)?;
    (kind != libc::TMPFS_MAGIC && kind != libc::HUGETLBFS_MAGIC).then(|| {
        format!(
            "the file is on a file system of type {kind:#x}, not tmpfs or hugetlbfs, and Linux does not let \
             a GPU driver pin such file pages; put the arena on tmpfs (`/dev/shm`, the default) or hugetlbfs"
        )
    })
}

/// The type of the file system `file` is on (`statfs`'s `f_type`: `libc::TMPFS_MAGIC`, …);
/// `None` when it cannot be read.
pub fn fs_type(file: &File) -> Option<libc::__fsword_t> {
    // SAFETY: `statfs` is plain data; `fstatfs` only writes into it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a valid out-pointer.
    (unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } == 0).then_some(st.f_type)
}

/// The kernel's PMD-sized transparent huge page, in bytes.
pub fn huge_page_bytes() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|&b: &u64| b.is_power_of_two() && b > SMALL_PAGE)
        .unwrap_or(DEFAULT_HUGE_PAGE)
}

/// A shared, read-write mapping of a file, unmapped when dropped.
#[derive(Debug)]
pub struct SharedMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; who may touch which bytes is
// the arena's contract (slots owned by one mover at a time), as it was with memmap2.
unsafe impl Send for SharedMap {}
// SAFETY: as above; `&SharedMap` only hands out the base address.
unsafe impl Sync for SharedMap {}

impl SharedMap {
    /// Maps the first `len` bytes of `file` shared and read-write, starting at an address
    /// aligned to the huge page size. With `huge`, asks for transparent huge pages on
    /// every whole huge page of the range (`MADV_HUGEPAGE`); a refusal is not an error,
    /// the report says what the mapping got.
    pub fn map(file: &File, len: usize, huge: bool) -> std::io::Result<Self> {
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty mapping"));
        }
        let align = huge_page_bytes() as usize;
        let span = len
            .checked_add(align)
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "mapping too large"))?;
        // SAFETY: a fresh anonymous reservation of `span` bytes, no access; nothing else
        // refers to it.
        let reserved = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if reserved == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let start = reserved as usize;
        let at = start.next_multiple_of(align);
        // SAFETY: `[at, at + len)` lies inside our own reservation (at < start + align),
        // so MAP_FIXED replaces only memory this function reserved.
        let mapped = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                file.as_raw_fd(),
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: the whole reservation is ours and nothing points into it.
            unsafe { libc::munmap(reserved, span) };
            return Err(e);
        }
        // Give back the reservation's slack on either side of the file mapping.
        let end = (at + len).next_multiple_of(SMALL_PAGE as usize);
        // SAFETY: both ranges are parts of our reservation that the file mapping does not
        // cover, page-aligned, and nothing points into them.
        unsafe {
            if at > start {
                libc::munmap(start as *mut libc::c_void, at - start);
            }
            if start + span > end {
                libc::munmap(end as *mut libc::c_void, start + span - end);
            }
        }
        let map = Self {
            // SAFETY: mmap succeeded, so the address is not null.
            ptr: unsafe { NonNull::new_unchecked(mapped.cast::<u8>()) },
            len,
        };
        let whole = len / align * align;
        if huge && whole > 0 {
            // SAFETY: an aligned range inside our live mapping; the advice changes no data.
            unsafe { libc::madvise(mapped, whole, libc::MADV_HUGEPAGE) };
        }
        Ok(map)
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes the mapping back to its file (a no-op on tmpfs).
    pub fn flush(&self) -> std::io::Result<()> {
        // SAFETY: the range is our live mapping.
        if unsafe { libc::msync(self.ptr.as_ptr().cast(), self.len, libc::MS_SYNC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// What backs the mapping now, read from `/proc/self/smaps`.
    pub fn pages(&self) -> PageUse {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        PageUse::of_vma(&smaps, self.ptr.as_ptr() as usize).unwrap_or_default()
    }
    /// The page size backing the mapping after its first touch, its bytes in huge pages,
    /// and why it has none when it has none. An untouched mapping (`touched` false) has no
    /// pages yet: it is reported with the page size the host would give it, without
    /// reading `smaps` (which walks every mapping of the process: slow in a large engine
    /// process).
    pub fn page_size(&self, path: &Path, touched: bool) -> (u64, u64, Option<String>) {
        let why = why_not_huge(path);
        let used = if touched { self.pages() } else { PageUse::default() };
        let page_bytes = match (used.rss_bytes, &why) {
            (0, None) => huge_page_bytes(),
            (0, Some(_)) => SMALL_PAGE,
            _ => used.page_bytes(),
        };
        let why = match why {
            None if page_bytes <= SMALL_PAGE => Some("the kernel mapped none (no free huge pages?)".to_string()),
            None => None,
            Some(w) if page_bytes <= SMALL_PAGE => Some(w),
            Some(_) => None,
        };
        (page_bytes, used.huge_bytes, why)
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; nothing borrows it past its owner.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// What backs one mapping, as `/proc/<pid>/smaps` reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PageUse {
    /// The page size of the mapping's page tables (`KernelPageSize`): above 4 KiB only
    /// for hugetlbfs.
    pub kernel_page_bytes: u64,
    /// Resident bytes.
    pub rss_bytes: u64,
    /// Resident bytes mapped as transparent huge pages (`ShmemPmdMapped` + `FilePmdMapped`).
    pub huge_bytes: u64,
}

impl PageUse {
    /// The entry of the mapping that starts at `start` in an smaps text.
    pub fn of_vma(smaps: &str, start: usize) -> Option<Self> {
        let head = format!("{start:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
        lines.next()?;
        let mut u = PageUse::default();
        // The fields of this entry run until the next entry's header (an address range).
        for l in lines.take_while(|l| l.split_once(':').is_some_and(|(k, _)| !k.contains('-'))) {
            let Some((k, v)) = l.split_once(':') else { continue };
            let kib = || v.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0) * 1024;
            match k {
                "KernelPageSize" => u.kernel_page_bytes = kib(),
                "Rss" => u.rss_bytes = kib(),
                "ShmemPmdMapped" | "FilePmdMapped" => u.huge_bytes += kib(),
                _ => {}
            }
        }
        Some(u)
    }

    /// The page size most of the resident mapping uses: the huge page size when at least
    /// half of what is resident is mapped by huge pages, else the kernel page size.
    pub fn page_bytes(&self) -> u64 {
        if self.kernel_page_bytes > SMALL_PAGE {
            return self.kernel_page_bytes;
        }
        if self.huge_bytes > 0 && self.huge_bytes * 2 >= self.rss_bytes {
            return huge_page_bytes();
        }
        self.kernel_page_bytes.max(SMALL_PAGE)
    }
}

/// The system's shmem huge page policy (`shmem_enabled`, the bracketed choice).
fn shmem_enabled() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    Some(s.split_once('[')?.1.split_once(']')?.0.to_owned())
}

/// The mount point, file system type and options of the mount holding `path`.
fn mount_of(path: &Path) -> Option<(String, String, String)> {
    let path = path.parent().unwrap_or(path);
    let path = std::fs::canonicalize(path).ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, at, fs, opts) = (f.next()?, f.next()?, f.next()?, f.next()?);
            path.starts_with(at)
                .then(|| (at.to_owned(), fs.to_owned(), opts.to_owned()))
        })
        .max_by_key(|(at, _, _)| at.len())
}

/// Whether the host hands out huge pages for a shared mapping of a file at `path`, and
/// if not, why not (for the log and the status).
pub fn why_not_huge(path: &Path) -> Option<String> {
    let policy = shmem_enabled();
    match policy.as_deref() {
        None => return Some("the kernel has no transparent huge pages for shared memory".into()),
        Some("deny") => return Some("shmem_enabled is [deny]".into()),
        Some("force") => return None,
        _ => {}
    }
    let Some((at, fs, opts)) = mount_of(path) else {
        return Some(format!("the mount holding {} is unknown", path.display()));
    };
    if fs == "hugetlbfs" {
        return None;
    }
    if fs != "tmpfs" {
        return Some(format!("{at} is {fs}, not tmpfs"));
    }
    let huge = opts.split(',').find_map(|o| o.strip_prefix("huge="));
    match huge {
        Some("always" | "within_size" | "advise") => None,
        Some(h) => Some(format!(
            "{at} is a tmpfs mounted with huge={h}; mount one with huge=advise for the arena's directory"
        )),
        None => Some(format!(
            "{at} is a tmpfs mounted without huge= (and shmem_enabled is [{}]); mount one with \
             huge=advise for the arena's directory",
            policy.unwrap_or_default()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-s 00000000 00:19 42   /dev/shm/a
Size:               4096 kB
KernelPageSize:        4 kB
Rss:                4096 kB
ShmemPmdMapped:     4096 kB
FilePmdMapped:         0 kB
THPeligible:           0
VmFlags: rd wr sh mr mw me ms hg
7f0000400000-7f0000800000 rw-s 00000000 00:19 43   /dev/shm/b
Size:               4096 kB
KernelPageSize:        4 kB
Rss:                2048 kB
ShmemPmdMapped:        0 kB
";

    #[test]
    fn smaps_entries_are_read_per_mapping() {
        let a = PageUse::of_vma(SMAPS, 0x7f00_0000_0000).unwrap();
        assert_eq!(
            a,
            PageUse {
                kernel_page_bytes: 4096,
                rss_bytes: 4 << 20,
                huge_bytes: 4 << 20
            }
        );
        assert_eq!(a.page_bytes(), huge_page_bytes());
        let b = PageUse::of_vma(SMAPS, 0x7f00_0040_0000).unwrap();
        assert_eq!((b.rss_bytes, b.huge_bytes, b.page_bytes()), (2 << 20, 0, 4096));
        assert_eq!(PageUse::of_vma(SMAPS, 0x1000), None);
    }

    #[test]
    fn a_mapping_starts_on_a_huge_page_boundary_and_reads_its_own_pages() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("m"))
            .unwrap();
        let len = (3 << 20) + 4096 * 3;
        f.set_len(len as u64).unwrap();
        let m = SharedMap::map(&f, len, true).unwrap();
        assert_eq!(m.as_ptr() as u64 % huge_page_bytes(), 0);
        // SAFETY: our own live mapping of `len` bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr(), len) };
        bytes[len - 1] = 7;
        bytes[0] = 9;
        m.flush().unwrap();
        let u = m.pages();
        assert!(u.rss_bytes >= 4096, "{u:?}");
        assert!(u.kernel_page_bytes >= 4096);
        drop(m);
        let back = std::fs::read(dir.path().join("m")).unwrap();
        assert_eq!((back[0], back[len - 1]), (9, 7));
    }
}
