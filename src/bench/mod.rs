//! `kvtier bench …`: measurements that print a figure beside a physical reference taken
//! in the same run (memcpy for copies), and their ratio, because an absolute time on a
//! shared machine means little.

mod admin_load;
pub mod arena;
mod caches;
pub mod control;
mod control_slow;
pub mod daemon;
pub mod engine;
pub mod events;
pub mod evict;
pub mod index;
pub mod placement;
pub mod pool;
mod pool_remote;
pub mod recovery;
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

/// A page-aligned, already touched byte buffer for a bench's reference copies.
///
/// The tiers' memory (arena and pool slots, emulated device regions) is page-aligned; a
/// plain large `Vec` starts 16 bytes past a page boundary, and `rep movsb` between
/// addresses 16 bytes apart modulo 4 KiB runs a third slower, so a reference built on
/// `Vec`s would not copy like the subject does.
pub(crate) struct PageAligned {
    buf: Vec<u8>,
    at: usize,
    len: usize,
}

impl PageAligned {
    /// `len` bytes, each set to `fill` (which also takes the first-touch page faults now).
    pub(crate) fn new(len: usize, fill: u8) -> Self {
        // Not `vec![0; n]`: that maps zero pages lazily, and the first copy would fault.
        let mut buf = Vec::with_capacity(len + 4096);
        buf.resize(len + 4096, fill);
        let at = buf.as_ptr().align_offset(4096).min(4096);
        Self { buf, at, len }
    }
}

impl std::ops::Deref for PageAligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }
}

impl std::ops::DerefMut for PageAligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.at..self.at + self.len]
    }
}
