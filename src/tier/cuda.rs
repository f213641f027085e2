//! The CUDA device tier (feature `cuda`): one rank's KV region in GPU memory, either
//! allocated here (`[part][layer][page][token bytes]`, like the emulated device) or
//! wrapped around the engine's own KV tensors ([`CudaDevice::wrap`]), which it never
//! frees. Both are addressed through one [`PageMap`].
//!
//! cudarc is loaded at run time, so this builds without a toolkit; [`driver_present`]
//! says whether a driver and a GPU are there (cudarc panics at its first call when
//! `libcuda` is absent, so every constructor asks first). Copies run on a dedicated copy
//! stream: an event recorded on the engine's compute stream orders D2H after the kernels
//! that wrote the pages, and the caller waits for an event recorded behind the copies,
//! with a deadline (`wait_landed`). A batch's runs move in as few copies as their
//! addresses allow (`cuda_batch`): 2-D copies where they step evenly, the rest in one
//! `cuMemcpyBatchAsync` where the driver has it (CUDA 12.8+). The daemon's arena, mapped by this process, is registered as
//! pinned memory in bounded chunks ([`PIN_CHUNK_BYTES`]) and the time it took is logged.
//! A batch that does not land within the copy timeout marks the region broken: the
//! driver may still write into the host buffers later, so it refuses further copies and,
//! when dropped, leaks its memory rather than freeing what a hung copy may still touch.

use std::panic::catch_unwind;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use parking_lot::Mutex;

use super::cuda_batch::{RunKey, coalesce};
use super::device::{DeviceError, DeviceRegion, ObjectCopy};
use super::tensors::{KvTensors, PageMap};
use crate::layout::{Layout, Part};

/// Largest single `cuMemHostRegister` call; bigger ranges are registered chunk by chunk.
pub const PIN_CHUNK_BYTES: usize = 1 << 30;
/// Longest wait for one copy batch. Default: 10 s.
pub const DEFAULT_COPY_TIMEOUT: Duration = Duration::from_secs(10);
/// A batch's wait spins at least this long before it naps...
const SPIN_FLOOR: Duration = Duration::from_micros(200);
/// ...and as long as its bytes take at this rate (bytes per ns, i.e. GB/s: half of
/// PCIe 5's one-way speed, so a batch on a busy link is still waited for in the spin).
const SPIN_BYTES_PER_NS: u64 = 25;
/// The first and the longest nap of a wait past its spin.
const MIN_NAP: Duration = Duration::from_micros(20);
const MAX_NAP: Duration = Duration::from_millis(1);

/// Whether a CUDA driver library and at least one GPU are present. Never panics.
pub fn driver_present() -> bool {
    catch_unwind(|| {
        // SAFETY: only tries to open the driver library.
        let lib = unsafe { sys::is_culib_present() };
        lib && CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    })
    .unwrap_or(false)
}

pub(super) fn check(r: CUresult, what: &str) -> Result<(), DeviceError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Copy(format!("{what}: {r:?}")))
    }
}

fn driver_err(e: cudarc::driver::DriverError) -> DeviceError {
    DeviceError::Copy(e.to_string())
}

/// One contiguous (or 2-D) move between a device address and host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Move {
    pub(super) dev: CUdeviceptr,
    pub(super) host: *mut u8,
    pub(super) width: usize,
    /// The rows of a 2-D move; `None` for a contiguous one.
    pub(super) rows: Option<Rows>,
}

/// `n` rows of a move's `width` bytes, each side's rows its own pitch apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Rows {
    pub(super) n: usize,
    pub(super) dev_pitch: usize,
    pub(super) host_pitch: usize,
}

/// Host memory registered with the driver.
#[derive(Default)]
struct Pinned {
    /// Ranges (base, len) handed to `register_host`.
    ranges: Vec<(usize, usize)>,
    /// Chunk addresses this region registered, to unregister on drop.
    chunks: Vec<usize>,
}

/// One rank's KV region in GPU memory.
pub struct CudaDevice {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) copy: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    map: PageMap,
    /// The allocation this region made (freed on drop); `None` for wrapped tensors.
    owned: Option<CUdeviceptr>,
    pinned: Mutex<Pinned>,
    pub(super) batch: AtomicBool,
    /// Set when a batch did not land in time; the region refuses copies from then on.
    broken: AtomicBool,
    serial: Mutex<()>,
    /// Recorded on the compute stream before each batch, for the copy stream to wait on
    /// (one event reused under `serial`, not one created per batch).
    ready: CudaEvent,
    /// Recorded on the copy stream behind each batch; queried until it completes.
    done: CudaEvent,
    timeout: Duration,
    pin_chunk: usize,
}

// SAFETY: the raw device address and host pointers are only used under `serial`, on the
// context bound to the calling thread; cudarc's context and streams are Send + Sync.
unsafe impl Send for CudaDevice {}
// SAFETY: as for Send: shared references only reach the raw addresses under `serial`.
unsafe impl Sync for CudaDevice {}

/// The context of GPU `ordinal`, a copy stream, and whether the driver batches copies.
fn open(ordinal: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>, bool), DeviceError> {
    if !driver_present() {
        return Err(DeviceError::Copy("no CUDA driver or GPU".into()));
    }
    let ctx = catch_unwind(|| CudaContext::new(ordinal))
        .map_err(|_| DeviceError::Copy("the CUDA driver failed to load".into()))?
        .map_err(driver_err)?;
    let copy = ctx.new_stream().map_err(driver_err)?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) };
    Ok((ctx, copy, version >= 12080))
}

impl CudaDevice {
    fn build(
        ctx: Arc<CudaContext>,
        copy: Arc<CudaStream>,
        batch: bool,
        map: PageMap,
        owned: Option<CUdeviceptr>,
    ) -> Result<Self, DeviceError> {
        let events = ctx.new_event(None).and_then(|r| Ok((r, ctx.new_event(None)?)));
        let (ready, done) = match events {
            Ok(e) => e,
            Err(e) => {
                if let Some(base) = owned {
                    // SAFETY: allocated by `new` just before; nothing else has it.
                    let _ = unsafe { sys::cuMemFree_v2(base) };
                }
                return Err(driver_err(e));
            }
        };
        Ok(Self {
            compute: ctx.default_stream(),
            ctx,
            copy,
            map,
            owned,
            pinned: Mutex::new(Pinned::default()),
            batch: AtomicBool::new(batch),
            broken: AtomicBool::new(false),
            serial: Mutex::new(()),
            ready,
            done,
            timeout: DEFAULT_COPY_TIMEOUT,
            pin_chunk: PIN_CHUNK_BYTES,
        })
    }

    /// Allocates a region of `pages` pages for rank `pp_rank` of `layout` on GPU `ordinal`.
    pub fn new(layout: &Layout, pp_rank: u16, pages: u32, ordinal: usize) -> Result<Self, DeviceError> {
        let (ctx, copy, batch) = open(ordinal)?;
        let bytes = PageMap::contiguous_bytes(layout, pp_rank, pages);
        ctx.bind_to_thread().map_err(driver_err)?;
        let mut base: CUdeviceptr = 0;
        // SAFETY: allocates device memory on the bound context; freed in Drop.
        check(unsafe { sys::cuMemAlloc_v2(&mut base, bytes.max(1)) }, "cuMemAlloc")?;
        let map = PageMap::contiguous(layout, pp_rank, pages, base);
        Self::build(ctx, copy, batch, map, Some(base))
    }

    /// Wraps the engine's own KV tensors on GPU `ordinal` (see [`KvTensors`] for the
    /// order of the addresses). The tensors are checked before the driver is touched, so
    /// bad addresses are a [`DeviceError::Tensors`] with or without a GPU.
    ///
    /// # Safety
    /// Every page of every tensor must be device memory of GPU `ordinal`'s primary
    /// context (what PyTorch allocates), and stay allocated while the region lives; the
    /// engine must not write a page while a copy of it is in flight.
    pub unsafe fn wrap(
        layout: &Layout,
        pp_rank: u16,
        tensors: &KvTensors,
        ordinal: usize,
    ) -> Result<Self, DeviceError> {
        let map = PageMap::wrap(layout, pp_rank, tensors)?;
        let (ctx, copy, batch) = open(ordinal)?;
        Self::build(ctx, copy, batch, map, None)
    }

    /// The engine stream whose work device→host copies must follow. Default: the
    /// context's default stream.
    pub fn with_compute_stream(mut self, stream: Arc<CudaStream>) -> Self {
        self.compute = stream;
        self
    }

    /// The engine's compute stream as a raw `CUstream` (PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`); 0 keeps the default stream. Default: 0.
    ///
    /// # Safety
    /// A non-zero `stream` must be a stream of this region's context that outlives it.
    pub unsafe fn with_raw_compute_stream(self, stream: u64) -> Self {
        if stream == 0 {
            return self;
        }
        // SAFETY: caller contract.
        let s = unsafe { self.ctx.wrap_borrowed_stream(stream as sys::CUstream) };
        self.with_compute_stream(s)
    }

    /// Longest wait for one copy batch. Default: 10 s.
    pub fn with_copy_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Largest single pinned-memory registration; larger host ranges are registered in
    /// chunks of this size. Default: [`PIN_CHUNK_BYTES`] (1 GiB).
    pub fn with_pin_chunk_bytes(mut self, bytes: usize) -> Self {
        self.pin_chunk = bytes.max(1);
        self
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The copy stream (benches time raw copies on it).
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// Device address of page 0 of the first (part, layer); for an owned region, the
    /// first byte of its allocation.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.map.chunk(0, 0, 0)
    }

    /// Whether this region wraps engine-owned tensors (and so never frees them).
    pub fn is_wrapped(&self) -> bool {
        self.owned.is_none()
    }

    /// Whether batched copies are in use (the driver has them and they have not failed).
    pub fn batched(&self) -> bool {
        self.batch.load(Ordering::Relaxed)
    }

    /// Whether a copy batch failed to land in time, leaving the region unusable.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// The moves of one object, each keyed by the object's place in the batch, its part
    /// and the run's place in the object, for [`coalesce`](super::cuda_batch::coalesce).
    fn plan(
        &self,
        slot: u32,
        part: Part,
        len: usize,
        host: *mut u8,
        out: &mut Vec<(RunKey, Move)>,
    ) -> Result<(), DeviceError> {
        let object = out.last().map_or(0, |(k, _)| k.object + 1);
        let mut run = 0u32;
        self.map.plan(slot, part, len, |r| {
            let m = Move {
                dev: r.dev,
                // SAFETY: `host_off` < `len`, the checked object size.
                host: unsafe { host.add(r.host_off) },
                width: r.width,
                rows: r.rows.map(|(n, host_pitch)| Rows {
                    n,
                    dev_pitch: r.width,
                    host_pitch,
                }),
            };
            out.push((
                RunKey {
                    object,
                    part: part as u8,
                    run,
                },
                m,
            ));
            run += 1;
        })
    }

    /// Issues the moves on the copy stream after the compute stream's work, then waits
    /// (bounded) for them to land.
    fn run(&self, moves: &[Move], to_host: bool) -> Result<(), DeviceError> {
        let _serial = self.serial.lock();
        if self.is_broken() {
            return Err(DeviceError::Copy(
                "an earlier copy batch never finished; the region is unusable".into(),
            ));
        }
        self.ctx.bind_to_thread().map_err(driver_err)?;
        self.ready.record(&self.compute).map_err(driver_err)?;
        self.copy.wait(&self.ready).map_err(driver_err)?;
        // 2-D moves one call each; the contiguous ones in one batched call where the driver
        // has it.
        let (flat, rows): (Vec<Move>, Vec<Move>) = moves.iter().partition(|m| m.rows.is_none());
        let issued = rows.iter().try_for_each(|m| self.issue_one(m, to_host)).and_then(|()| {
            if flat.len() > 1 && self.batched() && self.issue_batch(&flat, to_host).is_ok() {
                Ok(())
            } else {
                flat.iter().try_for_each(|m| self.issue_one(m, to_host))
            }
        });
        // Even when a move was refused, the ones issued before it must land before the
        // host buffers go back to the caller.
        let bytes = moves.iter().map(|m| m.width * m.rows.map_or(1, |r| r.n)).sum();
        self.wait_landed(bytes)?;
        issued
    }

    /// Blocks until everything queued on the copy stream so far has run, or the copy
    /// timeout passes; then the region is broken, because the driver may still write
    /// into the caller's buffers. An event recorded behind the copies is queried: in a
    /// spin while the copies should still be running (`bytes` at PCIe speed), then with
    /// naps that double up to [`MAX_NAP`]. Nothing of ours is ever blocked inside the
    /// driver, so the watchdog always fires; and no driver thread has to wake us, which
    /// on an H200 cost a batch 50 to 300 us (see `docs/engines.md`, *Waiting for a
    /// batch*).
    fn wait_landed(&self, bytes: usize) -> Result<(), DeviceError> {
        self.done.record(&self.copy).map_err(|e| {
            // Copies may be in flight into the caller's buffers and nothing can now say
            // when they land.
            self.mark_broken(format!("recording the batch's end: {e}"))
        })?;
        let start = Instant::now();
        let deadline = start + self.timeout;
        let spin = SPIN_FLOOR + Duration::from_nanos(bytes as u64 / SPIN_BYTES_PER_NS);
        let mut nap = MIN_NAP;
        loop {
            // SAFETY: the event is this region's, recorded above on its live copy stream.
            match unsafe { sys::cuEventQuery(self.done.cu_event()) } {
                CUresult::CUDA_SUCCESS => return Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                r => return Err(self.mark_broken(format!("waiting for the batch: {r:?}"))),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.mark_broken(format!("copies did not finish in {:?}", self.timeout)));
            }
            if now - start < spin.min(self.timeout) {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(nap.min(deadline - now));
                nap = (nap * 2).min(MAX_NAP);
            }
        }
    }

    fn mark_broken(&self, why: String) -> DeviceError {
        self.broken.store(true, Ordering::Relaxed);
        tracing::error!(%why, "a CUDA copy batch did not finish; the region is unusable");
        DeviceError::Copy(why)
    }
}

impl DeviceRegion for CudaDevice {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn pages(&self) -> u32 {
        self.map.pages()
    }

    fn object_bytes(&self) -> usize {
        self.map.object_bytes()
    }

    fn copy_to_host(&self, batch: &mut [ObjectCopy<&mut [u8]>]) -> Result<(), DeviceError> {
        let mut moves = Vec::with_capacity(batch.len() * self.map.layers() as usize);
        for c in batch.iter_mut() {
            self.plan(c.slot, c.part, c.host.len(), c.host.as_mut_ptr(), &mut moves)?;
        }
        self.run(&coalesce(moves), true)
    }

    fn copy_from_host(&self, batch: &[ObjectCopy<&[u8]>]) -> Result<(), DeviceError> {
        let mut moves = Vec::with_capacity(batch.len() * self.map.layers() as usize);
        for c in batch {
            // Only read from in this direction.
            self.plan(c.slot, c.part, c.host.len(), c.host.as_ptr().cast_mut(), &mut moves)?;
        }
        self.run(&coalesce(moves), false)
    }

    fn register_host(&self, base: *mut u8, len: usize) -> Result<(), DeviceError> {
        let mut pinned = self.pinned.lock();
        if pinned.ranges.contains(&(base as usize, len)) {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(driver_err)?;
        let t = Instant::now();
        let mut chunks = 0;
        let mut off = 0;
        let first = pinned.chunks.len();
        while off < len {
            let n = self.pin_chunk.min(len - off);
            let chunk = (base as usize + off) as *mut std::ffi::c_void;
            // SAFETY: `base..base+len` is this process's mapping of the arena (caller
            // contract); the driver validates the range.
            let r = unsafe { sys::cuMemHostRegister_v2(chunk, n, 1) };
            if r != CUresult::CUDA_SUCCESS && r != CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
                // Undo this call's chunks, so a retry (say with smaller chunks) starts clean.
                for &c in &pinned.chunks[first..] {
                    // SAFETY: registered just above; no copy uses the range yet.
                    let _ = unsafe { sys::cuMemHostUnregister(c as *mut _) };
                }
                pinned.chunks.truncate(first);
                return Err(DeviceError::Copy(format!("cuMemHostRegister of chunk {chunks}: {r:?}")));
            }
            if r == CUresult::CUDA_SUCCESS {
                pinned.chunks.push(base as usize + off);
            }
            off += n;
            chunks += 1;
        }
        pinned.ranges.push((base as usize, len));
        tracing::info!(
            bytes = len,
            chunks,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "pinned the host arena"
        );
        Ok(())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Errors are ignored: nothing useful can be done about them while dropping.
        if self.is_broken() {
            // A hung copy may still read or write the device memory and the pinned host
            // ranges; waiting for it could block forever. Leak both instead.
            tracing::error!("dropping a broken CUDA region: its memory and pinned ranges are leaked");
            return;
        }
        if self.ctx.bind_to_thread().is_ok() {
            let _ = self.copy.synchronize();
            for &b in self.pinned.lock().chunks.iter() {
                // SAFETY: registered by `register_host`; no copy is in flight after the sync.
                let _ = unsafe { sys::cuMemHostUnregister(b as *mut _) };
            }
            if let Some(base) = self.owned {
                // SAFETY: allocated in `new`; wrapped tensors belong to the engine.
                let _ = unsafe { sys::cuMemFree_v2(base) };
            }
        }
    }
}
