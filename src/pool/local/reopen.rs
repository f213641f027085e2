//! Reopening the local pool after a restart: the pool file keeps its bytes, and the slot
//! table says which object each slot holds. A record that checks out was written after
//! its object's bytes (the table's commit order, see `slots`), so the objects are indexed
//! again without reading them. One pass over the slot records: the cost is constant per
//! slot, whatever the objects' sizes.

use std::collections::HashMap;
use std::path::Path;

use parking_lot::Mutex;

use super::index::{Index, key_hash};
use super::slots::{Found, Opened, SlotTable};
use super::{LocalPool, slot_table_path};
use crate::tier::host::{ArenaError, ArenaOptions, HostArena, SlotId};

/// What [`LocalPool::open`] found of an earlier life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reopened {
    /// Objects indexed again.
    pub objects: u64,
    /// Records cut short by the end of the earlier life (a failed header checksum):
    /// dropped, as their objects' puts had not completed.
    pub torn: u64,
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
        let Some(Opened { mut table, found, torn }) =
            SlotTable::open(&table_path, store.slots(), slot_bytes).map_err(io)?
        else {
            return Ok(None);
        };
        let mut out = Reopened {
            torn,
            ..Reopened::default()
        };
        let mut best: HashMap<String, Found> = HashMap::with_capacity(found.len());
        for f in found {
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
            let _ = index.restore(f.key.clone(), key_hash(&f.key), SlotId(f.slot), f.len);
        }
        index.attach(table);
        let used: Vec<SlotId> = live.iter().map(|f| SlotId(f.slot)).collect();
        store.reset_free(&used);
        out.objects = live.len() as u64;
        tracing::info!(
            path = %path.display(),
            objects = out.objects,
            torn = out.torn,
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
    fn a_reopened_pool_serves_what_it_held_and_drops_torn_records() {
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
        // A record cut short (its key changed after its checksum was taken) is dropped
        // and counted; the other eight objects are served.
        let table = slot_table_path(&path);
        let mut bytes = std::fs::read(&table).unwrap();
        let first = 64 + 32;
        bytes[first] ^= 1;
        std::fs::write(&table, &bytes).unwrap();
        let (p, found) = LocalPool::open(&path, 8 * 4096, 4096, &opts, true).unwrap();
        assert_eq!((found.objects, found.torn), (7, 1));
        assert_eq!(p.usage().objects, 7);
        assert_eq!(p.take_recovered().len(), 7);
        drop(p);
        // Another geometry starts empty.
        let (p, found) = LocalPool::open(&path, 16 * 4096, 4096, &opts, true).unwrap();
        assert_eq!((found, p.slots()), (Reopened::default(), 16));
    }

    /// The crash test's pool at `path`, as the writer and the reader after a kill open it.
    fn open_crash_pool(path: &std::path::Path) -> (LocalPool, Reopened) {
        LocalPool::open(
            path,
            CRASH_SLOTS * CRASH_OBJ as u64,
            CRASH_OBJ as u64,
            &ArenaOptions::default(),
            true,
        )
        .unwrap()
    }

    /// The crash test's writer, in a child process (the test binary run again for this
    /// test alone): with `KVTIER_TEST_POOL_WRITER` set to a directory, it puts numbered
    /// generations of objects into the pool there forever, printing each generation once
    /// published. Without it, it returns at once.
    #[test]
    fn crash_writer() {
        let Some(dir) = std::env::var_os(WRITER_ENV) else {
            return;
        };
        let path = std::path::Path::new(&dir).join("pool");
        let (p, _) = open_crash_pool(&path);
        // Every object made up front, so that the writer spends its time putting and a
        // kill lands mid-put as often as it can.
        let made: Vec<Vec<Vec<u8>>> = (0..CRASH_KEYS)
            .map(|k| (0..VERSIONS).map(|v| crash_object(k, v)).collect())
            .collect();
        let keys: Vec<String> = (0..CRASH_KEYS).map(|k| format!("k{k}")).collect();
        let mut out = std::io::stdout().lock();
        for generation in 1u64.. {
            let items: Vec<(&str, &[u8])> = (0..CRASH_BATCH)
                .map(|i| {
                    let k = ((generation * CRASH_BATCH + i) % CRASH_KEYS) as usize;
                    (keys[k].as_str(), &made[k][(generation % VERSIONS) as usize][..])
                })
                .collect();
            assert!(p.batch_put_from(&items).iter().all(Result::is_ok));
            use std::io::Write;
            let _ = writeln!(out, "generation {generation}");
            let _ = out.flush();
        }
    }

    const WRITER_ENV: &str = "KVTIER_TEST_POOL_WRITER";
    const CRASH_SLOTS: u64 = 16;
    const CRASH_KEYS: u64 = 24;
    const CRASH_OBJ: usize = 256 << 10;
    const CRASH_BATCH: u64 = 8;
    const KILLS: u64 = 16;
    /// Versions of each key's object; a put writes the next one over the key.
    const VERSIONS: u64 = 3;

    /// Key `k`'s object of `version`: the version, then a pattern of both, so that any
    /// mix of two puts' bytes shows.
    fn crash_object(k: u64, version: u64) -> Vec<u8> {
        let mut v = pattern(version << 8 | k, CRASH_OBJ);
        v[..8].copy_from_slice(&version.to_le_bytes());
        v
    }

    /// SIGKILLs a writer at varied points of its puts, again and again, and reopens the
    /// pool each time: every object found must be whole, one put's bytes, since a record
    /// is written only after its bytes (published before them, a kill mid-copy would
    /// leave a record over a slot holding part of an older object).
    #[test]
    fn a_pool_killed_mid_put_reopens_with_only_whole_objects() {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool");
        let exe = std::env::current_exe().unwrap();
        let (mut checked, mut last_generation) = (0u64, 0u64);
        for round in 0..KILLS {
            let mut child = Command::new(&exe)
                .args([
                    "--exact",
                    "pool::local::reopen::tests::crash_writer",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(WRITER_ENV, dir.path())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
            // Kill after a varied number of published generations: the kill lands in
            // whatever the writer does next (reserving, copying, publishing).
            let target = 2 + round * 3;
            let mut seen = 0;
            for line in lines {
                let line = line.unwrap();
                if let Some(g) = line.strip_prefix("generation ") {
                    last_generation = last_generation.max(g.parse().unwrap());
                    seen += 1;
                    if seen >= target {
                        break;
                    }
                }
            }
            let _ = child.kill();
            let status = child.wait().unwrap();
            assert!(seen >= target, "the writer stopped early: {status}");
            let (p, found) = open_crash_pool(&path);
            let keys = p.take_recovered();
            assert!(found.objects > 0 && keys.len() as u64 == found.objects, "{found:?}");
            for (key, len) in keys {
                assert_eq!(len, CRASH_OBJ, "{key}");
                let k: u64 = key[1..].parse().unwrap();
                let mut buf = vec![0u8; CRASH_OBJ];
                assert_eq!(p.batch_get_into(&mut [(&key, &mut buf[..])]), vec![Ok(CRASH_OBJ)]);
                let version = u64::from_le_bytes(buf[..8].try_into().unwrap());
                assert!(version < VERSIONS, "{key}: version {version}");
                assert!(
                    buf == crash_object(k, version),
                    "{key}: not one put's bytes (version {version}, round {round})"
                );
                checked += 1;
            }
        }
        eprintln!(
            "crash test: {checked} recovered objects checked whole over {KILLS} kills, last generation seen {last_generation}"
        );
    }
}
