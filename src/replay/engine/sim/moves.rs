//! How pages move between tiers in the emulator: eviction with spill to the next tier,
//! write-through on store, and the session policy's moves, carried out as the manager
//! carries them out (`manager::policy`).

use super::Sim;
use crate::clock::Clock;
use crate::directory::{EvictClass, PageId};
use crate::policy::{Move, SessionClass};
use crate::replay::engine::PolicyKind;
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

    /// One move of the session policy.
    pub(super) fn apply_move(&mut self, m: Move) {
        let page_bytes = self.cfg.page_bytes;
        match m {
            // To the pool (write-back), then the host copy goes; without a pool the policy
            // sends none.
            Move::Demote { hashes, .. } => {
                for h in &hashes {
                    let Some(id) = self.dir.find(self.ns, h) else { continue };
                    if !self.dir.is_complete(id, TierKind::Host) || self.cap(TierKind::Pool) == 0 {
                        continue;
                    }
                    if !self.dir.is_complete(id, TierKind::Pool) {
                        self.dir.set_page(id, TierKind::Pool, true);
                        self.out.bytes.host_pool += page_bytes;
                    }
                    self.dir.set_page(id, TierKind::Host, false);
                    self.log_move(id, TierKind::Host, TierKind::Pool);
                }
                self.evict(TierKind::Pool);
            }
            // Pool to host; the engine loads from host when its turn comes.
            Move::Stage { hashes, .. } => {
                for h in &hashes {
                    let Some(id) = self.dir.find(self.ns, h) else { continue };
                    if self.dir.is_complete(id, TierKind::Pool)
                        && !self.dir.is_complete(id, TierKind::Host)
                        && !self.dir.is_complete(id, TierKind::Device)
                    {
                        self.dir.set_page(id, TierKind::Host, true);
                        self.out.bytes.pool_host += page_bytes;
                        self.dir.order_mut().touch(id, false);
                        // Protected until loaded or the TTL ends, at most half of host
                        // at once: the daemon's rule for staged pages.
                        if self.dir.order().protected_pages() < self.cap(TierKind::Host) / 2 {
                            let until_ms = self.clock.now_ms() + self.stage_protect_ms;
                            self.dir.order_mut().set_class(id, EvictClass::Protected { until_ms });
                        }
                        self.log_move(id, TierKind::Pool, TierKind::Host);
                    }
                }
                self.evict(TierKind::Host);
            }
            Move::DropHost { hashes, .. } => {
                for h in &hashes {
                    if let Some(id) = self.dir.find(self.ns, h)
                        && self.dir.is_complete(id, TierKind::Device)
                    {
                        self.dir.set_page(id, TierKind::Host, false);
                    }
                }
            }
            Move::Retain {
                hashes,
                priority,
                disown,
                ..
            } => {
                for h in &hashes {
                    if let Some(id) = self.dir.find(self.ns, h) {
                        self.dir.order_mut().set_retain(id, priority);
                        if disown {
                            self.dir.order_mut().set_session(id, 0);
                        }
                    }
                }
            }
        }
    }

    /// Puts the pages of the session tagged `tag` in `class`, as the daemon's manager
    /// does with the policy's class changes.
    pub(super) fn set_class(&mut self, tag: u32, class: SessionClass) {
        match class {
            SessionClass::Normal => self.dir.order_mut().set_session_idle(tag, false),
            SessionClass::Idle => self.dir.order_mut().set_session_idle(tag, true),
            SessionClass::Ended => self.dir.order_mut().end_session(tag),
        }
    }

    /// Evicts `tier` down to its capacity minus a small slack.
    pub(super) fn evict(&mut self, tier: TierKind) {
        let cap = self.cap(tier);
        let used = self.dir.complete_count(tier);
        if used <= cap {
            return;
        }
        let n = used - cap + cap / EVICT_SLACK_DIVISOR;
        // The directory's own order, the one the daemon's eviction and device advice
        // follow: the idle and ended classes first, then retain priority, then recency.
        let victims = self.dir.order().victims(tier, n, |_| false);
        let mut spilled = false;
        for id in victims {
            let colder = tier.colder().filter(|&c| self.cap(c) > 0);
            let spill_to = match (self.exclusive(), self.policy, colder) {
                (true, _, Some(c)) => Some(c),
                (false, PolicyKind::WriteThrough, Some(TierKind::Pool)) => Some(TierKind::Pool),
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
                self.dir.order_mut().set_retain(id, 0);
            }
            self.dir.set_page(id, tier, false);
            if tier == TierKind::Host && self.dir.is_complete(id, TierKind::Pool) {
                self.log_move(id, TierKind::Host, TierKind::Pool);
            }
        }
        if let (true, Some(c)) = (spilled, tier.colder()) {
            self.evict(c);
        }
    }
}
