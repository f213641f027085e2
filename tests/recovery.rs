//! Issue 15's recovery cases, through real `kvtier serve` processes: a set slot size is
//! configuration (never the first connector's layout), the default one fits the first
//! layout and is kept across restarts (issue 24), `arena_bytes` holds across a
//! restart and a truncated arena is detected, and the manifest is read record by record
//! with each discard counted in `/metrics`.

mod common;
#[path = "recovery/fence.rs"]
mod fence;
#[path = "security/serve.rs"]
mod serve;

use std::sync::Arc;

use common::{hashes, seed, small_spec};
use kvtier::client::ClientError;
use kvtier::layout::LayoutSpec;
use kvtier::page::PageHash;
use kvtier::protocol::{ErrorCode, LoadWait};
use kvtier::tier::device::EmulatedDevice;
use serve::*;

#[test]
fn slot_size_is_configuration_not_the_first_layouts() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let base = ["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "4194304"];
    let tiny = small_spec();
    let fits = LayoutSpec::mha(8, 4, 16, 2, 4);
    let big = LayoutSpec::mha(16, 4, 16, 2, 4);
    let size = |l: &LayoutSpec| l.clone().build().unwrap().max_object_bytes();
    assert_eq!((size(&tiny), size(&fits), size(&big)), (128, 4096, 8192));

    let mut d = serve(dir.path(), "s", &[&base[..], &["--set", "slot_bytes=4096"]].concat()).ready();
    // The tiny layout connects first; it does not decide the slot size.
    let c = d.client("tiny", tiny.clone()).unwrap();
    assert_eq!(c.arena().unwrap().slot_bytes, 4096);
    let f = d.client("fits", fits.clone()).unwrap();
    let hs = hashes(900, 8);
    store(&f, &fits, &hs, 9);
    assert_eq!(load_verified(&f, &fits, &hs, 9), 8);
    match d.client("big", big.clone()) {
        Err(ClientError::Remote(e)) => {
            assert_eq!(e.code, ErrorCode::BadLayout);
            assert!(
                e.message.contains("8192") && e.message.contains("4096"),
                "{}",
                e.message
            );
        }
        other => panic!("a layout over the slot size must be refused: {:?}", other.err()),
    }
    drop((c, f));
    d.stop(libc::SIGTERM);
    // A restart with a larger configured size serves the larger layout.
    let d = serve(dir.path(), "s", &[&base[..], &["--set", "slot_bytes=8192"]].concat()).ready();
    let b = d.client("big", big.clone()).unwrap();
    assert_eq!(b.arena().unwrap().slot_bytes, 8192);
    store(&b, &big, &hs, 10);
    assert_eq!(load_verified(&b, &big, &hs, 10), 8);
    assert!(d.log().contains("differs from the arena's"), "{}", d.log());
}

/// Issue 15 item 4: a tiny layout that connects first (a test, a draft model) sized
/// every slot (128 bytes here), and a real model was refused with `bad_layout`, even
/// after a clean restart. Since slots fit the first layout by default (issue 24), a node
/// that mixes geometries sets `host.slot_bytes`: with it set to 2 MiB, a 512 KiB-object
/// layout stores and loads its exact bytes after the tiny one, and again after a restart.
#[test]
fn a_tiny_first_layout_does_not_lock_out_a_real_model_when_the_slot_size_is_set() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    // 32 MiB: 16 slots of 2 MiB.
    let args = [
        "--arena-path",
        arena.to_str().unwrap(),
        "--arena-bytes",
        "33554432",
        "--set",
        "host.slot_bytes=2097152",
    ];
    let tiny = small_spec();
    let real = LayoutSpec::mha(32, 8, 128, 2, 8);
    let size = |l: &LayoutSpec| l.clone().build().unwrap().max_object_bytes();
    assert_eq!((size(&tiny), size(&real)), (128, 512 << 10));

    let mut d = serve_default_slots(dir.path(), "t", &args).ready();
    assert!(
        d.banner()
            .contains("32 MiB in 16 slots of 2097152 bytes (host.slot_bytes)"),
        "the banner says the slot size before anyone connects: {}",
        d.banner()
    );
    let t = d.client("tiny", tiny.clone()).unwrap();
    assert_eq!(
        t.arena().unwrap().slot_bytes,
        2 << 20,
        "the first connector sized nothing"
    );
    let ths = hashes(7000, 2);
    store(&t, &tiny, &ths, 1);
    let r = d.client("real", real.clone()).unwrap();
    let rhs = hashes(8000, 4);
    store(&r, &real, &rhs, 2);
    assert_eq!(load_verified(&r, &real, &rhs, 2), 4, "every real page, byte for byte");
    assert_eq!(load_verified(&t, &tiny, &ths, 1), 2);
    let status = d.admin_get("/v1/status");
    assert!(
        status.contains("\"slot_bytes\":2097152") && status.contains("\"used_slots\":12"),
        "status says the slot size and the 12 slots taken (2 + 4 pages of K and V): {status}"
    );
    drop((t, r));
    d.stop(libc::SIGTERM);

    // A clean restart keeps the configured size: the tiny layout connects first again,
    // the real pages come back intact, and the real layout stores more.
    let d = serve_default_slots(dir.path(), "t", &args).ready();
    let t = d.client("tiny", tiny.clone()).unwrap();
    assert_eq!(load_verified(&t, &tiny, &ths, 1), 2);
    let r = d.client("real", real.clone()).unwrap();
    assert_eq!(r.stats().unwrap().recovered_pages, 6);
    assert_eq!(
        load_verified(&r, &real, &rhs, 2),
        4,
        "recovered real pages, byte for byte"
    );
    let more = hashes(9000, 2);
    store(&r, &real, &more, 3);
    assert_eq!(load_verified(&r, &real, &more, 3), 2);
}

#[test]
fn arena_bytes_is_honoured_on_recovery_and_a_truncated_arena_is_detected() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let start = |bytes: u64| {
        let b = bytes.to_string();
        serve(
            dir.path(),
            "r",
            &[
                "--arena-path",
                arena.to_str().unwrap(),
                "--arena-bytes",
                &b,
                "--set",
                "slot_bytes=65536",
            ],
        )
        .ready()
    };
    // 2 MiB: 32 slots of 64 KiB; 15 pages of two objects fill 30, below the watermark.
    let mut d = start(2 << 20);
    let c = d.client("r", small_spec()).unwrap();
    let hs = hashes(40, 15);
    store(&c, &small_spec(), &hs, 5);
    d.stop(libc::SIGKILL);

    // Restarted at 1 MiB: the old 2 MiB file is not adopted as it is.
    let mut d = start(1 << 20);
    assert_eq!(std::fs::metadata(&arena).unwrap().len(), 1 << 20);
    let s = c.stats().unwrap();
    assert_eq!(
        s.arena_slots, 16,
        "the banner and the arena agree on the configured size"
    );
    assert!(
        d.banner().contains("1 MiB in 16 slots of 65536 bytes"),
        "{}",
        d.banner()
    );
    // Pages take slots from 0 up, two a page: the first 8 pages fit, 7 were cut off.
    assert_eq!((s.recovered_pages, s.discarded_pages), (8, 7));
    assert_eq!(c.lookup(&hs).unwrap().host, 8);
    assert_eq!(load_verified(&c, &small_spec(), &hs, 5), 8);
    d.stop(libc::SIGKILL);

    // Truncated behind the daemon's back to 8 slots: detected, not served as zeros.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&arena)
        .unwrap()
        .set_len(512 << 10)
        .unwrap();
    let _d = start(1 << 20);
    assert_eq!(std::fs::metadata(&arena).unwrap().len(), 1 << 20);
    let s = c.stats().unwrap();
    assert_eq!((s.arena_slots, s.recovered_pages, s.discarded_pages), (16, 4, 4));
    assert_eq!(load_verified(&c, &small_spec(), &hs, 5), 4);
    assert!(_d.log().contains("did not have the configured size"), "{}", _d.log());
}

/// The object records of a `KVTMANI2` manifest: (offset of the body, body length).
fn object_records(bytes: &[u8]) -> Vec<(usize, usize)> {
    assert_eq!(&bytes[..8], b"KVTMANI2");
    let mut at = 16;
    let mut out = Vec::new();
    while at + 16 <= bytes.len() {
        assert_eq!(&bytes[at..at + 4], b"KVR2");
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        if bytes[at + 16] == 2 {
            out.push((at + 16, len));
        }
        at += 16 + len;
    }
    out
}

#[test]
fn a_bad_manifest_record_costs_that_record_only_and_garbage_is_reported() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let manifest = dir.path().join("state/arena.manifest");
    let start = || {
        serve(
            dir.path(),
            "m",
            &["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "4194304"],
        )
        .ready()
    };
    let mut d = start();
    let c = d.client("m", small_spec()).unwrap();
    let hs = hashes(3000, 40);
    store(&c, &small_spec(), &hs, 7);
    d.stop(libc::SIGTERM); // compacts: one record per object

    let mut bytes = std::fs::read(&manifest).unwrap();
    let objects = object_records(&bytes);
    assert_eq!(objects.len(), 80, "40 pages of two objects");
    let (body, len) = objects[21];
    bytes[body + len - 1] ^= 0x5a; // a record in the middle, its checksum no longer holds
    std::fs::write(&manifest, &bytes).unwrap();

    let mut d = start();
    let s = c.stats().unwrap();
    assert_eq!(
        (s.recovered_pages, s.discarded_pages),
        (39, 1),
        "one bad record costs one page"
    );
    let on_host: Vec<&PageHash> = hs.iter().filter(|h| c.lookup(&[**h]).unwrap().host == 1).collect();
    assert_eq!(on_host.len(), 39);
    for h in on_host {
        assert_eq!(load_verified(&c, &small_spec(), &[*h], 7), 1);
    }
    assert!(d.log().contains("manifest records failed their checks"), "{}", d.log());
    let metrics = d.admin_get("/metrics");
    assert!(
        metrics.contains("kvtier_recovery_total{reason=\"bad_manifest_record\"} 1")
            && metrics.contains("kvtier_recovery_total{reason=\"recovered\"} 39")
            && metrics.contains("kvtier_recovery_total{reason=\"incomplete\"} 1"),
        "{metrics}"
    );
    d.stop(libc::SIGTERM);

    // A manifest that is not one at all is reported, not taken for an empty one.
    std::fs::write(&manifest, vec![0xa5u8; 4096]).unwrap();
    let d = start();
    assert_eq!(c.stats().unwrap().recovered_pages, 0);
    assert!(d.log().contains("not a kvtier manifest"), "{}", d.log());
    assert!(d.banner().contains("manifest unreadable"), "{}", d.banner());
    let metrics = d.admin_get("/metrics");
    assert!(
        metrics.contains("kvtier_recovery_total{reason=\"garbage_manifest\"} 1"),
        "{metrics}"
    );
}

/// `/v1/status` from the daemon's admin socket, and what `kvtier status` prints.
fn status(d: &Serve) -> (serde_json::Value, String) {
    let admin = d.socket.with_extension("admin.sock");
    let r = kvtier::cli::client::request(
        &admin,
        "GET",
        "/v1/status",
        None,
        Some(std::time::Duration::from_secs(10)),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.body().unwrap()).unwrap();
    let out = std::process::Command::new(common::kvtier_bin())
        .args(["status", "--socket", admin.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    (v, String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Arena bytes per stored page, from `/v1/status` on the daemon's admin socket, and the
/// ratio the daemon itself reports, with `kvtier status` printing the same figure.
fn arena_per_page(d: &Serve) -> (f64, f64, String) {
    let (v, text) = status(d);
    let a = &v["host_arena"];
    (
        a["bytes_per_stored_page"].as_f64().unwrap(),
        a["overhead"].as_f64().unwrap(),
        text,
    )
}

/// One model's row of `host_arena.models` in `/v1/status`: (arena bytes per page, its
/// page's own bytes, their ratio).
fn model_row(v: &serde_json::Value, model: &str) -> (u64, u64, f64) {
    let rows = v["host_arena"]["models"].as_array().expect("host_arena.models");
    let m = rows
        .iter()
        .find(|m| m["model"] == model)
        .unwrap_or_else(|| panic!("no row for {model}: {rows:?}"));
    (
        m["arena_bytes_per_page"].as_u64().unwrap(),
        m["page_bytes"].as_u64().unwrap(),
        m["overhead"].as_f64().unwrap(),
    )
}

/// The geometry of the model the vLLM CPU engine tests serve (tests/engines_vllm_cpu.rs):
/// 8 layers, 4 KV heads, head_dim 64, bf16, 32-token blocks: 128 KiB objects.
fn vllm_cpu_test_model() -> LayoutSpec {
    LayoutSpec::mha(8, 4, 64, 2, 32)
}

/// Llama-3-8B's geometry: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token pages,
/// TP 1: 1 MiB objects, which 2 MiB slots held at twice their size.
fn llama3_8b() -> LayoutSpec {
    LayoutSpec::mha(32, 8, 128, 2, 16)
}

/// Issue 24 item 5: by default (no `host.slot_bytes` set) the arena is cut into slots of
/// the first engine's objects, so the host memory a stored page takes is within a tenth
/// of the page's own bytes, for the vLLM CPU tests' model and for Llama-3-8B's geometry.
/// The figure is read through the daemon's admin socket (`/v1/status` and `kvtier
/// status`); the pages load byte for byte, and again after a restart, which reopens the
/// arena with the fitted size from the manifest.
#[test]
fn slots_fit_the_first_engine_by_default_so_arena_bytes_per_page_stay_within_a_tenth() {
    for (name, spec, object, arena_bytes) in [
        ("vllm-cpu-test-model", vllm_cpu_test_model(), 128u64 << 10, 4u64 << 20),
        ("llama3-8b", llama3_8b(), 1 << 20, 40 << 20),
    ] {
        let page = spec.clone().build().unwrap().page_bytes();
        assert_eq!(page, 2 * object, "{name}");
        let dir = tempdir();
        let arena = dir.path().join("state/arena");
        let bytes = arena_bytes.to_string();
        let args = ["--arena-path", arena.to_str().unwrap(), "--arena-bytes", &bytes];
        let mut d = serve_default_slots(dir.path(), name, &args).ready();
        assert!(
            d.banner()
                .contains("slots fitted to the first engine's objects (host.slot_bytes = 0, the default)"),
            "{}",
            d.banner()
        );
        let c = d.client(name, spec.clone()).unwrap();
        assert_eq!(c.arena().unwrap().slot_bytes, object, "{name}: one object per slot");
        let hs = hashes(4000, 8);
        store(&c, &spec, &hs, 5);
        let (per_page, overhead, text) = arena_per_page(&d);
        eprintln!(
            "{name}: {per_page} arena bytes per stored page, page {page} bytes, {overhead:.4}x (status: {})",
            text.lines().find(|l| l.starts_with("host arena")).unwrap_or("")
        );
        assert!(per_page <= 1.1 * page as f64, "{name}: {per_page} > 1.1 x {page}");
        assert!((overhead - per_page / page as f64).abs() < 1e-9, "{overhead}");
        assert!(
            text.contains("8 pages stored") && text.contains(&format!("{per_page:.0} arena bytes per page")),
            "{text}"
        );
        let (v, text) = status(&d);
        assert_eq!(model_row(&v, name), (page, page, 1.0), "{name}");
        assert!(
            text.contains(&format!(
                "model \"{name}\": {page} arena bytes per page, 1.000x its own {page}"
            )),
            "{text}"
        );
        assert_eq!(load_verified(&c, &spec, &hs, 5), 8, "{name}: every page, byte for byte");
        drop(c);
        d.stop(libc::SIGTERM);

        // The restart reopens the arena with the manifest's fitted slots, pages intact.
        let d = serve_default_slots(dir.path(), name, &args).ready();
        let slots = arena_bytes / object;
        assert!(
            d.banner()
                .contains(&format!("in {slots} slots of {object} bytes (host.slot_bytes)")),
            "{}",
            d.banner()
        );
        let c = d.client(name, spec.clone()).unwrap();
        assert_eq!(load_verified(&c, &spec, &hs, 5), 8, "{name}: recovered, byte for byte");
        let (per_page, _, _) = arena_per_page(&d);
        assert!(per_page <= 1.1 * page as f64, "{name} after the restart: {per_page}");
    }
}

/// Issue 24 item 5's rule for mixed models on the default (fitted) slots: after the
/// vLLM CPU test model fitted them (128 KiB), Llama-3-8B's 1 MiB objects are refused at
/// `Connect` with `bad_layout`, naming both sizes and `host.slot_bytes`, and the daemon
/// keeps serving the first model; a smaller model is served in the larger slots, and
/// status shows its waste. A restart keeps the fitted size: the larger model is still
/// refused, every page comes back.
#[test]
fn with_fitted_slots_a_larger_model_is_refused_by_name_and_a_smaller_one_shows_its_waste() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    // 8 MiB: 64 slots of 128 KiB.
    let args = ["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "8388608"];
    let (first, large, small) = (vllm_cpu_test_model(), llama3_8b(), LayoutSpec::mha(4, 2, 64, 2, 16));
    let size = |l: &LayoutSpec| l.clone().build().unwrap().max_object_bytes();
    assert_eq!(
        (size(&first), size(&large), size(&small)),
        (128 << 10, 1 << 20, 16 << 10)
    );
    let refused = |d: &Serve| match d.client("large", large.clone()) {
        Err(ClientError::Remote(e)) => {
            assert_eq!(e.code, ErrorCode::BadLayout, "{}", e.message);
            for part in [
                "objects of 1048576 bytes",
                "131072-byte slots",
                "host.slot_bytes",
                "first layout",
            ] {
                assert!(e.message.contains(part), "{part:?} in {}", e.message);
            }
        }
        other => panic!("a layout over the fitted slots must be refused: {:?}", other.err()),
    };

    let mut d = serve_default_slots(dir.path(), "mixed", &args).ready();
    let f = d.client("first", first.clone()).unwrap();
    assert_eq!(f.arena().unwrap().slot_bytes, 128 << 10);
    let fhs = hashes(100, 4);
    store(&f, &first, &fhs, 1);
    refused(&d);
    assert_eq!(load_verified(&f, &first, &fhs, 1), 4, "the first model is still served");
    let s = d.client("small", small.clone()).unwrap();
    assert_eq!(
        s.arena().unwrap().slot_bytes,
        128 << 10,
        "the smaller model shares the slots"
    );
    let shs = hashes(200, 4);
    store(&s, &small, &shs, 2);
    assert_eq!(
        load_verified(&s, &small, &shs, 2),
        4,
        "the smaller model, byte for byte"
    );
    let (v, text) = status(&d);
    assert_eq!(model_row(&v, "first"), (256 << 10, 256 << 10, 1.0));
    assert_eq!(model_row(&v, "small"), (256 << 10, 32 << 10, 8.0), "the waste, shown");
    assert!(
        text.contains("model \"small\": 262144 arena bytes per page, 8.000x its own 32768"),
        "{text}"
    );
    assert!(
        v["host_arena"]["page_bytes"].is_null(),
        "two page sizes: no single figure"
    );
    drop((f, s));
    d.stop(libc::SIGTERM);

    let d = serve_default_slots(dir.path(), "mixed", &args).ready();
    assert!(d.banner().contains("in 64 slots of 131072 bytes"), "{}", d.banner());
    refused(&d);
    let f = d.client("first", first.clone()).unwrap();
    assert_eq!(load_verified(&f, &first, &fhs, 1), 4, "recovered, byte for byte");
    let s = d.client("small", small.clone()).unwrap();
    assert_eq!(load_verified(&s, &small, &shs, 2), 4, "recovered, byte for byte");
}

/// Issue 28 item 3: pages that the host arena pushed into the local pool survive a
/// restart. 1,000 pages go through an arena of 32 pages into the local pool; after a
/// SIGKILL, and again after a SIGTERM, every one of them loads with the bytes stored.
#[test]
fn a_thousand_pages_in_the_local_pool_survive_sigkill_and_sigterm() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    // 64 slots of 2 KiB: 32 pages of K and V on host; 8 MiB of pool: 4,096 slots.
    let args = [
        "--arena-path",
        arena.to_str().unwrap(),
        "--arena-bytes",
        "131072",
        "--set",
        "pool_bytes=8388608",
    ];
    let layout = small_spec();
    let hs = hashes(50_000, 1000);
    let mut d = serve(dir.path(), "p", &args).ready();
    let c = d.client("pooled", layout.clone()).unwrap();
    for chunk in hs.chunks(20) {
        store(&c, &layout, chunk, 77);
        c.removed(chunk).unwrap();
    }
    let on_host = c.stats().unwrap().host_complete_pages;
    assert!(on_host <= 32, "the arena holds at most 32 pages: {on_host}");
    drop(c);
    let load_all = |d: &Serve, life: &str| {
        let c = d.client("pooled", layout.clone()).unwrap();
        let built = layout.clone().build().unwrap();
        let dev = Arc::new(EmulatedDevice::new(&built, 0, 20));
        c.register_device(dev.clone()).unwrap();
        let slots: Vec<u32> = (0..20).collect();
        let mut loaded = 0;
        for chunk in hs.chunks(20) {
            let n = c.load(chunk, &slots, LoadWait::Timeout(10_000)).unwrap();
            assert_eq!(n, chunk.len(), "{life}: every page of the chunk loads: {}", d.log());
            for (i, h) in chunk.iter().enumerate() {
                assert!(
                    dev.page_matches(i as u32, seed(h, 0, 0) ^ 77).unwrap(),
                    "{life}: page {} loaded with wrong bytes",
                    h.to_hex()
                );
            }
            c.removed(chunk).unwrap();
            loaded += n;
        }
        loaded
    };
    d.stop(libc::SIGKILL);
    let mut d = serve(dir.path(), "p", &args).ready();
    assert_eq!(load_all(&d, "after SIGKILL"), 1000);
    assert!(
        d.log().contains("local pool objects booked after a restart"),
        "{}",
        d.log()
    );
    d.stop(libc::SIGTERM);
    let d = serve(dir.path(), "p", &args).ready();
    assert_eq!(load_all(&d, "after SIGTERM"), 1000);
}

/// Issue 27 break 6: an engine's copy was in flight when the daemon died. The restarted
/// daemon reopens the same arena file; the slots of that store grant stay quarantined
/// (`host.fence_timeout_ms`), so another page stored after the restart never gets them,
/// and the late copy landing in them afterwards changes no byte anyone loads.
#[test]
fn a_copy_that_lands_after_a_restart_never_becomes_another_pages_bytes() {
    use kvtier::tier::host::{ArenaOptions, HostArena, SlotId};
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    // 64 slots of 2 KiB.
    let args = [
        "--arena-path",
        arena.to_str().unwrap(),
        "--arena-bytes",
        "131072",
        "--set",
        "host.fence_timeout_ms=600000",
    ];
    let layout = small_spec();
    let mut d = serve(dir.path(), "f", &args).ready();
    let a = d.client("fenced", layout.clone()).unwrap();
    let kept = hashes(70_000, 2);
    store(&a, &layout, &kept, 5);
    // Engine A's store is granted; its copy has not landed when the daemon dies.
    let plan = a.begin_store(&hashes(71_000, 4), "").unwrap();
    let granted: Vec<u32> = plan.pages.iter().flat_map(|p| p.slots.iter().map(|s| s.slot)).collect();
    assert_eq!(granted.len(), 8);
    d.stop(libc::SIGKILL);

    let d = serve(dir.path(), "f", &args).ready();
    let b = d.client("fenced", layout.clone()).unwrap();
    assert_eq!(b.stats().unwrap().recovered_pages, 2);
    let other = hashes(72_000, 20);
    store(&b, &layout, &other, 9);
    // The late copy lands, through a mapping of the same file (as A's own is).
    let late = HostArena::open(
        &arena,
        2048,
        &ArenaOptions {
            lock: false,
            prefault: false,
            touch_threads: 1,
            group: None,
        },
    )
    .unwrap();
    for &s in &granted {
        // SAFETY: the test plays the engine whose grant named these slots.
        unsafe { late.slot_mut(SlotId(s), 128).unwrap() }.fill(0xee);
    }
    assert_eq!(load_verified(&b, &layout, &other, 9), 20, "0 wrong bytes");
    assert_eq!(load_verified(&b, &layout, &kept, 5), 2);
    assert!(d.log().contains("quarantined until the fence timeout"), "{}", d.log());
    // The admin socket reports the 8 quarantined slots and the manifest's upkeep.
    let (keep, status) = host_keep(&d);
    assert_eq!(keep["fenced_slots"], 8, "{keep}");
    assert!(keep["manifest_live_records"].as_u64().unwrap() >= 22, "{keep}");
    assert!(keep["manifest_bytes"].as_u64().unwrap() > 0, "{keep}");
    assert!(status.contains("8 fenced slots"), "{status}");
    let metrics = d.admin_get("/metrics");
    assert!(metrics.contains("\nkvtier_host_fenced_slots 8\n"), "{metrics}");
    assert!(metrics.contains("\nkvtier_manifest_compactions_total "), "{metrics}");
    drop(a);
    drop(b);
    // The marks outlive another SIGKILL; a restart with a short timeout quarantines the
    // same 8 slots and frees them once it has passed.
    let mut d = d;
    d.stop(libc::SIGKILL);
    let mut short = args;
    short[5] = "host.fence_timeout_ms=300";
    let d = serve(dir.path(), "f", &short).ready();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut seen = Vec::new();
    loop {
        let (keep, _) = host_keep(&d);
        seen.push(keep["fenced_slots"].as_u64().unwrap());
        if seen.last() == Some(&0) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still fenced: {seen:?}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let log = d.log();
    assert!(
        log.contains("quarantined until the fence timeout") && log.contains("fence timeout passed"),
        "{log}"
    );
    let metrics = d.admin_get("/metrics");
    assert!(metrics.contains("\nkvtier_host_fenced_slots 0\n"), "{metrics}");
}

/// `host_keep` from `/v1/status` on the daemon's admin socket, and `kvtier status`'s text.
fn host_keep(d: &Serve) -> (serde_json::Value, String) {
    let admin = d.socket.with_extension("admin.sock");
    let r = kvtier::cli::client::request(
        &admin,
        "GET",
        "/v1/status",
        None,
        Some(std::time::Duration::from_secs(10)),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.body().unwrap()).unwrap();
    let out = std::process::Command::new(common::kvtier_bin())
        .args(["status", "--socket", admin.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    (
        v["host_keep"].clone(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Issue 28 item 4, through the daemon: 2,000 pages stored through an arena of 32 pages
/// (every store evicts, every eviction appends release records) keep the manifest under
/// twice its live records plus 64 KiB, where the log alone would pass 300 KB; a SIGKILL
/// then recovers exactly the pages on host.
#[test]
fn the_manifest_stays_bounded_while_the_daemon_stores_and_evicts() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let args = ["--arena-path", arena.to_str().unwrap(), "--arena-bytes", "131072"];
    let layout = small_spec();
    let manifest = dir.path().join("state/arena.manifest");
    let mut d = serve(dir.path(), "m", &args).ready();
    let c = d.client("bounded", layout.clone()).unwrap();
    let hs = hashes(90_000, 2000);
    let mut largest = 0;
    for chunk in hs.chunks(20) {
        store(&c, &layout, chunk, 3);
        c.removed(chunk).unwrap();
        largest = largest.max(std::fs::metadata(&manifest).unwrap().len());
    }
    // 64 live object records of about 50 bytes: 2 x 3.2 KB + 64 KiB, and one store's records.
    assert!(largest < 96 << 10, "the manifest reached {largest} bytes");
    // The admin socket shows the compactions that kept it there.
    let (keep, status) = host_keep(&d);
    assert!(keep["manifest_compactions"].as_u64().unwrap() >= 1, "{keep}");
    assert!(keep["manifest_bytes"].as_u64().unwrap() < 96 << 10, "{keep}");
    assert!(status.contains("host keep  manifest "), "{status}");
    let last = &hs[hs.len() - 20..];
    assert_eq!(load_verified(&c, &layout, last, 3), 20);
    let on_host = c.stats().unwrap().host_complete_pages;
    drop(c);
    d.stop(libc::SIGKILL);
    let d = serve(dir.path(), "m", &args).ready();
    let c = d.client("bounded", layout.clone()).unwrap();
    assert_eq!(c.stats().unwrap().recovered_pages, on_host);
    assert_eq!(load_verified(&c, &layout, last, 3), 20);
}

/// Issue 28 item 7: a killed daemon's arena under `/dev/shm` is reclaimed by the next
/// daemon that starts once the killed one's runtime directory is gone, and logged; the
/// arena of a daemon whose runtime directory still exists is kept.
#[test]
fn an_orphaned_arena_is_reclaimed_at_start_once_its_runtime_dir_is_gone() {
    use kvtier::daemon::orphans::{MARKER, dir_name};
    // SAFETY: geteuid has no preconditions.
    let base = std::path::PathBuf::from(format!("/dev/shm/kvtier-{}", unsafe { libc::geteuid() }));
    let (gone_rt, kept_rt, next_rt) = (tempdir(), tempdir(), tempdir());
    let arena_of = |rt: &tempfile::TempDir| base.join(dir_name(rt.path()));
    let (gone, kept, next) = (arena_of(&gone_rt), arena_of(&kept_rt), arena_of(&next_rt));
    // The default arena path (no --arena-path), 1 MiB, untouched.
    let args = ["--set", "host.bytes=1048576"];
    let mut a = serve(gone_rt.path(), "a", &args).ready();
    let mut b = serve(kept_rt.path(), "b", &args).ready();
    for (dir, rt) in [(&gone, &gone_rt), (&kept, &kept_rt)] {
        let marker = std::fs::read_to_string(dir.join(MARKER)).unwrap();
        assert_eq!(
            std::path::Path::new(&marker),
            rt.path(),
            "the marker names the runtime dir"
        );
        assert!(dir.join("arena").exists());
    }
    a.stop(libc::SIGKILL);
    b.stop(libc::SIGKILL);
    drop(gone_rt);
    let mut c = serve(next_rt.path(), "c", &args).ready();
    assert!(!gone.exists(), "the orphan's arena directory is reclaimed: {}", c.log());
    assert!(kept.join("arena").exists(), "a runtime dir that exists keeps its arena");
    assert!(
        c.log()
            .contains("reclaimed the arena of a daemon whose runtime directory is gone"),
        "{}",
        c.log()
    );
    c.stop(libc::SIGTERM);
    for d in [&kept, &next] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Issue 28 item 3: while the daemon rebuilds its index at start (made slow here with the
/// test-only `host.test_open_delay_ms`), its socket is already bound and every connection
/// gets the typed `recovering` error, never "connection refused"; a client whose timeout
/// ends first fails with `ClientError::Recovering`, and one that waits longer connects as
/// soon as the index is rebuilt.
#[test]
fn a_client_during_a_slow_recovery_gets_recovering_then_connects() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let args = [
        "--arena-path",
        arena.to_str().unwrap(),
        "--arena-bytes",
        "4194304",
        "--set",
        "host.test_open_delay_ms=6000",
    ];
    let d = serve(dir.path(), "r", &args);
    // The socket is bound before the slow recovery: a connection is accepted, never refused.
    let t = std::time::Instant::now();
    let mut raw = loop {
        match std::os::unix::net::UnixStream::connect(&d.socket) {
            Ok(s) => break s,
            Err(e) => assert!(t.elapsed() < std::time::Duration::from_secs(15), "never bound: {e}"),
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    // The raw protocol: one unsolicited `recovering` error (request id 0), then the close.
    raw.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    let mut ping = Vec::new();
    kvtier::protocol::Request::Ping { payload: Vec::new() }.encode(1, &mut ping);
    std::io::Write::write_all(&mut raw, &ping).unwrap();
    assert_eq!(common::code(common::answer(&mut raw)), Some(ErrorCode::Recovering));
    // The library: a short timeout ends while the daemon still recovers.
    let mut id = common::identity("early", 0, 0, 1, 1);
    id.namespace = kvtier::page::Namespace::model("early");
    let short = kvtier::client::ClientConfig::new(&d.socket, id.clone(), small_spec())
        .with_timeout(std::time::Duration::from_millis(300));
    match kvtier::client::Client::connect(short) {
        Err(ClientError::Recovering(m)) => assert!(m.contains("retry"), "{m}"),
        other => panic!("a client during recovery must get Recovering: {:?}", other.err()),
    }
    // A longer timeout waits the recovery out and serves.
    let long =
        kvtier::client::ClientConfig::new(&d.socket, id, small_spec()).with_timeout(std::time::Duration::from_secs(30));
    let c = kvtier::client::Client::connect(long).expect("connects once the index is rebuilt");
    let hs = hashes(2800, 4);
    store(&c, &small_spec(), &hs, 28);
    assert_eq!(load_verified(&c, &small_spec(), &hs, 28), 4);
    assert!(d.log().contains("answered 'recovering'"), "{}", d.log());
}
