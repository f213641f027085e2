//! The object both foreign interfaces hand out: a connected client plus the device region
//! the engine registered through the boundary (an emulated one it can fill and check).
//!
//! The C ABI never gives C a pointer to a [`Handle`]: it hands out an id from a registry
//! ([`register`], [`lookup`], [`unregister`]) disguised as the opaque `kvtier_client_t *`.
//! A C caller that closes twice, uses a handle after closing it, or passes a made-up
//! pointer therefore gets `KVTIER_ERR_CLOSED` instead of a double free or a read of freed
//! memory. Ids are never reused, so a stale one cannot reach a newer client; a call in
//! flight on another thread keeps its own reference, so a close never frees a client
//! under it.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::host_tensors::HostTensors;
use super::{ERR_CLOSED, ERR_INVALID, FfiError};
use crate::client::{Client, ClientConfig};
use crate::layout::Part;
use crate::tier::device::{DeviceError, DeviceRegion, EmulatedDevice, ObjectCopy};
use crate::tier::tensors::{KvTensors, PageMap};

/// Most pages an emulated region created through the boundary may hold.
pub const MAX_EMULATED_PAGES: u32 = 1 << 20;

/// Most handles one process may hold open through the C ABI at once.
pub const MAX_OPEN_HANDLES: usize = 4096;

/// The open C ABI handles by id. Taken alone and only to insert, clone or remove an entry
/// (never while calling into a client), so it ranks below nothing and blocks no one long.
struct Registry {
    next: u64,
    live: BTreeMap<u64, Arc<Handle>>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next: 1,
    live: BTreeMap::new(),
});

/// Files `h` and returns its id (never 0, never reused).
pub(crate) fn register(h: Handle) -> Result<u64, FfiError> {
    let mut r = REGISTRY.lock();
    if r.live.len() >= MAX_OPEN_HANDLES {
        return Err(FfiError::new(
            ERR_INVALID,
            format!("{MAX_OPEN_HANDLES} client handles are open; close one first"),
        ));
    }
    let id = r.next;
    r.next += 1;
    r.live.insert(id, Arc::new(h));
    Ok(id)
}

fn closed(id: u64) -> FfiError {
    FfiError::new(
        ERR_CLOSED,
        format!("client handle {id:#x} is closed or did not come from kvtier_connect"),
    )
}

/// The open handle of `id`; `ERR_CLOSED` when it was closed or never opened.
pub(crate) fn lookup(id: u64) -> Result<Arc<Handle>, FfiError> {
    REGISTRY.lock().live.get(&id).cloned().ok_or_else(|| closed(id))
}

/// Closes `id`: the client is dropped once the last call in flight on it returns.
/// `ERR_CLOSED` when it was already closed or never opened.
pub(crate) fn unregister(id: u64) -> Result<(), FfiError> {
    let h = REGISTRY.lock().live.remove(&id).ok_or_else(|| closed(id))?;
    // Dropped outside the lock: closing the connection may take a moment.
    drop(h);
    Ok(())
}

/// A connected engine rank as a foreign caller holds it.
pub struct Handle {
    client: Client,
    emulated: RwLock<Option<Arc<EmulatedDevice>>>,
    /// Advice taken from the daemon that the caller's buffer could not hold: handed out
    /// first by the next `kvtier_take_advice`, so advice (taken once) is never lost.
    pending_advice: Mutex<Option<String>>,
}

pub(crate) fn part(p: u32) -> Result<Part, FfiError> {
    match p {
        0 => Ok(Part::K),
        1 => Ok(Part::V),
        2 => Ok(Part::Latent),
        p => Err(FfiError::new(
            ERR_INVALID,
            format!("part {p} is not 0 (K), 1 (V) or 2 (latent)"),
        )),
    }
}

impl Handle {
    pub fn connect(cfg: ClientConfig) -> Result<Self, FfiError> {
        Ok(Self {
            client: Client::connect(cfg)?,
            emulated: RwLock::new(None),
            pending_advice: Mutex::new(None),
        })
    }

    /// Advice as JSON (see [`super::capi_advice`]): what a too-small buffer left pending,
    /// else a fresh batch of at most `max_pages` pages from the daemon.
    pub(crate) fn take_advice_json(&self, max_pages: usize) -> Result<String, FfiError> {
        if let Some(json) = self.pending_advice.lock().take() {
            return Ok(json);
        }
        let batch = self.client.take_advice(max_pages)?;
        Ok(super::capi_advice::advice_json(&batch))
    }

    /// Keeps advice the caller could not take this time.
    pub(crate) fn keep_advice(&self, json: String) {
        *self.pending_advice.lock() = Some(json);
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Creates an emulated region of `pages` pages for this rank and registers it.
    pub fn register_emulated(&self, pages: u32) -> Result<(), FfiError> {
        if pages == 0 || pages > MAX_EMULATED_PAGES {
            return Err(FfiError::new(
                ERR_INVALID,
                format!("an emulated region holds 1 to {MAX_EMULATED_PAGES} pages, not {pages}"),
            ));
        }
        let layout = self.client.layout();
        let bytes = (pages as u64).saturating_mul(layout.page_bytes());
        // One rank holds its share of a page; the whole page bounds it from above.
        if bytes > 16 << 30 {
            return Err(FfiError::new(
                ERR_INVALID,
                format!("{bytes} bytes is too large an emulated region"),
            ));
        }
        let dev = Arc::new(EmulatedDevice::new(layout, self.client.identity().pp_rank, pages));
        self.client.register_device(dev.clone())?;
        *self.emulated.write() = Some(dev);
        Ok(())
    }

    /// Registers any device region (the CUDA one, for instance).
    pub fn register(&self, dev: Arc<dyn DeviceRegion>) -> Result<(), FfiError> {
        self.client.register_device(dev)?;
        *self.emulated.write() = None;
        Ok(())
    }

    /// Allocates a region of `pages` pages on GPU `ordinal` and registers it (feature
    /// `cuda`); without the feature [`ERR_UNSUPPORTED`](super::ERR_UNSUPPORTED), without
    /// a driver a device error.
    pub fn register_cuda(&self, ordinal: u32, pages: u32) -> Result<(), FfiError> {
        #[cfg(feature = "cuda")]
        {
            let pp = self.client.identity().pp_rank;
            let dev = crate::tier::cuda::CudaDevice::new(self.client.layout(), pp, pages, ordinal as usize)?;
            self.register(Arc::new(dev))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (ordinal, pages);
            Err(DeviceError::NoCuda.into())
        }
    }

    /// Wraps the engine's own KV tensors on GPU `ordinal` and registers them (feature
    /// `cuda`): `tensors.bases[p * layers + l]` is page 0 of part `p`, layer `l` of this
    /// rank's stage, each page `page_stride` bytes after the previous one (and cut into
    /// `runs` runs `run_stride` apart). The addresses are checked in every build; without
    /// the feature a valid set is [`ERR_UNSUPPORTED`](super::ERR_UNSUPPORTED).
    ///
    /// # Safety
    /// As [`crate::tier::cuda::CudaDevice::wrap`]; a non-zero `stream` is a `CUstream` of
    /// the same context that outlives the registration.
    pub unsafe fn register_cuda_tensors(&self, ordinal: u32, tensors: &KvTensors, stream: u64) -> Result<(), FfiError> {
        let layout = self.client.layout();
        let pp = self.client.identity().pp_rank;
        PageMap::wrap(layout, pp, tensors).map_err(DeviceError::from)?;
        #[cfg(feature = "cuda")]
        {
            // SAFETY: caller contract.
            let dev = unsafe {
                crate::tier::cuda::CudaDevice::wrap(layout, pp, tensors, ordinal as usize)?
                    .with_raw_compute_stream(stream)
            };
            self.register(Arc::new(dev))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (ordinal, stream);
            Err(DeviceError::NoCuda.into())
        }
    }

    /// Wraps the engine's own KV tensors in host memory (vLLM's CPU KV caches, SGLang's
    /// HiCache host pool) and registers them, addressed as [`Handle::register_cuda_tensors`]
    /// says.
    ///
    /// # Safety
    /// Every page the tensors name is this process's memory, readable and writable, until
    /// the client is closed or another region is registered.
    pub unsafe fn register_host_tensors(&self, tensors: &KvTensors) -> Result<(), FfiError> {
        let layout = self.client.layout();
        // SAFETY: caller contract: the pages are live host memory while registered.
        let region = unsafe { HostTensors::wrap(layout, self.client.identity().pp_rank, tensors) }?;
        self.register(Arc::new(region))
    }

    pub fn emulated(&self) -> Result<Arc<EmulatedDevice>, FfiError> {
        self.emulated
            .read()
            .clone()
            .ok_or_else(|| FfiError::new(ERR_INVALID, "no emulated device region is registered"))
    }

    /// Bytes of one object of this rank.
    pub fn object_bytes(&self) -> usize {
        let layout = self.client.layout();
        let id = self.client.identity();
        layout
            .rank_load_objects(id.tp_rank, id.pp_rank)
            .ok()
            .and_then(|o| o.first().map(|&i| layout.object_bytes(i) as usize))
            .unwrap_or(0)
    }

    pub fn write_object(&self, slot: u32, p: u32, data: &[u8]) -> Result<(), FfiError> {
        let dev = self.emulated()?;
        dev.copy_from_host(&[ObjectCopy::new(slot, part(p)?, data)])?;
        Ok(())
    }

    pub fn read_object(&self, slot: u32, p: u32, out: &mut [u8]) -> Result<(), FfiError> {
        let dev = self.emulated()?;
        dev.copy_to_host(&mut [ObjectCopy::new(slot, part(p)?, out)])?;
        Ok(())
    }
}
