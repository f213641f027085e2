//! Batched copies for the CUDA region: every contiguous move of a copy batch in one
//! `cuMemcpyBatchAsync` (CUDA 12.8+), which saves a driver call per layer run.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};

use super::cuda::{CudaDevice, Move};
use super::device::DeviceError;

impl CudaDevice {
    /// One `cuMemcpyBatchAsync` for all moves. Any failure (an old driver without the
    /// symbol included) turns batching off for this region and the caller copies singly.
    pub(super) fn issue_batch(&self, moves: &[Move], to_host: bool) -> Result<(), DeviceError> {
        let mut dsts: Vec<CUdeviceptr> = Vec::with_capacity(moves.len());
        let mut srcs: Vec<CUdeviceptr> = Vec::with_capacity(moves.len());
        let mut sizes: Vec<usize> = moves.iter().map(|m| m.width).collect();
        for m in moves {
            let host = m.host as CUdeviceptr;
            let (d, s) = if to_host { (host, m.dev) } else { (m.dev, host) };
            dsts.push(d);
            srcs.push(s);
        }
        let loc = |host: bool| sys::CUmemLocation {
            type_: if host {
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
            } else {
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
            },
            id: if host { 0 } else { self.ctx.ordinal() as i32 },
        };
        let mut attr = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: loc(!to_host),
            dstLocHint: loc(to_host),
            flags: 0,
        };
        let mut attr_idx = 0usize;
        let mut fail_idx = usize::MAX;
        let stream = self.copy.cu_stream();
        let r = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: arrays of `moves.len()` entries; addresses checked by `plan`.
            unsafe {
                sys::cuMemcpyBatchAsync(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    moves.len(),
                    &mut attr,
                    &mut attr_idx,
                    1,
                    &mut fail_idx,
                    stream,
                )
            }
        }));
        match r {
            Ok(CUresult::CUDA_SUCCESS) => Ok(()),
            other => {
                self.batch.store(false, Ordering::Relaxed);
                tracing::warn!(result = ?other.ok(), "cuMemcpyBatchAsync unavailable; copying singly");
                Err(DeviceError::Copy("batched copy failed".into()))
            }
        }
    }
}
