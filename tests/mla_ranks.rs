//! MLA through the daemon's socket: a latent is the same on every TP rank, so only TP
//! rank 0 of each stage writes it, and every other TP rank must be able to load it. Four
//! rank connections on a TP=2 PP=2 MLA layout: the two TP-0 ranks store, the two TP-1
//! ranks (which store nothing) find the pages complete and load the bytes rank 0 wrote,
//! byte for byte, layer by layer. Across two `kvtier serve --pool mooncake` nodes, TP rank
//! 1 on the second node loads the latents of pages it found in the store.

mod cluster_support;
mod common;

use std::sync::Arc;

use common::{Daemon, hashes, seed};
use kvtier::client::Client;
use kvtier::layout::{LayoutSpec, Part};
use kvtier::page::Namespace;
use kvtier::protocol::{Identity, LoadWait};
use kvtier::tier::device::EmulatedDevice;

const TP: u16 = 2;
const PP: u16 = 2;
const LAYERS: u32 = 4;

fn mla() -> LayoutSpec {
    LayoutSpec::mla(LAYERS, 64, 2, 4).with_parallel(TP, PP)
}

struct Rank {
    tp: u16,
    pp: u16,
    client: Client,
    dev: Arc<EmulatedDevice>,
}

fn rank(d: &Daemon, instance: &str, tp: u16, pp: u16) -> Rank {
    rank_at(&d.socket, instance, tp, pp)
}

fn rank_at(socket: &std::path::Path, instance: &str, tp: u16, pp: u16) -> Rank {
    let id = Identity {
        instance: instance.into(),
        namespace: Namespace::model("mla-model"),
        tp_rank: tp,
        tp_size: TP,
        pp_rank: pp,
        pp_size: PP,
        dp_rank: 0,
    };
    let client = Client::connect(
        kvtier::client::ClientConfig::new(socket, id, mla()).with_timeout(std::time::Duration::from_secs(20)),
    )
    .unwrap();
    let dev = Arc::new(EmulatedDevice::new(&mla().build().unwrap(), pp, 16));
    client.register_device(dev.clone()).unwrap();
    Rank { tp, pp, client, dev }
}

#[test]
fn mla_tp_ranks_other_than_0_load_the_latent_rank_0_stored() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 16 << 20);
    let writers: Vec<Rank> = (0..PP).map(|pp| rank(&d, "mla-a", 0, pp)).collect();
    let readers: Vec<Rank> = (0..PP).map(|pp| rank(&d, "mla-b", 1, pp)).collect();
    let hs = hashes(0x31a_0000, 6);

    // TP rank 1 stores nothing of an MLA page, and what it "stores" alone is no page.
    let lone = hashes(0x31a_1000, 2);
    for r in &readers {
        r.client.store(&lone, &[0, 1], "").unwrap();
    }
    assert_eq!(readers[0].client.lookup(&lone).unwrap().total(), 0);

    // Rank 0 of each stage writes its stage's latent; that alone makes the pages complete.
    let slots: Vec<u32> = (0..hs.len() as u32).collect();
    for w in &writers {
        for (i, h) in hs.iter().enumerate() {
            w.dev.fill_page(i as u32, seed(h, w.tp, w.pp)).unwrap();
        }
        w.client.store(&hs, &slots, "").unwrap();
    }
    let hit = readers[1].client.lookup(&hs).unwrap();
    assert_eq!(hit.total(), hs.len(), "{hit:?}");

    // TP rank 1 loads them into other device slots: rank 0's bytes, every layer.
    let into: Vec<u32> = (0..hs.len() as u32).map(|i| 15 - i).collect();
    for (r, w) in readers.iter().zip(&writers) {
        let n = r.client.load(&hs, &into, LoadWait::Timeout(5_000)).unwrap();
        assert_eq!(n, hs.len(), "tp 1 pp {} loads every page", r.pp);
        let layers = mla().build().unwrap().stage_layers(r.pp);
        let mut compared = 0;
        for (i, h) in hs.iter().enumerate() {
            assert!(
                r.dev.page_matches(into[i], seed(h, 0, r.pp)).unwrap(),
                "page {i} pp {}",
                r.pp
            );
            for layer in 0..layers {
                let want = w.dev.read_layer(i as u32, Part::Latent, layer).unwrap();
                let got = r.dev.read_layer(into[i], Part::Latent, layer).unwrap();
                assert!(!want.is_empty());
                assert_eq!(got, want, "page {i} pp {} layer {layer}", r.pp);
                compared += got.len();
            }
        }
        assert_eq!(compared, hs.len() * layers as usize * 4 * 64 * 2);
        // Slots the load did not name stay as they were (zero).
        assert!(r.dev.read_layer(0, Part::Latent, 0).unwrap().iter().all(|&b| b == 0));
    }
    // The writers still load their own pages, and a page rank 0 never wrote is a miss.
    let n = writers[0]
        .client
        .load(&hs[..2], &[8, 9], LoadWait::Timeout(5_000))
        .unwrap();
    assert_eq!(n, 2);
    assert!(writers[0].dev.page_matches(9, seed(&hs[1], 0, 0)).unwrap());
    let n = readers[0]
        .client
        .load(&lone, &[0, 1], LoadWait::Timeout(5_000))
        .unwrap();
    assert_eq!(n, 0);
}

#[test]
fn mla_tp_rank_1_on_another_node_loads_latents_found_in_the_store() {
    use cluster_support::{Master, Node, eventually};
    use kvtier::hints::{Hint, HintOutcome, HintTarget};
    use std::time::Duration;

    if !common::require::require("mooncake", "two daemons share MLA pages through a mooncake_master") {
        return;
    }
    let (bin, python) = cluster_support::mooncake_tools();
    let dir = tempfile::tempdir().unwrap();
    let master = Master::start(bin, dir.path());
    let a = Node::start(&dir.path().join("a"), &master, &python);
    let b = Node::start(&dir.path().join("b"), &master, &python);
    let hs = hashes(0x31a_2000, 4);
    let slots: Vec<u32> = (0..hs.len() as u32).collect();
    let writers: Vec<Rank> = (0..PP).map(|pp| rank_at(&a.socket, "mla-a", 0, pp)).collect();
    for w in &writers {
        for (i, h) in hs.iter().enumerate() {
            w.dev.fill_page(i as u32, seed(h, w.tp, w.pp)).unwrap();
        }
        w.client.store(&hs, &slots, "").unwrap();
    }
    let prefix: Vec<String> = hs.iter().map(|h| h.to_hex()).collect();
    let share = Hint::Share {
        target: HintTarget::Pages(hs.clone()),
    };
    // Each round (re)sends the share, then looks; `eventually` spaces the rounds.
    let pooled = eventually(Duration::from_secs(60), || {
        let taken = matches!(writers[0].client.hint(share.clone()), Ok(HintOutcome::Accepted { .. }));
        taken && a.admin(&["pages", "--ns", "0", "--prefix", &prefix.join(",")])["complete_prefix"]["pool"] == hs.len()
    });
    assert!(pooled, "A's MLA pages reached the store; log {}", a.log.display());

    // Node B has never seen them: TP rank 1 of each stage finds them and loads rank 0's latents.
    let readers: Vec<Rank> = (0..PP).map(|pp| rank_at(&b.socket, "mla-b", 1, pp)).collect();
    let found = eventually(Duration::from_secs(60), || {
        readers[0]
            .client
            .lookup(&hs)
            .is_ok_and(|h| (h.device, h.host, h.pool) == (0, 0, hs.len()))
    });
    assert!(found, "B found A's MLA pages in the store; log {}", b.log.display());
    for r in &readers {
        let into: Vec<u32> = slots.iter().map(|s| s + 8).collect();
        let n = r.client.load(&hs, &into, LoadWait::Timeout(10_000)).unwrap();
        assert_eq!(n, hs.len(), "pp {}", r.pp);
        for (i, h) in hs.iter().enumerate() {
            assert!(
                r.dev.page_matches(into[i], seed(h, 0, r.pp)).unwrap(),
                "page {i} pp {}",
                r.pp
            );
        }
    }
}
