//! The index's contents, keyed by page: one entry per (key prefix, page hash), holding
//! which of the page's objects the pool has.
//!
//! Every object key kvtier renders (and SGLang HiCache's, see [`crate::pool::keys`]) is
//! `{prefix}{page hash in lowercase hex}{suffix}`, where the prefix is empty or ends in
//! `_`, and the suffix is one to three `_`-separated fields of at most five characters
//! (ranks and the K/V part: `_1_v`, `_0_1_k`, `__k`). So an event's key splits, with no
//! knowledge of its namespace or layout, at the rightmost field long enough to be a page
//! hash ([`split`]); prefixes and suffixes are interned as small integers, and a page's
//! objects are a bit set over its suffixes. A key that does not split that way is no
//! page's object: no lookup can ask for it, and the index does not hold it.
//!
//! A lookup then probes once per page, with the page hash as the engine gave it: the
//! namespace's prefix and the layout's suffixes are resolved once per lookup
//! ([`PageSet::query`]), and a page counts when its entry has every one of them. A key
//! the layout renders is present here exactly when it was stored and not removed since:
//! the split of a rendered key gives back the scheme's prefix, the hash and the object's
//! suffix, so the answer is the same as probing every rendered key, without rendering any.

use std::collections::HashMap;

use crate::layout::Layout;
use crate::page::{KeyScheme, MAX_HASH_BYTES, MIN_HASH_BYTES, PageHash};

type Map<K, V> = HashMap<K, V, foldhash::quality::RandomState>;

/// The longest field a key's suffix has (a rank of up to five digits).
const SUFFIX_FIELD: usize = 5;
/// The most fields a suffix has (`_{tp}_{pp}_{k|v}`).
const SUFFIX_FIELDS: usize = 3;
/// Most distinct prefixes (namespaces × layouts × tags) the index interns; past it the
/// index is full (it loses sync, and a resync starts from empty tables).
const MAX_PREFIXES: usize = 1 << 16;
/// Most bytes of distinct prefixes the index interns: prefixes come from peers' events,
/// and a key may be up to [`super::events::MAX_KEY_BYTES`] long.
const MAX_PREFIX_BYTES: usize = 16 << 20;
/// Most distinct suffixes (objects per page across every layout).
const MAX_SUFFIXES: usize = 1 << 12;

/// Splits an object key into its prefix, page hash and suffix (see the module docs);
/// `None` for a key that is no page's object. The hash must be canonical lowercase hex,
/// as kvtier renders it, so a key spelled differently never stands for a rendered one.
pub(super) fn split(key: &str) -> Option<(&str, PageHash, &str)> {
    let mut end = key.len();
    for _ in 0..=SUFFIX_FIELDS {
        let start = key[..end].rfind('_').map_or(0, |i| i + 1);
        let field = &key[start..end];
        if field.len() > SUFFIX_FIELD {
            let hex_ok = (2 * MIN_HASH_BYTES..=2 * MAX_HASH_BYTES).contains(&field.len())
                && field.len().is_multiple_of(2)
                && field.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            if !hex_ok || end == key.len() {
                return None;
            }
            let hash = PageHash::from_hex(field).ok()?;
            return Some((&key[..start], hash, &key[end..]));
        }
        if start == 0 {
            return None;
        }
        end = start - 1;
    }
    None
}

/// Which of a page's objects are present: a bit per interned suffix (the first 128 in a
/// word, the rest listed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Objects {
    low: u128,
    more: Vec<u16>,
}

impl Objects {
    /// Sets object `id`; `true` when it was not set.
    fn set(&mut self, id: u16) -> bool {
        if id < 128 {
            let was = self.low & (1 << id) != 0;
            self.low |= 1 << id;
            return !was;
        }
        match self.more.binary_search(&id) {
            Ok(_) => false,
            Err(at) => {
                self.more.insert(at, id);
                true
            }
        }
    }

    /// Clears object `id`; `true` when it was set.
    fn clear(&mut self, id: u16) -> bool {
        if id < 128 {
            let was = self.low & (1 << id) != 0;
            self.low &= !(1 << id);
            return was;
        }
        match self.more.binary_search(&id) {
            Ok(at) => {
                self.more.remove(at);
                true
            }
            Err(_) => false,
        }
    }

    fn has(&self, id: u16) -> bool {
        if id < 128 {
            self.low & (1 << id) != 0
        } else {
            self.more.binary_search(&id).is_ok()
        }
    }

    fn is_empty(&self) -> bool {
        self.low == 0 && self.more.is_empty()
    }

    /// Whether every object of `want` is set here.
    pub(super) fn covers(&self, want: &Objects) -> bool {
        self.low & want.low == want.low && want.more.iter().all(|&id| self.has(id))
    }
}

/// The index's table is full (see [`MAX_PREFIXES`], [`MAX_SUFFIXES`]).
#[derive(Debug)]
pub(super) struct Full;

/// The pages the pool holds, and which of their objects.
#[derive(Default)]
pub(super) struct PageSet {
    prefixes: Map<Box<str>, u32>,
    suffixes: Map<Box<str>, u16>,
    pages: Map<(u32, PageHash), Objects>,
    /// Bytes of the interned prefixes.
    prefix_bytes: usize,
    /// Object keys held (set bits over every page).
    objects: usize,
    /// [`Self::query`]'s answers by the caller's name for its (scheme, layout) pair, so a
    /// lookup renders no key (see [`Self::query_named`]). Interned ids never change while
    /// this set lives (a resync starts a new one), so a remembered answer stays right; a
    /// `None` is not remembered, since a later store may intern what it lacked. A leaf
    /// lock: taken under the index's read lock, nothing under it.
    queries: parking_lot::Mutex<Map<u32, (u32, Objects)>>,
}

impl PageSet {
    /// Object keys held.
    pub(super) fn len(&self) -> usize {
        self.objects
    }

    /// Pages with at least one object held.
    pub(super) fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Whether object `key` is held (`false` for a key that is no page's object).
    pub(super) fn contains(&self, key: &str) -> bool {
        let Some((prefix, hash, suffix)) = split(key) else {
            return false;
        };
        let (Some(&p), Some(&s)) = (self.prefixes.get(prefix), self.suffixes.get(suffix)) else {
            return false;
        };
        self.pages.get(&(p, hash)).is_some_and(|o| o.has(s))
    }

    /// Records object `key` as stored; `Ok(false)` when it was held already or is no
    /// page's object.
    pub(super) fn insert(&mut self, key: &str) -> Result<bool, Full> {
        let Some((prefix, hash, suffix)) = split(key) else {
            return Ok(false);
        };
        let p = intern(
            &mut self.prefixes,
            prefix,
            MAX_PREFIXES,
            &mut self.prefix_bytes,
            MAX_PREFIX_BYTES,
        )?;
        let s = intern(&mut self.suffixes, suffix, MAX_SUFFIXES, &mut 0, usize::MAX)?;
        let new = self.pages.entry((p, hash)).or_default().set(s);
        self.objects += usize::from(new);
        Ok(new)
    }

    /// Records object `key` as removed; `true` when it was held.
    pub(super) fn remove(&mut self, key: &str) -> bool {
        let Some((prefix, hash, suffix)) = split(key) else {
            return false;
        };
        let (Some(&p), Some(&s)) = (self.prefixes.get(prefix), self.suffixes.get(suffix)) else {
            return false;
        };
        let Some(o) = self.pages.get_mut(&(p, hash)) else {
            return false;
        };
        let was = o.clear(s);
        if o.is_empty() {
            self.pages.remove(&(p, hash));
        }
        self.objects -= usize::from(was);
        was
    }

    /// What a page of `layout` under `scheme` needs to count: the scheme's prefix and the
    /// layout's suffixes, resolved once for a lookup's pages. `None` when no page of it
    /// can be present (the prefix or one of the suffixes was never stored).
    pub(super) fn query(&self, scheme: &KeyScheme, layout: &Layout) -> Option<(u32, Objects)> {
        let prefix = *self.prefixes.get(scheme.prefix.as_str())?;
        // The suffixes as the scheme renders them, split off a sample page's keys with the
        // same split the events go through (any hash: the suffix does not depend on it).
        let mut want = Objects::default();
        for key in scheme.page_keys(layout, &PageHash::from_u64(0)) {
            let (_, _, suffix) = split(&key)?;
            want.set(*self.suffixes.get(suffix)?);
        }
        Some((prefix, want))
    }

    /// [`Self::query`], remembered under `name`: the caller's name for the pair, which it
    /// must never give to another (scheme, layout) pair (the manager passes the namespace,
    /// whose scheme and layout are fixed once registered). The first lookup of a
    /// namespace renders a sample page's keys; every later one is a map probe.
    pub(super) fn query_named(&self, name: u32, scheme: &KeyScheme, layout: &Layout) -> Option<(u32, Objects)> {
        if let Some(q) = self.queries.lock().get(&name) {
            return Some(q.clone());
        }
        let q = self.query(scheme, layout)?;
        self.queries.lock().insert(name, q.clone());
        Some(q)
    }

    /// The pages under `prefix` and their objects (a namespace newly resolved).
    pub(super) fn pages_of(&self, prefix: u32) -> impl Iterator<Item = (&PageHash, &Objects)> {
        self.pages
            .iter()
            .filter(move |((p, _), _)| *p == prefix)
            .map(|((_, h), o)| (h, o))
    }

    /// Whether page `hash` under `prefix` has every object of `want` ([`Self::query`]).
    pub(super) fn covers(&self, prefix: u32, hash: &PageHash, want: &Objects) -> bool {
        self.pages.get(&(prefix, *hash)).is_some_and(|o| o.covers(want))
    }
}

/// `s`'s id in `map`, given the next one when new: at most `cap` entries of at most
/// `max_bytes` together (`bytes` keeps the sum).
fn intern<T: TryFrom<usize> + Copy>(
    map: &mut Map<Box<str>, T>,
    s: &str,
    cap: usize,
    bytes: &mut usize,
    max_bytes: usize,
) -> Result<T, Full> {
    if let Some(&id) = map.get(s) {
        return Ok(id);
    }
    if map.len() >= cap || bytes.saturating_add(s.len()) > max_bytes {
        return Err(Full);
    }
    let id = T::try_from(map.len()).map_err(|_| Full)?;
    map.insert(s.into(), id);
    *bytes += s.len();
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutSpec;

    #[test]
    fn rendered_keys_split_into_their_scheme_prefix_hash_and_suffix() {
        let h = PageHash::new(&[0xab; 32]).unwrap();
        let specs = [
            LayoutSpec::mha(2, 2, 8, 2, 16).with_parallel(2, 1),
            LayoutSpec::mha(2, 4, 8, 2, 16).with_parallel(4, 2),
            LayoutSpec::mla(2, 8, 2, 16),
            LayoutSpec::mla(2, 8, 2, 16).with_parallel(1, 2),
        ];
        for scheme in [
            KeyScheme::default(),
            KeyScheme::with_prefix("kvtier", "org-m_deadbeefdeadbeef"),
        ] {
            for spec in &specs {
                let layout = spec.clone().build().unwrap();
                for key in scheme.page_keys(&layout, &h) {
                    let (p, got, s) = split(&key).unwrap_or_else(|| panic!("{key}"));
                    assert_eq!((p, got), (scheme.prefix.as_str(), h), "{key}");
                    assert_eq!(format!("{p}{}{s}", h.to_hex()), key);
                }
            }
        }
        for bad in [
            "a",
            "k1",
            "x_0123456789abcdef",          // no suffix
            "x_0123456789ABCDEF_0_k",      // not canonical hex
            "x_0123456789abcde_0_k",       // odd length
            "x_0123456789abcdef_123456_k", // a field too long for a rank
            "x_0123456789abcdef_1_2_3_k",  // four suffix fields
        ] {
            assert!(split(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_page_counts_only_with_every_object_of_the_layout() {
        let tp2 = LayoutSpec::mha(2, 2, 8, 2, 16).with_parallel(2, 1).build().unwrap();
        let tp1 = LayoutSpec::mha(2, 2, 8, 2, 16).build().unwrap();
        let scheme = KeyScheme::with_prefix("t", "m");
        let h = PageHash::from_u64(7);
        let keys = scheme.page_keys(&tp2, &h);
        let mut set = PageSet::default();
        assert!(set.query(&scheme, &tp2).is_none(), "nothing stored under the prefix");
        for k in &keys[..3] {
            assert!(set.insert(k).unwrap());
        }
        assert!(!set.insert(&keys[0]).unwrap(), "a second store of a key adds nothing");
        assert_eq!(set.query(&scheme, &tp2), None, "rank 1's V was never stored");
        // TP=1's objects (rank 0's K and V) are all there, but that is another layout.
        let (p, want) = set.query(&scheme, &tp1).unwrap();
        assert!(set.covers(p, &h, &want));
        set.insert(&keys[3]).unwrap();
        let (p, want) = set.query(&scheme, &tp2).unwrap();
        assert!(set.covers(p, &h, &want));
        assert!(!set.covers(p, &PageHash::from_u64(8), &want));
        assert_eq!((set.len(), set.pages()), (4, 1));
        assert!(set.remove(&keys[1]) && !set.remove(&keys[1]));
        assert!(!set.covers(p, &h, &want) && !set.contains(&keys[1]) && set.contains(&keys[2]));
        for k in &keys {
            set.remove(k);
        }
        assert_eq!((set.len(), set.pages()), (0, 0));
    }

    #[test]
    fn interned_prefixes_are_bounded_by_bytes_as_well_as_count() {
        let mut set = PageSet::default();
        let long = "p".repeat(60 << 10);
        let h = PageHash::from_u64(1).to_hex();
        let mut held = 0;
        let full = (0..1000).find(|i| {
            let key = format!("{long}{i}_{h}_0_k");
            match set.insert(&key) {
                Ok(new) => {
                    assert!(new);
                    held += 1;
                    false
                }
                Err(Full) => true,
            }
        });
        // 16 MiB of 60 KiB prefixes: 273 of them, then full; a held prefix still takes keys.
        assert_eq!((full, held), (Some(273), 273));
        assert!(set.prefix_bytes <= MAX_PREFIX_BYTES);
        assert!(set.insert(&format!("{long}0_{h}_1_v")).unwrap());
    }

    #[test]
    fn objects_past_the_first_word_are_counted() {
        let mut o = Objects::default();
        let mut want = Objects::default();
        for id in [0, 127, 128, 300] {
            assert!(o.set(id));
            want.set(id);
        }
        assert!(o.covers(&want));
        assert!(o.clear(300) && !o.clear(300));
        assert!(!o.covers(&want));
    }
}
