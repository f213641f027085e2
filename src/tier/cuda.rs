//! The CUDA device tier (feature `cuda`): one rank's KV region in GPU memory, with the
//! same byte layout as the emulated device (`[part][layer][page][token bytes]`).
//!
//! cudarc is loaded at run time, so this builds without a toolkit; [`driver_present`]
//! says whether a driver and a GPU are there (cudarc panics at its first call when
//! `libcuda` is absent, so every constructor asks first). Copies run on a dedicated copy
//! stream: an event recorded on the engine's compute stream orders D2H after the kernels
//! that wrote the pages, and a second event, polled with a deadline, says the batch
//! landed. Layer-first objects move as one contiguous run per layer, batched into one
//! `cuMemcpyBatchAsync` where the driver has it (CUDA 12.8+); page-first objects move as
//! one 2-D copy per layer. The daemon's arena, mapped by this process, is registered as
//! pinned memory in bounded chunks ([`PIN_CHUNK_BYTES`]) and the time it took is logged.

use std::panic::catch_unwind;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use cudarc::driver::{CudaContext, CudaStream};
use parking_lot::Mutex;

use super::device::{DeviceError, DeviceRegion, ObjectCopy};
use crate::layout::{ByteOrder, Layout, Part};

/// Largest single `cuMemHostRegister` call; bigger ranges are registered chunk by chunk.
pub const PIN_CHUNK_BYTES: usize = 1 << 30;
/// Longest wait for one copy batch. Default: 10 s.
pub const DEFAULT_COPY_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether a CUDA driver library and at least one GPU are present. Never panics.
pub fn driver_present() -> bool {
    catch_unwind(|| {
        // SAFETY: only tries to open the driver library.
        let lib = unsafe { sys::is_culib_present() };
        lib && CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    })
    .unwrap_or(false)
}

fn check(r: CUresult, what: &str) -> Result<(), DeviceError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Copy(format!("{what}: {r:?}")))
    }
}

fn driver_err(e: cudarc::driver::DriverError) -> DeviceError {
    DeviceError::Copy(e.to_string())
}

/// One contiguous (or 2-D, for page-first) move between a device address and host memory.
pub(super) struct Move {
    pub(super) dev: CUdeviceptr,
    pub(super) host: *mut u8,
    pub(super) width: usize,
    /// Rows and host pitch of a 2-D move; `None` for a contiguous one.
    pub(super) rows: Option<(usize, usize)>,
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
    base: CUdeviceptr,
    parts: &'static [Part],
    layers: u32,
    pages: u32,
    page_tokens: usize,
    token_bytes: usize,
    order: ByteOrder,
    pinned: Mutex<Pinned>,
    pub(super) batch: AtomicBool,
    serial: Mutex<()>,
    timeout: Duration,
}

// SAFETY: the raw device address and host pointers are only used under `serial`, on the
// context bound to the calling thread; cudarc's context and streams are Send + Sync.
unsafe impl Send for CudaDevice {}
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Allocates a region of `pages` pages for rank `pp_rank` of `layout` on GPU `ordinal`.
    pub fn new(layout: &Layout, pp_rank: u16, pages: u32, ordinal: usize) -> Result<Self, DeviceError> {
        if !driver_present() {
            return Err(DeviceError::Copy("no CUDA driver or GPU".into()));
        }
        let ctx = catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| DeviceError::Copy("the CUDA driver failed to load".into()))?
            .map_err(driver_err)?;
        let copy = ctx.new_stream().map_err(driver_err)?;
        let compute = ctx.default_stream();
        let parts = layout.rank_parts();
        let layers = layout.stage_layers(pp_rank);
        let page_tokens = layout.page_tokens() as usize;
        let token_bytes = layout.token_layer_bytes();
        let bytes = parts.len() * layers as usize * pages as usize * page_tokens * token_bytes;
        ctx.bind_to_thread().map_err(driver_err)?;
        let mut base: CUdeviceptr = 0;
        // SAFETY: allocates device memory on the bound context; freed in Drop.
        check(unsafe { sys::cuMemAlloc_v2(&mut base, bytes.max(1)) }, "cuMemAlloc")?;
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut version) };
        Ok(Self {
            ctx,
            copy,
            compute,
            base,
            parts,
            layers,
            pages,
            page_tokens,
            token_bytes,
            order: layout.byte_order(),
            pinned: Mutex::new(Pinned::default()),
            batch: AtomicBool::new(version >= 12080),
            serial: Mutex::new(()),
            timeout: DEFAULT_COPY_TIMEOUT,
        })
    }

    /// The engine stream whose work device→host copies must follow. Default: the
    /// context's default stream.
    pub fn with_compute_stream(mut self, stream: Arc<CudaStream>) -> Self {
        self.compute = stream;
        self
    }

    /// Longest wait for one copy batch. Default: 10 s.
    pub fn with_copy_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The copy stream (benches time raw copies on it).
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    /// Device address of the region's first byte.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.base
    }

    /// Whether batched copies are in use (the driver has them and they have not failed).
    pub fn batched(&self) -> bool {
        self.batch.load(Ordering::Relaxed)
    }

    fn page_layer_bytes(&self) -> usize {
        self.page_tokens * self.token_bytes
    }

    fn chunk(&self, part: usize, layer: u32, slot: u32) -> CUdeviceptr {
        let off = ((part * self.layers as usize + layer as usize) * self.pages as usize + slot as usize)
            * self.page_layer_bytes();
        self.base + off as u64
    }

    fn plan(&self, slot: u32, part: Part, len: usize, host: *mut u8, out: &mut Vec<Move>) -> Result<(), DeviceError> {
        if slot >= self.pages {
            return Err(DeviceError::BadSlot {
                slot,
                pages: self.pages,
            });
        }
        let p = self
            .parts
            .iter()
            .position(|&x| x == part)
            .ok_or(DeviceError::BadPart(part))?;
        if len != self.object_bytes() {
            return Err(DeviceError::WrongSize {
                got: len,
                want: self.object_bytes(),
            });
        }
        let run = self.page_layer_bytes();
        for layer in 0..self.layers {
            let (host_off, rows) = match self.order {
                ByteOrder::LayerFirst => (layer as usize * run, None),
                ByteOrder::PageFirst => (
                    layer as usize * self.token_bytes,
                    Some((self.page_tokens, self.layers as usize * self.token_bytes)),
                ),
            };
            out.push(Move {
                dev: self.chunk(p, layer, slot),
                // SAFETY: `host_off` < `len`, the checked object size.
                host: unsafe { host.add(host_off) },
                width: if rows.is_some() { self.token_bytes } else { run },
                rows,
            });
        }
        Ok(())
    }

    /// Issues the moves on the copy stream after the compute stream's work, then waits
    /// (bounded) for them to land.
    fn run(&self, moves: &[Move], to_host: bool) -> Result<(), DeviceError> {
        let _serial = self.serial.lock();
        self.ctx.bind_to_thread().map_err(driver_err)?;
        let ready = self.ctx.new_event(None).map_err(driver_err)?;
        ready.record(&self.compute).map_err(driver_err)?;
        self.copy.wait(&ready).map_err(driver_err)?;
        let flat = moves.iter().all(|m| m.rows.is_none());
        if !(flat && moves.len() > 1 && self.batched() && self.issue_batch(moves, to_host).is_ok()) {
            for m in moves {
                self.issue_one(m, to_host)?;
            }
        }
        let done = self.ctx.new_event(None).map_err(driver_err)?;
        done.record(&self.copy).map_err(driver_err)?;
        let t = Instant::now();
        while !done.try_is_complete().map_err(driver_err)? {
            if t.elapsed() > self.timeout {
                return Err(DeviceError::Copy(format!(
                    "copies did not finish in {:?}",
                    self.timeout
                )));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    fn issue_one(&self, m: &Move, to_host: bool) -> Result<(), DeviceError> {
        let stream = self.copy.cu_stream();
        match (m.rows, to_host) {
            // SAFETY (all arms): addresses checked by `plan`; the host memory outlives the
            // call because `run` waits for the copies before returning.
            (None, true) => check(
                unsafe { sys::cuMemcpyDtoHAsync_v2(m.host.cast(), m.dev, m.width, stream) },
                "cuMemcpyDtoHAsync",
            ),
            (None, false) => check(
                unsafe { sys::cuMemcpyHtoDAsync_v2(m.dev, m.host.cast_const().cast(), m.width, stream) },
                "cuMemcpyHtoDAsync",
            ),
            (Some((rows, pitch)), to_host) => {
                // SAFETY: a plain C struct; zero is a valid value for every field.
                let mut c: sys::CUDA_MEMCPY2D = unsafe { std::mem::zeroed() };
                c.WidthInBytes = m.width;
                c.Height = rows;
                if to_host {
                    (c.srcMemoryType, c.srcDevice, c.srcPitch) =
                        (sys::CUmemorytype::CU_MEMORYTYPE_DEVICE, m.dev, m.width);
                    (c.dstMemoryType, c.dstHost, c.dstPitch) =
                        (sys::CUmemorytype::CU_MEMORYTYPE_HOST, m.host.cast(), pitch);
                } else {
                    (c.srcMemoryType, c.srcHost, c.srcPitch) =
                        (sys::CUmemorytype::CU_MEMORYTYPE_HOST, m.host.cast(), pitch);
                    (c.dstMemoryType, c.dstDevice, c.dstPitch) =
                        (sys::CUmemorytype::CU_MEMORYTYPE_DEVICE, m.dev, m.width);
                }
                check(unsafe { sys::cuMemcpy2DAsync_v2(&c, stream) }, "cuMemcpy2DAsync")
            }
        }
    }
}

impl DeviceRegion for CudaDevice {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn pages(&self) -> u32 {
        self.pages
    }

    fn object_bytes(&self) -> usize {
        self.layers as usize * self.page_layer_bytes()
    }

    fn copy_to_host(&self, batch: &mut [ObjectCopy<&mut [u8]>]) -> Result<(), DeviceError> {
        let mut moves = Vec::with_capacity(batch.len() * self.layers as usize);
        for c in batch.iter_mut() {
            self.plan(c.slot, c.part, c.host.len(), c.host.as_mut_ptr(), &mut moves)?;
        }
        self.run(&moves, true)
    }

    fn copy_from_host(&self, batch: &[ObjectCopy<&[u8]>]) -> Result<(), DeviceError> {
        let mut moves = Vec::with_capacity(batch.len() * self.layers as usize);
        for c in batch {
            // Only read from in this direction.
            self.plan(c.slot, c.part, c.host.len(), c.host.as_ptr().cast_mut(), &mut moves)?;
        }
        self.run(&moves, false)
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
        while off < len {
            let n = PIN_CHUNK_BYTES.min(len - off);
            // SAFETY: `base..base+len` is this process's mapping of the arena (caller
            // contract); the driver validates the range.
            let chunk = (base as usize + off) as *mut std::ffi::c_void;
            let r = unsafe { sys::cuMemHostRegister_v2(chunk, n, 1) };
            if r != CUresult::CUDA_SUCCESS && r != CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
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
        if self.ctx.bind_to_thread().is_ok() {
            for &b in self.pinned.lock().chunks.iter() {
                // SAFETY: registered by `register_host`.
                let _ = unsafe { sys::cuMemHostUnregister(b as *mut _) };
            }
            let _ = self.copy.synchronize();
            // SAFETY: allocated in `new`; no copy is in flight after the sync.
            let _ = unsafe { sys::cuMemFree_v2(self.base) };
        }
    }
}
