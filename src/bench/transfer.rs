//! `kvtier bench transfer`: page-move throughput between tiers through the manager, at
//! several object sizes, beside `memcpy` of the same bytes in the same run.
//!
//! Each path copies on a known number of threads (the transfer workers, or the caller for
//! a staging too small to share), and it has two references, both `memcpy` of the same
//! bytes in the same object-sized pieces on that many threads:
//!
//! - the like-for-like one (`memcpy_same_mapping_gbps`, the `ratio`'s): between buffers
//!   of the kinds the path copies between, made the same way. Arena and pool slots are
//!   shared-memory files mapped by the arena's own code, in the same directory and with
//!   the same options (so with huge pages exactly where the arena has them); the emulated
//!   device region is page-aligned private memory.
//! - the heap one (`memcpy_heap_gbps`, `ratio_heap`): between page-aligned private
//!   buffers, so what the mapping costs shows beside it.
//! - on the device paths, the runs one (`memcpy_same_runs_gbps`, `ratio_same_runs`): the
//!   same mappings, but the device side copied run by run, to and from the places the
//!   engine's layout puts each object's layers (one run per layer of a layer-first
//!   region), as the path itself must. The object-sized reference writes each object in
//!   one piece, which no copy into an engine's per-layer tensors can; this one shows what
//!   that layout costs `memcpy` itself, so the rest of a gap is kvtier's.
//!
//! Every path runs slice by slice (8 MiB by default), each slice followed at once by its
//! references (subject, same mapping, heap, runs on a device path, subject, …), so all of
//! them meet the same machine. All are timed from the calling thread: the subject from
//! its first request to its last result, the references from handing their parts to
//! parked copier threads to hearing the last is done, so they pay the same wake-ups. A
//! ratio is the median of the per-slice ratios.
//!
//! Stores, loads, shares and stagings share each batch among the workers
//! (`TransferEngine::runners`), so their thread count is the workers' even for one batch
//! per slice. Host->pool sends one `Share` per batch (`--share-pages` sets another
//! size); pool->host sends one `Prefetch` per slice, as an engine names the pages of a
//! request at once. The manager's directory is sized to what the arena and the pool
//! hold, as a daemon's `max_pages` is: with the default of millions of pages, every new
//! page's slot in the lookup index lies on memory nobody has touched yet, and its
//! first-touch page fault under the directory lock was a start-up cost the reference
//! never pays (a third of device->host's time at 64 KiB, and a swing from run to run
//! with how fast the kernel hands out fresh pages).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use super::{PageAligned, gbps};
use crate::clock::SystemClock;
use crate::hints::{Hint, HintTarget};
use crate::layout::LayoutSpec;
use crate::manager::{LoadWait, Manager, ManagerConfig};
use crate::page::{Namespace, PageHash};
use crate::tier::TierKind;
use crate::tier::device::EmulatedDevice;
use crate::tier::host::{ArenaOptions, HostArena, SlotId};

/// Which device region the bench moves pages from and to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// A host buffer standing in for GPU memory; moves go through the manager and tiers.
    Emulated,
    /// GPU 0 through cudarc (feature `cuda`); page moves are compared with raw
    /// `cudaMemcpyAsync` of the same bytes.
    Cuda,
}

#[derive(Debug, Args)]
pub struct TransferArgs {
    /// The device region. Default: emulated.
    #[arg(long, value_enum, default_value_t = DeviceKind::Emulated)]
    pub device: DeviceKind,
    /// Object sizes in KiB.
    #[arg(long, value_delimiter = ',', default_values_t = [16u64, 64, 256, 2048])]
    pub sizes_kib: Vec<u64>,
    /// Bytes moved per measurement, in MiB.
    #[arg(long, default_value_t = 128)]
    pub mib: u64,
    /// Pages per store/load request.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Pages per `Share` hint on the host->pool path (0: `--batch`). One large `Share`
    /// is one job whose copy the workers share; its reserve and settle are not
    /// overlapped with another batch's copy, as those of several hints are.
    #[arg(long, default_value_t = 0)]
    pub share_pages: usize,
    /// Rounds; each moves every page along every path once.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// MiB per slice: each path runs slice by slice, each slice followed by its reference.
    /// At least one batch per transfer worker.
    #[arg(long, default_value_t = 8)]
    pub slice_mib: u64,
    /// Directory for the arena and pool files. Default: a temporary directory in /dev/shm.
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Cores the transfer workers and the reference's copiers are pinned to, worker `i`
    /// and copier `i` on the same one (the list reused from its start when shorter than
    /// the workers). Default: the first cores this process may run on, one per worker.
    /// Unpinned, two threads woken together were at times queued on one core while the
    /// other idled, on either side, which moved ratios by up to 2x from run to run.
    #[arg(long, value_delimiter = ',')]
    pub cores: Vec<usize>,
    /// `--device cuda`: also move each batch's pages in a shuffled order, as an engine's
    /// block table looks after churn, so that no run of a batch steps evenly and nothing
    /// coalesces (rows `... scattered`).
    #[arg(long)]
    pub scatter: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// One path at one object size. (`transfer_cuda` fills these too, against raw cuMemcpy.)
#[derive(Debug, Serialize)]
pub struct Row {
    pub path: String,
    pub object_bytes: u64,
    pub pages: usize,
    pub bytes: u64,
    pub gbps: f64,
    /// The reference: for the emulated device, `memcpy` of the same bytes between buffers
    /// mapped as the path's are, on as many threads as the path copies on, interleaved
    /// with it slice by slice (`memcpy_same_mapping_gbps`).
    pub memcpy_gbps: f64,
    /// For the emulated device, the median over slices of the path's speed over its
    /// like-for-like reference's on the same slice.
    pub ratio: f64,
}

/// A row with the emulated device's references and thread count beside it.
#[derive(Debug, Serialize)]
pub struct Figure {
    #[serde(flatten)]
    pub row: Row,
    /// Threads the path copies on; the references use as many.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
    /// `memcpy` between buffers of the kinds the path copies between (arena and pool
    /// slots: shared-memory files mapped as the arena is; the device: private memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcpy_same_mapping_gbps: Option<f64>,
    /// `memcpy` between page-aligned private (heap) buffers, in the same slices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcpy_heap_gbps: Option<f64>,
    /// The median over slices of the path's speed over the heap reference's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_heap: Option<f64>,
    /// Device paths: `memcpy` between the same mappings as `memcpy_same_mapping_gbps`,
    /// with the device side copied run by run where the engine's layout puts each layer
    /// of each object (what the path must do), in the same slices.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memcpy_same_runs_gbps: Option<f64>,
    /// The median over slices of the path's speed over the runs reference's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_same_runs: Option<f64>,
    /// Page size backing the host arena and the pool in this run (bytes): 4096, or a huge
    /// page size where the host allows them (see `tier::mapping`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mapping_page_bytes: Option<u64>,
    /// Whether every byte both sides copy was evicted from the CPU caches before each
    /// path's pass (x86-64), so that the path and its references start equally cold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub caches_evicted: Option<bool>,
    /// Cores the transfer workers and the reference's copiers were pinned to, worker `i`
    /// and copier `i` on the same one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cores: Option<Vec<usize>>,
}

impl From<Row> for Figure {
    fn from(row: Row) -> Self {
        Self {
            row,
            threads: None,
            memcpy_same_mapping_gbps: None,
            memcpy_heap_gbps: None,
            ratio_heap: None,
            memcpy_same_runs_gbps: None,
            ratio_same_runs: None,
            mapping_page_bytes: None,
            caches_evicted: None,
            cores: None,
        }
    }
}

/// The reference's copiers: `threads` threads that stay parked between slices and are
/// woken by the calling thread for each, as the transfer workers are woken by the jobs a
/// store or load submits. The time is the caller's, from handing out the parts to
/// hearing that the last is done, as the subject's is from its first request to its last
/// result: both pay the same wake-ups of parked threads and of the caller. A path that
/// copies on the calling thread (a one-batch prefetch) is compared with a copy on the
/// calling thread, with no hand-off on either side.
struct Copiers {
    parts: Vec<crossbeam_channel::Sender<Part>>,
    done: crossbeam_channel::Receiver<()>,
}

/// One copier's share of a slice.
enum Part {
    /// `len` bytes from `src` to `dst` in `chunk`-sized pieces.
    Pieces {
        src: *const u8,
        dst: *mut u8,
        len: usize,
        chunk: usize,
    },
    /// The `len` runs at `runs` (a share of the bench's run table, which outlives the
    /// copiers' scope), each from `src + offset` to `dst + offset`.
    Runs {
        src: *const u8,
        dst: *mut u8,
        runs: *const RunCopy,
        len: usize,
    },
}

/// One copy of a run: `(src offset, dst offset, bytes)`.
type RunCopy = (usize, usize, usize);

// SAFETY: a part names bytes of the bench's reference buffers that no other part of the
// same slice writes, and the caller neither reads nor writes the buffers until every part
// has reported done; the buffers (and the run table) outlive the copiers (a thread scope).
unsafe impl Send for Part {}

impl Part {
    fn copy(self) {
        match self {
            Part::Pieces { src, dst, len, chunk } => {
                // SAFETY: see `unsafe impl Send for Part`: the ranges are valid, disjoint
                // from the other parts' and untouched by the caller while the part runs.
                let (src, dst) = unsafe {
                    (
                        std::slice::from_raw_parts(src, len),
                        std::slice::from_raw_parts_mut(dst, len),
                    )
                };
                for (a, b) in src.chunks(chunk).zip(dst.chunks_mut(chunk)) {
                    b.copy_from_slice(a);
                }
            }
            Part::Runs { src, dst, runs, len } => {
                // SAFETY: a live share of the run table (see `unsafe impl Send for Part`).
                let runs = unsafe { std::slice::from_raw_parts(runs, len) };
                for &(s, d, n) in runs {
                    // SAFETY: `Copiers::time_runs` checked that each run lies inside both
                    // buffers, and no other part's share writes the same bytes.
                    unsafe { std::ptr::copy_nonoverlapping(src.add(s), dst.add(d), n) };
                }
            }
        }
    }
}

/// Where a path copies, and so where its reference copies.
#[derive(Clone, Copy)]
enum Threads {
    /// On the calling thread (a prefetch of one batch), with no hand-off.
    Caller,
    /// On this many transfer workers, woken by the caller.
    Workers(usize),
}

/// Longest the caller waits for a reference part (a stuck copier is a bench failure).
const PART_WAIT: Duration = Duration::from_secs(60);

impl Copiers {
    /// `threads` copiers in `scope`; they exit when `self` is dropped.
    /// Copier `i` pins itself to `cores[i % cores.len()]` (none when `cores` is empty), as
    /// transfer worker `i` does.
    fn spawn<'s>(scope: &'s std::thread::Scope<'s, '_>, threads: usize, cores: &[usize]) -> Self {
        let (done_tx, done) = crossbeam_channel::bounded(threads.max(1));
        let parts = (0..threads.max(1))
            .map(|i| {
                let (tx, rx) = crossbeam_channel::bounded::<Part>(1);
                let done_tx = done_tx.clone();
                let core = crate::affinity::nth_core(cores, i);
                scope.spawn(move || {
                    // A copier that cannot pin itself reports a failed bench: its
                    // placement would no longer match the worker's.
                    if let Some(core) = core
                        && crate::affinity::pin(0, &[core]).is_err()
                    {
                        return;
                    }
                    while let Ok(p) = rx.recv() {
                        p.copy();
                        if done_tx.send(()).is_err() {
                            break;
                        }
                    }
                });
                tx
            })
            .collect();
        Self { parts, done }
    }

    /// Copies `src` into `dst` in `chunk`-sized pieces on `threads` of the copiers (each
    /// taking a contiguous share of the pieces, as the transfer workers share batches),
    /// or on this thread for a path that copies on its caller, and returns the caller's
    /// time.
    fn time(&self, src: &[u8], dst: &mut [u8], chunk: usize, threads: Threads) -> anyhow::Result<Duration> {
        let chunk = chunk.max(1);
        let t0 = Instant::now();
        let Threads::Workers(threads) = threads else {
            Part::Pieces {
                src: src.as_ptr(),
                dst: dst.as_mut_ptr(),
                len: src.len().min(dst.len()),
                chunk,
            }
            .copy();
            return Ok(t0.elapsed());
        };
        let threads = threads.clamp(1, self.parts.len());
        let per = src.len().div_ceil(chunk).div_ceil(threads).max(1) * chunk;
        let parts = src.chunks(per).zip(dst.chunks_mut(per)).map(|(sv, dv)| Part::Pieces {
            src: sv.as_ptr(),
            dst: dv.as_mut_ptr(),
            len: sv.len().min(dv.len()),
            chunk,
        });
        self.hand_out(t0, parts)
    }

    /// Hands one part to each copier (as many as there are parts, at most one each) and
    /// returns the time from `t0` until the last reports done.
    fn hand_out(&self, t0: Instant, parts: impl Iterator<Item = Part>) -> anyhow::Result<Duration> {
        let mut sent = 0;
        for (part, tx) in parts.zip(&self.parts) {
            tx.send_timeout(part, PART_WAIT)
                .map_err(|_| anyhow::anyhow!("a reference copier is gone"))?;
            sent += 1;
        }
        for _ in 0..sent {
            self.done
                .recv_timeout(PART_WAIT)
                .map_err(|_| anyhow::anyhow!("a reference copier did not finish"))?;
        }
        Ok(t0.elapsed().max(Duration::from_nanos(1)))
    }

    /// Copies the runs of `pages` (`per_page` entries each in `table`, offsets relative to
    /// `src` and `dst`) on `threads` of the copiers, each taking a contiguous share of the
    /// pages, or on this thread; returns the caller's time, as [`Copiers::time`] does.
    /// `src` and `dst` must hold every offset of the table's runs for those pages.
    fn time_runs(
        &self,
        src: &[u8],
        dst: &mut [u8],
        table: &[RunCopy],
        per_page: usize,
        pages: std::ops::Range<usize>,
        threads: Threads,
    ) -> anyhow::Result<Duration> {
        let all = &table[pages.start * per_page..pages.end * per_page];
        anyhow::ensure!(
            all.iter().all(|&(s, d, n)| s + n <= src.len() && d + n <= dst.len()),
            "a reference run lies outside its buffers"
        );
        let (src, dst) = (src.as_ptr(), dst.as_mut_ptr());
        let part = |runs: &[RunCopy]| Part::Runs {
            src,
            dst,
            runs: runs.as_ptr(),
            len: runs.len(),
        };
        let t0 = Instant::now();
        let Threads::Workers(threads) = threads else {
            part(all).copy();
            return Ok(t0.elapsed());
        };
        let threads = threads.clamp(1, self.parts.len());
        let per = pages.len().div_ceil(threads).max(1) * per_page;
        self.hand_out(t0, all.chunks(per).map(part))
    }
}

/// Every page's runs between an object-contiguous page (the arena side: the page's parts
/// one after the other, each object in the layout's byte order) and a device region laid
/// out as [`EmulatedDevice::new`] lays it out: `(page offset, device offset, bytes)`,
/// `per_page` entries per page, pages in slot order.
fn device_runs(layout: &crate::layout::Layout, pages: u32) -> anyhow::Result<(Vec<RunCopy>, usize)> {
    let map = crate::tier::tensors::PageMap::contiguous(layout, 0, pages, 0);
    let obj = map.object_bytes();
    let mut table = Vec::new();
    for slot in 0..pages {
        for (pi, &part) in map.parts().iter().enumerate() {
            map.plan(slot, part, obj, |r| {
                let (rows, pitch) = r.rows.unwrap_or((1, 0));
                for t in 0..rows {
                    table.push((
                        slot as usize * map.parts().len() * obj + pi * obj + r.host_off + t * pitch,
                        r.dev as usize + t * r.width,
                        r.width,
                    ));
                }
            })?;
        }
    }
    let per_page = table.len() / pages.max(1) as usize;
    anyhow::ensure!(
        per_page * pages as usize == table.len(),
        "pages with different run counts"
    );
    Ok((table, per_page))
}

/// The four paths, in the order each round runs them.
const PATHS: [&str; 4] = ["device->host", "host->device", "host->pool", "pool->host"];

/// What a buffer is, for a like-for-like reference.
#[derive(Clone, Copy)]
enum Kind {
    /// Page-aligned private memory: the emulated device region, and the heap reference.
    Heap,
    /// A shared-memory file mapped by the arena's code: arena and pool slots.
    Shm,
}

/// What each path copies from and to, in the order of [`PATHS`].
const KINDS: [(Kind, Kind); 4] = [
    (Kind::Heap, Kind::Shm),
    (Kind::Shm, Kind::Heap),
    (Kind::Shm, Kind::Shm),
    (Kind::Shm, Kind::Shm),
];

/// Per path: the subject's and its references' times on every slice of every round.
#[derive(Default)]
struct Timings {
    subject: Vec<Duration>,
    same: Vec<Duration>,
    heap: Vec<Duration>,
    /// Device paths only: the runs reference.
    runs: Vec<Duration>,
}

/// Evicts every unleased page from host: one `make_host_room` call evicts a bounded
/// number of batches, fewer than the pages of a large `--mib` at small objects.
fn empty_host(m: &Manager) {
    while m.mover().make_host_room(usize::MAX) > 0 {}
}

fn median<T: Copy + PartialOrd>(v: &[T]) -> T {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

/// A reference buffer mapped the way the arena and the pool are: a file of `bytes` in
/// `dir`, through [`HostArena::create`] with the arena's options, as one slot.
fn shm_buffer(dir: &std::path::Path, name: &str, bytes: u64, opts: &ArenaOptions) -> anyhow::Result<HostArena> {
    let opts = ArenaOptions {
        group: None,
        ..opts.clone()
    };
    HostArena::create(&dir.join(name), bytes, bytes, &opts).with_context(|| format!("reference buffer {name}"))
}

fn rows_for(object_kib: u64, args: &TransferArgs, dir: &std::path::Path) -> anyhow::Result<Vec<Figure>> {
    // Objects of `object_kib`: 4 layers x 16 tokens x token bytes.
    let token_bytes = (object_kib * 1024 / 64) as u32;
    let layout = LayoutSpec::mha(4, 1, token_bytes / 2, 2, 16).build()?;
    let obj = layout.object_bytes(0);
    let page = layout.page_bytes();
    let pages = ((args.mib << 20) / page).max(args.batch as u64) as usize;
    let mut cfg = ManagerConfig::in_dir(dir, (pages as u64 + 8) * page, Some((pages as u64 + 8) * page));
    cfg.max_batch = args.batch.max(pages);
    cfg.transfer_queue = pages.div_ceil(args.batch) + 8;
    // Each round starts from an empty host: pages the last round prefetched must not stay
    // protected from eviction (a load would hold them), and no session policy moves pages
    // behind the bench's back. The bench measures the copy paths alone.
    cfg.tunables.stage_protect_ms = 0;
    cfg.policy = None;
    // A directory sized to what the arena and the pool can hold (with room for the pages
    // every round leaves behind), as a daemon's is (`max_pages`). Sized for the default
    // millions of pages, each store's new pages land
    // on never-touched memory of the lookup view's index (one first-touch page fault per
    // page, under the directory lock, until the whole index is resident): a start-up
    // cost charged to the subject alone, which at 64 KiB was a third of device->host.
    // Every round's pages stay booked until their pool objects are evicted and forgotten
    // (by upkeep, which the bench does not run), so there is room for each round's.
    cfg.max_pages = (args.runs + 2).max(16) * (pages + 8);
    let cores = if args.cores.is_empty() {
        let allowed = crate::affinity::allowed_cores().context("reading the cores this process may run on")?;
        allowed.into_iter().take(cfg.transfer_threads).collect()
    } else {
        args.cores.clone()
    };
    cfg.worker_cores = cores.clone();
    let workers = cfg.transfer_threads;
    let arena_opts = cfg.arena.clone();
    let m = Manager::new(cfg, SystemClock::new())?;
    let ns = m.register_namespace(Namespace::model(format!("bench-{object_kib}k")), layout.clone())?;
    let dev = Arc::new(EmulatedDevice::new(&layout, 0, pages as u32));
    m.attach_device(ns, 0, 0, dev.clone())?;
    for s in 0..pages as u32 {
        dev.fill_page(s, s as u64)?;
    }
    let slots: Vec<u32> = (0..pages as u32).collect();
    let bytes = pages as u64 * page;
    // Each path moves its pages slice by slice, and each slice is followed by the
    // references copying as many bytes: a slice is at least one batch per worker, so the
    // path runs as it would whole, and it is short enough (a few ms) that subject and
    // references meet the same machine.
    let slice = (((args.slice_mib << 20) / page) as usize)
        .max(args.batch * workers)
        .next_multiple_of(args.batch)
        .min(pages);
    // Where each path copies: stores and loads run on the transfer workers, each batch
    // shared by as many as its bytes are worth (`TransferEngine::runners`); a share is
    // one job whose copy is shared the same way (`TransferEngine::map_pieces`); a staging
    // shares each of its batches the same way, or copies on the calling thread when a
    // batch is too small to share.
    let shared = |n: usize| {
        let per_batch = crate::transfer::runners(workers, args.batch.min(n) as u64 * page);
        Threads::Workers(workers.min(n.div_ceil(args.batch) * per_batch).max(1))
    };
    // A Share is one job, shared piece by piece as a store's batch is.
    let share_pages = if args.share_pages == 0 {
        args.batch
    } else {
        args.share_pages
    };
    let shares = |n: usize| {
        let per_hint = crate::transfer::runners(workers, share_pages.min(n) as u64 * page);
        Threads::Workers(workers.min(n.div_ceil(share_pages) * per_hint).max(1))
    };
    let staged = |n: usize| {
        let batch = crate::manager::STAGE_BATCH_PAGES;
        match crate::transfer::runners(workers, batch.min(n) as u64 * page) {
            1 => Threads::Caller,
            r => Threads::Workers(workers.min(n.div_ceil(batch) * r)),
        }
    };
    let threads = [shared(slice), shared(slice), shares(slice), staged(slice)];
    // The references' buffers: page-aligned and touched before timing, as the arena, the
    // pool and the device region are, and as large as what the path moves: slice k's
    // references copy the k-th slice of them, bytes last touched a round ago, as the
    // path's are. (Reusing one slice-sized buffer would copy from cache.)
    let pattern = crate::tier::device::pattern(1, bytes as usize);
    let mut heap_src = PageAligned::new(bytes as usize, 0);
    heap_src.copy_from_slice(&pattern);
    let mut heap_dst = PageAligned::new(bytes as usize, 0);
    let (shm_src_map, shm_dst_map) = (
        shm_buffer(dir, "reference-src.arena", bytes, &arena_opts)?,
        shm_buffer(dir, "reference-dst.arena", bytes, &arena_opts)?,
    );
    // SAFETY: the bench owns both reference files' one slot each and nothing else maps
    // them; `shm_src` is written only here, before any copy reads it.
    let shm_src = unsafe { shm_src_map.slot_mut(SlotId(0), bytes as usize) }?;
    shm_src.copy_from_slice(&pattern);
    let shm_src: &[u8] = shm_src;
    // SAFETY: as above; only the reference copies write it, one slice at a time.
    let shm_dst = unsafe { shm_dst_map.slot_mut(SlotId(0), bytes as usize) }?;
    // The runs reference's device side: a region laid out as the emulated device's, and
    // each page's runs between it and an object-contiguous page. It starts out holding
    // the pattern, scattered, so that the device->host runs reference gathers the same
    // bytes the other references copy (the final check reads them back).
    let (to_dev, per_page) = device_runs(&layout, pages as u32)?;
    anyhow::ensure!(
        to_dev.iter().map(|r| r.2 as u64).sum::<u64>() == bytes,
        "the device runs do not cover every page byte once"
    );
    let to_host: Vec<_> = to_dev.iter().map(|&(h, d, n)| (d, h, n)).collect();
    let mut dev_ref = PageAligned::new(
        crate::tier::tensors::PageMap::contiguous_bytes(&layout, 0, pages as u32),
        0,
    );
    for &(h, d, n) in &to_dev {
        dev_ref[d..d + n].copy_from_slice(&pattern[h..h + n]);
    }
    // Every byte the paths and their references copy, evicted from the CPU caches before
    // each path's pass of a round (see `super::caches`): the path's device region, arena
    // and pool (the pool's file mapped again here: a cache line is evicted through any
    // mapping of it), and the references' buffers. Each copy then starts from memory, as
    // offloaded KV does in use, whatever the size of this machine's caches.
    let arena = m.stores().arena().context("the bench's manager has no arena")?;
    let crate::manager::PoolConfig::Local { path: pool_path, .. } = &m.config().pool else {
        anyhow::bail!("the bench's manager has no local pool");
    };
    let pool_file = std::fs::File::open(pool_path).context("the bench's pool file")?;
    // SAFETY: a read-only view of the pool's file, used only as addresses to evict; the
    // pool keeps the file at its size while the manager lives, which outlives this map.
    let pool_map = unsafe { memmap2::Mmap::map(&pool_file) }.context("mapping the pool file")?;
    let cold: Vec<(*const u8, usize)> = vec![
        dev.span(),
        (arena.base_ptr().cast_const(), arena.len_bytes() as usize),
        (pool_map.as_ptr(), pool_map.len()),
        (heap_src.as_ptr(), heap_src.len()),
        (heap_dst.as_ptr(), heap_dst.len()),
        (shm_src.as_ptr(), shm_src.len()),
        (shm_dst.as_ptr(), shm_dst.len()),
        (dev_ref.as_ptr(), dev_ref.len()),
    ];
    let evict_all = || {
        for &(at, len) in &cold {
            // SAFETY: each span is memory this function keeps mapped until it returns
            // (the device, the arena and pool the manager holds, the pool view, the
            // references' buffers); no copy runs while the caller evicts.
            unsafe { super::caches::evict(at, len) };
        }
    };
    let wait = Duration::from_secs(120);
    let mut hashes = Vec::new();
    let mut t: [Timings; 4] = Default::default();
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let copiers = Copiers::spawn(scope, workers, &cores);
        // Runs one slice of a path, then its two references on the same bytes and threads.
        let mut measured = |p: usize, at: usize, n: usize, op: &mut dyn FnMut() -> anyhow::Result<()>| {
            let (t, threads) = (&mut t[p], threads[p]);
            let t0 = Instant::now();
            op()?;
            t.subject.push(t0.elapsed());
            let span = at * page as usize..(at + n) * page as usize;
            let src: &[u8] = match KINDS[p].0 {
                Kind::Heap => &heap_src[span.clone()],
                Kind::Shm => &shm_src[span.clone()],
            };
            let dst: &mut [u8] = match KINDS[p].1 {
                Kind::Heap => &mut heap_dst[span.clone()],
                Kind::Shm => &mut shm_dst[span.clone()],
            };
            t.same.push(copiers.time(src, dst, obj as usize, threads)?);
            t.heap
                .push(copiers.time(&heap_src[span.clone()], &mut heap_dst[span], obj as usize, threads)?);
            let pages = at..at + n;
            match p {
                0 => t
                    .runs
                    .push(copiers.time_runs(&dev_ref, shm_dst, &to_host, per_page, pages, threads)?),
                1 => t
                    .runs
                    .push(copiers.time_runs(shm_src, &mut dev_ref, &to_dev, per_page, pages, threads)?),
                _ => {}
            }
            anyhow::Ok(())
        };
        for round in 1..=args.runs.max(1) as u64 {
            hashes = (0..pages as u64).map(|i| PageHash::from_u64(round << 40 | i)).collect();
            let slices = || {
                hashes
                    .chunks(slice)
                    .zip(slots.chunks(slice))
                    .enumerate()
                    .map(|(k, (h, s))| (k * slice, h, s))
            };
            evict_all();
            for (at, hs, ss) in slices() {
                // Device → host.
                measured(0, at, hs.len(), &mut || {
                    let tickets: Vec<_> = hs
                        .chunks(args.batch)
                        .zip(ss.chunks(args.batch))
                        .map(|(h, s)| m.store(ns, 0, 0, h, s, 0))
                        .collect::<Result<_, _>>()?;
                    // The last first: the batches end about in order, so the caller
                    // sleeps once per slice, as the references' caller does.
                    for tk in tickets.into_iter().rev() {
                        let r = m.wait(tk, wait)?;
                        anyhow::ensure!(r.failed == 0 && r.error.is_none(), "store failed: {r:?}");
                    }
                    Ok(())
                })?;
            }
            evict_all();
            for (at, hs, ss) in slices() {
                // Host → device.
                measured(1, at, hs.len(), &mut || {
                    let tickets: Vec<_> = hs
                        .chunks(args.batch)
                        .zip(ss.chunks(args.batch))
                        .map(|(h, s)| m.load(ns, 0, 0, h, s, LoadWait::BestEffort))
                        .collect::<Result<_, _>>()?;
                    for tk in tickets.into_iter().rev() {
                        let r = m.wait(tk, wait)?;
                        anyhow::ensure!(r.failed == 0, "load failed: {r:?}");
                    }
                    Ok(())
                })?;
            }
            evict_all();
            for (at, hs, _) in slices() {
                // Host → pool.
                measured(2, at, hs.len(), &mut || {
                    for h in hs.chunks(share_pages) {
                        let target = HintTarget::Pages(h.to_vec());
                        m.hint(ns, Hint::Share { target })?;
                    }
                    anyhow::ensure!(m.quiesce(wait), "share did not finish");
                    Ok(())
                })?;
            }
            // Pool → host: drop host copies (outside the timing), then prefetch them back,
            // one hint per slice as an engine names the pages of a request at once.
            m.removed(ns, 0, 0, &hashes)?;
            empty_host(&m);
            let now = m.lookup(ns, &hashes)?;
            anyhow::ensure!(now.pool == pages, "pages not in pool after share");
            // Else the prefetch finds pages still on host and copies nothing for them.
            anyhow::ensure!(now.host == 0, "{} pages stayed on host", now.host);
            evict_all();
            for (at, hs, _) in slices() {
                measured(3, at, hs.len(), &mut || {
                    let target = HintTarget::Pages(hs.to_vec());
                    let to = TierKind::Host;
                    m.hint(
                        ns,
                        Hint::Prefetch {
                            target,
                            to,
                            deadline_ms: None,
                        },
                    )?;
                    Ok(())
                })?;
            }
            anyhow::ensure!(
                m.lookup(ns, &hashes)?.host == pages,
                "prefetch did not bring every page"
            );
            // Clean slate for the next round.
            empty_host(&m);
        }
        Ok(())
    })?;
    // Content check: the last round's pages read back equal what the device holds.
    let tk = m.load(ns, 0, 0, &hashes[..1], &[0], LoadWait::WaitComplete)?;
    m.wait(tk, wait)?;
    anyhow::ensure!(dev.page_matches(0, 0)?, "bytes changed on the way");
    anyhow::ensure!(
        *heap_dst == *pattern && *shm_dst == *pattern,
        "a reference copy changed the bytes"
    );
    let mapping_page_bytes = m.stores().arena().map(|a| a.report().page_bytes);
    let total = |v: &[Duration]| v.iter().sum::<Duration>() / args.runs.max(1) as u32;
    let ratio = |s: &[Duration], r: &[Duration]| {
        let v: Vec<f64> = s
            .iter()
            .zip(r)
            .map(|(s, r)| r.as_secs_f64() / s.as_secs_f64())
            .collect();
        median(&v)
    };
    Ok(PATHS
        .iter()
        .zip(&t)
        .zip(threads)
        .map(|((path, t), threads)| Figure {
            row: Row {
                path: (*path).into(),
                object_bytes: obj,
                pages,
                bytes,
                gbps: gbps(bytes, total(&t.subject)),
                memcpy_gbps: gbps(bytes, total(&t.same)),
                ratio: ratio(&t.subject, &t.same),
            },
            threads: Some(match threads {
                Threads::Caller => 1,
                Threads::Workers(n) => n,
            }),
            memcpy_same_mapping_gbps: Some(gbps(bytes, total(&t.same))),
            memcpy_heap_gbps: Some(gbps(bytes, total(&t.heap))),
            ratio_heap: Some(ratio(&t.subject, &t.heap)),
            memcpy_same_runs_gbps: (!t.runs.is_empty()).then(|| gbps(bytes, total(&t.runs))),
            ratio_same_runs: (!t.runs.is_empty()).then(|| ratio(&t.subject, &t.runs)),
            mapping_page_bytes,
            caches_evicted: Some(super::caches::can_evict()),
            cores: Some(cores.clone()),
        })
        .collect())
}

pub fn run(args: TransferArgs) -> anyhow::Result<()> {
    let tmp;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => {
            let base = if std::path::Path::new("/dev/shm").is_dir() {
                "/dev/shm"
            } else {
                "."
            };
            tmp = tempfile::Builder::new()
                .prefix("kvtier-bench-")
                .tempdir_in(base)
                .context("temporary directory")?;
            tmp.path().to_owned()
        }
    };
    let mut rows = Vec::new();
    for &kib in &args.sizes_kib {
        anyhow::ensure!(
            (1..=64 * 1024).contains(&kib),
            "object size {kib} KiB is out of range (1 KiB to 64 MiB)"
        );
        match args.device {
            DeviceKind::Emulated => rows.extend(rows_for(kib, &args, &dir)?),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => rows.extend(
                super::transfer_cuda::rows_for(kib, &args)?
                    .into_iter()
                    .map(Figure::from),
            ),
            #[cfg(not(feature = "cuda"))]
            DeviceKind::Cuda => anyhow::bail!("this kvtier was built without the `cuda` feature"),
        }
    }
    let reference = match args.device {
        DeviceKind::Emulated => "same-mapping",
        DeviceKind::Cuda => "raw cuMemcpy",
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        let w = rows.iter().map(|f| f.row.path.len()).max().unwrap_or(0).max(14);
        println!(
            "{:<w$} {:>10} {:>7} {:>10} {:>12} {:>7} {:>10} {:>10} {:>10} {:>11}",
            "path", "object", "threads", "GB/s", reference, "ratio", "heap", "ratio_heap", "runs", "ratio_runs"
        );
        let opt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.2}"));
        for f in &rows {
            let r = &f.row;
            println!(
                "{:<w$} {:>9}K {:>7} {:>10.2} {:>12.2} {:>7.2} {:>10} {:>10} {:>10} {:>11}",
                r.path,
                r.object_bytes / 1024,
                f.threads.map_or("-".into(), |t| t.to_string()),
                r.gbps,
                r.memcpy_gbps,
                r.ratio,
                opt(f.memcpy_heap_gbps),
                opt(f.ratio_heap),
                opt(f.memcpy_same_runs_gbps),
                opt(f.ratio_same_runs)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::tensors::PageMap;

    /// The runs reference's table gathers from a device region exactly the bytes the
    /// emulated device holds for each layer of each page, and covers every device byte
    /// once: a wrong table would time a copy of other bytes than the path moves.
    #[test]
    fn the_runs_table_gathers_each_page_as_the_device_lays_it_out() {
        for layout in [
            LayoutSpec::mha(4, 1, 128, 2, 16).build().unwrap(),
            LayoutSpec::mla(3, 96, 2, 16).build().unwrap(),
        ] {
            let pages = 5u32;
            let dev = EmulatedDevice::new(&layout, 0, pages);
            for s in 0..pages {
                dev.fill_page(s, 100 + s as u64).unwrap();
            }
            let map = PageMap::contiguous(&layout, 0, pages, 0);
            let len = PageMap::contiguous_bytes(&layout, 0, pages);
            let raw = dev.read_raw(0, len).unwrap();
            let (table, per_page) = device_runs(&layout, pages).unwrap();
            let page = layout.page_bytes() as usize;
            assert_eq!(table.len(), per_page * pages as usize);
            let mut host = vec![0u8; page * pages as usize];
            let mut seen = vec![0u8; len];
            for &(h, d, n) in &table {
                host[h..h + n].copy_from_slice(&raw[d..d + n]);
                seen[d..d + n].iter_mut().for_each(|b| *b += 1);
            }
            assert!(seen.iter().all(|&b| b == 1), "a device byte read twice or never");
            let (obj, run) = (map.object_bytes(), map.run());
            for s in 0..pages as usize {
                for (pi, &part) in map.parts().iter().enumerate() {
                    for layer in 0..map.layers() {
                        let at = s * page + pi * obj + layer as usize * run;
                        assert_eq!(
                            host[at..at + run],
                            dev.read_layer(s as u32, part, layer).unwrap()[..],
                            "page {s} part {part:?} layer {layer}"
                        );
                    }
                }
            }
        }
    }
}
