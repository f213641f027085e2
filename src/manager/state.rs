//! The manager's directory state: the directory, the pool key scheme of each namespace,
//! and the host slot of every object on host. This is what lookups read, behind the
//! read-mostly lock of rank `Dir`; everything else the manager keeps (grants, timers,
//! queues, sessions) lives in its own table behind its own lock (see `locks`).
//!
//! Writers get a [`DirWrite`]: a write guard that moves the directory's new events into
//! the event log when it is dropped, still holding the lock, so events enter the log in
//! sequence order and no write section can forget to publish them.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use parking_lot::RwLockWriteGuard;

use super::locks::Ordered;
use crate::clock::Clock;
use crate::directory::{Directory, IdMap, PageId};
use crate::events::EventLog;
use crate::page::{KeyScheme, NamespaceId, PageHash};
use crate::tier::host::SlotId;

/// No slot for this object.
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// What the directory lock guards.
#[derive(Debug)]
pub(crate) struct DirState {
    pub dir: Directory,
    /// Pool key scheme per namespace id.
    pub keys: Vec<KeyScheme>,
    /// Host slot of every object of a page that has any object on host.
    pub host: IdMap<u32, Box<[u32]>>,
}

impl DirState {
    pub fn new(dir: Directory) -> Self {
        Self {
            dir,
            keys: Vec::new(),
            host: IdMap::default(),
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

    /// Every object's host slot of a page with any object on host ([`NO_SLOT`] for
    /// the objects not there), with one map lookup for the page.
    pub fn host_slots(&self, page: PageId) -> Option<&[u32]> {
        self.host.get(&page.0).map(|s| &s[..])
    }

    /// Records the host slots of several objects of one page, with one map lookup.
    pub fn set_host_slots(&mut self, page: PageId, objects: &[(usize, SlotId)], count: usize) {
        if objects.is_empty() {
            return;
        }
        let slots = self
            .host
            .entry(page.0)
            .or_insert_with(|| vec![NO_SLOT; count].into_boxed_slice());
        for &(obj, slot) in objects {
            if let Some(s) = slots.get_mut(obj) {
                *s = slot.0;
            }
        }
    }

    /// The live page with this id and hash, if the id still names it.
    pub fn same_page(&self, page: PageId, hash: &PageHash, ns: NamespaceId) -> bool {
        self.dir.find(ns, hash) == Some(page)
    }
}

/// Write access to the directory state. Dropping it publishes the directory's new events
/// (under the lock, so in sequence order) and then releases the lock.
pub(crate) struct DirWrite<'a> {
    guard: Ordered<RwLockWriteGuard<'a, DirState>>,
    events: &'a EventLog,
    clock: &'a Arc<dyn Clock>,
}

impl<'a> DirWrite<'a> {
    pub fn new(
        guard: Ordered<RwLockWriteGuard<'a, DirState>>,
        events: &'a EventLog,
        clock: &'a Arc<dyn Clock>,
    ) -> Self {
        let mut w = Self { guard, events, clock };
        let now = w.clock.now_ms();
        w.guard.dir.set_now(now);
        w
    }
}

impl Deref for DirWrite<'_> {
    type Target = DirState;

    fn deref(&self) -> &DirState {
        &self.guard
    }
}

impl DerefMut for DirWrite<'_> {
    fn deref_mut(&mut self) -> &mut DirState {
        &mut self.guard
    }
}

impl Drop for DirWrite<'_> {
    fn drop(&mut self) {
        let evs = self.guard.dir.drain_events();
        self.events.append(&evs);
    }
}
