//! Copies into cold memory with streaming (non-temporal) stores.
//!
//! `memcpy` of a large block uses `rep movsb`, which writes whole cache lines without
//! reading them first. A copy made of many shorter pieces (a transpose row by row, an
//! object gathered run by run) goes through ordinary stores instead, and each of those
//! first reads the destination line it is about to overwrite (a read for ownership): a
//! third more memory traffic when the destination is cold. kvtier's own tiers (the host
//! arena, the local pool) are such destinations: what is offloaded or staged there is read
//! next by another copy, long after the cache has moved on. Copies into the engine's
//! memory keep ordinary stores, since the engine reads those bytes next.

/// Whether `len` bytes at `dst` can be streamed: 16-byte aligned stores of whole 64-byte
/// lines. Always false off x86-64 (where the copies stay plain).
pub(crate) fn usable(dst: *const u8, len: usize) -> bool {
    cfg!(target_arch = "x86_64") && (dst as usize).is_multiple_of(16) && len.is_multiple_of(64)
}

/// `dst.copy_from_slice(src)`, with streaming stores when [`usable`]. Call [`fence`] before
/// the bytes are handed to another thread or process.
pub(crate) fn copy(dst: &mut [u8], src: &[u8]) {
    if dst.len() != src.len() || !usable(dst.as_ptr(), dst.len()) {
        dst.copy_from_slice(src);
        return;
    }
    // SAFETY: both slices are valid for their (equal) length and do not overlap (one is
    // an exclusive borrow); `usable` checked the alignment and length.
    unsafe { copy_raw(dst.as_mut_ptr(), src.as_ptr(), dst.len()) }
}

/// `n` bytes from `src` to `dst` with streaming stores; plain where the CPU has none.
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes, they do not overlap, and
/// `usable(dst, n)` holds.
pub(crate) unsafe fn copy_raw(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let mut at = 0;
        while at < n {
            // SAFETY: `at + 64 <= n` (n is a multiple of 64), so the four 16-byte lanes are
            // in bounds of both buffers; loads are unaligned loads, and the stores are
            // 16-byte aligned because `dst` is and `at` is a multiple of 64. SSE2 is part
            // of the x86-64 baseline.
            unsafe {
                let (s, d) = (src.add(at).cast::<__m128i>(), dst.add(at).cast::<__m128i>());
                let (x0, x1) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
                let (x2, x3) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
                _mm_stream_si128(d, x0);
                _mm_stream_si128(d.add(1), x1);
                _mm_stream_si128(d.add(2), x2);
                _mm_stream_si128(d.add(3), x3);
            }
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    }
}

/// Orders earlier streaming stores before every later store: streaming stores are weakly
/// ordered, and an object must be whole before it is published (a pool index entry, a
/// directory bit) to another thread or process.
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no operands and only orders stores; SSE is baseline on x86-64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Aligned whole lines stream, anything else copies plainly; both give the same bytes.
    #[test]
    fn streamed_and_plain_copies_give_the_same_bytes() {
        let src: Vec<u8> = (0..4096 + 64).map(|i| (i * 37 + i / 64) as u8).collect();
        let mut store = vec![0u128; 4096 / 16 + 8];
        // SAFETY: a byte view of the whole u128 buffer.
        let bytes = unsafe { std::slice::from_raw_parts_mut(store.as_mut_ptr().cast::<u8>(), store.len() * 16) };
        let at = bytes.as_ptr().align_offset(64);
        for (off, len) in [(at, 4096), (at + 1, 4096), (at, 4096 - 8), (at + 16, 64)] {
            assert_eq!(
                usable(bytes[off..].as_ptr(), len),
                cfg!(target_arch = "x86_64") && off != at + 1 && len % 64 == 0
            );
            bytes.fill(0);
            copy(&mut bytes[off..off + len], &src[3..3 + len]);
            fence();
            assert!(
                bytes[off..off + len] == src[3..3 + len],
                "offset {} len {len}",
                off - at
            );
            assert!(bytes[..off].iter().chain(&bytes[off + len..]).all(|&b| b == 0));
        }
    }
}
