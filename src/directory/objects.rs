//! Objects of a page: which are present or in flight in each tier, set one at a time,
//! per page, or for a whole object set. A page's two-bit tier state (absent, partial,
//! complete) follows from these changes, and only a change of completeness emits an
//! event (`Directory::set_state`).

use super::{ABSENT, COMPLETE, Directory, DirectoryError, ObjectSet, PARTIAL, PageId};
use crate::tier::TierKind;

impl Directory {
    fn object_count(&self, id: PageId) -> usize {
        let ns = self.records[id.0 as usize].ns;
        self.layouts[ns.0 as usize].1.object_count()
    }

    /// Whether object `index` of the page is present in `tier`.
    pub fn has_object(&self, id: PageId, tier: TierKind, index: usize) -> bool {
        match self.records[id.0 as usize].tier_state(tier) {
            COMPLETE => index < self.object_count(id),
            PARTIAL => self.partial.get(&(id.0, tier as u8)).is_some_and(|s| s.contains(index)),
            _ => false,
        }
    }

    /// Objects of the page that are not present in `tier`, in canonical order.
    pub fn missing_objects(&self, id: PageId, tier: TierKind) -> Vec<usize> {
        let n = self.object_count(id);
        match self.records[id.0 as usize].tier_state(tier) {
            COMPLETE => Vec::new(),
            PARTIAL => match self.partial.get(&(id.0, tier as u8)) {
                Some(s) => (0..n).filter(|&i| !s.contains(i)).collect(),
                None => (0..n).collect(),
            },
            _ => (0..n).collect(),
        }
    }

    /// Pages with at least one object being written into `tier`.
    pub fn inflight_pages(&self, tier: TierKind) -> usize {
        self.inflight_count[tier.index()]
    }

    /// Objects of the page that are being written into `tier`.
    pub fn inflight_objects(&self, id: PageId, tier: TierKind) -> Vec<usize> {
        if !self.is_inflight(id, tier) {
            return Vec::new();
        }
        self.inflight
            .get(&(id.0, tier as u8))
            .map(|s| s.iter().collect())
            .unwrap_or_default()
    }

    /// Whether object `index` of the page is being written into `tier`. Answers from the
    /// record's in-flight bit when the page has nothing in flight there.
    pub fn is_inflight_object(&self, id: PageId, tier: TierKind, index: usize) -> bool {
        self.is_inflight(id, tier)
            && self
                .inflight
                .get(&(id.0, tier as u8))
                .is_some_and(|s| s.contains(index))
    }

    fn check_index(&self, id: PageId, index: usize) -> Result<usize, DirectoryError> {
        let count = self.object_count(id);
        if index >= count {
            return Err(DirectoryError::ObjectOutOfRange { index, count });
        }
        Ok(count)
    }

    /// Marks one object present or gone. Emits `stored` when this completes the page and
    /// `removed` when it breaks a complete page. Returns whether completeness changed.
    pub fn set_object(
        &mut self,
        id: PageId,
        tier: TierKind,
        index: usize,
        present: bool,
    ) -> Result<bool, DirectoryError> {
        let count = self.check_index(id, index)?;
        let key = (id.0, tier as u8);
        let state = self.records[id.0 as usize].tier_state(tier);
        let changed = match (state, present) {
            (COMPLETE, true) | (ABSENT, false) => false,
            (ABSENT, true) => {
                if count == 1 {
                    self.set_state(id, tier, COMPLETE);
                    true
                } else {
                    let mut s = ObjectSet::new(count);
                    s.insert(index);
                    self.partial.insert(key, s);
                    self.set_state(id, tier, PARTIAL);
                    false
                }
            }
            (COMPLETE, false) => {
                if count == 1 {
                    self.set_state(id, tier, ABSENT);
                } else {
                    let mut s = ObjectSet::full(count);
                    s.remove(index);
                    self.partial.insert(key, s);
                    self.set_state(id, tier, PARTIAL);
                }
                true
            }
            (_, true) => {
                let s = self.partial.get_mut(&key).expect("partial pages have a set");
                s.insert(index);
                if s.is_full() {
                    self.partial.remove(&key);
                    self.set_state(id, tier, COMPLETE);
                    true
                } else {
                    false
                }
            }
            (_, false) => {
                let s = self.partial.get_mut(&key).expect("partial pages have a set");
                s.remove(index);
                if s.is_empty() {
                    self.partial.remove(&key);
                    self.set_state(id, tier, ABSENT);
                }
                false
            }
        };
        self.release_if_empty(id);
        Ok(changed)
    }

    /// Marks every object of the page present (`true`) or gone (`false`) in `tier` at once.
    /// Returns whether completeness changed (at most one event).
    pub fn set_page(&mut self, id: PageId, tier: TierKind, present: bool) -> bool {
        let state = self.records[id.0 as usize].tier_state(tier);
        self.partial.remove(&(id.0, tier as u8));
        let target = if present { COMPLETE } else { ABSENT };
        let changed = (state == COMPLETE) != present;
        if state != target {
            self.set_state(id, tier, target);
        }
        self.release_if_empty(id);
        changed
    }

    /// Marks several objects of one page present or gone in `tier` at once, with one
    /// side-table change instead of one per object. Events and the result are those of
    /// calling [`Self::set_object`] for each in turn (completeness crosses at most once,
    /// since every object moves the same way): a page whose objects all arrive in one
    /// call goes from absent to complete without a partial set.
    pub fn set_objects(
        &mut self,
        id: PageId,
        tier: TierKind,
        objs: &[usize],
        present: bool,
    ) -> Result<bool, DirectoryError> {
        let count = self.object_count(id);
        if let Some(&index) = objs.iter().find(|&&o| o >= count) {
            return Err(DirectoryError::ObjectOutOfRange { index, count });
        }
        let key = (id.0, tier as u8);
        let state = self.records[id.0 as usize].tier_state(tier);
        let mut set = match (state, present) {
            (COMPLETE, true) | (ABSENT, false) => {
                self.release_if_empty(id);
                return Ok(false);
            }
            _ if objs.is_empty() => return Ok(false),
            (COMPLETE, false) => ObjectSet::full(count),
            (ABSENT, true) => ObjectSet::new(count),
            _ => self.partial.remove(&key).unwrap_or_else(|| ObjectSet::new(count)),
        };
        for &o in objs {
            if present {
                set.insert(o);
            } else {
                set.remove(o);
            }
        }
        let target = if set.is_full() {
            COMPLETE
        } else if set.is_empty() {
            ABSENT
        } else {
            self.partial.insert(key, set);
            PARTIAL
        };
        if target != state {
            self.set_state(id, tier, target);
        }
        self.release_if_empty(id);
        Ok((state == COMPLETE) != (target == COMPLETE))
    }

    /// Marks several objects of one page as being written into `tier` (or no longer),
    /// with one side-table change.
    pub fn set_inflight_objects(
        &mut self,
        id: PageId,
        tier: TierKind,
        objs: &[usize],
        on: bool,
    ) -> Result<(), DirectoryError> {
        let count = self.object_count(id);
        if let Some(&index) = objs.iter().find(|&&o| o >= count) {
            return Err(DirectoryError::ObjectOutOfRange { index, count });
        }
        let key = (id.0, tier as u8);
        let bit = 1u8 << tier.index();
        if on && !objs.is_empty() {
            let set = self.inflight.entry(key).or_insert_with(|| {
                self.inflight_count[tier.index()] += 1;
                ObjectSet::new(count)
            });
            for &o in objs {
                set.insert(o);
            }
            self.records[id.0 as usize].inflight |= bit;
        } else if !on && let Some(s) = self.inflight.get_mut(&key) {
            for &o in objs {
                s.remove(o);
            }
            if s.is_empty() {
                self.inflight.remove(&key);
                self.inflight_count[tier.index()] -= 1;
                self.records[id.0 as usize].inflight &= !bit;
            }
        }
        self.release_if_empty(id);
        Ok(())
    }

    /// Marks one object as being written into `tier` (or no longer).
    pub fn set_inflight(&mut self, id: PageId, tier: TierKind, index: usize, on: bool) -> Result<(), DirectoryError> {
        let count = self.check_index(id, index)?;
        let key = (id.0, tier as u8);
        if on {
            let set = self.inflight.entry(key).or_insert_with(|| {
                self.inflight_count[tier.index()] += 1;
                ObjectSet::new(count)
            });
            set.insert(index);
        } else if let Some(s) = self.inflight.get_mut(&key) {
            s.remove(index);
            if s.is_empty() {
                self.inflight.remove(&key);
                self.inflight_count[tier.index()] -= 1;
            }
        }
        let bit = 1u8 << tier.index();
        let rec = &mut self.records[id.0 as usize];
        if self.inflight.contains_key(&key) {
            rec.inflight |= bit;
        } else {
            rec.inflight &= !bit;
        }
        self.release_if_empty(id);
        Ok(())
    }
}
