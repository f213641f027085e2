//! The arena's free slots: a stack (O(1) allocate and free) that also knows where each
//! free slot sits in it, so that taking one given slot out (recovery adopting the slots
//! its records name) is O(1) too rather than a scan of the stack.

/// Not in the stack.
const NIL: u32 = u32::MAX;

#[derive(Debug, Default)]
pub(super) struct FreeList {
    stack: Vec<u32>,
    /// Each slot's index in `stack`, or [`NIL`] when it is allocated.
    pos: Vec<u32>,
}

impl FreeList {
    /// Every one of `slots` slots free; slot 0 is allocated first.
    pub fn new(slots: u32) -> Self {
        Self {
            stack: (0..slots).rev().collect(),
            pos: (0..slots).map(|s| slots - 1 - s).collect(),
        }
    }

    /// Every slot free except those in `used`.
    pub fn without(slots: u32, used: impl IntoIterator<Item = u32>) -> Self {
        let mut taken = vec![false; slots as usize];
        for s in used {
            if let Some(t) = taken.get_mut(s as usize) {
                *t = true;
            }
        }
        let stack: Vec<u32> = (0..slots).rev().filter(|&s| !taken[s as usize]).collect();
        let mut pos = vec![NIL; slots as usize];
        for (i, &s) in stack.iter().enumerate() {
            pos[s as usize] = i as u32;
        }
        Self { stack, pos }
    }

    pub fn len(&self) -> usize {
        self.stack.len()
    }

    pub fn pop(&mut self) -> Option<u32> {
        let s = self.stack.pop()?;
        self.pos[s as usize] = NIL;
        Some(s)
    }

    /// The last `n` free slots, all or none.
    pub fn pop_n(&mut self, n: usize) -> Option<Vec<u32>> {
        if self.stack.len() < n {
            return None;
        }
        let at = self.stack.len() - n;
        let out: Vec<u32> = self.stack.drain(at..).collect();
        for &s in &out {
            self.pos[s as usize] = NIL;
        }
        Some(out)
    }

    pub fn push(&mut self, s: u32) {
        if let Some(p) = self.pos.get_mut(s as usize) {
            debug_assert_eq!(*p, NIL, "slot {s} freed twice");
            *p = self.stack.len() as u32;
            self.stack.push(s);
        }
    }

    /// Takes slot `s` out when it is free, O(1); false when it is not.
    pub fn take(&mut self, s: u32) -> bool {
        let Some(&p) = self.pos.get(s as usize) else {
            return false;
        };
        if p == NIL {
            return false;
        }
        let last = self.stack.len() - 1;
        self.stack.swap_remove(p as usize);
        if (p as usize) < last {
            let moved = self.stack[p as usize];
            self.pos[moved as usize] = p;
        }
        self.pos[s as usize] = NIL;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taking_given_slots_keeps_the_stack_and_positions_in_step() {
        let mut f = FreeList::new(6);
        assert!(f.take(3) && f.take(5) && f.take(0));
        assert!(!f.take(3), "taken twice");
        assert!(!f.take(9), "outside");
        assert_eq!(f.len(), 3);
        let mut rest = vec![f.pop().unwrap()];
        rest.extend(f.pop_n(2).unwrap());
        rest.sort();
        assert_eq!(rest, vec![1, 2, 4]);
        assert!(f.pop().is_none() && f.pop_n(1).is_none());
        f.push(4);
        f.push(0);
        assert!(f.take(4));
        assert_eq!(f.pop(), Some(0));
        let mut g = FreeList::without(5, [1, 3, 7]);
        assert_eq!(g.len(), 3);
        assert!(!g.take(1) && g.take(2));
        assert_eq!((g.pop(), g.pop(), g.pop()), (Some(0), Some(4), None));
    }
}
