//! The one internal stream of page events.
//!
//! The directory emits an event only when a page's completeness in a tier changes, each
//! with the next sequence number. [`EventLog`] keeps the most recent events in a bounded
//! ring: publishers read from a sequence number onward and can replay a gap as long as the
//! ring still holds it. Nothing here blocks a writer: a subscriber that falls behind the
//! ring sees `lost` events, never a stalled directory.

use std::collections::VecDeque;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use serde::Serialize;

use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PageEventKind {
    /// The page became complete in the tier.
    Stored,
    /// The page stopped being complete in the tier.
    Removed,
    /// Every page of the tier was dropped at once (e.g. a pool reset).
    Cleared,
}

/// A change of completeness of one page in one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PageEvent {
    pub seq: u64,
    pub kind: PageEventKind,
    pub tier: TierKind,
    pub ns: NamespaceId,
    /// For `Cleared`, a zero hash of 8 bytes.
    pub hash: PageHash,
    /// Milliseconds on the manager's clock when it happened.
    pub at_ms: u64,
}

/// Items a [`SeqRing`] holds: each carries its sequence number.
pub trait Sequenced {
    fn seq(&self) -> u64;
}

impl Sequenced for PageEvent {
    fn seq(&self) -> u64 {
        self.seq
    }
}

/// What a reader got from [`SeqRing::read_from`].
#[derive(Debug)]
pub struct Batch<T> {
    pub events: Vec<T>,
    /// Items between the asked sequence and the first returned that the ring no longer holds.
    pub lost: u64,
    /// The sequence number to ask for next.
    pub next: u64,
}

impl<T> Default for Batch<T> {
    fn default() -> Self {
        Self {
            events: Vec::new(),
            lost: 0,
            next: 0,
        }
    }
}

/// What a subscriber got from [`EventLog::read_from`].
pub type EventBatch = Batch<PageEvent>;

/// A bounded ring of recent items numbered from 1 without gaps, with blocking reads. Each
/// reader keeps its own position; one that falls behind sees `lost`, never a stalled writer.
#[derive(Debug)]
pub struct SeqRing<T> {
    inner: Mutex<Ring<T>>,
    cond: Condvar,
}

/// A bounded ring of recent page events with blocking reads.
pub type EventLog = SeqRing<PageEvent>;

#[derive(Debug)]
struct Ring<T> {
    items: VecDeque<T>,
    capacity: usize,
    /// Sequence number the next appended item must carry.
    next_seq: u64,
}

impl<T: Sequenced + Clone> SeqRing<T> {
    /// A ring that keeps the last `capacity` items for replay.
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(Ring {
                items: VecDeque::with_capacity(capacity.min(1 << 16)),
                capacity: capacity.max(1),
                next_seq: 1,
            }),
            cond: Condvar::new(),
        }
    }

    /// Appends what `items` builds from the next sequence number, under the ring's lock (so
    /// concurrent writers number without gaps); the items must continue the sequence.
    pub fn append_with<I: IntoIterator<Item = T>>(&self, items: impl FnOnce(u64) -> I) {
        let mut ring = self.inner.lock();
        for it in items(ring.next_seq) {
            debug_assert_eq!(it.seq(), ring.next_seq, "sequence must have no gaps");
            if ring.items.len() == ring.capacity {
                ring.items.pop_front();
            }
            ring.next_seq = it.seq() + 1;
            ring.items.push_back(it);
        }
        drop(ring);
        self.cond.notify_all();
    }

    /// The sequence number of the newest item (0 when none yet).
    pub fn last_seq(&self) -> u64 {
        self.inner.lock().next_seq - 1
    }

    /// Items with `seq >= from`, at most `max`, waiting up to `timeout` for the first.
    pub fn read_from(&self, from: u64, max: usize, timeout: Duration) -> Batch<T> {
        let mut ring = self.inner.lock();
        if ring.next_seq <= from && !timeout.is_zero() {
            let _ = self.cond.wait_for(&mut ring, timeout);
        }
        let oldest = ring.items.front().map_or(ring.next_seq, Sequenced::seq);
        let start = from.max(oldest);
        let lost = start
            .saturating_sub(from.max(1))
            .min(ring.next_seq.saturating_sub(from.max(1)));
        let skip = (start - oldest) as usize;
        let events: Vec<T> = ring.items.iter().skip(skip).take(max).cloned().collect();
        let next = events.last().map_or(start.max(from), |e| e.seq() + 1);
        Batch { events, lost, next }
    }
}

impl SeqRing<PageEvent> {
    /// Appends events that the directory numbered; they must continue the sequence.
    pub fn append(&self, batch: &[PageEvent]) {
        if !batch.is_empty() {
            self.append_with(|_| batch.iter().copied());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(seq: u64) -> PageEvent {
        PageEvent {
            seq,
            kind: PageEventKind::Stored,
            tier: TierKind::Host,
            ns: NamespaceId(0),
            hash: PageHash::from_u64(seq),
            at_ms: 0,
        }
    }

    #[test]
    fn ring_replays_and_reports_loss() {
        let log = EventLog::new(4);
        log.append(&(1..=6).map(ev).collect::<Vec<_>>());
        assert_eq!(log.last_seq(), 6);
        let b = log.read_from(1, 100, Duration::ZERO);
        assert_eq!(b.lost, 2);
        assert_eq!(b.events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4, 5, 6]);
        assert_eq!(b.next, 7);
        let b = log.read_from(5, 1, Duration::ZERO);
        assert_eq!((b.lost, b.events[0].seq, b.next), (0, 5, 6));
        let b = log.read_from(7, 10, Duration::from_millis(1));
        assert!(b.events.is_empty());
        assert_eq!((b.lost, b.next), (0, 7));
    }
}
