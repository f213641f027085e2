//! One rank's device KV region, and the emulated device that stands in for a GPU.
//!
//! An engine keeps KV the way attention kernels want it: per layer, a tensor of
//! `[pages][page_tokens][heads][head_dim]`. An object is one part (K, V or the MLA latent)
//! of one page across the layers of the rank's PP stage, in the layout's byte order. The
//! [`DeviceRegion`] trait gathers objects out of that region (D2H) and scatters them back
//! (H2D). [`EmulatedDevice`] does it on a host buffer, so every path runs without a GPU;
//! the CUDA implementation (feature `cuda`) implements the same trait. Both address pages
//! through a [`PageMap`](super::tensors::PageMap), so an owned region and wrapped engine
//! tensors share one addressing rule.

use std::alloc::Layout as AllocLayout;

use super::tensors::{KvTensors, PageMap, TensorError};
use crate::layout::{Layout, Part};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DeviceError {
    #[error("device page {slot} is outside the region's {pages} pages")]
    BadSlot { slot: u32, pages: u32 },
    #[error("part {0:?} is not held by this rank's region")]
    BadPart(Part),
    #[error("object buffer has {got} bytes, the object has {want}")]
    WrongSize { got: usize, want: usize },
    #[error("layer {layer} is outside the stage's {layers} layers")]
    BadLayer { layer: u32, layers: u32 },
    #[error("device copy failed: {0}")]
    Copy(String),
    #[error("cannot wrap these KV tensors: {0}")]
    Tensors(#[from] TensorError),
    #[error("this kvtier was built without the `cuda` feature")]
    NoCuda,
}

/// One object copy between a device page and a host buffer.
pub struct ObjectCopy<B> {
    pub slot: u32,
    pub part: Part,
    pub host: B,
}

impl<B> ObjectCopy<B> {
    pub fn new(slot: u32, part: Part, host: B) -> Self {
        Self { slot, part, host }
    }
}

/// One rank's KV region on a device.
pub trait DeviceRegion: Send + Sync {
    /// `"emulated"` or `"cuda"`.
    fn kind(&self) -> &'static str;
    /// Number of pages the region holds.
    fn pages(&self) -> u32;
    /// Bytes of one object of this rank.
    fn object_bytes(&self) -> usize;
    /// Device → host: gathers each object into its host buffer. All copies of the batch
    /// have finished when this returns `Ok`.
    fn copy_to_host(&self, batch: &mut [ObjectCopy<&mut [u8]>]) -> Result<(), DeviceError>;
    /// Host → device: scatters each host buffer into its device page.
    fn copy_from_host(&self, batch: &[ObjectCopy<&[u8]>]) -> Result<(), DeviceError>;
    /// The host memory copies will use (this process's mapping of the daemon's arena), so
    /// a GPU region can register it as pinned memory once. `base..base + len` must stay
    /// mapped while the region is in use. Default: nothing to do.
    fn register_host(&self, base: *mut u8, len: usize) -> Result<(), DeviceError> {
        let _ = (base, len);
        Ok(())
    }
}

/// Device → host for a region whose memory this process can address (the emulated device,
/// wrapped engine host tensors): checks the whole batch, then copies each object run by
/// run, with streaming stores where the runs allow ([`super::stream`]): the host side is
/// kvtier's arena, where offloaded bytes wait cold. `dev` turns a run's device address from the [`PageMap`] (an offset into the
/// emulated buffer, or an address of a wrapped tensor) into a pointer.
///
/// # Safety
/// For every run of a copy that `map` checked, `dev` returns a pointer valid for the run's
/// bytes, and no other copy touches the same device page meanwhile.
pub(crate) unsafe fn gather_to_host(
    map: &PageMap,
    batch: &mut [ObjectCopy<&mut [u8]>],
    dev: impl Fn(u64) -> *mut u8,
) -> Result<(), DeviceError> {
    for c in batch.iter() {
        map.check(c.slot, c.part, c.host.len())?;
    }
    for c in batch.iter_mut() {
        // SAFETY: checked above; `host` is an exclusive borrow of the object's size; the
        // device side is the caller's contract.
        unsafe { copy_runs(map, c.slot, c.part, c.host.as_mut_ptr(), true, &dev)? };
    }
    // Runs into host were streamed: whole before the store settles and publishes them.
    super::stream::fence();
    Ok(())
}

/// Host → device, the other direction of [`gather_to_host`].
///
/// # Safety
/// As for [`gather_to_host`].
pub(crate) unsafe fn scatter_from_host(
    map: &PageMap,
    batch: &[ObjectCopy<&[u8]>],
    dev: impl Fn(u64) -> *mut u8,
) -> Result<(), DeviceError> {
    for c in batch {
        map.check(c.slot, c.part, c.host.len())?;
    }
    for c in batch {
        // SAFETY: checked; in this direction the host slice is only read (the cast is for
        // the shared walk, which reads from it in this direction).
        unsafe { copy_runs(map, c.slot, c.part, c.host.as_ptr() as *mut u8, false, &dev)? };
    }
    Ok(())
}

/// The one strided walk of an object: each run of the plan, a row at a time where the
/// byte order interleaves layers per token, copied between `host` and `dev(run address)`.
///
/// # Safety
/// `host` is valid for `map.object_bytes()` bytes in the direction copied, the copy was
/// checked by `PageMap::check`, and `dev` is as [`gather_to_host`] requires.
unsafe fn copy_runs(
    map: &PageMap,
    slot: u32,
    part: Part,
    host: *mut u8,
    to_host: bool,
    dev: &impl Fn(u64) -> *mut u8,
) -> Result<(), DeviceError> {
    let mv = |d: u64, host_off: usize, n: usize| {
        let d = dev(d);
        // SAFETY: runs lie inside the region (checked when the map was built, and the
        // caller's `dev` contract) and inside the host buffer (checked size).
        unsafe {
            let h = host.add(host_off);
            if to_host && super::stream::usable(h, n) {
                // Into kvtier's host tier: cold bytes, read next by another copy.
                super::stream::copy_raw(h, d, n);
            } else if to_host {
                std::ptr::copy_nonoverlapping(d, h, n);
            } else {
                std::ptr::copy_nonoverlapping(host.add(host_off), d, n);
            }
        }
    };
    map.plan(slot, part, map.object_bytes(), |r| match r.rows {
        None => mv(r.dev, r.host_off, r.width),
        Some((rows, pitch)) => {
            for t in 0..rows {
                mv(r.dev + (t * r.width) as u64, r.host_off + t * pitch, r.width);
            }
        }
    })
}

/// Zeroed host memory aligned like a GPU allocation (to a 4 KiB page), so copies between
/// it and the page-aligned arena run at memcpy speed. A plain `Vec` sits 16 bytes past a
/// page boundary, and copying into such an address from a page-aligned source hits the
/// 4 KiB-aliasing slow path of `rep movsb`: about a third of memcpy speed.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: AllocLayout,
    len: usize,
}

impl AlignedBuf {
    const ALIGN: usize = 4096;

    fn zeroed(len: usize) -> Self {
        let layout = AllocLayout::from_size_align(len.max(1), Self::ALIGN).expect("a region size below isize::MAX");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, layout, len }
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

// SAFETY: a plain owned allocation; `EmulatedDevice` governs access to its bytes.
unsafe impl Send for AlignedBuf {}

/// A host buffer standing in for one rank's GPU KV region. By default it is laid out as
/// an owned region (`[part][layer][page][token][heads*head_dim*dtype]`); built with
/// [`EmulatedDevice::with_tensors`] it is addressed like wrapped engine tensors, with
/// each (part, layer) at an offset into the buffer and its own page stride.
pub struct EmulatedDevice {
    buf: AlignedBuf,
    map: PageMap,
}

// SAFETY: the buffer is only reached through raw copies of whole, disjoint page ranges;
// the manager never runs two copies on the same device page at once (in-flight pages are
// fenced by the directory), which is the same discipline a GPU region needs.
unsafe impl Sync for EmulatedDevice {}

impl std::fmt::Debug for EmulatedDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedDevice")
            .field("pages", &self.map.pages())
            .field("layers", &self.map.layers())
            .field("object_bytes", &self.object_bytes())
            .finish()
    }
}

impl EmulatedDevice {
    /// A region of `pages` pages for the rank `(tp_rank, pp_rank)` of `layout`.
    pub fn new(layout: &Layout, pp_rank: u16, pages: u32) -> Self {
        let len = PageMap::contiguous_bytes(layout, pp_rank, pages);
        Self {
            buf: AlignedBuf::zeroed(len),
            map: PageMap::contiguous(layout, pp_rank, pages, 0),
        }
    }

    /// A buffer of `len` bytes addressed like engine-owned tensors: `tensors.bases` are
    /// byte offsets into the buffer (checked as [`PageMap::wrap`] checks addresses; an
    /// offset of 0 counts as null, so start the first tensor past it).
    pub fn with_tensors(layout: &Layout, pp_rank: u16, tensors: &KvTensors, len: usize) -> Result<Self, DeviceError> {
        let map = PageMap::wrap(layout, pp_rank, tensors)?;
        if let Some(index) = map.beyond(len as u64) {
            return Err(TensorError::OutOfBuffer { index, len: len as u64 }.into());
        }
        Ok(Self {
            buf: AlignedBuf::zeroed(len),
            map,
        })
    }

    fn base(&self) -> *mut u8 {
        self.buf.ptr.as_ptr()
    }

    /// Where the buffer lies and its length, for a bench that evicts it from the CPU caches
    /// between copies (nothing may read or write through the pointer).
    #[cfg(feature = "daemon")]
    pub(crate) fn span(&self) -> (*const u8, usize) {
        (self.base(), self.buf.len())
    }

    /// Raw bytes of the buffer (what a kernel sees at those offsets), or `None` out of range.
    pub fn read_raw(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        if offset.checked_add(len)? > self.buf.len() {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: in bounds; no copy runs on pages a test inspects.
        unsafe { std::ptr::copy_nonoverlapping(self.base().add(offset), out.as_mut_ptr(), len) };
        Some(out)
    }

    /// What the engine's attention kernel would write: the bytes of one layer of one page.
    pub fn write_layer(&self, slot: u32, part: Part, layer: u32, data: &[u8]) -> Result<(), DeviceError> {
        let p = self.map.part_index(part)?;
        self.map.check_layer(slot, layer, data.len())?;
        let piece = self.map.piece();
        for (at, off) in self.map.layer_runs(p, layer, slot) {
            // SAFETY: bounds checked; the engine owns this device page while writing it.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr().add(off), self.base().add(at as usize), piece);
            }
        }
        Ok(())
    }

    /// What the engine's attention kernel would read: one layer of one page.
    pub fn read_layer(&self, slot: u32, part: Part, layer: u32) -> Result<Vec<u8>, DeviceError> {
        let p = self.map.part_index(part)?;
        self.map.check_layer(slot, layer, self.map.run())?;
        let mut out = vec![0u8; self.map.run()];
        let piece = self.map.piece();
        for (at, off) in self.map.layer_runs(p, layer, slot) {
            // SAFETY: bounds checked.
            unsafe {
                std::ptr::copy_nonoverlapping(self.base().add(at as usize), out.as_mut_ptr().add(off), piece);
            }
        }
        Ok(out)
    }

    /// Fills every layer and part of a page with bytes derived from `seed` (tests, benches
    /// and the C++ test engine use the same rule to check what comes back).
    pub fn fill_page(&self, slot: u32, seed: u64) -> Result<(), DeviceError> {
        for (pi, &part) in self.map.parts().iter().enumerate() {
            for layer in 0..self.map.layers() {
                let data = pattern(layer_seed(seed, pi, layer), self.map.run());
                self.write_layer(slot, part, layer, &data)?;
            }
        }
        Ok(())
    }

    /// Whether a page holds exactly what `fill_page(_, seed)` wrote.
    pub fn page_matches(&self, slot: u32, seed: u64) -> Result<bool, DeviceError> {
        for (pi, &part) in self.map.parts().iter().enumerate() {
            for layer in 0..self.map.layers() {
                let want = pattern(layer_seed(seed, pi, layer), self.map.run());
                if self.read_layer(slot, part, layer)? != want {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }
}

/// The seed of one (part index, layer) run of a page filled by `fill_page(_, seed)`.
pub fn layer_seed(seed: u64, part: usize, layer: u32) -> u64 {
    seed ^ ((part as u64) << 56) ^ ((layer as u64) << 40)
}

/// Deterministic bytes from a seed (splitmix64), so any side can check content.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed;
    while out.len() < len {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

impl DeviceRegion for EmulatedDevice {
    fn kind(&self) -> &'static str {
        "emulated"
    }

    fn pages(&self) -> u32 {
        self.map.pages()
    }

    fn object_bytes(&self) -> usize {
        self.map.object_bytes()
    }

    fn copy_to_host(&self, batch: &mut [ObjectCopy<&mut [u8]>]) -> Result<(), DeviceError> {
        let base = self.base();
        // SAFETY: the map's runs are offsets inside the buffer (checked when it was built),
        // and the manager never runs two copies on one device page at once.
        unsafe { gather_to_host(&self.map, batch, |off| base.wrapping_add(off as usize)) }
    }

    fn copy_from_host(&self, batch: &[ObjectCopy<&[u8]>]) -> Result<(), DeviceError> {
        let base = self.base();
        // SAFETY: as for `copy_to_host`.
        unsafe { scatter_from_host(&self.map, batch, |off| base.wrapping_add(off as usize)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{ByteOrder, LayoutSpec};

    #[test]
    fn objects_round_trip_in_both_byte_orders() {
        for order in [ByteOrder::LayerFirst, ByteOrder::PageFirst] {
            let layout = LayoutSpec::mha(4, 4, 16, 2, 8)
                .with_parallel(2, 2)
                .with_byte_order(order)
                .build()
                .unwrap();
            let dev = EmulatedDevice::new(&layout, 1, 4);
            assert_eq!(dev.object_bytes() as u64, layout.object_bytes(0));
            dev.fill_page(2, 77).unwrap();
            let mut k = vec![0u8; dev.object_bytes()];
            let mut v = vec![0u8; dev.object_bytes()];
            dev.copy_to_host(&mut [
                ObjectCopy::new(2, Part::K, &mut k[..]),
                ObjectCopy::new(2, Part::V, &mut v[..]),
            ])
            .unwrap();
            assert_ne!(k, v);
            dev.copy_from_host(&[ObjectCopy::new(3, Part::K, &k[..]), ObjectCopy::new(3, Part::V, &v[..])])
                .unwrap();
            assert!(dev.page_matches(3, 77).unwrap());
            assert!(!dev.page_matches(3, 78).unwrap());
            // Byte order decides where a token of a layer sits in the object.
            let l1 = dev.read_layer(2, Part::K, 1).unwrap();
            let tb = layout.token_layer_bytes();
            let at = match order {
                ByteOrder::LayerFirst => 8 * tb,
                ByteOrder::PageFirst => tb,
            };
            assert_eq!(&k[at..at + tb], &l1[..tb]);
        }
    }

    #[test]
    fn bad_copies_are_typed_errors() {
        let layout = LayoutSpec::mla(2, 64, 2, 4).build().unwrap();
        let dev = EmulatedDevice::new(&layout, 0, 2);
        let mut buf = vec![0u8; dev.object_bytes()];
        assert_eq!(
            dev.copy_to_host(&mut [ObjectCopy::new(2, Part::Latent, &mut buf[..])]),
            Err(DeviceError::BadSlot { slot: 2, pages: 2 })
        );
        assert_eq!(
            dev.copy_to_host(&mut [ObjectCopy::new(0, Part::K, &mut buf[..])]),
            Err(DeviceError::BadPart(Part::K))
        );
        assert!(matches!(
            dev.copy_from_host(&[ObjectCopy::new(0, Part::Latent, &buf[1..])]),
            Err(DeviceError::WrongSize { .. })
        ));
    }

    #[test]
    fn wrapped_tensors_put_pages_where_the_engine_expects_them() {
        // [blocks, 2, block_size, heads, head_dim] per layer: K and V of a block are
        // neighbours, so each part's pages are two runs apart.
        for order in [ByteOrder::LayerFirst, ByteOrder::PageFirst] {
            let layout = LayoutSpec::mha(2, 2, 8, 2, 4).with_byte_order(order).build().unwrap();
            let (blocks, run) = (6u64, 128u64);
            let layer_bytes = blocks * 2 * run;
            let l = |i: u64| 64 + i * layer_bytes;
            let t = KvTensors::new(vec![l(0), l(1), l(0) + run, l(1) + run], 2 * run, blocks as u32);
            let len = (64 + 2 * layer_bytes) as usize;
            assert!(matches!(
                EmulatedDevice::with_tensors(&layout, 0, &t, len - 1),
                Err(DeviceError::Tensors(TensorError::OutOfBuffer { index: 3, .. }))
            ));
            let dev = EmulatedDevice::with_tensors(&layout, 0, &t, len).unwrap();
            dev.fill_page(4, 9).unwrap();
            // V of layer 1, block 4 sits right after K of layer 1, block 4.
            let at = (l(1) + 4 * 2 * run + run) as usize;
            let want = pattern(layer_seed(9, 1, 1), run as usize);
            assert_eq!(dev.read_raw(at, run as usize).unwrap(), want);
            let mut v = vec![0u8; dev.object_bytes()];
            dev.copy_to_host(&mut [ObjectCopy::new(4, Part::V, &mut v[..])])
                .unwrap();
            dev.copy_from_host(&[ObjectCopy::new(0, Part::V, &v[..])]).unwrap();
            assert_eq!(dev.read_layer(0, Part::V, 1).unwrap(), want);
            // Block 0's K was never written.
            assert_eq!(dev.read_raw(l(1) as usize, 8).unwrap(), vec![0u8; 8]);
        }
    }
}
