//! The engine's own KV tensors in host memory as a rank's region: what vLLM keeps on a
//! CPU-only machine and what SGLang's HiCache host pool is. kvtier copies pages straight
//! between them and its arena, so registering them costs no staging buffer and no copy
//! beyond the one into or out of the arena.
//!
//! Addressing is the same [`PageMap`] wrapped CUDA tensors use; only the copy is a
//! `memcpy` instead of a device transfer.

use crate::layout::Layout;
use crate::tier::device::{DeviceError, DeviceRegion, ObjectCopy, gather_to_host, scatter_from_host};
use crate::tier::tensors::{KvTensors, PageMap};

/// Engine-owned host tensors, wrapped. The engine keeps them allocated while they are
/// registered (the C ABI contract of `kvtier_register_host_tensors`).
pub struct HostTensors {
    map: PageMap,
}

// SAFETY: the region only ever copies whole, disjoint pages named by the manager, which
// never runs two copies on one page at once (in-flight pages are fenced), the same rule
// the emulated and CUDA regions rely on; the addresses stay valid by the caller's contract.
unsafe impl Send for HostTensors {}
// SAFETY: as for `Send`.
unsafe impl Sync for HostTensors {}

impl HostTensors {
    /// Wraps `tensors` (addresses checked by [`PageMap::wrap`]).
    ///
    /// # Safety
    /// Every page of every tensor, `bases[i] + s * page_stride .. + one page` for
    /// `s < pages`, is readable and writable memory of this process, and stays so while
    /// the region is registered.
    pub unsafe fn wrap(layout: &Layout, pp_rank: u16, tensors: &KvTensors) -> Result<Self, DeviceError> {
        Ok(Self {
            map: PageMap::wrap(layout, pp_rank, tensors)?,
        })
    }
}

impl DeviceRegion for HostTensors {
    fn kind(&self) -> &'static str {
        "host-tensors"
    }

    fn pages(&self) -> u32 {
        self.map.pages()
    }

    fn object_bytes(&self) -> usize {
        self.map.object_bytes()
    }

    fn copy_to_host(&self, batch: &mut [ObjectCopy<&mut [u8]>]) -> Result<(), DeviceError> {
        // SAFETY: a run's device address lies inside a wrapped tensor (`wrap`'s contract,
        // slot checked), and the manager never runs two copies on one page at once.
        unsafe { gather_to_host(&self.map, batch, |addr| addr as usize as *mut u8) }
    }

    fn copy_from_host(&self, batch: &[ObjectCopy<&[u8]>]) -> Result<(), DeviceError> {
        // SAFETY: as for `copy_to_host`.
        unsafe { scatter_from_host(&self.map, batch, |addr| addr as usize as *mut u8) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutSpec, Part};

    #[test]
    fn objects_round_trip_through_strided_tensors() {
        // 2 layers; one page of one (part, layer) = 4 tokens x 2 heads x 8 dims x 2 bytes.
        let layout = LayoutSpec::mha(2, 2, 8, 2, 4).build().unwrap();
        let run = 128usize;
        // vLLM's [blocks, 2, ...] shape: K and V interleaved, stride two blocks, 3 pages.
        let mut mem: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 3 * 2 * run]).collect();
        let bases = vec![
            mem[0].as_mut_ptr() as u64,
            mem[1].as_mut_ptr() as u64,
            mem[0].as_mut_ptr() as u64 + run as u64,
            mem[1].as_mut_ptr() as u64 + run as u64,
        ];
        let t = KvTensors::new(bases, 2 * run as u64, 3);
        // SAFETY: `mem` outlives the region and holds every page.
        let region = unsafe { HostTensors::wrap(&layout, 0, &t) }.unwrap();
        let obj: Vec<u8> = (0..2 * run).map(|i| (i * 7 % 251) as u8).collect();
        region.copy_from_host(&[ObjectCopy::new(2, Part::V, &obj[..])]).unwrap();
        // Layer 0's V of page 2 sits at 2 * stride + run in layer 0's tensor.
        assert_eq!(&mem[0][4 * run + run..6 * run], &obj[..run]);
        assert_eq!(&mem[1][4 * run + run..6 * run], &obj[run..]);
        assert!(mem[0][..4 * run + run].iter().all(|&b| b == 0));
        let mut back = vec![0u8; 2 * run];
        region
            .copy_to_host(&mut [ObjectCopy::new(2, Part::V, &mut back[..])])
            .unwrap();
        assert_eq!(back, obj);
        let err = region
            .copy_to_host(&mut [ObjectCopy::new(3, Part::K, &mut back[..])])
            .unwrap_err();
        assert_eq!(err, DeviceError::BadSlot { slot: 3, pages: 3 });
    }
}
