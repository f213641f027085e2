//! Reopening the local pool after a restart: the pool file keeps its bytes, the slot
//! table says which object each slot holds, and every object is checked against the
//! checksum its record keeps before it is indexed again. One pass over the slots: the
//! cost is constant per slot plus the hash of each object's bytes.

use std::collections::HashMap;
use std::path::Path;

use parking_lot::Mutex;

use super::index::{Index, key_hash};
use super::slots::{Found, SlotTable, object_sum};
use super::{LocalPool, slot_table_path};
use crate::tier::host::{ArenaError, ArenaOptions, HostArena, SlotId};

/// What [`LocalPool::open`] found of an earlier life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reopened {
    /// Objects indexed again.
    pub objects: u64,
    /// Records whose object's bytes did not match their checksum (dropped).
    pub corrupt: u64,
    /// Older records of a key that a later record replaced (a crash mid-replace).
    pub superseded: u64,
}

impl LocalPool {
    /// The pool at `path`: with `recover`, the earlier pool there with its objects when
    /// its file and slot table are the daemon's own and of this geometry (`capacity`,
    /// `slot_bytes`); otherwise, or when they are not, a fresh one ([`LocalPool::create`]).
    /// The objects found are handed to the manager once ([`crate::pool::PoolBackend::take_recovered`]).
    pub fn open(
        path: &Path,
        capacity: u64,
        slot_bytes: u64,
        opts: &ArenaOptions,
        recover: bool,
    ) -> Result<(Self, Reopened), ArenaError> {
        if recover && std::fs::symlink_metadata(path).is_ok() {
            match Self::reopen(path, capacity, slot_bytes, opts) {
                Ok(Some(found)) => return Ok(found),
                Ok(None) => {
                    tracing::info!(path = %path.display(), "the local pool's slot table is missing or of another geometry; the pool starts empty")
                }
                Err(e) => tracing::warn!(error = %e, "the local pool cannot be reopened; it starts empty"),
            }
        }
        Ok((Self::create(path, capacity, slot_bytes, opts)?, Reopened::default()))
    }

    fn reopen(
        path: &Path,
        capacity: u64,
        slot_bytes: u64,
        opts: &ArenaOptions,
    ) -> Result<Option<(Self, Reopened)>, ArenaError> {
        let r = HostArena::reopen(path, capacity, slot_bytes, opts)?;
        let store = r.arena;
        if r.found_bytes != store.len_bytes() {
            return Ok(None);
        }
        let table_path = slot_table_path(path);
        let io = |source| ArenaError::Io {
            path: table_path.clone(),
            source,
        };
        let Some((mut table, found)) = SlotTable::open(&table_path, store.slots(), slot_bytes).map_err(io)? else {
            return Ok(None);
        };
        let mut out = Reopened::default();
        let mut best: HashMap<String, Found> = HashMap::with_capacity(found.len());
        for f in found {
            // SAFETY: nothing else maps the pool file (it is the daemon's private file and
            // the daemon is starting); the slot and length were checked by the table.
            let intact = unsafe { store.slot(SlotId(f.slot), f.len) }.is_ok_and(|b| object_sum(b) == f.sum);
            if !intact {
                out.corrupt += 1;
                table.clear(f.slot);
                continue;
            }
            match best.get(&f.key) {
                Some(b) if b.seq > f.seq => {
                    out.superseded += 1;
                    table.clear(f.slot);
                }
                _ => {
                    if let Some(old) = best.insert(f.key.clone(), f) {
                        out.superseded += 1;
                        table.clear(old.slot);
                    }
                }
            }
        }
        let mut live: Vec<Found> = best.into_values().collect();
        // The least recently put first: the LRU order of the earlier life, as far as puts go.
        live.sort_unstable_by_key(|f| f.seq);
        let mut index = Index::new(store.slots());
        for f in &live {
            let _ = index.restore(&f.key, key_hash(&f.key), SlotId(f.slot), f.len);
        }
        index.attach(table);
        let used: Vec<SlotId> = live.iter().map(|f| SlotId(f.slot)).collect();
        store.reset_free(&used);
        out.objects = live.len() as u64;
        tracing::info!(
            path = %path.display(),
            objects = out.objects,
            corrupt = out.corrupt,
            superseded = out.superseded,
            "local pool reopened"
        );
        let keys = live.into_iter().map(|f| (f.key, f.len)).collect();
        Ok(Some((
            Self {
                store,
                index: Mutex::new(index),
                recovered: Mutex::new(keys),
            },
            out,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{PoolBackend, PoolError};
    use crate::tier::device::pattern;

    #[test]
    fn a_reopened_pool_serves_what_it_held_and_drops_what_fails_its_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let opts = ArenaOptions::default();
        let (p, found) = LocalPool::open(&path, 8 * 4096, 4096, &opts, true).unwrap();
        assert_eq!(found, Reopened::default());
        let r = p.batch_put_from(&[
            ("a", &pattern(1, 4096)[..]),
            ("b", &pattern(2, 100)[..]),
            ("c", &pattern(3, 64)[..]),
        ]);
        assert!(r.iter().all(Result::is_ok));
        // Replaced and removed objects are not found again.
        assert!(p.batch_put_from(&[("a", &pattern(4, 4096)[..])])[0].is_ok());
        assert_eq!(p.remove("c", false), Ok(()));
        drop(p);
        // A fresh start without recovery would empty it; with recovery, a and b are back.
        let (p, found) = LocalPool::open(&path, 8 * 4096, 4096, &opts, true).unwrap();
        assert_eq!(found.objects, 2);
        let mut keys = p.take_recovered();
        keys.sort();
        assert_eq!(keys, vec![("a".to_string(), 4096), ("b".into(), 100)]);
        assert!(p.take_recovered().is_empty(), "handed over once");
        let (mut ba, mut bb) = (vec![0u8; 4096], vec![0u8; 4096]);
        let got = p.batch_get_into(&mut [("a", &mut ba[..]), ("b", &mut bb[..]), ("c", &mut [0u8; 64][..])]);
        assert_eq!(got, vec![Ok(4096), Ok(100), Err(PoolError::NotFound)]);
        assert_eq!(ba, pattern(4, 4096));
        assert_eq!(&bb[..100], &pattern(2, 100)[..]);
        assert_eq!(p.usage().objects, 2);
        // Six slots are free: the recovered ones are taken.
        let six: Vec<(String, Vec<u8>)> = (0..6).map(|i| (format!("n{i}"), pattern(10 + i, 64))).collect();
        let items: Vec<(&str, &[u8])> = six.iter().map(|(k, v)| (k.as_str(), &v[..])).collect();
        assert!(p.batch_put_from(&items).iter().all(Result::is_ok));
        assert!(
            p.take_evicted().is_empty(),
            "nothing evicted: the recovered slots were not handed out"
        );
        drop(p);
        // Flip a byte of every object: all fail their checksums and none is served.
        let mut bytes = std::fs::read(&path).unwrap();
        for s in 0..8 {
            bytes[s * 4096] ^= 0xff;
        }
        std::fs::write(&path, &bytes).unwrap();
        let (p, found) = LocalPool::open(&path, 8 * 4096, 4096, &opts, true).unwrap();
        assert_eq!((found.objects, found.corrupt), (0, 8));
        assert_eq!(p.usage().objects, 0);
        drop(p);
        // Another geometry starts empty.
        let (p, found) = LocalPool::open(&path, 16 * 4096, 4096, &opts, true).unwrap();
        assert_eq!((found, p.slots()), (Reopened::default(), 16));
    }
}
