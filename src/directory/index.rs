//! The directory's hash index: open addressing with linear probing over 8-byte slots.
//!
//! A slot holds a 32-bit tag taken from the page's table hash and the 32-bit record
//! index. The tag also picks the home slot, so the index can grow and delete (backward
//! shift) without rehashing records. Lookups of a hash chain prefetch slots a few pages
//! ahead, so the memory latency of one page overlaps with the work on the previous ones.
//! The local pool indexes its objects with the same structure, by key hash.

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

    /// Hints the CPU to fetch the home slot of `h`.
    #[inline]
    pub fn prefetch(&self, h: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = self.slots.as_ptr().wrapping_add(self.home(tag(h)));
            // SAFETY: prefetch never faults, and `p` is inside the slot vector.
            unsafe { std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = h;
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

    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * 8
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
