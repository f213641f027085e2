//! How the host arena's slots fit the engines' pages.
//!
//! With `host.slot_bytes = 0` (the default) the arena is mapped at start but cut into
//! slots only at the first registration: slots of that layout's largest object, plus
//! room for the Mooncake integrity trailer where the pool seals objects in place, rounded
//! up to 64 bytes. A restart reopens it with the manifest's slot size, so recovery finds
//! every page where it was. Every registration, fitted or not, is then checked against
//! the slots: a layout whose objects fit is served (a smaller one wastes the difference,
//! which `kvtier status` shows per model), a larger one is refused with
//! [`BackendError::SlotTooSmall`], which names both sizes and `host.slot_bytes`.

use crate::layout::Layout;
use crate::manager::ManagerError;
use crate::pool::mooncake::integrity::MAC_LEN;

use super::{BackendError, ManagedTiers, TiersConfig};

/// Bytes a fitted slot keeps after the largest object: the integrity trailer when a
/// Mooncake pool seals objects (so they move straight between the slot and the store,
/// never through staging), else none.
pub(super) fn tail_bytes(cfg: &TiersConfig) -> u64 {
    if cfg.shared_pool.as_ref().is_some_and(|s| s.sealed) {
        MAC_LEN as u64
    } else {
        0
    }
}

/// The slot size fitted to `layout`: its largest object and `tail`, rounded up to 64.
pub(super) fn fitted_slot(layout: &Layout, tail: u64) -> u64 {
    (layout.max_object_bytes() + tail).div_ceil(64) * 64
}

impl ManagedTiers {
    /// Cuts an unfitted arena into slots fitted to `layout` ([`fitted_slot`]), once, at
    /// the first registration; then checks that `layout`'s objects fit the arena's slots.
    pub(super) fn fit_arena(&self, layout: &Layout) -> Result<(), BackendError> {
        let mut unfitted = self.unfitted.lock();
        if let Some(u) = unfitted.as_ref() {
            let slot = fitted_slot(layout, tail_bytes(&self.cfg));
            u.fits(slot).map_err(ManagerError::from)?;
            if let Some(u) = unfitted.take() {
                let arena = self
                    .mgr
                    .stores()
                    .adopt_arena(u.fit(slot).map_err(ManagerError::from)?)?;
                let mut fence = self.fence.lock();
                fence
                    .attach(&arena, None, self.cfg.fence_timeout)
                    .map_err(|source| BackendError::Manifest {
                        path: fence.path().display().to_string(),
                        source,
                    })?;
            }
        }
        let (Some(arena), need) = (self.mgr.stores().arena(), layout.max_object_bytes()) else {
            return Ok(());
        };
        let slot = arena.slot_bytes() as u64;
        if need <= slot {
            return Ok(());
        }
        let how = if self.cfg.slot_bytes == 0 {
            "fitted to the first layout that registered (host.slot_bytes = 0, the default)".to_owned()
        } else {
            format!("as host.slot_bytes = {} sets them", self.cfg.slot_bytes)
        };
        Err(BackendError::SlotTooSmall { need, slot, how })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::config::DaemonConfig;
    use crate::layout::LayoutSpec;
    use crate::pool::mooncake::integrity::KeyMaterial;

    #[test]
    fn fitted_slots_hold_the_largest_object_and_the_mac_where_a_mooncake_pool_seals_objects() {
        let l = LayoutSpec::mha(4, 2, 64, 2, 16).build().unwrap();
        assert_eq!(fitted_slot(&l, 0), 16 << 10);
        assert_eq!(fitted_slot(&l, MAC_LEN as u64), (16 << 10) + 64);
        let odd = LayoutSpec::mha(1, 1, 3, 2, 5).build().unwrap();
        assert_eq!((odd.max_object_bytes(), fitted_slot(&odd, 0)), (30, 64));

        // No pool, the local pool, a Mooncake pool without integrity: no trailer room;
        // with integrity's key material (read at start): the MAC's 32 bytes.
        let flags = |p: &[(&str, &str)]| -> Vec<(String, String)> {
            p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        assert_eq!(tail_bytes(&DaemonConfig::default().tiers()), 0);
        let mut c = DaemonConfig::load(
            None,
            Vec::new(),
            &flags(&[
                ("pool.kind", "mooncake"),
                ("mooncake.master", "10.0.0.1:50051"),
                ("mooncake.integrity", "false"),
            ]),
        )
        .unwrap();
        assert_eq!(tail_bytes(&c.tiers()), 0);
        c.mooncake.integrity_key = Some(KeyMaterial(vec![7; 32]));
        assert_eq!(tail_bytes(&c.tiers()), MAC_LEN as u64);
    }
}
