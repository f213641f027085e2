//! The daemon's threads' CPU priorities, read from `/proc/<pid>/task/*/stat`: the threads
//! that move bytes and do pool I/O (transfer workers, the blocking pool) run
//! `control.worker_nice` steps below the control thread, which keeps the daemon's own
//! priority, and nothing is raised above it. And their placement, read from
//! `/proc/<pid>/task/*/status`: with `control.worker_cores`, each transfer worker is pinned
//! to its core and no other thread is.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvtier::protocol::LoadWait;
use kvtier::tier::device::EmulatedDevice;

/// One thread of a process, as its `stat` file says.
#[derive(Debug)]
struct Thread {
    tid: u32,
    comm: String,
    nice: i32,
}

/// Parses a `stat` line: the name sits in parentheses (and may hold spaces or
/// parentheses itself), the nice value is field 19, the 17th after the name.
fn parse_stat(tid: u32, line: &str) -> Thread {
    let open = line.find('(').expect("a stat line names its thread");
    let close = line.rfind(')').expect("a stat line names its thread");
    let rest: Vec<&str> = line[close + 1..].split_whitespace().collect();
    Thread {
        tid,
        comm: line[open + 1..close].to_owned(),
        nice: rest[16].parse().expect("field 19 of stat is the nice value"),
    }
}

/// Every thread of `pid` still alive when read.
fn threads(pid: u32) -> Vec<Thread> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let Ok(tid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A thread that ended since the listing has no stat any more.
        if let Ok(line) = std::fs::read_to_string(e.path().join("stat")) {
            out.push(parse_stat(tid, &line));
        }
    }
    out
}

/// The nice value of the calling thread, which the daemon it spawns starts with.
fn own_nice() -> i32 {
    parse_stat(0, &std::fs::read_to_string("/proc/thread-self/stat").unwrap()).nice
}

/// Starts a daemon with `worker_nice`, has one engine store and load a few pages (so the
/// blocking pool has threads: connect, store and a waiting load run there), and returns
/// the daemon's threads.
fn threads_after_work(worker_nice: u8) -> (u32, Vec<Thread>) {
    let dir = tempfile::tempdir().unwrap();
    let set = format!("control.worker_nice={worker_nice}");
    let d = Daemon::start_with(dir.path(), 4 << 20, &[set.as_str()]);
    let pid = d.pid().unwrap();
    let layout = spec(1, 1);
    let built = layout.clone().build().unwrap();
    let c = d.client(identity("prio", 0, 0, 1, 1), layout);
    let dev = Arc::new(EmulatedDevice::new(&built, 0, 8));
    c.register_device(dev.clone()).unwrap();
    let hs = hashes(7_000, 8);
    let slots: Vec<u32> = (0..8).collect();
    for (i, h) in hs.iter().enumerate() {
        dev.fill_page(i as u32, seed(h, 0, 0)).unwrap();
    }
    c.store(&hs, &slots, "").unwrap();
    c.removed(&hs).unwrap();
    assert_eq!(c.load(&hs, &slots, LoadWait::Timeout(2_000)).unwrap(), 8);
    until("the daemon has blocking threads", Duration::from_secs(10), || {
        threads(pid).iter().any(|t| t.comm == "kvtier-blocking")
    });
    let ts = threads(pid);
    drop(c);
    drop(d);
    (pid, ts)
}

#[test]
fn transfer_workers_and_blocking_threads_run_at_the_configured_nice_below_the_control_thread() {
    let base = own_nice();
    let want = (base + 7).min(19);
    let (pid, ts) = threads_after_work(7);
    let control = ts.iter().find(|t| t.tid == pid).expect("the main thread");
    assert_eq!(
        control.nice, base,
        "the control thread keeps the daemon's priority: {ts:?}"
    );
    let xfer: Vec<&Thread> = ts.iter().filter(|t| t.comm.starts_with("kvtier-xfer-")).collect();
    let blocking: Vec<&Thread> = ts.iter().filter(|t| t.comm == "kvtier-blocking").collect();
    assert!(!xfer.is_empty() && !blocking.is_empty(), "{ts:?}");
    for t in xfer.iter().chain(&blocking) {
        assert_eq!(
            t.nice, want,
            "{} runs worker_nice below the control thread: {ts:?}",
            t.comm
        );
    }
    // Only those: the admin socket's threads stay at the daemon's priority, and no thread
    // is ever raised above it.
    let admin: Vec<&Thread> = ts.iter().filter(|t| t.comm.starts_with("kvtier-admin")).collect();
    assert!(!admin.is_empty(), "{ts:?}");
    assert!(admin.iter().all(|t| t.nice == base), "{ts:?}");
    assert!(ts.iter().all(|t| t.nice >= base), "{ts:?}");
}

#[test]
fn worker_nice_zero_leaves_every_thread_at_the_daemons_priority() {
    let base = own_nice();
    let (_, ts) = threads_after_work(0);
    assert!(ts.iter().any(|t| t.comm.starts_with("kvtier-xfer-")), "{ts:?}");
    assert!(ts.iter().all(|t| t.nice == base), "{ts:?}");
}

/// The cores thread `tid` of `pid` may run on, as `Cpus_allowed_list` says (`0-1`, `3`).
fn cpus_allowed(pid: u32, tid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list:"))
        .expect("a status file lists the allowed cores");
    line["Cpus_allowed_list:".len()..].trim().to_owned()
}

#[test]
fn transfer_workers_pin_themselves_to_control_worker_cores_and_nothing_else_is_pinned() {
    let allowed = kvtier::affinity::allowed_cores().unwrap();
    let last = *allowed.last().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // One core named for the daemon's two workers: the list is reused from its start.
    let set = format!("control.worker_cores=[{last}]");
    let d = Daemon::start_with(dir.path(), 4 << 20, &[set.as_str()]);
    let pid = d.pid().unwrap();
    let xfer = || {
        let mut v: Vec<(String, String)> = threads(pid)
            .iter()
            .filter(|t| t.comm.starts_with("kvtier-xfer-"))
            .map(|t| (t.comm.clone(), cpus_allowed(pid, t.tid)))
            .collect();
        v.sort();
        v
    };
    let want: Vec<(String, String)> = [last, last]
        .iter()
        .enumerate()
        .map(|(i, c)| (format!("kvtier-xfer-{i}"), c.to_string()))
        .collect();
    // A worker pins itself as its first step, which on a loaded machine may come after
    // the daemon already answers: wait for it, within a deadline.
    until("both workers are pinned", Duration::from_secs(10), || xfer() == want);
    assert_eq!(xfer(), want);
    // The control thread keeps every core the daemon started with.
    let all = cpus_allowed(pid, pid);
    assert_eq!(all, cpus_allowed(std::process::id(), std::process::id()));
}

#[test]
fn a_worker_core_the_daemon_may_not_run_on_stops_the_start_and_names_it() {
    let allowed = kvtier::affinity::allowed_cores().unwrap();
    let outside = (0..4096).find(|c| !allowed.contains(c)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("k.sock");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .args(["--set", &format!("control.worker_cores=[{outside}]")])
        .env("KVTIER_ARENA_PATH", dir.path().join("arena"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started with worker core {outside}: {err}");
    assert!(
        err.contains("control.worker_cores") && err.contains(&format!("core {outside}")),
        "{err}"
    );
    assert!(!socket.exists(), "refused before binding");
}
