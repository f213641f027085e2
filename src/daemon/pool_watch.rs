//! After the pool lost objects this node had stored, write them again from host.
//!
//! A Mooncake helper that was replaced took its segment with it: the master drops every
//! object placed there once the dead client's TTL has passed (10 s upstream, set on the
//! master), the other nodes' objects included. The directory still calls those pages
//! pool-complete. So each time the pool's [`lost_generation`] changes, this thread checks
//! the pool-complete pages against the store ([`Manager::reconcile_pool`], sharing, with
//! an empty index: every page is asked about) every few seconds for the next two minutes, since
//! the loss shows only after that TTL, and the pages the store lost stop being
//! pool-complete and are shared again from host where host still holds them.
//!
//! [`lost_generation`]: crate::pool::PoolBackend::lost_generation

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::manager::Manager;
use crate::pool::PoolHealth;
use crate::pool::index::PoolIndex;

/// How often, after a loss, the pages are checked, and for how long: past upstream's
/// 10 s client TTL with a wide margin for a master with a longer one or a slow unmount.
const CHECK_EVERY: Duration = Duration::from_secs(3);
const CHECK_FOR: Duration = Duration::from_secs(120);
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
    // The pool is built with the arena, which may wait for the first engine.
    let pool = loop {
        if cancel.is_cancelled() {
            return;
        }
        if let Some(p) = m.stores().pool() {
            break p;
        }
        std::thread::sleep(POLL);
    };
    let mut seen = pool.lost_generation();
    let mut lost_at: Option<Instant> = None;
    let mut checked = Instant::now();
    while !cancel.is_cancelled() {
        std::thread::sleep(POLL);
        let generation = pool.lost_generation();
        if generation != seen {
            seen = generation;
            lost_at = Some(Instant::now());
            checked = Instant::now();
            tracing::info!(
                generation,
                "the pool lost objects; checking this node's pool pages against the store"
            );
        }
        let Some(at) = lost_at else { continue };
        if at.elapsed() > CHECK_FOR {
            lost_at = None;
            continue;
        }
        if checked.elapsed() < CHECK_EVERY || pool.health() != PoolHealth::Ok {
            continue;
        }
        checked = Instant::now();
        let (dropped, shared) = m.reconcile_pool(&PoolIndex::new(0), true);
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
