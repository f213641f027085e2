//! A shutdown signal shared by the daemon's long-running components (admin server, event
//! publishers). Cheap to clone; every clone sees the same trigger. Components poll it
//! between bounded waits, so a trigger is noticed within one wait's timeout.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// A one-way latch: once triggered it stays triggered.
#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    inner: Arc<(Mutex<bool>, Condvar)>,
}

impl Shutdown {
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks every holder to stop.
    pub fn trigger(&self) {
        *self.inner.0.lock() = true;
        self.inner.1.notify_all();
    }

    pub fn is_triggered(&self) -> bool {
        *self.inner.0.lock()
    }

    /// Waits up to `timeout` for the trigger; returns whether it was triggered.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let mut on = self.inner.0.lock();
        if !*on {
            let _ = self.inner.1.wait_for(&mut on, timeout);
        }
        *on
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_is_seen_by_clones() {
        let s = Shutdown::new();
        let c = s.clone();
        assert!(!c.wait_timeout(Duration::from_millis(1)));
        let t = std::thread::spawn(move || c.wait_timeout(Duration::from_secs(5)));
        s.trigger();
        assert!(t.join().unwrap());
        assert!(s.is_triggered());
    }
}
