//! Evicting a bench's buffers from the CPU caches, so that a path and its reference copy
//! bytes that start out equally cold.
//!
//! A copy's speed depends on where its bytes are: a machine whose last-level cache holds
//! hundreds of MiB keeps part of a bench's working set, and it keeps most of what is
//! touched most often. A path's own memory (the device region, the arena, the pool) is
//! touched once or twice a round; the references' buffers serve every path's references
//! and are touched several times a round. Left alone, the references copy from cache
//! while the paths copy from memory, and the ratio measures that difference, not the
//! path (issue 29: on a VM with a 480 MiB L3 the references read 15-24 GB/s where the
//! same copies of evicted bytes read 8-12). Offloaded KV is cold in use: an arena is many
//! times any cache. So the transfer bench evicts both sides before each path's pass.

/// Whether [`evict`] evicts on this CPU (x86-64; elsewhere it does nothing).
pub(crate) fn can_evict() -> bool {
    cfg!(target_arch = "x86_64")
}

/// Writes back and evicts every cache line of the `len` bytes at `at` from every cache
/// level, and waits until that is done. Costs a pass over the lines at memory speed;
/// nothing when [`can_evict`] is false.
///
/// # Safety
/// The bytes are mapped memory of this process. No byte is read or written (another
/// thread may be using them, though the bench evicts only between copies).
pub(crate) unsafe fn evict(at: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        const LINE: usize = 64;
        let start = at as usize & !(LINE - 1);
        let end = at as usize + len;
        // CPUID leaf 7, EBX bit 23: CLFLUSHOPT, which unlike CLFLUSH is not ordered
        // against the other flushes, so they overlap. Leaf 7 exists where leaf 0 says so.
        let optimized = {
            use std::arch::x86_64::{__cpuid, __cpuid_count};
            __cpuid(0).eax >= 7 && __cpuid_count(7, 0).ebx & (1 << 23) != 0
        };
        for line in (start..end).step_by(LINE) {
            // SAFETY: each line holds at least one of the bytes, mapped memory of this
            // process (the caller's contract); a flush changes no byte. `clflushopt` is used only
            // where the CPU reports it; `clflush` and `mfence` are SSE2, baseline on x86-64.
            unsafe {
                if optimized {
                    flush_opt(line as *const u8);
                } else {
                    std::arch::x86_64::_mm_clflush(line as *const u8);
                }
            }
        }
        // SAFETY: `mfence` has no operands; it orders the flushes before later accesses.
        unsafe { std::arch::x86_64::_mm_mfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, len);
}

/// # Safety
/// The CPU has `clflushopt`, and `p` points into this process's mapped memory.
#[cfg(target_arch = "x86_64")]
unsafe fn flush_opt(p: *const u8) {
    // SAFETY: the caller's contract; the instruction writes back and evicts one line and
    // changes no register, flag or byte.
    unsafe { std::arch::asm!("clflushopt byte ptr [{0}]", in(reg) p, options(nostack, preserves_flags)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Eviction changes no byte, whatever the alignment and length of the span.
    #[test]
    fn evicted_bytes_read_back_the_same() {
        let v: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 253) as u8).collect();
        for (from, to) in [(0, 10_000), (1, 65), (63, 64), (5, 5), (100, 9_999)] {
            // SAFETY: a span of `v`.
            unsafe { evict(v[from..].as_ptr(), to - from) };
        }
        assert!(
            v.iter()
                .enumerate()
                .all(|(i, &b)| b == (i as u32 * 7 + i as u32 / 253) as u8)
        );
    }
}
