//! The session event stream: every pause and resume the session policy's pressure
//! controller decides, numbered, for routers.
//!
//! Engines get the same decisions as Pause/Resume advice in their advice stream, and
//! `/v1/sessions/advice` hands routers a queue of them; both are *taken* (each item is
//! answered once). Events are not: [`SessionEventLog`] is a bounded ring read from a
//! sequence number, like the page event log, so the ZMQ session publisher, the admin
//! socket's `/v1/sessions/events` stream and any number of other readers each keep their
//! own position and none of them takes anything from the advice queues.
//!
//! Its mutex is a leaf, outside the manager's ranked locks: it is taken only to append
//! or copy events out, with no other lock held and none taken inside.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::Serialize;

use crate::events::{Batch, SeqRing, Sequenced};
use crate::policy::{Advice, Usage};

/// Session events kept for readers that fall behind (older ones are reported lost).
pub const SESSION_EVENT_RING: usize = 4096;

/// Whether a session was paused or resumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionEventKind {
    Pause,
    Resume,
}

/// Why the controller paused or resumed a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionEventReason {
    /// Host utilisation reached the pause watermark; an acting session was paused.
    Pressure,
    /// A session marked to pause under pressure reached its tool boundary (it started
    /// acting) and was paused there.
    ToolBoundary,
    /// Host utilisation fell to the resume watermark; the session may run again.
    Room,
    /// The pause reached the forced-resume cap, whatever the utilisation.
    CapExpired,
    /// An engine or router reported the session reasoning again while it was paused.
    Reported,
}

impl SessionEventReason {
    /// Every reason, in the order metrics list them.
    pub const ALL: [SessionEventReason; 5] = [
        Self::Pressure,
        Self::ToolBoundary,
        Self::Room,
        Self::CapExpired,
        Self::Reported,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Pressure => "pressure",
            Self::ToolBoundary => "tool_boundary",
            Self::Room => "room",
            Self::CapExpired => "cap_expired",
            Self::Reported => "reported",
        }
    }
}

/// Which policy call produced the advice: a tick decides on utilisation, a phase change
/// on what an engine or router reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AdviceCause {
    Tick,
    Phase,
}

/// One pause or resume. The session id is the engine's identifier (what a router
/// routes by), never prompt or tool content.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SessionEvent {
    /// From 1, without gaps, for the daemon's life.
    pub seq: u64,
    /// Milliseconds on the manager's clock.
    pub at_ms: u64,
    pub kind: SessionEventKind,
    pub session_id: String,
    pub reason: SessionEventReason,
    /// Host pages in use and host capacity in pages when the decision was taken.
    pub host_used_pages: u64,
    pub host_capacity_pages: u64,
    /// `host_used_pages / host_capacity_pages` (0 without capacity).
    pub utilisation: f64,
    /// How long the session was paused (resumes; 0 for pauses).
    pub paused_ms: u64,
}

/// What a reader got from [`SessionEventLog::read_from`].
pub type SessionEventBatch = Batch<SessionEvent>;

impl Sequenced for SessionEvent {
    fn seq(&self) -> u64 {
        self.seq
    }
}

/// The bounded ring of session events, with blocking reads and per-reason counters.
#[derive(Debug)]
pub struct SessionEventLog {
    ring: SeqRing<SessionEvent>,
    /// Events per (kind, reason): `[kind as usize * 5 + reason index]`.
    counts: [AtomicU64; 10],
}

impl Default for SessionEventLog {
    fn default() -> Self {
        Self {
            ring: SeqRing::new(SESSION_EVENT_RING),
            counts: Default::default(),
        }
    }
}

fn slot(kind: SessionEventKind, reason: SessionEventReason) -> usize {
    let r = SessionEventReason::ALL.iter().position(|&x| x == reason).unwrap_or(0);
    kind as usize * SessionEventReason::ALL.len() + r
}

impl SessionEventLog {
    /// Numbers and appends the events for the pause/resume advice of one policy call.
    pub(crate) fn record(&self, advice: &[Advice], cause: AdviceCause, usage: Usage, at_ms: u64) {
        if advice.is_empty() {
            return;
        }
        let utilisation = if usage.capacity_pages == 0 {
            0.0
        } else {
            usage.used_pages as f64 / usage.capacity_pages as f64
        };
        let event = |seq: u64, a: &Advice| {
            let (kind, session_id, reason, paused_ms) = match a {
                Advice::Pause { session_id } => {
                    let reason = match cause {
                        AdviceCause::Tick => SessionEventReason::Pressure,
                        AdviceCause::Phase => SessionEventReason::ToolBoundary,
                    };
                    (SessionEventKind::Pause, session_id, reason, 0)
                }
                Advice::Resume {
                    session_id,
                    forced,
                    paused_ms,
                } => {
                    let reason = match (forced, cause) {
                        (true, _) => SessionEventReason::CapExpired,
                        (false, AdviceCause::Tick) => SessionEventReason::Room,
                        (false, AdviceCause::Phase) => SessionEventReason::Reported,
                    };
                    (SessionEventKind::Resume, session_id, reason, *paused_ms)
                }
            };
            self.counts[slot(kind, reason)].fetch_add(1, Relaxed);
            SessionEvent {
                seq,
                at_ms,
                kind,
                session_id: session_id.clone(),
                reason,
                host_used_pages: usage.used_pages,
                host_capacity_pages: usage.capacity_pages,
                utilisation,
                paused_ms,
            }
        };
        self.ring
            .append_with(|first| advice.iter().zip(first..).map(|(a, seq)| event(seq, a)));
    }

    /// The newest event's sequence (0 when none yet).
    pub fn last_seq(&self) -> u64 {
        self.ring.last_seq()
    }

    /// Events given so far, per (kind, reason).
    pub fn counts(&self) -> Vec<(SessionEventKind, SessionEventReason, u64)> {
        [SessionEventKind::Pause, SessionEventKind::Resume]
            .into_iter()
            .flat_map(|k| SessionEventReason::ALL.map(|r| (k, r, self.counts[slot(k, r)].load(Relaxed))))
            .collect()
    }

    /// Events with `seq >= from` (from 1), at most `max`, waiting up to `timeout` for the
    /// first.
    pub fn read_from(&self, from: u64, max: usize, timeout: Duration) -> SessionEventBatch {
        self.ring.read_from(from.max(1), max, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(used: u64) -> Usage {
        Usage {
            used_pages: used,
            capacity_pages: 100,
            pool: true,
        }
    }

    #[test]
    fn reasons_follow_the_cause_and_readers_keep_their_own_place() {
        let log = SessionEventLog::default();
        let pause = Advice::Pause { session_id: "a".into() };
        let resume = |forced| Advice::Resume {
            session_id: "a".into(),
            forced,
            paused_ms: 7,
        };
        log.record(std::slice::from_ref(&pause), AdviceCause::Tick, usage(96), 1);
        log.record(&[pause], AdviceCause::Phase, usage(90), 2);
        log.record(&[resume(false), resume(true)], AdviceCause::Tick, usage(80), 3);
        log.record(&[resume(false)], AdviceCause::Phase, usage(80), 4);
        let b = log.read_from(1, 100, Duration::ZERO);
        let got: Vec<(u64, SessionEventReason)> = b.events.iter().map(|e| (e.seq, e.reason)).collect();
        use SessionEventReason::*;
        assert_eq!(
            got,
            vec![
                (1, Pressure),
                (2, ToolBoundary),
                (3, Room),
                (4, CapExpired),
                (5, Reported)
            ]
        );
        assert_eq!((b.events[0].utilisation, b.events[0].paused_ms), (0.96, 0));
        assert_eq!((b.events[2].kind, b.events[2].paused_ms), (SessionEventKind::Resume, 7));
        assert_eq!((b.lost, b.next), (0, 6));
        // A second reader starts where it likes and takes nothing from the first.
        let b2 = log.read_from(4, 1, Duration::ZERO);
        assert_eq!((b2.events[0].seq, b2.next), (4, 5));
        assert_eq!(log.read_from(1, 100, Duration::ZERO).events.len(), 5);
        let c = log.counts();
        assert_eq!(c.iter().map(|x| x.2).sum::<u64>(), 5);
        assert!(c.contains(&(SessionEventKind::Pause, ToolBoundary, 1)));
    }

    #[test]
    fn a_reader_behind_the_ring_is_told_what_it_lost() {
        let log = SessionEventLog::default();
        let advice: Vec<Advice> = (0..SESSION_EVENT_RING + 3)
            .map(|i| Advice::Pause {
                session_id: i.to_string(),
            })
            .collect();
        log.record(&advice, AdviceCause::Tick, usage(99), 0);
        let b = log.read_from(1, 2, Duration::ZERO);
        assert_eq!((b.lost, b.events[0].seq, b.events[0].session_id.as_str()), (3, 4, "3"));
        let end = log.read_from(log.last_seq() + 1, 10, Duration::from_millis(1));
        assert!(end.events.is_empty());
        assert_eq!((end.lost, end.next), (0, SESSION_EVENT_RING as u64 + 4));
    }
}
