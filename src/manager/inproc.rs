//! In-process engine operations: `store` and `load` for ranks whose device region is
//! attached to the manager, run as jobs on transfer workers and collected by ticket.
//!
//! [`InProcJobs`] owns the ticket table: it issues a ticket before a grant, queues the
//! grant's pages as one shared batch on the transfer workers it is handed, and settles
//! the ticket when the batch ends, fails, or is dropped unrun.

use std::sync::Arc;
use std::time::Duration;

use super::devices::Devices;
use super::engine::{LoadWait, OpResult, StoreStatus};
use super::pages::Pages;
use super::{Manager, ManagerError};
use crate::layout::Layout;
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::tier::device::{DeviceRegion, ObjectCopy};
use crate::tier::host::{HostArena, SlotId};
use crate::transfer::{Ticket, Tickets, TransferEngine};

impl Manager {
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
        let jobs = &self.inner.jobs;
        let (device, layout, ticket) = jobs.prepare(
            &self.inner.devices,
            &self.inner.pages,
            (ns, tp_rank, pp_rank),
            hashes,
            device_slots,
        )?;
        let grant = jobs.settle_on_error(ticket, self.begin_store(ns, tp_rank, pp_rank, hashes, session, 0))?;
        let guard = GrantGuard::new(self.clone(), grant.id, ticket);
        let slots = device_slots.to_vec();
        let bytes = grant_bytes(&layout, grant.pages.iter().map(|p| p.objects.iter().copied()));
        let n = grant.pages.len();
        let grant = Arc::new(grant);
        let (m, g) = (self.clone(), grant.clone());
        let arena = self.stores().arena();
        // Each page is copied by whichever worker takes it; the worker that ends the
        // last page commits the grant.
        let item = move |i: usize| {
            let (Some(page), Some(arena)) = (g.pages.get(i), arena.as_ref()) else {
                return false;
            };
            if page.status != StoreStatus::Write {
                return false;
            }
            let t = std::time::Instant::now();
            let ok = copy_page(&layout, &*device, arena, slots[i], page.objects.iter().copied(), true).is_ok();
            m.inner.stats.copied(TierKind::Device, TierKind::Host, t.elapsed());
            ok
        };
        let finish = move |written: Vec<bool>| {
            let mut guard = guard;
            let failed = grant
                .pages
                .iter()
                .zip(&written)
                .filter(|&(p, &w)| p.status == StoreStatus::NoSpace || (p.status == StoreStatus::Write && !w))
                .count();
            let result = match guard.m.commit_store(grant.id, &written) {
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
        jobs.submit(&self.inner.xfer, ticket, n, bytes, item, finish)
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
        let jobs = &self.inner.jobs;
        let (device, layout, ticket) = jobs.prepare(
            &self.inner.devices,
            &self.inner.pages,
            (ns, tp_rank, pp_rank),
            hashes,
            device_slots,
        )?;
        let grant = jobs.settle_on_error(ticket, self.begin_load(ns, tp_rank, pp_rank, hashes, wait, 0))?;
        let guard = GrantGuard::new(self.clone(), grant.id, ticket);
        let slots = device_slots.to_vec();
        let total = hashes.len();
        let n = grant.pages.len();
        let bytes = grant_bytes(
            &layout,
            grant.pages.iter().map(|p| p.objects.iter().map(|&(o, s, _)| (o, s))),
        );
        let (m, grant) = (self.clone(), Arc::new(grant));
        let (g, id) = (grant.clone(), grant.id);
        let arena = self.stores().arena();
        let item = move |i: usize| {
            let (Some(page), Some(arena)) = (g.pages.get(i), arena.as_ref()) else {
                return false;
            };
            let objs = page.objects.iter().map(|&(o, s, _)| (o, s));
            let t = std::time::Instant::now();
            let ok = copy_page(&layout, &*device, arena, slots[i], objs, false).is_ok();
            if ok {
                m.inner.stats.copied(TierKind::Host, TierKind::Device, t.elapsed());
            }
            ok
        };
        // Only the leading pages that all arrived count as loaded, as when one worker
        // copied them in order and stopped at the first failure.
        let finish = move |ok: Vec<bool>| {
            let mut guard = guard;
            let loaded = ok.iter().take_while(|&&b| b).count();
            let result = match guard.m.finish_load(id, loaded) {
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
        jobs.submit(&self.inner.xfer, ticket, n, bytes, item, finish)
    }

    /// Waits up to `timeout` for an in-process operation's result.
    pub fn wait(&self, ticket: Ticket, timeout: Duration) -> Result<OpResult, ManagerError> {
        self.inner.jobs.wait(ticket, timeout)
    }

    /// Every finished in-process operation, without waiting.
    pub fn poll(&self) -> Vec<(Ticket, OpResult)> {
        self.inner.jobs.poll()
    }
}

/// The tickets of in-process operations, and the batches that settle them.
pub(crate) struct InProcJobs {
    tickets: Arc<Tickets<OpResult>>,
}

impl InProcJobs {
    /// A table of at most `max_outstanding` tickets not yet collected.
    pub(super) fn new(max_outstanding: usize) -> Self {
        Self {
            tickets: Tickets::new(max_outstanding),
        }
    }

    /// What an in-process store or load needs before its grant: matching lengths, the
    /// attached device of the rank, the layout, and a ticket.
    fn prepare(
        &self,
        devices: &Devices,
        pages: &Pages,
        (ns, tp_rank, pp_rank): (NamespaceId, u16, u16),
        hashes: &[PageHash],
        device_slots: &[u32],
    ) -> Result<(Arc<dyn DeviceRegion>, Layout, Ticket), ManagerError> {
        if hashes.len() != device_slots.len() {
            return Err(ManagerError::LengthMismatch {
                hashes: hashes.len(),
                slots: device_slots.len(),
            });
        }
        let device = devices.region(ns, tp_rank, pp_rank)?;
        let layout = pages.read().dir.layout(ns)?.clone();
        let ticket = self.tickets.issue()?;
        Ok((device, layout, ticket))
    }

    /// Passes a grant through; on an error, settles and collects the ticket first so it
    /// does not stay outstanding.
    fn settle_on_error<G>(&self, ticket: Ticket, grant: Result<G, ManagerError>) -> Result<G, ManagerError> {
        if grant.is_err() {
            self.tickets.complete(ticket, OpResult::default());
            let _ = self.tickets.wait(ticket, Duration::ZERO);
        }
        grant
    }

    /// Queues a grant's pages as one batch that the transfer workers share (as many as
    /// its bytes are worth, see `TransferEngine::runners`).
    fn submit(
        &self,
        xfer: &TransferEngine,
        ticket: Ticket,
        n: usize,
        bytes: u64,
        item: impl Fn(usize) -> bool + Send + Sync + 'static,
        finish: impl FnOnce(Vec<bool>) + Send + 'static,
    ) -> Result<Ticket, ManagerError> {
        let runners = xfer.runners(bytes);
        // Engine operations wait a bounded time for queue room rather than fail at once.
        match xfer.submit_shared(n, runners, item, finish, Duration::from_secs(5)) {
            Ok(()) => Ok(ticket),
            Err(job) => {
                // Dropping the unrun job drops the batch and its guard, which aborts the
                // grant and settles the ticket; collect that so nothing is left outstanding.
                drop(job);
                let _ = self.tickets.wait(ticket, Duration::ZERO);
                Err(ManagerError::Busy)
            }
        }
    }

    /// Waits up to `timeout` for a ticket's result.
    fn wait(&self, ticket: Ticket, timeout: Duration) -> Result<OpResult, ManagerError> {
        Ok(self.tickets.wait(ticket, timeout)?)
    }

    /// Every finished operation, without waiting.
    fn poll(&self) -> Vec<(Ticket, OpResult)> {
        self.tickets.poll()
    }

    /// Settles a ticket with the operation's result.
    fn complete(&self, ticket: Ticket, result: OpResult) {
        self.tickets.complete(ticket, result);
    }
}

/// Bytes a grant's pages move: the sum of their objects' sizes.
fn grant_bytes<I: IntoIterator<Item = (usize, SlotId)>>(layout: &Layout, pages: impl Iterator<Item = I>) -> u64 {
    pages
        .flat_map(|p| p.into_iter())
        .map(|(o, _)| layout.object_bytes(o))
        .sum()
}

/// Copies one page's objects between a device page and host slots: `objects` gives each
/// object's index and host slot. One list per page (the device's batch), built straight
/// from the grant's entries.
fn copy_page<I>(
    layout: &Layout,
    device: &dyn DeviceRegion,
    arena: &HostArena,
    device_slot: u32,
    objects: I,
    to_host: bool,
) -> Result<(), ManagerError>
where
    I: ExactSizeIterator<Item = (usize, SlotId)>,
{
    let part = |o: usize| (layout.objects()[o].part, layout.object_bytes(o) as usize);
    if to_host {
        let mut batch = Vec::with_capacity(objects.len());
        for (o, slot) in objects {
            let (part, len) = part(o);
            // SAFETY: the slot belongs to an open store grant: in flight, owned by us.
            batch.push(ObjectCopy::new(device_slot, part, unsafe {
                arena.slot_mut(slot, len)?
            }));
        }
        device.copy_to_host(&mut batch)?;
    } else {
        let mut batch = Vec::with_capacity(objects.len());
        for (o, slot) in objects {
            let (part, len) = part(o);
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
        self.m.inner.jobs.complete(self.ticket, r);
    }
}

impl Drop for GrantGuard {
    fn drop(&mut self) {
        if !self.settled {
            let _ = self.m.abort(self.grant);
            self.m.inner.jobs.complete(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SimClock;
    use crate::layout::LayoutSpec;
    use crate::manager::ManagerConfig;
    use crate::page::Namespace;
    use crate::tier::device::{DeviceError, EmulatedDevice};

    /// An emulated device whose host→device copies into one page fail.
    struct FailsAt(Arc<EmulatedDevice>, u32);

    impl DeviceRegion for FailsAt {
        fn kind(&self) -> &'static str {
            "fails-at"
        }
        fn pages(&self) -> u32 {
            self.0.pages()
        }
        fn object_bytes(&self) -> usize {
            self.0.object_bytes()
        }
        fn copy_to_host(&self, batch: &mut [ObjectCopy<&mut [u8]>]) -> Result<(), DeviceError> {
            self.0.copy_to_host(batch)
        }
        fn copy_from_host(&self, batch: &[ObjectCopy<&[u8]>]) -> Result<(), DeviceError> {
            if batch.iter().any(|c| c.slot == self.1) {
                return Err(DeviceError::Copy("injected".into()));
            }
            self.0.copy_from_host(batch)
        }
    }

    /// A batch big enough that every worker shares it (48 pages of two 64 KiB objects is
    /// 6 MiB): every page arrives with its own bytes both ways, and a load that fails
    /// part-way counts exactly the leading pages, as when one worker copied them in order.
    #[test]
    fn a_shared_batch_moves_every_page_by_content_and_loads_count_the_leading_pages() {
        let dir = tempfile::tempdir().unwrap();
        let layout = LayoutSpec::mha(4, 1, 512, 2, 16).build().unwrap();
        assert_eq!(layout.object_bytes(0), 64 << 10);
        let (pages, page) = (48u32, layout.page_bytes());
        let mut cfg = ManagerConfig::in_dir(dir.path(), (pages as u64 + 4) * page, None);
        cfg.arena.lock = false;
        cfg.transfer_threads = 3;
        cfg.max_pages = 4096;
        let m = Manager::new(cfg, SimClock::new()).unwrap();
        assert_eq!(m.inner.xfer.runners(pages as u64 * page), 3, "the batch is shared");
        let ns = m.register_namespace(Namespace::model("split"), layout.clone()).unwrap();
        let dev = Arc::new(EmulatedDevice::new(&layout, 0, 2 * pages));
        m.attach_device(ns, 0, 0, dev.clone()).unwrap();
        for s in 0..pages {
            dev.fill_page(s, 1000 + s as u64).unwrap();
        }
        let hs: Vec<PageHash> = (0..pages as u64).map(PageHash::from_u64).collect();
        let from: Vec<u32> = (0..pages).collect();
        let wait = Duration::from_secs(30);
        let r = m.wait(m.store(ns, 0, 0, &hs, &from, 0).unwrap(), wait).unwrap();
        assert_eq!((r.pages, r.failed, r.error), (pages as usize, 0, None));
        // Back into other device pages, reversed, so no page lands where it came from.
        let to: Vec<u32> = (0..pages).rev().map(|s| pages + s).collect();
        let r = m
            .wait(m.load(ns, 0, 0, &hs, &to, LoadWait::BestEffort).unwrap(), wait)
            .unwrap();
        assert_eq!((r.pages, r.failed), (pages as usize, 0));
        for (i, &s) in to.iter().enumerate() {
            assert!(
                dev.page_matches(s, 1000 + i as u64).unwrap(),
                "page {i} in device page {s}"
            );
        }
        // The 21st page's copy fails: 20 leading pages are loaded, whatever the order
        // in which the workers ended the others.
        m.attach_device(ns, 0, 0, Arc::new(FailsAt(dev.clone(), to[20])))
            .unwrap();
        let r = m
            .wait(m.load(ns, 0, 0, &hs, &to, LoadWait::BestEffort).unwrap(), wait)
            .unwrap();
        assert_eq!((r.pages, r.failed), (20, pages as usize - 20));
        assert_eq!(m.open_grants(), 0);
    }
}
