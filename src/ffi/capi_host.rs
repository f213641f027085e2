//! The C ABI entry that registers the engine's own KV tensors in host memory (see
//! `include/kvtier.h`): vLLM's CPU KV caches, SGLang's HiCache host pool. kvtier then
//! copies pages directly between those tensors and its arena.

use super::capi::run;
use super::capi_device::MAX_TENSORS;
use super::host_tensors::HostTensors;
use super::{ERR_LENGTH_MISMATCH, ERR_NULL, FfiError, Handle};
use crate::tier::tensors::KvTensors;
use std::sync::Arc;

/// # Safety
/// `client` is any value (checked); `ptrs` is null or readable for `n_ptrs` values; every
/// page those addresses name is this process's memory, readable and writable, until the
/// client is closed or another region is registered.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_register_host_tensors(
    client: *mut Handle,
    ptrs: *const u64,
    n_ptrs: usize,
    page_stride: u64,
    pages: u32,
) -> i32 {
    run(|| {
        // SAFETY: any handle value is checked.
        let h = unsafe { super::capi::handle(client) }?;
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
        let bases = unsafe { std::slice::from_raw_parts(ptrs, n_ptrs) }.to_vec();
        let tensors = KvTensors::new(bases, page_stride, pages);
        let layout = h.client().layout();
        // SAFETY: caller contract: the pages are live host memory while registered.
        let region = unsafe { HostTensors::wrap(layout, h.client().identity().pp_rank, &tensors) }?;
        h.register(Arc::new(region))
    })
}
