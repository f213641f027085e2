//! The grant table: stores and loads in progress, and read leases on host pages.
//!
//! A grant records the host slots a store reserved or a load leased, so `commit_store`,
//! `finish_load` and `abort` can settle exactly what was taken. A lease counts readers of
//! a page's host slots (loads, pool writes, host reads): eviction skips a leased page and
//! never frees its slots. The table has its own lock, taken after the directory's when
//! both are needed, so a lease is checked or taken in the same critical section as the
//! completeness it relies on.

use std::collections::HashMap;

use super::Manager;
use crate::directory::{IdMap, PageId};
use crate::page::NamespaceId;
use crate::tier::host::SlotId;

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
    /// A load of objects the rank holds a replica of but does not write (the MLA latent
    /// on a TP rank other than 0): leased and copied like a load, recorded on no tier.
    ReplicaLoad,
}

#[derive(Clone, Debug)]
pub(crate) struct GrantPage {
    /// Position of the page in the request.
    pub req_index: usize,
    pub page: PageId,
    /// (object index, slot) pairs.
    pub objects: Vec<(usize, SlotId)>,
}

/// A read lease on one page's host slots, held by a caller that reads them outside every
/// lock. Dropping it gives the lease back (taking the grants lock), so an early return or
/// an error between the lease and the end of the read cannot leak it. Never drop one while
/// holding the grants lock or a lock ranked after it.
#[must_use = "the lease is given back when this drops"]
pub(crate) struct HostLease<'m> {
    m: &'m Manager,
    page: PageId,
}

impl Drop for HostLease<'_> {
    fn drop(&mut self) {
        self.m.grants().unlease(self.page);
    }
}

/// Open grants and leases.
#[derive(Debug)]
pub(crate) struct GrantTable {
    pub grants: HashMap<u64, Grant>,
    next_grant: u64,
    /// Readers of a page's host slots, by record index.
    leases: IdMap<u32, u32>,
}

impl Default for GrantTable {
    fn default() -> Self {
        Self {
            grants: HashMap::new(),
            next_grant: 1,
            leases: IdMap::default(),
        }
    }
}

impl GrantTable {
    pub fn insert(&mut self, g: Grant) -> u64 {
        let id = self.next_grant;
        self.next_grant += 1;
        self.grants.insert(id, g);
        id
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

    /// Takes a read lease on `page`'s host slots, given back when the returned guard
    /// drops. Call it in the critical section that saw the page complete in host (the
    /// directory lock held), so eviction cannot come in between.
    pub fn lease_scoped<'m>(&mut self, m: &'m Manager, page: PageId) -> HostLease<'m> {
        self.lease(page);
        HostLease { m, page }
    }

    /// Pages with at least one lease.
    pub fn leased_pages(&self) -> usize {
        self.leases.len()
    }

    /// Leases held, summed over pages.
    #[cfg(test)]
    pub fn lease_count(&self) -> u32 {
        self.leases.values().sum()
    }
}
