//! How pages move between tiers in the emulator: eviction with spill to the next tier,
//! write-through on store, and the pressure controller's demotions and prefetches.

use super::Sim;
use crate::directory::PageId;
use crate::policy::select_victims;
use crate::replay::engine::PolicyKind;
use crate::session::pressure::{demote_session_pages, prefetch_chain};
use crate::tier::TierKind;

/// Each eviction frees this fraction of the tier beyond what is needed, so that eviction
/// scans stay rare; the same for every policy.
const EVICT_SLACK_DIVISOR: usize = 256;

impl Sim<'_> {
    /// A freshly computed page: write-through copies it on at once.
    pub(super) fn store_new(&mut self, id: PageId) {
        if self.policy != PolicyKind::WriteThrough {
            return;
        }
        if self.cap(TierKind::Host) > 0 {
            self.dir.set_page(id, TierKind::Host, true);
            self.out.bytes.device_host += self.cfg.page_bytes;
        }
        if self.cap(TierKind::Pool) > 0 {
            self.dir.set_page(id, TierKind::Pool, true);
            self.out.bytes.host_pool += self.cfg.page_bytes;
        }
    }

    /// A paused session: its device pages become the first eviction candidates (idle
    /// sessions go first) and get their host copy on the way out, so the device room goes
    /// to active sessions only when they need it and nothing is copied twice. With a pool,
    /// its host pages get a pool copy now, so that host can drop them later for free.
    pub(super) fn demote(&mut self, idx: u32) {
        if self.cap(TierKind::Pool) > 0 {
            let backed = demote_session_pages(&mut self.dir, idx, TierKind::Host, TierKind::Pool);
            self.out.bytes.host_pool += backed.copied as u64 * self.cfg.page_bytes;
            for &id in &backed.pages {
                self.dir.set_retain(id, 0);
            }
            self.evict(TierKind::Pool);
        }
    }

    /// Brings the session's latest chain back to the device ahead of its next turn.
    pub(super) fn prefetch(&mut self, s: usize) {
        let Some(i) = self.last_req[s] else { return };
        let blocks = &self.w.requests[i].blocks;
        let copied = prefetch_chain(&mut self.dir, self.ns, blocks, TierKind::Device);
        for &(id, src) in &copied {
            self.out.bytes.host_device += self.cfg.page_bytes;
            if src == TierKind::Pool {
                self.out.bytes.pool_host += self.cfg.page_bytes;
            } else {
                self.dir.set_page(id, TierKind::Host, false);
            }
        }
        for (id, _) in copied.iter().rev() {
            self.dir.touch(*id, false);
        }
        self.evict(TierKind::Device);
        self.evict(TierKind::Host);
    }

    /// Evicts `tier` down to its capacity minus a small slack.
    pub(super) fn evict(&mut self, tier: TierKind) {
        let cap = self.cap(tier);
        let used = self.dir.complete_count(tier);
        if used <= cap {
            return;
        }
        let n = used - cap + cap / EVICT_SLACK_DIVISOR;
        let cands = self.dir.eviction_candidates(tier);
        let victims = if self.aware() && tier == TierKind::Device {
            let table = &self.table;
            select_victims(cands, n, |s| table.is_idle(s))
        } else {
            select_victims(cands, n, |_| false)
        };
        let mut spilled = false;
        for id in victims {
            let colder = tier.colder().filter(|&c| self.cap(c) > 0);
            let spill_to = match (self.policy, colder) {
                (PolicyKind::SessionAware, Some(c)) => Some(c),
                (PolicyKind::WriteThrough, Some(TierKind::Pool)) => Some(TierKind::Pool),
                _ => None,
            };
            if let Some(c) = spill_to {
                let held = TierKind::ALL.iter().any(|&t| t >= c && self.dir.is_complete(id, t));
                if !held {
                    self.dir.set_page(id, c, true);
                    spilled = true;
                    match tier {
                        TierKind::Device => self.out.bytes.device_host += self.cfg.page_bytes,
                        _ => self.out.bytes.host_pool += self.cfg.page_bytes,
                    }
                }
            }
            if self.dir.info(id).retain == i8::MIN {
                self.dir.set_retain(id, 0);
            }
            self.dir.set_page(id, tier, false);
        }
        if let (true, Some(c)) = (spilled, tier.colder()) {
            self.evict(c);
        }
    }
}
