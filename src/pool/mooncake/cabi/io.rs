//! Puts and gets over the C ABI: straight from and into the registered host arena where
//! that is safe, and through the registered staging buffer otherwise, packed there so
//! that one C call moves many objects.
//!
//! With the integrity MAC on ([`crate::pool::mooncake::integrity`]), every object is
//! `page bytes ‖ MAC(32)` in the store, as on the helper path, and moves through staging:
//! the MAC is written after the copy in on a put and checked before the copy out on a get,
//! so a caller never sees bytes whose MAC failed. Such an object is a miss (`NotFound`),
//! counted, and removed from the store.

use std::ffi::{CString, c_char, c_void};

use super::MooncakeCPool;
use crate::pool::PoolError;
use crate::pool::mooncake::codes;

/// A buffer as the C ABI takes it: pointer and size.
pub(super) type Buf = (*mut c_void, usize);

/// Keys as C strings; a NUL byte in one is `INVALID_KEY`.
pub(super) fn ckeys(keys: &[&str]) -> Result<Vec<CString>, PoolError> {
    keys.iter()
        .map(|k| {
            CString::new(*k).map_err(|_| PoolError::Backend {
                code: codes::INVALID_KEY,
                message: "key contains a NUL byte".into(),
            })
        })
        .collect()
}

/// One batch call's arguments as the C ABI takes them: the keys as C strings and their
/// pointers, the buffers' pointers and sizes. The pointers stay valid while this lives
/// (a `CString`'s bytes do not move with it).
struct CBatch {
    _owned: Vec<CString>,
    keys: Vec<*const c_char>,
    ptrs: Vec<*mut c_void>,
    sizes: Vec<usize>,
}

impl CBatch {
    fn new(keys: &[&str], bufs: &[Buf]) -> Result<Self, PoolError> {
        let owned = ckeys(keys)?;
        Ok(Self {
            keys: owned.iter().map(|k| k.as_ptr()).collect(),
            _owned: owned,
            ptrs: bufs.iter().map(|b| b.0).collect(),
            sizes: bufs.iter().map(|b| b.1).collect(),
        })
    }

    /// Bytes the call moves, for its deadline.
    fn bytes(&self) -> u64 {
        self.sizes.iter().sum::<usize>() as u64
    }
}

/// One staged object: its index in the caller's batch, and its region of staging.
struct Slot {
    item: usize,
    off: usize,
    len: usize,
}

impl MooncakeCPool {
    /// One batch put of registered buffers (at most `max_batch`); per-key results.
    pub(super) fn put_raw(&self, keys: &[&str], bufs: &[Buf]) -> Vec<Result<(), PoolError>> {
        let n = keys.len();
        let mut b = match CBatch::new(keys, bufs) {
            Ok(b) => b,
            Err(e) => return vec![Err(e); n],
        };
        let mut out = vec![0i32; n];
        let config = self.replicate_config();
        let deadline = self.cfg.deadline_for(b.bytes());
        // SAFETY: arrays of `n` entries and a config, alive for the call; the buffers are
        // registered and the callee only reads them.
        let rc = self.client.transfer(deadline, |c| unsafe {
            c.lib.mooncake_store_batch_put_from(
                c.store,
                b.keys.as_ptr().cast_mut(),
                b.ptrs.as_mut_ptr(),
                b.sizes.as_ptr(),
                n,
                &config,
                out.as_mut_ptr(),
            )
        });
        match rc {
            Err(e) => vec![Err(e); n],
            Ok(0) => out.into_iter().map(|c| codes::put_result(c as i64)).collect(),
            Ok(rc) => vec![Err(codes::to_error(rc as i64, 0)); n],
        }
    }

    /// One batch get into registered buffers (at most `max_batch`); per-key lengths.
    pub(super) fn get_raw(&self, keys: &[&str], bufs: &[Buf]) -> Vec<Result<usize, PoolError>> {
        let n = keys.len();
        let mut b = match CBatch::new(keys, bufs) {
            Ok(b) => b,
            Err(e) => return vec![Err(e); n],
        };
        let mut out = vec![0i64; n];
        let deadline = self.cfg.deadline_for(b.bytes());
        // SAFETY: as in `put_raw`; the callee writes at most `sizes[i]` bytes to `ptrs[i]`,
        // and returns before this function does (a transfer is never abandoned).
        let rc = self.client.transfer(deadline, |c| unsafe {
            c.lib.mooncake_store_batch_get_into(
                c.store,
                b.keys.as_ptr().cast_mut(),
                b.ptrs.as_mut_ptr(),
                b.sizes.as_ptr(),
                n,
                out.as_mut_ptr(),
            )
        });
        match rc {
            Err(e) => vec![Err(e); n],
            Ok(0) => out
                .into_iter()
                .zip(&b.sizes)
                .map(|(c, &s)| codes::get_result(c, s))
                .collect(),
            Ok(rc) => vec![Err(codes::to_error(rc as i64, 0)); n],
        }
    }

    /// Moves the items with a direct buffer (`Some`: in the registered arena) with `raw`,
    /// `max_batch` a call; the others stay `None`.
    fn direct<T: Clone>(
        &self,
        keys: &[&str],
        bufs: &[Option<Buf>],
        out: &mut [Option<Result<T, PoolError>>],
        raw: impl Fn(&[&str], &[Buf]) -> Vec<Result<T, PoolError>>,
    ) {
        let direct: Vec<(usize, Buf)> = bufs.iter().enumerate().filter_map(|(i, b)| Some((i, (*b)?))).collect();
        for chunk in direct.chunks(self.cfg.max_batch.max(1)) {
            let ks: Vec<&str> = chunk.iter().map(|&(i, _)| keys[i]).collect();
            let bs: Vec<Buf> = chunk.iter().map(|&(_, b)| b).collect();
            for (&(i, _), r) in chunk.iter().zip(raw(&ks, &bs)) {
                out[i] = Some(r);
            }
        }
    }

    /// Whether `bytes` may move without staging: in the registered arena, with no MAC to add.
    fn direct_ok(&self, bytes: &[u8]) -> bool {
        self.cfg.integrity.is_none() && self.arena.as_ref().is_some_and(|a| a.offset_of(bytes).is_some())
    }

    /// Cuts the items `todo` (object lengths `need`) into runs that fit staging and
    /// `max_batch`; an object larger than staging gets `too_large`.
    fn pack(&self, todo: &[usize], need: impl Fn(usize) -> usize, mut too_large: impl FnMut(usize)) -> Vec<Vec<Slot>> {
        let cap = self.staging_len;
        let mut runs: Vec<Vec<Slot>> = Vec::new();
        let mut run: Vec<Slot> = Vec::new();
        let mut off = 0;
        for &item in todo {
            let len = need(item);
            if len > cap {
                too_large(item);
                continue;
            }
            if off + len > cap || run.len() >= self.cfg.max_batch.max(1) {
                runs.push(std::mem::take(&mut run));
                off = 0;
            }
            run.push(Slot { item, off, len });
            off += len;
        }
        if !run.is_empty() {
            runs.push(run);
        }
        runs
    }

    pub(super) fn put(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        let keys: Vec<&str> = items.iter().map(|i| i.0).collect();
        let bufs: Vec<Option<Buf>> = items
            .iter()
            .map(|(_, d)| self.direct_ok(d).then(|| (d.as_ptr().cast_mut().cast(), d.len())))
            .collect();
        let mut out: Vec<Option<Result<(), PoolError>>> = vec![None; items.len()];
        self.direct(&keys, &bufs, &mut out, |k, b| self.put_raw(k, b));
        let todo: Vec<usize> = (0..items.len()).filter(|&i| out[i].is_none()).collect();
        let trailer = self.trailer_len();
        let max = self.staging_len - trailer;
        let runs = self.pack(
            &todo,
            |i| items[i].1.len() + trailer,
            |i| {
                out[i] = Some(Err(PoolError::TooLarge {
                    len: items[i].1.len(),
                    max,
                }))
            },
        );
        if !runs.is_empty() {
            let mut staging = self.staging.lock();
            for run in runs {
                for s in &run {
                    let (key, data) = items[s.item];
                    let obj = &mut staging[s.off..s.off + s.len];
                    obj[..data.len()].copy_from_slice(data);
                    if let Some(mac) = &self.cfg.integrity {
                        mac.seal(key, obj);
                    }
                }
                let base = staging.as_mut_ptr();
                let ks: Vec<&str> = run.iter().map(|s| keys[s.item]).collect();
                // SAFETY: every region lies inside the staging buffer (packed by `pack`).
                let bs: Vec<Buf> = run.iter().map(|s| (unsafe { base.add(s.off) }.cast(), s.len)).collect();
                for (s, r) in run.iter().zip(self.put_raw(&ks, &bs)) {
                    out[s.item] = Some(r);
                }
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or(Err(PoolError::Unavailable("short batch answer".into()))))
            .collect()
    }

    pub(super) fn get(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        let keys: Vec<&str> = items.iter().map(|i| i.0).collect();
        let bufs: Vec<Option<Buf>> = items
            .iter_mut()
            .map(|(_, b)| self.direct_ok(b).then(|| (b.as_mut_ptr().cast(), b.len())))
            .collect();
        let mut out: Vec<Option<Result<usize, PoolError>>> = vec![None; items.len()];
        self.direct(&keys, &bufs, &mut out, |k, b| self.get_raw(k, b));
        let todo: Vec<usize> = (0..items.len()).filter(|&i| out[i].is_none()).collect();
        let trailer = self.trailer_len();
        let cap = self.staging_len;
        // A buffer larger than staging reads what staging holds: a larger object is then
        // BufferTooSmall, like a small buffer.
        let runs = self.pack(&todo, |i| (items[i].1.len() + trailer).min(cap), |_| {});
        if runs.is_empty() {
            return out.into_iter().map(|r| r.unwrap_or(Err(PoolError::NotFound))).collect();
        }
        let mut staging = self.staging.lock();
        let mut bad: Vec<&str> = Vec::new();
        for run in runs {
            let base = staging.as_mut_ptr();
            let ks: Vec<&str> = run.iter().map(|s| keys[s.item]).collect();
            // SAFETY: every region lies inside the staging buffer (packed by `pack`).
            let bs: Vec<Buf> = run.iter().map(|s| (unsafe { base.add(s.off) }.cast(), s.len)).collect();
            for (s, r) in run.iter().zip(self.get_raw(&ks, &bs)) {
                let (key, buf) = &mut items[s.item];
                let got = &staging[s.off..s.off + s.len];
                out[s.item] = Some(match r {
                    Ok(n) => match &self.cfg.integrity {
                        Some(mac) => match mac.open(key, &got[..n.min(s.len)]) {
                            Some(page) if page.len() <= buf.len() => {
                                buf[..page.len()].copy_from_slice(page);
                                Ok(page.len())
                            }
                            Some(page) => Err(PoolError::BufferTooSmall {
                                got: buf.len(),
                                need: page.len(),
                            }),
                            None => {
                                bad.push(keys[s.item]);
                                Err(PoolError::NotFound)
                            }
                        },
                        None => {
                            let n = n.min(buf.len());
                            buf[..n].copy_from_slice(&got[..n]);
                            Ok(n)
                        }
                    },
                    Err(PoolError::BufferTooSmall { .. }) => Err(PoolError::BufferTooSmall {
                        got: buf.len(),
                        need: buf.len() + 1,
                    }),
                    Err(e) => Err(e),
                });
            }
        }
        drop(staging);
        // An object whose MAC failed is removed, so that no lookup credits it again.
        for key in bad {
            if let Err(e) = self.remove_once(key, true) {
                tracing::warn!(error = %e, "could not remove a Mooncake object that failed its MAC");
            }
        }
        out.into_iter().map(|r| r.unwrap_or(Err(PoolError::NotFound))).collect()
    }
}
