//! Which threads may block on pool I/O.
//!
//! The daemon's async runtime serves every connection on a few threads: one of them
//! waiting on a pool write, a read or an existence query stalls every engine's lookups.
//! Blocking pool calls belong on transfer workers, on threads of their own, and on the
//! runtime's blocking pool, where a command runs once it has entered a
//! [`BlockingScope`]. [`check`] is called where the pool is asked synchronously; in debug
//! builds it panics when the caller is a runtime thread that did not enter a scope, so a
//! command that starts doing pool I/O inline fails its tests instead of freezing lookups
//! in production.

use std::cell::Cell;

thread_local! {
    static BLOCKING_OK: Cell<bool> = const { Cell::new(false) };
}

/// While alive, the current thread may block (a command on the runtime's blocking pool).
/// Restores the previous state when dropped, so scopes nest.
#[must_use = "the scope ends when the guard is dropped"]
pub struct BlockingScope {
    prev: bool,
}

impl Drop for BlockingScope {
    fn drop(&mut self) {
        let prev = self.prev;
        BLOCKING_OK.with(|b| b.set(prev));
    }
}

/// Marks the current thread as one that may block until the guard is dropped.
pub fn allow_blocking() -> BlockingScope {
    BlockingScope {
        prev: BLOCKING_OK.with(|b| b.replace(true)),
    }
}

/// Whether the current thread may block on I/O: any thread outside an async runtime, and
/// a runtime thread inside a [`BlockingScope`].
pub fn may_block() -> bool {
    BLOCKING_OK.with(Cell::get) || !in_runtime()
}

#[cfg(feature = "daemon")]
fn in_runtime() -> bool {
    tokio::runtime::Handle::try_current().is_ok()
}

#[cfg(not(feature = "daemon"))]
fn in_runtime() -> bool {
    false
}

/// Fails in debug builds when blocking pool I/O (`what`) is about to run on an async
/// runtime thread; free in release builds.
#[inline]
pub fn check(what: &'static str) {
    debug_assert!(
        may_block(),
        "pool I/O ({what}) on an async runtime thread: run it on a transfer worker or the blocking pool"
    );
}

#[cfg(all(test, feature = "daemon"))]
mod tests {
    use super::*;

    #[test]
    fn runtime_threads_may_block_only_inside_a_scope() {
        assert!(may_block(), "a plain thread may block");
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            assert!(!may_block(), "a runtime thread may not");
            {
                let _s = allow_blocking();
                assert!(may_block());
                let _inner = allow_blocking();
            }
            assert!(!may_block(), "the scope ended");
        });
        let blocking = rt.block_on(async {
            tokio::task::spawn_blocking(|| {
                let before = may_block();
                let _s = allow_blocking();
                (before, may_block())
            })
            .await
        });
        assert_eq!(blocking.unwrap(), (false, true));
    }

    #[test]
    #[cfg(debug_assertions)]
    fn pool_io_on_a_runtime_thread_panics_in_debug_builds() {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let r = std::panic::catch_unwind(|| rt.block_on(async { check("test") }));
        assert!(r.is_err());
    }
}
