//! `MooncakeCPool`: the [`PoolBackend`] over upstream Mooncake's own C ABI.
//!
//! For sites that build `libmooncake_store.so` with `cmake -DWITH_STORE_C_SHARED=ON`.
//! bindgen binds upstream's `mooncake-store/include/store_c.h`, vendored verbatim in
//! `include/upstream/mooncake/` (feature `mooncake-c`), and the library is opened at run
//! time (`mooncake.library`, else `MOONCAKE_STORE_LIBRARY`), like upstream's Rust crate
//! with its `dlopen` feature: nothing links against Mooncake at build time. The client runs
//! in the daemon's process, so no helper process is started. The host arena is registered
//! whole; how objects move is in [`io`], and how every call is bounded in [`client`].

mod client;
mod io;

use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{MooncakeConfig, MooncakeError, RemovePolicy, codes};
use crate::pool::{IntegrityReport, PoolBackend, PoolError, PoolHealth, PoolUsage};
use crate::tier::host::HostArena;
use client::{StoreClient, cstr};

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
mod sys {
    include!(concat!(env!("OUT_DIR"), "/mooncake_store_c.rs"));
}

/// Where the library is looked for when no path is configured.
pub const LIBRARY_ENV: &str = "MOONCAKE_STORE_LIBRARY";

/// The Mooncake Store backend through the C ABI.
pub struct MooncakeCPool {
    client: StoreClient,
    cfg: MooncakeConfig,
    arena: Option<Arc<HostArena>>,
    /// Registered with the store; objects that cannot move directly are packed here.
    staging: Mutex<Vec<u8>>,
    staging_len: usize,
}

/// The library to load: `library` when given, else [`LIBRARY_ENV`].
pub fn library_path(library: Option<&Path>) -> Result<PathBuf, MooncakeError> {
    match library {
        Some(p) if !p.as_os_str().is_empty() => Ok(p.to_owned()),
        _ => std::env::var_os(LIBRARY_ENV).map(Into::into).ok_or_else(|| {
            MooncakeError::Library(format!(
                "no library: set mooncake.library or {LIBRARY_ENV} to the absolute path of libmooncake_store.so"
            ))
        }),
    }
}

/// Loads the library (`library`, else [`LIBRARY_ENV`]) and checks that it has every
/// function of upstream's header, without connecting: the daemon's start-up check.
pub fn check_library(library: Option<&Path>) -> Result<PathBuf, MooncakeError> {
    let path = library_path(library)?;
    client::open_library(&path)?;
    Ok(path)
}

impl MooncakeCPool {
    /// Opens the library (`library`, else `MOONCAKE_STORE_LIBRARY`), connects to the master
    /// (within the configured start timeout) and registers the arena and the staging buffer.
    pub fn open(
        cfg: MooncakeConfig,
        library: Option<&Path>,
        arena: Option<Arc<HostArena>>,
    ) -> Result<Self, MooncakeError> {
        cfg.validate()?;
        let client = StoreClient::load(&library_path(library)?)?;
        let staging_len = cfg.staging_bytes as usize;
        let mut pool = Self {
            client,
            staging: Mutex::new(vec![0u8; staging_len]),
            staging_len,
            cfg,
            arena,
        };
        let c = &pool.cfg;
        pool.client.setup(
            c.start_timeout,
            cstr("mooncake.local_hostname", &c.local_hostname)?,
            cstr("mooncake.metadata", &c.metadata)?,
            c.segment_bytes,
            c.local_buffer_bytes,
            cstr("mooncake.protocol", &c.protocol)?,
            cstr("mooncake.device", &c.device)?,
            cstr("mooncake.master", &c.master)?,
        )?;
        let staging = pool.staging.get_mut().as_mut_ptr();
        // SAFETY: the staging buffer and the arena live as long as the pool, which owns the
        // handle; transfers run on callers' threads, never after the pool is gone.
        unsafe {
            pool.client.register(staging, staging_len)?;
            if let Some(a) = &pool.arena {
                pool.client.register(a.base_ptr(), a.len_bytes() as usize)?;
            }
        }
        Ok(pool)
    }

    fn replicate_config(&self) -> sys::mooncake_replicate_config_t {
        sys::mooncake_replicate_config_t {
            replica_num: self.cfg.replicas as usize,
            with_soft_pin: 0,
            with_hard_pin: 0,
            preferred_segments: std::ptr::null_mut(),
            preferred_segments_count: 0,
        }
    }

    /// One remove, bounded.
    fn remove_once(&self, key: &str, force: bool) -> Result<(), PoolError> {
        let ck = io::ckeys(&[key])?.pop().ok_or(PoolError::NotFound)?;
        let rc = self.client.bounded("remove", self.cfg.deadline_for(0), move |c| {
            // SAFETY: a valid handle and a NUL-terminated key the callee copies.
            unsafe { c.lib.mooncake_store_remove(c.store, ck.as_ptr(), force as i32) }
        })?;
        match rc as i64 {
            0 => Ok(()),
            c => Err(codes::to_error(c, 0)),
        }
    }
}

impl PoolBackend for MooncakeCPool {
    fn name(&self) -> &'static str {
        "mooncake-c"
    }

    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        self.put(items)
    }

    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        self.get(items)
    }

    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        let mut res = Vec::with_capacity(keys.len());
        for part in keys.chunks(self.cfg.max_batch.max(1)) {
            let ck = match io::ckeys(part) {
                Ok(k) => k,
                Err(e) => {
                    res.extend(part.iter().map(|_| Err(e.clone())));
                    continue;
                }
            };
            let n = part.len();
            let answer = self
                .client
                .bounded("batch_is_exist", self.cfg.deadline_for(0), move |c| {
                    let kp: Vec<*const c_char> = ck.iter().map(|k| k.as_ptr()).collect();
                    let mut out = vec![0i32; n];
                    // SAFETY: arrays of `n` entries, owned by this closure for the call.
                    let rc = unsafe {
                        c.lib
                            .mooncake_store_batch_is_exist(c.store, kp.as_ptr().cast_mut(), n, out.as_mut_ptr())
                    };
                    (rc, out)
                });
            match answer {
                Ok((0, out)) => res.extend(out.into_iter().map(|c| codes::exists_result(c as i64))),
                Ok((rc, _)) => res.extend(part.iter().map(|_| Err(codes::to_error(rc as i64, 0)))),
                Err(e) => res.extend(part.iter().map(|_| Err(e.clone()))),
            }
        }
        res
    }

    fn remove(&self, key: &str, force: bool) -> Result<(), PoolError> {
        let (force, attempts, interval) = match self.cfg.remove_policy {
            _ if force => (true, 1, std::time::Duration::ZERO),
            RemovePolicy::Force => (true, 1, std::time::Duration::ZERO),
            RemovePolicy::Fail => (false, 1, std::time::Duration::ZERO),
            RemovePolicy::Retry { attempts, interval } => (false, attempts.max(1), interval),
        };
        for n in 0..attempts {
            if n > 0 {
                std::thread::sleep(interval);
            }
            match self.remove_once(key, force) {
                Err(PoolError::HasLease) => continue,
                r => return r,
            }
        }
        Err(PoolError::HasLease)
    }

    fn health(&self) -> PoolHealth {
        if let Some(why) = self.client.refusal() {
            return PoolHealth::Degraded { reason: why };
        }
        // SAFETY: a valid handle.
        let rc = self
            .client
            .bounded("health_check", self.cfg.deadline_for(0), |c| unsafe {
                c.lib.mooncake_store_health_check(c.store)
            });
        match rc {
            Ok(0) => PoolHealth::Ok,
            Ok(1) => PoolHealth::Degraded {
                reason: "Mooncake client not initialised".into(),
            },
            Ok(c) => PoolHealth::Degraded {
                reason: format!("Mooncake master unreachable (health_check {c})"),
            },
            Err(e) => PoolHealth::Degraded { reason: e.to_string() },
        }
    }

    fn usage(&self) -> PoolUsage {
        PoolUsage {
            capacity_bytes: self.cfg.segment_bytes,
            ..PoolUsage::default()
        }
    }

    fn take_evicted(&self) -> Vec<String> {
        Vec::new()
    }

    fn max_object_bytes(&self) -> usize {
        self.staging_len - self.trailer_len()
    }

    fn integrity(&self) -> Option<IntegrityReport> {
        Some(IntegrityReport {
            on: self.cfg.integrity.is_some(),
            rejected: self.cfg.integrity.as_ref().map_or(0, |m| m.rejected()),
        })
    }

    fn exists_source(&self) -> Option<&'static str> {
        Some("c-abi")
    }
}

impl MooncakeCPool {
    fn trailer_len(&self) -> usize {
        if self.cfg.integrity.is_some() {
            super::integrity::MAC_LEN
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests;
