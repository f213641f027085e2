//! `kvtier bench …`: measurements that print a figure beside a physical reference taken
//! in the same run (memcpy for copies), and their ratio, because an absolute time on a
//! shared machine means little.

mod admin_load;
pub mod arena;
pub mod control;
pub mod daemon;
pub mod events;
pub mod index;
pub mod pool;
pub mod transfer;
#[cfg(feature = "cuda")]
pub mod transfer_cuda;

use std::time::{Duration, Instant};

/// Runs `f` `runs` times and returns the median duration.
pub fn median_time(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

/// Bytes per second as GB/s (10^9).
pub fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-12) / 1e9
}
