//! In-process host I/O without a device: whole objects written from caller buffers
//! (HiCache-style batch set from host memory) and objects read back.

use super::grants::{Grant, GrantKind, GrantPage};
use super::{Manager, ManagerError};
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;

/// A page and the bytes of some of its objects, by object index.
pub type PageObjects<'a> = (PageHash, Vec<(usize, &'a [u8])>);

impl Manager {
    /// In process: writes whole objects from caller buffers into host, all objects of a
    /// page or none (HiCache-style batch set from host memory). Returns pages committed.
    pub fn put_objects(&self, ns: NamespaceId, pages: &[PageObjects<'_>]) -> Result<usize, ManagerError> {
        self.inner.cfg.check_batch(pages.len())?;
        let layout = self.pages().layout(ns)?;
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
        let arena = self.stores().arena().ok_or(ManagerError::NoNamespace)?;
        let need: usize = pages.iter().map(|(_, o)| o.len()).sum();
        if arena.free_slots() < need as u32 {
            self.mover().make_host_room(need - arena.free_slots() as usize);
        }
        let mut written = vec![false; pages.len()];
        let mut grant_pages = Vec::new();
        {
            let mut st = self.write();
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
        let id = self.grants().insert(Grant {
            ns,
            kind: GrantKind::Store,
            pages: grant_pages,
            owner: 0,
        });
        let committed = self.commit_store(id, &written);
        self.mover().usage_grew(TierKind::Host);
        committed
    }

    /// In process: reads one object of a page complete on host into `buf`.
    pub fn read_host_object(
        &self,
        ns: NamespaceId,
        hash: &PageHash,
        obj: usize,
        buf: &mut [u8],
    ) -> Result<bool, ManagerError> {
        let layout = self.pages().layout(ns)?;
        let arena = self.stores().arena().ok_or(ManagerError::NoNamespace)?;
        let (lease, slot) = {
            let st = self.read();
            let Some(id) = st.dir.find(ns, hash) else {
                return Ok(false);
            };
            if !st.dir.is_complete(id, TierKind::Host) {
                return Ok(false);
            }
            let Some(slot) = st.host_slot(id, obj) else {
                return Ok(false);
            };
            // Leased under the read lock that saw it complete: eviction, which drops
            // host pages under the write lock, cannot run in between.
            (self.grants().lease_scoped(&self.inner.grants, id), slot)
        };
        let len = layout.object_bytes(obj) as usize;
        // SAFETY: leased above: not freed or rewritten until the lease drops.
        let res = unsafe { arena.slot(slot, len) }.map(|src| {
            if buf.len() >= len {
                buf[..len].copy_from_slice(src);
            }
        });
        drop(lease);
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
