//! The manager's locked state: the directory plus what each tier needs beside it (host
//! slot maps, read leases, pins, retains, open grants, deferred hints, device advice).

use std::collections::{HashMap, HashSet, VecDeque};

use serde::Serialize;

use super::config::Tunables;
use crate::directory::{Directory, PageId};
use crate::hints::Hint;
use crate::page::{KeyScheme, NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::tier::host::SlotId;

/// No slot for this object.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// Most deferred hints and advice entries kept; beyond that the oldest advice is dropped
/// (advice is a hint to the engine, re-derived on the next tick) and new hints are
/// answered `ignored: queue_full`.
pub(crate) const MAX_DEFERRED: usize = 4096;
pub(crate) const MAX_ADVICE: usize = 4096;

/// Something the engine should do, because kvtier cannot touch device memory itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "advice", rename_all = "snake_case")]
pub enum Advice {
    /// Evict these device pages first (they have a complete colder copy).
    EvictFirst { ns: NamespaceId, hashes: Vec<PageHash> },
    /// Store these device pages to host (a demote or share needs a host copy first).
    Offload { ns: NamespaceId, hashes: Vec<PageHash> },
    /// These pages are staged in host and ready to load (a prefetch to device).
    ReadyToLoad { ns: NamespaceId, hashes: Vec<PageHash> },
}

impl Advice {
    pub fn ns(&self) -> NamespaceId {
        match self {
            Advice::EvictFirst { ns, .. } | Advice::Offload { ns, .. } | Advice::ReadyToLoad { ns, .. } => *ns,
        }
    }

    pub fn hashes(&self) -> &[PageHash] {
        match self {
            Advice::EvictFirst { hashes, .. } | Advice::Offload { hashes, .. } | Advice::ReadyToLoad { hashes, .. } => {
                hashes
            }
        }
    }

    /// Keeps the first `at` pages and returns the rest as advice of the same kind.
    pub(crate) fn split_off(&mut self, at: usize) -> Advice {
        match self {
            Advice::EvictFirst { ns, hashes } => Advice::EvictFirst {
                ns: *ns,
                hashes: hashes.split_off(at),
            },
            Advice::Offload { ns, hashes } => Advice::Offload {
                ns: *ns,
                hashes: hashes.split_off(at),
            },
            Advice::ReadyToLoad { ns, hashes } => Advice::ReadyToLoad {
                ns: *ns,
                hashes: hashes.split_off(at),
            },
        }
    }
}

/// A store or load in progress: the slots it reserved or leased.
#[derive(Debug)]
pub(crate) struct Grant {
    pub ns: NamespaceId,
    pub kind: GrantKind,
    pub pages: Vec<GrantPage>,
    /// Connection or caller that owns it (0: in-process), so a dead client's grants can
    /// be reclaimed.
    pub owner: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GrantKind {
    Store,
    Load,
}

#[derive(Clone, Debug)]
pub(crate) struct GrantPage {
    /// Position of the page in the request.
    pub req_index: usize,
    pub page: PageId,
    /// (object index, slot) pairs.
    pub objects: Vec<(usize, SlotId)>,
}

#[derive(Debug)]
pub(crate) struct State {
    pub dir: Directory,
    pub tun: Tunables,
    pub keys: Vec<KeyScheme>,
    /// Host slot of every object of a page that has any object on host.
    pub host: HashMap<u32, Box<[u32]>>,
    /// Readers of a page's host slots (loads and pool writes in progress).
    pub leases: HashMap<u32, u32>,
    /// (page, tier) → (expiry ms, hash) of pins.
    pub pins: HashMap<(u32, u8), (u64, PageHash)>,
    /// page → (expiry ms, hash) of retain priorities.
    pub retains: HashMap<u32, (u64, PageHash)>,
    pub grants: HashMap<u64, Grant>,
    pub next_grant: u64,
    pub deferred: VecDeque<(NamespaceId, Hint)>,
    pub advice: VecDeque<Advice>,
    /// Device pages per namespace (sum over one rank's region), when known.
    pub device_pages: HashMap<NamespaceId, usize>,
    /// Session ids interned to the index pages carry (0: no session).
    pub sessions: HashMap<String, u32>,
    /// Sessions that are paused or acting: their pages are evicted first.
    pub idle_sessions: HashSet<u32>,
}

impl State {
    pub fn new(dir: Directory, tun: Tunables) -> Self {
        Self {
            dir,
            tun,
            keys: Vec::new(),
            host: HashMap::new(),
            leases: HashMap::new(),
            pins: HashMap::new(),
            retains: HashMap::new(),
            grants: HashMap::new(),
            next_grant: 1,
            deferred: VecDeque::new(),
            advice: VecDeque::new(),
            device_pages: HashMap::new(),
            sessions: HashMap::new(),
            idle_sessions: HashSet::new(),
        }
    }

    pub fn host_slot(&self, page: PageId, obj: usize) -> Option<SlotId> {
        self.host
            .get(&page.0)
            .and_then(|s| s.get(obj).copied())
            .filter(|&s| s != NO_SLOT)
            .map(SlotId)
    }

    pub fn set_host_slot(&mut self, page: PageId, obj: usize, count: usize, slot: Option<SlotId>) {
        let slots = self
            .host
            .entry(page.0)
            .or_insert_with(|| vec![NO_SLOT; count].into_boxed_slice());
        slots[obj] = slot.map_or(NO_SLOT, |s| s.0);
        if slots.iter().all(|&s| s == NO_SLOT) {
            self.host.remove(&page.0);
        }
    }

    pub fn leased(&self, page: PageId) -> bool {
        self.leases.get(&page.0).is_some_and(|&n| n > 0)
    }

    pub fn lease(&mut self, page: PageId) {
        *self.leases.entry(page.0).or_default() += 1;
    }

    pub fn unlease(&mut self, page: PageId) {
        if let Some(n) = self.leases.get_mut(&page.0) {
            *n -= 1;
            if *n == 0 {
                self.leases.remove(&page.0);
            }
        }
    }

    pub fn pins_in(&self, tier: TierKind) -> usize {
        self.pins.keys().filter(|(_, t)| *t == tier as u8).count()
    }

    pub fn push_advice(&mut self, a: Advice) {
        if self.advice.len() >= MAX_ADVICE {
            self.advice.pop_front();
        }
        self.advice.push_back(a);
    }

    /// Takes namespace `ns`'s advice, oldest first, up to `max_pages` page hashes in all;
    /// an entry that does not fit is split and its rest kept first in line. Other
    /// namespaces' advice stays. Returns the advice and whether more of `ns`'s is left.
    pub fn take_advice_for(&mut self, ns: NamespaceId, max_pages: usize) -> (Vec<Advice>, bool) {
        let mut budget = max_pages;
        let mut taken = Vec::new();
        let mut more = false;
        let mut kept = VecDeque::with_capacity(self.advice.len());
        for mut a in self.advice.drain(..) {
            if a.ns() != ns {
                kept.push_back(a);
            } else if a.hashes().is_empty() {
                // Advice about no page says nothing: dropped.
            } else if budget == 0 {
                more = true;
                kept.push_back(a);
            } else {
                if a.hashes().len() > budget {
                    kept.push_back(a.split_off(budget));
                    more = true;
                }
                budget -= a.hashes().len();
                taken.push(a);
            }
        }
        self.advice = kept;
        (taken, more)
    }

    pub fn new_grant(&mut self, g: Grant) -> u64 {
        let id = self.next_grant;
        self.next_grant += 1;
        self.grants.insert(id, g);
        id
    }

    /// The live page with this id and hash, if the id still names it.
    pub fn same_page(&self, page: PageId, hash: &PageHash, ns: NamespaceId) -> bool {
        self.dir.find(ns, hash) == Some(page)
    }
}
