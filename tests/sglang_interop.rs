//! SGLang 0.5.23's own `MooncakeStore` and kvtier on one real Mooncake Store: SGLang reads
//! the pages kvtier wrote and kvtier loads the pages SGLang wrote, for MHA TP=2, MHA TP=2
//! PP=2 and MLA, every element compared, and SGLang's object keys (built by its real
//! `_tag_keys` / `_batch_preprocess`) equal kvtier's, key by key.
//!
//! The SGLang side is `python/tests/sglang_mooncake_interop.py` in the SGLang venv (which
//! holds the Mooncake wheel, see scripts/engine-venvs.sh): one server per test process
//! imports torch and SGLang once, and each read or write is a fresh process forked from it
//! (its own Mooncake clients and segments, gone when it exits). The kvtier side is a manager
//! with `PoolConfig::Mooncake` whose engine ranks are emulated devices written layer by
//! layer, as an attention kernel writes them. Needs the master from
//! `scripts/mooncake-env.sh` (`KVTIER_MOONCAKE_MASTER`, `KVTIER_MOONCAKE_METADATA`);
//! without it or the SGLang venv the test writes a `SKIPPED` line, or fails in CI.

mod common;
mod pkg_support;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::require::{engine_python, require};
use kvtier::TierKind;
use kvtier::clock::SystemClock;
use kvtier::hints::{Hint, HintOutcome, HintTarget};
use kvtier::layout::{ByteOrder, Layout, LayoutSpec, Part};
use kvtier::manager::LoadWait;
use kvtier::manager::{Manager, ManagerConfig, PoolConfig, RemoteConfig, pool_key_scheme};
use kvtier::page::{Namespace, PageHash};
use kvtier::pool::PoolHealth;
use kvtier::pool::keys::KeyFormat;
use kvtier::pool::mooncake::MooncakeConfig;
use kvtier::tier::device::{EmulatedDevice, pattern};

const LAYERS: u32 = 4;
const HEADS: u32 = 4;
const DIM: u32 = 16;
const LATENT: u32 = 32;
const PAGE: u32 = 4;
const PAGES: usize = 3;

struct Case {
    name: &'static str,
    pp: u16,
    mla: bool,
    order: ByteOrder,
}

impl Case {
    fn layout(&self) -> Layout {
        let spec = if self.mla {
            LayoutSpec::mla(LAYERS, LATENT, 2, PAGE)
        } else {
            LayoutSpec::mha(LAYERS, HEADS, DIM, 2, PAGE)
        };
        spec.with_parallel(2, self.pp)
            .with_byte_order(self.order)
            .build()
            .unwrap()
    }

    /// SGLang's view of the case (argv[2] of the script).
    fn json(&self, model: &str, hashes: &[PageHash]) -> String {
        let hs: Vec<String> = hashes.iter().map(|h| format!("\"{}\"", h.to_hex())).collect();
        format!(
            r#"{{"model":"{model}","layers":{LAYERS},"heads":{HEADS},"dim":{},"page":{PAGE},"tp":2,"pp":{},"mla":{},"hashes":[{}]}}"#,
            if self.mla { LATENT } else { DIM },
            self.pp,
            self.mla,
            hs.join(",")
        )
    }
}

/// The value rule of the script's docstring, as the 16-bit pattern of one element.
fn value(page: usize, part: usize, layer: u32, token: u32, head: u32, dim: u32) -> u16 {
    let x = page as u64 * 1_000_003
        + part as u64 * 100_003
        + layer as u64 * 10_007
        + token as u64 * 1_009
        + head as u64 * 101
        + dim as u64;
    ((x.wrapping_mul(2_654_435_761) >> 13) & 0xffff) as u16
}

/// One layer of one page of rank `(tp, pp)` as the engine keeps it: `[token][head][dim]`.
fn layer_bytes(l: &Layout, page: usize, part: usize, tp: u16, pp: u16, local_layer: u32) -> Vec<u8> {
    let (heads, dim) = match l.rank_parts()[part] {
        Part::Latent => (1, LATENT),
        _ => (l.heads_per_rank(), DIM),
    };
    let head0 = if l.rank_parts()[part] == Part::Latent {
        0
    } else {
        tp as u32 * heads
    };
    let layer = pp as u32 * (LAYERS / l.pp_size() as u32) + local_layer;
    let mut out = Vec::with_capacity((PAGE * heads * dim * 2) as usize);
    for t in 0..PAGE {
        for h in 0..heads {
            for d in 0..dim {
                out.extend_from_slice(&value(page, part, layer, t, head0 + h, d).to_le_bytes());
            }
        }
    }
    out
}

fn ranks(l: &Layout) -> Vec<(u16, u16)> {
    (0..l.pp_size())
        .flat_map(|pp| (0..l.tp_size()).map(move |tp| (tp, pp)))
        .collect()
}

fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{tag}-{nanos:x}")
}

/// SHA-256-sized page hashes, as SGLang's radix cache names pages, fresh for each run so
/// reruns against one master never meet old objects.
fn hashes() -> Vec<PageHash> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    (0..PAGES as u64)
        .map(|i| PageHash::new(&pattern(seed ^ (i << 48), 32)).unwrap())
        .collect()
}

fn manager(dir: &Path, mc: &MooncakeConfig, l: &Layout) -> Manager {
    let mut cfg = ManagerConfig::in_dir(dir, 64 * l.page_bytes(), None);
    cfg.arena.lock = false;
    cfg.pool_key_tag = String::new();
    // SGLang's exact keys: every instance here serves one layout (see `KeyFormat::Sglang`).
    cfg.pool_key_format = KeyFormat::Sglang;
    cfg.remote = Some(RemoteConfig::default());
    cfg.pool = PoolConfig::Mooncake(Box::new(mc.clone()));
    Manager::new(cfg, SystemClock::new()).unwrap()
}

/// Waits for the manager's pool (built with the first namespace) to reach the master.
fn healthy(m: &Manager) {
    let pool = m.stores().pool().expect("a pool");
    let end = Instant::now() + Duration::from_secs(120);
    while pool.health() != PoolHealth::Ok {
        assert!(
            Instant::now() < end,
            "the Mooncake pool never became healthy: {:?}",
            pool.health()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// kvtier's keys for rank `(tp, pp)` in SGLang's order: per page, the rank's objects.
fn kvtier_keys(m: &Manager, ns: &Namespace, l: &Layout, hs: &[PageHash], tp: u16, pp: u16) -> Vec<String> {
    let scheme = pool_key_scheme(m.config(), ns, l);
    let objs = l.rank_objects(tp, pp).unwrap();
    hs.iter()
        .flat_map(|h| {
            objs.iter()
                .map(|&i| scheme.object_key(l, h, l.objects()[i]))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The `KEYS tp pp k...` lines of the script, checked against kvtier's keys.
fn check_keys(out: &[String], m: &Manager, ns: &Namespace, l: &Layout, hs: &[PageHash]) -> usize {
    let mut n = 0;
    for line in out.iter().filter(|s| s.starts_with("KEYS ")) {
        let f: Vec<&str> = line.split(' ').collect();
        let (tp, pp): (u16, u16) = (f[1].parse().unwrap(), f[2].parse().unwrap());
        assert_eq!(f[3..], kvtier_keys(m, ns, l, hs, tp, pp), "rank tp={tp} pp={pp}");
        n += 1;
    }
    n
}

/// The SGLang server (`sglang_mooncake_interop.py serve`): torch and SGLang imported once
/// per test process, a child forked per request. Its stdin is held for the life of the
/// test process: the server exits when it ends, and removes its socket and the socket's
/// directory then. Its own stderr is the test process's.
struct Server {
    socket: PathBuf,
    _stdin: ChildStdin,
    _child: Child,
}

/// How long the server may take to import SGLang, and a request to finish (as each
/// process of SGLang's was given before).
const SGLANG_SECS: u64 = 300;

fn server(py: &Path) -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let socket = tempfile::tempdir().unwrap().keep().join("sglang.sock");
        let var = |k: &str| std::env::var(k).unwrap_or_default();
        let mut child = pkg_support::script(py, "sglang_mooncake_interop.py")
            .arg("serve")
            .arg(&socket)
            .env("MOONCAKE_MASTER", var("KVTIER_MOONCAKE_MASTER"))
            .env("MOONCAKE_TE_META_DATA_SERVER", var("KVTIER_MOONCAKE_METADATA"))
            .env("MOONCAKE_PROTOCOL", "tcp")
            .env("MOONCAKE_DEVICE", "")
            .env("MOONCAKE_GLOBAL_SEGMENT_SIZE", "67108864")
            .env("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the SGLang server");
        let stdin = child.stdin.take().unwrap();
        let rx = lines(child.stdout.take().unwrap());
        match rx.recv_timeout(Duration::from_secs(SGLANG_SECS)) {
            Ok(s) if s == "LISTENING" => {}
            other => {
                let _ = child.kill();
                panic!("the SGLang server did not start ({other:?}); its stderr is above");
            }
        }
        Server {
            socket,
            _stdin: stdin,
            _child: child,
        }
    })
}

/// The lines of `r`, read on a thread of their own.
fn lines(r: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::sync_channel::<String>(256);
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// One request to the SGLang server: a fresh process forked for `mode` on the case.
struct Request {
    conn: UnixStream,
    rx: mpsc::Receiver<String>,
    stderr: PathBuf,
}

/// A request's stderr goes to `<dir>/<mode>.stderr`.
fn sglang(py: &Path, dir: &Path, mode: &str, case_json: &str) -> Request {
    let srv = server(py);
    let stderr = dir.join(format!("{mode}.stderr"));
    let mut conn = UnixStream::connect(&srv.socket).expect("connect to the SGLang server");
    writeln!(conn, "{mode}\t{}\t{case_json}", stderr.display()).unwrap();
    let rx = lines(conn.try_clone().unwrap());
    Request { conn, rx, stderr }
}

impl Request {
    /// The lines up to the first that is `stop` (not included), or every line until the
    /// child's `STATUS` line when `stop` is `None`; panics unless they come within `secs`
    /// and the child exits 0.
    fn until(&self, stop: Option<&str>, secs: u64, seen: &mut Vec<String>) {
        let end = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(s) if Some(s.as_str()) == stop => return,
                Ok(s) if s.starts_with("STATUS ") => {
                    if stop.is_none() && s == "STATUS 0" {
                        return;
                    }
                    self.fail(&format!("exited: {s}"), seen);
                }
                Ok(s) => seen.push(s),
                Err(e) => self.fail(&format!("{e} after {secs} s"), seen),
            }
        }
    }

    fn fail(&self, why: &str, seen: &[String]) -> ! {
        panic!(
            "SGLang's side {why}\nstdout:\n{}\nstderr:\n{}",
            seen.join("\n"),
            std::fs::read_to_string(&self.stderr).unwrap_or_default()
        )
    }
}

/// kvtier writes (store from every rank, Share), SGLang reads every element.
fn kvtier_to_sglang(py: &Path, mc: &MooncakeConfig, case: &Case) {
    let dir = tempfile::tempdir().unwrap();
    let l = case.layout();
    let m = manager(dir.path(), mc, &l);
    let name = Namespace::model(format!("sgl-interop/{}", unique(case.name)));
    let ns = m.register_namespace(name.clone(), l.clone()).unwrap();
    healthy(&m);
    let hs = hashes();
    let slots: Vec<u32> = (0..PAGES as u32).collect();
    for (tp, pp) in ranks(&l) {
        let dev = Arc::new(EmulatedDevice::new(&l, pp, PAGES as u32));
        for p in 0..PAGES {
            for (pi, &part) in l.rank_parts().iter().enumerate() {
                for layer in 0..l.stage_layers(pp) {
                    dev.write_layer(p as u32, part, layer, &layer_bytes(&l, p, pi, tp, pp, layer))
                        .unwrap();
                }
            }
        }
        m.attach_device(ns, tp, pp, dev).unwrap();
        let t = m.store(ns, tp, pp, &hs, &slots, 0).unwrap();
        assert_eq!(m.wait(t, Duration::from_secs(20)).unwrap().pages, PAGES);
    }
    let hint = Hint::Share {
        target: HintTarget::Prefix(hs.clone()),
    };
    assert_eq!(m.hint(ns, hint).unwrap(), HintOutcome::Accepted { pages: PAGES });
    assert!(m.quiesce(Duration::from_secs(30)));
    let in_pool = |h: &PageHash| {
        m.page_status(ns, h)
            .unwrap()
            .is_some_and(|s| s.tiers[TierKind::Pool.index()].complete)
    };
    assert!(hs.iter().all(in_pool), "every shared page is pool-complete");
    let mut lines = Vec::new();
    sglang(py, dir.path(), "read", &case.json(&name.model, &hs)).until(None, SGLANG_SECS, &mut lines);
    let out = lines.join("\n");
    let want_ranks = if case.mla {
        l.pp_size() as usize
    } else {
        ranks(&l).len()
    };
    assert_eq!(check_keys(&lines, &m, &name, &l, &hs), want_ranks, "{out}");
    let per_rank = if case.mla { LATENT } else { HEADS * DIM } * PAGE * LAYERS / l.pp_size() as u32;
    let want = format!(
        "OK read done, {} elements compared",
        per_rank as usize * PAGES * want_ranks
    );
    assert!(
        lines.contains(&want),
        "{case:?}: want {want:?} in\n{out}",
        case = case.name
    );
}

/// SGLang writes (every rank, `batch_set_v1`); a fresh kvtier finds the pages in the store
/// and loads every element into each rank's device.
fn sglang_to_kvtier(py: &Path, mc: &MooncakeConfig, case: &Case) {
    let dir = tempfile::tempdir().unwrap();
    let l = case.layout();
    let name = Namespace::model(format!("sgl-interop/{}", unique(case.name)));
    let hs = hashes();
    let mut writer = sglang(py, dir.path(), "write", &case.json(&name.model, &hs));
    let mut lines = Vec::new();
    writer.until(Some("READY"), SGLANG_SECS, &mut lines);
    let m = manager(dir.path(), mc, &l);
    let ns = m.register_namespace(name.clone(), l.clone()).unwrap();
    healthy(&m);
    let want_ranks = if case.mla {
        l.pp_size() as usize
    } else {
        ranks(&l).len()
    };
    assert_eq!(check_keys(&lines, &m, &name, &l, &hs), want_ranks, "{lines:?}");
    assert_eq!(m.lookup(ns, &hs).unwrap().pool, PAGES, "SGLang's pages are pool hits");
    let slots: Vec<u32> = (0..PAGES as u32).rev().collect();
    let mut elements = 0;
    // MLA: kvtier moves the shared latent through TP rank 0 of each stage only (the other
    // ranks own no objects, `Layout::rank_objects`), as SGLang reads it through tp=0 here.
    let movers: Vec<(u16, u16)> = ranks(&l)
        .into_iter()
        .filter(|&(tp, pp)| !l.rank_objects(tp, pp).unwrap().is_empty())
        .collect();
    assert_eq!(movers.len(), want_ranks);
    for &(tp, pp) in &movers {
        let dev = Arc::new(EmulatedDevice::new(&l, pp, PAGES as u32));
        m.attach_device(ns, tp, pp, dev.clone()).unwrap();
        let t = m.load(ns, tp, pp, &hs, &slots, LoadWait::WaitComplete).unwrap();
        assert_eq!(
            m.wait(t, Duration::from_secs(30)).unwrap().pages,
            PAGES,
            "rank tp={tp} pp={pp}"
        );
        for (p, &slot) in slots.iter().enumerate() {
            for (pi, &part) in l.rank_parts().iter().enumerate() {
                for layer in 0..l.stage_layers(pp) {
                    let got = dev.read_layer(slot, part, layer).unwrap();
                    let want = layer_bytes(&l, p, pi, tp, pp, layer);
                    let bad = got.chunks(2).zip(want.chunks(2)).filter(|(a, b)| a != b).count();
                    assert_eq!(
                        bad, 0,
                        "{} rank tp={tp} pp={pp} page {p} part {pi} layer {layer}",
                        case.name
                    );
                    elements += got.len() / 2;
                }
            }
        }
    }
    let per_rank = if case.mla { LATENT } else { HEADS * DIM } * PAGE * LAYERS / l.pp_size() as u32;
    assert_eq!(elements, per_rank as usize * PAGES * movers.len());
    writeln!(writer.conn, "done").unwrap();
    writer.until(None, 60, &mut lines);
}

fn setup() -> Option<(std::path::PathBuf, MooncakeConfig)> {
    let py = engine_python(
        "sglang",
        &["sglang", "torch", "mooncake.store"],
        "runs SGLang's MooncakeStore against kvtier's pages",
    )?;
    if !require("mooncake", "needs a running mooncake_master") {
        return None;
    }
    let mc = MooncakeConfig::from_env().expect("KVTIER_MOONCAKE_MASTER is set (checked above)");
    Some((py, mc.with_segment_bytes(64 << 20)))
}

/// One case at a time: each runs a manager and up to four SGLang stores on the master.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn both_ways(case: Case) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some((py, mc)) = setup() else { return };
    kvtier_to_sglang(&py, &mc, &case);
    sglang_to_kvtier(&py, &mc, &case);
}

#[test]
fn mha_tp2_page_first_round_trips_with_sglang() {
    both_ways(Case {
        name: "mha-tp2",
        pp: 1,
        mla: false,
        order: ByteOrder::PageFirst,
    });
}

#[test]
fn mha_tp2_pp2_page_first_round_trips_with_sglang() {
    both_ways(Case {
        name: "mha-tp2-pp2",
        pp: 2,
        mla: false,
        order: ByteOrder::PageFirst,
    });
}

#[test]
fn mla_page_first_round_trips_with_sglang() {
    both_ways(Case {
        name: "mla",
        pp: 1,
        mla: true,
        order: ByteOrder::PageFirst,
    });
}

/// A layer-first engine (the GPU's own order) still gives SGLang page-first bytes: kvtier
/// transposes on the way to and from the pool.
#[test]
fn mha_tp2_pp2_layer_first_round_trips_with_sglang() {
    both_ways(Case {
        name: "mha-tp2-pp2-lf",
        pp: 2,
        mla: false,
        order: ByteOrder::LayerFirst,
    });
}

#[test]
fn mla_layer_first_round_trips_with_sglang() {
    both_ways(Case {
        name: "mla-lf",
        pp: 1,
        mla: true,
        order: ByteOrder::LayerFirst,
    });
}
