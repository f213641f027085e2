//! A connection's deadline, shared by the connection task that enforces it and the
//! request handler and event stream that move it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A connection's deadline, which the request handler moves: set at accept, renewed
/// once the request is in, lifted while an event stream runs. Milliseconds after
/// `start`; [`NO_DEADLINE`] while streaming.
pub(crate) struct Deadline {
    start: Instant,
    at_ms: AtomicU64,
}

const NO_DEADLINE: u64 = u64::MAX;

impl Deadline {
    pub(crate) fn new(after: Duration) -> Self {
        Self {
            start: Instant::now(),
            at_ms: AtomicU64::new(after.as_millis() as u64),
        }
    }

    /// The deadline becomes `after` from now.
    pub(crate) fn extend(&self, after: Duration) {
        let at = (self.start.elapsed() + after).as_millis() as u64;
        self.at_ms.store(at, Ordering::Release);
    }

    pub(crate) fn lift(&self) {
        self.at_ms.store(NO_DEADLINE, Ordering::Release);
    }

    /// When the connection must be done, `None` while streaming.
    pub(crate) fn at(&self) -> Option<Instant> {
        match self.at_ms.load(Ordering::Acquire) {
            NO_DEADLINE => None,
            ms => Some(self.start + Duration::from_millis(ms)),
        }
    }
}
