//! The engine-facing operations: store and load grants, `removed`, and the in-process
//! `store`/`load` that run the device copies on transfer workers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::state::{Grant, GrantKind, GrantPage};
use super::{Manager, ManagerError};
use crate::layout::Layout;
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::tier::device::ObjectCopy;
use crate::tier::host::SlotId;
use crate::transfer::Ticket;

/// How long a load may wait for pages that are not on host yet (HiCache's prefetch
/// policies).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum LoadWait {
    /// Take what is on host now; start staging the rest in the background.
    BestEffort,
    /// Stage pool pages to host first, however long that takes.
    WaitComplete,
    /// Stage pool pages until the deadline, then take what is ready.
    Timeout { ms: u64 },
}

/// What happened to one page of a store request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreStatus {
    /// Write the listed objects into the listed slots, then commit.
    Write,
    /// This rank's objects are already on host; nothing to write.
    AlreadyStored,
    /// No host room, even after eviction; the page is not stored.
    NoSpace,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StorePage {
    pub hash: PageHash,
    pub status: StoreStatus,
    /// (object index, host slot) to write.
    pub objects: Vec<(usize, SlotId)>,
}

/// Host slots reserved for one rank's store. Commit or abort it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreGrant {
    pub id: u64,
    /// One entry per requested page, in request order.
    pub pages: Vec<StorePage>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadPage {
    pub hash: PageHash,
    /// (object index, host slot, bytes) to read: this rank's objects.
    pub objects: Vec<(usize, SlotId, u64)>,
}

/// Leased host slots of the leading loadable pages. Finish it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadGrant {
    pub id: u64,
    /// Exactly the leading pages that are complete on host and leased: a partial
    /// prefix is never reported as a whole one.
    pub pages: Vec<LoadPage>,
}

/// The result of an in-process operation, collected by ticket.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpResult {
    /// Pages stored, or leading pages loaded.
    pub pages: usize,
    /// Pages that failed (store) or were not loadable (load).
    pub failed: usize,
    pub error: Option<String>,
}

impl Manager {
    /// Reserves host slots for the objects rank `(tp_rank, pp_rank)` holds of each page,
    /// marks them in flight, and records that the rank has the pages on device.
    pub fn begin_store(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        session: u32,
        owner: u64,
    ) -> Result<StoreGrant, ManagerError> {
        self.check_batch(hashes.len())?;
        let layout = self.layout(ns)?;
        let objs = layout
            .rank_objects(tp_rank, pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?;
        let arena = self.arena().ok_or(ManagerError::NoNamespace)?;
        // Make room before taking the lock for allocation; eviction takes it in phases.
        let need = hashes.len() * objs.len();
        if arena.free_slots() < need as u32 {
            self.make_host_room(need - arena.free_slots() as usize);
        }
        let mut st = self.inner.state.lock();
        let mut pages = Vec::with_capacity(hashes.len());
        let mut grant_pages = Vec::new();
        for (req_index, hash) in hashes.iter().enumerate() {
            let id = st.dir.find_or_insert(ns, hash)?;
            for &o in &objs {
                st.dir.set_object(id, TierKind::Device, o, true)?;
            }
            st.dir.touch(id, false);
            if session != 0 {
                st.dir.set_session(id, session);
            }
            let todo: Vec<usize> = objs
                .iter()
                .copied()
                .filter(|&o| {
                    !st.dir.has_object(id, TierKind::Host, o)
                        && !st.dir.inflight_objects(id, TierKind::Host).contains(&o)
                })
                .collect();
            if todo.is_empty() {
                pages.push(StorePage {
                    hash: *hash,
                    status: StoreStatus::AlreadyStored,
                    objects: Vec::new(),
                });
                continue;
            }
            let Some(slots) = arena.alloc_n(todo.len()) else {
                pages.push(StorePage {
                    hash: *hash,
                    status: StoreStatus::NoSpace,
                    objects: Vec::new(),
                });
                continue;
            };
            let objects: Vec<(usize, SlotId)> = todo.into_iter().zip(slots).collect();
            for &(o, _) in &objects {
                st.dir.set_inflight(id, TierKind::Host, o, true)?;
            }
            grant_pages.push(GrantPage {
                req_index,
                page: id,
                objects: objects.clone(),
            });
            pages.push(StorePage {
                hash: *hash,
                status: StoreStatus::Write,
                objects,
            });
        }
        let id = st.new_grant(Grant {
            ns,
            kind: GrantKind::Store,
            pages: grant_pages,
            owner,
        });
        self.publish(&mut st);
        Ok(StoreGrant { id, pages })
    }

    /// Makes the written objects of a store grant present on host. `written[i]` says
    /// whether request page `i` was written in full; pages not written free their slots.
    /// Returns how many pages were committed.
    pub fn commit_store(&self, id: u64, written: &[bool]) -> Result<usize, ManagerError> {
        let mut st = self.inner.state.lock();
        let g = st.grants.get(&id).ok_or(ManagerError::UnknownGrant(id))?;
        let max_index = g.pages.iter().map(|p| p.req_index + 1).max().unwrap_or(0);
        if g.kind != GrantKind::Store || written.len() < max_index {
            return Err(ManagerError::GrantMismatch {
                id,
                pages: max_index,
                got: written.len(),
            });
        }
        let g = st.grants.remove(&id).expect("checked above");
        let arena = self.arena().ok_or(ManagerError::NoNamespace)?;
        let count = st.dir.layout(g.ns)?.object_count();
        let mut committed = 0;
        let mut bytes = 0u64;
        let mut to_pool = Vec::new();
        for p in &g.pages {
            let ok = written[p.req_index];
            for &(o, slot) in &p.objects {
                st.dir.set_inflight(p.page, TierKind::Host, o, false)?;
                if ok {
                    st.set_host_slot(p.page, o, count, Some(slot));
                    st.dir.set_object(p.page, TierKind::Host, o, true)?;
                    bytes += arena.slot_bytes() as u64;
                } else {
                    arena.free(slot);
                }
            }
            if ok {
                committed += 1;
                if st.dir.is_complete(p.page, TierKind::Host) {
                    let hits = st.dir.info(p.page).hits;
                    if st.tun.host_to_pool.copy_now(hits) {
                        to_pool.push(p.page);
                    }
                }
            }
        }
        self.publish(&mut st);
        let ns = g.ns;
        drop(st);
        self.inner.stats.moved(TierKind::Device, TierKind::Host, bytes);
        if !to_pool.is_empty() {
            self.spawn_copy_to_pool(ns, to_pool);
        }
        Ok(committed)
    }

    /// Abandons a grant: a store frees its slots (the page stays as it was), a load
    /// releases its leases.
    pub fn abort(&self, id: u64) -> Result<(), ManagerError> {
        let kind = self.inner.state.lock().grants.get(&id).map(|g| g.kind);
        match kind {
            None => Err(ManagerError::UnknownGrant(id)),
            Some(GrantKind::Store) => {
                let n = self.inner.state.lock().grants[&id]
                    .pages
                    .iter()
                    .map(|p| p.req_index + 1)
                    .max();
                self.commit_store(id, &vec![false; n.unwrap_or(0)]).map(|_| ())
            }
            Some(GrantKind::Load) => self.finish_load(id, 0).map(|_| ()),
        }
    }

    /// Aborts every grant of a caller that went away (a client killed mid-store).
    /// Returns how many grants were reclaimed.
    pub fn release_owner(&self, owner: u64) -> usize {
        let ids: Vec<u64> = {
            let st = self.inner.state.lock();
            st.grants
                .iter()
                .filter(|(_, g)| g.owner == owner)
                .map(|(&id, _)| id)
                .collect()
        };
        ids.iter().filter(|&&id| self.abort(id).is_ok()).count()
    }

    /// Grants open right now (stores and loads).
    pub fn open_grants(&self) -> usize {
        self.inner.state.lock().grants.len()
    }

    /// Leases the host slots of the leading pages of `hashes` that are complete on host,
    /// staging pool pages to host first as `wait` allows.
    pub fn begin_load(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        wait: LoadWait,
        owner: u64,
    ) -> Result<LoadGrant, ManagerError> {
        self.check_batch(hashes.len())?;
        let layout = self.layout(ns)?;
        let objs = layout
            .rank_objects(tp_rank, pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?;
        if wait != LoadWait::BestEffort {
            let deadline = match wait {
                LoadWait::Timeout { ms } => Some(Instant::now() + Duration::from_millis(ms)),
                _ => None,
            };
            self.stage_prefix_from_pool(ns, hashes, deadline);
        } else {
            self.spawn_stage_prefix(ns, hashes);
        }
        let mut st = self.inner.state.lock();
        let mut pages = Vec::new();
        let mut grant_pages = Vec::new();
        for (req_index, hash) in hashes.iter().enumerate() {
            let Some(id) = st.dir.find(ns, hash) else { break };
            if !st.dir.is_complete(id, TierKind::Host) {
                break;
            }
            let mut objects = Vec::with_capacity(objs.len());
            for &o in &objs {
                match st.host_slot(id, o) {
                    Some(slot) => objects.push((o, slot, layout.object_bytes(o))),
                    None => break,
                }
            }
            if objects.len() != objs.len() {
                break;
            }
            st.lease(id);
            st.dir.touch(id, true);
            grant_pages.push(GrantPage {
                req_index,
                page: id,
                objects: objects.iter().map(|&(o, s, _)| (o, s)).collect(),
            });
            pages.push(LoadPage { hash: *hash, objects });
        }
        let id = st.new_grant(Grant {
            ns,
            kind: GrantKind::Load,
            pages: grant_pages,
            owner,
        });
        Ok(LoadGrant { id, pages })
    }

    /// Ends a load: releases the leases, and records that the rank now holds the first
    /// `loaded` pages on device. Returns the number of pages recorded.
    pub fn finish_load(&self, id: u64, loaded: usize) -> Result<usize, ManagerError> {
        let mut st = self.inner.state.lock();
        match st.grants.get(&id) {
            Some(g) if g.kind == GrantKind::Load => {}
            Some(_) | None => return Err(ManagerError::UnknownGrant(id)),
        }
        let g = st.grants.remove(&id).expect("checked above");
        let mut bytes = 0u64;
        let arena_slot = self.arena().map_or(0, |a| a.slot_bytes() as u64);
        for (i, p) in g.pages.iter().enumerate() {
            st.unlease(p.page);
            if i < loaded {
                for &(o, _) in &p.objects {
                    st.dir.set_object(p.page, TierKind::Device, o, true)?;
                    bytes += arena_slot;
                }
            }
        }
        self.publish(&mut st);
        drop(st);
        self.inner.stats.moved(TierKind::Host, TierKind::Device, bytes);
        Ok(loaded.min(g.pages.len()))
    }

    /// The engine freed these device pages (for this rank).
    pub fn removed(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
    ) -> Result<usize, ManagerError> {
        self.check_batch(hashes.len())?;
        let layout = self.layout(ns)?;
        let objs = layout
            .rank_objects(tp_rank, pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?;
        let mut st = self.inner.state.lock();
        let mut n = 0;
        for hash in hashes {
            if let Some(id) = st.dir.find(ns, hash) {
                n += 1;
                for &o in &objs {
                    // The page may be released by the last removal; stop touching it then.
                    if st.dir.find(ns, hash) != Some(id) {
                        break;
                    }
                    st.dir.set_object(id, TierKind::Device, o, false)?;
                }
            }
        }
        self.publish(&mut st);
        Ok(n)
    }

    /// In process: stores device pages of an attached rank to host on a transfer worker.
    pub fn store(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        device_slots: &[u32],
        session: u32,
    ) -> Result<Ticket, ManagerError> {
        if hashes.len() != device_slots.len() {
            return Err(ManagerError::LengthMismatch {
                hashes: hashes.len(),
                slots: device_slots.len(),
            });
        }
        let device = self.device(ns, tp_rank, pp_rank)?;
        let layout = self.layout(ns)?;
        let ticket = self.inner.tickets.issue()?;
        let grant = match self.begin_store(ns, tp_rank, pp_rank, hashes, session, 0) {
            Ok(g) => g,
            Err(e) => {
                self.inner.tickets.complete(ticket, OpResult::default());
                let _ = self.inner.tickets.wait(ticket, Duration::ZERO);
                return Err(e);
            }
        };
        let mut guard = GrantGuard::new(self.clone(), grant.id, ticket);
        let slots = device_slots.to_vec();
        let job = move || {
            let m = guard.m.clone();
            let arena = m.arena().expect("a grant implies an arena");
            let mut written = vec![false; grant.pages.len()];
            let mut failed = 0;
            for (i, page) in grant.pages.iter().enumerate() {
                if page.status != StoreStatus::Write {
                    failed += usize::from(page.status == StoreStatus::NoSpace);
                    continue;
                }
                let t = std::time::Instant::now();
                written[i] = copy_page(&layout, &*device, &arena, slots[i], &page.objects, true).is_ok();
                m.inner.stats.copied(TierKind::Device, TierKind::Host, t.elapsed());
                failed += usize::from(!written[i]);
            }
            let result = match m.commit_store(grant.id, &written) {
                Ok(n) => OpResult {
                    pages: n + grant
                        .pages
                        .iter()
                        .filter(|p| p.status == StoreStatus::AlreadyStored)
                        .count(),
                    failed,
                    error: None,
                },
                Err(e) => OpResult {
                    pages: 0,
                    failed: grant.pages.len(),
                    error: Some(e.to_string()),
                },
            };
            guard.done(result);
        };
        self.submit(Box::new(job), ticket)
    }

    /// In process: loads the leading host pages of `hashes` into an attached rank's device
    /// slots on a transfer worker. The result counts exactly the leading pages loaded.
    pub fn load(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        device_slots: &[u32],
        wait: LoadWait,
    ) -> Result<Ticket, ManagerError> {
        if hashes.len() != device_slots.len() {
            return Err(ManagerError::LengthMismatch {
                hashes: hashes.len(),
                slots: device_slots.len(),
            });
        }
        let device = self.device(ns, tp_rank, pp_rank)?;
        let layout = self.layout(ns)?;
        let ticket = self.inner.tickets.issue()?;
        let grant = self.begin_load(ns, tp_rank, pp_rank, hashes, wait, 0);
        let grant = match grant {
            Ok(g) => g,
            Err(e) => {
                self.inner.tickets.complete(ticket, OpResult::default());
                let _ = self.inner.tickets.wait(ticket, Duration::ZERO);
                return Err(e);
            }
        };
        let mut guard = GrantGuard::new(self.clone(), grant.id, ticket);
        let slots = device_slots.to_vec();
        let total = hashes.len();
        let job = move || {
            let m = guard.m.clone();
            let arena = m.arena().expect("a grant implies an arena");
            let mut loaded = 0;
            for (i, page) in grant.pages.iter().enumerate() {
                let objs: Vec<(usize, SlotId)> = page.objects.iter().map(|&(o, s, _)| (o, s)).collect();
                let t = std::time::Instant::now();
                if copy_page(&layout, &*device, &arena, slots[i], &objs, false).is_err() {
                    break;
                }
                m.inner.stats.copied(TierKind::Host, TierKind::Device, t.elapsed());
                loaded += 1;
            }
            let result = match m.finish_load(grant.id, loaded) {
                Ok(n) => OpResult {
                    pages: n,
                    failed: total - n,
                    error: None,
                },
                Err(e) => OpResult {
                    pages: 0,
                    failed: total,
                    error: Some(e.to_string()),
                },
            };
            guard.done(result);
        };
        self.submit(Box::new(job), ticket)
    }

    /// Waits up to `timeout` for an in-process operation's result.
    pub fn wait(&self, ticket: Ticket, timeout: Duration) -> Result<OpResult, ManagerError> {
        Ok(self.inner.tickets.wait(ticket, timeout)?)
    }

    /// Every finished in-process operation, without waiting.
    pub fn poll(&self) -> Vec<(Ticket, OpResult)> {
        self.inner.tickets.poll()
    }

    fn device(
        &self,
        ns: NamespaceId,
        tp: u16,
        pp: u16,
    ) -> Result<Arc<dyn crate::tier::device::DeviceRegion>, ManagerError> {
        self.inner
            .devices
            .lock()
            .get(&(ns, tp, pp))
            .cloned()
            .ok_or(ManagerError::NoDevice { ns: ns.0, tp, pp })
    }

    fn submit(&self, job: crate::transfer::Job, ticket: Ticket) -> Result<Ticket, ManagerError> {
        // Engine operations wait a bounded time for queue room rather than fail at once.
        match self.inner.xfer.submit_timeout(job, Duration::from_secs(5)) {
            Ok(()) => Ok(ticket),
            Err(job) => {
                // Dropping the unrun job drops its guard, which aborts the grant and settles
                // the ticket; collect that so nothing is left outstanding.
                drop(job);
                let _ = self.inner.tickets.wait(ticket, Duration::ZERO);
                Err(ManagerError::Busy)
            }
        }
    }

    /// In process: writes whole objects from caller buffers into host, all objects of a
    /// page or none (HiCache-style batch set from host memory). Returns pages committed.
    pub fn put_objects(&self, ns: NamespaceId, pages: &[PageObjects<'_>]) -> Result<usize, ManagerError> {
        self.check_batch(pages.len())?;
        let layout = self.layout(ns)?;
        for (_, objs) in pages {
            for &(o, data) in objs {
                if o >= layout.object_count() {
                    return Err(crate::directory::DirectoryError::ObjectOutOfRange {
                        index: o,
                        count: layout.object_count(),
                    }
                    .into());
                }
                if data.len() as u64 != layout.object_bytes(o) {
                    return Err(ManagerError::ObjectSize {
                        got: data.len(),
                        want: layout.object_bytes(o),
                    });
                }
            }
        }
        let arena = self.arena().ok_or(ManagerError::NoNamespace)?;
        let need: usize = pages.iter().map(|(_, o)| o.len()).sum();
        if arena.free_slots() < need as u32 {
            self.make_host_room(need - arena.free_slots() as usize);
        }
        let mut written = vec![false; pages.len()];
        let mut grant_pages = Vec::new();
        {
            let mut st = self.inner.state.lock();
            for (i, (hash, objs)) in pages.iter().enumerate() {
                let id = st.dir.find_or_insert(ns, hash)?;
                let Some(slots) = arena.alloc_n(objs.len()) else {
                    st.dir.release_if_empty(id);
                    continue;
                };
                for &(o, _) in objs {
                    st.dir.set_inflight(id, TierKind::Host, o, true)?;
                }
                grant_pages.push(GrantPage {
                    req_index: i,
                    page: id,
                    objects: objs.iter().map(|&(o, _)| o).zip(slots).collect(),
                });
            }
        }
        for gp in &grant_pages {
            for (&(_, data), &(_, slot)) in pages[gp.req_index].1.iter().zip(&gp.objects) {
                // SAFETY: the slot was allocated above for this grant and is in flight.
                unsafe { arena.slot_mut(slot, data.len())? }.copy_from_slice(data);
            }
            written[gp.req_index] = true;
        }
        let id = self.inner.state.lock().new_grant(Grant {
            ns,
            kind: GrantKind::Store,
            pages: grant_pages,
            owner: 0,
        });
        self.commit_store(id, &written)
    }

    /// In process: reads one object of a page complete on host into `buf`.
    pub fn read_host_object(
        &self,
        ns: NamespaceId,
        hash: &PageHash,
        obj: usize,
        buf: &mut [u8],
    ) -> Result<bool, ManagerError> {
        let layout = self.layout(ns)?;
        let arena = self.arena().ok_or(ManagerError::NoNamespace)?;
        let (id, slot) = {
            let mut st = self.inner.state.lock();
            let Some(id) = st.dir.find(ns, hash) else {
                return Ok(false);
            };
            if !st.dir.is_complete(id, TierKind::Host) {
                return Ok(false);
            }
            let Some(slot) = st.host_slot(id, obj) else {
                return Ok(false);
            };
            st.lease(id);
            (id, slot)
        };
        let len = layout.object_bytes(obj) as usize;
        // SAFETY: leased above: not freed or rewritten until unleased.
        let res = unsafe { arena.slot(slot, len) }.map(|src| {
            if buf.len() >= len {
                buf[..len].copy_from_slice(src);
            }
        });
        self.inner.state.lock().unlease(id);
        res?;
        if buf.len() < len {
            return Err(ManagerError::ObjectSize {
                got: buf.len(),
                want: len as u64,
            });
        }
        Ok(true)
    }
}

/// A page and the bytes of some of its objects, by object index.
pub type PageObjects<'a> = (PageHash, Vec<(usize, &'a [u8])>);

/// Copies one page's objects between a device page and host slots.
fn copy_page(
    layout: &Layout,
    device: &dyn crate::tier::device::DeviceRegion,
    arena: &crate::tier::host::HostArena,
    device_slot: u32,
    objects: &[(usize, SlotId)],
    to_host: bool,
) -> Result<(), ManagerError> {
    let parts: Vec<_> = objects
        .iter()
        .map(|&(o, s)| (layout.objects()[o].part, s, layout.object_bytes(o) as usize))
        .collect();
    if to_host {
        let mut batch = Vec::with_capacity(parts.len());
        for &(part, slot, len) in &parts {
            // SAFETY: the slot belongs to an open store grant: in flight, owned by us.
            batch.push(ObjectCopy::new(device_slot, part, unsafe {
                arena.slot_mut(slot, len)?
            }));
        }
        device.copy_to_host(&mut batch)?;
    } else {
        let mut batch = Vec::with_capacity(parts.len());
        for &(part, slot, len) in &parts {
            // SAFETY: the page is leased by an open load grant: not freed or rewritten.
            batch.push(ObjectCopy::new(device_slot, part, unsafe { arena.slot(slot, len)? }));
        }
        device.copy_from_host(&batch)?;
    }
    Ok(())
}

/// Makes sure a transfer job's grant and ticket are settled even if the job panics or
/// is dropped unrun: aborts the grant and fails the ticket.
struct GrantGuard {
    m: Manager,
    grant: u64,
    ticket: Ticket,
    settled: bool,
}

impl GrantGuard {
    fn new(m: Manager, grant: u64, ticket: Ticket) -> Self {
        Self {
            m,
            grant,
            ticket,
            settled: false,
        }
    }

    fn done(&mut self, r: OpResult) {
        self.settled = true;
        self.m.inner.tickets.complete(self.ticket, r);
    }
}

impl Drop for GrantGuard {
    fn drop(&mut self) {
        if !self.settled {
            let _ = self.m.abort(self.grant);
            self.m.inner.tickets.complete(
                self.ticket,
                OpResult {
                    pages: 0,
                    failed: 0,
                    error: Some("transfer job did not finish".into()),
                },
            );
        }
    }
}
