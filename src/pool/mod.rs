//! The shared pool tier (G3) and its backends.
//!
//! [`PoolBackend`] mirrors Mooncake Store's batch API: put-from and get-into over caller
//! buffers, batch exists, and remove. The node-local default ([`local::LocalPool`]) keeps
//! objects in a shared-memory region of its own; the Mooncake backends of a later module
//! implement the same trait. The pool is object-addressed: pages become pool-complete only
//! in the directory, when every object key of their layout exists.

pub mod keys;
pub mod local;
pub mod mooncake;
pub mod page;
// Only the C ABI tests need an outside tool today; widen the gate with the next user.
#[cfg(all(test, feature = "mooncake-c"))]
pub(crate) mod test_env;

use serde::Serialize;

/// Why a pool operation failed. Mooncake's error codes map onto these.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("object not found")]
    NotFound,
    #[error("object is leased by a recent reader; retry later or force")]
    HasLease,
    #[error("buffer of {got} bytes is too small for an object of {need} bytes")]
    BufferTooSmall { got: usize, need: usize },
    #[error("object of {len} bytes is larger than the pool's object limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("the pool has no space left")]
    NoSpace,
    #[error("object already exists")]
    Exists,
    #[error("pool unavailable: {0}")]
    Unavailable(String),
    #[error("batch of {got} exceeds the maximum of {max}")]
    BatchTooLarge { got: usize, max: usize },
    #[error("pool backend error {code}: {message}")]
    Backend { code: i64, message: String },
}

/// Whether the backend can serve requests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum PoolHealth {
    Ok,
    Degraded { reason: String },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolUsage {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub objects: u64,
}

/// A shared pool, addressed by object key, with Mooncake-shaped batch operations.
pub trait PoolBackend: Send + Sync {
    fn name(&self) -> &'static str;

    /// Writes each `(key, bytes)`. Per-item results, in order.
    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>>;

    /// Reads each key into its buffer; `Ok(n)` is the object's length.
    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>>;

    /// Whether each key exists.
    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>>;

    /// Removes one object. `force` overrides a read lease.
    fn remove(&self, key: &str, force: bool) -> Result<(), PoolError>;

    fn health(&self) -> PoolHealth;

    fn usage(&self) -> PoolUsage;

    /// Keys the backend dropped on its own (its own eviction) since the last call.
    fn take_evicted(&self) -> Vec<String>;

    /// Largest object the backend accepts.
    fn max_object_bytes(&self) -> usize;
}
