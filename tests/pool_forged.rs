//! Pool integrity against a store peer without the cluster key, through two
//! `kvtier serve --pool mooncake` daemons on one real `mooncake_master`.
//!
//! The master has no authentication: whoever reaches it (`mallory`, here the wheel's own
//! client run by this test; her uid does not matter to the store, the cluster key is what
//! she lacks) can put objects under any key. Two of last round's breaks:
//!
//! - **Pre-put.** Mallory puts Carol's page keys first, with her own bytes. Carol's daemon
//!   (A) finds each key taken when it shares the page, checks the object there, refuses
//!   it (counted), removes it and puts Carol's: node B then loads Carol's bytes on both
//!   ranks. Before, A took "already exists" as stored and nobody could ever load the page.
//! - **Forged object.** An object that fails its MAC on B's load is a miss, counted, and
//!   removed from the store, so no lookup (B's, or any peer's) credits it again.
//!
//! Needs the Mooncake wheel's `mooncake_master` and Python (`scripts/mooncake-env.sh env`);
//! without them the test writes a `SKIPPED` line, or fails where `KVTIER_REQUIRE` lists
//! `mooncake`.

mod cluster_support;
mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cluster_support::{Master, Node, Rank, eventually};
use common::rank::RankProc;
use common::require::require;
use common::{hashes, spec};
use kvtier::hints::{Hint, HintOutcome, HintTarget};
use kvtier::page::{Namespace, PageHash};
use kvtier::pool::keys::{KeyFormat, scheme_for};

/// Mallory's client: the wheel's own, contributing no segment (her objects land in the
/// daemons' segments and outlive her). `forge` puts `len` bytes of her choosing under
/// every key; `exists` prints the store's answer per key.
fn mallory(python: &Path, master: &Master, mode: &str, keys: &[String], len: usize) -> Vec<i64> {
    const SCRIPT: &str = r#"
import ctypes, json, sys
from mooncake.store import MooncakeDistributedStore
cfg = json.loads(sys.argv[1])
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", cfg["metadata"], 0, 16 << 20, "tcp", "", cfg["master"]) == 0
keys = cfg["keys"]
if cfg["mode"] == "forge":
    n = cfg["len"]
    buf = ctypes.create_string_buffer(b"\xa5" * (n * len(keys)), n * len(keys))
    base = ctypes.addressof(buf)
    assert s.register_buffer(base, len(buf)) == 0
    rc = s.batch_put_from(keys, [base + i * n for i in range(len(keys))], [n] * len(keys))
    assert rc == [0] * len(keys), rc
    print(json.dumps(rc))
else:
    print(json.dumps(s.batch_is_exist(keys)))
"#;
    let spec = serde_json::json!({
        "mode": mode, "master": master.addr(), "metadata": master.metadata(), "keys": keys, "len": len,
    });
    let out = Command::new(python)
        .args(["-c", SCRIPT, &spec.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mallory {mode}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("mallory {mode}: {e}: {text}"))
}

fn rejected(n: &Node) -> u64 {
    let pool = n.admin(&["status"])["pool"].clone();
    assert_eq!(pool["integrity"]["on"], true, "{pool}");
    pool["integrity"]["rejected"].as_u64().unwrap()
}

#[test]
fn a_pre_put_page_is_replaced_and_a_forged_object_is_removed_on_load() {
    if !require("mooncake", "needs mooncake_master and the wheel's Python") {
        return;
    }
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(bin, dir.path());
    let a = Node::start(&dir.path().join("a"), &master, &python);
    let b = Node::start(&dir.path().join("b"), &master, &python);
    let layout = spec(2, 1).build().unwrap();
    let keys = scheme_for("kvtier", KeyFormat::Kvtier, &Namespace::model("test-model"), &layout);
    let obj = layout.object_bytes(0) as usize;

    // Engines on both nodes start the pools; once both nodes' segments are mounted the
    // store has room for Mallory's objects.
    let mut ranks: Vec<RankProc> = (0..2)
        .map(|r| RankProc::spawn(&a.socket, "a-engine", r, 0, 2, 1))
        .collect();
    for r in &mut ranks {
        assert_eq!(r.cmd("ready"), "ready");
    }
    let b0 = Rank::new(&b, 0);
    let b1 = Rank::new(&b, 1);
    for n in [&a, &b] {
        let up = eventually(Duration::from_secs(60), || {
            n.admin(&["status"])["pool"]["health"]["state"] == "ok"
        });
        assert!(up, "pool healthy; log {}", n.log.display());
    }

    // Mallory pre-puts every object of three of Carol's four pages: two at the size of a
    // sealed object, one at the bare page size.
    let hs = hashes(0xca_0100_0000, 4);
    let page_keys = |h: &PageHash| keys.page_keys(&layout, h);
    let pre: Vec<String> = hs[..2].iter().flat_map(page_keys).collect();
    mallory(&python, &master, "forge", &pre, obj + 32);
    mallory(&python, &master, "forge", &page_keys(&hs[2]), obj);
    let taken = pre.len() + page_keys(&hs[2]).len();
    let a_before = rejected(&a);

    // Carol's engine on A stores the pages (both ranks) and shares them.
    for r in &mut ranks {
        let stored = r.nums(&format!("store {} 4", hs[0].prefix_u64()));
        assert_eq!(stored[0], 4, "rank wrote every page");
    }
    let ctl = a.client("a-ctl", 0);
    let prefix: Vec<String> = hs.iter().map(PageHash::to_hex).collect();
    let share = Hint::Share {
        target: HintTarget::Prefix(hs.clone()),
    };
    // Each round (re)sends the share, then looks; `eventually` spaces the rounds.
    let pooled = eventually(Duration::from_secs(60), || {
        let ok = matches!(ctl.hint(share.clone()), Ok(HintOutcome::Accepted { .. }));
        ok && a.admin(&["pages", "--ns", "0", "--prefix", &prefix.join(",")])["complete_prefix"]["pool"] == hs.len()
    });
    assert!(pooled, "A's pages reached the store; log {}", a.log.display());
    let a_after = rejected(&a);
    assert!(
        a_after - a_before >= taken as u64,
        "A checked and refused every pre-put object ({} of {taken}); log {}",
        a_after - a_before,
        a.log.display()
    );

    // Node B loads Carol's bytes for every page, on both ranks, and refuses nothing.
    let b_before = rejected(&b);
    let found = eventually(Duration::from_secs(30), || {
        b0.client.lookup(&hs).is_ok_and(|h| h.pool == 4)
    });
    assert!(found, "B found Carol's pages; log {}", b.log.display());
    assert_eq!(b0.load(&hs), (4, 4), "rank 0 loads Carol's bytes, not Mallory's");
    assert_eq!(b1.load(&hs), (4, 4), "rank 1 loads Carol's bytes, not Mallory's");
    assert_eq!(rejected(&b), b_before, "nothing B read failed its MAC");

    // A forged page: B credits it at lookup (existence is all the master knows), loads
    // none of it, counts what it refused, and removes it from the store.
    let forged = PageHash::from_u64(0xf0_0ca0_0001);
    let fkeys = page_keys(&forged);
    mallory(&python, &master, "forge", &fkeys, obj + 32);
    assert!(mallory(&python, &master, "exists", &fkeys, 0).iter().all(|&e| e == 1));
    let credited = eventually(Duration::from_secs(30), || {
        b0.client
            .lookup(std::slice::from_ref(&forged))
            .is_ok_and(|h| h.pool == 1)
    });
    assert!(credited, "the forged page is in the store");
    assert_eq!(b0.load(std::slice::from_ref(&forged)), (0, 0), "never loaded on rank 0");
    let _ = b1.client.lookup(std::slice::from_ref(&forged));
    assert_eq!(b1.load(std::slice::from_ref(&forged)), (0, 0), "never loaded on rank 1");
    assert!(
        rejected(&b) >= b_before + 2,
        "B counted the forged objects it read; log {}",
        b.log.display()
    );
    // What rank 0 read is gone from the store: no lookup credits the page again.
    let gone = eventually(Duration::from_secs(10), || {
        mallory(&python, &master, "exists", &fkeys[..2], 0) == vec![0, 0]
    });
    assert!(gone, "B removed the forged objects it read; log {}", b.log.display());
    let uncredited = eventually(Duration::from_secs(30), || {
        b0.client
            .lookup(std::slice::from_ref(&forged))
            .is_ok_and(|h| h.pool == 0)
    });
    assert!(
        uncredited,
        "no pool credit for the forged page once its objects are gone"
    );
    // Carol's pages are untouched by all of this.
    assert_eq!(b0.load(&hs), (4, 4));
}
