//! The C ABI entry that registers the engine's own KV tensors in host memory (see
//! `include/kvtier.h`): vLLM's CPU KV caches, SGLang's HiCache host pool. kvtier then
//! copies pages directly between those tensors and its arena.

use super::Handle;
use super::capi::run;
use super::capi_device::tensor_addresses;
use crate::tier::tensors::KvTensors;

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
    // SAFETY: caller contract, forwarded (one run a page).
    unsafe { kvtier_register_host_tensor_runs(client, ptrs, n_ptrs, page_stride, pages, 1, 0) }
}

/// # Safety
/// As [`kvtier_register_host_tensors`], for every run of every page: `runs` runs of each
/// page, `run_stride` bytes apart.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_register_host_tensor_runs(
    client: *mut Handle,
    ptrs: *const u64,
    n_ptrs: usize,
    page_stride: u64,
    pages: u32,
    runs: u32,
    run_stride: u64,
) -> i32 {
    run(|| {
        // SAFETY: any handle value is checked.
        let h = unsafe { super::capi::handle(client) }?;
        // SAFETY: caller contract: `ptrs` null or readable for `n_ptrs` values.
        let bases = unsafe { tensor_addresses(ptrs, n_ptrs) }?;
        let tensors = KvTensors::new(bases, page_stride, pages).with_runs(runs, run_stride);
        // SAFETY: caller contract: the pages are live host memory while registered.
        unsafe { h.register_host_tensors(&tensors) }
    })
}
