//! A fixed-length set of object indices, for pages that are partial or in flight.
//!
//! Pages of up to 128 objects (TP × PP × 2 up to 128) keep their bits inline, so marking
//! a page partial or in flight allocates nothing; larger layouts spill to the heap.

/// Bits kept inline.
const INLINE_BITS: usize = 128;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Words {
    Inline([u64; INLINE_BITS / 64]),
    Heap(Box<[u64]>),
}

/// Which objects of one page are in some state. Length fixed at creation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectSet {
    len: usize,
    count: usize,
    words: Words,
}

impl ObjectSet {
    pub fn new(len: usize) -> Self {
        let words = if len <= INLINE_BITS {
            Words::Inline([0; INLINE_BITS / 64])
        } else {
            Words::Heap(vec![0; len.div_ceil(64)].into_boxed_slice())
        };
        Self { len, count: 0, words }
    }

    pub fn full(len: usize) -> Self {
        let mut s = Self::new(len);
        for i in 0..len {
            s.insert(i);
        }
        s
    }

    fn words(&self) -> &[u64] {
        match &self.words {
            Words::Inline(w) => w,
            Words::Heap(w) => w,
        }
    }

    fn words_mut(&mut self) -> &mut [u64] {
        match &mut self.words {
            Words::Inline(w) => w,
            Words::Heap(w) => w,
        }
    }

    pub fn insert(&mut self, i: usize) {
        debug_assert!(i < self.len);
        let (w, b) = (i / 64, 1u64 << (i % 64));
        let words = self.words_mut();
        if words[w] & b == 0 {
            words[w] |= b;
            self.count += 1;
        }
    }

    pub fn remove(&mut self, i: usize) {
        if i >= self.len {
            return;
        }
        let (w, b) = (i / 64, 1u64 << (i % 64));
        let words = self.words_mut();
        if words[w] & b != 0 {
            words[w] &= !b;
            self.count -= 1;
        }
    }

    pub fn contains(&self, i: usize) -> bool {
        i < self.len && self.words()[i / 64] & (1u64 << (i % 64)) != 0
    }

    /// Objects in the set (not the page's object count).
    pub fn count(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn is_full(&self) -> bool {
        self.count == self.len
    }

    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.len).filter(|&i| self.contains(i))
    }

    pub fn heap_bytes(&self) -> usize {
        match &self.words {
            Words::Inline(_) => 0,
            Words::Heap(w) => w.len() * 8,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_sets_agree() {
        for len in [1, 2, 64, 65, 128, 129, 300] {
            let mut s = ObjectSet::new(len);
            assert_eq!(s.heap_bytes() == 0, len <= INLINE_BITS, "len {len}");
            for i in (0..len).step_by(3) {
                s.insert(i);
                s.insert(i);
            }
            let want: Vec<usize> = (0..len).step_by(3).collect();
            assert_eq!(s.iter().collect::<Vec<_>>(), want, "len {len}");
            assert_eq!(s.count(), want.len());
            s.remove(0);
            s.remove(len);
            assert!(!s.contains(0) && !s.contains(len));
            assert_eq!(s.count(), want.len() - 1);
            assert!(ObjectSet::full(len).is_full());
        }
    }
}
