//! Two SGLang 0.5.23 instances on two kvtier daemons that share one Mooncake Store: SGLang's
//! own `StorageBackendFactory` creates `kvtier.sglang.KvtierStorage` for instance A on
//! daemon A and instance B on daemon B, each over SGLang's own CPU host pool. A stores
//! pages with `batch_set_v1` (the backend shares them to A's pool); B, which never saw
//! them, finds them with `batch_exists` and loads them with `batch_get_v1` into its own
//! host pool, every element equal to A's (`python/tests/sglang_cluster.py`).
//!
//! Needs a `mooncake_master` (the wheel's, `KVTIER_MOONCAKE_MASTER_BIN`, started here on
//! ports of its own) and the SGLang venv; without them it writes a `SKIPPED` line, or fails
//! where `KVTIER_REQUIRE` lists `mooncake` or `sglang`.

mod cluster_support;
mod common;
mod pkg_support;

use cluster_support::{Master, Node};
use common::require::{engine_python, require};
use pkg_support::{assert_lines, run_ok, script};

#[test]
fn a_second_sglang_instance_on_another_daemon_hits_what_the_first_stored() {
    if !require("mooncake", "two daemons share pages through a mooncake_master") {
        return;
    }
    let Some(py) = engine_python("sglang", &["sglang", "torch"], "runs KvtierStorage in SGLang's HiCache") else {
        return;
    };
    let (bin, helper) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(bin, dir.path());
    let a = Node::start(&dir.path().join("a"), &master, &helper);
    let b = Node::start(&dir.path().join("b"), &master, &helper);
    let mut cmd = script(&py, "sglang_cluster.py");
    cmd.arg(&a.socket).arg(&b.socket);
    let out = run_ok(cmd, 600, &|| {
        format!("daemon A:\n{}\ndaemon B:\n{}", a.log_text(), b.log_text())
    });
    assert_lines(
        &out,
        &[
            "OK instance A stored 6 pages on daemon A",
            "OK daemon B finds 6 of them in the shared pool; a page never stored is a miss",
            "OK instance B loaded 6 pages into its host pool: 4608 elements equal, other pages untouched",
            "OK done",
        ],
    );
    // Node B's daemon learned the pages from the pool; node A's wrote them there.
    let line = out.lines().find_map(|l| l.strip_prefix("HASHES ")).unwrap();
    let hashes: Vec<&str> = line.split(',').collect();
    assert_eq!(hashes.len(), 6);
    for h in &hashes {
        let on_b = b.admin(&["pages", h]);
        assert_eq!(on_b["pages"][0]["pool_origin"], "found_in_pool", "{on_b}");
        let on_a = a.admin(&["pages", h]);
        assert_eq!(on_a["pages"][0]["pool_origin"], "written_here", "{on_a}");
    }
}
