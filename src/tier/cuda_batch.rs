//! Issuing the CUDA region's copies: every contiguous move of a copy batch in one
//! `cuMemcpyBatchAsync` (CUDA 12.8+), which saves a driver call per layer run, or one
//! call per move (`cuMemcpy{DtoH,HtoD}Async`, `cuMemcpy2DAsync` for page-first layers).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};

use super::cuda::{CudaDevice, Move, check};
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

    /// One driver call for one move: a contiguous copy, or a 2-D one for a page-first
    /// layer.
    pub(super) fn issue_one(&self, m: &Move, to_host: bool) -> Result<(), DeviceError> {
        let stream = self.copy.cu_stream();
        match (m.rows, to_host) {
            // SAFETY (all arms): addresses checked by `plan`; the host memory outlives the
            // call because `run` waits for the copies before returning.
            (None, true) => check(
                // SAFETY: as above.
                unsafe { sys::cuMemcpyDtoHAsync_v2(m.host.cast(), m.dev, m.width, stream) },
                "cuMemcpyDtoHAsync",
            ),
            (None, false) => check(
                // SAFETY: as above: addresses checked by `plan`, host memory outlives the copy.
                unsafe { sys::cuMemcpyHtoDAsync_v2(m.dev, m.host.cast_const().cast(), m.width, stream) },
                "cuMemcpyHtoDAsync",
            ),
            (Some((rows, pitch)), to_host) => {
                // Every field spelled out: the memory-type enum has no zero value, so a
                // zeroed struct is not a valid one.
                use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE as DEVICE, CU_MEMORYTYPE_HOST as HOST};
                let (src_type, dst_type, src_pitch, dst_pitch) = if to_host {
                    (DEVICE, HOST, m.width, pitch)
                } else {
                    (HOST, DEVICE, pitch, m.width)
                };
                let c = sys::CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: src_type,
                    srcHost: if to_host {
                        std::ptr::null()
                    } else {
                        m.host.cast_const().cast()
                    },
                    srcDevice: if to_host { m.dev } else { 0 },
                    srcArray: std::ptr::null_mut(),
                    srcPitch: src_pitch,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: dst_type,
                    dstHost: if to_host { m.host.cast() } else { std::ptr::null_mut() },
                    dstDevice: if to_host { 0 } else { m.dev },
                    dstArray: std::ptr::null_mut(),
                    dstPitch: dst_pitch,
                    WidthInBytes: m.width,
                    Height: rows,
                };
                // SAFETY: `c` describes ranges `plan` checked; the host memory outlives the
                // copy because `run` waits for it before returning.
                check(unsafe { sys::cuMemcpy2DAsync_v2(&c, stream) }, "cuMemcpy2DAsync")
            }
        }
    }
}
