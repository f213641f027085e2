//! Byte reordering on the way into and out of a pool: a row transpose, done as one strided
//! gather/scatter between the caller's buffer and the pool's object.
//!
//! The manager stores layer-first objects page-first in the pool (SGLang's bytes, see
//! `manager::pool_layout`). Transposing into a staging buffer and then copying that into
//! the pool costs a second full copy and an allocation per object, which halved the
//! host↔pool paths. So the order travels with each item of a batch
//! ([`PoolBackend::batch_put_ordered`](super::PoolBackend::batch_put_ordered)), and a
//! backend whose object memory this process can write (the local pool) moves the rows
//! straight between the two buffers; the others fall back to staging.

use crate::tier::stream;

/// Caller bytes `[outer][inner][row]` are pool bytes `[inner][outer][row]`: a put gathers
/// with [`Transpose::to_pool`], a get scatters back with [`Transpose::from_pool`]. Whole
/// rows move, so it is one `copy_from_slice` per (outer, inner) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transpose {
    /// Rows of the caller's outer index (the layers of a layer-first object).
    pub outer: usize,
    /// Rows of the caller's inner index (the tokens).
    pub inner: usize,
    /// Bytes of one row (a token of one layer: heads × head dim × dtype).
    pub row: usize,
}

impl Transpose {
    /// Bytes of the whole object.
    pub fn len(&self) -> usize {
        self.outer * self.inner * self.row
    }

    /// Whether the object has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Caller `[outer][inner][row]` into pool `[inner][outer][row]`. Both slices hold the
    /// whole object; a length mismatch copies nothing and returns false.
    pub fn to_pool(&self, caller: &[u8], pool: &mut [u8]) -> bool {
        swap_rows(self.outer, self.inner, self.row, caller, pool)
    }

    /// Pool `[inner][outer][row]` back into caller `[outer][inner][row]`.
    pub fn from_pool(&self, pool: &[u8], caller: &mut [u8]) -> bool {
        swap_rows(self.inner, self.outer, self.row, pool, caller)
    }
}

/// `src` as `[a][b][row]` into `dst` as `[b][a][row]`, walking whichever side keeps the
/// fewer streams of rows: the destination in order (reading `a` interleaved runs of the
/// source) when `a <= b`, else the source in order (writing `b` interleaved runs of the
/// destination).
///
/// The order matters on cold memory. Walking the destination in order, a pool-to-host
/// transpose of a 16 KiB object (16 tokens of 4 layers, 256-byte rows) reads 16 runs of
/// the source at a 1 KiB stride, four passes over each page, and ran at 3.1 GB/s on one
/// thread between two `/dev/shm` mappings where `memcpy` of whole objects ran at 5.1 and
/// the same transpose walking the source in order (4 runs of the destination) at 7.1-7.5;
/// at 64 KiB 4.7 against 6.3. Into the pool, an object of 32 layers read as 32 runs
/// of the source ran at 2.2-3.3 GB/s, and at 4.1-4.6 written as 16 runs of the
/// destination (docs/ARCHITECTURE.md, issue 29's fifth round, has the table).
///
/// Rows are written with streaming stores where the CPU has them ([`stream`]): row by row,
/// ordinary stores read every cold destination line before writing it, which left the
/// transposing paths at about 0.75 of a `memcpy` of whole objects.
fn swap_rows(a: usize, b: usize, row: usize, src: &[u8], dst: &mut [u8]) -> bool {
    let len = a * b * row;
    if src.len() != len || dst.len() != len {
        return false;
    }
    if row == 0 {
        return true;
    }
    let streaming = stream::usable(dst.as_ptr(), row);
    // Source row (i, j) is destination row (j, i), for i < a and j < b.
    let mut move_row = |i: usize, j: usize| {
        let (s, d) = ((i * b + j) * row, (j * a + i) * row);
        let (from, to) = (&src[s..s + row], &mut dst[d..d + row]);
        if streaming {
            stream::copy(to, from);
        } else {
            to.copy_from_slice(from);
        }
    };
    if a <= b {
        for j in 0..b {
            for i in 0..a {
                move_row(i, j);
            }
        }
    } else {
        for i in 0..a {
            for j in 0..b {
                move_row(i, j);
            }
        }
    }
    if streaming {
        // The object must be whole before the caller publishes it (the pool index, the
        // directory) to another thread or process.
        stream::fence();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_moves_to_its_transposed_place_and_back() {
        let t = Transpose {
            outer: 3,
            inner: 5,
            row: 7,
        };
        let src: Vec<u8> = (0..t.len()).map(|i| (i * 13 + i / 7) as u8).collect();
        let mut pool = vec![0u8; t.len()];
        assert!(t.to_pool(&src, &mut pool));
        for o in 0..3 {
            for i in 0..5 {
                let s = (o * 5 + i) * 7;
                let p = (i * 3 + o) * 7;
                assert_eq!(pool[p..p + 7], src[s..s + 7], "outer {o} inner {i}");
            }
        }
        let mut back = vec![0u8; t.len()];
        assert!(t.from_pool(&pool, &mut back));
        assert_eq!(back, src);
        assert!(!t.to_pool(&src[1..], &mut pool));
        assert!(!t.from_pool(&pool, &mut back[1..]));
    }

    /// Rows of whole cache lines into aligned buffers take the streaming path; every row
    /// still lands in its place, and buffers one byte off alignment take the plain path.
    #[test]
    fn streamed_rows_land_where_plain_ones_do() {
        let t = Transpose {
            outer: 4,
            inner: 16,
            row: 192,
        };
        let src: Vec<u8> = (0..t.len()).map(|i| (i * 31 + i / 192) as u8).collect();
        let mut want = vec![0u8; t.len()];
        for (d, out) in want.chunks_exact_mut(t.row).enumerate() {
            let (j, i) = (d / t.outer, d % t.outer);
            let s = (i * t.inner + j) * t.row;
            out.copy_from_slice(&src[s..s + t.row]);
        }
        // 64-byte aligned storage, and the same one byte past it.
        let mut store = vec![0u128; t.len() / 16 + 4];
        // SAFETY: a plain byte view of the u128 buffer, of its full size.
        let bytes = unsafe { std::slice::from_raw_parts_mut(store.as_mut_ptr().cast::<u8>(), store.len() * 16) };
        let at = bytes.as_ptr().align_offset(64);
        for off in [at, at + 1] {
            let dst = &mut bytes[off..off + t.len()];
            assert_eq!(
                stream::usable(dst.as_ptr(), t.row),
                off == at && cfg!(target_arch = "x86_64")
            );
            dst.fill(0);
            assert!(t.to_pool(&src, dst));
            assert!(dst == &want[..], "offset {}", off - at);
            let mut back = vec![0u8; t.len()];
            assert!(t.from_pool(dst, &mut back));
            assert_eq!(back, src);
        }
    }
}
