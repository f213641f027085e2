//! The C ABI's device-region and ticket entry points (see `include/kvtier.h`): register
//! an emulated region, a CUDA region, or the engine's own CUDA KV tensors; fill and check
//! pages with the shared test pattern, copy single objects in and out, and poll or wait
//! on store tickets.

use std::time::Duration;

use super::capi::{handle, out, run};
use super::{ERR_LENGTH_MISMATCH, ERR_NULL, FfiError, Handle};
use crate::protocol::TicketStatus;
use crate::tier::tensors::KvTensors;

/// # Safety
/// `client` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_register_emulated(client: *mut Handle, pages: u32) -> i32 {
    // SAFETY: caller contract.
    run(|| unsafe { handle(client) }?.register_emulated(pages))
}

/// # Safety
/// `client` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_register_cuda(client: *mut Handle, ordinal: u32, pages: u32) -> i32 {
    // SAFETY: caller contract.
    run(|| unsafe { handle(client) }?.register_cuda(ordinal, pages))
}

/// Most tensor addresses one registration may pass (parts x stage layers).
pub const MAX_TENSORS: usize = 1 << 16;

/// # Safety
/// `client` is null or a live handle; `ptrs` is null or readable for `n_ptrs` values;
/// the addresses and `stream` follow `kvtier_register_cuda_tensors` in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_register_cuda_tensors(
    client: *mut Handle,
    ordinal: u32,
    ptrs: *const u64,
    n_ptrs: usize,
    page_stride: u64,
    pages: u32,
    stream: u64,
) -> i32 {
    // SAFETY: caller contract, forwarded (one run a page).
    unsafe { kvtier_register_cuda_tensor_runs(client, ordinal, ptrs, n_ptrs, page_stride, pages, 1, 0, stream) }
}

/// # Safety
/// As [`kvtier_register_cuda_tensors`]; each page of a tensor is `runs` runs
/// `run_stride` bytes apart (`kvtier_register_cuda_tensor_runs` in `include/kvtier.h`).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // the C signature: one value per argument
pub unsafe extern "C" fn kvtier_register_cuda_tensor_runs(
    client: *mut Handle,
    ordinal: u32,
    ptrs: *const u64,
    n_ptrs: usize,
    page_stride: u64,
    pages: u32,
    runs: u32,
    run_stride: u64,
    stream: u64,
) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let h = unsafe { handle(client) }?;
        // SAFETY: caller contract: `ptrs` null or readable for `n_ptrs` values.
        let bases = unsafe { tensor_addresses(ptrs, n_ptrs) }?;
        let tensors = KvTensors::new(bases, page_stride, pages).with_runs(runs, run_stride);
        // SAFETY: caller contract (the addresses are the engine's live KV tensors).
        unsafe { h.register_cuda_tensors(ordinal, &tensors, stream) }
    })
}

/// The tensor address array of a registration, checked: not null, 1 to [`MAX_TENSORS`].
///
/// # Safety
/// `ptrs` is null or readable for `n_ptrs` values.
pub(super) unsafe fn tensor_addresses(ptrs: *const u64, n_ptrs: usize) -> Result<Vec<u64>, FfiError> {
    if ptrs.is_null() {
        return Err(FfiError::new(ERR_NULL, "the tensor address array is a null pointer"));
    }
    if n_ptrs == 0 || n_ptrs > MAX_TENSORS {
        return Err(FfiError::new(
            ERR_LENGTH_MISMATCH,
            format!("{n_ptrs} tensor addresses; a rank passes 1 to {MAX_TENSORS}"),
        ));
    }
    // SAFETY: caller contract: `ptrs` readable for `n_ptrs` values (bounded above).
    Ok(unsafe { std::slice::from_raw_parts(ptrs, n_ptrs) }.to_vec())
}

/// # Safety
/// `client` is null or a live handle; `out_bytes` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_object_bytes(client: *const Handle, out_bytes: *mut usize) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let (h, o) = unsafe { (handle(client)?, out(out_bytes, "the output")?) };
        *o = h.object_bytes();
        Ok(())
    })
}

/// # Safety
/// `client` is null or a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_device_fill_page(client: *mut Handle, slot: u32, seed: u64) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let h = unsafe { handle(client) }?;
        h.emulated()?.fill_page(slot, seed)?;
        Ok(())
    })
}

/// # Safety
/// `client` is null or a live handle; `matches` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_device_page_matches(
    client: *mut Handle,
    slot: u32,
    seed: u64,
    matches: *mut i32,
) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let (h, o) = unsafe { (handle(client)?, out(matches, "the output")?) };
        *o = h.emulated()?.page_matches(slot, seed)? as i32;
        Ok(())
    })
}

fn buffer_null() -> FfiError {
    FfiError::new(ERR_NULL, "the object buffer is a null pointer")
}

/// # Safety
/// `client` is null or a live handle; `data` is null or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_device_write_object(
    client: *mut Handle,
    slot: u32,
    part: u32,
    data: *const u8,
    len: usize,
) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let h = unsafe { handle(client) }?;
        if data.is_null() {
            return Err(buffer_null());
        }
        // The region checks `len` against the object size before reading a byte; bound
        // it first so a wild length never forms a slice.
        let len = len.min(h.object_bytes() + 1);
        // SAFETY: caller contract: `data` valid for the `len` it passed (we read no more).
        let data = unsafe { std::slice::from_raw_parts(data, len) };
        h.write_object(slot, part, data)
    })
}

/// # Safety
/// `client` is null or a live handle; `buf` is null or writable for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_device_read_object(
    client: *mut Handle,
    slot: u32,
    part: u32,
    buf: *mut u8,
    len: usize,
) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let h = unsafe { handle(client) }?;
        if buf.is_null() {
            return Err(buffer_null());
        }
        let len = len.min(h.object_bytes() + 1);
        // SAFETY: caller contract: `buf` writable for the `len` it passed.
        let buf = unsafe { std::slice::from_raw_parts_mut(buf, len) };
        h.read_object(slot, part, buf)
    })
}

/// The ticket status struct of `include/kvtier.h`.
#[repr(C)]
pub struct TicketStatusC {
    pub complete: u32,
    pub total: u32,
    pub failed: u32,
}

impl From<TicketStatus> for TicketStatusC {
    fn from(t: TicketStatus) -> Self {
        Self {
            complete: t.complete,
            total: t.total,
            failed: t.failed,
        }
    }
}

/// # Safety
/// `client` is null or a live handle; `status` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_poll(client: *mut Handle, ticket: u64, status: *mut TicketStatusC) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let (h, o) = unsafe { (handle(client)?, out(status, "the output")?) };
        *o = h.client().poll(ticket)?.into();
        Ok(())
    })
}

/// # Safety
/// `client` is null or a live handle; `status` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_wait(
    client: *mut Handle,
    ticket: u64,
    timeout_ms: u32,
    status: *mut TicketStatusC,
) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let (h, o) = unsafe { (handle(client)?, out(status, "the output")?) };
        *o = h
            .client()
            .wait(ticket, Duration::from_millis(timeout_ms as u64))?
            .into();
        Ok(())
    })
}
