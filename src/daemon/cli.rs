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
///
/// Every configuration key is also a flag by one rule: key `k` of section `[s]` is
/// `--s-k` (`[host] bytes` is `--host-bytes`), a root key `k` is `--k`; `--set s.k=value`
/// takes any key too (docs/daemon.md, "Configuration").
#[derive(Args, Debug, Default, Clone)]
pub struct ServeArgs {
    /// TOML configuration file.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Any configuration key: `--set control.max_connections=64`, `--set mooncake.key_tag=""`
    /// (repeatable).
    ///
    /// KV event keys (docs/admin.md): `events.encoding` = `vllm` (vLLM 0.24 to 0.33, the
    /// default) | `vllm-legacy` (vLLM 0.23 and earlier); `events.replay_protocol` = `auto` |
    /// `topic` (vLLM 0.26+) | `legacy` (vLLM 0.25 and earlier); `events.hashes` = `int` (low
    /// 64 bits) | `auto` | `bytes`; `events.endpoint`, `events.replay_endpoint`,
    /// `events.pool_endpoint`, `events.session_endpoint` = `tcp://HOST:PORT` | `ipc` (a socket
    /// in the 0700 runtime dir) | empty (off); `events.replay_per_sec`; `events.pool_tenant`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    #[command(flatten)]
    pub keys: KeyFlags,
}

/// One flag per configuration key (`--host-bytes`), and hidden ones for the flat names
/// of the release before sections (`--arena-bytes`), as `(name, value)` in the order of
/// the keys.
#[derive(Debug, Default, Clone)]
pub struct KeyFlags(pub Vec<(String, String)>);

impl KeyFlags {
    /// The flag names (without `--`), each with whether it is an old name.
    fn names() -> Vec<(String, bool)> {
        let keys = DaemonConfig::keys();
        let mut names: Vec<(String, bool)> = keys.iter().map(|k| (k.flag()[2..].to_owned(), false)).collect();
        for (old, _, _) in super::config::keys_renamed() {
            let flag = old.replace('_', "-");
            // An old name that is also a new key's flag is that key's flag.
            if !names.iter().any(|(n, _)| *n == flag) {
                names.push((flag, true));
            }
        }
        names
    }
}

impl clap::FromArgMatches for KeyFlags {
    fn from_arg_matches(m: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let mut out = Self::default();
        out.update_from_arg_matches(m)?;
        Ok(out)
    }

    fn update_from_arg_matches(&mut self, m: &clap::ArgMatches) -> Result<(), clap::Error> {
        for (name, _) in Self::names() {
            if let Some(v) = m.get_one::<String>(&name) {
                self.0.push((name, v.clone()));
            }
        }
        Ok(())
    }
}

impl clap::Args for KeyFlags {
    fn augment_args(mut cmd: clap::Command) -> clap::Command {
        let keys = DaemonConfig::keys();
        for (name, old) in Self::names() {
            let help = match keys.iter().find(|k| k.flag()[2..] == name) {
                Some(k) if k.section.is_some() => format!("Key `{}` of `[{}]`", k.name, k.section.unwrap_or("")),
                Some(k) => format!("Key `{}`", k.name),
                None => String::new(),
            };
            cmd = cmd.arg(
                clap::Arg::new(name.clone())
                    .long(name)
                    .value_name("VALUE")
                    .help(help)
                    .hide(old)
                    .action(clap::ArgAction::Set),
            );
        }
        cmd
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl ServeArgs {
    /// `--set` pairs first, then the named flags, so a named flag wins over `--set`.
    fn flag_pairs(&self) -> Result<Vec<(String, String)>, ConfigError> {
        let mut out = Vec::new();
        for s in &self.set {
            let (k, v) = s.split_once('=').ok_or_else(|| ConfigError::BadSet(s.clone()))?;
            out.push((k.trim().to_owned(), v.trim().to_owned()));
        }
        out.extend(self.keys.0.iter().cloned());
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
        print!("{}", cfg.to_toml()?);
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
pub fn serve(mut cfg: DaemonConfig, shutdown: CancellationToken) -> anyhow::Result<()> {
    // The pool's cluster key before anything is created: a loose or missing key file
    // refuses the start.
    if cfg.pool.kind == PoolKind::Mooncake
        && let Some(key_file) = cfg.mooncake.load_integrity_key()?
    {
        tracing::info!(key_file = %key_file.display(), "Mooncake objects carry a keyed MAC");
    }
    // The C ABI client's library is loaded before anything is created (the pool itself is
    // built when the first engine connects): a missing or wrong-ABI library refuses the start.
    #[cfg(feature = "mooncake-c")]
    if cfg.pool.kind == PoolKind::Mooncake && cfg.mooncake.client == super::pool_config::MooncakeClient::CAbi {
        let lib = crate::pool::mooncake::cabi::check_library(Some(&cfg.mooncake.library))
            .map_err(|e| anyhow::anyhow!("pool mooncake (client c-abi): {e}"))?;
        tracing::info!(library = %lib.display(), "Mooncake C library loaded: every function of store_c.h present");
    }
    let rt = server::runtime_with(cfg.control.worker_nice).context("starting the control-plane runtime")?;
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
        if let Some(kvtier_uid) = cfg.host.path.parent().and_then(Path::parent)
            && kvtier_uid.starts_with("/dev/shm")
            && kvtier_uid != Path::new("/dev/shm")
        {
            private::shared_dir(kvtier_uid, engines).context("the arena's directory")?;
        }
        let arena_dir = private::parent_of(&cfg.host.path);
        private::shared_dir(arena_dir, engines).context("the arena's directory")?;
        if let Some(kvtier_uid) = arena_dir.parent().filter(|d| d.starts_with("/dev/shm")) {
            // Say whose arena this is, then reclaim those whose runtime directory is gone.
            super::orphans::mark_runtime_dir(arena_dir, private::parent_of(&cfg.socket))
                .context("the arena's runtime marker")?;
            super::orphans::reclaim(kvtier_uid, arena_dir);
        }
    }
    // The socket before the tiers: while recovery rebuilds the index, engines get a typed
    // `recovering` answer, never "connection refused". A refused start (the arena is
    // another daemon's) removes the socket again.
    let listener = bind(&cfg)?;
    let recovering = super::recovering::answer(&listener).context("answering while recovering")?;
    if cfg.host.test_open_delay_ms > 0 {
        std::thread::sleep(Duration::from_millis(cfg.host.test_open_delay_ms));
    }
    let opened = ManagedTiers::open(cfg.tiers(), SystemClock::new()).context("opening the tiers");
    recovering.finish();
    let backend = match opened {
        Ok(b) => Arc::new(b),
        Err(e) => {
            let _ = std::fs::remove_file(&cfg.socket);
            return Err(e);
        }
    };
    announce(&cfg, &backend)?;
    tracing::info!(socket = %cfg.socket.display(), "serving");
    let shared = Arc::new(Shared::new(backend.clone(), cfg.limits()));
    backend.manager().upkeep().set_waker(shared.upkeep_waker());
    let tick = Duration::from_millis(cfg.tiers.tick_ms.max(1));
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
    rt.shutdown_timeout(Duration::from_millis(cfg.control.max_wait_ms) + Duration::from_secs(1));
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
    let size = match backend.manager().stores().arena() {
        Some(a) => format!(
            "{} MiB in {} slots of {} bytes (host.slot_bytes)",
            a.len_bytes() >> 20,
            a.slots(),
            a.slot_bytes()
        ),
        None if cfg.host.slot_bytes == 0 => format!(
            "{} MiB, slots fitted to the first engine's objects (host.slot_bytes = 0, the default)",
            cfg.host.bytes >> 20
        ),
        None => format!(
            "{} MiB, slots of {} bytes (host.slot_bytes)",
            cfg.host.bytes >> 20,
            cfg.host.slot_bytes
        ),
    };
    let size = match cfg.engine_gid()? {
        Some(g) => format!("{size}, mode 0660 for access.engine_group {g}"),
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
        cfg.host.path.display(),
        backend.manifest_path().display(),
        backend.lock_path().display()
    )?;
    match cfg.pool.kind {
        PoolKind::None => writeln!(out, "kvtier serve: pool none")?,
        PoolKind::Local if cfg.pool.bytes == 0 => writeln!(out, "kvtier serve: pool none (pool.bytes = 0)")?,
        PoolKind::Local => writeln!(out, "kvtier serve: pool local, {} MiB", cfg.pool.bytes >> 20)?,
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
                "kvtier serve: pool mooncake, client {}, master {} ({health}), key tag {:?}, segment {} MiB, {} replica(s)",
                match m.client {
                    super::pool_config::MooncakeClient::Helper => "helper",
                    super::pool_config::MooncakeClient::CAbi => "c-abi",
                },
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

/// Starts the pool index (`mooncake.index_sources`): its subscribers, this node's own
/// object events among them, and its supervisor. A failure is logged; lookups then keep
/// asking the master.
fn start_pool_index(
    cfg: &DaemonConfig,
    manager: &crate::manager::Manager,
    own: Option<String>,
    cancel: &CancellationToken,
) {
    use crate::pool::index::{PoolIndex, sync};
    let mut sources = cfg.mooncake.index_sources.clone();
    if let Some(own) = own.filter(|o| !sources.contains(o)) {
        sources.push(own);
    }
    let index = Arc::new(PoolIndex::new(cfg.mooncake.index_max_keys));
    let icfg = sync::IndexConfig {
        sources,
        admin: cfg.mooncake.admin_addr(),
        poll: Duration::from_millis(50),
        http_timeout: Duration::from_secs(5),
    };
    let m = manager.clone();
    let healthy = Box::new(move || {
        m.stores()
            .pool()
            .is_some_and(|p| p.health() == crate::pool::PoolHealth::Ok)
    });
    let m = manager.clone();
    let on_resync = Box::new(move |ix: &PoolIndex| {
        m.reconcile_pool(ix, false);
    });
    let shown = format!("{} sources, master admin {}", icfg.sources.len(), icfg.admin);
    match sync::spawn(icfg, index.clone(), healthy, on_resync, cancel.clone()) {
        Ok(_) if manager.discovery().set_index(index) => println!("kvtier serve: pool index on ({shown})"),
        Ok(_) => tracing::warn!("pool index not used: the pool is not shared"),
        Err(e) => tracing::warn!(error = %e, "pool index not started; lookups ask the master"),
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
        socket: cfg.admin.socket.clone(),
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
            println!("kvtier serve: admin socket {}", cfg.admin.socket.display());
            Some(h)
        }
        Err(e) => {
            tracing::warn!(error = %e, socket = %cfg.admin.socket.display(), "admin socket not started");
            None
        }
    };
    let mut publishers = Vec::new();
    let run_dir = cfg.socket.parent().map(Path::to_path_buf).unwrap_or_default();
    if !cfg.events.endpoint.is_empty() {
        use crate::publish::vllm;
        let vcfg = vllm::VllmConfig {
            endpoint: super::config::event_endpoint(&cfg.events.endpoint, &run_dir, "kv-events.ipc"),
            replay_endpoint: Some(super::config::event_endpoint(
                &cfg.events.replay_endpoint,
                &run_dir,
                "kv-events-replay.ipc",
            ))
            .filter(|e| !e.is_empty()),
            encoding: cfg.events.encoding.into(),
            hashes: cfg.events.hashes,
            replay: cfg.events.replay_protocol,
            replay_limits: vllm::ReplayLimits {
                per_sec: cfg.events.replay_per_sec,
                ..vllm::ReplayLimits::default()
            },
            tokens: Some(shared.tokens.clone()),
            // Pool pages say whether the pool is this node's own or a cluster's store.
            pool_medium: if cfg.pool.kind == PoolKind::Local {
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
            Err(e) => tracing::warn!(error = %e, endpoint = %cfg.events.endpoint, "KV event publisher not started"),
        }
    }
    // Mooncake-style object events describe objects in a shared store; the node-local
    // pool is none, so they are published only with `pool = "mooncake"` (local pool pages
    // are in the vLLM events above, with the pool tier's medium).
    if cfg.pool.kind != PoolKind::Mooncake && !cfg.events.pool_endpoint.is_empty() {
        println!(
            "kvtier serve: pool object events off (they describe a shared store; pool is {})",
            cfg.pool.kind.name()
        );
    }
    let mut own_pool_events = None;
    if !cfg.events.pool_endpoint.is_empty() && cfg.pool.kind == PoolKind::Mooncake {
        let mcfg = crate::publish::mooncake::MooncakeConfig {
            endpoint: super::config::event_endpoint(&cfg.events.pool_endpoint, &run_dir, "pool-events.ipc"),
            tenant_id: cfg.events.pool_tenant.clone(),
            ..crate::publish::mooncake::MooncakeConfig::default()
        };
        match crate::publish::mooncake::spawn(mcfg, manager.clone(), side.clone()) {
            Ok(h) => {
                println!("kvtier serve: pool object events {}", h.endpoint());
                own_pool_events = Some(h.endpoint().to_owned());
                publishers.push(h);
            }
            Err(e) => {
                tracing::warn!(error = %e, endpoint = %cfg.events.pool_endpoint, "pool event publisher not started")
            }
        }
    }
    if cfg.pool.kind == PoolKind::Mooncake && !cfg.mooncake.index_sources.is_empty() {
        start_pool_index(cfg, &manager, own_pool_events, &cancel);
    }
    if cfg.pool.kind == PoolKind::Mooncake
        && let Err(e) = super::pool_watch::spawn(manager.clone(), cancel.clone())
    {
        tracing::warn!(error = %e, "pool watcher not started: pages a replaced helper lost are not written again");
    }
    if !cfg.events.session_endpoint.is_empty() {
        let scfg = crate::publish::sessions::SessionEventsConfig {
            endpoint: super::config::event_endpoint(&cfg.events.session_endpoint, &run_dir, "session-events.ipc"),
            ..crate::publish::sessions::SessionEventsConfig::default()
        };
        match crate::publish::sessions::spawn(scfg, manager.clone(), side.clone()) {
            Ok(h) => {
                println!("kvtier serve: session events {}", h.endpoint());
                publishers.push(h);
            }
            Err(e) => {
                tracing::warn!(error = %e, endpoint = %cfg.events.session_endpoint, "session event publisher not started")
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
