//! A pool that forwards every call to a real backend and runs a hook before the data
//! calls: fault injection for the daemon, benches and tests. The bytes are always the
//! inner pool's; only when the calls happen, and what happens before them, changes.
//!
//! - [`HookedPool::delayed`] sleeps a fixed time before each put, get, existence query
//!   and remove. The daemon wraps its pool in one when `pool.fault_delay_ms` is set (never
//!   by default); `kvtier bench control` uses it to show that a slow pool does not slow
//!   the control plane.
//! - Tests build one with [`HookedPool::before`] (a put that panics, a count of the
//!   existence queries) and [`HookedPool::awaitable`] (an existence query the caller
//!   awaits, as the Mooncake pool's query of its master is).
//!
//! Everything else a backend reports (health, usage, evictions, recovered objects,
//! integrity, the helper's queue, lost generations, the master's version) is the inner
//! pool's.

use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "daemon")]
use super::{ExistsFuture, KeyBatch};
use super::{GetItem, HelperQueue, IntegrityReport, PoolBackend, PoolError, PoolHealth, PoolUsage, PutItem};

/// The data calls a hook runs before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// A put, from caller buffers or ordered.
    Put,
    /// A get, into caller buffers or ordered.
    Get,
    /// A blocking existence query.
    Exists,
    /// A remove.
    Remove,
}

type Hook = Box<dyn Fn(Call) + Send + Sync>;

/// `inner`, with a hook before its data calls (see the module doc).
pub struct HookedPool {
    inner: Arc<dyn PoolBackend>,
    before: Hook,
    #[cfg_attr(not(feature = "daemon"), allow(dead_code))]
    awaited: Option<Box<dyn Fn() + Send + Sync>>,
}

impl HookedPool {
    /// `inner`, forwarded as it is.
    pub fn new(inner: Arc<dyn PoolBackend>) -> Self {
        Self {
            inner,
            before: Box::new(|_| {}),
            awaited: None,
        }
    }

    /// `inner`, each of whose data calls takes `delay` longer.
    pub fn delayed(inner: Arc<dyn PoolBackend>, delay: Duration) -> Self {
        Self::new(inner).before(move |_| {
            super::io_guard::check("delayed pool");
            std::thread::sleep(delay);
        })
    }

    /// Runs `hook` before each data call, with the call's kind.
    pub fn before(mut self, hook: impl Fn(Call) + Send + Sync + 'static) -> Self {
        self.before = Box::new(hook);
        self
    }

    /// Makes the existence query one the caller awaits (as the Mooncake pool's query of
    /// its master is), answered by the inner pool's blocking one, and runs `hook` before
    /// each. Without it the wrapper's query is never awaited, whatever the inner pool's
    /// is: the `before` hook then runs before every query.
    #[cfg(feature = "daemon")]
    pub fn awaitable(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.awaited = Some(Box::new(hook));
        self
    }
}

impl PoolBackend for HookedPool {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn mapping_page_bytes(&self) -> Option<u64> {
        self.inner.mapping_page_bytes()
    }
    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        (self.before)(Call::Put);
        self.inner.batch_put_from(items)
    }
    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        (self.before)(Call::Get);
        self.inner.batch_get_into(items)
    }
    fn batch_put_ordered(&self, items: &[PutItem<'_>]) -> Vec<Result<(), PoolError>> {
        (self.before)(Call::Put);
        self.inner.batch_put_ordered(items)
    }
    fn batch_get_ordered(&self, items: &mut [GetItem<'_>]) -> Vec<Result<usize, PoolError>> {
        (self.before)(Call::Get);
        self.inner.batch_get_ordered(items)
    }
    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        (self.before)(Call::Exists);
        self.inner.batch_exists(keys)
    }
    fn remove(&self, key: &str, force: bool) -> Result<(), PoolError> {
        (self.before)(Call::Remove);
        self.inner.remove(key, force)
    }
    fn health(&self) -> PoolHealth {
        self.inner.health()
    }
    fn usage(&self) -> PoolUsage {
        self.inner.usage()
    }
    fn take_evicted(&self) -> Vec<String> {
        self.inner.take_evicted()
    }
    fn take_recovered(&self) -> Vec<(String, usize)> {
        self.inner.take_recovered()
    }
    fn max_object_bytes(&self) -> usize {
        self.inner.max_object_bytes()
    }
    fn lost_generation(&self) -> u64 {
        self.inner.lost_generation()
    }
    fn integrity(&self) -> Option<IntegrityReport> {
        self.inner.integrity()
    }
    fn helper_queue(&self) -> Option<HelperQueue> {
        self.inner.helper_queue()
    }
    fn exists_source(&self) -> Option<&'static str> {
        self.inner.exists_source()
    }
    fn master_version(&self) -> Option<String> {
        self.inner.master_version()
    }
    #[cfg(feature = "daemon")]
    fn awaits_exists(&self) -> bool {
        self.awaited.is_some()
    }
    #[cfg(feature = "daemon")]
    fn exists_async(&self, keys: KeyBatch) -> Option<ExistsFuture> {
        let hook = self.awaited.as_ref()?;
        hook();
        let answers = self.inner.batch_exists(&keys.refs());
        Some(Box::pin(async move { Some(answers) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of one object, enough to see the delay and the inner answers.
    struct One(parking_lot::Mutex<Vec<u8>>);

    impl PoolBackend for One {
        fn name(&self) -> &'static str {
            "one"
        }
        fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
            items
                .iter()
                .map(|(_, d)| {
                    *self.0.lock() = d.to_vec();
                    Ok(())
                })
                .collect()
        }
        fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
            let v = self.0.lock();
            items
                .iter_mut()
                .map(|(_, b)| {
                    b[..v.len()].copy_from_slice(&v);
                    Ok(v.len())
                })
                .collect()
        }
        fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
            keys.iter().map(|_| Ok(!self.0.lock().is_empty())).collect()
        }
        fn remove(&self, _: &str, _: bool) -> Result<(), PoolError> {
            self.0.lock().clear();
            Ok(())
        }
        fn health(&self) -> PoolHealth {
            PoolHealth::Ok
        }
        fn usage(&self) -> PoolUsage {
            PoolUsage::default()
        }
        fn take_evicted(&self) -> Vec<String> {
            Vec::new()
        }
        fn max_object_bytes(&self) -> usize {
            64
        }
    }

    #[test]
    fn every_data_call_takes_the_delay_and_keeps_the_inner_bytes() {
        let p = HookedPool::delayed(Arc::new(One(Default::default())), Duration::from_millis(30));
        let t = std::time::Instant::now();
        assert_eq!(p.batch_put_from(&[("k", b"abc")]), vec![Ok(())]);
        let mut buf = [0u8; 3];
        assert_eq!(p.batch_get_into(&mut [("k", &mut buf[..])]), vec![Ok(3)]);
        assert_eq!(&buf, b"abc");
        assert_eq!(p.batch_exists(&["k"]), vec![Ok(true)]);
        assert!(t.elapsed() >= Duration::from_millis(90), "three calls, three delays");
        assert_eq!(p.health(), PoolHealth::Ok);
    }
}
