//! Pages other nodes wrote: discovery in a shared pool past the end of the directory.
//!
//! On a shared pool (Mooncake Store) another node's page is a hit here too, but this
//! node's directory knows only the pages it wrote or saw. When a lookup or a load runs past
//! what the directory holds on device or host, [`PoolDiscovery::discover`] asks the pool, in one
//! batched existence query, for every object of each candidate page (TP × PP × K/V, or the
//! MLA latents) and counts a page only when all of them exist. Found pages enter the
//! directory as pool-complete (one `stored` event each, like any pool page), so Load,
//! Prefetch, Share and the publishers treat them alike; pages the directory credited to the
//! pool that the store no longer has are dropped (`removed`), so gone objects earn no credit.
//!
//! Bounded: only the part of the prefix that device and host do not cover is asked about, at
//! most [`RemoteConfig::budget_pages`] pages per lookup, and answers are cached for a short
//! while ([`RemoteConfig::positive_ttl_ms`], [`RemoteConfig::negative_ttl_ms`]). The query
//! runs with no manager lock held; the cache has its own lock ([`Rank::Remote`]), taken
//! alone, or inside the directory's while a lookup's entries are settled. While the pool is not healthy (master unreachable) nothing gets pool credit.
//!
//! With a pool index ([`PoolDiscovery::set_index`], [`crate::pool::index`]) in sync, the
//! window is answered from the index instead: no query and no cache. Pages this node wrote
//! stay the directory's to judge; pages found in the pool follow the index.
//!
//! The answer comes first: a lookup's credit needs no directory write, and one answered
//! on the daemon's connection task leaves the directory's entries for after its reply
//! ([`settle`]).

mod report;
pub(super) mod settle;

pub use report::PoolReport;
pub use settle::settle_lookups;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::Mutex;
use serde::Serialize;

use super::locks::{Ordered, Rank};
use super::pages::Pages;
use super::state::DirState;
use super::{Manager, ManagerConfig, Stores};
use crate::clock::Clock;
use crate::directory::shared::LookupFile;
use crate::layout::Layout;
use crate::page::KeyScheme;
use crate::page::{NamespaceId, PageHash};
#[cfg(feature = "daemon")]
use crate::pool::PoolError;
use crate::pool::index::table::PoolTable;
use crate::pool::index::{IndexMode, PoolIndex};
use crate::pool::{KeyBatch, PoolHealth};
use crate::tier::TierKind;
use crate::wire::PrefixHit;

/// Bounded caches keyed by engine-given hashes (foldhash, seeded per process). Past
/// their capacity, quick_cache's S3-FIFO evicts one entry per insert: entries asked about
/// once leave first, and a scan of new pages does not flush the ones lookups keep hitting.
pub(super) type PageMap<V> =
    quick_cache::unsync::Cache<(NamespaceId, PageHash), V, quick_cache::UnitWeighter, foldhash::quality::RandomState>;

/// A [`PageMap`] holding at most `cap` entries. Its table grows with use: a daemon whose
/// lookups never reach a pool allocates next to nothing.
pub(super) fn page_map<V>(cap: usize) -> PageMap<V> {
    let options = quick_cache::OptionsBuilder::new()
        .estimated_items_capacity(cap.clamp(1, 1024))
        .weight_capacity(cap.max(1) as u64)
        .build()
        .expect("an items estimate and a weight capacity are all the options need");
    PageMap::with_options(
        options,
        quick_cache::UnitWeighter,
        foldhash::quality::RandomState::default(),
        Default::default(),
    )
}

/// Discovery tunables. Every field has a documented default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteConfig {
    /// Most pages one lookup or load asks the pool about. Default: 256.
    pub budget_pages: usize,
    /// How long "all objects exist" is believed without asking again, in ms. Default: 2000.
    pub positive_ttl_ms: u64,
    /// How long "not complete in the pool" is believed, in ms. Default: 500.
    pub negative_ttl_ms: u64,
    /// Most cached answers (and, apart, most pages remembered as found in the pool); past
    /// it, one entry is evicted per insert (S3-FIFO, see [`PageMap`]). Default: 262,144.
    pub cache_entries: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            budget_pages: 256,
            positive_ttl_ms: 2_000,
            negative_ttl_ms: 500,
            cache_entries: 1 << 18,
        }
    }
}

/// Where a pool page came from, as `kvtier pages` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolOrigin {
    /// This node wrote it (or it was recovered here).
    WrittenHere,
    /// Another node wrote it; this node found it with an existence query.
    FoundInPool,
}

/// Discovery counters, for `/metrics` and `kvtier status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RemoteSnapshot {
    /// Batched existence queries sent to the pool.
    pub exists_queries: u64,
    /// Object keys those queries named.
    pub exists_keys: u64,
    /// Time spent in them, in nanoseconds.
    pub exists_ns: u64,
    /// Queries that failed (pool unreachable): no credit was given.
    pub exists_failed: u64,
    /// Candidate pages answered from the cache / that needed the pool.
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Pages found in the pool that this node did not know (entered the directory).
    pub found_pages: u64,
    /// Pages credited to the pool in lookups that were found there, not written here.
    pub remote_hit_pages: u64,
    /// Pool pages dropped because the store no longer had all their objects.
    pub vanished_pages: u64,
    /// Pool gets that answered "not found".
    pub get_not_found: u64,
    /// Lookups that got no pool credit because the pool was unhealthy.
    pub unhealthy_lookups: u64,
}

#[derive(Default)]
struct Counters {
    exists_queries: AtomicU64,
    exists_keys: AtomicU64,
    exists_ns: AtomicU64,
    exists_failed: AtomicU64,
    cache_hits: AtomicU64,
    cache_misses: AtomicU64,
    found_pages: AtomicU64,
    remote_hit_pages: AtomicU64,
    vanished_pages: AtomicU64,
    get_not_found: AtomicU64,
    unhealthy_lookups: AtomicU64,
}

/// Cached answers and the origin of pages found in the pool. Guarded by [`Rank::Remote`].
pub(super) struct Cache {
    /// (namespace, page) → (complete in the pool, expires at ms).
    answers: PageMap<(bool, u64)>,
    /// Pages this node found in the pool rather than wrote (bounded like `answers`).
    found: PageMap<u64>,
    /// Directory work of lookups answered on a connection task, not done yet (bounded: 64
    /// lookups, see `settle`).
    pending: Vec<settle::Settle>,
}

impl Cache {
    fn new(cap: usize) -> Self {
        Self {
            answers: page_map(cap),
            found: page_map(cap),
            pending: Vec::new(),
        }
    }
}

/// Discovery state: configuration, cache, counters, and the pool index once the daemon
/// sets one ([`PoolDiscovery::set_index`]).
pub(crate) struct Remote {
    cfg: RemoteConfig,
    cache: Mutex<Cache>,
    n: Counters,
    index: std::sync::OnceLock<Arc<PoolIndex>>,
    /// Whether `Cache::pending` holds work (read without the cache's lock).
    pending: AtomicBool,
    /// The lookup file's pool page table, handed to the index when one is set.
    table: Mutex<Option<PoolTable>>,
    /// The lookup file, whose pool health word lookups here keep current.
    lookup: Option<Arc<LookupFile>>,
}

impl Remote {
    pub(crate) fn new(cfg: RemoteConfig, table: Option<PoolTable>, lookup: Option<Arc<LookupFile>>) -> Self {
        Self {
            table: Mutex::new(table),
            lookup,
            cfg,
            cache: Mutex::new(Cache::new(cfg.cache_entries)),
            n: Counters::default(),
            index: std::sync::OnceLock::new(),
            pending: AtomicBool::new(false),
        }
    }

    fn snapshot(&self) -> RemoteSnapshot {
        let n = &self.n;
        RemoteSnapshot {
            exists_queries: n.exists_queries.load(Relaxed),
            exists_keys: n.exists_keys.load(Relaxed),
            exists_ns: n.exists_ns.load(Relaxed),
            exists_failed: n.exists_failed.load(Relaxed),
            cache_hits: n.cache_hits.load(Relaxed),
            cache_misses: n.cache_misses.load(Relaxed),
            found_pages: n.found_pages.load(Relaxed),
            remote_hit_pages: n.remote_hit_pages.load(Relaxed),
            vanished_pages: n.vanished_pages.load(Relaxed),
            get_not_found: n.get_not_found.load(Relaxed),
            unhealthy_lookups: n.unhealthy_lookups.load(Relaxed),
        }
    }
}

/// A lookup's discovery between the directory's answer and the pool's: see
/// [`PoolDiscovery::plan`] and [`settle::credit`].
pub(crate) struct DiscoveryPlan {
    ns: NamespaceId,
    /// The directory's answer, before the pool.
    hit: PrefixHit,
    /// The window of candidate pages, `hashes[start..end]`.
    start: usize,
    end: usize,
    known: Vec<Known>,
    /// Per window page: known to count (`Some(true)`), known not to (`Some(false)`), or
    /// to be asked.
    answer: Vec<Option<bool>>,
    /// Window pages the query asks about, in key order.
    ask: Vec<usize>,
    per_page: usize,
    now: u64,
}

/// A window's pages as far as [`PoolDiscovery::index_plan`] walked them: what the
/// directory knows of each, whether each counts, and the objects per page.
struct Walked {
    known: Vec<Known>,
    answer: Vec<Option<bool>>,
    per_page: usize,
}

/// The lookup's namespace has no layout registered: nothing past the directory counts.
#[derive(Debug)]
struct NoLayout;

/// What the directory says about a candidate page before the pool is asked.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Complete on device or host: counts without the pool.
    Near,
    /// Credited to the pool by the directory, written here (to be confirmed).
    Pool,
    /// Credited to the pool by the directory, found there by this node: the pool judges.
    Found,
    /// Unknown here, or incomplete everywhere.
    No,
}

/// The discovery component at work: its own state ([`Remote`]: the cache, the counters,
/// the pool index) and the parts it reads and writes through their own APIs (the
/// directory, the stores, the manager's counters, the clock), borrowed for one call
/// ([`Manager::discovery`]).
pub struct PoolDiscovery<'a> {
    remote: Option<&'a Remote>,
    pages: &'a Pages,
    stores: &'a Stores,
    /// The manager's lookup counters (the daemon's lookups record theirs here).
    #[cfg(feature = "daemon")]
    stats: &'a super::Stats,
    clock: &'a dyn Clock,
    cfg: &'a ManagerConfig,
}

impl PoolDiscovery<'_> {
    /// Whether lookups and loads may ask a shared pool about pages other nodes wrote: a
    /// network round trip, bounded by the pool's op timeout.
    pub fn is_remote(&self) -> bool {
        self.remote.is_some()
    }
}

impl Manager {
    /// Discovery of pages other nodes wrote, on a shared pool (inert on any other).
    pub fn discovery(&self) -> PoolDiscovery<'_> {
        let inner = &*self.inner;
        PoolDiscovery {
            remote: inner.remote.as_ref(),
            pages: &inner.pages,
            stores: &inner.stores,
            #[cfg(feature = "daemon")]
            stats: &inner.stats,
            clock: inner.clock.as_ref(),
            cfg: &inner.cfg,
        }
    }
}

impl<'a> PoolDiscovery<'a> {
    pub(super) fn cache(&self) -> Option<Ordered<parking_lot::MutexGuard<'a, Cache>>> {
        let r = self.remote?;
        Some(Ordered::take(Rank::Remote, || r.cache.lock()))
    }

    /// Lookups past device and host are answered from `index` while it is in sync (no
    /// master query on the lookup path). Set once; `false` when the pool is not shared
    /// or an index is set already.
    pub fn set_index(&self, index: Arc<PoolIndex>) -> bool {
        let Some(r) = self.remote else { return false };
        if r.index.set(index.clone()).is_err() {
            return false;
        }
        // Engines credit pool pages from the lookup file's table from now on, kept by the
        // index for every namespace registered, now or later.
        if let Some(table) = r.table.lock().take() {
            index.publish_to(table);
            let st = self.pages.read();
            for (id, _, layout) in st.dir.namespaces() {
                index.publish_namespace(id.0, &st.keys[id.0 as usize], layout);
            }
        }
        true
    }

    /// Whether `pool` is healthy, said also in the lookup file, where engines read it.
    fn pool_healthy(&self, remote: &Remote, pool: &dyn crate::pool::PoolBackend) -> bool {
        let healthy = pool.health() == PoolHealth::Ok;
        if let Some(f) = &remote.lookup {
            f.set_pool_healthy(healthy);
        }
        healthy
    }

    /// Checks the shared pool's health, for engines that read it in the lookup file
    /// (upkeep: the daemon's lookups check it too).
    pub(super) fn refresh_pool_health(&self) {
        if let (Some(remote), Some(pool)) = (self.remote, self.stores.pool()) {
            self.pool_healthy(remote, pool.as_ref());
        }
    }

    /// Namespace `ns` was registered: the pool index keeps its pages in the lookup file.
    pub(super) fn publish_namespace(&self, ns: NamespaceId, scheme: &KeyScheme, layout: &Layout) {
        if let Some(index) = self.index() {
            index.publish_namespace(ns.0, scheme, layout);
        }
    }

    fn index(&self) -> Option<&'a Arc<PoolIndex>> {
        self.remote?.index.get()
    }

    /// Discovery counters, when the pool is shared.
    pub fn counters(&self) -> Option<RemoteSnapshot> {
        self.remote.map(Remote::snapshot)
    }

    /// Where a pool-complete page came from (`None` when it is not pool-complete).
    pub fn origin(&self, ns: NamespaceId, hash: &PageHash) -> Option<PoolOrigin> {
        self.settle_pending();
        let complete = {
            let st = self.pages.read();
            st.dir
                .find(ns, hash)
                .is_some_and(|id| st.dir.is_complete(id, TierKind::Pool))
        };
        if !complete {
            return None;
        }
        let found = self.cache().is_some_and(|c| c.found.contains_key(&(ns, *hash)));
        Some(if found {
            PoolOrigin::FoundInPool
        } else {
            PoolOrigin::WrittenHere
        })
    }

    /// A get of one of the page's objects answered "not found": forget the cached answer
    /// (the directory record is dropped by the caller, under its own lock).
    pub(crate) fn object_vanished(&self, ns: NamespaceId, hash: &PageHash) {
        if let Some(r) = self.remote {
            r.n.get_not_found.fetch_add(1, Relaxed);
        }
        if let Some(mut c) = self.cache() {
            c.answers.remove(&(ns, *hash));
            c.found.remove(&(ns, *hash));
        }
        let Some(index) = self.index() else { return };
        let keys = {
            let st = self.pages.read();
            let Ok(layout) = st.dir.layout(ns) else { return };
            st.keys[ns.0 as usize].page_keys(layout, hash)
        };
        index.forget(&keys);
    }

    /// Lookup credit on a shared pool: `hit` is the directory's answer for `hashes`. Pages
    /// past the device/host prefix are confirmed (or found) in the pool, and the directory
    /// is brought in line before this returns. No pool, or a local one: `hit` unchanged.
    pub(crate) fn discover(&self, ns: NamespaceId, hashes: &[PageHash], hit: PrefixHit) -> PrefixHit {
        // What earlier lookups left to do first, so a load sees the pages they credited.
        self.settle_pending();
        match self.plan(ns, hashes, hit) {
            Err(hit) => hit,
            Ok((d, None)) => self.apply(hashes, d, None),
            Ok((d, Some(keys))) => {
                let Some(pool) = self.stores.pool() else { return d.hit };
                crate::pool::io_guard::check("exists");
                let t = Instant::now();
                let res = pool.batch_exists(&keys.refs());
                self.apply(hashes, d, Some((res, t.elapsed())))
            }
        }
    }

    /// Discovery up to the pool's answer: what the directory and the cache say, and the
    /// keys to ask about (`None`: nothing to ask). `Err`: the final answer, with no query.
    fn plan(
        &self,
        ns: NamespaceId,
        hashes: &[PageHash],
        hit: PrefixHit,
    ) -> Result<(DiscoveryPlan, Option<KeyBatch>), PrefixHit> {
        let (Some(remote), Some(pool)) = (self.remote, self.stores.pool()) else {
            return Err(hit);
        };
        if !self.pool_healthy(remote, pool.as_ref()) {
            if hit.pool > 0 {
                remote.n.unhealthy_lookups.fetch_add(1, Relaxed);
            }
            return Err(PrefixHit { pool: 0, ..hit });
        }
        let start = hit.device + hit.host;
        let end = hashes.len().min(start + remote.cfg.budget_pages);
        if start >= end {
            return Err(hit);
        }
        let window = &hashes[start..end];
        let now = self.clock.now_ms();
        // The pool index, while in sync, answers every page here: no query, no cache.
        if let Some(index) = self.index().filter(|i| i.mode() == IndexMode::InSync) {
            match self.index_plan(index, ns, window) {
                Some(Ok(Walked {
                    known,
                    answer,
                    per_page,
                })) => {
                    let d = DiscoveryPlan {
                        ns,
                        hit,
                        start,
                        end: start + known.len(),
                        known,
                        answer,
                        ask: Vec::new(),
                        per_page,
                        now,
                    };
                    return Ok((d, None));
                }
                Some(Err(NoLayout)) => return Err(hit),
                // The index lost sync meanwhile: the master's path.
                None => {}
            }
        }
        let Ok(known) = self.classify(ns, window) else {
            return Err(hit);
        };
        let mut answer: Vec<Option<bool>> = known.iter().map(|k| (*k == Known::Near).then_some(true)).collect();
        // The master's path: the layout and the key scheme, to render the query's keys with.
        let (layout, scheme) = {
            let st = self.pages.read();
            let Ok(layout) = st.dir.layout(ns).cloned() else {
                return Err(hit);
            };
            (layout, st.keys[ns.0 as usize].clone())
        };
        let per_page = layout.object_count();
        // Cached answers; the walk stops at the first cached "no".
        {
            let Some(cache) = self.cache() else {
                return Err(hit);
            };
            for (i, h) in window.iter().enumerate() {
                if answer[i].is_some() {
                    continue;
                }
                match cache.answers.get(&(ns, *h)) {
                    Some(&(yes, until)) if until > now => {
                        remote.n.cache_hits.fetch_add(1, Relaxed);
                        answer[i] = Some(yes);
                        if !yes {
                            break;
                        }
                    }
                    _ => {
                        remote.n.cache_misses.fetch_add(1, Relaxed);
                    }
                }
            }
        }
        let cut = answer.iter().position(|a| *a == Some(false)).unwrap_or(window.len());
        let ask: Vec<usize> = (0..cut).filter(|&i| answer[i].is_none()).collect();
        let keys = (!ask.is_empty()).then(|| {
            // Every key in one buffer: a 64-page query names 256 objects.
            let mut keys = KeyBatch::with_capacity(ask.len() * per_page, scheme.key_capacity());
            for &i in &ask {
                keys.push_page(&scheme, &layout, &window[i]);
            }
            keys
        });
        let d = DiscoveryPlan {
            ns,
            hit,
            start,
            end,
            known,
            answer,
            ask,
            per_page,
            now,
        };
        Ok((d, keys))
    }

    /// Discovery from the pool's answer on: the lookup's credit, with the cache and the
    /// directory brought in line before it returns. `res` is the query's answers and how
    /// long it took (`None`: nothing was asked).
    fn apply(&self, hashes: &[PageHash], d: DiscoveryPlan, res: settle::Answers) -> PrefixHit {
        let (hit, work) = settle::credit(self, hashes, d, res);
        if work.is_some() {
            settle::settle(self, work);
        }
        hit
    }

    /// What the directory knows of each of `pages` (one read lock, the view's probes
    /// being lock-free already; nothing is cloned here): [`Self::classify_in`].
    fn classify(&self, ns: NamespaceId, pages: &[PageHash]) -> Result<Vec<Known>, NoLayout> {
        let st = self.pages.read();
        if st.dir.layout(ns).is_err() {
            return Err(NoLayout);
        }
        Ok(self.classify_in(&st, ns, pages))
    }

    /// What the directory `st` knows of each of `pages`, and of the pages it credits to
    /// the pool, which this node found there rather than wrote (the cache's `found`, whose
    /// lock nests inside the directory's).
    fn classify_in(&self, st: &DirState, ns: NamespaceId, pages: &[PageHash]) -> Vec<Known> {
        // The pages' slots load together, not one cold miss after another.
        st.dir.view().prefetch_pages(ns, pages);
        let mut known: Vec<Known> = pages
            .iter()
            .map(|h| match st.dir.find(ns, h) {
                Some(id) if st.dir.is_complete(id, TierKind::Device) || st.dir.is_complete(id, TierKind::Host) => {
                    Known::Near
                }
                Some(id) if st.dir.is_complete(id, TierKind::Pool) => Known::Pool,
                _ => Known::No,
            })
            .collect();
        if known.contains(&Known::Pool)
            && let Some(cache) = self.cache()
        {
            for (k, h) in known.iter_mut().zip(pages) {
                if *k == Known::Pool && cache.found.contains_key(&(ns, *h)) {
                    *k = Known::Found;
                }
            }
        }
        known
    }

    /// The window's answers from the directory and the pool index, up to and including
    /// the first page that does not count: what the directory knows of each page and
    /// whether it counts, and the objects per page. Pages this node wrote stay the
    /// directory's to judge (a node's own lookup may run before its own events reach its
    /// index); pages found in the pool follow the index. The window is taken in parts of
    /// growing size (4, 8, 16, …) and the walk stops after the part that holds a page that
    /// does not count, so a lookup whose first page misses classifies a few pages, not the
    /// whole window. The directory's read lock is held for the whole walk; the index's is
    /// taken per part, after the part's classification (it is a leaf: the cache's lock
    /// must not nest in it). `None` when the index lost sync meanwhile.
    fn index_plan(&self, index: &PoolIndex, ns: NamespaceId, window: &[PageHash]) -> Option<Result<Walked, NoLayout>> {
        let st = self.pages.read();
        let Ok(layout) = st.dir.layout(ns) else {
            return Some(Err(NoLayout));
        };
        let scheme = &st.keys[ns.0 as usize];
        let (mut known, mut answer) = (Vec::with_capacity(window.len()), Vec::with_capacity(window.len()));
        let mut part = 4;
        while known.len() < window.len() {
            let pages = &window[known.len()..(known.len() + part).min(window.len())];
            let k = self.classify_in(&st, ns, pages);
            let mut a: Vec<Option<bool>> = k
                .iter()
                .map(|k| matches!(k, Known::Near | Known::Pool).then_some(true))
                .collect();
            // The index's answers for the part's unanswered pages, in order, up to the
            // first page that lacks an object (it and the rest stay `false`): each page is
            // one probe by its hash, no key rendered (the namespace's key prefix and its
            // layout's objects are resolved once and remembered by the index under the
            // namespace). The first part's probe counts the lookup; later parts count only
            // their pages.
            let mut probe = if known.is_empty() {
                index.probe()?
            } else {
                index.probe_more()?
            };
            let mut present = probe.pages_named(u32::from(ns.0), scheme, layout);
            let mut open = true;
            for (a, h) in a.iter_mut().zip(pages) {
                if a.is_none() {
                    open = open && present.present(h);
                    *a = Some(open);
                }
            }
            // The index's lock goes before the next part's classification takes the cache's.
            drop(probe);
            known.extend(k);
            answer.extend(a);
            if !open {
                break;
            }
            part *= 2;
        }
        Some(Ok(Walked {
            known,
            answer,
            per_page: layout.object_count(),
        }))
    }
}

/// A lookup's first step on an async runtime (see [`PoolDiscovery::lookup_begin`]).
#[cfg(feature = "daemon")]
pub enum LookupStep {
    /// Answered without waiting on the pool.
    Done(PrefixHit),
    /// Await [`PendingLookup::answers`], then call [`PoolDiscovery::lookup_finish`].
    Query(PendingLookup),
    /// The pool's query would block a thread: run [`Manager::lookup`] off the runtime.
    Blocking,
}

/// A lookup waiting on the pool's existence answers.
#[cfg(feature = "daemon")]
pub struct PendingLookup {
    d: DiscoveryPlan,
    query: Option<crate::pool::ExistsFuture>,
    started: Instant,
}

#[cfg(feature = "daemon")]
impl PendingLookup {
    /// The pool's answers; `None` when the pool could not answer this way after all (then
    /// run [`Manager::lookup`] off the runtime). Call once.
    pub async fn answers(&mut self) -> Option<Vec<Result<bool, PoolError>>> {
        self.query.take()?.await
    }
}

#[cfg(feature = "daemon")]
impl PoolDiscovery<'_> {
    /// [`Manager::lookup`] for a caller on an async runtime that must not block: when the
    /// lookup needs the pool and the pool's query can be awaited, the query is handed back
    /// to await, with no manager lock held; [`PoolDiscovery::lookup_finish`] completes it. Either
    /// way the directory's entries for pages found in the pool are left for after the
    /// reply: call [`settle_lookups`] once it is written (the daemon does once the
    /// connection is idle, or before its next request).
    pub fn lookup_begin(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<LookupStep, super::ManagerError> {
        self.cfg.check_batch(hashes.len())?;
        // Planned here whatever the pool: a lookup the directory or the pool index answers
        // needs no query, so it never leaves the caller's thread. Only a query this pool
        // cannot await sends the lookup to a blocking thread (which plans it again).
        let hit = self.pages.lookup(ns, hashes)?;
        let hit = match self.plan(ns, hashes, hit) {
            Err(hit) => hit,
            Ok((d, None)) => {
                // The answer goes out first; the connection task settles the directory after.
                let (hit, work) = settle::credit(self, hashes, d, None);
                settle::defer(self, work);
                hit
            }
            Ok((d, Some(keys))) => {
                let pool = self.stores.pool().filter(|p| p.awaits_exists());
                let Some(query) = pool.and_then(|p| p.exists_async(keys)) else {
                    return Ok(LookupStep::Blocking);
                };
                return Ok(LookupStep::Query(PendingLookup {
                    d,
                    query: Some(query),
                    started: Instant::now(),
                }));
            }
        };
        self.stats.record_lookup(hashes.len(), &hit);
        Ok(LookupStep::Done(hit))
    }

    /// The daemon answered a lookup `d` after it read the request, whichever way it was
    /// answered (here, by a query, or on a blocking thread): the lookup latency histogram
    /// ([`super::StatsSnapshot::lookup_latency`]).
    pub fn lookup_served(&self, d: std::time::Duration) {
        self.stats.lookup_served(d);
    }

    /// Lookups an engine answered itself from the lookup file, as it reported them: in
    /// the lookup and hit counters, not the latency histogram.
    pub fn lookups_tallied(&self, t: &crate::wire::LookupTally) {
        self.stats.record_tally(t);
    }

    /// Completes a lookup that [`PoolDiscovery::lookup_begin`] handed back, with the same
    /// `hashes` and the pool's answers.
    pub fn lookup_finish(
        &self,
        hashes: &[PageHash],
        p: PendingLookup,
        answers: Vec<Result<bool, PoolError>>,
    ) -> PrefixHit {
        let took = p.started.elapsed();
        let (hit, work) = settle::credit(self, hashes, p.d, Some((answers, took)));
        settle::defer(self, work);
        self.stats.record_lookup(hashes.len(), &hit);
        hit
    }
}
