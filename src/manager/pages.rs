//! The page directory as a component: the directory state behind its read-mostly lock
//! ([`Rank::Dir`]), its lock-free lookup view, and the event log its writers publish to.
//! `Pages` owns the three; nothing else takes the lock or appends page events.
//!
//! Writers get a [`DirWrite`], which publishes the directory's new events when dropped,
//! still under the lock, so events enter the log in sequence order. Prefix lookups take
//! no lock: [`Pages::lookup`] reads the view, which the writer keeps current.

use std::sync::Arc;

use parking_lot::{RwLock, RwLockReadGuard};

use super::ManagerError;
use super::locks::{Ordered, Rank};
use super::state::{DirState, DirWrite};
use crate::clock::Clock;
use crate::directory::{DirView, Directory, DirectoryError, PageId, PageInfo};
use crate::events::EventLog;
use crate::layout::Layout;
use crate::page::{KeyScheme, Namespace, NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::wire::PrefixHit;

/// Records per chunk when a walk over the directory lets go of its lock between chunks.
const WALK_CHUNK: usize = 16 * 1024;

/// The directory, its lookup view and its event log.
pub struct Pages {
    /// [Dir] The directory, key schemes and host slot map. Readers (status, hint
    /// resolution, victim walks) take it shared; writers take it exclusively through
    /// `write()`, which publishes events on release. Prefix lookups do not take it: they
    /// read `view`.
    dir: RwLock<DirState>,
    /// The directory's lock-free read side: lookups go through it and take no lock.
    view: Arc<DirView>,
    events: EventLog,
    clock: Arc<dyn Clock>,
}

impl Pages {
    pub(super) fn new(dir: Directory, event_ring: usize, clock: Arc<dyn Clock>) -> Self {
        let view = dir.view();
        Self {
            dir: RwLock::new(DirState::new(dir)),
            view,
            events: EventLog::new(event_ring),
            clock,
        }
    }

    /// The page event log (the one internal stream publishers read).
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// A namespace's layout.
    pub fn layout(&self, ns: NamespaceId) -> Result<Layout, ManagerError> {
        Ok(self.read().dir.layout(ns)?.clone())
    }

    /// The pool key scheme of a namespace.
    pub fn key_scheme(&self, ns: NamespaceId) -> Result<KeyScheme, ManagerError> {
        let st = self.read();
        st.dir.layout(ns)?;
        Ok(st.keys[ns.0 as usize].clone())
    }

    /// Every registered namespace with its id and layout (what a journal must record).
    pub fn namespaces(&self) -> Vec<(NamespaceId, Namespace, Layout)> {
        let st = self.read();
        st.dir
            .namespaces()
            .map(|(id, n, l)| (id, n.clone(), l.clone()))
            .collect()
    }

    /// A contiguous-prefix lookup through the directory's lock-free view. It takes no
    /// lock, so it has no rank and may run while this thread or any other holds any
    /// lock, `dir` included: a store or an eviction round never delays it.
    pub(super) fn lookup(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<PrefixHit, ManagerError> {
        if !self.view.knows(ns) {
            return Err(DirectoryError::UnknownNamespace(ns.0).into());
        }
        Ok(self.view.lookup_prefix(ns, hashes))
    }

    /// Shared access to the directory state: readers other than prefix lookups.
    pub(super) fn read(&self) -> Ordered<RwLockReadGuard<'_, DirState>> {
        Ordered::take(Rank::Dir, || self.dir.read())
    }

    /// Objects in the largest page of the registered namespaces' layouts (1 when none is
    /// registered): what tier capacities in pages divide slots by.
    pub(super) fn largest_page_objects(&self) -> usize {
        self.read()
            .dir
            .namespaces()
            .map(|(_, _, l)| l.object_count())
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// Exclusive access to the directory state; publishes its events when dropped.
    pub(super) fn write(&self) -> DirWrite<'_> {
        let g = Ordered::take(Rank::Dir, || self.dir.write());
        DirWrite::new(g, &self.events, &self.clock)
    }

    /// Walks the directory in chunks of [`WALK_CHUNK`] records under the read lock,
    /// released between chunks, so lookups and writers never wait for a whole walk.
    /// `f` sees each chunk's state and range. Pages may change between chunks: callers
    /// re-check what they act on under the lock that acts.
    pub(super) fn walk(&self, mut f: impl FnMut(&DirState, std::ops::Range<usize>)) {
        let mut start = 0;
        loop {
            let st = self.read();
            let end = st.dir.order().record_slots().min(start + WALK_CHUNK);
            if start >= end {
                return;
            }
            f(&st, start..end);
            start = end;
        }
    }

    /// Eviction candidates of `tier` that `keep` accepts, gathered in chunks (the
    /// directory lock is let go between them).
    pub(super) fn candidates(
        &self,
        tier: TierKind,
        keep: impl Fn(&DirState, PageId, &PageInfo) -> bool,
    ) -> Vec<(PageId, PageInfo)> {
        let mut out = Vec::new();
        self.walk(|st, range| {
            out.extend(
                st.dir
                    .order()
                    .eviction_candidates_in(tier, range)
                    .into_iter()
                    .filter(|(id, i)| keep(st, *id, i)),
            );
        });
        out
    }

    /// Moves a session's pages between the idle and normal eviction classes: the pages
    /// are listed under the read lock (O(pages of the session)), then reclassed under the
    /// write lock in chunks, so lookups never wait behind a big session.
    pub(super) fn reclass_session(&self, session: u32, idle: bool, ended: bool) {
        const CHUNK: usize = 4096;
        if session == 0 {
            return;
        }
        self.write().dir.order_mut().note_session_idle(session, idle);
        let pages = self.read().dir.order().session_pages(session);
        for chunk in pages.chunks(CHUNK) {
            let mut st = self.write();
            for &p in chunk {
                st.dir.order_mut().set_session_page_idle(p, session, idle);
            }
        }
        if ended {
            self.write().dir.order_mut().end_session(session);
        }
    }

    /// Sets the retain priority of the pages of `hashes` the directory holds, and with
    /// `disown` takes them out of their session (the policy's `Retain` move).
    pub(super) fn set_retain(&self, ns: NamespaceId, hashes: &[PageHash], priority: i8, disown: bool) {
        let mut st = self.write();
        for h in hashes {
            if let Some(id) = st.dir.find(ns, h) {
                st.dir.order_mut().set_retain(id, priority);
                if disown {
                    st.dir.order_mut().set_session(id, 0);
                }
            }
        }
    }

    /// Objects the pool dropped on its own (`keys`): their pages are no longer
    /// pool-complete.
    pub(super) fn forget_pool_objects(&self, keys: Vec<String>) {
        if keys.is_empty() {
            return;
        }
        let mut st = self.write();
        for key in keys {
            for i in 0..st.keys.len() {
                let ns = NamespaceId(i as u16);
                let Ok(layout) = st.dir.layout(ns) else { continue };
                if let Ok((hash, obj)) = st.keys[i].parse(layout, &key) {
                    if let Some(id) = st.dir.find(ns, &hash) {
                        // `parse` checked `obj` against this layout: this cannot fail.
                        let _ = st.dir.set_object(id, TierKind::Pool, obj, false);
                    }
                    break;
                }
            }
        }
    }
}
