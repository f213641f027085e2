//! Booking the objects a reopened local pool found ([`crate::pool::PoolBackend::take_recovered`])
//! as the pages they belong to.
//!
//! A pool object's key is the namespace's key prefix, the page hash in hex and a suffix
//! naming the object (ranks and part; see [`crate::page::KeyScheme`]). Each key is matched
//! against the registered namespaces' prefixes and their layouts' object suffixes, and its
//! length against the layout's object size: an object that fits no namespace is removed
//! from the pool, never booked. One pass over the keys, a hash-map probe per key.

use std::collections::HashMap;

use super::Manager;
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;

/// What [`adopt_recovered_pool`] booked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolAdopted {
    /// Objects booked, and the pages they belong to.
    pub objects: u64,
    pub pages: u64,
    /// Objects of no registered namespace, or of another size than their layout says,
    /// removed from the pool.
    pub removed: u64,
}

struct Space {
    ns: NamespaceId,
    prefix: String,
    /// Object suffix (what follows the hash) -> (object index, bytes).
    objects: HashMap<String, (usize, usize)>,
}

fn spaces(mgr: &Manager) -> Vec<Space> {
    let probe = PageHash::from_u64(0);
    let hex = probe.to_hex();
    mgr.pages()
        .namespaces()
        .into_iter()
        .filter_map(|(ns, _, layout)| {
            let scheme = mgr.pages().key_scheme(ns).ok()?;
            let objects = scheme
                .page_keys(&layout, &probe)
                .into_iter()
                .enumerate()
                .map(|(o, k)| {
                    let suffix = k[scheme.prefix.len() + hex.len()..].to_owned();
                    (suffix, (o, layout.object_bytes(o) as usize))
                })
                .collect();
            Some(Space {
                ns,
                prefix: scheme.prefix,
                objects,
            })
        })
        .collect()
}

/// The page and object a pool key names in one of `spaces`, when its length fits.
fn parse(spaces: &[Space], key: &str, len: usize) -> Option<(NamespaceId, PageHash, usize)> {
    spaces.iter().find_map(|s| {
        let rest = key.strip_prefix(s.prefix.as_str())?;
        let cut = rest.find('_')?;
        let (&(o, bytes), hash) = (s.objects.get(&rest[cut..])?, PageHash::from_hex(&rest[..cut]).ok()?);
        (bytes == len).then_some((s.ns, hash, o))
    })
}

/// Books the pool's recovered objects (once; later calls find none) as pool objects of
/// their pages in the registered namespaces, and removes the rest from the pool. Run it
/// once the namespaces of the earlier life are registered.
pub fn adopt_recovered_pool(mgr: &Manager) -> PoolAdopted {
    let mut out = PoolAdopted::default();
    let Some(pool) = mgr.stores().pool() else { return out };
    let found = pool.take_recovered();
    if found.is_empty() {
        return out;
    }
    let spaces = spaces(mgr);
    let mut pages: HashMap<(NamespaceId, PageHash), (Vec<usize>, Vec<String>)> = HashMap::new();
    let mut unknown = Vec::new();
    for (key, len) in found {
        match parse(&spaces, &key, len) {
            Some((ns, hash, o)) => {
                let page = pages.entry((ns, hash)).or_default();
                page.0.push(o);
                page.1.push(key);
            }
            None => unknown.push(key),
        }
    }
    {
        let mut st = mgr.write();
        for ((ns, hash), (objs, keys)) in pages {
            match st.dir.find_or_insert(ns, &hash) {
                // Every object index comes from this namespace's own layout.
                Ok(id) if st.dir.set_objects(id, TierKind::Pool, &objs, true).is_ok() => {
                    out.objects += objs.len() as u64;
                    out.pages += 1;
                }
                // The directory is full: the objects cannot be booked.
                _ => unknown.extend(keys),
            }
        }
    }
    for key in &unknown {
        let _ = pool.remove(key, false);
    }
    out.removed = unknown.len() as u64;
    tracing::info!(
        pages = out.pages,
        objects = out.objects,
        removed = out.removed,
        "local pool objects booked after a restart"
    );
    out
}
