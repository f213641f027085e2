//! Issue 27, break 4 ("wrong bytes across TP sizes"): two nodes share one Mooncake store
//! and serve the same model with 2 KV heads, one at TP=2 and one at TP=4. At TP=2 rank 1
//! holds head 1; at TP=4 rank 1 holds head 0, in objects of the same size. Pool keys that
//! named only the rank let one node load the other's head. Keys carry the TP size and
//! the dtype now: neither node ever credits or loads the other's objects, and each
//! node's pages come back bit-identical on a fresh node of its own geometry. The same
//! for two dtypes of one size (f16 and bf16) at one TP size.

use std::sync::Arc;
use std::time::Duration;

use crate::cluster_support::{Master, Node, eventually, mooncake_tools};
use crate::common::require::require;
use crate::common::{hashes, seed};
use kvtier::client::{Client, ClientConfig};
use kvtier::hints::{Hint, HintOutcome, HintTarget};
use kvtier::layout::{Dtype, LayoutSpec};
use kvtier::page::{Namespace, PageHash};
use kvtier::protocol::{Identity, LoadWait};
use kvtier::tier::device::EmulatedDevice;

/// The model both nodes serve: 2 layers, 2 KV heads of 64, 2-byte elements, 4 tokens a page.
fn model(tp: u16, dtype: Dtype) -> LayoutSpec {
    LayoutSpec::mha(2, 2, 64, 2, 4).with_dtype(dtype).with_parallel(tp, 1)
}

struct Rank {
    client: Client,
    dev: Arc<EmulatedDevice>,
}

/// Every rank of one engine on `node`, in this process.
fn engine(node: &Node, instance: &str, spec: &LayoutSpec) -> Vec<Rank> {
    (0..spec.tp_size)
        .map(|tp| {
            let id = Identity {
                instance: instance.into(),
                namespace: Namespace::model("org/two-head-model"),
                tp_rank: tp,
                tp_size: spec.tp_size,
                pp_rank: 0,
                pp_size: 1,
                dp_rank: 0,
            };
            let cfg = ClientConfig::new(&node.socket, id, spec.clone()).with_timeout(Duration::from_secs(20));
            let client = Client::connect(cfg).unwrap();
            let dev = Arc::new(EmulatedDevice::new(&spec.clone().build().unwrap(), 0, 16));
            client.register_device(dev.clone()).unwrap();
            Rank { client, dev }
        })
        .collect()
}

/// The bytes `node` (a salt per writing node) writes for page `h` on TP rank `tp`.
fn bytes_of(node: u16, h: &PageHash, tp: u16) -> u64 {
    seed(h, tp, node)
}

/// Stores `hs` from every rank of `ranks` with `node`'s bytes and shares them until the
/// node counts them all complete in the pool.
fn store_and_share(node: &Node, ranks: &[Rank], salt: u16, hs: &[PageHash]) {
    let slots: Vec<u32> = (0..hs.len() as u32).collect();
    for (tp, r) in ranks.iter().enumerate() {
        for (i, h) in hs.iter().enumerate() {
            r.dev.fill_page(i as u32, bytes_of(salt, h, tp as u16)).unwrap();
        }
        r.client.store(hs, &slots, "").unwrap();
    }
    let share = Hint::Share {
        target: HintTarget::Pages(hs.to_vec()),
    };
    let prefix: Vec<String> = hs.iter().map(PageHash::to_hex).collect();
    let pooled = eventually(Duration::from_secs(60), || {
        matches!(ranks[0].client.hint(share.clone()), Ok(HintOutcome::Accepted { .. }))
            && node.admin(&["pages", "--ns", "0", "--prefix", &prefix.join(",")])["complete_prefix"]["pool"] == hs.len()
    });
    assert!(pooled, "pages reached the store; log {}", node.log.display());
}

/// Each rank loads `hs` into device slots 8..; every page must hold `salt`'s bytes.
fn loads_own(ranks: &[Rank], salt: u16, hs: &[PageHash]) {
    let into: Vec<u32> = (8..8 + hs.len() as u32).collect();
    for (tp, r) in ranks.iter().enumerate() {
        let n = r.client.load(hs, &into, LoadWait::Timeout(10_000)).unwrap();
        assert_eq!(n, hs.len(), "rank {tp} loaded every page");
        for (i, h) in hs.iter().enumerate() {
            assert!(
                r.dev.page_matches(into[i], bytes_of(salt, h, tp as u16)).unwrap(),
                "rank {tp} page {i}: the bytes of node {salt}"
            );
        }
    }
}

/// Node A (`a`) and node B (`b`) serve one model on one store; see the module docs.
fn never_shared(name: &str, a: &LayoutSpec, b: &LayoutSpec, base: u64) {
    let (bin, python) = mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(bin, dir.path());
    // The same tokens on every node, so the same page hashes.
    let hs = hashes(base, 4);
    let node_a = Node::start(&dir.path().join("a"), &master, &python);
    let ranks_a = engine(&node_a, "a-engine", a);
    store_and_share(&node_a, &ranks_a, 1, &hs);

    // A fresh node of A's geometry finds A's pages in the store (so lookups reach it),
    // while B, beside it, credits none of them and loads none.
    let node_b = Node::start(&dir.path().join("b"), &master, &python);
    let ranks_b = engine(&node_b, "b-engine", b);
    let fresh_a = Node::start(&dir.path().join("a2"), &master, &python);
    let ranks_fa = engine(&fresh_a, "a2-engine", a);
    let found = |ranks: &[Rank]| {
        eventually(Duration::from_secs(60), || {
            ranks[0]
                .client
                .lookup(&hs)
                .is_ok_and(|h| (h.device, h.host, h.pool) == (0, 0, hs.len()))
        })
    };
    assert!(
        found(&ranks_fa),
        "{name}: a fresh node of A's geometry found A's pages; log {}",
        fresh_a.log.display()
    );
    for _ in 0..3 {
        let hit = ranks_b[0].client.lookup(&hs).unwrap();
        assert_eq!(hit.total(), 0, "{name}: B credited A's pages: {hit:?}");
    }
    let into: Vec<u32> = (8..8 + hs.len() as u32).collect();
    for (tp, r) in ranks_b.iter().enumerate() {
        let n = r.client.load(&hs, &into, LoadWait::Timeout(2_000)).unwrap();
        assert_eq!(n, 0, "{name}: B rank {tp} loaded A's pages");
    }
    loads_own(&ranks_fa, 1, &hs);

    // B stores its own bytes under the same hashes; with both in the store, a fresh node
    // of B's geometry loads B's bit for bit, never A's.
    store_and_share(&node_b, &ranks_b, 2, &hs);
    let fresh_b = Node::start(&dir.path().join("b2"), &master, &python);
    let ranks_fb = engine(&fresh_b, "b2-engine", b);
    assert!(
        found(&ranks_fb),
        "{name}: a fresh node of B's geometry found B's pages; log {}",
        fresh_b.log.display()
    );
    loads_own(&ranks_fb, 2, &hs);
}

#[test]
fn tp2_and_tp4_of_one_model_on_one_store_never_load_each_others_objects() {
    if !require("mooncake", "two daemons at TP=2 and TP=4 share a mooncake_master") {
        return;
    }
    never_shared(
        "TP=2 vs TP=4",
        &model(2, Dtype::Bf16),
        &model(4, Dtype::Bf16),
        0x27_4000,
    );
}

#[test]
fn two_dtypes_of_one_size_on_one_store_never_load_each_others_objects() {
    if !require("mooncake", "two daemons with f16 and bf16 share a mooncake_master") {
        return;
    }
    never_shared("f16 vs bf16", &model(2, Dtype::F16), &model(2, Dtype::Bf16), 0x27_5000);
}
