//! Sessions in the daemon, end to end: two engine processes (a parent session and a
//! child that forks its prefix) report phases through their clients; under host pressure
//! the acting child's private pages go to the pool while the shared prefix stays, and on
//! resume they are back in host, with ReadyToLoad advice, before the engine looks again —
//! with no hint sent. The pressure controller's pause and resume reach the engine's
//! advice stream. Bad session input gets typed errors and loses nothing. The same
//! scenario through `kvtier replay` is tests/session_moves.rs.

mod common;
mod session_support;

use std::process::Command;
use std::time::Duration;

use common::kvtier_bin;
use common::rank::RankProc;
use serde_json::{Value, json};
use session_support::{advice_until, http, serve, wait_until, where_are};

#[test]
fn an_acting_child_goes_to_the_pool_under_pressure_and_comes_back_on_resume() {
    let dir = tempfile::tempdir().unwrap();
    let traces = dir.path().join("traces/requests.jsonl");
    let d = serve(dir.path(), &[format!("request_trace_path={}", traces.display())]);
    let mut parent = RankProc::spawn(&d.socket, "parent-engine", 0, 0, 1, 1);
    let mut child = RankProc::spawn(&d.socket, "child-engine", 0, 0, 1, 1);

    assert_eq!(parent.cmd("phase parent - reasoning"), "ok");
    assert_eq!(parent.cmd("cstore parent 1000 8"), "stored 8 8");
    assert_eq!(child.cmd("phase child parent reasoning"), "ok");
    assert_eq!(child.cmd("cstore child 1000 8 2000 16"), "stored 24 24");
    assert_eq!(child.cmd("phase child - acting"), "ok");

    // The sessions as the daemon keeps them.
    let (_, v) = http(&d.admin, "GET", "/v1/sessions", "");
    let s = |id: &str| {
        v["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["session_id"] == id)
            .cloned()
    };
    let c = s("child").unwrap_or_else(|| panic!("child in {v}"));
    assert_eq!(
        (c["parent_session_id"].clone(), c["phase"].clone()),
        (json!("parent"), json!("acting"))
    );
    assert_eq!(c["pages"], json!(24));
    assert_eq!(s("parent").unwrap()["phase"], json!("reasoning"));

    // No pressure (24 of 100 pages): an acting session keeps its pages in host, after
    // the policy has had its chance (a whole upkeep run, which takes the policy's step,
    // started after the child began acting).
    common::two_more_upkeep_runs(&d.admin, Duration::from_secs(15));
    assert!(where_are(&d.admin, 2000, 16).iter().all(|&(host, _)| host));

    // Another session fills host to 0.88, between the target (0.80) and the high
    // watermark (0.95): the child's private pages go to the pool, the prefix stays.
    assert_eq!(parent.cmd("cstore filler 5000 64"), "stored 64 64");
    wait_until("the child's private pages are only in the pool", || {
        where_are(&d.admin, 2000, 16) == vec![(false, true); 16]
    });
    assert!(
        where_are(&d.admin, 1000, 8).iter().all(|&(host, _)| host),
        "the shared prefix stays in host"
    );
    // Nothing else left host: the filler (reasoning) and the parent keep theirs.
    assert!(where_are(&d.admin, 5000, 64).iter().all(|&(host, _)| host));

    // Resume: no hint, only the phase. Back in host before the next lookup.
    assert_eq!(child.cmd("phase child - reasoning"), "ok");
    assert_eq!(where_are(&d.admin, 2000, 16), vec![(true, true); 16]);
    assert_eq!(child.cmd("advice"), "ready 24", "ReadyToLoad names the whole chain");
    assert_eq!(child.cmd("cload 1000 8 2000 16"), "loaded 24 24");

    let (_, a) = http(&d.admin, "GET", "/v1/sessions/advice", "");
    assert_eq!(a["stats"]["demoted_pages"], json!(16), "{a}");
    assert_eq!(a["stats"]["staged_pages"], json!(24), "{a}");

    // Request ends become content-free trace lines that `kvtier replay --trace` reads.
    assert_eq!(parent.cmd("reqend parent - 32 4 1000 8"), "ok");
    assert_eq!(child.cmd("reqend child parent 96 8 1000 8 2000 16"), "ok");
    let text = std::fs::read_to_string(&traces).unwrap();
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{text}");
    let ids: Vec<u64> = (1000..1008).chain(2000..2016).collect();
    assert_eq!(lines[1]["hash_ids"], json!(ids));
    assert_eq!(
        (lines[1]["session_id"].clone(), lines[1]["parent_session_id"].clone()),
        (json!("child"), json!("parent"))
    );
    assert_eq!(
        (lines[1]["input_length"].clone(), lines[1]["output_length"].clone()),
        (json!(96), json!(8))
    );
    let mut keys: Vec<&String> = lines[1].as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "hash_ids",
            "input_length",
            "output_length",
            "parent_session_id",
            "session_id",
            "timestamp"
        ]
    );
    let out = Command::new(kvtier_bin())
        .args(["replay", "--json", "--block-tokens", "4", "--trace"])
        .arg(&traces)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (r["workload"]["requests"].clone(), r["workload"]["sessions"].clone()),
        (json!(2), json!(2))
    );
    // The child reuses the parent's 8-page prefix: 32 of its tokens are a hit.
    assert_eq!(r["bounds"]["infinite_hit_tokens"], json!(32), "{r}");
}

#[test]
fn a_trace_line_with_missing_fields_is_refused_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\": 0, \"input_length\": 8, \"output_length\": 1, \"hash_ids\": [1, 2]}\n{\"timestamp\": 5, \"input_length\": 8, \"output_length\": 1}\n",
    )
    .unwrap();
    let out = Command::new(kvtier_bin())
        .args(["replay", "--json", "--trace"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2") && err.contains("hash_ids"), "{err}");
}

#[test]
fn bad_session_input_gets_typed_errors_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = serve(dir.path(), &[]);
    let mut e = RankProc::spawn(&d.socket, "engine", 0, 0, 1, 1);
    assert_eq!(e.cmd("phase a - reasoning"), "ok");
    assert_eq!(e.cmd("cstore a 1000 8"), "stored 8 8");
    assert_eq!(e.cmd("phase b a reasoning"), "ok");

    // A parent cycle (a's parent would be b, whose parent is a), from an engine.
    let cycle = e.cmd("phase a b reasoning");
    assert!(cycle.starts_with("err") && cycle.contains("cycle"), "{cycle}");
    // An id over the length limit.
    let long = "x".repeat(1025);
    let too_long = e.cmd(&format!("phase {long} - acting"));
    assert!(too_long.starts_with("err") && too_long.contains("1024"), "{too_long}");
    // From a router: an unknown phase, and a cycle.
    let (status, v) = http(
        &d.admin,
        "POST",
        "/v1/sessions/phase",
        r#"{"session_id":"a","phase":"thinking"}"#,
    );
    assert_eq!((status, v["code"].clone()), (400, json!("bad_session")), "{v}");
    assert!(
        v["message"].as_str().unwrap_or("").contains("reasoning"),
        "lists the phases: {v}"
    );
    let (status, v) = http(
        &d.admin,
        "POST",
        "/v1/sessions/phase",
        r#"{"session_id":"a","parent_session_id":"b","phase":"acting"}"#,
    );
    assert_eq!((status, v["code"].clone()), (400, json!("bad_session")), "{v}");
    // A good one from the router works, and nothing stored was lost.
    let (status, v) = http(
        &d.admin,
        "POST",
        "/v1/sessions/phase",
        r#"{"session_id":"b","phase":"acting"}"#,
    );
    assert_eq!((status, v["session"]["phase"].clone()), (200, json!("acting")), "{v}");
    assert_eq!(e.cmd("cload 1000 8"), "loaded 8 8");
    let (_, v) = http(&d.admin, "GET", "/v1/sessions", "");
    let a = v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["session_id"] == "a")
        .cloned()
        .unwrap();
    assert_eq!(
        a["parent_session_id"],
        Value::Null,
        "the refused parent was not recorded"
    );
}

#[test]
fn exclusive_tiers_drop_the_host_copy_once_a_page_is_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let d = serve(dir.path(), &["policy_exclusive=true".to_string()]);
    let mut e = RankProc::spawn(&d.socket, "engine", 0, 0, 1, 1);
    assert_eq!(e.cmd("cstore a 1000 4"), "stored 4 4");
    assert_eq!(e.cmd("cremoved 1000 4"), "ok");
    assert_eq!(where_are(&d.admin, 1000, 4), vec![(true, false); 4]);
    assert_eq!(e.cmd("cload 1000 4"), "loaded 4 4");
    assert_eq!(
        where_are(&d.admin, 1000, 4),
        vec![(false, false); 4],
        "on device now: the host copy went"
    );
}

#[test]
fn the_pressure_controller_pauses_and_resumes_sessions_through_the_engines_advice_stream() {
    let dir = tempfile::tempdir().unwrap();
    // Exclusive tiers: loading a page to device drops its host copy, so the test lowers
    // host utilisation by loading, as an engine would.
    let d = serve(dir.path(), &["policy_exclusive=true".to_string()]);
    let mut e = RankProc::spawn(&d.socket, "engine", 0, 0, 1, 1);
    assert_eq!(e.cmd("phase tool-user - reasoning"), "ok");
    assert_eq!(e.cmd("cstore tool-user 1000 10"), "stored 10 10");
    assert_eq!(e.cmd("phase tool-user - acting"), "ok");
    assert_eq!(e.cmd("alladvice"), "advice", "no pressure, no advice");

    // Another session takes host to 96 of 100 pages, over the pause threshold (0.95):
    // the acting session is paused, and its engine hears it.
    assert_eq!(e.cmd("cstore filler 5000 86"), "stored 86 86");
    assert_eq!(advice_until(&mut e, 1), ["pause:tool-user"]);
    let (_, v) = http(&d.admin, "GET", "/v1/sessions", "");
    let phase = |v: &Value, id: &str| {
        v["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["session_id"] == id)
            .map(|s| s["phase"].clone())
    };
    assert_eq!(phase(&v, "tool-user"), Some(json!("paused")), "{v}");
    // Its pages went to the pool: they are what the pause frees.
    wait_until("the paused session's pages are only in the pool", || {
        where_are(&d.admin, 1000, 10) == vec![(false, true); 10]
    });

    // The filler's pages are loaded to device and leave host: utilisation falls to the
    // resume threshold (0.85, less the paused session's size and its buffer). The engine
    // hears Resume, and the session's pages are staged back and ready to load.
    assert_eq!(e.cmd("cload 5000 86"), "loaded 86 86");
    let got = advice_until(&mut e, 2);
    assert_eq!(got, ["readytoload:10", "resume:tool-user"], "staged, then resumed");
    assert_eq!(where_are(&d.admin, 1000, 10), vec![(true, true); 10]);
    let (_, v) = http(&d.admin, "GET", "/v1/sessions", "");
    // No longer paused; still waiting on its tool until its engine says otherwise.
    assert_eq!(phase(&v, "tool-user"), Some(json!("acting")), "{v}");
    assert_eq!(e.cmd("cload 1000 10"), "loaded 10 10");

    // Routers saw the same two decisions at the admin socket.
    let (_, a) = http(&d.admin, "GET", "/v1/sessions/advice", "");
    let kinds: Vec<(String, String)> = a["advice"]
        .as_array()
        .unwrap_or_else(|| panic!("advice in {a}"))
        .iter()
        .map(|x| {
            (
                x["advice"].as_str().unwrap().to_owned(),
                x["session_id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("pause".to_owned(), "tool-user".to_owned()),
            ("resume".to_owned(), "tool-user".to_owned())
        ]
    );
    assert_eq!(
        (a["stats"]["pauses"].clone(), a["stats"]["resumes"].clone()),
        (json!(1), json!(1)),
        "{a}"
    );
}
