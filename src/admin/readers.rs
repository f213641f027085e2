//! Admin connections still sending their request, oldest first, so that slow clients
//! cannot lock the socket.
//!
//! Each connection has its whole-request deadline (`read_timeout`), but 64 clients that
//! each trickle a request would still hold all 64 slots until their deadlines, and every
//! other caller would get 503 meanwhile. So a connection registers here from accept until
//! its request is in; a newcomer that finds every slot taken cuts off the oldest one that
//! has been sending for at least [`DISPLACE_AFTER`] and takes its slot. A client that
//! sends its request at once is never displaced; a slow one loses its slot only to
//! someone who needs it. At most one entry per held slot, so the list is bounded by
//! `max_connections`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

/// How long a connection may have been sending its request before a newcomer at the
/// limit may take its slot: well above what a local client needs to send a request.
pub(crate) const DISPLACE_AFTER: Duration = Duration::from_millis(250);

struct Reader {
    id: u64,
    since: Instant,
    cut: CancellationToken,
}

/// The connections still reading their request.
#[derive(Default)]
pub(crate) struct Readers {
    list: Mutex<VecDeque<Reader>>,
    next: AtomicU64,
}

/// A connection's place in [`Readers`]; leaves it when the request is in or the
/// connection ends.
pub(crate) struct ReaderGuard {
    readers: Arc<Readers>,
    id: u64,
}

impl Readers {
    /// Registers a connection that starts reading its request; the token fires when a
    /// newcomer displaces it.
    pub fn enter(self: &Arc<Self>) -> (ReaderGuard, CancellationToken) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let cut = CancellationToken::new();
        self.list.lock().push_back(Reader {
            id,
            since: Instant::now(),
            cut: cut.clone(),
        });
        (
            ReaderGuard {
                readers: self.clone(),
                id,
            },
            cut,
        )
    }

    /// Cuts off the oldest connection that has been reading for at least `older_than`.
    /// Returns whether one was cut (its slot is freed as its task ends).
    pub fn displace_oldest(&self, older_than: Duration) -> bool {
        let mut list = self.list.lock();
        match list.front() {
            Some(r) if r.since.elapsed() >= older_than => {
                if let Some(r) = list.pop_front() {
                    r.cut.cancel();
                }
                true
            }
            _ => false,
        }
    }

    fn leave(&self, id: u64) {
        let mut list = self.list.lock();
        if let Some(at) = list.iter().position(|r| r.id == id) {
            list.remove(at);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.list.lock().len()
    }
}

impl ReaderGuard {
    /// The request is in: the connection can no longer be displaced. Idempotent.
    pub fn done(&self) {
        self.readers.leave(self.id);
    }
}

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        self.readers.leave(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_slow_reader_is_cut_and_finished_ones_never() {
        let r = Arc::new(Readers::default());
        let (a, cut_a) = r.enter();
        let (b, cut_b) = r.enter();
        assert!(!r.displace_oldest(Duration::from_secs(60)), "nobody is that slow yet");
        a.done();
        assert_eq!(r.len(), 1);
        assert!(r.displace_oldest(Duration::ZERO));
        assert!(!cut_a.is_cancelled(), "a finished request is never cut");
        assert!(cut_b.is_cancelled(), "the oldest still reading is");
        assert_eq!(r.len(), 0);
        drop(b);
        assert!(!r.displace_oldest(Duration::ZERO));
        let (c, _) = r.enter();
        drop(c);
        assert_eq!(r.len(), 0, "a connection that ends leaves the list");
    }
}
