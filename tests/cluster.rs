//! Cluster mode through the daemons' sockets: one real `mooncake_master` (started here, on
//! ports of its own, since the test kills it) and two `kvtier serve --pool mooncake`
//! daemons with their own runtime directories and arenas. Node A's two rank processes store
//! complete TP=2 pages and share them; a fresh engine on node B finds them in the store,
//! loads A's bytes on both ranks, never credits a page only one rank wrote, loads fewer
//! pages once objects vanish, and gives no pool credit while the master is down.
//!
//! Needs the Mooncake wheel's `mooncake_master` (`KVTIER_MOONCAKE_MASTER_BIN`, from
//! `scripts/mooncake-env.sh env`) and its Python (`KVTIER_MOONCAKE_PYTHON`); without them
//! the test writes a `SKIPPED` line, or fails where `KVTIER_REQUIRE` lists `mooncake`.

mod cluster_support;
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use cluster_support::{Master, Node, Rank, eventually};
use common::rank::RankProc;
use common::require::require;
use common::{hashes, identity, seed, spec};
use kvtier::client::{Client, ClientConfig};
use kvtier::hints::{Hint, HintOutcome, HintTarget};
use kvtier::page::{Namespace, PageHash};
use kvtier::pool::keys::{KeyFormat, scheme_for};
use kvtier::protocol::{ErrorCode, Request};
use kvtier::tier::device::EmulatedDevice;

/// The wheel's own client, run as HiCache runs it, on `keys`: `put` writes `len` bytes per
/// key, `forge` too from a client that contributes no segment (the objects outlive it),
/// `remove` removes them.
fn store_client(python: &Path, master: &Master, mode: &str, keys: &[String], len: usize) {
    const SCRIPT: &str = r#"
import ctypes, json, sys
from mooncake.store import MooncakeDistributedStore
cfg = json.loads(sys.argv[1])
s = MooncakeDistributedStore()
# "forge" contributes no memory: its objects land in the daemons' segments and outlive it.
seg = 0 if cfg["mode"] == "forge" else 16 << 20
assert s.setup("127.0.0.1", cfg["metadata"], seg, 16 << 20, "tcp", "", cfg["master"]) == 0
if cfg["mode"] in ("put", "forge"):
    n = cfg["len"]
    buf = ctypes.create_string_buffer(n * len(cfg["keys"]))
    base = ctypes.addressof(buf)
    assert s.register_buffer(base, len(buf)) == 0
    rc = s.batch_put_from(cfg["keys"], [base + i * n for i in range(len(cfg["keys"]))], [n] * len(cfg["keys"]))
    assert rc == [0] * len(cfg["keys"]), rc
else:
    for k in cfg["keys"]:
        rc = s.remove(k, True)
        assert rc == 0, (k, rc)
    assert s.batch_is_exist(cfg["keys"]) == [0] * len(cfg["keys"])
"#;
    let spec = serde_json::json!({
        "mode": mode, "master": master.addr(), "metadata": master.metadata(), "keys": keys, "len": len,
    });
    let out = Command::new(python)
        .args(["-c", SCRIPT, &spec.to_string()])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "store client {mode}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Shares `hs` from node A until A's directory has every page complete in the store: a
/// share taken while the store is still coming up (after a master restart, segments are
/// mounted again within the client TTL) may write nothing, and is simply asked again.
fn share_until_pooled(a: &Node, ctl: &Client, hs: &[PageHash], ns: u16) {
    let prefix: Vec<String> = hs.iter().map(PageHash::to_hex).collect();
    let share = Hint::Share {
        target: HintTarget::Prefix(hs.to_vec()),
    };
    let pooled = eventually(Duration::from_secs(60), || {
        let taken = matches!(ctl.hint(share.clone()), Ok(HintOutcome::Accepted { .. }));
        std::thread::sleep(Duration::from_millis(200));
        taken
            && a.admin(&["pages", "--ns", &ns.to_string(), "--prefix", &prefix.join(",")])["complete_prefix"]["pool"]
                == hs.len()
    });
    assert!(pooled, "A's pages reached the store; log {}", a.log.display());
}

#[test]
fn two_daemons_on_one_store_share_complete_pages_and_only_those() {
    if !require("mooncake", "cluster mode needs mooncake_master and the wheel's Python") {
        return;
    }
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let mut master = Master::start(bin, dir.path());
    let a = Node::start(&dir.path().join("a"), &master, &python);
    let b = Node::start(&dir.path().join("b"), &master, &python);

    // A lookup on a cluster node answers on its connection task (it awaits the master
    // there): before Connect it is refused as on any daemon, and the connection stays.
    let mut raw = std::os::unix::net::UnixStream::connect(&b.socket).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for id in 1..=2 {
        let mut frame = Vec::new();
        Request::Lookup {
            hashes: hashes(0xbad, 2),
        }
        .encode(id, &mut frame);
        std::io::Write::write_all(&mut raw, &frame).unwrap();
        assert_eq!(common::code(common::answer(&mut raw)), Some(ErrorCode::NotConnected));
    }
    drop(raw);

    // Node A: two rank processes store 12 complete TP=2 pages; an engine shares them.
    let hs = hashes(0xc1a5_7e00_0000, 12);
    let mut ranks: Vec<RankProc> = (0..2)
        .map(|r| RankProc::spawn(&a.socket, "a-engine", r, 0, 2, 1))
        .collect();
    for r in &mut ranks {
        assert_eq!(r.cmd("ready"), "ready");
        let stored = r.nums(&format!("store {} 12", hs[0].prefix_u64()));
        assert_eq!(stored[0], 12, "rank wrote every page");
    }
    let ctl = a.client("a-ctl", 0);
    share_until_pooled(&a, &ctl, &hs, 0);

    // Node B: a fresh engine finds the pages in the store, as pool hits.
    let b0 = Rank::new(&b, 0);
    let b1 = Rank::new(&b, 1);
    let found = eventually(Duration::from_secs(60), || {
        b0.client
            .lookup(&hs[..4])
            .is_ok_and(|h| (h.device, h.host, h.pool) == (0, 0, 4))
    });
    assert!(found, "B found A's pages; log {}", b.log.display());
    assert_eq!(b0.load(&hs[..4]), (4, 4), "rank 0 loads A's rank-0 bytes");
    assert_eq!(b1.load(&hs[..4]), (4, 4), "rank 1 loads A's rank-1 bytes");
    let page = b.admin(&["pages", &hs[5].to_hex()]);
    assert_eq!(page["pages"][0]["known"], false, "not looked up yet");
    assert_eq!(b0.client.lookup(&hs[4..8]).unwrap().pool, 4);
    let page = b.admin(&["pages", &hs[5].to_hex()]);
    assert_eq!(page["pages"][0]["pool_origin"], "found_in_pool", "{page}");
    let page = a.admin(&["pages", &hs[5].to_hex()]);
    assert_eq!(page["pages"][0]["pool_origin"], "written_here", "{page}");

    // A page for which only TP rank 0's objects exist is never a hit on B.
    let layout = spec(2, 1).build().unwrap();
    let keys = scheme_for("kvtier", KeyFormat::Kvtier, &Namespace::model("test-model"), &layout);
    let lone = PageHash::from_u64(0x10e_0000_0001);
    let rank0: Vec<String> = keys.page_keys(&layout, &lone)[..2].to_vec();
    store_client(&python, &master, "put", &rank0, layout.object_bytes(0) as usize);
    assert_eq!(b0.client.lookup(&[lone]).unwrap().total(), 0);
    assert_eq!(b0.load(&[lone]), (0, 0));

    // Foreign puts under every key of a page (the wheel's raw client, as anyone who reaches
    // the master can): one the size of a sealed object, one the size of the bare bytes.
    // Neither carries the cluster key's MAC: B may credit them at lookup (existence is all
    // the master knows), but never loads them, and counts each object it refused.
    let rejected = |n: &Node| {
        let pool = n.admin(&["status"])["pool"].clone();
        assert_eq!(pool["integrity"]["on"], true, "{pool}");
        pool["integrity"]["rejected"].as_u64().unwrap()
    };
    let before = rejected(&b);
    let forged = [PageHash::from_u64(0xf0_0000_0001), PageHash::from_u64(0xf0_0000_0002)];
    let obj = layout.object_bytes(0) as usize;
    store_client(
        &python,
        &master,
        "forge",
        &keys.page_keys(&layout, &forged[0]),
        obj + 32,
    );
    store_client(&python, &master, "forge", &keys.page_keys(&layout, &forged[1]), obj);
    for (i, f) in forged.iter().enumerate() {
        // The master knows the objects exist: B credits the page at lookup...
        let credited = eventually(Duration::from_secs(30), || {
            b0.client.lookup(std::slice::from_ref(f)).is_ok_and(|h| h.pool == 1)
        });
        assert!(credited, "forged page {i} is in the store");
        // ...and loads none of it.
        assert_eq!(
            b0.load(std::slice::from_ref(f)),
            (0, 0),
            "forged page {i} is never loaded on rank 0"
        );
        let _ = b1.client.lookup(std::slice::from_ref(f)).unwrap();
        assert_eq!(
            b1.load(std::slice::from_ref(f)),
            (0, 0),
            "forged page {i} is never loaded on rank 1"
        );
    }
    let after = rejected(&b);
    assert!(
        after >= before + 2,
        "B refused the forged objects: {before} -> {after}; log {}",
        b.log.display()
    );
    // A real page behind a forged one: the load stops at the forged page, never past it.
    assert_eq!(b0.load(&[hs[0], forged[0], hs[1]]), (1, 1));

    // Objects removed from the store after B learned of them: fewer pages, no wrong bytes.
    store_client(&python, &master, "remove", &keys.page_keys(&layout, &hs[6]), 0);
    assert_eq!(b0.load(&hs[4..8]), (2, 2), "the load stops at the vanished page");
    assert_eq!(b1.load(&hs[4..8]), (2, 2));

    // With the master down, B gives no pool credit; once it is back, it does again.
    assert_eq!(b0.client.lookup(&hs[8..12]).unwrap().pool, 4);
    master.kill();
    let none = eventually(Duration::from_secs(30), || {
        b0.client.lookup(&hs[8..12]).is_ok_and(|h| h.pool == 0)
    });
    assert!(none, "no pool credit while the master is down");
    let status = b.admin(&["status"]);
    assert_eq!(status["pool"]["backend"], "mooncake");
    // The daemon asked the master itself, and kept doing so through its restart.
    assert_eq!(status["pool"]["exists_via"], "master", "{}", status["pool"]);
    assert_eq!(status["pool"]["health"]["state"], "degraded", "{}", status["pool"]);
    master.restart();
    // The restarted master lost every object: the old pages are gone for good (no stale
    // credit), and pages A shares now are hits on B again.
    let fresh = hashes(0xc1a5_7e01_0000, 4);
    for r in &mut ranks {
        assert_eq!(r.nums(&format!("store {} 4", fresh[0].prefix_u64()))[0], 4);
    }
    share_until_pooled(&a, &ctl, &fresh, 0);
    let again = eventually(Duration::from_secs(60), || {
        b0.client.lookup(&fresh).is_ok_and(|h| h.pool == 4)
    });
    assert!(
        again,
        "pool credit again after the restart; A {} B {}; B lookup {:?}; log {}",
        a.admin(&["status"])["pool"],
        b.admin(&["status"])["pool"],
        b0.client.lookup(&fresh),
        b.log.display()
    );
    assert_eq!(b1.load(&fresh), (4, 4));
    let stale = eventually(Duration::from_secs(30), || {
        b0.client.lookup(&hs[8..12]).is_ok_and(|h| h.pool == 0)
    });
    assert!(stale, "pages the old master held earn no credit");
    // Tenants whose namespaces differ only in '_' against '-', or in which field holds a
    // string, never meet on a key: A's salt "t_1" pages are no hit for salt "t-1" or for
    // LoRA "t_1" on B, and are for salt "t_1".
    let ns = |lora: &str, salt: &str| Namespace {
        model: "test-model".into(),
        lora: lora.into(),
        salt: salt.into(),
    };
    let tenant = |node: &Node, n: Namespace, tp: u16| {
        let mut id = identity(&format!("t-{}-{}-{tp}", n.lora, n.salt), tp, 0, 2, 1);
        id.namespace = n;
        let c = Client::connect(ClientConfig::new(&node.socket, id, spec(2, 1)).with_timeout(Duration::from_secs(20)))
            .unwrap();
        let dev = Arc::new(EmulatedDevice::new(&spec(2, 1).build().unwrap(), 0, 64));
        c.register_device(dev.clone()).unwrap();
        (c, dev)
    };
    let th = hashes(0x7e_0000_0000, 2);
    let writers: Vec<_> = (0..2).map(|tp| tenant(&a, ns("", "t_1"), tp)).collect();
    for (tp, (c, dev)) in writers.iter().enumerate() {
        for (i, h) in th.iter().enumerate() {
            dev.fill_page(i as u32, seed(h, tp as u16, 0)).unwrap();
        }
        c.store(&th, &[0, 1], "s").unwrap();
    }
    // The second namespace A registered: id 1.
    share_until_pooled(&a, &writers[0].0, &th, 1);
    for (lora, salt, want) in [("", "t-1", 0), ("t_1", "", 0), ("", "t_1", 2)] {
        let (c, _) = tenant(&b, ns(lora, salt), 0);
        let got = eventually(Duration::from_secs(10), || c.lookup(&th).is_ok_and(|h| h.pool == want));
        assert!(got, "lora {lora:?} salt {salt:?}: {:?}, want {want}", c.lookup(&th));
    }

    let metrics = Command::new("curl")
        .args(["-s", "--unix-socket"])
        .arg(&b.admin)
        .arg("http://kvtier/metrics")
        .output();
    if let Ok(m) = metrics
        && m.status.success()
    {
        let text = String::from_utf8_lossy(&m.stdout);
        assert!(text.contains("kvtier_pool_info{backend=\"mooncake\""), "{text}");
        assert!(text.contains("kvtier_pool_found_pages_total"), "{text}");
        assert!(text.contains("kvtier_pool_exists_via{via=\"master\"} 1"), "{text}");
        assert!(text.contains("kvtier_pool_integrity_enabled 1"), "{text}");
        assert!(text.contains("kvtier_pool_integrity_rejected_total "), "{text}");
    }
    drop(ranks);
}

/// `kvtier status --json`'s pool index, and the master queries made on the lookup path.
fn index_of(node: &Node) -> (serde_json::Value, u64) {
    let pool = node.admin(&["status"])["pool"].clone();
    let queries = pool["remote"]["exists_queries"].as_u64().unwrap();
    (pool["index"].clone(), queries)
}

fn in_sync(node: &Node) -> bool {
    eventually(Duration::from_secs(30), || index_of(node).0["mode"] == "in_sync")
}

/// The pool index: nodes on one master subscribe to each other's object events and answer
/// lookups from them with no master query; a load of a page the index believed present
/// but gone loads fewer pages and the index learns; the master killed and restarted
/// takes the index out of sync (no credit) and back; a node started against a populated
/// pool credits what is there after its resync, and never a page missing one rank.
#[test]
fn pool_index_answers_lookups_from_peer_events() {
    if !require(
        "mooncake",
        "the pool index needs mooncake_master and the wheel's Python",
    ) {
        return;
    }
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let mut master = Master::start(bin, dir.path());
    let ports: Vec<String> = (0..3)
        .map(|_| format!("tcp://127.0.0.1:{}", cluster_support::free_port()))
        .collect();
    let sources = format!("{:?}", ports);
    let start = |name: &str, own: &str| {
        Node::start_with(
            &dir.path().join(name),
            &master,
            &python,
            &[
                ("pool_events_endpoint", format!("{own:?}")),
                ("mooncake.index_sources", sources.clone()),
                ("mooncake.master_admin", format!("{:?}", master.admin())),
            ],
        )
    };
    let a = start("a", &ports[0]);
    let b = start("b", &ports[1]);
    // The pool starts with a node's first namespace: connect B's engine, then wait for
    // B's index to list the (empty) store.
    let b0 = Rank::new(&b, 0);
    let b1 = Rank::new(&b, 1);
    assert!(in_sync(&b), "B's index in sync: {}", index_of(&b).0);

    // A stores 12 complete TP=2 pages and shares them: B credits them from A's events.
    let hs = hashes(0x1de_0000_0000, 12);
    let mut ranks: Vec<RankProc> = (0..2)
        .map(|r| RankProc::spawn(&a.socket, "a-engine", r, 0, 2, 1))
        .collect();
    for r in &mut ranks {
        assert_eq!(r.cmd("ready"), "ready");
        assert_eq!(r.nums(&format!("store {} 12", hs[0].prefix_u64()))[0], 12);
    }
    let ctl = a.client("a-ctl", 0);
    let (_, queries_before) = index_of(&b);
    share_until_pooled(&a, &ctl, &hs, 0);
    let t = std::time::Instant::now();
    let credited = eventually(Duration::from_secs(10), || {
        b0.client
            .lookup(&hs)
            .is_ok_and(|h| (h.device, h.host, h.pool) == (0, 0, 12))
    });
    assert!(credited, "B credits A's pages from events: {}", index_of(&b).0);
    eprintln!(
        "pool index: B credited A's 12 pages {:?} after A's pages were pooled",
        t.elapsed()
    );
    // B's engine answers its lookups itself, from the lookup file's pool page table that
    // B's index keeps; B's daemon, asked, answers the same from its index.
    let local = b0.client.engine_lookups().answered();
    for _ in 0..20 {
        assert_eq!(b0.client.lookup(&hs).unwrap().pool, 12);
    }
    assert_eq!(
        b0.client.engine_lookups().answered(),
        local + 20,
        "answered in B's engine"
    );
    assert_eq!(b0.client.lookup_remote(&hs).unwrap().pool, 12);
    let (ix, queries_after) = index_of(&b);
    assert_eq!(
        queries_after, queries_before,
        "no master query on B's lookup path in sync: {ix}"
    );
    assert!(ix["index_lookups"].as_u64().unwrap() >= 1, "{ix}");
    assert!(
        ix["engine_pages"].as_u64().unwrap() >= 12,
        "A's pages in B's lookup file: {ix}"
    );
    assert!(ix["keys"].as_u64().unwrap() >= 48, "12 pages x 4 objects: {ix}");
    assert_eq!(b0.load(&hs[..4]), (4, 4), "rank 0 loads A's rank-0 bytes");
    assert_eq!(b1.load(&hs[..4]), (4, 4), "rank 1 loads A's rank-1 bytes");

    // Objects removed behind every node's back (the wheel's own client publishes nothing):
    // the load stops at the gone page, never wrong bytes, and the index learns.
    let layout = spec(2, 1).build().unwrap();
    let keys = scheme_for("kvtier", KeyFormat::Kvtier, &Namespace::model("test-model"), &layout);
    store_client(&python, &master, "remove", &keys.page_keys(&layout, &hs[6]), 0);
    assert_eq!(b0.load(&hs[4..8]), (2, 2), "the load stops at the vanished page");
    assert_eq!(b0.client.lookup(&hs[4..8]).unwrap().total(), 2, "the index learned");
    // (The index learns from the load's not-found, or from B's own `removed` event of the
    // page, whichever comes first: either way hs[6] is no longer credited, which the lookup
    // above shows; were it still believed present, hs[6] and hs[7] would be credited.)

    // A page with only TP rank 0's objects, written behind the index's back, and a node
    // started now: its resync lists both; it credits A's pages and never the half page.
    let lone = PageHash::from_u64(0x10e_0000_0002);
    let rank0: Vec<String> = keys.page_keys(&layout, &lone)[..2].to_vec();
    store_client(&python, &master, "put", &rank0, layout.object_bytes(0) as usize);
    let c = start("c", &ports[2]);
    let c0 = Rank::new(&c, 0);
    assert!(in_sync(&c), "C's index in sync: {}", index_of(&c).0);
    let (cix, c_queries) = index_of(&c);
    assert!(cix["resyncs"].as_u64().unwrap() >= 1, "{cix}");
    assert_eq!(c0.client.lookup(&hs[..6]).unwrap().pool, 6, "{}", index_of(&c).0);
    assert_eq!(c0.client.lookup(&[lone]).unwrap().total(), 0);
    assert_eq!(c0.load(&hs[..2]), (2, 2));
    assert_eq!(
        index_of(&c).1,
        c_queries,
        "C asked the master nothing on its lookup path"
    );
    let text = String::from_utf8(
        Command::new(common::kvtier_bin())
            .args(["status", "--socket"])
            .arg(&c.admin)
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(text.contains("pool index in sync"), "{text}");

    // The master killed: the index is out of sync and nothing gets pool credit. Restarted
    // (it lost every object): in sync again and the old pages earn nothing; A's resync
    // finds its pages gone from the store, stops believing the pool holds them (they stay
    // in its host), and shares them again for real: B credits them and loads A's bytes.
    let rest = &hs[8..12];
    master.kill();
    assert!(
        eventually(Duration::from_secs(30), || index_of(&b).0["mode"] == "syncing"),
        "{}",
        index_of(&b).0
    );
    assert!(eventually(Duration::from_secs(30), || {
        b0.client.lookup(rest).is_ok_and(|h| h.total() == 0)
    }));
    master.restart();
    assert!(in_sync(&b), "B resynced after the restart: {}", index_of(&b).0);
    assert!(in_sync(&a), "A resynced after the restart: {}", index_of(&a).0);
    let stale = eventually(Duration::from_secs(30), || {
        b0.client.lookup(rest).is_ok_and(|h| h.total() == 0)
    });
    assert!(stale, "pages the old master held earn no credit");
    let prefix: Vec<String> = rest.iter().map(PageHash::to_hex).collect();
    let a_view = || a.admin(&["pages", "--ns", "0", "--prefix", &prefix.join(",")])["complete_prefix"].clone();
    let relearned = eventually(Duration::from_secs(30), || {
        let v = a_view();
        v["pool"] == 0 && v["host"] == 4
    });
    assert!(
        relearned,
        "A no longer believes the store holds its pages: {}",
        a_view()
    );
    share_until_pooled(&a, &ctl, rest, 0);
    let again = eventually(Duration::from_secs(30), || {
        b0.client.lookup(rest).is_ok_and(|h| h.pool == 4)
    });
    assert!(again, "credit after the restart: {}", index_of(&b).0);
    assert_eq!(b1.load(rest), (4, 4), "A's bytes, nothing lost");
    drop(ranks);
}

/// `kvtier serve` with `--pool mooncake` and `args`, expected to refuse to start: its
/// stderr. Fails if it is still running after 30 s.
fn refused_start(dir: &Path, args: &[String]) -> String {
    let err = dir.join("refused.err");
    let mut child = Command::new(common::kvtier_bin())
        .arg("serve")
        .arg("--socket")
        .arg(dir.join("kvtier.sock"))
        .arg("--arena-path")
        .arg(dir.join("arena"))
        .args([
            "--arena-bytes",
            "4194304",
            "--pool",
            "mooncake",
            "--mooncake-master",
            "127.0.0.1:9",
        ])
        .args(["--set", "lock_arena=false", "--set", "prefault=false"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let exited = eventually(Duration::from_secs(30), || child.try_wait().unwrap().is_some());
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
    let text = std::fs::read_to_string(&err).unwrap();
    assert!(exited, "the daemon started: {text}");
    assert!(!child.wait().unwrap().success(), "{text}");
    assert!(!dir.join("kvtier.sock").exists(), "no socket is left behind");
    text
}

/// The cluster key file must be the daemon's own and private: mode 0644 refuses the start,
/// naming the file and its mode; so does `key_format = "sglang"` with integrity left on.
#[test]
fn a_cluster_key_file_others_can_read_refuses_the_start() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let key = cluster_support::cluster_key_file(dir.path());
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let key_set = format!("mooncake.integrity_key_file={:?}", key.display().to_string());
    let err = refused_start(dir.path(), &["--set".into(), key_set.clone()]);
    assert!(
        err.contains(&key.display().to_string()) && err.contains("0644") && err.contains("chmod 600"),
        "{err}"
    );
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let err = refused_start(
        dir.path(),
        &[
            "--set".into(),
            key_set,
            "--set".into(),
            "mooncake.key_format=\"sglang\"".into(),
        ],
    );
    assert!(err.contains("mooncake.integrity = false"), "{err}");
}

/// A SIGKILLed daemon takes its Mooncake helper with it: no process is left holding the
/// node's store segment and a mapping of its arena. The helper leaves when its control
/// socket closes, and the kernel kills it when the daemon's thread that started it dies
/// (its parent-death signal, set before `exec`), should it be stuck in the store.
#[test]
fn a_killed_daemons_mooncake_helper_dies_with_it() {
    if !require("mooncake", "cluster mode needs mooncake_master and the wheel's Python") {
        return;
    }
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(bin, dir.path());
    let a = Node::start(&dir.path().join("a"), &master, &python);
    // The helper starts at an engine's first connect.
    let _engine = a.client("a-engine", 0);
    let daemon = a.pid();
    assert!(
        eventually(Duration::from_secs(30), || cluster_support::helper_pid(daemon)
            .is_some()),
        "the daemon started no helper; log {}",
        a.log.display()
    );
    let helper = cluster_support::helper_pid(daemon).unwrap();
    // SAFETY: signalling a process by pid has no memory-safety preconditions; it is the
    // daemon this test started.
    assert_eq!(unsafe { libc::kill(daemon as i32, libc::SIGKILL) }, 0);
    assert!(
        eventually(Duration::from_secs(20), || !cluster_support::alive(helper)),
        "helper {helper} outlived its daemon"
    );
}
