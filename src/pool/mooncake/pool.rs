//! [`MooncakePool`]: the [`PoolBackend`] over the wheel's client, through the helper.
//!
//! Each caller slice that lies inside the host arena is sent as `(region 1, offset, len)`:
//! the helper moves it straight between its own mapping of the arena file and the store.
//! Slices elsewhere (tests, tools, an engine's private buffer) are copied through the
//! staging region (region 0, a shared-memory file of the same kind, one batch at a time).
//! Batches are split at `max_batch` objects, at the frame limit and when staging is full.
//! A transfer that overruns its deadline kills the helper before the call returns, since
//! a late transfer could otherwise touch caller memory that has been reused.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::helper::{Launch, Supervisor};
use super::wire::{Body, MAX_FRAME, MAX_KEY, Op, Reply, WireError, decode_results};
use super::{MooncakeConfig, MooncakeError, RemovePolicy, codes};
use crate::pool::{PoolBackend, PoolError, PoolHealth, PoolUsage};
use crate::tier::host::{ArenaOptions, HostArena, SlotId};

const HELPER_PY: &str = include_str!("../../../python/kvtier_mooncake_helper.py");
const REGION_STAGING: u8 = 0;
const REGION_ARENA: u8 = 1;
static RUN_SEQ: AtomicU64 = AtomicU64::new(0);

/// One item of a request: caller index and where its bytes are.
struct Item<'k> {
    idx: usize,
    key: &'k str,
    region: u8,
    off: u64,
    len: u64,
}

/// The baseline timing the helper measured with the wheel's own batch calls.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct RawBench {
    pub seconds: f64,
    pub failed: u64,
}

/// The Mooncake Store backend through the PyPI wheel's client.
pub struct MooncakePool {
    cfg: MooncakeConfig,
    sup: Option<Supervisor>,
    arena: Option<Arc<HostArena>>,
    staging: HostArena,
    staging_lock: Mutex<()>,
    run_dir: PathBuf,
    owns_run_dir: bool,
}

impl MooncakePool {
    /// Starts the helper and returns at once; the pool is `Degraded` until the helper is
    /// up and the master reachable (see [`MooncakePool::wait_healthy`]). `arena` is the
    /// host arena whose slices move without copies.
    pub fn start(cfg: MooncakeConfig, arena: Option<Arc<HostArena>>) -> Result<Self, MooncakeError> {
        cfg.validate()?;
        let (run_dir, owns_run_dir) = match &cfg.run_dir {
            Some(d) => (d.clone(), false),
            None => {
                let shm = Path::new("/dev/shm");
                let base = if shm.is_dir() {
                    shm.to_owned()
                } else {
                    std::env::temp_dir()
                };
                let seq = RUN_SEQ.fetch_add(1, Ordering::Relaxed);
                (base.join(format!("kvtier-mooncake-{}-{seq}", std::process::id())), true)
            }
        };
        std::fs::create_dir_all(&run_dir)?;
        let staging_path = run_dir.join("staging");
        let opts = ArenaOptions {
            lock: false,
            prefault: true,
            touch_threads: 1,
        };
        let staging = HostArena::create(&staging_path, cfg.staging_bytes, cfg.staging_bytes, &opts)?;
        let script = match &cfg.helper_script {
            Some(p) => p.clone(),
            None => {
                let p = run_dir.join("kvtier_mooncake_helper.py");
                std::fs::write(&p, HELPER_PY)?;
                p
            }
        };
        let python = cfg.python.clone().unwrap_or_else(|| {
            let venv = PathBuf::from(".venv/bin/python3");
            if venv.exists() { venv } else { PathBuf::from("python3") }
        });
        let mut regions = vec![(staging_path, staging.len_bytes())];
        if let Some(a) = &arena {
            regions.push((a.path().to_owned(), a.len_bytes()));
        }
        let sup = Supervisor::start(Launch {
            cfg: cfg.clone(),
            python,
            script,
            run_dir: run_dir.clone(),
            regions,
        })?;
        Ok(Self {
            cfg,
            sup: Some(sup),
            arena,
            staging,
            staging_lock: Mutex::new(()),
            run_dir,
            owns_run_dir,
        })
    }

    fn sup(&self) -> &super::helper::Shared {
        // Only `Drop` takes the supervisor out.
        self.sup
            .as_ref()
            .map(Supervisor::shared)
            .expect("supervisor lives as long as the pool")
    }

    /// Waits up to `timeout` for the pool to be healthy; returns the health it ended with.
    pub fn wait_healthy(&self, timeout: Duration) -> PoolHealth {
        let end = Instant::now() + timeout;
        loop {
            let h = self.health();
            if h == PoolHealth::Ok || Instant::now() >= end {
                return h;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The helper's process id, while one runs.
    pub fn helper_pid(&self) -> Option<u32> {
        self.sup().pid()
    }

    /// How many times the helper was replaced. Objects in the segment a dead helper
    /// contributed are gone from the store: the manager should re-check pool pages.
    pub fn restarts(&self) -> u64 {
        self.sup().restarts()
    }

    /// Where the helper's socket, staging file and log live.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    fn conn(&self) -> Result<Arc<super::wire::Conn>, PoolError> {
        self.sup().conn().map_err(PoolError::Unavailable)
    }

    fn check(&self, key: &str, len: usize) -> Result<(), PoolError> {
        if key.is_empty() || key.len() > MAX_KEY {
            return Err(PoolError::Backend {
                code: codes::INVALID_KEY,
                message: "key empty or too long".into(),
            });
        }
        if len > self.max_object_bytes() {
            return Err(PoolError::TooLarge {
                len,
                max: self.max_object_bytes(),
            });
        }
        Ok(())
    }

    /// Sends one request of items and returns Mooncake's per-item codes. The body is
    /// column-wise (`u32 n`, key lengths, regions, offsets, lengths, then the keys), so the
    /// helper decodes a batch with a handful of calls.
    fn send(&self, op: Op, items: &[Item]) -> Result<Vec<i64>, PoolError> {
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
        self.reply(conn.call(op, &body, self.cfg.deadline_for(bytes)), items.len(), true)
    }

    fn reply(&self, r: Result<Reply, WireError>, n: usize, moves_bytes: bool) -> Result<Vec<i64>, PoolError> {
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
            Err(WireError::Timeout(t)) if moves_bytes => {
                self.sup().kill("a transfer overran its deadline");
                Err(PoolError::Unavailable(format!(
                    "Mooncake transfer timed out after {t:?}"
                )))
            }
            Err(e) => {
                let reason = format!("Mooncake helper: {e}");
                self.sup().degrade(reason.clone());
                Err(PoolError::Unavailable(reason))
            }
        }
    }

    /// Plans, stages and sends a put or get batch. `at` says where each caller slice lies
    /// in the arena; `stage_in` fills staging for a put, `stage_out` empties it for a get.
    fn transfer(
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
                    guard.get_or_insert_with(|| self.staging_lock.lock());
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

    /// Sends a key-only request (exists, remove), split at `max_batch`.
    fn keys_op(&self, op: Op, prefix: Option<u8>, keys: &[&str]) -> Vec<Result<i64, PoolError>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(self.cfg.max_batch) {
            if let Some(bad) = part.iter().find_map(|k| self.check(k, 0).err()) {
                out.extend(part.iter().map(|_| Err(bad.clone())));
                continue;
            }
            let res = self.conn().and_then(|conn| {
                let mut body = Body::with_capacity(5 + part.iter().map(|k| k.len() + 2).sum::<usize>());
                if let Some(p) = prefix {
                    body.u8(p);
                }
                body.u32(part.len() as u32);
                for k in part {
                    body.key(k);
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

    /// Removes many keys in bounded batches, one answer per key; lease conflicts are not
    /// retried here (use [`PoolBackend::remove`] for the configured policy).
    pub fn remove_batch(&self, keys: &[&str], force: bool) -> Vec<Result<(), PoolError>> {
        let res = self.keys_op(Op::Remove, Some(force as u8), keys);
        res.into_iter()
            .map(|r| r.and_then(|c| if c == 0 { Ok(()) } else { Err(codes::to_error(c, 0)) }))
            .collect()
    }

    fn arena_offset(&self, bytes: &[u8]) -> Option<u64> {
        self.arena.as_ref().and_then(|a| a.offset_of(bytes))
    }

    /// The bench's baseline: the helper times the wheel's own `batch_put_from` (or
    /// `batch_get_into`) of `objects` under `{prefix}{i}`, `batch` at a time, over the same
    /// registered arena. Every object must lie in the arena.
    pub fn raw_bench(&self, put: bool, prefix: &str, objects: &[&[u8]], batch: usize) -> Result<RawBench, PoolError> {
        let items = objects
            .iter()
            .map(|o| self.arena_offset(o).map(|off| [off, o.len() as u64]))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| PoolError::Unavailable("raw bench objects must lie in the arena".into()))?;
        let total: u64 = objects.iter().map(|o| o.len() as u64).sum();
        let spec = serde_json::json!({
            "op": if put { "put" } else { "get" }, "prefix": prefix, "region": REGION_ARENA,
            "items": items, "batch": batch,
        });
        let mut body = Body::default();
        body.bytes(spec.to_string().as_bytes());
        let conn = self.conn()?;
        match conn.call(Op::RawBench, &body, self.cfg.deadline_for(total) * 4) {
            Ok(Reply::Ok(json)) => serde_json::from_slice(&json).map_err(|e| PoolError::Backend {
                code: codes::INTERNAL_ERROR,
                message: e.to_string(),
            }),
            other => self
                .reply(other, 0, true)
                .and(Err(PoolError::Unavailable("raw bench failed".into()))),
        }
    }
}

impl PoolBackend for MooncakePool {
    fn name(&self) -> &'static str {
        "mooncake"
    }

    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<usize> = items.iter().map(|(_, d)| d.len()).collect();
        let at: Vec<Option<u64>> = items.iter().map(|(_, d)| self.arena_offset(d)).collect();
        let stage_in = |i: usize, dst: &mut [u8]| dst.copy_from_slice(items[i].1);
        let mut res: Vec<Result<(), PoolError>> = self
            .transfer(Op::Put, &keys, &lens, &at, &stage_in, &mut |_, _, _| {})
            .into_iter()
            .map(|r| r.and_then(codes::put_result))
            .collect();
        // The master may place an object in a segment whose owner just died (until its
        // client TTL passes); placement is random, so one retry usually lands elsewhere.
        let failed: Vec<usize> = (0..res.len())
            .filter(|&i| {
                matches!(
                    res[i],
                    Err(PoolError::Backend {
                        code: codes::TRANSFER_FAIL,
                        ..
                    })
                )
            })
            .collect();
        if !failed.is_empty() {
            let sub: Vec<(&str, &[u8])> = failed.iter().map(|&i| items[i]).collect();
            let keys: Vec<&str> = sub.iter().map(|(k, _)| *k).collect();
            let lens: Vec<usize> = sub.iter().map(|(_, d)| d.len()).collect();
            let at: Vec<Option<u64>> = failed.iter().map(|&i| at[i]).collect();
            let stage_in = |i: usize, dst: &mut [u8]| dst.copy_from_slice(sub[i].1);
            let again = self.transfer(Op::Put, &keys, &lens, &at, &stage_in, &mut |_, _, _| {});
            for (&i, r) in failed.iter().zip(again) {
                res[i] = r.and_then(codes::put_result);
            }
        }
        res
    }

    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<usize> = items.iter().map(|(_, b)| b.len()).collect();
        let at: Vec<Option<u64>> = items.iter().map(|(_, b)| self.arena_offset(b)).collect();
        let mut bufs: Vec<&mut [u8]> = items.iter_mut().map(|(_, b)| &mut **b).collect();
        let mut stage_out = |i: usize, src: &[u8], code: i64| {
            let n = (code as usize).min(bufs[i].len()).min(src.len());
            bufs[i][..n].copy_from_slice(&src[..n]);
        };
        let res = self.transfer(Op::Get, &keys, &lens, &at, &|_, _| {}, &mut stage_out);
        res.into_iter()
            .zip(lens)
            .map(|(r, len)| r.and_then(|c| codes::get_result(c, len)))
            .collect()
    }

    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        let res = self.keys_op(Op::Exists, None, keys);
        res.into_iter().map(|r| r.and_then(codes::exists_result)).collect()
    }

    fn remove(&self, key: &str, force: bool) -> Result<(), PoolError> {
        let (force, attempts, interval) = match self.cfg.remove_policy {
            _ if force => (true, 1, Duration::ZERO),
            RemovePolicy::Force => (true, 1, Duration::ZERO),
            RemovePolicy::Fail => (false, 1, Duration::ZERO),
            RemovePolicy::Retry { attempts, interval } => (false, attempts.max(1), interval),
        };
        let mut last = PoolError::HasLease;
        for n in 0..attempts {
            if n > 0 {
                std::thread::sleep(interval);
            }
            let code = self.keys_op(Op::Remove, Some(force as u8), &[key]).pop();
            match code.unwrap_or(Err(PoolError::NotFound)) {
                Ok(0) => return Ok(()),
                Ok(c) if c == codes::OBJECT_HAS_LEASE => last = PoolError::HasLease,
                Ok(c) => return Err(codes::to_error(c, 0)),
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    fn health(&self) -> PoolHealth {
        self.sup().health()
    }

    /// Capacity is the segment this node contributes; the wheel's client does not report
    /// store-wide usage, so used bytes and objects read zero.
    fn usage(&self) -> PoolUsage {
        PoolUsage {
            capacity_bytes: self.cfg.segment_bytes,
            used_bytes: 0,
            objects: 0,
        }
    }

    /// Mooncake evicts on its own and does not tell this client which keys; the manager
    /// re-checks existence before it counts a pool hit.
    fn take_evicted(&self) -> Vec<String> {
        Vec::new()
    }

    /// Arena slices of any size move directly; others are bounded by the staging region.
    fn max_object_bytes(&self) -> usize {
        self.staging.len_bytes() as usize
    }
}

impl Drop for MooncakePool {
    fn drop(&mut self) {
        drop(self.sup.take());
        if self.owns_run_dir {
            let _ = std::fs::remove_dir_all(&self.run_dir);
        }
    }
}
