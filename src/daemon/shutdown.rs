//! Graceful shutdown: a cancellation token that SIGTERM/SIGINT can fire.
//!
//! The signal handler only stores into a static atomic (async-signal-safe); the accept
//! loop and every connection handler poll the token at least every 100 ms.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    SIGNALLED.store(true, Ordering::SeqCst);
}

/// A cheap, clonable cancellation token.
#[derive(Clone, Debug, Default)]
pub struct Shutdown {
    flag: Arc<AtomicBool>,
    signals: bool,
}

impl Shutdown {
    /// A token fired only by [`Shutdown::fire`] (tests, embedding).
    pub fn new() -> Self {
        Self::default()
    }

    /// A token that SIGTERM and SIGINT also fire. Installs the handlers.
    pub fn with_signals() -> std::io::Result<Self> {
        for sig in [libc::SIGTERM, libc::SIGINT] {
            // SAFETY: a zeroed sigaction with a handler that only touches an atomic.
            let rc = unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut())
            };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(Self {
            flag: Arc::new(AtomicBool::new(false)),
            signals: true,
        })
    }

    pub fn fire(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }

    pub fn is_fired(&self) -> bool {
        self.flag.load(Ordering::Relaxed) || (self.signals && SIGNALLED.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_the_flag() {
        let a = Shutdown::new();
        let b = a.clone();
        assert!(!b.is_fired());
        a.fire();
        assert!(b.is_fired());
    }
}
