//! The engine-facing operations: store and load grants, `removed`, and the in-process
//! `store`/`load` that run the device copies on transfer workers.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::grants::{Grant, GrantKind, GrantPage, Leases, release_store_page};
use super::store_plan::{apply_store, plan_store, unplan_store};
use super::{Manager, ManagerError};
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::tier::host::SlotId;

/// Longest `begin_store` retries a reservation that came up short while other moves
/// were still settling, before it answers `NoSpace` for the pages without room.
const ROOM_WAIT: Duration = Duration::from_secs(1);
/// First pause between such retries (doubling up to [`ROOM_RETRY_MAX`]), so the moves it
/// waits for get the directory lock.
const ROOM_RETRY: Duration = Duration::from_millis(1);
const ROOM_RETRY_MAX: Duration = Duration::from_millis(16);

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
    ///
    /// A page that gets no host room (`NoSpace`) leaves no trace: it is not recorded on
    /// device (the engine does not remember refused pages, so nothing would ever clear
    /// the mark) and a record created for it is released. An error leaves the directory
    /// and the arena as they were. A request whose objects outnumber the arena's slots is
    /// refused up front (`StoreTooLarge`) rather than partly stored. When slots run short
    /// because concurrent stores or evictions have not settled yet, the reservation is
    /// undone and retried (bounded by [`ROOM_WAIT`]) instead of answering `NoSpace`.
    pub fn begin_store(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
        session: u32,
        owner: u64,
    ) -> Result<StoreGrant, ManagerError> {
        self.inner.cfg.check_batch(hashes.len())?;
        let layout = self.pages().layout(ns)?;
        let objs = layout
            .rank_objects(tp_rank, pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?;
        let arena = self.stores().arena().ok_or(ManagerError::NoNamespace)?;
        let need = hashes.len() * objs.len();
        if need > arena.slots() as usize {
            return Err(ManagerError::StoreTooLarge {
                pages: hashes.len(),
                need,
                slots: arena.slots(),
            });
        }
        let deadline = Instant::now() + ROOM_WAIT;
        let mut round = 0u32;
        loop {
            // Make room before taking the directory lock for allocation; eviction takes
            // it in phases.
            let free = arena.free_slots() as usize;
            if free < need {
                self.mover().make_host_room(need - free);
            }
            let mut st = self.write();
            let planned = plan_store(&mut st, &arena, ns, &objs, hashes)?;
            let short = planned.iter().any(|p| p.no_space);
            if short && Instant::now() < deadline {
                // Concurrent stores race for the slots one eviction frees, and a victim
                // another thread is writing to the pool is skipped here until it settles:
                // undo and try again (making room again), rather than answering
                // `no_space` while the arena is about to have room. Only a host held
                // entirely by pins, leases and open grants answers `no_space`, after
                // `ROOM_WAIT`.
                unplan_store(&mut st, &arena, &planned);
                drop(st);
                std::thread::sleep((ROOM_RETRY * 2u32.pow(round.min(4))).min(ROOM_RETRY_MAX));
                round += 1;
                continue;
            }
            if short {
                tracing::debug!(pages = hashes.len(), need, "store: no host room even after eviction");
            }
            let (pages, grant_pages) = apply_store(&mut st, &arena, &objs, hashes, &planned, session)?;
            let id = self.grants().insert(Grant {
                ns,
                kind: GrantKind::Store,
                pages: grant_pages,
                owner,
            });
            drop(st);
            self.mover().usage_grew(TierKind::Host);
            return Ok(StoreGrant { id, pages });
        }
    }

    /// Makes the written objects of a store grant present on host. `written[i]` says
    /// whether request page `i` was written in full; pages not written free their slots.
    /// Returns how many pages were committed.
    pub fn commit_store(&self, id: u64, written: &[bool]) -> Result<usize, ManagerError> {
        // Owns the grant's slots and in-flight marks until each page is settled: an early
        // return below releases the rest (declared before `st`, so it drops after it).
        let mut g = self.grants().take(self, id, |g| {
            let max_index = g.pages.iter().map(|p| p.req_index + 1).max().unwrap_or(0);
            if g.kind != GrantKind::Store || written.len() < max_index {
                return Err(ManagerError::GrantMismatch {
                    id,
                    pages: max_index,
                    got: written.len(),
                });
            }
            Ok(())
        })?;
        let arena = self.stores().arena().ok_or(ManagerError::NoNamespace)?;
        let host_to_pool = self.tunables().host_to_pool;
        let mut st = self.write();
        let count = st.dir.layout(g.ns())?.object_count();
        let mut committed = 0;
        let mut bytes = 0u64;
        let mut to_pool = Vec::new();
        let mut objs: Vec<usize> = Vec::new();
        for i in 0..g.pages().len() {
            let p = &g.pages()[i];
            let page = p.page;
            if !written[p.req_index] {
                release_store_page(&mut st, &arena, p);
                g.settle(i + 1);
                continue;
            }
            objs.clear();
            objs.extend(p.objects.iter().map(|&(o, _)| o));
            // Present first, then out of flight, so the page never looks empty (and is
            // never released) in between. Once present, the slots are the directory's.
            st.set_host_slots(page, &p.objects, count);
            st.dir.set_objects(page, TierKind::Host, &objs, true)?;
            g.settle(i + 1);
            bytes += arena.slot_bytes() as u64 * objs.len() as u64;
            st.dir.set_inflight_objects(page, TierKind::Host, &objs, false)?;
            committed += 1;
            if st.dir.is_complete(page, TierKind::Host) {
                let hits = st.dir.info(page).hits;
                if host_to_pool.copy_now(hits) {
                    to_pool.push(page);
                }
            }
        }
        let ns = g.ns();
        drop(st);
        self.inner.stats.moved(TierKind::Device, TierKind::Host, bytes);
        if !to_pool.is_empty() {
            self.mover().spawn_copy_to_pool(ns, to_pool);
        }
        Ok(committed)
    }

    /// Abandons a grant: a store frees its slots (the page stays as it was), a load
    /// releases its leases.
    pub fn abort(&self, id: u64) -> Result<(), ManagerError> {
        let kind = self.grants().grants.get(&id).map(|g| g.kind);
        match kind {
            None => Err(ManagerError::UnknownGrant(id)),
            Some(GrantKind::Store) => {
                let n = self
                    .grants()
                    .grants
                    .get(&id)
                    .and_then(|g| g.pages.iter().map(|p| p.req_index + 1).max());
                self.commit_store(id, &vec![false; n.unwrap_or(0)]).map(|_| ())
            }
            Some(GrantKind::Load | GrantKind::ReplicaLoad) => self.finish_load(id, 0).map(|_| ()),
        }
    }

    /// Aborts every grant of a caller that went away (a client killed mid-store).
    /// Returns how many grants were reclaimed.
    pub fn release_owner(&self, owner: u64) -> usize {
        let ids: Vec<u64> = {
            let gt = self.grants();
            gt.grants
                .iter()
                .filter(|(_, g)| g.owner == owner)
                .map(|(&id, _)| id)
                .collect()
        };
        ids.iter().filter(|&&id| self.abort(id).is_ok()).count()
    }

    /// Grants open right now (stores and loads).
    pub fn open_grants(&self) -> usize {
        self.grants().grants.len()
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
        self.inner.cfg.check_batch(hashes.len())?;
        let layout = self.pages().layout(ns)?;
        // An MLA rank other than TP 0 reads the latent rank 0 wrote (the same bytes on
        // every rank); its load then records nothing on device (`ReplicaLoad`).
        let objs = layout
            .rank_load_objects(tp_rank, pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?;
        let replica = layout
            .rank_objects(tp_rank, pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?
            .is_empty();
        // Pages past what the directory knows may be in a shared pool (another node's).
        if self.inner.remote.is_some() {
            let hit = self.inner.pages.lookup(ns, hashes)?;
            self.discovery().discover(ns, hashes, hit);
        }
        // Staging makes room on host by evicting, and upkeep evicts beside it: the load's
        // pages already on host are leased before anything is staged, so neither takes
        // them from under the load (which then came back short of pages it asked for while
        // they were all on host or in the pool). Given back after the grant's own leases.
        let (held, stage) = lease_staging_prefix(self, ns, hashes);
        // Staged only when a page of the prefix is in the pool and not on host (the same
        // walk that leased): a load of pages all on host starts no staging.
        if stage {
            if wait == LoadWait::BestEffort {
                self.mover().spawn_stage_prefix(ns, hashes);
            } else {
                let deadline = match wait {
                    LoadWait::Timeout { ms } => Some(Instant::now() + Duration::from_millis(ms)),
                    _ => None,
                };
                self.mover().stage_prefix_from_pool(ns, hashes, deadline);
            }
        }
        let host_to_pool = self.tunables().host_to_pool;
        let mut st = self.write();
        // Leases are taken in the same critical section that saw the page complete on
        // host, so eviction (which checks leases under the directory lock) cannot slip in.
        let mut gt = self.grants();
        let mut pages = Vec::with_capacity(hashes.len());
        let mut grant_pages = Vec::with_capacity(hashes.len());
        let mut earned = Vec::new();
        for (req_index, hash) in hashes.iter().enumerate() {
            let Some(id) = st.dir.find(ns, hash) else { break };
            if !st.dir.is_complete(id, TierKind::Host) {
                break;
            }
            let mut objects = Vec::with_capacity(objs.len());
            let slots = st.host_slots(id).unwrap_or(&[]);
            for &o in &objs {
                match slots.get(o).copied().filter(|&s| s != super::state::NO_SLOT) {
                    Some(slot) => objects.push((o, SlotId(slot), layout.object_bytes(o))),
                    None => break,
                }
            }
            if objects.len() != objs.len() {
                break;
            }
            gt.lease(id);
            st.dir.order_mut().touch(id, true);
            // Write-through-selective: a page hit often enough earns its pool copy now.
            if let crate::policy::WritePolicy::WriteThroughSelective { hits } = host_to_pool
                && st.dir.info(id).hits == hits
                && !st.dir.is_complete(id, TierKind::Pool)
            {
                earned.push(id);
            }
            grant_pages.push(GrantPage {
                req_index,
                page: id,
                objects: objects.iter().map(|&(o, s, _)| (o, s)).collect(),
            });
            pages.push(LoadPage { hash: *hash, objects });
        }
        let id = gt.insert(Grant {
            ns,
            kind: if replica {
                GrantKind::ReplicaLoad
            } else {
                GrantKind::Load
            },
            pages: grant_pages,
            owner,
        });
        drop(gt);
        drop(st);
        drop(held);
        if !earned.is_empty() {
            self.mover().spawn_copy_to_pool(ns, earned);
        }
        Ok(LoadGrant { id, pages })
    }

    /// Ends a load: releases the leases, and records that the rank now holds the first
    /// `loaded` pages on device. Returns the number of pages recorded.
    pub fn finish_load(&self, id: u64, loaded: usize) -> Result<usize, ManagerError> {
        // Owns the grant's leases until each page is settled: an early return below gives
        // the rest back (declared before `st` and `gt`, so it drops after them).
        let mut g = self.grants().take(self, id, |g| match g.kind {
            GrantKind::Load | GrantKind::ReplicaLoad => Ok(()),
            GrantKind::Store => Err(ManagerError::UnknownGrant(id)),
        })?;
        let record = g.kind() == GrantKind::Load;
        let mut bytes = 0u64;
        let arena_slot = self.stores().arena().map_or(0, |a| a.slot_bytes() as u64);
        let exclusive = self.inner.cfg.policy.is_some_and(|p| p.exclusive);
        let mut on_device = Vec::new();
        let mut st = self.write();
        let mut gt = self.grants();
        let mut objs: Vec<usize> = Vec::new();
        let total = g.pages().len();
        for i in 0..total {
            let p = &g.pages()[i];
            let page = p.page;
            objs.clear();
            objs.extend(p.objects.iter().map(|&(o, _)| o));
            gt.unlease(page);
            g.settle(i + 1);
            if i < loaded && record {
                st.dir.set_objects(page, TierKind::Device, &objs, true)?;
                bytes += arena_slot * objs.len() as u64;
                if exclusive {
                    let info = st.dir.info(page);
                    on_device.push((info.ns, info.hash));
                }
            }
        }
        drop(gt);
        drop(st);
        self.inner.stats.moved(TierKind::Host, TierKind::Device, bytes);
        // Exclusive tiers: the session policy drops the host copies of what is on device.
        if let Some(&(ns, _)) = on_device.first() {
            let hashes: Vec<PageHash> = on_device.iter().filter(|(n, _)| *n == ns).map(|(_, h)| *h).collect();
            self.inner.policy.page_hit(self, None, ns, &hashes, hashes.len());
        }
        Ok(loaded.min(total))
    }

    /// The engine freed these device pages (for this rank).
    pub fn removed(
        &self,
        ns: NamespaceId,
        tp_rank: u16,
        pp_rank: u16,
        hashes: &[PageHash],
    ) -> Result<usize, ManagerError> {
        self.inner.cfg.check_batch(hashes.len())?;
        let layout = self.pages().layout(ns)?;
        let objs = layout
            .rank_objects(tp_rank, pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?;
        let mut st = self.write();
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
        drop(st);
        Ok(n)
    }
}

/// Walks a load's prefix (pages complete on host or in the pool, up to the first that is
/// neither) once, and says whether a page of it has to be staged from the pool first. When
/// one has, the prefix's pages complete on host are leased, so that the staging's evictions
/// cannot take them; with nothing to stage (or no pool), nothing is leased or staged.
fn lease_staging_prefix<'m>(m: &'m Manager, ns: NamespaceId, hashes: &[PageHash]) -> (Option<Leases<'m>>, bool) {
    if m.stores().pool().is_none() {
        return (None, false);
    }
    let st = m.read();
    let mut on_host = Vec::with_capacity(hashes.len());
    let mut stage = false;
    for h in hashes {
        let Some(id) = st.dir.find(ns, h) else { break };
        if st.dir.is_complete(id, TierKind::Host) {
            on_host.push(id);
        } else if st.dir.is_complete(id, TierKind::Pool) {
            stage = true;
        } else {
            break;
        }
    }
    if !stage || on_host.is_empty() {
        return (None, stage);
    }
    // Under the read lock that saw them complete: eviction, which drops host pages under
    // the write lock, cannot come in between.
    let mut leases = Leases::new(&m.inner.grants);
    let mut gt = m.grants();
    for id in on_host {
        leases.take(&mut gt, id);
    }
    drop(gt);
    (Some(leases), true)
}
