//! A pool for tests that forwards every call to a real backend and runs a test's hook
//! before the calls a test wants to watch or break: a put that panics, a count of the
//! existence queries asked each way. The bytes are always the inner pool's.

use std::sync::Arc;

#[cfg(feature = "daemon")]
use super::{ExistsFuture, KeyBatch};
use super::{GetItem, PoolBackend, PoolError, PoolHealth, PoolUsage, PutItem};

/// A hook: runs before the call it is named for.
pub(crate) type Hook = Box<dyn Fn() + Send + Sync>;

/// `inner`, with hooks (see the module doc). Built with [`HookedPool::new`] and the
/// `on_*` setters; a call without a hook is forwarded as it is.
pub(crate) struct HookedPool {
    inner: Arc<dyn PoolBackend>,
    put: Option<Hook>,
    exists: Option<Hook>,
    #[cfg_attr(not(feature = "daemon"), allow(dead_code))]
    awaited: Option<Hook>,
}

impl HookedPool {
    pub(crate) fn new(inner: Arc<dyn PoolBackend>) -> Self {
        Self {
            inner,
            put: None,
            exists: None,
            awaited: None,
        }
    }

    /// Runs `hook` before each put (either kind).
    pub(crate) fn on_put(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.put = Some(Box::new(hook));
        self
    }

    /// Runs `hook` before each blocking existence query.
    #[cfg_attr(not(feature = "daemon"), allow(dead_code))]
    pub(crate) fn on_exists(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.exists = Some(Box::new(hook));
        self
    }

    #[cfg(feature = "daemon")]
    /// Makes the existence query one the caller awaits (as the Mooncake pool's query of
    /// its master is), answered by the inner pool's blocking one, and runs `hook` before
    /// each.
    pub(crate) fn awaitable(mut self, hook: impl Fn() + Send + Sync + 'static) -> Self {
        self.awaited = Some(Box::new(hook));
        self
    }

    fn run(hook: &Option<Hook>) {
        if let Some(h) = hook {
            h();
        }
    }
}

impl PoolBackend for HookedPool {
    fn name(&self) -> &'static str {
        "hooked"
    }
    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        Self::run(&self.put);
        self.inner.batch_put_from(items)
    }
    fn batch_put_ordered(&self, items: &[PutItem<'_>]) -> Vec<Result<(), PoolError>> {
        Self::run(&self.put);
        self.inner.batch_put_ordered(items)
    }
    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        self.inner.batch_get_into(items)
    }
    fn batch_get_ordered(&self, items: &mut [GetItem<'_>]) -> Vec<Result<usize, PoolError>> {
        self.inner.batch_get_ordered(items)
    }
    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        Self::run(&self.exists);
        self.inner.batch_exists(keys)
    }
    fn remove(&self, key: &str, force: bool) -> Result<(), PoolError> {
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
    #[cfg(feature = "daemon")]
    fn awaits_exists(&self) -> bool {
        self.awaited.is_some() || self.inner.awaits_exists()
    }
    #[cfg(feature = "daemon")]
    fn exists_async(&self, keys: KeyBatch) -> Option<ExistsFuture> {
        let Some(hook) = &self.awaited else {
            return self.inner.exists_async(keys);
        };
        hook();
        let answers = self.inner.batch_exists(&keys.refs());
        Some(Box::pin(async move { Some(answers) }))
    }
}
