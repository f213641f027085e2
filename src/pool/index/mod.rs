//! A local index of a shared pool's objects, fed by Store/Remove events.
//!
//! On a Mooncake Store shared by a cluster, every node's lookups used to ask the master,
//! in one batched existence query per lookup, whether each candidate page's objects exist.
//! The index keeps, on this node, which objects the pool holds, learned from the pool's
//! Store/Remove events (its peers' kvtier object event streams, or a master that publishes
//! its own, in Mooncake's format: see [`events`]) and from a full listing of the store at
//! start and after any loss of sync (a resync, see [`sync`]).
//!
//! The index is keyed by page ([`pages`]): each event's object key is split into its key
//! prefix (namespace, layout fingerprint, tag), page hash and object suffix (ranks, K/V),
//! and the page's entry records which of its objects are present. A lookup resolves the
//! namespace's prefix and its layout's objects (TP × PP × K/V, or MLA latents, from the
//! namespace's [`KeyScheme`] and [`Layout`](crate::layout::Layout)) once, then probes
//! once per page with the engine's page hash, rendering no key; a page counts only when
//! every object of the layout is present. So a page is credited only when all its objects
//! are present, for every namespace, layout and key format alike, and a page missing one
//! rank's objects never is.
//!
//! Consistency: the index answers only while [`IndexMode::InSync`]. A gap in an event
//! stream's sequence, a publisher that restarted, a `cleared` event, a master that went
//! away or restarted, or a listing past [`PoolIndex::max_keys`] makes it
//! [`IndexMode::Syncing`] until a resync completes; meanwhile lookups fall back to the
//! master query (the existence path of [`crate::manager::RemoteConfig`]). Events that arrive
//! during a resync are journalled and replayed over the listing, so none is lost to the
//! race between the listing and the stream. A load that finds an object gone (an eviction
//! the master made, of which no peer published anything) returns fewer pages and removes
//! the page's keys here ([`PoolIndex::forget`]).
//!
//! [`KeyScheme`]: crate::page::KeyScheme

#[cfg(feature = "daemon")]
pub mod events;
mod pages;
#[cfg(feature = "daemon")]
pub mod sync;
pub mod table;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::RwLock;
use serde::Serialize;

use self::pages::{Objects, PageSet};
use self::table::PoolTable;
use crate::layout::Layout;
use crate::page::{KeyScheme, PageHash};

/// Whether the index may answer lookups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexMode {
    /// Not (or no longer) known to match the store: lookups fall back to the master.
    Syncing,
    /// Matches the store as of the last event: lookups are answered here.
    InSync,
}

/// The index's state and counters, for `kvtier status` and `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexSnapshot {
    /// `in_sync`, or `syncing` (lookups fall back to the master).
    pub mode: Option<IndexMode>,
    /// Why the index last lost sync (empty when it never did).
    pub last_loss: String,
    /// Object keys the index holds, and the pages they belong to.
    pub keys: u64,
    pub pages: u64,
    /// Store/Remove object events applied (or journalled during a resync).
    pub events: u64,
    /// Times the index lost sync (sequence gaps, restarts, unreachable master, overflow).
    pub sync_losses: u64,
    /// Resyncs completed, and the last one's listing size and time.
    pub resyncs: u64,
    pub resync_failures: u64,
    pub last_resync_keys: u64,
    pub last_resync_us: u64,
    /// Lookups answered from the index (no master query), and the pages they probed (up to
    /// the first page that lacks an object).
    pub index_lookups: u64,
    pub index_pages: u64,
    /// Pages whose keys were dropped because a get found an object gone.
    pub forgotten_pages: u64,
    /// (Namespace, page) entries of the lookup file's pool page table: the pool pages
    /// engines credit in their own lookups, with no request to the daemon.
    pub engine_pages: u64,
}

struct State {
    keys: PageSet,
    mode: IndexMode,
    last_loss: String,
    /// Events that arrived during a resync, replayed over its listing (`None`: no resync
    /// under way).
    journal: Option<Journal>,
    /// The lookup file's pool page table, kept with `keys` (see [`table`]).
    published: Option<Published>,
}

/// The pool page table and the namespaces it is kept for.
struct Published {
    table: PoolTable,
    namespaces: Vec<Publishing>,
}

/// A namespace whose complete pages go in the table: its key scheme and layout, and
/// their resolution in the current key set once it has one ([`PageSet::query`]).
struct Publishing {
    ns: u16,
    scheme: KeyScheme,
    layout: Layout,
    want: Option<(u32, Objects)>,
}

impl Published {
    /// Resolves `n` in `keys` if it is not yet, entering every complete page of it when
    /// it now resolves.
    fn resolve(table: &mut PoolTable, n: &mut Publishing, keys: &PageSet) {
        if n.want.is_some() {
            return;
        }
        let Some((prefix, want)) = keys.query(&n.scheme, &n.layout) else {
            return;
        };
        for (hash, objects) in keys.pages_of(prefix) {
            if objects.covers(&want) {
                table.set(n.ns, hash, true);
            }
        }
        n.want = Some((prefix, want));
    }

    /// Object `key` changed in `keys`: its page's entry for every namespace of its prefix.
    fn changed(&mut self, keys: &PageSet, key: &str) {
        let Some((prefix, hash, _)) = pages::split(key) else {
            return;
        };
        for n in &mut self.namespaces {
            if n.scheme.prefix != prefix {
                continue;
            }
            match &n.want {
                Some((p, want)) => self.table.set(n.ns, &hash, keys.covers(*p, &hash, want)),
                None => Self::resolve(&mut self.table, n, keys),
            }
        }
    }

    /// `keys` replaced the set: the table is rebuilt from it.
    fn rebuild(&mut self, keys: &PageSet) {
        self.table.clear();
        for n in &mut self.namespaces {
            n.want = None;
            Self::resolve(&mut self.table, n, keys);
        }
    }
}

impl State {
    /// The index may not match the store: engines stop trusting the pool page table.
    fn unpublish(&mut self) {
        if let Some(p) = &self.published {
            p.table.publish_mode(false);
        }
    }
}

/// The most bytes of keys a resync's journal holds; past it (or past `max_keys` entries)
/// the resync is abandoned and another wanted, as for a listing too large.
const JOURNAL_MAX_BYTES: usize = 64 << 20;

/// Events journalled during a resync, and their keys' bytes.
#[derive(Default)]
struct Journal {
    events: Vec<(bool, Box<str>)>,
    bytes: usize,
}

impl Journal {
    /// Journals an event; `false` when that would pass a bound.
    fn push(&mut self, stored: bool, key: &str, max_keys: usize) -> bool {
        if self.events.len() >= max_keys || self.bytes + key.len() > JOURNAL_MAX_BYTES {
            return false;
        }
        self.bytes += key.len();
        self.events.push((stored, key.into()));
        true
    }
}

/// The pages a shared pool holds, and which of their objects, as this node knows it.
pub struct PoolIndex {
    state: RwLock<State>,
    max_keys: usize,
    resync_wanted: AtomicBool,
    events: AtomicU64,
    sync_losses: AtomicU64,
    resyncs: AtomicU64,
    resync_failures: AtomicU64,
    last_resync_keys: AtomicU64,
    last_resync_us: AtomicU64,
    index_lookups: AtomicU64,
    index_pages: AtomicU64,
    forgotten_pages: AtomicU64,
}

impl PoolIndex {
    /// An empty index that holds at most `max_keys` keys; it starts [`IndexMode::Syncing`]
    /// with a resync wanted (the pool may already hold objects).
    pub fn new(max_keys: usize) -> Self {
        Self {
            state: RwLock::new(State {
                keys: PageSet::default(),
                mode: IndexMode::Syncing,
                last_loss: String::new(),
                journal: None,
                published: None,
            }),
            max_keys: max_keys.max(1),
            resync_wanted: AtomicBool::new(true),
            events: AtomicU64::new(0),
            sync_losses: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            resync_failures: AtomicU64::new(0),
            last_resync_keys: AtomicU64::new(0),
            last_resync_us: AtomicU64::new(0),
            index_lookups: AtomicU64::new(0),
            index_pages: AtomicU64::new(0),
            forgotten_pages: AtomicU64::new(0),
        }
    }

    /// Most keys the index holds; past it the index loses sync (lookups fall back).
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    pub fn mode(&self) -> IndexMode {
        self.state.read().mode
    }

    /// One Store (`stored = true`) or Remove event of object `key`.
    pub fn apply(&self, stored: bool, key: &str) {
        self.events.fetch_add(1, Relaxed);
        let mut st = self.state.write();
        if let Some(j) = st.journal.as_mut() {
            // A key that is no page's object is not held, so not journalled either.
            if pages::split(key).is_none() || j.push(stored, key, self.max_keys) {
                return;
            }
            // A dropped event would leave the listing's replay wrong: resync again.
            drop(st);
            self.lose_sync("events during a resync past mooncake.index_max_keys or the journal's bytes");
            return;
        }
        if stored {
            let full = st.keys.len() >= self.max_keys && !st.keys.contains(key);
            if full || st.keys.insert(key).is_err() {
                drop(st);
                self.lose_sync("index full (mooncake.index_max_keys)");
                return;
            }
        } else {
            st.keys.remove(key);
        }
        let State { keys, published, .. } = &mut *st;
        if let Some(p) = published {
            p.changed(keys, key);
        }
    }

    /// Keeps `table` (the lookup file's pool page table) from now on, for the namespaces
    /// [`Self::publish_namespace`] names.
    pub fn publish_to(&self, table: PoolTable) {
        let mut st = self.state.write();
        let mut p = Published {
            table,
            namespaces: Vec::new(),
        };
        p.rebuild(&st.keys);
        p.table
            .publish_mode(st.mode == IndexMode::InSync && st.journal.is_none());
        st.published = Some(p);
    }

    /// Namespace `ns` (its key scheme and layout fixed) has its complete pages in the
    /// table from now on. Naming one twice changes nothing.
    pub fn publish_namespace(&self, ns: u16, scheme: &KeyScheme, layout: &Layout) {
        let mut st = self.state.write();
        let State { keys, published, .. } = &mut *st;
        let Some(p) = published else { return };
        if p.namespaces.iter().any(|n| n.ns == ns) {
            return;
        }
        let mut n = Publishing {
            ns,
            scheme: scheme.clone(),
            layout: layout.clone(),
            want: None,
        };
        Published::resolve(&mut p.table, &mut n, keys);
        p.namespaces.push(n);
    }

    /// The index may no longer match the store: stop answering until a resync completes.
    pub fn lose_sync(&self, why: &str) {
        let mut st = self.state.write();
        if st.mode == IndexMode::InSync || st.journal.is_some() {
            self.sync_losses.fetch_add(1, Relaxed);
            tracing::warn!(
                reason = why,
                "pool index lost sync; lookups ask the master until it resyncs"
            );
        }
        st.mode = IndexMode::Syncing;
        st.journal = None;
        st.last_loss = why.to_owned();
        st.unpublish();
        self.resync_wanted.store(true, Relaxed);
    }

    /// Whether a resync is wanted (taken: the caller runs it).
    pub fn take_resync_wanted(&self) -> bool {
        self.resync_wanted.swap(false, Relaxed)
    }

    /// A resync starts: events from here on are journalled until [`Self::finish_resync`].
    pub fn begin_resync(&self) {
        let mut st = self.state.write();
        st.mode = IndexMode::Syncing;
        st.journal = Some(Journal::default());
        st.unpublish();
    }

    /// The store's listing, taken after [`Self::begin_resync`]: it replaces the index, the
    /// journalled events are replayed over it, and the index is in sync again. `false`
    /// (still syncing) when sync was lost meanwhile or the listing is too large.
    pub fn finish_resync(&self, listing: impl IntoIterator<Item = String>, started: Instant) -> bool {
        let mut keys = PageSet::default();
        for k in listing {
            if keys.len() >= self.max_keys || keys.insert(&k).is_err() {
                self.resync_failures.fetch_add(1, Relaxed);
                self.lose_sync("store listing larger than mooncake.index_max_keys");
                return false;
            }
        }
        let mut st = self.state.write();
        let Some(journal) = st.journal.take() else {
            // Sync was lost during the listing: another resync is already wanted.
            self.resync_failures.fetch_add(1, Relaxed);
            return false;
        };
        for (stored, k) in journal.events {
            if stored {
                // Past the bound the next event loses sync; the journal is bounded too.
                let _ = keys.insert(&k);
            } else {
                keys.remove(&k);
            }
        }
        let n = keys.len() as u64;
        st.keys = keys;
        st.mode = IndexMode::InSync;
        let State { keys, published, .. } = &mut *st;
        if let Some(p) = published {
            p.rebuild(keys);
            p.table.publish_mode(true);
        }
        drop(st);
        self.resyncs.fetch_add(1, Relaxed);
        self.last_resync_keys.store(n, Relaxed);
        self.last_resync_us
            .store(started.elapsed().as_micros().min(u64::MAX as u128) as u64, Relaxed);
        tracing::info!(keys = n, "pool index in sync");
        true
    }

    /// A resync that could not list the store; another is wanted.
    pub fn fail_resync(&self, why: &str) {
        self.resync_failures.fetch_add(1, Relaxed);
        let mut st = self.state.write();
        st.journal = None;
        st.mode = IndexMode::Syncing;
        st.last_loss = why.to_owned();
        st.unpublish();
        self.resync_wanted.store(true, Relaxed);
    }

    /// Per page of `keys` (`per_page` keys each, in page order): whether every object of
    /// the page is present. Stops after the first page that is not (the rest are `false`).
    /// `None` while not in sync. Lookups probe by page ([`Self::probe`]); this per-key
    /// answer stays as the tests' reference for it.
    #[cfg(test)]
    pub fn pages_present(&self, keys: &super::KeyBatch, per_page: usize) -> Option<Vec<bool>> {
        let st = self.state.read();
        if st.mode != IndexMode::InSync || per_page == 0 {
            return None;
        }
        let pages = keys.len() / per_page;
        let mut out = vec![false; pages];
        for (p, slot) in out.iter_mut().enumerate() {
            let all = (p * per_page..(p + 1) * per_page).all(|i| st.keys.contains(keys.get(i)));
            if !all {
                break;
            }
            *slot = true;
        }
        drop(st);
        self.index_lookups.fetch_add(1, Relaxed);
        self.index_pages.fetch_add(pages as u64, Relaxed);
        Some(out)
    }

    /// A read view for one lookup, `None` while not in sync (the caller falls back to the
    /// master). The caller resolves its namespace once ([`IndexProbe::pages`]) and asks
    /// [`PageProbe::present`] page by page, stopping at the first page that is not.
    /// The view holds the index's read lock: probe, and drop it.
    pub fn probe(&self) -> Option<IndexProbe<'_>> {
        self.probe_counting(true)
    }

    /// [`Self::probe`] for a later part of a lookup that an earlier probe began: its
    /// pages count, the lookup does not count again.
    pub fn probe_more(&self) -> Option<IndexProbe<'_>> {
        self.probe_counting(false)
    }

    fn probe_counting(&self, lookup: bool) -> Option<IndexProbe<'_>> {
        let st = self.state.read();
        (st.mode == IndexMode::InSync).then_some(IndexProbe {
            st,
            index: self,
            lookup,
            pages: 0,
        })
    }

    /// Whether every one of `keys` is in the index (whatever its mode).
    pub fn contains_all(&self, keys: &[String]) -> bool {
        let st = self.state.read();
        keys.iter().all(|k| st.keys.contains(k.as_str()))
    }

    /// A get found one of a page's objects gone: none of `keys` is believed present now.
    pub fn forget(&self, keys: &[String]) {
        let mut st = self.state.write();
        let mut any = false;
        for k in keys {
            any |= st.keys.remove(k.as_str());
            let State { keys, published, .. } = &mut *st;
            if let Some(p) = published {
                p.changed(keys, k);
            }
        }
        if any {
            self.forgotten_pages.fetch_add(1, Relaxed);
        }
        let fits = st
            .journal
            .as_mut()
            .is_none_or(|j| keys.iter().all(|k| j.push(false, k, self.max_keys)));
        if !fits {
            drop(st);
            self.lose_sync("forgotten keys during a resync past the journal's bounds");
        }
    }

    pub fn snapshot(&self) -> IndexSnapshot {
        let st = self.state.read();
        IndexSnapshot {
            mode: Some(st.mode),
            last_loss: st.last_loss.clone(),
            keys: st.keys.len() as u64,
            pages: st.keys.pages() as u64,
            events: self.events.load(Relaxed),
            sync_losses: self.sync_losses.load(Relaxed),
            resyncs: self.resyncs.load(Relaxed),
            resync_failures: self.resync_failures.load(Relaxed),
            last_resync_keys: self.last_resync_keys.load(Relaxed),
            last_resync_us: self.last_resync_us.load(Relaxed),
            index_lookups: self.index_lookups.load(Relaxed),
            index_pages: self.index_pages.load(Relaxed),
            forgotten_pages: self.forgotten_pages.load(Relaxed),
            engine_pages: st.published.as_ref().map_or(0, |p| p.table.len() as u64),
        }
    }
}

/// One lookup's view of an in-sync index (see [`PoolIndex::probe`]); counts as one index
/// lookup of the pages it was asked about when dropped.
pub struct IndexProbe<'a> {
    st: parking_lot::RwLockReadGuard<'a, State>,
    index: &'a PoolIndex,
    /// Whether dropping it counts a lookup ([`PoolIndex::probe_more`]: no).
    lookup: bool,
    pages: u64,
}

impl<'a> IndexProbe<'a> {
    /// The probe for pages of `layout` under `scheme`: the scheme's key prefix and the
    /// layout's objects are resolved here, once, so each page is one probe.
    pub fn pages<'p>(&'p mut self, scheme: &KeyScheme, layout: &Layout) -> PageProbe<'p, 'a> {
        let want = self.st.keys.query(scheme, layout);
        PageProbe { probe: self, want }
    }

    /// [`Self::pages`], with the resolution remembered under `name`, the caller's name for
    /// the (scheme, layout) pair: it must never name another pair with it (a namespace's
    /// id does, its scheme and layout being fixed once registered). After a namespace's
    /// first lookup no key is rendered.
    pub fn pages_named<'p>(&'p mut self, name: u32, scheme: &KeyScheme, layout: &Layout) -> PageProbe<'p, 'a> {
        let want = self.st.keys.query_named(name, scheme, layout);
        PageProbe { probe: self, want }
    }
}

/// An [`IndexProbe`] resolved for one namespace and layout ([`IndexProbe::pages`]).
pub struct PageProbe<'p, 'a> {
    probe: &'p mut IndexProbe<'a>,
    /// The prefix's id and the layout's objects; `None` when no page can be present.
    want: Option<(u32, Objects)>,
}

impl PageProbe<'_, '_> {
    /// Whether every object of page `hash` is present.
    pub fn present(&mut self, hash: &PageHash) -> bool {
        self.probe.pages += 1;
        let Some((prefix, want)) = &self.want else { return false };
        self.probe.st.keys.covers(*prefix, hash, want)
    }
}

impl Drop for IndexProbe<'_> {
    fn drop(&mut self) {
        self.index.index_lookups.fetch_add(u64::from(self.lookup), Relaxed);
        self.index.index_pages.fetch_add(self.pages, Relaxed);
    }
}

#[cfg(test)]
mod tests;
