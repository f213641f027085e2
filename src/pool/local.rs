//! The node-local shared pool: objects in a shared-memory region of fixed slots, with LRU
//! eviction of its own.
//!
//! Bytes are copied outside the index lock. A put becomes visible only after its bytes
//! are in place, and a slot being read is never reused until the reader is done, so a
//! reader can never see a torn or recycled object.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use parking_lot::Mutex;

use super::{PoolBackend, PoolError, PoolHealth, PoolUsage};
use crate::tier::host::{ArenaError, ArenaOptions, HostArena, SlotId};

/// Keys evicted by the pool are kept for the manager until taken, up to this many; beyond
/// that the oldest are dropped and [`LocalPool::evicted_overflow`] says a resync is due.
const EVICTED_LOG_MAX: usize = 1 << 20;

#[derive(Debug)]
struct Entry {
    slot: SlotId,
    len: usize,
    tick: u64,
    /// Readers copying out of the slot right now; it is not reused until they leave.
    readers: u32,
}

#[derive(Debug, Default)]
struct Index {
    entries: HashMap<String, Entry>,
    lru: BTreeMap<u64, String>,
    /// Slots of doomed entries, still being read.
    draining: Vec<(SlotId, u32)>,
    tick: u64,
    used_bytes: u64,
    evicted: Vec<String>,
    overflow: bool,
}

/// The embedded default pool.
#[derive(Debug)]
pub struct LocalPool {
    store: HostArena,
    index: Mutex<Index>,
}

impl LocalPool {
    /// A pool at `path` of `capacity` bytes in slots of `slot_bytes`.
    pub fn create(path: &Path, capacity: u64, slot_bytes: u64, opts: &ArenaOptions) -> Result<Self, ArenaError> {
        Ok(Self {
            store: HostArena::create(path, capacity, slot_bytes, opts)?,
            index: Mutex::new(Index::default()),
        })
    }

    pub fn slots(&self) -> u32 {
        self.store.slots()
    }

    /// Whether evicted keys were lost because nobody took them in time.
    pub fn evicted_overflow(&self) -> bool {
        self.index.lock().overflow
    }

    /// Takes a free slot, evicting the least recently used idle object when none is free.
    fn alloc(&self, idx: &mut Index) -> Option<SlotId> {
        if let Some(s) = self.store.alloc() {
            return Some(s);
        }
        let victim = idx
            .lru
            .iter()
            .find(|(_, k)| idx.entries.get(*k).is_some_and(|e| e.readers == 0))
            .map(|(&t, k)| (t, k.clone()))?;
        idx.lru.remove(&victim.0);
        let e = idx.entries.remove(&victim.1).expect("lru and entries agree");
        idx.used_bytes -= e.len as u64;
        if idx.evicted.len() >= EVICTED_LOG_MAX {
            idx.evicted.remove(0);
            idx.overflow = true;
        }
        idx.evicted.push(victim.1);
        Some(e.slot)
    }

    fn unlink(&self, idx: &mut Index, key: &str) -> Option<()> {
        let e = idx.entries.remove(key)?;
        idx.lru.remove(&e.tick);
        idx.used_bytes -= e.len as u64;
        if e.readers > 0 {
            idx.draining.push((e.slot, e.readers));
        } else {
            self.store.free(e.slot);
        }
        Some(())
    }

    fn put_one(&self, key: &str, data: &[u8]) -> Result<(), PoolError> {
        if data.len() > self.store.slot_bytes() {
            return Err(PoolError::TooLarge {
                len: data.len(),
                max: self.store.slot_bytes(),
            });
        }
        let slot = {
            let mut idx = self.index.lock();
            self.alloc(&mut idx).ok_or(PoolError::NoSpace)?
        };
        // SAFETY: the slot is ours: allocated above and not yet published in the index.
        unsafe { self.store.slot_mut(slot, data.len()) }
            .map_err(|e| PoolError::Unavailable(e.to_string()))?
            .copy_from_slice(data);
        let mut idx = self.index.lock();
        self.unlink(&mut idx, key);
        idx.tick += 1;
        let tick = idx.tick;
        idx.lru.insert(tick, key.to_owned());
        idx.used_bytes += data.len() as u64;
        idx.entries.insert(
            key.to_owned(),
            Entry {
                slot,
                len: data.len(),
                tick,
                readers: 0,
            },
        );
        Ok(())
    }

    fn get_one(&self, key: &str, buf: &mut [u8]) -> Result<usize, PoolError> {
        let (slot, len) = {
            let mut idx = self.index.lock();
            idx.tick += 1;
            let tick = idx.tick;
            let e = idx.entries.get_mut(key).ok_or(PoolError::NotFound)?;
            if buf.len() < e.len {
                return Err(PoolError::BufferTooSmall {
                    got: buf.len(),
                    need: e.len,
                });
            }
            let old = std::mem::replace(&mut e.tick, tick);
            e.readers += 1;
            let (slot, len) = (e.slot, e.len);
            idx.lru.remove(&old);
            idx.lru.insert(tick, key.to_owned());
            (slot, len)
        };
        // SAFETY: the slot is fenced by our reader count: not freed or reused until we
        // drop it below, and puts never write a published slot.
        let res = unsafe { self.store.slot(slot, len) }.map(|src| buf[..len].copy_from_slice(src));
        let mut idx = self.index.lock();
        match idx.entries.get_mut(key).filter(|e| e.slot == slot) {
            Some(e) => e.readers -= 1,
            None => {
                // The object was removed or replaced while we read: finish draining.
                if let Some(pos) = idx.draining.iter().position(|(s, _)| *s == slot) {
                    idx.draining[pos].1 -= 1;
                    if idx.draining[pos].1 == 0 {
                        idx.draining.swap_remove(pos);
                        self.store.free(slot);
                    }
                }
            }
        }
        res.map(|_| len).map_err(|e| PoolError::Unavailable(e.to_string()))
    }
}

impl PoolBackend for LocalPool {
    fn name(&self) -> &'static str {
        "local"
    }

    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        items.iter().map(|(k, d)| self.put_one(k, d)).collect()
    }

    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        items.iter_mut().map(|(k, b)| self.get_one(k, b)).collect()
    }

    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        let idx = self.index.lock();
        keys.iter().map(|k| Ok(idx.entries.contains_key(*k))).collect()
    }

    fn remove(&self, key: &str, _force: bool) -> Result<(), PoolError> {
        let mut idx = self.index.lock();
        self.unlink(&mut idx, key).ok_or(PoolError::NotFound)
    }

    fn health(&self) -> PoolHealth {
        PoolHealth::Ok
    }

    fn usage(&self) -> PoolUsage {
        let idx = self.index.lock();
        PoolUsage {
            capacity_bytes: self.store.slots() as u64 * self.store.slot_bytes() as u64,
            used_bytes: idx.used_bytes,
            objects: idx.entries.len() as u64,
        }
    }

    fn take_evicted(&self) -> Vec<String> {
        let mut idx = self.index.lock();
        idx.overflow = false;
        std::mem::take(&mut idx.evicted)
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
