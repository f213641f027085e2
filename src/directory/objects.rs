//! Objects of a page: which are present or in flight in each tier, set one at a time,
//! per page, or for a whole object set. A page's two-bit tier state (absent, partial,
//! complete) follows from these changes, and only a change of completeness emits an
//! event (`Directory::set_state`).
//!
//! [`ObjectMarks`] owns the side tables of the rare pages that are partial or in flight
//! (and the in-flight count per tier kept with them); the directory's writes change them
//! through its API, and readers reach them through [`Directory::objects`].

use super::{ABSENT, COMPLETE, Directory, DirectoryError, IdMap, NsLayouts, ObjectSet, PARTIAL, PageId, PageRecord};
use crate::tier::TierKind;

/// A page's side-table key: (record slot, tier).
type Key = (u32, u8);

fn key(id: PageId, tier: TierKind) -> Key {
    (id.0, tier as u8)
}

/// The objects present on partial pages and the objects in flight, per (page, tier).
#[derive(Debug, Default)]
pub(super) struct ObjectMarks {
    partial: IdMap<Key, ObjectSet>,
    inflight: IdMap<Key, ObjectSet>,
    /// Pages with an entry in `inflight`, per tier (kept as it changes, so stats are O(1)).
    inflight_count: [usize; 3],
}

impl ObjectMarks {
    /// Forgets the partial set of the page in `tier` (it became absent or complete).
    pub(super) fn clear_partial(&mut self, id: PageId, tier: TierKind) {
        self.partial.remove(&key(id, tier));
    }

    /// Marks `objs` of the page (of `count` objects) in flight into `tier` (`on`) or no
    /// longer. Returns whether the page still has objects in flight there.
    fn mark_inflight(&mut self, id: PageId, tier: TierKind, count: usize, objs: &[usize], on: bool) -> bool {
        let k = key(id, tier);
        if on && !objs.is_empty() {
            let set = self.inflight.entry(k).or_insert_with(|| {
                self.inflight_count[tier.index()] += 1;
                ObjectSet::new(count)
            });
            for &o in objs {
                set.insert(o);
            }
        } else if !on && let Some(s) = self.inflight.get_mut(&k) {
            for &o in objs {
                s.remove(o);
            }
            if s.is_empty() {
                self.inflight.remove(&k);
                self.inflight_count[tier.index()] -= 1;
            }
        }
        self.inflight.contains_key(&k)
    }

    /// Heap bytes of the side tables.
    pub(super) fn heap_bytes(&self) -> usize {
        (self.partial.capacity() + self.inflight.capacity()) * (std::mem::size_of::<(Key, ObjectSet)>() + 1)
            + self
                .partial
                .values()
                .chain(self.inflight.values())
                .map(ObjectSet::heap_bytes)
                .sum::<usize>()
    }
}

fn object_count(layouts: &NsLayouts, rec: &PageRecord) -> usize {
    layouts[rec.ns.0 as usize].1.object_count()
}

fn check_index(count: usize, index: usize) -> Result<(), DirectoryError> {
    if index >= count {
        return Err(DirectoryError::ObjectOutOfRange { index, count });
    }
    Ok(())
}

fn check_indices(count: usize, objs: &[usize]) -> Result<(), DirectoryError> {
    match objs.iter().find(|&&o| o >= count) {
        Some(&index) => Err(DirectoryError::ObjectOutOfRange { index, count }),
        None => Ok(()),
    }
}

/// Which objects of a page are present or in flight, read-only ([`Directory::objects`]).
#[derive(Clone, Copy)]
pub struct Objects<'a> {
    records: &'a [PageRecord],
    layouts: &'a NsLayouts,
    marks: &'a ObjectMarks,
}

impl Objects<'_> {
    /// Whether object `index` of the page is present in `tier`.
    pub fn has_object(&self, id: PageId, tier: TierKind, index: usize) -> bool {
        let rec = &self.records[id.0 as usize];
        match rec.tier_state(tier) {
            COMPLETE => index < object_count(self.layouts, rec),
            PARTIAL => self
                .marks
                .partial
                .get(&key(id, tier))
                .is_some_and(|s| s.contains(index)),
            _ => false,
        }
    }

    /// Whether the page has no object present in `tier` and none in flight into it:
    /// every object of its layout is still to be written there and nothing else is
    /// writing it (the common case of a store or a staging, answered from the record
    /// alone, with no side-table read and no list built).
    pub fn untouched(&self, id: PageId, tier: TierKind) -> bool {
        let rec = &self.records[id.0 as usize];
        rec.tier_state(tier) == ABSENT && rec.inflight & (1 << tier.index()) == 0
    }

    /// Objects of the page that are not present in `tier`, in canonical order.
    pub fn missing_objects(&self, id: PageId, tier: TierKind) -> Vec<usize> {
        let rec = &self.records[id.0 as usize];
        let n = object_count(self.layouts, rec);
        match rec.tier_state(tier) {
            COMPLETE => Vec::new(),
            PARTIAL => match self.marks.partial.get(&key(id, tier)) {
                Some(s) => (0..n).filter(|&i| !s.contains(i)).collect(),
                None => (0..n).collect(),
            },
            _ => (0..n).collect(),
        }
    }

    /// Objects of the page neither present in `tier` nor being written into it, in
    /// canonical order, into `out` (cleared first): what a move into `tier` still has to
    /// write. A page with nothing there and nothing on its way (the common case of a
    /// staging or a share) is answered from its record alone, with no side-table read and
    /// no list built, so a caller reusing `out` allocates nothing per page.
    pub fn unwritten_into(&self, id: PageId, tier: TierKind, out: &mut Vec<usize>) {
        out.clear();
        if self.untouched(id, tier) {
            out.extend(0..object_count(self.layouts, &self.records[id.0 as usize]));
            return;
        }
        out.extend(
            self.missing_objects(id, tier)
                .into_iter()
                .filter(|&o| !self.is_inflight_object(id, tier, o)),
        );
    }

    /// Pages with at least one object being written into `tier`.
    pub fn inflight_pages(&self, tier: TierKind) -> usize {
        self.marks.inflight_count[tier.index()]
    }

    /// Objects of the page that are being written into `tier`.
    pub fn inflight_objects(&self, id: PageId, tier: TierKind) -> Vec<usize> {
        if self.records[id.0 as usize].inflight & (1 << tier.index()) == 0 {
            return Vec::new();
        }
        self.marks
            .inflight
            .get(&key(id, tier))
            .map(|s| s.iter().collect())
            .unwrap_or_default()
    }

    /// Whether object `index` of the page is being written into `tier`. Answers from the
    /// record's in-flight bit when the page has nothing in flight there.
    pub fn is_inflight_object(&self, id: PageId, tier: TierKind, index: usize) -> bool {
        self.records[id.0 as usize].inflight & (1 << tier.index()) != 0
            && self
                .marks
                .inflight
                .get(&key(id, tier))
                .is_some_and(|s| s.contains(index))
    }
}

impl Directory {
    /// Which objects of each page are present or in flight, read-only.
    pub fn objects(&self) -> Objects<'_> {
        Objects {
            records: &self.records,
            layouts: &self.layouts,
            marks: &self.marks,
        }
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
        let count = object_count(&self.layouts, &self.records[id.0 as usize]);
        check_index(count, index)?;
        let key = key(id, tier);
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
                    self.marks.partial.insert(key, s);
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
                    self.marks.partial.insert(key, s);
                    self.set_state(id, tier, PARTIAL);
                }
                true
            }
            (_, true) => {
                let s = self.marks.partial.get_mut(&key).expect("partial pages have a set");
                s.insert(index);
                if s.is_full() {
                    self.marks.partial.remove(&key);
                    self.set_state(id, tier, COMPLETE);
                    true
                } else {
                    false
                }
            }
            (_, false) => {
                let s = self.marks.partial.get_mut(&key).expect("partial pages have a set");
                s.remove(index);
                if s.is_empty() {
                    self.marks.partial.remove(&key);
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
        self.marks.clear_partial(id, tier);
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
        let count = object_count(&self.layouts, &self.records[id.0 as usize]);
        check_indices(count, objs)?;
        let key = key(id, tier);
        let state = self.records[id.0 as usize].tier_state(tier);
        let mut set = match (state, present) {
            (COMPLETE, true) | (ABSENT, false) => {
                self.release_if_empty(id);
                return Ok(false);
            }
            _ if objs.is_empty() => return Ok(false),
            (COMPLETE, false) => ObjectSet::full(count),
            (ABSENT, true) => ObjectSet::new(count),
            _ => self.marks.partial.remove(&key).unwrap_or_else(|| ObjectSet::new(count)),
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
            self.marks.partial.insert(key, set);
            PARTIAL
        };
        if target != state {
            self.set_state(id, tier, target);
        }
        self.release_if_empty(id);
        Ok((state == COMPLETE) != (target == COMPLETE))
    }

    /// Forgets up to `n` pages whose only state is that engines hold them on device, least
    /// recently accessed first, and returns how many. kvtier holds no byte of such a page
    /// (device memory is the engine's), and an engine that frees its blocks without saying
    /// so (`Removed`) leaves these marks behind for good: without this, they filled the
    /// directory and every later store was refused. Pinned or in-flight pages stay; each
    /// forgotten page that was complete on device emits its `removed` event.
    pub(super) fn forget_device_only(&mut self, n: usize) -> usize {
        let device = 3u8 << (TierKind::Device.index() * 2);
        let mut oldest: std::collections::BinaryHeap<(u64, u32)> = std::collections::BinaryHeap::new();
        for (i, r) in self.records.iter().enumerate() {
            if !self.live[i] || r.state == 0 || r.state & !device != 0 || r.inflight != 0 || r.pinned != 0 {
                continue;
            }
            oldest.push((r.last_access, i as u32));
            if oldest.len() > n {
                oldest.pop();
            }
        }
        let mut forgotten = 0;
        for (_, i) in oldest {
            let id = PageId(i);
            let all: Vec<usize> = (0..object_count(&self.layouts, &self.records[i as usize])).collect();
            if self.set_objects(id, TierKind::Device, &all, false).is_ok() && !self.live[i as usize] {
                forgotten += 1;
            }
        }
        forgotten
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
        let count = object_count(&self.layouts, &self.records[id.0 as usize]);
        check_indices(count, objs)?;
        let still = self.marks.mark_inflight(id, tier, count, objs, on);
        self.write_inflight(id, tier, still);
        Ok(())
    }

    /// Marks one object as being written into `tier` (or no longer).
    pub fn set_inflight(&mut self, id: PageId, tier: TierKind, index: usize, on: bool) -> Result<(), DirectoryError> {
        let count = object_count(&self.layouts, &self.records[id.0 as usize]);
        check_index(count, index)?;
        let still = self.marks.mark_inflight(id, tier, count, &[index], on);
        self.write_inflight(id, tier, still);
        Ok(())
    }

    /// Sets the record's in-flight bit for `tier` as the side table says, and relinks
    /// (or frees) the page.
    fn write_inflight(&mut self, id: PageId, tier: TierKind, on: bool) {
        let bit = 1u8 << tier.index();
        let rec = &mut self.records[id.0 as usize];
        if on {
            rec.inflight |= bit;
        } else {
            rec.inflight &= !bit;
        }
        self.release_if_empty(id);
    }
}
