//! The grant table: stores and loads in progress, and read leases on host pages.
//!
//! A grant records the host slots a store reserved or a load leased, so `commit_store`,
//! `finish_load` and `abort` can settle exactly what was taken. A lease counts readers of
//! a page's host slots (loads, pool writes, host reads): eviction skips a leased page and
//! never frees its slots. The table has its own lock, taken after the directory's when
//! both are needed, so a lease is checked or taken in the same critical section as the
//! completeness it relies on.

use std::collections::HashMap;

use parking_lot::{Mutex, MutexGuard};

use super::locks::{Ordered, Rank};
use super::state::DirState;
use super::{Manager, ManagerError};
use crate::directory::{IdMap, PageId};
use crate::page::NamespaceId;
use crate::tier::TierKind;
use crate::tier::host::{HostArena, SlotId};

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
    grants: &'m Grants,
    page: PageId,
}

impl Drop for HostLease<'_> {
    fn drop(&mut self) {
        self.grants.lock().unlease(self.page);
    }
}

/// A grant taken out of the table to be settled (`commit_store`, `finish_load`). It owns
/// what the grant holds until each page is settled: a store's reserved host slots and
/// in-flight marks, a load's leases. Pages are settled from the front ([`Self::settle`]);
/// dropping it releases every page not settled yet as an abandoned grant would (a store's
/// slots freed and marks cleared, the pages left as they were; a load's leases given
/// back), so an error or early return in the middle of a settle cannot leak them. With
/// pages left, its drop takes the directory lock (stores) or the grants lock (loads):
/// declare it before the lock guards of the settle, so it drops after them.
#[must_use = "dropping it releases the grant's unsettled pages"]
pub(crate) struct Settling<'m> {
    m: &'m Manager,
    grant: Grant,
    /// Pages settled so far, from the front.
    settled: usize,
}

impl Settling<'_> {
    pub fn ns(&self) -> NamespaceId {
        self.grant.ns
    }

    pub fn kind(&self) -> GrantKind {
        self.grant.kind
    }

    /// Every page of the grant, settled or not, in grant order.
    pub fn pages(&self) -> &[GrantPage] {
        &self.grant.pages
    }

    /// The first `through` pages are settled: the caller made them present or released
    /// them, and the guard no longer touches them.
    pub fn settle(&mut self, through: usize) {
        self.settled = self.settled.max(through.min(self.grant.pages.len()));
    }
}

impl Drop for Settling<'_> {
    fn drop(&mut self) {
        let rest = &self.grant.pages[self.settled..];
        if rest.is_empty() {
            return;
        }
        match self.grant.kind {
            GrantKind::Store => {
                let Some(arena) = self.m.stores().arena() else { return };
                let mut st = self.m.write();
                for p in rest {
                    release_store_page(&mut st, &arena, p);
                }
            }
            GrantKind::Load | GrantKind::ReplicaLoad => {
                let mut gt = self.m.grants();
                for p in rest {
                    gt.unlease(p.page);
                }
            }
        }
    }
}

/// Undoes one page of a store grant: frees the slots it reserved, forgets any of them the
/// page recorded, and clears its in-flight marks, so the page is as it was before the
/// store (a record made for it alone is released with its last mark).
pub(crate) fn release_store_page(st: &mut DirState, arena: &HostArena, p: &GrantPage) {
    for &(o, s) in &p.objects {
        if st.host_slot(p.page, o) == Some(s) {
            st.set_host_slot(p.page, o, 0, None);
        }
    }
    arena.free_all(p.objects.iter().map(|&(_, s)| s));
    let objs: Vec<usize> = p.objects.iter().map(|&(o, _)| o).collect();
    // Cannot fail: the object indices come from the page's own layout.
    let _ = st.dir.set_inflight_objects(p.page, TierKind::Host, &objs, false);
}

/// Read leases on several pages' host slots (a pool write's), given back by ownership:
/// [`Self::give_back_each`] returns them one by one under the grants lock the caller
/// holds; a set dropped before that (a panic or an early return between the lease and
/// the settle) gives them all back itself, taking the grants lock, so none can leak.
/// Declare it before the settle's lock guards, so it drops after them.
#[must_use = "the leases are given back when this drops"]
pub(crate) struct Leases<'m> {
    grants: &'m Grants,
    pages: Vec<PageId>,
}

impl<'m> Leases<'m> {
    pub fn new(grants: &'m Grants) -> Self {
        Self {
            grants,
            pages: Vec::new(),
        }
    }

    /// Leases `page`. Call it in the critical section that saw the page complete on host
    /// (the directory lock held), so eviction cannot come in between.
    pub fn take(&mut self, gt: &mut GrantTable, page: PageId) {
        gt.lease(page);
        self.pages.push(page);
    }

    /// Gives the leases back in the order they were taken, calling `after` with the table
    /// once each page's lease is back (it may see the page still leased by others).
    pub fn give_back_each(mut self, gt: &mut GrantTable, mut after: impl FnMut(&GrantTable, PageId)) {
        // Taken out first: should `after` panic with the caller's lock held, the drop
        // below finds nothing to give back and does not wait on that lock.
        for page in std::mem::take(&mut self.pages) {
            gt.unlease(page);
            after(gt, page);
        }
    }
}

impl Drop for Leases<'_> {
    fn drop(&mut self) {
        if self.pages.is_empty() {
            return;
        }
        let mut gt = self.grants.lock();
        for &page in &self.pages {
            gt.unlease(page);
        }
    }
}

/// The grant table behind its own lock, of rank [`Rank::Grants`]: [`Self::lock`] is the
/// only way to take it, so the lock order is checked wherever it is taken (the manager's
/// engine calls, the mover's leases, a lease's drop).
#[derive(Debug, Default)]
pub(crate) struct Grants(Mutex<GrantTable>);

impl Grants {
    pub fn lock(&self) -> Ordered<MutexGuard<'_, GrantTable>> {
        Ordered::take(Rank::Grants, || self.0.lock())
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

    /// Takes grant `id` out of the table to settle it, if `check` accepts it; the grant
    /// stays in the table when `check` refuses it.
    pub fn take<'m>(
        &mut self,
        m: &'m Manager,
        id: u64,
        check: impl FnOnce(&Grant) -> Result<(), ManagerError>,
    ) -> Result<Settling<'m>, ManagerError> {
        check(self.grants.get(&id).ok_or(ManagerError::UnknownGrant(id))?)?;
        let grant = self.grants.remove(&id).ok_or(ManagerError::UnknownGrant(id))?;
        Ok(Settling { m, grant, settled: 0 })
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
    pub fn lease_scoped<'m>(&mut self, grants: &'m Grants, page: PageId) -> HostLease<'m> {
        self.lease(page);
        HostLease { grants, page }
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
