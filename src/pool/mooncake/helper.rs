//! Spawns and supervises the helper process that holds the Mooncake client.
//!
//! One supervisor thread per pool starts the helper, accepts its control connection, and
//! then asks it for its state every probe interval. A helper that exits, closes its socket
//! or stops answering is replaced, with a backoff that doubles up to a limit; while it is
//! down the pool is `Degraded` and calls fail fast. The helper reports `ready` only when
//! its client is set up and the master is reachable, so a dead master degrades the pool
//! too, and its return clears it.
//!
//! The helper runs requests concurrently and answers probes from its reading thread, with
//! how long its running requests have gone without one finishing (`stalled_ms`). Only a
//! helper stalled for [`HUNG_AFTER`] (or deaf to probes that long) is killed: a kill drops
//! this node's Mooncake segment and every object the store placed in it, so a helper that
//! is merely busy is never replaced.

use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::MooncakeConfig;
use super::wire::{Body, Conn, Op, Reply, WireError};
use crate::pool::{HelperQueue, PoolHealth};

/// After this long without an answer to probes, or with requests running and none
/// finishing, a running helper is killed and replaced.
pub(crate) const HUNG_AFTER: Duration = Duration::from_secs(15);
/// How long a transfer past its deadline waits for its reply ([`super::wire::Conn::call_settled`]):
/// longer than [`HUNG_AFTER`], so a hung helper is killed by the supervisor first.
pub(crate) const SETTLE: Duration = Duration::from_secs(20);
/// How long a helper may take to leave after its socket closes, before it is killed.
const GRACEFUL_EXIT: Duration = Duration::from_secs(3);

/// What the backend needs to reach and restart the helper.
pub(crate) struct Launch {
    pub cfg: MooncakeConfig,
    pub python: PathBuf,
    pub script: PathBuf,
    pub run_dir: PathBuf,
    /// `(path, length)` of each region, in region-id order.
    pub regions: Vec<(PathBuf, u64)>,
}

struct State {
    conn: Option<Arc<Conn>>,
    child: Option<Child>,
    health: PoolHealth,
    restarts: u64,
    /// The running helper's queue as of its last probe; its totals count from its start.
    queue: HelperQueue,
    /// The totals of the helpers before it.
    queue_before: HelperQueue,
}

pub(crate) struct Shared {
    launch: Launch,
    state: Mutex<State>,
    stop: AtomicBool,
}

/// Owns the supervisor thread; dropping it stops the helper.
pub(crate) struct Supervisor {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Supervisor {
    pub fn start(launch: Launch) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            launch,
            state: Mutex::new(State {
                conn: None,
                child: None,
                health: PoolHealth::Degraded {
                    reason: "Mooncake helper starting".into(),
                },
                restarts: 0,
                queue: HelperQueue::default(),
                queue_before: HelperQueue::default(),
            }),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvtier-mooncake-supervisor".into())
            .spawn(move || supervise(&s))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    pub fn shared(&self) -> &Shared {
        &self.shared
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Shared {
    pub fn health(&self) -> PoolHealth {
        self.state.lock().health.clone()
    }

    pub fn restarts(&self) -> u64 {
        self.state.lock().restarts
    }

    /// The helper's queue as of its last probe, with totals over every helper started.
    pub fn queue(&self) -> HelperQueue {
        let st = self.state.lock();
        let (now, before) = (st.queue, st.queue_before);
        HelperQueue {
            queued: now.queued,
            in_flight: now.in_flight,
            timed_out_in_queue_total: before.timed_out_in_queue_total + now.timed_out_in_queue_total,
            refused_full_total: before.refused_full_total + now.refused_full_total,
            done_total: before.done_total + now.done_total,
            restarts_total: st.restarts,
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.state.lock().child.as_ref().map(Child::id)
    }

    /// The connection, when the pool is healthy; otherwise why not.
    pub fn conn(&self) -> Result<Arc<Conn>, String> {
        let st = self.state.lock();
        match (&st.health, &st.conn) {
            (PoolHealth::Ok, Some(c)) if c.is_open() => Ok(c.clone()),
            (PoolHealth::Degraded { reason }, _) => Err(reason.clone()),
            _ => Err("Mooncake helper connection lost".into()),
        }
    }

    /// Marks the pool degraded until the next probe says otherwise.
    pub fn degrade(&self, reason: String) {
        let mut st = self.state.lock();
        if st.health == PoolHealth::Ok {
            tracing::warn!(%reason, "mooncake pool degraded");
        }
        st.health = PoolHealth::Degraded { reason };
    }

    /// Kills the helper if its connection has closed but it has not been reaped yet, so a
    /// caller whose transfer saw the connection close never reuses memory the helper may
    /// still write. A helper already replaced was reaped by whoever replaced it.
    pub fn reap_closed(&self) {
        let mut st = self.state.lock();
        if st.conn.as_ref().is_some_and(|c| !c.is_open()) {
            st.conn = None;
            if let Some(mut child) = st.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            st.health = PoolHealth::Degraded {
                reason: "Mooncake helper restarting: its connection closed".into(),
            };
        }
    }

    /// Kills the helper now and waits for it to be gone. Used when a transfer timed out:
    /// the helper could otherwise still read or write caller memory after we returned.
    pub fn kill(&self, reason: &str) {
        let mut st = self.state.lock();
        tracing::warn!(reason, "killing the mooncake helper");
        if let Some(c) = st.conn.take() {
            c.shutdown();
        }
        if let Some(mut child) = st.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        st.health = PoolHealth::Degraded {
            reason: format!("Mooncake helper restarting: {reason}"),
        };
    }
}

fn supervise(sh: &Shared) {
    let mut backoff = Duration::from_millis(100);
    let mut next_start = Instant::now();
    let mut last_answer = Instant::now();
    let mut spawned = 0u64;
    while !sh.stop.load(Ordering::Acquire) {
        let gone = {
            let mut st = sh.state.lock();
            let exited = match st.child.as_mut().map(|c| c.try_wait()) {
                None => Some("not running".to_owned()),
                Some(Ok(Some(status))) => Some(format!("exited ({status})")),
                Some(Ok(None)) => None,
                Some(Err(e)) => Some(format!("unknown ({e})")),
            };
            let closed = st.conn.as_ref().is_none_or(|c| !c.is_open());
            match exited {
                Some(why) => {
                    st.child = None;
                    st.conn = None;
                    st.health = PoolHealth::Degraded {
                        reason: format!("Mooncake helper {why}"),
                    };
                    true
                }
                None if closed => {
                    // Alive but deaf: replace it.
                    if let Some(mut c) = st.child.take() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    st.conn = None;
                    true
                }
                None => false,
            }
        };
        if gone {
            if Instant::now() >= next_start {
                match spawn(&sh.launch, spawned) {
                    Ok((child, conn)) => {
                        let mut st = sh.state.lock();
                        if spawned > 0 {
                            st.restarts += 1;
                        }
                        // The new helper counts from zero: keep its predecessor's totals.
                        let last = std::mem::take(&mut st.queue);
                        st.queue_before.timed_out_in_queue_total += last.timed_out_in_queue_total;
                        st.queue_before.refused_full_total += last.refused_full_total;
                        st.queue_before.done_total += last.done_total;
                        tracing::info!(pid = child.id(), restarts = st.restarts, "mooncake helper started");
                        st.child = Some(child);
                        st.conn = Some(conn);
                        last_answer = Instant::now();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, ?backoff, "mooncake helper failed to start");
                        sh.degrade(format!("Mooncake helper failed to start: {e}"));
                    }
                }
                spawned += 1;
                next_start = Instant::now() + backoff;
                backoff = (backoff * 2).min(sh.launch.cfg.restart_backoff_max);
            }
        } else if let Some(conn) = current(sh) {
            match probe(&conn, sh.launch.cfg.probe_interval.max(Duration::from_millis(500))) {
                Ok((_, _, stalled, _)) if stalled > HUNG_AFTER => {
                    sh.kill(&format!("requests running with none finished for {stalled:?}"));
                }
                Ok((ready, reason, _, queue)) => {
                    last_answer = Instant::now();
                    let mut st = sh.state.lock();
                    if let Some(q) = queue {
                        st.queue = q;
                    }
                    if ready {
                        if st.health != PoolHealth::Ok {
                            tracing::info!("mooncake pool healthy");
                        }
                        st.health = PoolHealth::Ok;
                        backoff = Duration::from_millis(100);
                    } else {
                        st.health = PoolHealth::Degraded { reason };
                    }
                }
                // Busy with a long transfer, not hung: it answered something recently.
                Err(WireError::Timeout(t)) if conn.since_last_reply() < t * 2 => last_answer = Instant::now(),
                Err(WireError::Timeout(_)) if last_answer.elapsed() > HUNG_AFTER => sh.kill("not answering"),
                Err(e) => sh.degrade(format!("Mooncake helper not answering: {e}")),
            }
        }
        std::thread::sleep(sh.launch.cfg.probe_interval);
    }
    let mut st = sh.state.lock();
    if let Some(c) = st.conn.take() {
        c.shutdown();
    }
    if let Some(mut c) = st.child.take() {
        // A closed socket asks the helper to unmount its segment and leave; give it a
        // moment, so the master does not keep placing objects in a dead segment.
        let end = Instant::now() + GRACEFUL_EXIT;
        while Instant::now() < end && matches!(c.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn current(sh: &Shared) -> Option<Arc<Conn>> {
    sh.state.lock().conn.clone()
}

/// Asks the helper's state: ready, why not, how long its running requests have gone
/// without one finishing, and its queue (totals since it started; no restarts).
fn probe(conn: &Conn, timeout: Duration) -> Result<(bool, String, Duration, Option<HelperQueue>), WireError> {
    match conn.call(Op::Status, &Body::default(), timeout)? {
        Reply::Ok(json) => {
            let v: serde_json::Value =
                serde_json::from_slice(&json).map_err(|_| WireError::Malformed("status is not JSON"))?;
            let ready = v.get("ready").and_then(|r| r.as_bool()).unwrap_or(false);
            let reason = v.get("reason").and_then(|r| r.as_str()).unwrap_or("").to_owned();
            let stalled = Duration::from_millis(v.get("stalled_ms").and_then(|s| s.as_u64()).unwrap_or(0));
            let n = |k: &str| v.get(k).and_then(|x| x.as_u64());
            let queue = (|| {
                Some(HelperQueue {
                    queued: n("queued")?,
                    in_flight: n("running")?,
                    timed_out_in_queue_total: n("expired")?,
                    refused_full_total: n("busy")?,
                    done_total: n("done")?,
                    restarts_total: 0,
                })
            })();
            Ok((ready, reason, stalled, queue))
        }
        Reply::Unavailable(r) | Reply::Bad(r) | Reply::Busy(r) => Ok((false, r, Duration::ZERO, None)),
    }
}

/// Starts one helper and accepts its connection, within the start timeout.
fn spawn(l: &Launch, n: u64) -> std::io::Result<(Child, Arc<Conn>)> {
    let sock = l.run_dir.join(format!("ctl-{n}.sock"));
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock)?;
    listener.set_nonblocking(true)?;
    // Keep the previous helper's log: it says why that one died.
    let log_path = l.run_dir.join("helper.log");
    let _ = std::fs::rename(&log_path, l.run_dir.join("helper.log.1"));
    let log = crate::tier::private::replace(&log_path).map_err(std::io::Error::other)?;
    let mut cmd = Command::new(&l.python);
    cmd.arg(&l.script)
        .arg("--socket")
        .arg(&sock)
        .args(["--master", &l.cfg.master, "--metadata", &l.cfg.metadata])
        .args(["--hostname", &l.cfg.local_hostname, "--protocol", &l.cfg.protocol])
        .args(["--device", &l.cfg.device])
        .args(["--segment-bytes", &l.cfg.segment_bytes.to_string()])
        .args(["--local-buffer-bytes", &l.cfg.local_buffer_bytes.to_string()])
        .args(["--replicas", &l.cfg.replicas.to_string()])
        .args(["--workers", &l.cfg.helper_workers.to_string()])
        .args(["--max-queued", &(l.cfg.helper_workers * 8).to_string()])
        .args(["--test-get-delay-ms", &l.cfg.test_get_delay.as_millis().to_string()])
        // Mooncake's INFO lines would grow the log without bound in a long-running daemon.
        .env(
            "GLOG_minloglevel",
            std::env::var("GLOG_minloglevel").unwrap_or_else(|_| "1".into()),
        )
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    for (path, len) in &l.regions {
        cmd.arg("--region").arg(format!("{}:{len}", path.display()));
    }
    // SAFETY: the closure makes one `prctl` system call (rustix issues it directly: no
    // allocation, no lock), which is async-signal-safe. The helper dies with the
    // supervisor thread that started it, so a crashed daemon never leaves a client
    // holding pool memory.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let deadline = Instant::now() + l.cfg.start_timeout;
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(std::io::Error::other(format!("helper exited at start ({status})")));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "helper did not connect",
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = std::fs::remove_file(&sock);
    stream.set_nonblocking(false)?;
    Ok((child, Conn::new(stream)?))
}
