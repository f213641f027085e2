//! Advice for engines and deferred hints: two bounded queues behind their own lock.
//!
//! Both are bounded, with different overflow rules. Advice is a hint to the engine that
//! the next tick derives again, so a full advice queue drops its oldest entry. A deferred
//! hint is a promise to the caller, so a full deferred queue refuses the new hint and the
//! caller is answered `ignored: queue_full`.

use std::collections::VecDeque;

use parking_lot::{Mutex, MutexGuard};
use serde::Serialize;

use super::Manager;
use super::locks::{Ordered, Rank};
use crate::hints::{Hint, HintOutcome, Reason};
use crate::page::{NamespaceId, PageHash};
use crate::wire::MAX_SESSION_ADVICE;

/// Most advice entries kept; beyond that the oldest is dropped.
pub(crate) const MAX_ADVICE: usize = 4096;
/// Most deferred hints kept; beyond that new hints are answered `ignored: queue_full`.
pub(crate) const MAX_DEFERRED: usize = 4096;

/// Something the engine should do, because kvtier cannot touch device memory itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "advice", rename_all = "snake_case")]
pub enum Advice {
    /// Evict these device pages first (they have a complete colder copy).
    EvictFirst { ns: NamespaceId, hashes: Vec<PageHash> },
    /// Store these device pages to host (a demote or share needs a host copy first).
    Offload { ns: NamespaceId, hashes: Vec<PageHash> },
    /// These pages are staged in host and ready to load (a prefetch to device).
    ReadyToLoad { ns: NamespaceId, hashes: Vec<PageHash> },
    /// The pressure controller paused this session: stop admitting its turns. Goes to
    /// the namespace its pages live in.
    Pause { ns: NamespaceId, session_id: String },
    /// The session may run again.
    Resume { ns: NamespaceId, session_id: String },
}

impl Advice {
    pub fn ns(&self) -> NamespaceId {
        match self {
            Advice::EvictFirst { ns, .. }
            | Advice::Offload { ns, .. }
            | Advice::ReadyToLoad { ns, .. }
            | Advice::Pause { ns, .. }
            | Advice::Resume { ns, .. } => *ns,
        }
    }

    pub fn hashes(&self) -> &[PageHash] {
        match self {
            Advice::EvictFirst { hashes, .. } | Advice::Offload { hashes, .. } | Advice::ReadyToLoad { hashes, .. } => {
                hashes
            }
            Advice::Pause { .. } | Advice::Resume { .. } => &[],
        }
    }

    /// Whether the advice is about a session (Pause, Resume) rather than pages.
    pub fn is_session(&self) -> bool {
        matches!(self, Advice::Pause { .. } | Advice::Resume { .. })
    }

    /// Keeps the first `at` pages and returns the rest as advice of the same kind.
    pub(crate) fn split_off(&mut self, at: usize) -> Advice {
        match self {
            Advice::EvictFirst { ns, hashes } => Advice::EvictFirst {
                ns: *ns,
                hashes: hashes.split_off(at),
            },
            Advice::Offload { ns, hashes } => Advice::Offload {
                ns: *ns,
                hashes: hashes.split_off(at),
            },
            Advice::ReadyToLoad { ns, hashes } => Advice::ReadyToLoad {
                ns: *ns,
                hashes: hashes.split_off(at),
            },
            // Session advice names no pages: nothing to split.
            Advice::Pause { ns, session_id } => Advice::Pause {
                ns: *ns,
                session_id: session_id.clone(),
            },
            Advice::Resume { ns, session_id } => Advice::Resume {
                ns: *ns,
                session_id: session_id.clone(),
            },
        }
    }
}

/// The advice and deferred-hint queues as a component, behind their own lock
/// ([`Rank::Queues`]): filled after the directory work is done, read by engines.
#[derive(Debug, Default)]
pub struct EngineQueues {
    q: Mutex<Queues>,
}

impl EngineQueues {
    /// Both queues, under their lock.
    pub(super) fn lock(&self) -> Ordered<MutexGuard<'_, Queues>> {
        Ordered::take(Rank::Queues, || self.q.lock())
    }

    /// Takes the advice for engines gathered since the last call.
    pub fn take_advice(&self) -> Vec<Advice> {
        self.lock().take_advice()
    }

    /// Takes one namespace's advice, at most `max_pages` page hashes in all (an entry that
    /// does not fit is split); other namespaces' advice stays. Returns the advice, oldest
    /// first, and whether more of the namespace's is waiting.
    pub fn take_advice_for(&self, ns: NamespaceId, max_pages: usize) -> (Vec<Advice>, bool) {
        self.lock().take_advice_for(ns, max_pages)
    }

    /// Queues a hint for a later tick, or answers `ignored: queue_full` when the queue is full.
    pub(crate) fn defer(&self, ns: NamespaceId, hint: &Hint, pages: usize, reason: Reason) -> HintOutcome {
        if !self.lock().defer(ns, hint.clone()) {
            return HintOutcome::Ignored {
                reason: Reason::QueueFull,
            };
        }
        HintOutcome::Deferred { pages, reason }
    }

    /// Queues offload advice (if any); returns how many pages it names.
    pub(super) fn push_offload(&self, advice: Option<Advice>) -> usize {
        let Some(a) = advice else { return 0 };
        let n = a.hashes().len();
        self.lock().push_advice(a);
        n
    }
}

impl Manager {
    /// The advice for engines and the deferred hints.
    pub fn engine_queues(&self) -> &EngineQueues {
        &self.inner.queues
    }
}

/// The advice queue and the deferred-hint queue.
#[derive(Debug, Default)]
pub(crate) struct Queues {
    advice: VecDeque<Advice>,
    deferred: VecDeque<(NamespaceId, Hint)>,
}

impl Queues {
    /// Queues advice, dropping the oldest entry when full.
    pub fn push_advice(&mut self, a: Advice) {
        if self.advice.len() >= MAX_ADVICE {
            self.advice.pop_front();
        }
        self.advice.push_back(a);
    }

    /// Queues a hint for a later tick; `false` (and the hint is not queued) when full.
    pub fn defer(&mut self, ns: NamespaceId, hint: Hint) -> bool {
        if self.deferred.len() >= MAX_DEFERRED {
            return false;
        }
        self.deferred.push_back((ns, hint));
        true
    }

    pub fn deferred_len(&self) -> usize {
        self.deferred.len()
    }

    /// Every deferred hint, oldest first; the queue is left empty.
    pub fn take_deferred(&mut self) -> Vec<(NamespaceId, Hint)> {
        self.deferred.drain(..).collect()
    }

    /// Every advice entry, oldest first; the queue is left empty.
    pub fn take_advice(&mut self) -> Vec<Advice> {
        self.advice.drain(..).collect()
    }

    /// Takes namespace `ns`'s advice, oldest first, up to `max_pages` page hashes in all
    /// and [`MAX_SESSION_ADVICE`] session entries; an entry that does not fit is split and
    /// its rest kept first in line. Other namespaces' advice stays. Returns the advice and
    /// whether more of `ns`'s is left.
    pub fn take_advice_for(&mut self, ns: NamespaceId, max_pages: usize) -> (Vec<Advice>, bool) {
        let mut budget = max_pages;
        let mut sessions = MAX_SESSION_ADVICE;
        let mut taken = Vec::new();
        let mut more = false;
        let mut kept = VecDeque::with_capacity(self.advice.len());
        for mut a in self.advice.drain(..) {
            if a.ns() != ns {
                kept.push_back(a);
            } else if a.is_session() {
                // Session advice keeps its order among the page advice; it costs no page.
                if sessions == 0 {
                    more = true;
                    kept.push_back(a);
                } else {
                    sessions -= 1;
                    taken.push(a);
                }
            } else if a.hashes().is_empty() {
                // Advice about no page says nothing: dropped.
            } else if budget == 0 {
                more = true;
                kept.push_back(a);
            } else {
                if a.hashes().len() > budget {
                    kept.push_back(a.split_off(budget));
                    more = true;
                }
                budget -= a.hashes().len();
                taken.push(a);
            }
        }
        self.advice = kept;
        (taken, more)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hints::HintTarget;
    use crate::tier::TierKind;

    fn evict(i: u64) -> Advice {
        Advice::EvictFirst {
            ns: NamespaceId(0),
            hashes: vec![PageHash::from_u64(i)],
        }
    }

    fn pin(i: u64) -> Hint {
        Hint::Pin {
            target: HintTarget::Pages(vec![PageHash::from_u64(i)]),
            tier: TierKind::Host,
            ttl_ms: 10,
        }
    }

    #[test]
    fn a_full_advice_queue_drops_its_oldest_entry() {
        let mut q = Queues::default();
        for i in 0..MAX_ADVICE as u64 + 3 {
            q.push_advice(evict(i));
        }
        let all = q.take_advice();
        assert_eq!(all.len(), MAX_ADVICE);
        assert_eq!(all[0], evict(3), "the three oldest were dropped");
        assert_eq!(all[MAX_ADVICE - 1], evict(MAX_ADVICE as u64 + 2), "the newest was kept");
        assert!(q.take_advice().is_empty());
    }

    #[test]
    fn a_full_deferred_queue_refuses_new_hints_and_keeps_the_old() {
        let mut q = Queues::default();
        for i in 0..MAX_DEFERRED as u64 {
            assert!(q.defer(NamespaceId(1), pin(i)));
        }
        assert!(!q.defer(NamespaceId(1), pin(99_999)), "full: refused");
        assert_eq!(q.deferred_len(), MAX_DEFERRED);
        let all = q.take_deferred();
        assert_eq!(all.first(), Some(&(NamespaceId(1), pin(0))));
        assert_eq!(all.last(), Some(&(NamespaceId(1), pin(MAX_DEFERRED as u64 - 1))));
        assert_eq!(q.deferred_len(), 0);
        assert!(q.defer(NamespaceId(1), pin(5)), "room again once drained");
    }

    #[test]
    fn session_advice_keeps_its_place_costs_no_page_and_is_bounded() {
        let ns = NamespaceId(0);
        let pause = |i: usize| Advice::Pause {
            ns,
            session_id: format!("s{i}"),
        };
        let mut q = Queues::default();
        q.push_advice(evict(1));
        q.push_advice(pause(0));
        q.push_advice(evict(2));
        q.push_advice(Advice::Resume {
            ns: NamespaceId(9),
            session_id: "other".into(),
        });
        let (got, more) = q.take_advice_for(ns, 1);
        assert_eq!(
            got,
            vec![evict(1), pause(0)],
            "a zero page budget still hands session advice"
        );
        assert!(more);
        assert_eq!(q.take_advice_for(ns, 8), (vec![evict(2)], false));
        for i in 0..MAX_SESSION_ADVICE + 2 {
            q.push_advice(pause(i));
        }
        let (got, more) = q.take_advice_for(ns, 8);
        assert_eq!(got.len(), MAX_SESSION_ADVICE);
        assert!(more);
        assert_eq!(
            q.take_advice_for(ns, 8),
            (vec![pause(MAX_SESSION_ADVICE), pause(MAX_SESSION_ADVICE + 1)], false)
        );
        assert_eq!(q.take_advice().len(), 1, "the other namespace's advice stayed");
    }
}
