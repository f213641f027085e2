//! Re-adopting host pages after a daemon restart.
//!
//! The host arena is a shared-memory file that outlives the daemon process. A restarted
//! daemon reopens it without truncating ([`super::Stores::open_existing_arena`]), verifies its
//! own records of what each slot held, and hands every page that checked out back to the
//! manager ([`Mover::adopt_host_page`]). What is in the file is the caller's to vouch
//! for: the manager only books the slots and marks the pages complete on host. A journal
//! learns what a page that reached host by other ways than a commit (staged back from the
//! pool) holds through [`Mover::read_host_page`].

use super::Manager;

impl Manager {
    /// Counts what a start-up recovery found, for operators (`/metrics`): `counts` in
    /// [`crate::manager::RECOVERY_REASONS`] order.
    pub fn record_recovery(&self, counts: [u64; crate::manager::RECOVERY_REASONS.len()]) {
        self.inner.stats.recovered(counts);
    }
}

/// The mover's side of recovery (the daemon's journal is its one user).
#[cfg(any(feature = "daemon", test))]
mod journal_pages {
    use crate::manager::ManagerError;
    use crate::manager::tiers::Mover;
    use crate::page::{NamespaceId, PageHash};
    use crate::tier::TierKind;
    use crate::tier::host::SlotId;

    /// Host pages the mover books or reads for recovery (their slots are the mover's to lease
    /// and free). The daemon's journal is their one user.
    impl Mover<'_> {
        /// Runs `f` over a page complete on host: each object's slot and bytes, in canonical
        /// order. The page is leased meanwhile, so it is neither evicted nor rewritten under
        /// `f`. `None` when the page is not complete on host.
        pub(crate) fn read_host_page<R>(
            &self,
            ns: NamespaceId,
            hash: &PageHash,
            f: impl FnOnce(&[(SlotId, &[u8])]) -> R,
        ) -> Option<R> {
            let arena = self.stores.arena()?;
            let layout = self.pages.layout(ns).ok()?;
            let (lease, slots) = {
                let st = self.read();
                let id = st.dir.find(ns, hash)?;
                if !st.dir.is_complete(id, TierKind::Host) {
                    return None;
                }
                let slots: Vec<SlotId> = (0..layout.object_count())
                    .map(|o| st.host_slot(id, o))
                    .collect::<Option<_>>()?;
                (self.grants().lease_scoped(self.grants, id), slots)
            };
            let objects: Result<Vec<(SlotId, &[u8])>, _> = slots
                .iter()
                .enumerate()
                // SAFETY: the page is leased: its slots are not freed or rewritten until the lease drops.
                .map(|(o, &s)| unsafe { arena.slot(s, layout.object_bytes(o) as usize) }.map(|b| (s, b)))
                .collect();
            let out = objects.ok().map(|o| f(&o));
            drop(lease);
            out
        }

        /// Marks a page complete on host whose objects already sit in `slots` (one per object
        /// of the layout, in canonical order). The slots are taken out of the free list.
        pub(crate) fn adopt_host_page(
            &self,
            ns: NamespaceId,
            hash: &PageHash,
            slots: &[SlotId],
        ) -> Result<(), ManagerError> {
            let arena = self.stores.arena().ok_or(ManagerError::NoNamespace)?;
            let mut st = self.write();
            let count = st.dir.layout(ns)?.object_count();
            if slots.len() != count {
                return Err(ManagerError::GrantMismatch {
                    id: 0,
                    pages: count,
                    got: slots.len(),
                });
            }
            if let Some(bad) = slots.iter().find(|s| s.0 >= arena.slots()) {
                return Err(ManagerError::Arena(crate::tier::host::ArenaError::BadSlot(bad.0)));
            }
            let id = st.dir.find_or_insert(ns, hash)?;
            for (o, &slot) in slots.iter().enumerate() {
                if !arena.claim(slot) {
                    return Err(ManagerError::Config(format!("slot {} is adopted twice", slot.0)));
                }
                st.set_host_slot(id, o, count, Some(slot));
                st.dir.set_object(id, TierKind::Host, o, true)?;
            }
            drop(st);
            Ok(())
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
    use crate::page::PageHash;
    use crate::tier::host::SlotId;

    #[test]
    fn adopted_pages_are_host_hits_and_keep_their_slots() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = ManagerConfig::in_dir(dir.path(), 1 << 20, None);
        let layout = LayoutSpec::mha(2, 2, 32, 2, 4).build().unwrap();
        let slot = layout.max_object_bytes().div_ceil(64) * 64;
        // A first life writes the arena file.
        std::fs::write(&cfg.host_path, vec![7u8; 1 << 20]).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cfg.host_path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let m = Manager::new(cfg, SimClock::new()).unwrap();
        let (arena, found) = m.stores().open_existing_arena(slot).unwrap();
        assert_eq!(found, 1 << 20);
        assert!(m.stores().open_existing_arena(slot).is_err());
        let ns = m.register_namespace(Namespace::model("m"), layout).unwrap();
        assert_eq!(m.pages().namespaces()[0].1, Namespace::model("m"));
        let h = PageHash::from_u64(5);
        m.mover().adopt_host_page(ns, &h, &[SlotId(3), SlotId(9)]).unwrap();
        assert_eq!(m.lookup(ns, &[h]).unwrap().host, 1);
        assert_eq!(arena.used(), 2);
        // SAFETY: slot 3 was adopted above and nothing writes it while this test reads it.
        assert_eq!(unsafe { arena.slot(SlotId(3), 4).unwrap() }, &[7, 7, 7, 7]);
        let g = m
            .begin_load(ns, 0, 0, &[h], crate::manager::LoadWait::BestEffort, 1)
            .unwrap();
        assert_eq!(
            g.pages[0].objects.iter().map(|o| o.1).collect::<Vec<_>>(),
            vec![SlotId(3), SlotId(9)]
        );
        assert!(
            m.mover()
                .adopt_host_page(ns, &PageHash::from_u64(6), &[SlotId(3), SlotId(4)])
                .is_err()
        );
        assert!(
            m.mover()
                .adopt_host_page(ns, &PageHash::from_u64(6), &[SlotId(4)])
                .is_err()
        );
        let leases = |m: &Manager| m.grants().lease_count();
        let before = leases(&m);
        let read = m.mover().read_host_page(ns, &h, |objs| {
            objs.iter().map(|&(s, b)| (s, b.len(), b[0])).collect::<Vec<_>>()
        });
        let len = m.pages().layout(ns).unwrap().object_bytes(0) as usize;
        assert_eq!(read, Some(vec![(SlotId(3), len, 7), (SlotId(9), len, 7)]));
        assert_eq!(m.mover().read_host_page(ns, &PageHash::from_u64(6), |_| ()), None);
        assert_eq!(leases(&m), before, "the read gave its lease back");
    }
}
