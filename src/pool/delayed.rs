//! A pool that answers late: fault injection for benches and tests.
//!
//! [`DelayedPool`] wraps a real backend and sleeps a fixed time before each batch put,
//! get, existence query and remove, then does the real work, so the bytes are the inner
//! pool's and only the latency changes. The daemon wraps its pool in one when
//! `pool.fault_delay_ms` is set (never by default); `kvtier bench control` uses it to show
//! that a slow pool does not slow the control plane.

use std::sync::Arc;
use std::time::Duration;

use super::{GetItem, PoolBackend, PoolError, PoolHealth, PoolUsage, PutItem};

/// A backend whose data calls each take `delay` longer.
pub struct DelayedPool {
    inner: Arc<dyn PoolBackend>,
    delay: Duration,
}

impl DelayedPool {
    pub fn new(inner: Arc<dyn PoolBackend>, delay: Duration) -> Self {
        Self { inner, delay }
    }

    fn wait(&self) {
        super::io_guard::check("delayed pool");
        std::thread::sleep(self.delay);
    }
}

impl PoolBackend for DelayedPool {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        self.wait();
        self.inner.batch_put_from(items)
    }

    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        self.wait();
        self.inner.batch_get_into(items)
    }

    fn batch_put_ordered(&self, items: &[PutItem<'_>]) -> Vec<Result<(), PoolError>> {
        self.wait();
        self.inner.batch_put_ordered(items)
    }

    fn batch_get_ordered(&self, items: &mut [GetItem<'_>]) -> Vec<Result<usize, PoolError>> {
        self.wait();
        self.inner.batch_get_ordered(items)
    }

    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        self.wait();
        self.inner.batch_exists(keys)
    }

    fn remove(&self, key: &str, force: bool) -> Result<(), PoolError> {
        self.wait();
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

    fn max_object_bytes(&self) -> usize {
        self.inner.max_object_bytes()
    }

    fn lost_generation(&self) -> u64 {
        self.inner.lost_generation()
    }

    fn exists_source(&self) -> Option<&'static str> {
        self.inner.exists_source()
    }

    fn master_version(&self) -> Option<String> {
        self.inner.master_version()
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
        let p = DelayedPool::new(Arc::new(One(Default::default())), Duration::from_millis(30));
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
