//! A fixed-length set of object indices, for pages that are partial or in flight.

/// Which objects of one page are in some state. Length fixed at creation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectSet {
    len: usize,
    count: usize,
    words: Box<[u64]>,
}

impl ObjectSet {
    pub fn new(len: usize) -> Self {
        Self {
            len,
            count: 0,
            words: vec![0; len.div_ceil(64)].into_boxed_slice(),
        }
    }

    pub fn full(len: usize) -> Self {
        let mut s = Self::new(len);
        for i in 0..len {
            s.insert(i);
        }
        s
    }

    pub fn insert(&mut self, i: usize) {
        debug_assert!(i < self.len);
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.words[w] & b == 0 {
            self.words[w] |= b;
            self.count += 1;
        }
    }

    pub fn remove(&mut self, i: usize) {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        if self.words[w] & b != 0 {
            self.words[w] &= !b;
            self.count -= 1;
        }
    }

    pub fn contains(&self, i: usize) -> bool {
        i < self.len && self.words[i / 64] & (1u64 << (i % 64)) != 0
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
        self.words.len() * 8
    }
}
