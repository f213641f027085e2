//! The node-local shared pool: objects in a shared-memory region of fixed slots, with LRU
//! eviction of its own.
//!
//! Bytes are copied outside the index lock. A put becomes visible only after its bytes
//! are in place, and a slot being read is never reused until the reader is done, so a
//! reader can never see a torn or recycled object.

use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::{GetItem, PoolBackend, PoolError, PoolHealth, PoolUsage, PutItem, reorder_shape};
use crate::tier::host::{ArenaError, ArenaOptions, HostArena, SlotId};

mod index;
mod reopen;
mod slots;

use index::{Freed, Index, key_hash};
pub use reopen::Reopened;

/// The embedded default pool.
///
/// A batch takes the index lock twice, not twice per object: once to reserve (slots for
/// puts, reader fences for gets), then the bytes move with no lock held, then once to
/// settle. Per-object locking made every 64 KiB copy pay two lock round trips (contended
/// by the other transfer workers) and a key allocation on top of the copy. Key hashes
/// are taken before the lock, and the index allocates nothing per object (see `index`).
/// A reordered item (a layer-first object stored page-first) is transposed straight
/// between the caller's buffer and the pool slot, with no staging copy.
///
/// Each slot's object is also recorded in a slot table beside the pool file
/// (`<path>.slots`, see `slots`), so that [`LocalPool::open`] with `recover` finds the
/// pool's objects again after the daemon restarts, SIGKILL included.
#[derive(Debug)]
pub struct LocalPool {
    store: HostArena,
    index: Mutex<Index>,
    /// The objects (key, length) found at open, until the manager takes them.
    recovered: Mutex<Vec<(String, usize)>>,
}

/// The slot table's path for a pool at `path`.
pub fn slot_table_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".slots");
    PathBuf::from(p)
}

impl LocalPool {
    /// A fresh, empty pool at `path` of `capacity` bytes in slots of `slot_bytes`.
    pub fn create(path: &Path, capacity: u64, slot_bytes: u64, opts: &ArenaOptions) -> Result<Self, ArenaError> {
        let store = HostArena::create(path, capacity, slot_bytes, opts)?;
        let mut index = Index::new(store.slots());
        let table = slot_table_path(path);
        index.attach(
            slots::SlotTable::create(&table, store.slots(), slot_bytes).map_err(|source| ArenaError::Io {
                path: table.clone(),
                source,
            })?,
        );
        Ok(Self {
            store,
            index: Mutex::new(index),
            recovered: Mutex::new(Vec::new()),
        })
    }

    pub fn slots(&self) -> u32 {
        self.store.slots()
    }

    /// Objects put whose key was too long for the slot table: they are served, but not
    /// found again after a restart.
    pub fn unrecorded(&self) -> u64 {
        self.index.lock().unrecorded()
    }

    /// Whether evicted keys were lost because nobody took them in time.
    pub fn evicted_overflow(&self) -> bool {
        self.index.lock().overflowed()
    }

    /// Takes a free slot, evicting the least recently used idle object when none is free.
    fn alloc(&self, idx: &mut Index) -> Option<SlotId> {
        self.store.alloc().or_else(|| idx.evict_lru())
    }

    /// One round of a batch put over the items `todo` names: reserve their slots under one
    /// lock, copy with no lock held, publish under one lock. Returns how many were placed
    /// and the items that found no slot.
    fn put_round(
        &self,
        items: &[PutItem<'_>],
        hashes: &[u64],
        todo: &[usize],
        results: &mut [Result<(), PoolError>],
    ) -> (usize, Vec<usize>) {
        let max = self.store.slot_bytes();
        let mut rest = Vec::new();
        let mut slots: Vec<(usize, SlotId)> = Vec::with_capacity(todo.len());
        {
            let mut idx = self.index.lock();
            for &i in todo {
                let len = items[i].1.len();
                if len > max {
                    results[i] = Err(PoolError::TooLarge { len, max });
                } else if let Some(s) = self.alloc(&mut idx) {
                    slots.push((i, s));
                } else {
                    results[i] = Err(PoolError::NoSpace);
                    rest.push(i);
                }
            }
        }
        let mut written = Vec::with_capacity(slots.len());
        for (i, s) in slots {
            let (_, data, order) = items[i];
            // SAFETY: the slot is ours: allocated above and not yet published in the index.
            match unsafe { self.store.slot_mut(s, data.len()) } {
                Ok(dst) => match order {
                    None => {
                        dst.copy_from_slice(data);
                        written.push((i, s));
                    }
                    Some(t) if t.to_pool(data, dst) => written.push((i, s)),
                    Some(t) => {
                        self.store.free(s);
                        results[i] = Err(reorder_shape(data.len(), &t));
                    }
                },
                Err(e) => {
                    self.store.free(s);
                    results[i] = Err(PoolError::Unavailable(e.to_string()));
                }
            }
        }
        // The index keeps its own copy of each key: made here, not under the lock.
        let keys: Vec<String> = written.iter().map(|&(i, _)| items[i].0.to_owned()).collect();
        let mut idx = self.index.lock();
        // Every byte above is in before its record goes in (`slots`: commit order).
        for (&(i, s), key) in written.iter().zip(keys) {
            if let Some(old) = idx.publish(key, hashes[i], s, items[i].1.len()) {
                self.store.free(old);
            }
            results[i] = Ok(());
        }
        (written.len(), rest)
    }
}

impl PoolBackend for LocalPool {
    fn name(&self) -> &'static str {
        "local"
    }

    fn mapping_page_bytes(&self) -> Option<u64> {
        Some(self.store.report().page_bytes)
    }

    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        let items: Vec<PutItem<'_>> = items.iter().map(|&(k, d)| (k, d, None)).collect();
        self.batch_put_ordered(&items)
    }

    fn batch_put_ordered(&self, items: &[PutItem<'_>]) -> Vec<Result<(), PoolError>> {
        let mut results: Vec<Result<(), PoolError>> = vec![Err(PoolError::NoSpace); items.len()];
        let mut todo: Vec<usize> = (0..items.len()).collect();
        let hashes: Vec<u64> = items.iter().map(|(k, _, _)| key_hash(k)).collect();
        // Normally one round. When the pool runs out of slots mid-batch, the rest go in
        // another round once this one is published, so they may evict what it wrote (as
        // one put at a time would), rather than fail beside slots still unpublished.
        while !todo.is_empty() {
            let (placed, rest) = self.put_round(items, &hashes, &todo, &mut results);
            if placed == 0 {
                break;
            }
            todo = rest;
        }
        results
    }

    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        let mut items: Vec<GetItem<'_>> = items.iter_mut().map(|(k, b)| (*k, &mut **b, None)).collect();
        self.batch_get_ordered(&mut items)
    }

    fn batch_get_ordered(&self, items: &mut [GetItem<'_>]) -> Vec<Result<usize, PoolError>> {
        // Fence every slot under one lock: none is freed or reused until unfenced below,
        // and puts never write a published slot.
        let hashes: Vec<u64> = items.iter().map(|(k, _, _)| key_hash(k)).collect();
        let fenced: Vec<Result<(SlotId, usize), PoolError>> = {
            let mut idx = self.index.lock();
            items
                .iter()
                .zip(&hashes)
                .map(|((k, b, _), &h)| idx.fence(k, h, b.len()))
                .collect()
        };
        let results: Vec<Result<usize, PoolError>> = items
            .iter_mut()
            .zip(&fenced)
            .map(|((_, buf, order), f)| {
                let (slot, len) = f.clone()?;
                // SAFETY: the slot is fenced by our reader count (see above).
                let src = unsafe { self.store.slot(slot, len) }.map_err(|e| PoolError::Unavailable(e.to_string()))?;
                match order {
                    None => buf[..len].copy_from_slice(src),
                    // An object of another length stays uncopied; `Ok(len)` says so.
                    Some(_) if len != buf.len() => {}
                    Some(t) if !t.from_pool(src, buf) => return Err(reorder_shape(buf.len(), t)),
                    Some(_) => {}
                }
                Ok(len)
            })
            .collect();
        let mut idx = self.index.lock();
        for (slot, _) in fenced.iter().flatten() {
            if let Some(s) = idx.unfence(*slot) {
                self.store.free(s);
            }
        }
        results
    }

    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        let hashes: Vec<u64> = keys.iter().map(|k| key_hash(k)).collect();
        let idx = self.index.lock();
        keys.iter().zip(hashes).map(|(k, h)| Ok(idx.contains(k, h))).collect()
    }

    fn remove(&self, key: &str, _force: bool) -> Result<(), PoolError> {
        let h = key_hash(key);
        let (slot, freed) = self.index.lock().remove(key, h).ok_or(PoolError::NotFound)?;
        if freed == Freed::Now {
            self.store.free(slot);
        }
        Ok(())
    }

    fn health(&self) -> PoolHealth {
        PoolHealth::Ok
    }

    fn usage(&self) -> PoolUsage {
        let idx = self.index.lock();
        PoolUsage {
            capacity_bytes: self.store.slots() as u64 * self.store.slot_bytes() as u64,
            used_bytes: idx.used_bytes(),
            objects: idx.len() as u64,
        }
    }

    fn take_evicted(&self) -> Vec<String> {
        self.index.lock().take_evicted()
    }

    fn take_recovered(&self) -> Vec<(String, usize)> {
        std::mem::take(&mut *self.recovered.lock())
    }

    fn max_object_bytes(&self) -> usize {
        self.store.slot_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tier::device::pattern;

    fn pool(slots: u64) -> (tempfile::TempDir, LocalPool) {
        let dir = tempfile::tempdir().unwrap();
        let p = LocalPool::create(&dir.path().join("pool"), slots * 4096, 4096, &ArenaOptions::default()).unwrap();
        (dir, p)
    }

    #[test]
    fn put_get_exists_remove() {
        let (_d, p) = pool(4);
        let a = pattern(1, 4096);
        let b = pattern(2, 100);
        let r = p.batch_put_from(&[("a", &a), ("b", &b)]);
        assert!(r.iter().all(Result::is_ok));
        let mut ba = vec![0u8; 4096];
        let mut bb = vec![0u8; 4096];
        let got = p.batch_get_into(&mut [("a", &mut ba[..]), ("b", &mut bb[..]), ("c", &mut [0u8; 8][..])]);
        assert_eq!(got, vec![Ok(4096), Ok(100), Err(PoolError::NotFound)]);
        assert_eq!(ba, a);
        assert_eq!(&bb[..100], &b[..]);
        assert_eq!(p.batch_exists(&["a", "z"]), vec![Ok(true), Ok(false)]);
        let mut small = [0u8; 10];
        assert_eq!(
            p.batch_get_into(&mut [("a", &mut small[..])])[0],
            Err(PoolError::BufferTooSmall { got: 10, need: 4096 })
        );
        assert_eq!(p.remove("a", false), Ok(()));
        assert_eq!(p.remove("a", false), Err(PoolError::NotFound));
        assert_eq!(p.usage().objects, 1);
        assert!(matches!(
            p.batch_put_from(&[("big", &vec![0u8; 4097][..])])[0],
            Err(PoolError::TooLarge { .. })
        ));
    }

    #[test]
    fn full_pool_evicts_least_recently_used_and_reports_it() {
        let (_d, p) = pool(3);
        for (i, k) in ["a", "b", "c"].iter().enumerate() {
            assert!(p.batch_put_from(&[(k, &pattern(i as u64, 64)[..])])[0].is_ok());
        }
        // Touch "a" so "b" is the least recently used.
        let mut buf = vec![0u8; 64];
        assert_eq!(p.batch_get_into(&mut [("a", &mut buf[..])])[0], Ok(64));
        assert!(p.batch_put_from(&[("d", &pattern(9, 64)[..])])[0].is_ok());
        assert_eq!(p.take_evicted(), vec!["b".to_string()]);
        assert_eq!(
            p.batch_exists(&["a", "b", "c", "d"]),
            vec![Ok(true), Ok(false), Ok(true), Ok(true)]
        );
        assert_eq!(p.batch_get_into(&mut [("d", &mut buf[..])])[0], Ok(64));
        assert_eq!(buf, pattern(9, 64));
        assert!(p.take_evicted().is_empty());
    }

    #[test]
    fn one_batch_answers_each_item_in_order_and_releases_every_fence() {
        let (_d, p) = pool(4);
        let (a, b, c) = (pattern(1, 64), pattern(2, 100), pattern(3, 4096));
        let too_big = vec![7u8; 4097];
        // "c" twice in one batch: the later write wins, and the earlier slot is freed.
        let r = p.batch_put_from(&[("a", &a), ("big", &too_big), ("b", &b), ("c", &a), ("c", &c)]);
        assert_eq!(r.len(), 5);
        assert!(r[0].is_ok() && r[2].is_ok() && r[3].is_ok() && r[4].is_ok(), "{r:?}");
        assert!(matches!(r[1], Err(PoolError::TooLarge { len: 4097, max: 4096 })));
        assert_eq!(p.usage().objects, 3);
        assert_eq!(p.usage().used_bytes, 64 + 100 + 4096);
        let (mut bb, mut small, mut ba, mut bc) = (vec![0u8; 128], [0u8; 10], vec![0u8; 64], vec![0u8; 4096]);
        let got = p.batch_get_into(&mut [
            ("b", &mut bb[..]),
            ("nope", &mut [0u8; 8][..]),
            ("a", &mut small[..]),
            ("a", &mut ba[..]),
            ("c", &mut bc[..]),
        ]);
        assert_eq!(
            got,
            vec![
                Ok(100),
                Err(PoolError::NotFound),
                Err(PoolError::BufferTooSmall { got: 10, need: 64 }),
                Ok(64),
                Ok(4096)
            ]
        );
        assert_eq!(&bb[..100], &b[..]);
        assert_eq!(ba, a);
        assert_eq!(bc, c);
        // Every fence was dropped: removing frees slots at once, so three new objects fit
        // beside nothing evicted.
        for k in ["a", "b", "c"] {
            assert_eq!(p.remove(k, false), Ok(()));
        }
        let r = p.batch_put_from(&[("w", &a), ("x", &a), ("y", &b), ("z", &c)]);
        assert!(r.iter().all(Result::is_ok), "{r:?}");
        assert!(p.take_evicted().is_empty());
    }

    #[test]
    fn a_batch_larger_than_the_free_room_evicts_as_single_puts_would() {
        let (_d, p) = pool(3);
        let (a, b, c) = (pattern(1, 64), pattern(2, 64), pattern(3, 64));
        // Four writes, three slots: the last one evicts the least recently used ("a").
        let r = p.batch_put_from(&[("a", &a), ("b", &b), ("c", &a), ("c", &c)]);
        assert_eq!(r, vec![Ok(()), Ok(()), Ok(()), Ok(())]);
        assert_eq!(p.take_evicted(), vec!["a".to_string()]);
        let mut buf = vec![0u8; 64];
        assert_eq!(p.batch_get_into(&mut [("c", &mut buf[..])]), vec![Ok(64)]);
        assert_eq!(buf, c);
        assert_eq!(p.batch_exists(&["a", "b", "c"]), vec![Ok(false), Ok(true), Ok(true)]);
    }

    /// A backend that keeps the trait's staging defaults for ordered puts and gets, over
    /// the local pool's plain ones: both ways must give the same pool bytes.
    struct Staging<'a>(&'a LocalPool);

    impl PoolBackend for Staging<'_> {
        fn name(&self) -> &'static str {
            "staging"
        }
        fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
            self.0.batch_put_from(items)
        }
        fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
            self.0.batch_get_into(items)
        }
        fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
            self.0.batch_exists(keys)
        }
        fn remove(&self, key: &str, force: bool) -> Result<(), PoolError> {
            self.0.remove(key, force)
        }
        fn health(&self) -> PoolHealth {
            self.0.health()
        }
        fn usage(&self) -> PoolUsage {
            self.0.usage()
        }
        fn take_evicted(&self) -> Vec<String> {
            self.0.take_evicted()
        }
        fn max_object_bytes(&self) -> usize {
            self.0.max_object_bytes()
        }
    }

    #[test]
    fn ordered_puts_and_gets_transpose_in_place_as_the_staging_default_does() {
        let (_d, p) = pool(8);
        let t = crate::pool::Transpose {
            outer: 4,
            inner: 16,
            row: 48,
        };
        let host = pattern(5, t.len());
        let mut want = vec![0u8; t.len()];
        assert!(t.to_pool(&host, &mut want));
        let plain = pattern(6, 100);
        let staging = Staging(&p);
        for (b, (tk, pk)) in [(&p as &dyn PoolBackend, ("t1", "p1")), (&staging, ("t2", "p2"))] {
            let r = b.batch_put_ordered(&[(tk, &host, Some(t)), (pk, &plain, None), ("bad", &host[1..], Some(t))]);
            assert_eq!(r[..2], [Ok(()), Ok(())], "{}", b.name());
            assert_eq!(
                r[2],
                Err(PoolError::ReorderShape {
                    len: t.len() - 1,
                    want: t.len()
                })
            );
        }
        assert_eq!(p.batch_exists(&["bad"]), vec![Ok(false)]);
        // The pool holds the transposed bytes, and the plain object as it was.
        for k in ["t1", "t2"] {
            let mut raw = vec![0u8; t.len()];
            assert_eq!(p.batch_get_into(&mut [(k, &mut raw[..])]), vec![Ok(t.len())]);
            assert_eq!(raw, want, "{k}");
        }
        for b in [&p as &dyn PoolBackend, &staging] {
            let (mut back, mut pl, mut short) = (vec![0u8; t.len()], vec![0u8; 100], vec![0u8; t.len()]);
            let got = b.batch_get_ordered(&mut [
                ("t1", &mut back[..], Some(t)),
                ("p2", &mut pl[..], None),
                // An object of another length than its reorder: uncopied, and the length
                // it has says so.
                ("p1", &mut short[..], Some(t)),
                ("none", &mut [0u8; 8][..], Some(t)),
            ]);
            assert_eq!(
                got,
                vec![Ok(t.len()), Ok(100), Ok(100), Err(PoolError::NotFound)],
                "{}",
                b.name()
            );
            assert_eq!(back, host, "{}", b.name());
            assert_eq!(pl, plain);
            assert_eq!(short, vec![0u8; t.len()], "{}", b.name());
        }
    }

    #[test]
    fn overwrite_replaces_bytes() {
        let (_d, p) = pool(2);
        p.batch_put_from(&[("k", &pattern(1, 64)[..])]);
        p.batch_put_from(&[("k", &pattern(2, 32)[..])]);
        let mut buf = [0u8; 64];
        assert_eq!(p.batch_get_into(&mut [("k", &mut buf[..])])[0], Ok(32));
        assert_eq!(&buf[..32], &pattern(2, 32)[..]);
        assert_eq!(p.usage().objects, 1);
        assert_eq!(p.usage().used_bytes, 32);
    }
}
