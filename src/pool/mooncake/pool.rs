//! [`MooncakePool`]: the [`PoolBackend`] over the wheel's client, through the helper.
//!
//! The pool owns the helper's run directory (socket, script copy, staging file, log), the
//! supervisor, and the mapping of results to typed errors; how batches become requests is
//! in `batch.rs`. Caller slices inside the host arena move with no copy; others go through
//! the staging region (a shared-memory file of the same kind, one batch at a time). A
//! transfer that overruns its deadline kills the helper before the call returns, since a
//! late transfer could otherwise touch caller memory that has been reused.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::batch::REGION_ARENA;
use super::helper::{Launch, Supervisor};
use super::master_rpc::{MasterRpc, RpcError};
use super::wire::{Body, MAX_KEY, Op, Reply};
use super::{ExistsVia, MooncakeConfig, MooncakeError, RemovePolicy, codes};
use crate::pool::{PoolBackend, PoolError, PoolHealth, PoolUsage};
use crate::tier::host::{ArenaOptions, HostArena};
use crate::tier::private::private_dir;

const HELPER_PY: &str = include_str!("../../../python/kvtier_mooncake_helper.py");

/// The baseline timing the helper measured with the wheel's own batch calls.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct RawBench {
    pub seconds: f64,
    pub failed: u64,
}

/// The Mooncake Store backend through the PyPI wheel's client.
pub struct MooncakePool {
    pub(super) cfg: MooncakeConfig,
    pub(super) sup: Option<Supervisor>,
    pub(super) arena: Option<Arc<HostArena>>,
    pub(super) staging: HostArena,
    pub(super) staging_lock: Mutex<()>,
    /// A wait for `staging_lock` timed out and it has not been free since (see
    /// [`MooncakePool::lock_staging`]).
    pub(super) staging_stalled: std::sync::atomic::AtomicBool,
    /// The master's own `BatchExistKey`, unless configured off (or found foreign: see
    /// [`MasterRpc::refused`]).
    rpc: Option<Arc<MasterRpc>>,
    run_dir: PathBuf,
    owns_run_dir: bool,
}

impl MooncakePool {
    /// Starts the helper and returns at once; the pool is `Degraded` until the helper is
    /// up and the master reachable (see [`MooncakePool::wait_healthy`]). `arena` is the
    /// host arena whose slices move without copies.
    pub fn start(cfg: MooncakeConfig, arena: Option<Arc<HostArena>>) -> Result<Self, MooncakeError> {
        cfg.validate()?;
        // The programs first: nothing is created for a helper that could never be trusted.
        let python = super::programs::resolve(
            cfg.python.as_deref().unwrap_or(Path::new("python3")),
            "mooncake.python",
            std::env::var_os("PATH").as_deref(),
        )?;
        if let Some(p) = &cfg.helper_script {
            if !p.is_absolute() {
                return Err(super::programs::ProgramError::Relative {
                    what: "helper script",
                    path: p.clone(),
                }
                .into());
            }
            super::programs::check(p, "helper script")?;
        }
        let (run_dir, owns_run_dir) = match &cfg.run_dir {
            Some(d) => {
                private_dir(d)?;
                (d.clone(), false)
            }
            None => {
                let base = super::run_dir::base()?;
                let swept = super::run_dir::sweep_stale(&base);
                if swept > 0 {
                    tracing::info!(swept, base = %base.display(), "removed Mooncake run directories of daemons that are gone");
                }
                (super::run_dir::fresh(&base)?, true)
            }
        };
        let staging_path = run_dir.join("staging");
        let opts = ArenaOptions {
            lock: false,
            prefault: true,
            touch_threads: 1,
            group: None,
        };
        let staging = HostArena::create(&staging_path, cfg.staging_bytes, cfg.staging_bytes, &opts)?;
        let script = match &cfg.helper_script {
            Some(p) => p.clone(),
            None => {
                // Exclusively, never through whatever name is there already.
                let p = run_dir.join("kvtier_mooncake_helper.py");
                let mut f = crate::tier::private::replace(&p)?;
                std::io::Write::write_all(&mut f, HELPER_PY.as_bytes())?;
                p
            }
        };
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
        let rpc = (cfg.exists_via == ExistsVia::Master).then(|| Arc::new(MasterRpc::new(&cfg.master, cfg.op_timeout)));
        Ok(Self {
            cfg,
            sup: Some(sup),
            rpc,
            arena,
            staging,
            staging_lock: Mutex::new(()),
            staging_stalled: std::sync::atomic::AtomicBool::new(false),
            run_dir,
            owns_run_dir,
        })
    }

    pub(super) fn sup(&self) -> &super::helper::Shared {
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

    pub(super) fn conn(&self) -> Result<Arc<super::wire::Conn>, PoolError> {
        self.sup().conn().map_err(PoolError::Unavailable)
    }

    pub(super) fn check(&self, key: &str, len: usize) -> Result<(), PoolError> {
        if key.is_empty() || key.len() > MAX_KEY || key.contains('\0') {
            return Err(PoolError::Backend {
                code: codes::INVALID_KEY,
                message: "key empty, too long, or holding a NUL".into(),
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

    /// Removes many keys in bounded batches, one answer per key; lease conflicts are not
    /// retried here (use [`PoolBackend::remove`] for the configured policy).
    pub fn remove_batch(&self, keys: &[&str], force: bool) -> Vec<Result<(), PoolError>> {
        let res = self.keys_op(Op::Remove, Some(force as u8), keys);
        res.into_iter()
            .map(|r| r.and_then(|c| if c == 0 { Ok(()) } else { Err(codes::to_error(c, 0)) }))
            .collect()
    }

    pub(super) fn arena_offset(&self, bytes: &[u8]) -> Option<u64> {
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

impl MooncakePool {
    /// The bench's baseline for existence: the helper times the wheel's own
    /// `batch_is_exist` over `keys`; `failed` counts keys that do not exist.
    pub fn raw_exists(&self, keys: &[&str]) -> Result<RawBench, PoolError> {
        let spec = serde_json::json!({ "op": "exists", "keys": keys });
        let mut body = Body::default();
        body.bytes(spec.to_string().as_bytes());
        let conn = self.conn()?;
        match conn.call(Op::RawBench, &body, self.cfg.deadline_for(0) * 4) {
            Ok(Reply::Ok(json)) => serde_json::from_slice(&json).map_err(|e| PoolError::Backend {
                code: codes::INTERNAL_ERROR,
                message: e.to_string(),
            }),
            other => self
                .reply(other, 0, true)
                .and(Err(PoolError::Unavailable("raw exists failed".into()))),
        }
    }
}

impl MooncakePool {
    /// Who answers existence queries now: `master` or `helper`.
    pub fn exists_via(&self) -> ExistsVia {
        match self.master_rpc() {
            Some(_) => ExistsVia::Master,
            None => ExistsVia::Helper,
        }
    }

    fn master_rpc(&self) -> Option<&Arc<MasterRpc>> {
        self.rpc.as_ref().filter(|r| !r.refused())
    }

    /// The first key of `keys` this pool refuses, as the error every answer carries.
    fn bad_key(&self, keys: &[&str]) -> Option<PoolError> {
        keys.iter().find_map(|k| self.check(k, 0).err())
    }

    fn exists_in_helper(&self, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        let res = self.keys_op(Op::Exists, None, keys);
        res.into_iter().map(|r| r.and_then(codes::exists_result)).collect()
    }

    /// The master's answers, in batches of `max_batch`. A master that is down answers every
    /// key `Unavailable` (no pool credit); one that speaks another protocol hands this and
    /// every later query to the helper.
    fn exists_at_master(&self, rpc: &MasterRpc, keys: &[&str]) -> Vec<Result<bool, PoolError>> {
        let mut out = Vec::with_capacity(keys.len());
        for (n, part) in keys.chunks(self.cfg.max_batch).enumerate() {
            if let Some(bad) = self.bad_key(part) {
                out.extend(part.iter().map(|_| Err(bad.clone())));
                continue;
            }
            match master_answers(rpc, part, rpc.batch_exists(part)) {
                Some(answers) => out.extend(answers),
                None => {
                    out.extend(self.exists_in_helper(&keys[n * self.cfg.max_batch..]));
                    break;
                }
            }
        }
        out
    }
}

/// The pool's answers from the master's: per key, a down master's `Unavailable` for every
/// key (no pool credit), or `None` once the master turned out to speak another protocol
/// (the caller asks the helper instead).
fn master_answers(
    rpc: &MasterRpc,
    part: &[&str],
    res: Result<Vec<Result<bool, i64>>, RpcError>,
) -> Option<Vec<Result<bool, PoolError>>> {
    let fail = |e: PoolError| Some(part.iter().map(|_| Err(e.clone())).collect());
    match res {
        Ok(answers) => Some(answers.into_iter().map(|a| a.or_else(codes::exists_result)).collect()),
        Err(e @ (RpcError::Protocol { .. } | RpcError::Version { .. })) => {
            rpc.refuse(&e);
            None
        }
        Err(e @ RpcError::Io { .. }) => {
            rpc.reset();
            fail(PoolError::Unavailable(e.to_string()))
        }
        Err(e @ RpcError::TooLarge(_)) => fail(PoolError::Backend {
            code: codes::INVALID_PARAMS,
            message: e.to_string(),
        }),
    }
}

impl PoolBackend for MooncakePool {
    fn name(&self) -> &'static str {
        "mooncake"
    }

    fn lost_generation(&self) -> u64 {
        self.restarts()
    }

    fn helper_queue(&self) -> Option<crate::pool::HelperQueue> {
        Some(self.sup().queue())
    }

    fn batch_put_from(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        if let Some(mac) = &self.cfg.integrity {
            return self.sealed_put(mac, items);
        }
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<usize> = items.iter().map(|(_, d)| d.len()).collect();
        let at: Vec<Option<u64>> = items.iter().map(|(_, d)| self.arena_offset(d)).collect();
        let stage_in = |i: usize, dst: &mut [u8]| dst.copy_from_slice(items[i].1);
        self.put_retrying(&keys, &lens, &at, &stage_in)
    }

    fn batch_get_into(&self, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        if let Some(mac) = self.cfg.integrity.clone() {
            return self.sealed_get(&mac, items);
        }
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
        match self.master_rpc() {
            Some(rpc) => self.exists_at_master(rpc, keys),
            None => self.exists_in_helper(keys),
        }
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
        let trailer = if self.cfg.integrity.is_some() {
            super::integrity::MAC_LEN
        } else {
            0
        };
        self.staging.len_bytes() as usize - trailer
    }

    fn integrity(&self) -> Option<crate::pool::IntegrityReport> {
        Some(crate::pool::IntegrityReport {
            on: self.cfg.integrity.is_some(),
            rejected: self.cfg.integrity.as_ref().map_or(0, |m| m.rejected()),
        })
    }

    #[cfg(feature = "daemon")]
    fn awaits_exists(&self) -> bool {
        self.master_rpc().is_some()
    }

    /// The master's answers, awaited: batches of `max_batch` as the blocking query, and
    /// `None` (ask the helper, off the runtime) once the master speaks another protocol.
    #[cfg(feature = "daemon")]
    fn exists_async(&self, keys: crate::pool::KeyBatch) -> Option<crate::pool::ExistsFuture> {
        let rpc = self.master_rpc()?.clone();
        let max_batch = self.cfg.max_batch;
        let refs = keys.refs();
        let bad: Vec<Option<PoolError>> = refs.chunks(max_batch).map(|p| self.bad_key(p)).collect();
        drop(refs);
        Some(Box::pin(async move {
            let refs = keys.refs();
            let mut out = Vec::with_capacity(refs.len());
            for (part, bad) in refs.chunks(max_batch).zip(bad) {
                if let Some(bad) = bad {
                    out.extend(part.iter().map(|_| Err(bad.clone())));
                    continue;
                }
                let res = rpc.batch_exists_async(part).await;
                out.extend(master_answers(&rpc, part, res)?);
            }
            Some(out)
        }))
    }

    fn exists_source(&self) -> Option<&'static str> {
        Some(self.exists_via().name())
    }

    fn master_version(&self) -> Option<String> {
        self.rpc.as_ref()?.master_version()
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
