//! The host arena and the pool: the two stores the manager keeps page bytes in, each
//! created once (by the first namespace registered, or before it by the daemon with its
//! configured slot size, a reopened file or an arena it fitted itself) and read through
//! `arena()` and `pool()` from then on.
//!
//! `Stores` owns both cells, the configuration they are made from, and the lock that
//! serialises making them ([`Rank::Init`], taken alone before any other manager lock).

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, MutexGuard};

use super::locks::{Ordered, Rank};
use super::{ManagerConfig, ManagerError, PoolConfig};
use crate::pool::PoolBackend;
use crate::pool::local::LocalPool;
use crate::pool::mooncake::MooncakePool;
use crate::tier::host::{ArenaOptions, HostArena};

/// The host arena and the pool, each made once.
pub struct Stores {
    host_path: PathBuf,
    host_bytes: u64,
    arena_opts: ArenaOptions,
    pool_cfg: PoolConfig,
    /// Fault injection: each pool batch call waits this long first.
    pool_fault_delay_ms: u64,
    /// [Init] Serialises creating the arena and the pool.
    init: Mutex<()>,
    arena: OnceLock<Arc<HostArena>>,
    pool: OnceLock<Option<Arc<dyn PoolBackend>>>,
}

impl Stores {
    pub(super) fn new(cfg: &ManagerConfig) -> Self {
        Self {
            host_path: cfg.host_path.clone(),
            host_bytes: cfg.host_bytes,
            arena_opts: cfg.arena.clone(),
            pool_cfg: cfg.pool.clone(),
            pool_fault_delay_ms: cfg.tunables.pool_fault_delay_ms,
            init: Mutex::new(()),
            arena: OnceLock::new(),
            pool: OnceLock::new(),
        }
    }

    fn init_lock(&self) -> Ordered<MutexGuard<'_, ()>> {
        Ordered::take(Rank::Init, || self.init.lock())
    }

    /// Holds the init lock (tests: proving an operation does not need it).
    #[cfg(test)]
    pub(super) fn hold(&self) -> Box<dyn super::locks::Held + '_> {
        Box::new(self.init_lock())
    }

    /// The host arena, once made.
    pub fn arena(&self) -> Option<Arc<HostArena>> {
        self.arena.get().cloned()
    }

    /// The pool backend, if one is configured and made.
    pub fn pool(&self) -> Option<Arc<dyn PoolBackend>> {
        self.pool.get().cloned().flatten()
    }

    /// The arena, made here with slots of `slot_bytes` (rounded up to 64) if none is yet.
    pub(super) fn ensure_arena(&self, slot_bytes: u64) -> Result<Arc<HostArena>, ManagerError> {
        if let Some(a) = self.arena.get() {
            return Ok(a.clone());
        }
        let _guard = self.init_lock();
        if let Some(a) = self.arena.get() {
            return Ok(a.clone());
        }
        let slot = slot_bytes.div_ceil(64) * 64;
        let a = Arc::new(HostArena::create(
            &self.host_path,
            self.host_bytes,
            slot,
            &self.arena_opts,
        )?);
        let _ = self.arena.set(a.clone());
        Ok(a)
    }

    /// Makes the configured pool once `arena` exists (a backend may register it).
    pub(super) fn ensure_pool(&self, arena: &Arc<HostArena>) -> Result<(), ManagerError> {
        let slot_bytes = arena.slot_bytes() as u64;
        if self.pool.get().is_some() {
            return Ok(());
        }
        let _guard = self.init_lock();
        if self.pool.get().is_some() {
            return Ok(());
        }
        // Only the daemon maps the local pool: it stays private even where engines of
        // another uid may map the arena.
        let pool_opts = ArenaOptions {
            group: None,
            ..self.arena_opts.clone()
        };
        let local = |path: &std::path::Path, bytes, recover| -> Result<Option<Arc<dyn PoolBackend>>, ManagerError> {
            let (pool, _) = LocalPool::open(path, bytes, slot_bytes, &pool_opts, recover)?;
            Ok(Some(Arc::new(pool)))
        };
        let pool = match &self.pool_cfg {
            PoolConfig::None => None,
            PoolConfig::LocalDefault => {
                let mut p = self.host_path.clone().into_os_string();
                p.push(".pool");
                local(std::path::Path::new(&p), 2 << 30, false)?
            }
            PoolConfig::Local { path, bytes, recover } => local(path, *bytes, *recover)?,
            PoolConfig::Backend(b) => Some(b.clone()),
            PoolConfig::Build(f) => Some((f.build)(arena.clone()).map_err(ManagerError::Config)?),
            PoolConfig::Mooncake(m) => {
                let pool: Arc<dyn PoolBackend> = Arc::new(MooncakePool::start((**m).clone(), Some(arena.clone()))?);
                Some(pool)
            }
        };
        // Fault injection (benches, tests): the same pool, answering later.
        let pool = pool.map(|p| match self.pool_fault_delay_ms {
            0 => p,
            ms => Arc::new(crate::pool::hooked::HookedPool::delayed(
                p,
                std::time::Duration::from_millis(ms),
            )) as Arc<dyn PoolBackend>,
        });
        let _ = self.pool.set(pool);
        Ok(())
    }

    /// Installs the arena `make` builds, under the init lock; refused once one exists.
    fn install<T>(
        &self,
        make: impl FnOnce() -> Result<(HostArena, T), ManagerError>,
    ) -> Result<(Arc<HostArena>, T), ManagerError> {
        let _guard = self.init_lock();
        if self.arena.get().is_some() {
            return Err(ManagerError::Config("the host arena is already open".into()));
        }
        let (arena, extra) = make()?;
        let arena = Arc::new(arena);
        let _ = self.arena.set(arena.clone());
        Ok((arena, extra))
    }

    /// Maps the existing arena file at the configured path, keeping its bytes, with every
    /// slot free until pages are adopted. The file is fitted to the configured size
    /// (`host_bytes`): returns the arena and how many bytes the file held before, so the
    /// caller knows which slots were cut off or read as zeros. Must run before the first
    /// namespace is registered (which would otherwise create a fresh, empty arena).
    pub fn open_existing_arena(&self, slot_bytes: u64) -> Result<(Arc<HostArena>, u64), ManagerError> {
        self.install(|| {
            let r = HostArena::reopen(&self.host_path, self.host_bytes, slot_bytes, &self.arena_opts)?;
            Ok((r.arena, r.found_bytes))
        })
    }

    /// Creates a fresh, empty arena with slots of `slot_bytes` (rounded up to 64) before any
    /// namespace is registered, so the slot size is configuration rather than whatever the
    /// first layout needs. A later layout whose objects do not fit is refused with
    /// [`ManagerError::SlotTooSmall`].
    pub fn create_arena(&self, slot_bytes: u64) -> Result<Arc<HostArena>, ManagerError> {
        let slot = slot_bytes.div_ceil(64) * 64;
        self.install(|| {
            let a = HostArena::create(&self.host_path, self.host_bytes, slot, &self.arena_opts)?;
            Ok((a, ()))
        })
        .map(|(a, ())| a)
    }

    /// Adopts an arena the caller cut itself (an unfitted arena fitted to the first
    /// layout registered, [`crate::tier::host::Unfitted::fit`]), before any namespace is
    /// registered.
    pub fn adopt_arena(&self, arena: HostArena) -> Result<Arc<HostArena>, ManagerError> {
        self.install(|| Ok((arena, ()))).map(|(a, ())| a)
    }
}
