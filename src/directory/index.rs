//! A growable hash index: open addressing with linear probing over 8-byte slots, used by
//! the local pool to index its objects by key hash (the directory's own index is the
//! fixed-capacity, lock-free one in `view.rs`).
//!
//! A slot holds a 32-bit tag taken from the key's hash and the 32-bit record index. The
//! tag also picks the home slot, so the index can grow and delete (backward shift)
//! without rehashing records.

const EMPTY: u64 = u64::MAX;
const MIN_SLOTS: usize = 1024;

#[derive(Debug)]
pub(crate) struct PageIndex {
    slots: Vec<u64>,
    mask: usize,
    len: usize,
}

impl Default for PageIndex {
    fn default() -> Self {
        Self {
            slots: vec![EMPTY; MIN_SLOTS],
            mask: MIN_SLOTS - 1,
            len: 0,
        }
    }
}

#[inline]
fn tag(h: u64) -> u32 {
    (h >> 32) as u32
}

impl PageIndex {
    #[inline]
    fn home(&self, t: u32) -> usize {
        t as usize & self.mask
    }

    /// The record index whose tag matches and for which `eq` holds.
    #[inline]
    pub fn find(&self, h: u64, eq: impl Fn(u32) -> bool) -> Option<u32> {
        let t = tag(h);
        let mut i = self.home(t);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            if (s >> 32) as u32 == t && eq(s as u32) {
                return Some(s as u32);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Adds a record index under `h`. The caller has checked it is not present.
    pub fn insert(&mut self, h: u64, idx: u32) {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        self.place(((tag(h) as u64) << 32) | idx as u64);
        self.len += 1;
    }

    fn place(&mut self, s: u64) {
        let mut i = self.home((s >> 32) as u32);
        while self.slots[i] != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.slots[i] = s;
    }

    fn grow(&mut self) {
        let doubled = vec![EMPTY; self.slots.len() * 2];
        let old = std::mem::replace(&mut self.slots, doubled);
        self.mask = self.slots.len() - 1;
        for s in old.into_iter().filter(|&s| s != EMPTY) {
            self.place(s);
        }
    }

    /// Removes record index `idx` stored under `h`. Returns whether it was there.
    pub fn remove(&mut self, h: u64, idx: u32) -> bool {
        let t = tag(h);
        let mut i = self.home(t);
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return false;
            }
            if s as u32 == idx && (s >> 32) as u32 == t {
                break;
            }
            i = (i + 1) & self.mask;
        }
        // Backward-shift deletion: pull later entries of the run into the hole when
        // their home does not lie cyclically in (hole, j].
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s == EMPTY {
                break;
            }
            let home = self.home((s >> 32) as u32);
            let between = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !between {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn insert_find_remove_against_a_map() {
        let mut ix = PageIndex::default();
        let mut model = HashMap::new();
        // Few distinct tags force long runs and wrap-around.
        let h = |k: u64| ((k % 7) << 32 | (k & 0xffff)) ^ 0xffff_fff0_0000_0000;
        for k in 0..5000u64 {
            ix.insert(h(k), k as u32);
            model.insert(k, k as u32);
            if k % 3 == 0 {
                let victim = k / 2;
                if model.remove(&victim).is_some() {
                    assert!(ix.remove(h(victim), victim as u32));
                }
            }
        }
        for k in 0..5000u64 {
            let got = ix.find(h(k), |i| i as u64 == k);
            assert_eq!(got, model.get(&k).copied(), "key {k}");
        }
        assert!(!ix.remove(h(1), 999_999));
    }
}
