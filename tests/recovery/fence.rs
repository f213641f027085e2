//! Issue 27 break 6, what the fence timeout alone left: an engine that reconnects and has
//! no copy of its earlier grants running ends its quarantine at once, and a late copy
//! into a slot that was granted again is caught by the slot's generation at load.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{hashes, seed, small_spec};
use crate::serve::*;
use kvtier::client::Client;
use kvtier::layout::LayoutSpec;
use kvtier::page::PageHash;
use kvtier::tier::device::EmulatedDevice;

/// A daemon on a 64-slot arena (2 KiB slots) at `arena`, with this fence timeout.
fn fenced(dir: &std::path::Path, arena: &std::path::Path, timeout_ms: u64) -> Serve {
    let timeout = format!("host.fence_timeout_ms={timeout_ms}");
    let args = [
        "--arena-path",
        arena.to_str().unwrap(),
        "--arena-bytes",
        "131072",
        "--set",
        &timeout,
    ];
    serve(dir, "g", &args).ready()
}

/// A device of `hs.len()` pages registered on `c`, holding `hs` with `salt`'s bytes.
fn device(c: &Client, layout: &LayoutSpec, hs: &[PageHash], salt: u64) -> Arc<EmulatedDevice> {
    let dev = Arc::new(EmulatedDevice::new(
        &layout.clone().build().unwrap(),
        0,
        hs.len() as u32,
    ));
    c.register_device(dev.clone()).unwrap();
    for (i, h) in hs.iter().enumerate() {
        dev.fill_page(i as u32, seed(h, 0, 0) ^ salt).unwrap();
    }
    dev
}

fn fenced_slots(d: &Serve) -> u64 {
    super::host_keep(d).0["fenced_slots"].as_u64().unwrap()
}

/// Engine A's store grant is open when the daemon is SIGKILLed; after the restart its
/// 8 slots are quarantined for 10 minutes. Another engine's connecting frees none, nor
/// does A's reconnecting while its plan (a copy that may still run) is alive. Once A's
/// late copy has landed and the plan is gone, A's next call says it is done and the
/// daemon frees the 8 slots at once; pages stored in them load with their own bytes.
#[test]
fn an_engine_done_with_its_copies_ends_its_quarantine_at_once() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let layout = small_spec();
    let mut d = fenced(dir.path(), &arena, 600_000);
    let a = d.client("fenced", layout.clone()).unwrap();
    let ours = hashes(81_000, 4);
    let slots: Vec<u32> = (0..4).collect();
    device(&a, &layout, &ours, 3);
    let plan = a.begin_store(&ours, "").unwrap();
    assert_eq!(plan.pages.iter().map(|p| p.slots.len()).sum::<usize>(), 8);
    d.stop(libc::SIGKILL);

    let d = fenced(dir.path(), &arena, 600_000);
    assert_eq!(fenced_slots(&d), 8);
    let b = d.client("fenced", layout.clone()).unwrap();
    b.lookup(&ours).unwrap();
    assert_eq!(fenced_slots(&d), 8, "another engine's token frees nothing of A's");
    // A reconnects (its first call after the restart) with its plan still alive.
    a.lookup(&ours).unwrap();
    assert_eq!(fenced_slots(&d), 8, "A's plan is alive: its copy may still land");
    // The late copy lands (in quarantined slots), its commit fails, the plan goes.
    let written = a.write_plan(&plan, &slots).unwrap();
    assert!(a.commit(&plan, &written).is_err(), "the grant died with the daemon");
    drop(plan);
    a.lookup(&ours).unwrap();
    assert_eq!(fenced_slots(&d), 0, "A said it is done: its slots are free at once");
    assert!(
        d.log().contains("its quarantined host slots are free again"),
        "{}",
        d.log()
    );
    let metrics = d.admin_get("/metrics");
    assert!(metrics.contains("\nkvtier_host_fenced_slots 0\n"), "{metrics}");
    // The freed slots take new pages (the free list hands them out first): 0 wrong bytes.
    let other = hashes(82_000, 8);
    store(&b, &layout, &other, 11);
    assert_eq!(load_verified(&b, &layout, &other, 11), other.len());
}

/// After the fence timeout, engine B's store is granted the slots engine A's dead grant
/// held; B writes and commits. Then A's late copy lands, stamping its old generations. A
/// load of B's pages copies the slots, sees the stamps differ, and reports the first hit
/// page and all after it missing: never A's bytes. Without generations it loaded them.
#[test]
fn a_late_copy_into_a_slot_granted_again_is_caught_at_load() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let layout = small_spec();
    let mut d = fenced(dir.path(), &arena, 300);
    let a = d.client("late", layout.clone()).unwrap();
    let theirs = hashes(83_000, 4);
    device(&a, &layout, &theirs, 5);
    let plan = a.begin_store(&theirs, "").unwrap();
    let granted: Vec<u32> = plan.pages.iter().flat_map(|p| p.slots.iter().map(|s| s.slot)).collect();
    assert_eq!(granted.len(), 8);
    d.stop(libc::SIGKILL);

    let d = fenced(dir.path(), &arena, 300);
    let deadline = Instant::now() + Duration::from_secs(30);
    while fenced_slots(&d) != 0 {
        assert!(Instant::now() < deadline, "the fence timeout never passed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let b = d.client("late", layout.clone()).unwrap();
    let mine = hashes(84_000, 8);
    device(&b, &layout, &mine, 9);
    let plan_b = b.begin_store(&mine, "").unwrap();
    let written = b.write_plan(&plan_b, &(0..8).collect::<Vec<u32>>()).unwrap();
    let receipt = b.commit(&plan_b, &written).unwrap();
    assert_eq!(receipt.complete, 8, "B's pages are stored before the late copy lands");
    // The page of B's that got one of A's slots first (the free list hands them out first).
    let first_hit = plan_b
        .pages
        .iter()
        .position(|p| p.slots.iter().any(|s| granted.contains(&s.slot)))
        .expect("B was granted a slot of A's dead grant");
    drop(plan_b);
    // A's copy lands now, through A's own mappings of the arena and its stamps.
    a.write_plan(&plan, &(0..4).collect::<Vec<u32>>()).unwrap();
    let n = load_verified(&b, &layout, &mine, 9);
    assert_eq!(
        n, first_hit,
        "loading stops at the first page a late copy hit, 0 wrong bytes"
    );
}
