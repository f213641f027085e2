//! How a caller's batch becomes requests to the helper.
//!
//! Each caller slice that lies inside the host arena is sent as `(region 1, offset, len)`;
//! slices elsewhere are copied through the staging region (region 0) under its lock.
//! Batches are split at `max_batch` objects, at the frame limit and when staging is full;
//! once the store is found unavailable, the rest of the batch fails without a request.

use super::codes;
use super::pool::MooncakePool;
use super::wire::{Body, MAX_FRAME, MAX_KEY, Op, Reply, WireError, decode_results};
use crate::pool::PoolError;
use crate::tier::host::SlotId;

pub(super) const REGION_STAGING: u8 = 0;
pub(super) const REGION_ARENA: u8 = 1;

/// Transfers that answered after their deadline, in this process (for the log's sampling).
static LATE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One item of a request: caller index and where its bytes are.
pub(super) struct Item<'k> {
    idx: usize,
    key: &'k str,
    region: u8,
    off: u64,
    len: u64,
}

impl MooncakePool {
    /// Sends one request of items and returns Mooncake's per-item codes. The body is
    /// column-wise (`u32 n`, key lengths, regions, offsets, lengths, then the keys), so the
    /// helper decodes a batch with a handful of calls.
    pub(super) fn send(&self, op: Op, items: &[Item]) -> Result<Vec<i64>, PoolError> {
        let conn = self.conn()?;
        let keys: usize = items.iter().map(|i| i.key.len()).sum();
        let mut body = Body::with_capacity(4 + items.len() * 19 + keys);
        body.u32(items.len() as u32);
        for it in items {
            body.u16(it.key.len() as u16);
        }
        for it in items {
            body.u8(it.region);
        }
        for it in items {
            body.u64(it.off);
        }
        for it in items {
            body.u64(it.len);
        }
        for it in items {
            body.bytes(it.key.as_bytes());
        }
        let bytes: u64 = items.iter().map(|i| i.len).sum();
        // Past its deadline the request may still be running in the helper, on caller
        // memory: wait for it to settle rather than kill a helper that is only busy (the
        // kill drops this node's segment, and every object in it, for the whole store).
        let r = conn.call_settled(op, &body, self.cfg.deadline_for(bytes), super::helper::SETTLE);
        self.reply(r, items.len(), true)
    }

    pub(super) fn reply(
        &self,
        r: Result<Reply, WireError>,
        n: usize,
        moves_bytes: bool,
    ) -> Result<Vec<i64>, PoolError> {
        match r {
            Ok(Reply::Ok(b)) => decode_results(&b, n).map_err(|e| PoolError::Backend {
                code: codes::INTERNAL_ERROR,
                message: e.to_string(),
            }),
            Ok(Reply::Unavailable(reason)) => {
                self.sup().degrade(reason.clone());
                Err(PoolError::Unavailable(reason))
            }
            Ok(Reply::Bad(message)) => Err(PoolError::Backend {
                code: codes::INVALID_PARAMS,
                message,
            }),
            // Not run: busy is back-pressure, not a sick store, so the pool stays healthy.
            Ok(Reply::Busy(reason)) => Err(PoolError::Unavailable(format!("Mooncake helper: {reason}"))),
            Err(WireError::Late(t)) => {
                // The first, then one in a hundred: an overloaded store must not flood the log.
                let n = LATE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n.is_multiple_of(100) {
                    tracing::warn!(deadline = ?t, late = n + 1, "a mooncake transfer answered after its deadline");
                }
                Err(PoolError::Unavailable(format!(
                    "Mooncake transfer answered after its deadline of {t:?}"
                )))
            }
            Err(WireError::Timeout(t)) if moves_bytes => {
                self.sup().kill("a transfer did not settle: the helper is hung");
                Err(PoolError::Unavailable(format!(
                    "Mooncake transfer timed out after {t:?}"
                )))
            }
            Err(e) => {
                let reason = format!("Mooncake helper: {e}");
                if moves_bytes {
                    // The connection closed under a transfer: the helper must be gone
                    // before the caller reuses the memory it named.
                    self.sup().reap_closed();
                }
                self.sup().degrade(reason.clone());
                Err(PoolError::Unavailable(reason))
            }
        }
    }

    /// Puts a batch and retries, once, the objects that failed with `TRANSFER_FAIL`: the
    /// master may place an object in a segment whose owner just died (until its client TTL
    /// passes), and placement is random, so one retry usually lands elsewhere. Sealed and
    /// unsealed puts both go through here; only their `lens`, `at` and `stage_in` differ.
    pub(super) fn put_retrying(
        &self,
        keys: &[&str],
        lens: &[usize],
        at: &[Option<u64>],
        stage_in: &dyn Fn(usize, &mut [u8]),
    ) -> Vec<Result<(), PoolError>> {
        self.put_codes(keys, lens, at, stage_in)
            .into_iter()
            .map(|r| r.and_then(codes::put_result))
            .collect()
    }

    /// [`Self::put_retrying`] with Mooncake's own per-object codes (a sealed put sends its
    /// batch in parts, each through here).
    pub(super) fn put_codes(
        &self,
        keys: &[&str],
        lens: &[usize],
        at: &[Option<u64>],
        stage_in: &dyn Fn(usize, &mut [u8]),
    ) -> Vec<Result<i64, PoolError>> {
        let mut res = self.transfer(Op::Put, keys, lens, at, stage_in, &mut |_, _, _| {});
        let failed: Vec<usize> = (0..res.len())
            .filter(|&i| matches!(res[i], Ok(codes::TRANSFER_FAIL)))
            .collect();
        if !failed.is_empty() {
            let keys: Vec<&str> = failed.iter().map(|&i| keys[i]).collect();
            let lens: Vec<usize> = failed.iter().map(|&i| lens[i]).collect();
            let at: Vec<Option<u64>> = failed.iter().map(|&i| at[i]).collect();
            let stage_in = |j: usize, dst: &mut [u8]| stage_in(failed[j], dst);
            let again = self.transfer(Op::Put, &keys, &lens, &at, &stage_in, &mut |_, _, _| {});
            for (&i, r) in failed.iter().zip(again) {
                res[i] = r;
            }
        }
        res
    }

    /// Plans, stages and sends a put or get batch. `at` says where each caller slice lies
    /// in the arena; `stage_in` fills staging for a put, `stage_out` empties it for a get.
    pub(super) fn transfer(
        &self,
        op: Op,
        keys: &[&str],
        lens: &[usize],
        at: &[Option<u64>],
        stage_in: &dyn Fn(usize, &mut [u8]),
        stage_out: &mut dyn FnMut(usize, &[u8], i64),
    ) -> Vec<Result<i64, PoolError>> {
        let mut out: Vec<Result<i64, PoolError>> = vec![Ok(0); keys.len()];
        let mut chunk: Vec<Item> = Vec::new();
        let mut frame = 4usize;
        let mut cursor = 0u64;
        let mut guard = None;
        let mut down: Option<PoolError> = None;
        let cap = self.staging.len_bytes();
        // Every put passes the staging buffer's gate, whether it stages or names arena
        // memory: a put from the arena sent while a transfer is stuck on the pool waits in
        // the helper behind it, past its deadline, until the helper is replaced as hung
        // (15 s), and a store that demotes pages to make room would wait that long. At
        // the gate it waits at most the op timeout, and not at all once that has passed
        // (see `lock_staging`), so such a put fails at once and the store goes on.
        if op == Op::Put && at.iter().any(Option::is_some) {
            guard = self.lock_staging();
            if guard.is_none() {
                return vec![Err(staging_busy()); keys.len()];
            }
        }
        let mut flush = |chunk: &mut Vec<Item>, out: &mut Vec<Result<i64, PoolError>>, down: &mut Option<PoolError>| {
            if chunk.is_empty() {
                return;
            }
            let res = match down {
                Some(e) => Err(e.clone()),
                None => self.send(op, chunk),
            };
            match res {
                Ok(codes) => {
                    for (it, code) in chunk.iter().zip(codes) {
                        if it.region == REGION_STAGING && code >= 0 {
                            // SAFETY: staging is ours while `guard` holds its lock.
                            if let Ok(s) = unsafe { self.staging.slot(SlotId(0), (it.off + it.len) as usize) } {
                                stage_out(it.idx, &s[it.off as usize..], code);
                            }
                        }
                        out[it.idx] = Ok(code);
                    }
                }
                Err(e) => {
                    if matches!(e, PoolError::Unavailable(_)) {
                        *down = Some(e.clone());
                    }
                    for it in chunk.iter() {
                        out[it.idx] = Err(e.clone());
                    }
                }
            }
            chunk.clear();
        };
        for (i, key) in keys.iter().enumerate() {
            if let Err(e) = self.check(key, if at[i].is_some() { 0 } else { lens[i] }) {
                out[i] = Err(e);
                continue;
            }
            let len = lens[i] as u64;
            let (region, off) = match at[i] {
                Some(off) => (REGION_ARENA, off),
                None => {
                    if cursor + len > cap {
                        flush(&mut chunk, &mut out, &mut down);
                        frame = 4;
                        cursor = 0;
                    }
                    if guard.is_none() {
                        guard = self.lock_staging();
                        if guard.is_none() {
                            out[i] = Err(staging_busy());
                            continue;
                        }
                    }
                    // SAFETY: staging is ours while `guard` holds its lock.
                    if let Ok(s) = unsafe { self.staging.slot_mut(SlotId(0), (cursor + len) as usize) } {
                        stage_in(i, &mut s[cursor as usize..]);
                    }
                    let off = cursor;
                    cursor = (cursor + len).div_ceil(64) * 64;
                    (REGION_STAGING, off)
                }
            };
            chunk.push(Item {
                idx: i,
                key,
                region,
                off,
                len,
            });
            frame += key.len() + 19;
            if chunk.len() >= self.cfg.max_batch || frame + MAX_KEY + 64 > MAX_FRAME {
                flush(&mut chunk, &mut out, &mut down);
                frame = 4;
                cursor = 0;
            }
        }
        flush(&mut chunk, &mut out, &mut down);
        out
    }

    /// The staging buffer, waited for no longer than the op timeout: a transfer holds it
    /// until its reply, and a get from a helper stuck on its master may wait past its
    /// deadline until the helper is replaced as hung. Once a wait has timed out, callers
    /// do not wait at all until the buffer is free again, so a store that demotes pages
    /// to make room fails those puts at once (and drops the pages) instead of queueing.
    fn lock_staging(&self) -> Option<parking_lot::MutexGuard<'_, ()>> {
        use std::sync::atomic::Ordering;
        let g = if self.staging_stalled.load(Ordering::Relaxed) {
            self.staging_lock.try_lock()
        } else {
            self.staging_lock.try_lock_for(self.cfg.op_timeout)
        };
        self.staging_stalled.store(g.is_none(), Ordering::Relaxed);
        g
    }

    /// Sends a key-only request (exists, remove), split at `max_batch`.
    pub(super) fn keys_op(&self, op: Op, prefix: Option<u8>, keys: &[&str]) -> Vec<Result<i64, PoolError>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(self.cfg.max_batch) {
            if let Some(bad) = part.iter().find_map(|k| self.check(k, 0).err()) {
                out.extend(part.iter().map(|_| Err(bad.clone())));
                continue;
            }
            let res = self.conn().and_then(|conn| {
                // Keys joined by NUL (`check` refuses keys holding one): the helper splits
                // them in one call instead of a Python loop per key.
                let mut body = Body::with_capacity(5 + part.iter().map(|k| k.len() + 1).sum::<usize>());
                if let Some(p) = prefix {
                    body.u8(p);
                }
                body.u32(part.len() as u32);
                for (i, k) in part.iter().enumerate() {
                    if i > 0 {
                        body.u8(0);
                    }
                    body.bytes(k.as_bytes());
                }
                self.reply(conn.call(op, &body, self.cfg.op_timeout), part.len(), false)
            });
            match res {
                Ok(codes) => out.extend(codes.into_iter().map(Ok)),
                Err(e) => out.extend(part.iter().map(|_| Err(e.clone()))),
            }
        }
        out
    }
}

/// What a transfer that found the staging buffer's gate shut answers.
fn staging_busy() -> PoolError {
    PoolError::Unavailable(
        "the staging buffer stayed busy past the op timeout: a transfer in it waits on the pool".into(),
    )
}
