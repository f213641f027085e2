//! The daemon's one shutdown signal: a [`tokio_util::sync::CancellationToken`].
//!
//! Every long-running component takes a clone of the same token: the control socket's
//! accept loop, its connection tasks and upkeep task (all on tokio, which await
//! `cancelled()`), the admin server, and the event publisher threads (which check
//! `is_cancelled()` between their bounded waits). Cancelling one clone cancels them all,
//! and a cancelled token stays cancelled. SIGTERM and SIGINT reach it through
//! [`cancel_on_signals`], so there is no signal handler of our own and no flag to poll.

pub use tokio_util::sync::CancellationToken;

/// The name the daemon's components use for the token; it is the token itself, not a
/// wrapper, so `Shutdown::new()`, `cancel()` and `is_cancelled()` are tokio-util's.
pub type Shutdown = CancellationToken;

/// Installs SIGTERM and SIGINT handling now and returns the future that cancels `token`
/// on the first of them (or ends when the token is cancelled by someone else). Call it
/// inside a tokio runtime context before the daemon announces itself, so a signal sent
/// as soon as the socket answers is never lost to a race with the handler's install.
pub fn cancel_on_signals(
    token: CancellationToken,
) -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
            _ = token.cancelled() => return,
        }
        token.cancel();
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_cancels_every_clone() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let token = Shutdown::new();
        let seen_by = token.clone();
        rt.block_on(async {
            // Installed before the first kill below, so the signal can never take its
            // default action (ending the test process).
            let waiter = tokio::spawn(cancel_on_signals(token.clone()).unwrap());
            while !waiter.is_finished() && !seen_by.is_cancelled() {
                // SAFETY: signalling our own process; the handler installed above owns it.
                unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            waiter.await.unwrap();
        });
        assert!(seen_by.is_cancelled());
    }
}
