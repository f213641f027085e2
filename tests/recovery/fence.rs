//! Issue 27 break 6, what the fence timeout alone left: an engine that reconnects and has
//! no copy of its earlier grants running ends its quarantine at once, and a late copy
//! into a slot that was granted again is caught by the slot's generation at load: after
//! it, or while it lands (its in-copy marker), at the load grant or after the load's
//! copy, and the page it hit is dropped from host and stored again.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{hashes, seed, small_spec};
use crate::serve::*;
use kvtier::client::{Client, StorePlan};
use kvtier::layout::LayoutSpec;
use kvtier::page::PageHash;
use kvtier::protocol::LoadWait;
use kvtier::tier::device::{DeviceError, DeviceRegion, EmulatedDevice, ObjectCopy};

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

type Hook = Box<dyn FnOnce() + Send>;

/// A device whose copies can be held at one point, to play out an interleaving: a
/// store's copy after its bytes landed and before the library stamps them, or a load's
/// copy before it reads (running another copy there first).
struct Gated {
    inner: EmulatedDevice,
    /// Once, after a store's bytes: says so on the first, waits on the second.
    after_store: Mutex<Option<(Sender<()>, Receiver<()>)>>,
    /// Once, before a load reads the slots.
    before_load: Mutex<Option<Hook>>,
}

impl Gated {
    fn new(c: &Client, layout: &LayoutSpec, pages: u32) -> Arc<Self> {
        let dev = Arc::new(Self {
            inner: EmulatedDevice::new(&layout.clone().build().unwrap(), 0, pages),
            after_store: Mutex::new(None),
            before_load: Mutex::new(None),
        });
        c.register_device(dev.clone()).unwrap();
        dev
    }
}

impl DeviceRegion for Gated {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn pages(&self) -> u32 {
        self.inner.pages()
    }
    fn object_bytes(&self) -> usize {
        self.inner.object_bytes()
    }
    fn copy_to_host(&self, batch: &mut [ObjectCopy<&mut [u8]>]) -> Result<(), DeviceError> {
        self.inner.copy_to_host(batch)?;
        if let Some((landed, go)) = self.after_store.lock().unwrap().take() {
            landed.send(()).unwrap();
            go.recv_timeout(Duration::from_secs(60)).unwrap();
        }
        Ok(())
    }
    fn copy_from_host(&self, batch: &[ObjectCopy<&[u8]>]) -> Result<(), DeviceError> {
        let hook = self.before_load.lock().unwrap().take();
        if let Some(f) = hook {
            f();
        }
        self.inner.copy_from_host(batch)
    }
}

/// A late copy set up: the restarted daemon, engine A with its dead plan and a gated
/// device holding its pages' bytes, engine B, and B's first page in one of A's slots.
struct LateCopy {
    d: Serve,
    a: Client,
    plan: StorePlan,
    dev_a: Arc<Gated>,
    b: Client,
    first_hit: usize,
}

/// Engine A's store grant of 4 pages is open when the daemon is SIGKILLed; after the
/// restart and the fence timeout, engine B stores 8 pages (`hashes(86_000, 8)`, salt 9),
/// some in A's 8 slots, and drops its device copies.
fn late_copy_set_up(dir: &std::path::Path, arena: &std::path::Path) -> LateCopy {
    let layout = small_spec();
    let mut d = fenced(dir, arena, 300);
    let a = d.client("late", layout.clone()).unwrap();
    let theirs = hashes(85_000, 4);
    let dev_a = Gated::new(&a, &layout, 4);
    for (i, h) in theirs.iter().enumerate() {
        dev_a.inner.fill_page(i as u32, seed(h, 0, 0) ^ 5).unwrap();
    }
    let plan = a.begin_store(&theirs, "").unwrap();
    let granted: Vec<u32> = plan.pages.iter().flat_map(|p| p.slots.iter().map(|s| s.slot)).collect();
    assert_eq!(granted.len(), 8);
    d.stop(libc::SIGKILL);
    let d = fenced(dir, arena, 300);
    let deadline = Instant::now() + Duration::from_secs(30);
    while fenced_slots(&d) != 0 {
        assert!(Instant::now() < deadline, "the fence timeout never passed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let b = d.client("late", layout.clone()).unwrap();
    let mine = hashes(86_000, 8);
    device(&b, &layout, &mine, 9);
    let plan_b = b.begin_store(&mine, "").unwrap();
    let written = b.write_plan(&plan_b, &(0..8).collect::<Vec<u32>>()).unwrap();
    assert_eq!(b.commit(&plan_b, &written).unwrap().complete, 8);
    // B's device copies go: `lookup` counts host only from here.
    b.removed(&mine).unwrap();
    let first_hit = plan_b
        .pages
        .iter()
        .position(|p| p.slots.iter().any(|s| granted.contains(&s.slot)))
        .expect("B was granted a slot of A's dead grant");
    LateCopy {
        d,
        a,
        plan,
        dev_a,
        b,
        first_hit,
    }
}

/// Issue 27 break 6, what a stamp after the bytes alone left open: A's late copy has
/// landed its bytes in B's pages but not yet its stamps when B loads. The daemon's check
/// at the load grant sees A's in-copy marker and grants only the pages before the first
/// one hit (with a stamp after the bytes only, that load returned A's bytes as B's); the
/// page hit is dropped from host, so `lookup` stops crediting it, and once A's copy ends
/// B stores its pages again and loads all 8 with their own bytes.
#[test]
fn a_late_copy_in_flight_at_a_load_grant_is_not_granted_and_its_pages_are_stored_again() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let layout = small_spec();
    let LateCopy {
        d,
        a,
        plan,
        dev_a,
        b,
        first_hit,
    } = late_copy_set_up(dir.path(), &arena);
    let mine = hashes(86_000, 8);
    assert_eq!(b.lookup(&mine).unwrap().host, 8);
    let (landed_tx, landed) = channel();
    let (go, go_rx) = channel();
    *dev_a.after_store.lock().unwrap() = Some((landed_tx, go_rx));
    std::thread::scope(|s| {
        let late = s.spawn(|| a.write_plan(&plan, &[0, 1, 2, 3]).unwrap());
        landed.recv_timeout(Duration::from_secs(30)).unwrap();
        // A's bytes are in the slots; its stamps still say "in copy".
        assert_eq!(
            load_verified(&b, &layout, &mine, 9),
            first_hit,
            "the grant stops at the first page hit, 0 wrong bytes"
        );
        assert!(
            d.log().contains("a load grant stops at a page whose slot was stamped"),
            "{}",
            d.log()
        );
        assert!(d.log().contains("dropped from host"), "{}", d.log());
        assert_eq!(
            b.lookup(&mine).unwrap().total(),
            first_hit,
            "the page hit is no longer credited"
        );
        go.send(()).unwrap();
        late.join().unwrap();
    });
    drop(plan);
    store(&b, &layout, &mine, 9);
    assert_eq!(
        load_verified(&b, &layout, &mine, 9),
        8,
        "stored again, loaded with B's bytes"
    );
    assert_eq!(b.lookup(&mine).unwrap().total(), 8);
}

/// The same window one step later: A's late copy starts after B's load was granted and
/// lands its bytes while B's load copies (B's device runs it before reading). B's check
/// after its copy sees A's in-copy marker (not B's number, which a stamp after the bytes
/// only still showed): the pages from the first one hit are reported not loaded, and the
/// daemon, told so at `LoadDone`, drops that page from host.
#[test]
fn a_late_copy_landing_during_a_loads_copy_is_seen_by_its_check_and_dropped() {
    let dir = tempdir();
    let arena = dir.path().join("state/arena");
    let layout = small_spec();
    let LateCopy {
        d,
        a,
        plan,
        dev_a,
        b,
        first_hit,
    } = late_copy_set_up(dir.path(), &arena);
    let mine = hashes(86_000, 8);
    let (landed_tx, landed) = channel();
    let (go, go_rx) = channel();
    *dev_a.after_store.lock().unwrap() = Some((landed_tx, go_rx));
    let dev_b = Gated::new(&b, &layout, 8);
    std::thread::scope(|s| {
        let (started_tx, started) = channel::<()>();
        let late = s.spawn(move || {
            started.recv_timeout(Duration::from_secs(30)).unwrap();
            a.write_plan(&plan, &[0, 1, 2, 3]).unwrap()
        });
        *dev_b.before_load.lock().unwrap() = Some(Box::new(move || {
            started_tx.send(()).unwrap();
            landed.recv_timeout(Duration::from_secs(30)).unwrap();
        }));
        let n = b
            .load(&mine, &(0..8).collect::<Vec<u32>>(), LoadWait::BestEffort)
            .unwrap();
        assert_eq!(n, first_hit, "loading stops at the first page hit");
        for (i, h) in mine[..n].iter().enumerate() {
            assert!(
                dev_b.inner.page_matches(i as u32, seed(h, 0, 0) ^ 9).unwrap(),
                "page {i}"
            );
        }
        assert!(
            !dev_b
                .inner
                .page_matches(first_hit as u32, seed(&mine[first_hit], 0, 0) ^ 9)
                .unwrap(),
            "the page reported missing was copied with A's bytes"
        );
        assert!(
            !d.log().contains("a load grant stops"),
            "the grant was whole: the library's own check caught it"
        );
        assert!(d.log().contains("dropped from host"), "{}", d.log());
        assert_eq!(b.lookup(&mine).unwrap().total(), first_hit);
        go.send(()).unwrap();
        late.join().unwrap();
    });
    store(&b, &layout, &mine, 9);
    assert_eq!(load_verified(&b, &layout, &mine, 9), 8);
}
