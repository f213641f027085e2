//! Page-level helpers over any [`PoolBackend`]: completeness and write-missing.
//!
//! A page is pool-complete only when every object key of its layout exists; a page with
//! one key missing is never a hit. Writers ask first and write only the missing objects,
//! so a page that another instance (or a HiCache engine) already stored is not rewritten.

use super::{PoolBackend, PoolError};

/// What [`put_missing`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageWrite {
    /// Objects written now.
    pub written: usize,
    /// Objects that already existed and were left alone.
    pub present: usize,
}

/// Which of `keys` exist; any error fails the whole answer (no partial credit).
pub fn presence(pool: &dyn PoolBackend, keys: &[&str]) -> Result<Vec<bool>, PoolError> {
    pool.batch_exists(keys).into_iter().collect()
}

/// Whether every object of a page exists. An empty key list is not a page.
pub fn is_complete(pool: &dyn PoolBackend, keys: &[&str]) -> Result<bool, PoolError> {
    Ok(!keys.is_empty() && presence(pool, keys)?.iter().all(|&p| p))
}

/// Writes the objects of a page that the pool does not have yet. `objects[i]` is the
/// bytes of `keys[i]`. Fails on the first object that could not be written.
pub fn put_missing(pool: &dyn PoolBackend, keys: &[&str], objects: &[&[u8]]) -> Result<PageWrite, PoolError> {
    if keys.len() != objects.len() {
        return Err(PoolError::Backend {
            code: -600,
            message: format!("{} keys for {} objects", keys.len(), objects.len()),
        });
    }
    let have = presence(pool, keys)?;
    let todo: Vec<(&str, &[u8])> = keys
        .iter()
        .zip(objects)
        .zip(&have)
        .filter(|(_, p)| !**p)
        .map(|((k, o), _)| (*k, *o))
        .collect();
    for r in pool.batch_put_from(&todo) {
        r?;
    }
    Ok(PageWrite {
        written: todo.len(),
        present: keys.len() - todo.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::local::LocalPool;
    use crate::tier::device::pattern;
    use crate::tier::host::ArenaOptions;

    #[test]
    fn only_missing_objects_are_written_and_partial_pages_are_not_complete() {
        let dir = tempfile::tempdir().unwrap();
        let pool = LocalPool::create(&dir.path().join("p"), 8 * 4096, 4096, &ArenaOptions::default()).unwrap();
        let keys = ["h_0_k", "h_0_v", "h_1_k", "h_1_v"];
        let objs: Vec<Vec<u8>> = (0..4).map(|i| pattern(i, 256)).collect();
        let refs: Vec<&[u8]> = objs.iter().map(Vec::as_slice).collect();
        pool.batch_put_from(&[(keys[1], refs[1])]);
        assert!(!is_complete(&pool, &keys).unwrap());
        assert_eq!(
            put_missing(&pool, &keys, &refs).unwrap(),
            PageWrite { written: 3, present: 1 }
        );
        assert!(is_complete(&pool, &keys).unwrap());
        assert_eq!(
            put_missing(&pool, &keys, &refs).unwrap(),
            PageWrite { written: 0, present: 4 }
        );
        pool.remove(keys[2], true).unwrap();
        assert!(!is_complete(&pool, &keys).unwrap());
        assert!(!is_complete(&pool, &[]).unwrap());
    }
}
