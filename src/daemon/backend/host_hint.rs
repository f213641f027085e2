//! KV hints as the host-tier backend applies them.
//!
//! Pin and Retain act on complete host pages with a TTL (clipped to the configured
//! maximum; pins also to the pin budget). Prefetch to device answers how many pages are
//! staged in host and ready to load. Share and pool-bound moves need a pool backend and
//! come back `ignored: no_pool`. Only a malformed hint is an error.

use crate::hints::{Hint, HintError, HintOutcome, HintTarget, Reason};
use crate::page::{NamespaceId, PageHash};
use crate::protocol::MAX_PAGES;
use crate::tier::TierKind;

use super::host::{HostBackend, State};

const HOST: TierKind = TierKind::Host;

impl HostBackend {
    /// Pages of the target that are complete on host (for a prefix, the leading run).
    fn resolve(st: &State, ns: NamespaceId, target: &HintTarget) -> (Vec<PageHash>, usize) {
        let complete = |h: &PageHash| st.dir.find(ns, h).is_some_and(|id| st.dir.is_complete(id, HOST));
        match target {
            HintTarget::Pages(hs) => (hs.iter().filter(|h| complete(h)).copied().collect(), hs.len()),
            HintTarget::Prefix(hs) => (hs.iter().take_while(|h| complete(h)).copied().collect(), hs.len()),
            HintTarget::Session(_) => (Vec::new(), 0),
        }
    }

    fn validate(hint: &Hint) -> Result<(), HintError> {
        match hint.target() {
            HintTarget::Pages(h) | HintTarget::Prefix(h) if h.is_empty() => return Err(HintError::Empty),
            HintTarget::Pages(h) | HintTarget::Prefix(h) if h.len() > MAX_PAGES => {
                return Err(HintError::TooMany {
                    got: h.len(),
                    max: MAX_PAGES,
                });
            }
            _ => {}
        }
        match *hint {
            Hint::Pin { ttl_ms: 0, .. } | Hint::Retain { ttl_ms: 0, .. } => Err(HintError::ZeroTtl),
            Hint::Demote {
                to: TierKind::Device, ..
            } => Err(HintError::BadTier {
                kind: "demote",
                tier: TierKind::Device,
            }),
            Hint::Prefetch { to: TierKind::Pool, .. } => Err(HintError::BadTier {
                kind: "prefetch",
                tier: TierKind::Pool,
            }),
            _ => Ok(()),
        }
    }

    fn outcome(applied: usize, requested: usize, short: Reason) -> HintOutcome {
        if applied == 0 {
            HintOutcome::Ignored { reason: short }
        } else if applied < requested {
            HintOutcome::Clipped {
                applied,
                requested,
                reason: short,
            }
        } else {
            HintOutcome::Accepted { pages: applied }
        }
    }

    pub(super) fn apply_hint(&self, ns: NamespaceId, hint: &Hint) -> Result<HintOutcome, HintError> {
        Self::validate(hint)?;
        if let HintTarget::Session(_) = hint.target() {
            return Ok(HintOutcome::Ignored {
                reason: Reason::UnknownSession,
            });
        }
        let mut st = self.st.lock();
        let st = &mut *st;
        let (pages, requested) = Self::resolve(st, ns, hint.target());
        let now = self.clock.now_ms();
        Ok(match *hint {
            Hint::Share { .. } | Hint::Demote { to: TierKind::Pool, .. } => {
                HintOutcome::Ignored { reason: Reason::NoPool }
            }
            Hint::Prefetch { to: TierKind::Host, .. } => {
                if pages.len() == requested {
                    HintOutcome::Ignored {
                        reason: Reason::AlreadyThere,
                    }
                } else {
                    Self::outcome(0, requested, Reason::NotComplete)
                }
            }
            // Staged in host means ready for the engine to load.
            Hint::Prefetch { .. } => Self::outcome(pages.len(), requested, Reason::NotComplete),
            // A complete host copy exists: the device copy is an eviction candidate.
            Hint::Demote { .. } => Self::outcome(pages.len(), requested, Reason::NotComplete),
            Hint::Pin { tier, ttl_ms, .. } => {
                if tier != HOST {
                    return Ok(HintOutcome::Ignored {
                        reason: if tier == TierKind::Pool {
                            Reason::NoPool
                        } else {
                            Reason::WrongTier
                        },
                    });
                }
                let budget = st
                    .arena
                    .as_ref()
                    .map_or(0.0, |a| a.slots() as f64 * self.cfg.pin_budget) as usize;
                let mut applied = 0;
                for h in &pages {
                    let Some(id) = st.dir.find(ns, h) else { continue };
                    if !st.dir.is_pinned(id, HOST) {
                        if st.pinned >= budget {
                            break;
                        }
                        st.pinned += 1;
                        st.dir.set_pinned(id, HOST, true);
                    }
                    st.ttls.push((now + ttl_ms.min(self.cfg.max_pin_ttl_ms), ns, *h, true));
                    applied += 1;
                }
                let reason = if applied < pages.len() {
                    Reason::PinBudget
                } else if ttl_ms > self.cfg.max_pin_ttl_ms && applied > 0 {
                    return Ok(HintOutcome::Clipped {
                        applied,
                        requested,
                        reason: Reason::MaxTtl,
                    });
                } else {
                    Reason::UnknownPages
                };
                Self::outcome(applied, requested, reason)
            }
            Hint::Retain { priority, ttl_ms, .. } => {
                for h in &pages {
                    if let Some(id) = st.dir.find(ns, h) {
                        st.dir.set_retain(id, priority);
                        st.ttls.push((now + ttl_ms.min(self.cfg.max_pin_ttl_ms), ns, *h, false));
                    }
                }
                Self::outcome(pages.len(), requested, Reason::UnknownPages)
            }
        })
    }

    /// Undoes pins and retains whose TTL has ended.
    pub(super) fn expire_ttls(&self) {
        let now = self.clock.now_ms();
        let mut st = self.st.lock();
        let st = &mut *st;
        let due: Vec<_> = st.ttls.iter().filter(|t| t.0 <= now).copied().collect();
        if due.is_empty() {
            return;
        }
        st.ttls.retain(|t| t.0 > now);
        for (_, ns, h, pin) in due {
            // A later pin or retain of the same page keeps it.
            if st.ttls.iter().any(|t| t.1 == ns && t.2 == h && t.3 == pin) {
                continue;
            }
            let Some(id) = st.dir.find(ns, &h) else { continue };
            if pin {
                if st.dir.is_pinned(id, HOST) {
                    st.dir.set_pinned(id, HOST, false);
                    st.pinned = st.pinned.saturating_sub(1);
                }
            } else {
                st.dir.set_retain(id, 0);
            }
        }
    }
}
