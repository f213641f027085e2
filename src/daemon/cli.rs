//! `kvtier serve`: flags, start-up report, and the daemon's life from bind to clean exit.

use std::io::Write;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use anyhow::{Context, bail};
use clap::Args;

use crate::clock::SystemClock;
use crate::tier::private;

use super::backend::{Backend, ManagedTiers};
use super::config::{ConfigError, DaemonConfig, PoolKind};
use super::connection::Shared;
use super::server;

/// Run the per-node daemon.
#[derive(Args, Debug, Default, Clone)]
pub struct ServeArgs {
    /// TOML configuration file.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Control socket path.
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Host arena file (shared memory).
    #[arg(long, value_name = "PATH")]
    pub arena_path: Option<PathBuf>,
    /// Host arena size in bytes.
    #[arg(long, value_name = "BYTES")]
    pub arena_bytes: Option<u64>,
    /// Pool backend: none, local or mooncake (key `pool`).
    #[arg(long, value_name = "KIND")]
    pub pool: Option<String>,
    /// Mooncake master, host:port (key `mooncake.master`).
    #[arg(long, value_name = "HOST:PORT")]
    pub mooncake_master: Option<String>,
    /// Any configuration key: `--set max_connections=64`, `--set mooncake.key_tag=""` (repeatable).
    ///
    /// KV event keys (docs/admin.md): `events_encoding` = `vllm` (vLLM 0.24 to 0.33, the
    /// default) | `vllm-legacy` (vLLM 0.23 and earlier); `events_replay_protocol` = `auto` |
    /// `topic` (vLLM 0.26+) | `legacy` (vLLM 0.25 and earlier); `events_hashes` = `int` (low
    /// 64 bits) | `auto` | `bytes`; `events_endpoint`, `events_replay_endpoint`,
    /// `pool_events_endpoint`, `session_events_endpoint` = `tcp://HOST:PORT` | `ipc` (a socket in the 0700 runtime dir) |
    /// empty (off); `events_replay_per_sec`; `pool_events_tenant`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
}

impl ServeArgs {
    fn flag_pairs(&self) -> Result<Vec<(String, String)>, ConfigError> {
        let mut out = Vec::new();
        for s in &self.set {
            let (k, v) = s.split_once('=').ok_or_else(|| ConfigError::BadSet(s.clone()))?;
            out.push((k.trim().to_owned(), v.trim().to_owned()));
        }
        let quote = |p: &Path| format!("{:?}", p.display().to_string());
        if let Some(p) = &self.socket {
            out.push(("socket".into(), quote(p)));
        }
        if let Some(p) = &self.arena_path {
            out.push(("arena_path".into(), quote(p)));
        }
        if let Some(b) = self.arena_bytes {
            out.push(("arena_bytes".into(), b.to_string()));
        }
        // Quoted, so a value that happens to parse as a TOML number stays a string and
        // serde names the allowed values when it is not one of them.
        if let Some(p) = &self.pool {
            out.push(("pool".into(), format!("{p:?}")));
        }
        if let Some(m) = &self.mooncake_master {
            out.push(("mooncake.master".into(), format!("{m:?}")));
        }
        Ok(out)
    }
}

/// Logs go to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    init_tracing();
    let cfg = DaemonConfig::load(args.config.as_deref(), std::env::vars(), &args.flag_pairs()?)?;
    if args.print_config {
        print!("{}", toml::to_string(&cfg)?);
        return Ok(());
    }
    serve(cfg, CancellationToken::new())
}

/// Binds the control socket in a private directory with the configured mode and group,
/// refusing to steal it from a live daemon.
fn bind(cfg: &DaemonConfig) -> anyhow::Result<UnixListener> {
    let path = &cfg.socket;
    let dir = private::parent_of(path);
    if cfg.socket_dir_is_default() {
        private::private_dir(dir)
    } else {
        private::trusted_dir(dir)
    }
    .context("the control socket's directory")?;
    let (mode, gid) = cfg.socket_access()?;
    match crate::admin::security::bind_socket(path, mode, gid) {
        Ok(l) => Ok(l),
        Err(crate::admin::AdminError::InUse(_)) => bail!("another daemon is serving {}", path.display()),
        Err(e) => Err(anyhow::anyhow!("control socket: {e}")),
    }
}

/// Runs the daemon with a ready configuration until `shutdown` is cancelled, by the
/// caller or by SIGTERM/SIGINT.
pub fn serve(cfg: DaemonConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    let rt = server::runtime().context("starting the control-plane runtime")?;
    // Signals first: once the socket is bound a client may already see the daemon.
    let signals = {
        let _in_runtime = rt.enter();
        crate::shutdown::cancel_on_signals(shutdown.clone()).context("installing signal handlers")?
    };
    // The tiers first: the arena's owner lock decides whether this daemon may run at all,
    // and a refused start must not leave a socket behind.
    if cfg.arena_is_default() {
        // kvtier's own directories under /dev/shm: strictly private, whoever made them, or
        // open to the engines' group (enter and read, never write) where one is set.
        let engines = cfg.engine_gid()?;
        if let Some(kvtier_uid) = cfg.arena_path.parent().and_then(Path::parent)
            && kvtier_uid.starts_with("/dev/shm")
            && kvtier_uid != Path::new("/dev/shm")
        {
            private::shared_dir(kvtier_uid, engines).context("the arena's directory")?;
        }
        private::shared_dir(private::parent_of(&cfg.arena_path), engines).context("the arena's directory")?;
    }
    let backend = Arc::new(ManagedTiers::open(cfg.tiers(), SystemClock::new()).context("opening the tiers")?);
    let listener = bind(&cfg)?;
    announce(&cfg, &backend)?;
    tracing::info!(socket = %cfg.socket.display(), "serving");
    let shared = Arc::new(Shared::new(backend.clone(), cfg.limits()));
    backend.manager().set_upkeep_waker(shared.upkeep_waker());
    let tick = Duration::from_millis(cfg.tick_ms.max(1));
    let (extras, served) = rt.block_on(async {
        tokio::spawn(signals);
        let extras = start_side_services(&cfg, backend.manager().clone(), shared.clone(), &shutdown);
        listener.set_nonblocking(true)?;
        let listener = tokio::net::UnixListener::from_std(listener)?;
        let served = server::run_with(listener, shutdown.clone(), shared, tick, cfg.peers()).await;
        // Whatever ended the server ends the side services too.
        shutdown.cancel();
        Ok::<_, std::io::Error>((extras, served))
    })?;
    extras.stop();
    // Commands still on the blocking pool end within `max_wait_ms` (their grants are
    // released as they end); this bounds the wait for them all the same.
    rt.shutdown_timeout(Duration::from_millis(cfg.max_wait_ms) + Duration::from_secs(1));
    let _ = std::fs::remove_file(&cfg.socket);
    backend.shutdown().context("compacting the manifest")?;
    served.context("serving")?;
    tracing::info!("stopped");
    Ok(())
}

/// The start-up report on stdout: where everything is, as it is (the arena's real size
/// and slot size once it exists, what recovery kept and dropped).
fn announce(cfg: &DaemonConfig, backend: &ManagedTiers) -> anyhow::Result<()> {
    let (recovered, discarded, bad_records, garbage) = backend.recovery();
    let mut out = std::io::stdout().lock();
    writeln!(out, "kvtier serve: control socket {}", cfg.socket.display())?;
    // The arena exists from the start; its slots are `slot_bytes`, or, with 0, fitted to
    // the first engine's objects when it registers.
    let size = match backend.manager().arena() {
        Some(a) => format!(
            "{} MiB in {} slots of {} bytes (slot_bytes)",
            a.len_bytes() >> 20,
            a.slots(),
            a.slot_bytes()
        ),
        None if cfg.slot_bytes == 0 => format!(
            "{} MiB, slots fitted to the first engine's objects (slot_bytes = 0)",
            cfg.arena_bytes >> 20
        ),
        None => format!(
            "{} MiB, slots of {} bytes (slot_bytes)",
            cfg.arena_bytes >> 20,
            cfg.slot_bytes
        ),
    };
    let size = match cfg.engine_gid()? {
        Some(g) => format!("{size}, mode 0660 for engine_group {g}"),
        None => size,
    };
    let mut notes = String::new();
    if recovered + discarded > 0 {
        notes.push_str(&format!(", {recovered} pages recovered, {discarded} discarded"));
    }
    if bad_records > 0 {
        notes.push_str(&format!(", {bad_records} bad manifest records skipped"));
    }
    if garbage {
        notes.push_str(", manifest unreadable (ignored)");
    }
    writeln!(
        out,
        "kvtier serve: host arena {} ({size}{notes}), manifest {}, owner lock {}",
        cfg.arena_path.display(),
        backend.manifest_path().display(),
        backend.lock_path().display()
    )?;
    match cfg.pool {
        PoolKind::None => writeln!(out, "kvtier serve: pool none")?,
        PoolKind::Local if cfg.pool_bytes == 0 => writeln!(out, "kvtier serve: pool none (pool_bytes = 0)")?,
        PoolKind::Local => writeln!(out, "kvtier serve: pool local, {} MiB", cfg.pool_bytes >> 20)?,
        PoolKind::Mooncake => {
            let m = &cfg.mooncake;
            let health = if m.master_reachable(Duration::from_secs(1)) {
                "master reachable".to_owned()
            } else {
                tracing::warn!(master = %m.master, "Mooncake master unreachable; serving degraded: no pool credit until it is back");
                "DEGRADED: master unreachable; no pool credit until it answers".to_owned()
            };
            writeln!(
                out,
                "kvtier serve: pool mooncake, master {} ({health}), key tag {:?}, segment {} MiB, {} replica(s)",
                m.master,
                m.key_tag,
                m.global_segment_bytes >> 20,
                m.replicas
            )?;
        }
    }
    out.flush()?;
    Ok(())
}

/// The admin socket and the event publishers, started beside the control socket. The
/// admin server runs on a small runtime of its own (one worker, a blocking pool for its
/// renders), so operator traffic never shares the control plane's thread; its token is a
/// child of the daemon's one token, so a signal or the end of the server stops it too.
struct SideServices {
    runtime: Option<tokio::runtime::Runtime>,
    cancel: tokio_util::sync::CancellationToken,
    admin: Option<crate::admin::AdminHandle>,
    publishers: Vec<crate::publish::PublisherHandle>,
}

/// How long stopping waits for the admin server to close its connections.
const ADMIN_STOP: Duration = Duration::from_secs(15);

impl SideServices {
    fn stop(self) {
        self.cancel.cancel();
        if let (Some(rt), Some(a)) = (&self.runtime, self.admin) {
            let _ = rt.block_on(async { tokio::time::timeout(ADMIN_STOP, a.stop()).await });
        }
        if let Some(rt) = self.runtime {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
        for p in self.publishers {
            p.stop();
        }
    }
}

/// Starts the admin socket and publishers. A failure to start one is logged and the daemon
/// keeps serving engines: losing the admin view or an event stream must not take the KV
/// cache of a running fleet down with it.
fn start_side_services(
    cfg: &DaemonConfig,
    manager: crate::manager::Manager,
    shared: Arc<Shared>,
    side: &CancellationToken,
) -> SideServices {
    let admin_cfg = crate::admin::AdminConfig {
        socket: cfg.admin_socket.clone(),
        ..crate::admin::AdminConfig::default()
    };
    let cancel = side.child_token();
    // An admin connection holds at most one blocking thread at a time (its handler, or
    // its event stream's wait), so this many never makes one connection wait for another.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(admin_cfg.max_connections)
        .thread_name("kvtier-admin")
        .enable_all()
        .build()
        .map_err(|e| tracing::warn!(error = %e, "no runtime for the admin socket"))
        .ok();
    let started = runtime.as_ref().map(|rt| {
        let _in_runtime = rt.enter();
        crate::admin::spawn(admin_cfg, manager.clone(), shared.clone(), cancel.clone())
    });
    let admin = match started.unwrap_or(Err(crate::admin::AdminError::Config("no runtime".into()))) {
        Ok(h) => {
            println!("kvtier serve: admin socket {}", cfg.admin_socket.display());
            Some(h)
        }
        Err(e) => {
            tracing::warn!(error = %e, socket = %cfg.admin_socket.display(), "admin socket not started");
            None
        }
    };
    let mut publishers = Vec::new();
    let run_dir = cfg.socket.parent().map(Path::to_path_buf).unwrap_or_default();
    if !cfg.events_endpoint.is_empty() {
        use crate::publish::vllm;
        let vcfg = vllm::VllmConfig {
            endpoint: super::config::event_endpoint(&cfg.events_endpoint, &run_dir, "kv-events.ipc"),
            replay_endpoint: Some(super::config::event_endpoint(
                &cfg.events_replay_endpoint,
                &run_dir,
                "kv-events-replay.ipc",
            ))
            .filter(|e| !e.is_empty()),
            encoding: cfg.events_encoding.into(),
            hashes: cfg.events_hashes,
            replay: cfg.events_replay_protocol,
            replay_limits: vllm::ReplayLimits {
                per_sec: cfg.events_replay_per_sec,
                ..vllm::ReplayLimits::default()
            },
            tokens: Some(shared.tokens.clone()),
            // Pool pages say whether the pool is this node's own or a cluster's store.
            pool_medium: if cfg.pool == PoolKind::Local {
                vllm::PoolMedium::Local
            } else {
                vllm::PoolMedium::Shared
            },
            ..vllm::VllmConfig::default()
        };
        match vllm::spawn(vcfg, manager.clone(), side.clone()) {
            Ok(h) => {
                println!("kvtier serve: KV events {}", h.endpoint());
                if let Some(r) = h.replay_endpoint() {
                    println!("kvtier serve: KV event replay {r}");
                }
                publishers.push(h);
            }
            Err(e) => tracing::warn!(error = %e, endpoint = %cfg.events_endpoint, "KV event publisher not started"),
        }
    }
    // Mooncake-style object events describe objects in a shared store; the node-local
    // pool is none, so they are published only with `pool = "mooncake"` (local pool pages
    // are in the vLLM events above, with the pool tier's medium).
    if cfg.pool != PoolKind::Mooncake && !cfg.pool_events_endpoint.is_empty() {
        println!(
            "kvtier serve: pool object events off (they describe a shared store; pool is {})",
            cfg.pool.name()
        );
    }
    if !cfg.pool_events_endpoint.is_empty() && cfg.pool == PoolKind::Mooncake {
        let mcfg = crate::publish::mooncake::MooncakeConfig {
            endpoint: super::config::event_endpoint(&cfg.pool_events_endpoint, &run_dir, "pool-events.ipc"),
            tenant_id: cfg.pool_events_tenant.clone(),
            ..crate::publish::mooncake::MooncakeConfig::default()
        };
        match crate::publish::mooncake::spawn(mcfg, manager.clone(), side.clone()) {
            Ok(h) => {
                println!("kvtier serve: pool object events {}", h.endpoint());
                publishers.push(h);
            }
            Err(e) => {
                tracing::warn!(error = %e, endpoint = %cfg.pool_events_endpoint, "pool event publisher not started")
            }
        }
    }
    if !cfg.session_events_endpoint.is_empty() {
        let scfg = crate::publish::sessions::SessionEventsConfig {
            endpoint: super::config::event_endpoint(&cfg.session_events_endpoint, &run_dir, "session-events.ipc"),
            ..crate::publish::sessions::SessionEventsConfig::default()
        };
        match crate::publish::sessions::spawn(scfg, manager.clone(), side.clone()) {
            Ok(h) => {
                println!("kvtier serve: session events {}", h.endpoint());
                publishers.push(h);
            }
            Err(e) => {
                tracing::warn!(error = %e, endpoint = %cfg.session_events_endpoint, "session event publisher not started")
            }
        }
    }
    SideServices {
        runtime,
        cancel,
        admin,
        publishers,
    }
}
