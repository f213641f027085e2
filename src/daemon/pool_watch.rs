//! After the pool lost objects this node had stored, write them again from host.
//!
//! A Mooncake helper that was replaced took its segment with it: the master drops every
//! object placed there once the dead client's TTL has passed (10 s upstream, set on the
//! master), the other nodes' objects included. The directory still calls those pages
//! pool-complete. So each time the pool's [`lost_generation`] changes, this thread checks
//! the pool-complete pages against the store ([`Manager::reconcile_pool`] with an empty
//! index: every page is asked about) a few times over the next minute, since the loss
//! shows only after that TTL, and the pages the store lost stop being pool-complete and
//! are shared again from host where host still holds them.
//!
//! [`lost_generation`]: crate::pool::PoolBackend::lost_generation

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::manager::Manager;
use crate::pool::PoolHealth;
use crate::pool::index::PoolIndex;

/// When, after a loss, the pages are checked: past a short TTL, past upstream's 10 s, and
/// once more for a master with a longer one or a slow unmount.
const CHECKS_AFTER: [Duration; 4] = [
    Duration::from_secs(1),
    Duration::from_secs(5),
    Duration::from_secs(15),
    Duration::from_secs(45),
];
/// How often the pool's loss count is read.
const POLL: Duration = Duration::from_millis(250);

/// Starts the watcher thread; it ends with `cancel`.
pub fn spawn(manager: Manager, cancel: CancellationToken) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("kvtier-pool-watch".into())
        .spawn(move || watch(&manager, &cancel))
        .map(drop)
}

fn watch(m: &Manager, cancel: &CancellationToken) {
    let Some(pool) = m.pool() else { return };
    let mut seen = pool.lost_generation();
    let mut lost_at: Option<Instant> = None;
    let mut next = 0usize;
    while !cancel.is_cancelled() {
        std::thread::sleep(POLL);
        let generation = pool.lost_generation();
        if generation != seen {
            seen = generation;
            lost_at = Some(Instant::now());
            next = 0;
        }
        let Some(at) = lost_at else { continue };
        if next >= CHECKS_AFTER.len() {
            lost_at = None;
            continue;
        }
        if at.elapsed() < CHECKS_AFTER[next] || pool.health() != PoolHealth::Ok {
            continue;
        }
        next += 1;
        let (dropped, shared) = m.reconcile_pool_and_share(&PoolIndex::new(0));
        if dropped > 0 {
            tracing::warn!(
                pages = dropped,
                shared,
                "the store lost pages this node had in the pool (its Mooncake helper was replaced); \
                 wrote again those host still holds"
            );
        }
    }
}
