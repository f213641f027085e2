//! Attached device regions as a component: the regions engines' ranks attached for
//! in-process copies, by (namespace, tp rank, pp rank), and the device pages per
//! namespace, behind their own lock ([`Rank::Devices`]). Nothing else takes the lock.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::ManagerError;
use super::locks::{Ordered, Rank};
use crate::page::NamespaceId;
use crate::tier::device::DeviceRegion;

/// Device pages per namespace (one rank's region), when known.
pub(super) type DevicePages = HashMap<NamespaceId, usize>;

/// Attached device regions and device pages per namespace.
#[derive(Default)]
pub(super) struct Devices {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    regions: HashMap<(NamespaceId, u16, u16), Arc<dyn DeviceRegion>>,
    pages: DevicePages,
}

impl Devices {
    fn lock(&self) -> Ordered<parking_lot::MutexGuard<'_, State>> {
        Ordered::take(Rank::Devices, || self.state.lock())
    }

    /// Holds the lock (tests: proving an operation does not need it).
    #[cfg(test)]
    pub(super) fn hold(&self) -> Box<dyn super::locks::Held + '_> {
        Box::new(self.lock())
    }

    /// Attaches (or replaces) one rank's region; its page count is the namespace's.
    pub(super) fn attach(&self, ns: NamespaceId, tp: u16, pp: u16, region: Arc<dyn DeviceRegion>) {
        let mut s = self.lock();
        s.pages.insert(ns, region.pages() as usize);
        s.regions.insert((ns, tp, pp), region);
    }

    /// The region of one rank, or a typed error naming it.
    pub(super) fn region(&self, ns: NamespaceId, tp: u16, pp: u16) -> Result<Arc<dyn DeviceRegion>, ManagerError> {
        self.lock()
            .regions
            .get(&(ns, tp, pp))
            .cloned()
            .ok_or(ManagerError::NoDevice { ns: ns.0, tp, pp })
    }

    /// Device pages per namespace, as a copy.
    pub(super) fn pages(&self) -> DevicePages {
        self.lock().pages.clone()
    }
}
