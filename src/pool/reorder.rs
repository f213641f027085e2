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

/// `src` as `[a][b][row]` into `dst` as `[b][a][row]`, walking `dst` in order: the
/// destination is written front to back (what the store buffers and the hardware
/// prefetcher handle best) while the source is read at a stride of `b` rows.
fn swap_rows(a: usize, b: usize, row: usize, src: &[u8], dst: &mut [u8]) -> bool {
    let len = a * b * row;
    if src.len() != len || dst.len() != len {
        return false;
    }
    if row == 0 {
        return true;
    }
    for (d, out) in dst.chunks_exact_mut(row).enumerate() {
        // dst row d = (j, i) with j < b, i < a; its source row is (i, j).
        let (j, i) = (d / a, d % a);
        let s = (i * b + j) * row;
        out.copy_from_slice(&src[s..s + row]);
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
}
