//! The loaded library and its store handle, and how every call into it is bounded.
//!
//! Upstream's C functions block the calling thread until the client has its answer: setup
//! connects to the master and mounts the segment, and every object call is an RPC to the
//! master plus, for puts and gets, transfers. None takes a deadline. kvtier bounds them in
//! two ways:
//!
//! - Calls that touch no caller memory (setup, existence, remove, health) run on a thread
//!   of their own ([`StoreClient::bounded`]); the caller waits up to its deadline and then gets
//!   [`PoolError::Unavailable`]. The thread keeps the library and the handle alive (an
//!   [`Arc`]) until upstream returns; at most [`MAX_ABANDONED`] such calls may be left
//!   running, after which new ones are refused at once.
//! - Puts and gets read or write the caller's buffers, so kvtier never walks away from one
//!   (a late write would land in memory the caller has reused). They run on the caller's
//!   thread ([`StoreClient::transfer`]), bounded by upstream's own RPC and transfer timeouts.
//!   While one has overrun kvtier's deadline, the pool reports itself degraded and every
//!   new call is refused at once, so one stuck transfer never stalls other callers.

use std::ffi::CString;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::sys;
use crate::pool::PoolError;
use crate::pool::mooncake::{MooncakeError, codes};

/// Calls past their deadline still running on their threads before new bounded calls are
/// refused.
pub const MAX_ABANDONED: usize = 4;

/// The library and one store handle; destroyed when the last holder (the pool, or a call
/// still running on its thread) lets go.
pub struct Inner {
    pub lib: sys::MooncakeStoreC,
    pub store: sys::mooncake_store_t,
}

// SAFETY: upstream's client serves concurrent callers on one handle (SGLang's HiCache calls
// it from several threads); the handle is a pointer we never dereference ourselves.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: the handle came from mooncake_store_create and is destroyed once, when no
        // call uses it any more (every call holds the Arc).
        unsafe { self.lib.mooncake_store_destroy(self.store) };
    }
}

/// A transfer in progress, by id, and when it passes kvtier's deadline.
type Running = Vec<(u64, Instant)>;

pub struct StoreClient {
    inner: Arc<Inner>,
    abandoned: Arc<AtomicUsize>,
    running: Mutex<Running>,
    next_id: AtomicU64,
}

/// A string for the C side; a NUL byte inside is a configuration error.
pub fn cstr(what: &str, s: &str) -> Result<CString, MooncakeError> {
    CString::new(s).map_err(|_| MooncakeError::Config(format!("{what} contains a NUL byte")))
}

impl StoreClient {
    /// Opens the library at `path` (every function of upstream's header must be present)
    /// and creates a handle.
    pub fn load(path: &Path) -> Result<Self, MooncakeError> {
        let lib = open_library(path)?;
        // SAFETY: plain constructor of the ABI; it catches its own exceptions.
        let store = unsafe { lib.mooncake_store_create() };
        if store.is_null() {
            return Err(MooncakeError::Library("mooncake_store_create returned NULL".into()));
        }
        Ok(Self {
            inner: Arc::new(Inner { lib, store }),
            abandoned: Arc::new(AtomicUsize::new(0)),
            running: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
        })
    }
}

/// Opens the library at `path`, an absolute path, resolving every function of upstream's
/// header (a library built from another version of it is refused, naming the function).
pub fn open_library(path: &Path) -> Result<sys::MooncakeStoreC, MooncakeError> {
    if !path.is_absolute() {
        return Err(MooncakeError::Library(format!(
            "{}: the library path must be absolute (a bare name would be searched for by the loader)",
            path.display()
        )));
    }
    if !path.exists() {
        return Err(MooncakeError::Library(format!(
            "{}: no such file (build it with cmake -DWITH_STORE_C_SHARED=ON, see docs/pool.md)",
            path.display()
        )));
    }
    // The library runs in the daemon with the arena mapped: held to the rules of the
    // helper's interpreter, placed and swappable only by the daemon's user or root.
    crate::pool::mooncake::programs::check(path, "mooncake.library")
        .map_err(|e| MooncakeError::Library(e.to_string()))?;
    // SAFETY: loading runs the library's initialisers; it is the Mooncake library the
    // operator named, and every symbol of upstream's header is resolved before use.
    unsafe { sys::MooncakeStoreC::new(path) }.map_err(|e| {
        MooncakeError::Library(format!(
            "{}: not a Mooncake Store C library for the vendored store_c.h: {e}",
            path.display()
        ))
    })
}

impl StoreClient {
    /// Why no new call may start now: a transfer past its deadline, or too many abandoned
    /// bounded calls.
    pub fn refusal(&self) -> Option<String> {
        let now = Instant::now();
        if self.running.lock().iter().any(|&(_, end)| end < now) {
            return Some("a Mooncake transfer overran its deadline and has not returned".into());
        }
        let n = self.abandoned.load(Ordering::Relaxed);
        (n >= MAX_ABANDONED).then(|| format!("{n} Mooncake calls overran their deadline and have not returned"))
    }

    /// Bounded calls past their deadline whose threads still run.
    #[cfg(test)]
    pub fn abandoned_now(&self) -> usize {
        self.abandoned.load(Ordering::Relaxed)
    }

    /// Runs `f` on a thread of its own and waits up to `deadline` for it. `what` names the
    /// call in errors.
    pub fn bounded<T: Send + 'static>(
        &self,
        what: &'static str,
        deadline: Duration,
        f: impl FnOnce(&Inner) -> T + Send + 'static,
    ) -> Result<T, PoolError> {
        if let Some(why) = self.refusal() {
            return Err(PoolError::Unavailable(why));
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let inner = self.inner.clone();
        let abandoned = self.abandoned.clone();
        let spawned = std::thread::Builder::new()
            .name("kvtier-mooncake-c".into())
            .spawn(move || {
                let out = f(&inner);
                if tx.send(out).is_err() {
                    // The caller gave up on us: we are no longer running.
                    abandoned.fetch_sub(1, Ordering::Relaxed);
                }
            });
        if let Err(e) = spawned {
            return Err(PoolError::Unavailable(format!("no thread for a Mooncake call: {e}")));
        }
        match rx.recv_timeout(deadline) {
            Ok(v) => Ok(v),
            Err(_) => {
                self.abandoned.fetch_add(1, Ordering::Relaxed);
                // The answer may have come between the timeout and the count: take it.
                match rx.try_recv() {
                    Ok(v) => {
                        self.abandoned.fetch_sub(1, Ordering::Relaxed);
                        Ok(v)
                    }
                    Err(_) => Err(PoolError::Unavailable(format!(
                        "Mooncake {what} did not answer within {} ms",
                        deadline.as_millis()
                    ))),
                }
            }
        }
    }

    /// Runs a put or get `f` on the caller's thread, booked as running with `deadline`, so
    /// that other callers are refused while it overruns. Refused at once itself when
    /// another has.
    pub fn transfer<T>(&self, deadline: Duration, f: impl FnOnce(&Inner) -> T) -> Result<T, PoolError> {
        if let Some(why) = self.refusal() {
            return Err(PoolError::Unavailable(why));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.running.lock().push((id, Instant::now() + deadline));
        let out = f(&self.inner);
        self.running.lock().retain(|&(i, _)| i != id);
        Ok(out)
    }

    /// Connects to the master and mounts the segment, within `deadline`.
    #[allow(clippy::too_many_arguments)]
    pub fn setup(
        &self,
        deadline: Duration,
        host: CString,
        meta: CString,
        segment: u64,
        local_buffer: u64,
        proto: CString,
        dev: CString,
        master: CString,
    ) -> Result<(), MooncakeError> {
        let rc = self
            .bounded("setup", deadline, move |c| {
                // SAFETY: a valid handle and NUL-terminated strings the callee copies.
                unsafe {
                    c.lib.mooncake_store_setup(
                        c.store,
                        host.as_ptr(),
                        meta.as_ptr(),
                        segment,
                        local_buffer,
                        proto.as_ptr(),
                        dev.as_ptr(),
                        master.as_ptr(),
                    )
                }
            })
            .map_err(|e| MooncakeError::Library(format!("setup: {e}")))?;
        if rc != 0 {
            return Err(MooncakeError::Library(format!(
                "setup failed: {} ({rc}); is the master up and the metadata server reachable?",
                codes::name(rc as i64)
            )));
        }
        Ok(())
    }

    /// Registers `len` bytes at `ptr` for copy-free transfers.
    ///
    /// # Safety
    /// The region must stay mapped for as long as the handle lives.
    pub unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<(), MooncakeError> {
        // SAFETY: the caller keeps the region alive; register_buffer only records it.
        let rc = unsafe {
            self.inner
                .lib
                .mooncake_store_register_buffer(self.inner.store, ptr.cast(), len)
        };
        if rc != 0 {
            return Err(MooncakeError::Library(format!(
                "register_buffer of {len} bytes failed: {} ({rc})",
                codes::name(rc as i64)
            )));
        }
        Ok(())
    }
}
