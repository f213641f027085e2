//! The shared pool tier (G3) and its backends.
//!
//! [`PoolBackend`] mirrors Mooncake Store's batch API: put-from and get-into over caller
//! buffers, batch exists, and remove. The node-local default ([`local::LocalPool`]) keeps
//! objects in a shared-memory region of its own; the Mooncake backends of a later module
//! implement the same trait. The pool is object-addressed: pages become pool-complete only
//! in the directory, when every object key of their layout exists.

pub mod hooked;
pub mod index;
pub mod io_guard;
pub mod keys;
pub mod local;
pub mod mooncake;
pub mod page;
pub mod reorder;
// Only the C ABI tests need an outside tool today; widen the gate with the next user.
#[cfg(all(test, feature = "mooncake-c"))]
pub(crate) mod test_env;

use serde::Serialize;

pub use reorder::Transpose;

/// One object of an ordered put: key, the caller's bytes, and how they are reordered on
/// the way into the pool (`None`: as they are).
pub type PutItem<'a> = (&'a str, &'a [u8], Option<Transpose>);

/// One object of an ordered get: key, the caller's buffer, and how the pool's bytes are
/// reordered on the way out (`None`: as they are).
pub type GetItem<'a> = (&'a str, &'a mut [u8], Option<Transpose>);

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
    #[error("an object of {len} bytes does not fit a reorder of {want} bytes")]
    ReorderShape { len: usize, want: usize },
    #[error("pool backend error {code}: {message}")]
    Backend { code: i64, message: String },
}

/// Many object keys rendered into one buffer: a batched query's keys, one allocation.
#[derive(Clone, Debug, Default)]
pub struct KeyBatch {
    buf: String,
    ends: Vec<usize>,
}

impl KeyBatch {
    /// Room for `keys` keys of about `key_bytes` bytes each.
    pub fn with_capacity(keys: usize, key_bytes: usize) -> Self {
        Self {
            buf: String::with_capacity(keys * key_bytes),
            ends: Vec::with_capacity(keys),
        }
    }

    /// Appends every object key of page `hash` in `layout`'s canonical order.
    pub fn push_page(
        &mut self,
        scheme: &crate::page::KeyScheme,
        layout: &crate::layout::Layout,
        hash: &crate::page::PageHash,
    ) {
        scheme.push_page_keys(layout, hash, &mut self.buf, &mut self.ends);
    }

    /// Empties the batch, keeping its buffers.
    pub fn clear(&mut self) {
        self.buf.clear();
        self.ends.clear();
    }

    /// How many keys the batch holds.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Key `i` (panics past [`Self::len`], like a slice).
    pub fn get(&self, i: usize) -> &str {
        let a = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.buf[a..self.ends[i]]
    }

    /// The keys, in the order they were pushed.
    pub fn refs(&self) -> Vec<&str> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(&self.ends).map(|(a, &b)| &self.buf[a..b]).collect()
    }
}

/// An existence query a caller awaits instead of blocking on it: one answer per key, or
/// `None` when the backend could not ask this way after all (then ask with
/// [`PoolBackend::batch_exists`], off the async runtime).
#[cfg(feature = "daemon")]
pub type ExistsFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Option<Vec<Result<bool, PoolError>>>> + Send>>;

/// The error for bytes of `len` that do not match reorder `t`.
pub(crate) fn reorder_shape(len: usize, t: &Transpose) -> PoolError {
    PoolError::ReorderShape { len, want: t.len() }
}

/// Whether the backend can serve requests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum PoolHealth {
    Ok,
    Degraded { reason: String },
}

/// A pool helper process's request queue (Mooncake's), as of its last probe. The totals
/// run over every helper the daemon started, so a replaced helper does not reset them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HelperQueue {
    /// Requests waiting in the queue for a worker.
    pub queued: u64,
    /// Requests a worker is running.
    pub in_flight: u64,
    /// Requests whose deadline passed while they waited in the queue (never run).
    pub timed_out_in_queue_total: u64,
    /// Requests refused because the queue was full.
    pub refused_full_total: u64,
    /// Requests run to completion.
    pub done_total: u64,
    /// Times the helper was replaced (each one drops this node's segment).
    pub restarts_total: u64,
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

    /// The page size of the memory that holds this node's pool objects, where the backend
    /// maps it itself (the local pool's shared-memory file), for the status.
    fn mapping_page_bytes(&self) -> Option<u64> {
        None
    }

    /// Writes each `(key, bytes)`. Per-item results, in order.
    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>>;

    /// Reads each key into its buffer; `Ok(n)` is the object's length.
    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>>;

    /// [`batch_put_from`](Self::batch_put_from) with each item's bytes reordered on the way
    /// in. An item whose bytes do not match its reorder's shape gets
    /// [`PoolError::ReorderShape`]. The default reorders into a staging buffer per
    /// reordered item and puts those; a backend that can write its objects' memory
    /// directly overrides it to reorder straight into the object (one copy, no allocation
    /// per object).
    fn batch_put_ordered(&self, items: &[PutItem<'_>]) -> Vec<Result<(), PoolError>> {
        let mut res: Vec<Result<(), PoolError>> = Vec::with_capacity(items.len());
        let mut staged: Vec<Vec<u8>> = Vec::with_capacity(items.len());
        for (_, data, order) in items {
            let mut out = Vec::new();
            res.push(match order {
                Some(t) => {
                    out = vec![0u8; data.len()];
                    if t.to_pool(data, &mut out) {
                        Ok(())
                    } else {
                        Err(reorder_shape(data.len(), t))
                    }
                }
                None => Ok(()),
            });
            staged.push(out);
        }
        let todo: Vec<usize> = (0..items.len()).filter(|&i| res[i].is_ok()).collect();
        let plain: Vec<(&str, &[u8])> = todo
            .iter()
            .map(|&i| {
                let (key, data, order) = items[i];
                (key, if order.is_some() { staged[i].as_slice() } else { data })
            })
            .collect();
        let mut done = self.batch_put_from(&plain).into_iter();
        for i in todo {
            res[i] = done
                .next()
                .unwrap_or(Err(PoolError::Unavailable("short batch answer".into())));
        }
        res
    }

    /// [`batch_get_into`](Self::batch_get_into) with each object's bytes reordered on the
    /// way out. An object whose length is not the reorder's is not copied: its result is
    /// `Ok(length)`, which the caller sees is not the length it wanted; a buffer that does
    /// not match its reorder gets [`PoolError::ReorderShape`]. The default reads reordered
    /// items into a staging buffer and reorders from there.
    fn batch_get_ordered(&self, items: &mut [GetItem<'_>]) -> Vec<Result<usize, PoolError>> {
        let mut staged: Vec<Vec<u8>> = items
            .iter()
            .map(|(_, buf, order)| {
                if order.is_some() {
                    vec![0u8; buf.len()]
                } else {
                    Vec::new()
                }
            })
            .collect();
        let mut res = {
            let mut plain: Vec<(&str, &mut [u8])> = items
                .iter_mut()
                .zip(staged.iter_mut())
                .map(|((key, buf, order), s)| {
                    let dst: &mut [u8] = if order.is_some() { s } else { buf };
                    (*key, dst)
                })
                .collect();
            self.batch_get_into(&mut plain)
        };
        for ((r, (_, buf, order)), s) in res.iter_mut().zip(items.iter_mut()).zip(&staged) {
            if let (Ok(n), Some(t)) = (&*r, order)
                && *n == s.len()
                && !t.from_pool(s, buf)
            {
                *r = Err(reorder_shape(buf.len(), t));
            }
        }
        res
    }

    /// Whether each key exists.
    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>>;

    /// Removes one object. `force` overrides a read lease.
    fn remove(&self, key: &str, force: bool) -> Result<(), PoolError>;

    fn health(&self) -> PoolHealth;

    fn usage(&self) -> PoolUsage;

    /// Keys the backend dropped on its own (its own eviction) since the last call.
    fn take_evicted(&self) -> Vec<String>;

    /// The objects (key, length) the backend found when it reopened its storage after a
    /// restart (the local pool), once: the manager books them or removes them. Default:
    /// none.
    fn take_recovered(&self) -> Vec<(String, usize)> {
        Vec::new()
    }

    /// Largest object the backend accepts.
    fn max_object_bytes(&self) -> usize;

    /// Counts the events in which the backend lost objects this node had stored without
    /// being asked (Mooncake: a replaced helper takes its segment with it). A change asks
    /// the daemon to check its pool-complete pages and write the lost ones again from
    /// host. Default: 0, never changing.
    fn lost_generation(&self) -> u64 {
        0
    }

    /// Whether objects carry a keyed MAC, and how many failed it, where the backend seals
    /// them (Mooncake). Default: `None`.
    fn integrity(&self) -> Option<IntegrityReport> {
        None
    }

    /// The helper process's request queue, where the backend runs one (Mooncake), for
    /// `/metrics`. Default: `None`.
    fn helper_queue(&self) -> Option<HelperQueue> {
        None
    }

    /// Who answers existence queries, where the backend has a choice (Mooncake: `master`
    /// or `helper`), for `kvtier status` and `/metrics`. Default: `None`.
    fn exists_source(&self) -> Option<&'static str> {
        None
    }

    /// The version the pool's master answered with, where the backend asks it (Mooncake's
    /// `ServiceReady`), for `kvtier status`. Default: `None`.
    fn master_version(&self) -> Option<String> {
        None
    }

    /// Whether [`PoolBackend::exists_async`] answers now (a backend whose existence query
    /// is network I/O it can await). Default: `false`.
    #[cfg(feature = "daemon")]
    fn awaits_exists(&self) -> bool {
        false
    }

    /// [`PoolBackend::batch_exists`] as a future that awaits its I/O instead of blocking a
    /// thread; `None` where the backend has no such query. Default: `None`.
    #[cfg(feature = "daemon")]
    fn exists_async(&self, keys: KeyBatch) -> Option<ExistsFuture> {
        drop(keys);
        None
    }
}

/// A backend's object integrity ([`PoolBackend::integrity`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IntegrityReport {
    /// Every object carries a keyed MAC, checked on every get.
    pub on: bool,
    /// Objects whose MAC failed (or that were too short for one) since start: never loaded.
    pub rejected: u64,
}
