//! The rank's side of a transfer: device → arena slots for a store, arena slots →
//! device for a load, through the registered [`DeviceRegion`].

use std::sync::Arc;

use crate::protocol::ObjectSlot;
use crate::tier::device::ObjectCopy;
use crate::tier::host::{HostArena, SlotId};

use super::{Client, ClientError, StorePlan};

impl Client {
    fn device(&self) -> Result<Arc<dyn crate::tier::device::DeviceRegion>, ClientError> {
        self.device
            .read()
            .clone()
            .ok_or_else(|| ClientError::BadInput("register a device region first".into()))
    }

    fn check_slots(&self, arena: &HostArena, slots: &[ObjectSlot]) -> Result<(), ClientError> {
        for s in slots {
            let o = s.object as usize;
            if o >= self.layout.object_count() || s.slot >= arena.slots() {
                return Err(ClientError::Protocol(format!(
                    "grant names object {o} in slot {}",
                    s.slot
                )));
            }
        }
        Ok(())
    }

    /// Copies the plan's objects from the device into their slots, every page of the plan
    /// in one device batch (on a GPU: one stream order and one completion wait for the
    /// request, not one per page). Returns, per granted page, whether it was written.
    pub fn write_plan(&self, plan: &StorePlan, device_slots: &[u32]) -> Result<Vec<bool>, ClientError> {
        let dev = self.device()?;
        let objects = self.layout.objects();
        let mut batch = Vec::with_capacity(plan.pages.iter().map(|p| p.slots.len()).sum());
        for page in &plan.pages {
            let dev_slot = *device_slots
                .get(page.index as usize)
                .ok_or_else(|| ClientError::Protocol(format!("grant names page {}", page.index)))?;
            self.check_slots(&plan.arena, &page.slots)?;
            for s in &page.slots {
                let o = s.object as usize;
                let len = self.layout.object_bytes(o) as usize;
                // SAFETY: the grant gives this rank the slot exclusively until commit/abort,
                // and a grant names each slot once.
                let host = unsafe { plan.arena.slot_mut(SlotId(s.slot), len)? };
                batch.push(ObjectCopy::new(dev_slot, objects[o].part, host));
            }
        }
        // In copy before the bytes, stamped after them: a commit (and every load) checks
        // these, and a page another copy ran into meanwhile is not written.
        let before = super::fence::begin_copy(plan.stamps.as_deref(), &plan.pages);
        let copied = dev.copy_to_host(&mut batch);
        let written = super::fence::end_copy(plan.stamps.as_deref(), &plan.pages, &before);
        copied?;
        if written.contains(&false) {
            tracing::warn!("another copy ran into a granted slot during this store's; its page is not written");
        }
        Ok(written)
    }

    /// Copies granted pages from their slots into the device, in one device batch.
    pub(super) fn read_pages(
        &self,
        arena: &HostArena,
        pages: &[Vec<ObjectSlot>],
        device_slots: &[u32],
    ) -> Result<(), ClientError> {
        let dev = self.device()?;
        let objects = self.layout.objects();
        let mla = self.layout.attention() == crate::layout::AttentionKind::Mla;
        let mut batch = Vec::with_capacity(pages.iter().map(Vec::len).sum());
        for (slots, &dev_slot) in pages.iter().zip(device_slots) {
            self.check_slots(arena, slots)?;
            for s in slots {
                let o = s.object as usize;
                let len = self.layout.object_bytes(o) as usize;
                // SAFETY: the load grant holds the page against eviction; nobody writes it.
                let host = unsafe { arena.slot(SlotId(s.slot), len)? };
                let part = if mla {
                    crate::layout::Part::Latent
                } else {
                    objects[o].part
                };
                batch.push(ObjectCopy::new(dev_slot, part, host));
            }
        }
        dev.copy_from_host(&batch)?;
        Ok(())
    }
}
