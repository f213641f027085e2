//! The same scenario through `kvtier replay`: the daemon records the acceptance
//! scenario's requests as a request trace, the replay runs that trace through the same
//! session policy with the daemon's capacities, and the host and pool moves it makes are
//! the daemon's, page for page.

mod common;
mod session_support;

use std::process::Command;
use std::time::{Duration, Instant};

use common::rank::RankProc;
use common::{hashes, kvtier_bin};
use serde_json::Value;
use session_support::{daemon_moves, move_runs, serve, wait_until, where_are};

/// The child's first turn in the replay: at most 96 tokens of prefill at 20,000 tokens/s
/// (4.8 ms) and its pages' copies at 25 GB/s (under 1 ms), rounded up.
const CHILD_TURN: Duration = Duration::from_millis(10);

/// The acceptance scenario once more, its requests recorded by the daemon as a request
/// trace; `kvtier replay` runs that trace with the daemon's capacities (100 pages of
/// host, a pool of 2,048) through the same session policy and makes the same moves.
///
/// The replay's phase signals are a request's arrival (reasoning) and its end (acting).
/// So the parent, the filler and the child's second turn are long requests (100,000
/// output tokens): they run on while the daemon scenario lasts, as the daemon's parent and
/// filler stay reasoning. The child's first turn ends at once and it acts, as in the
/// daemon. The daemon scenario ends with the child's second turn; the replay runs the
/// trace to its end (those requests finish, much later, and their sessions act), so the
/// moves compared are the replay's up to that turn's arrival.
#[test]
fn the_daemon_scenario_replayed_from_its_request_trace_makes_the_same_moves() {
    let dir = tempfile::tempdir().unwrap();
    let traces = dir.path().join("traces/requests.jsonl");
    let d = serve(dir.path(), &[format!("request_trace_path={}", traces.display())]);
    let mut parent = RankProc::spawn(&d.socket, "parent-engine", 0, 0, 1, 1);
    let mut child = RankProc::spawn(&d.socket, "child-engine", 0, 0, 1, 1);

    assert_eq!(parent.cmd("phase parent - reasoning"), "ok");
    assert_eq!(parent.cmd("cstore parent 1000 8"), "stored 8 8");
    assert_eq!(parent.cmd("reqend parent - 32 100000 1000 8"), "ok");
    assert_eq!(child.cmd("phase child parent reasoning"), "ok");
    assert_eq!(child.cmd("cstore child 1000 8 2000 16"), "stored 24 24");
    assert_eq!(child.cmd("reqend child parent 96 0 1000 8 2000 16"), "ok");
    assert_eq!(child.cmd("phase child - acting"), "ok");
    // The replay ends the child's first turn its prefill and copies after its arrival
    // (`CHILD_TURN`), so the filler must arrive later than that on
    // the daemon's millisecond clock, which runs at this process's rate: wait until the
    // child's line is in the trace and that time has passed since it was written.
    let child_ended = Instant::now();
    wait_until("the trace holds the child's first turn", || {
        std::fs::read_to_string(&traces).is_ok_and(|t| t.lines().count() == 2)
    });
    wait_until("the child's turn, as the replay times it, has ended", || {
        child_ended.elapsed() >= CHILD_TURN + Duration::from_millis(2)
    });
    assert_eq!(parent.cmd("cstore filler 5000 64"), "stored 64 64");
    assert_eq!(parent.cmd("reqend filler - 256 100000 5000 64"), "ok");
    wait_until("the child's private pages are only in the pool", || {
        where_are(&d.admin, 2000, 16) == vec![(false, true); 16]
    });
    assert_eq!(child.cmd("phase child - reasoning"), "ok");
    assert_eq!(where_are(&d.admin, 2000, 16), vec![(true, true); 16]);
    assert_eq!(child.cmd("reqend child parent 96 100000 1000 8 2000 16"), "ok");

    let daemon = move_runs(daemon_moves(&d.admin));
    let private: Vec<String> = hashes(2000, 16).iter().map(|h| h.to_hex()).collect();
    assert_eq!(
        daemon,
        vec![
            ("host".to_owned(), "pool".to_owned(), private.clone()),
            ("pool".to_owned(), "host".to_owned(), private.clone()),
        ],
        "the daemon demoted the child's private pages and staged them back, nothing else"
    );

    let text = std::fs::read_to_string(&traces).unwrap();
    let arrivals: Vec<u64> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["timestamp"].as_u64().unwrap())
        .collect();
    assert_eq!(arrivals.len(), 4, "{text}");
    assert!(
        arrivals[2] > arrivals[1] + CHILD_TURN.as_millis() as u64,
        "the filler arrived after the child's turn ended: {arrivals:?}"
    );
    let moves_path = dir.path().join("moves.jsonl");
    let out = Command::new(kvtier_bin())
        .args(["replay", "--json", "--block-tokens", "4", "--trace"])
        .arg(&traces)
        .args(["--device-pages", "1", "--host-pages", "100", "--pool", "local"])
        .args(["--pool-pages", "2048", "--policies", "session-aware", "--write-moves"])
        .arg(&moves_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let replayed: Vec<Value> = std::fs::read_to_string(&moves_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let resume_at = arrivals[3];
    let until_resume = replayed
        .iter()
        .filter(|m| m["at_ms"].as_u64().unwrap() <= resume_at)
        .map(|m| {
            let s = |k: &str| m[k].as_str().unwrap().to_owned();
            (s("page"), s("from"), s("to"))
        });
    assert_eq!(move_runs(until_resume), daemon, "replayed: {replayed:?}");
    // The demotion happened when the filler arrived, the staging when the child's
    // second turn did.
    assert_eq!(replayed[0]["at_ms"].as_u64(), Some(arrivals[2]), "{replayed:?}");
    assert_eq!(replayed[16]["at_ms"].as_u64(), Some(resume_at), "{replayed:?}");
}
