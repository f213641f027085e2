//! The daemon's side of slot generations, in process: a load grant stops before a page a
//! late copy is landing in, a load that reports a page not loaded has it dropped from
//! host when its stamps differ (and only then), and the page can be stored again once the
//! copy has ended.

use std::time::Duration;

use super::super::{Backend, ManagedTiers, TiersConfig};
use crate::clock::SystemClock;
use crate::layout::LayoutSpec;
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::protocol::LoadWait;
use crate::tier::host::{HostArena, SlotId};
use crate::tier::slot_gen::{SlotStamps, stamps_path};

fn open(dir: &std::path::Path) -> ManagedTiers {
    // A fence timeout no test reaches, so an in-copy marker is never taken over here.
    let cfg = TiersConfig {
        fence_timeout: Duration::from_secs(3600),
        policy: None,
        ..crate::daemon::backend::tests::config(dir, false)
    };
    ManagedTiers::open(cfg, SystemClock::new()).unwrap()
}

/// Tiers with one small model registered, their arena, and the stamps as an engine maps them.
fn set_up(dir: &std::path::Path) -> (ManagedTiers, NamespaceId, std::sync::Arc<HostArena>, SlotStamps) {
    let b = open(dir);
    let ns = b
        .register(&Namespace::model("m"), &LayoutSpec::mha(1, 1, 16, 2, 4))
        .unwrap()
        .ns;
    let arena = b.manager().stores().arena().unwrap();
    let engine = SlotStamps::open(&stamps_path(arena.path()), arena.slots())
        .unwrap()
        .unwrap();
    (b, ns, arena, engine)
}

/// Stores `hs` as the only rank, every object of page `i` filled with `i + salt`; returns
/// each page's slots.
fn store(b: &ManagedTiers, arena: &HostArena, ns: NamespaceId, hs: &[PageHash], salt: u8) -> Vec<Vec<u32>> {
    let (grant, pages) = b.begin_store(ns, 0, 0, hs, "", 1).unwrap();
    let mut slots = vec![Vec::new(); hs.len()];
    for p in &pages {
        for s in &p.slots {
            // SAFETY: the grant gives us the slot until commit.
            unsafe { arena.slot_mut(SlotId(s.slot), 128).unwrap() }.fill(p.index as u8 + salt);
            slots[p.index as usize].push(s.slot);
        }
    }
    b.commit_store(grant, &vec![true; pages.len()]).unwrap();
    slots
}

/// How many leading pages of `hs` are complete on host (a lookup would count the device
/// credit the in-process stores leave).
fn host(b: &ManagedTiers, ns: NamespaceId, hs: &[PageHash]) -> usize {
    let on_host = |h: &PageHash| {
        b.manager()
            .page_status(ns, h)
            .unwrap()
            .is_some_and(|s| s.tiers[crate::tier::TierKind::Host.index()].complete)
    };
    hs.iter().take_while(|&h| on_host(h)).count()
}

#[test]
fn a_page_a_late_copy_hit_is_not_granted_is_dropped_from_host_and_stored_again() {
    let dir = tempfile::tempdir().unwrap();
    let (b, ns, arena, engine) = set_up(dir.path());
    let hs: Vec<PageHash> = (0..4).map(|i| PageHash::from_u64(500 + i)).collect();
    let slots = store(&b, &arena, ns, &hs, 10);
    assert_eq!(host(&b, ns, &hs), 4);

    // A late copy (of an older generation) has begun in page 2's first slot.
    let late = engine.begin_copy(slots[2][0], 1);
    let (g, pages) = b.begin_load(ns, 0, 0, &hs, LoadWait::BestEffort, 2).unwrap();
    assert_eq!(pages.len(), 2, "the grant stops before the page in copy");
    assert_eq!(host(&b, ns, &hs), 4, "still booked while the grant is open");
    b.finish_load(g, 2).unwrap();
    assert_eq!(host(&b, ns, &hs), 2, "the page hit is no longer credited");
    assert_eq!(host(&b, ns, &hs[3..]), 1, "a page after it that no copy hit stays");
    assert_eq!(arena.used(), 6, "its 2 slots are free");

    // Stored again while the late copy still runs: its slot keeps the marker, so a page
    // granted it is not kept; in other slots it is.
    let again = store(&b, &arena, ns, &hs[2..3], 20);
    let in_copy = again[0].contains(&slots[2][0]);
    assert_eq!(host(&b, ns, &hs), if in_copy { 2 } else { 4 });
    // The late copy ends (its own number); the page is stored and loads with its bytes.
    engine.end_copy(slots[2][0], 1, late);
    store(&b, &arena, ns, &hs[2..3], 20);
    assert_eq!(host(&b, ns, &hs), 4);
    let (g, pages) = b.begin_load(ns, 0, 0, &hs, LoadWait::BestEffort, 2).unwrap();
    assert_eq!(pages.len(), 4);
    for s in &pages[2] {
        // SAFETY: the load grant leases the page.
        let bytes = unsafe { arena.slot(SlotId(s.slot), 128).unwrap() };
        assert!(bytes.iter().all(|&x| x == 20), "page 2 has its new bytes");
    }
    b.finish_load(g, 4).unwrap();
}

#[test]
fn a_load_reporting_pages_missing_drops_only_those_whose_stamps_differ() {
    let dir = tempfile::tempdir().unwrap();
    let (b, ns, arena, engine) = set_up(dir.path());
    let hs: Vec<PageHash> = (0..4).map(|i| PageHash::from_u64(600 + i)).collect();
    let slots = store(&b, &arena, ns, &hs, 0);
    // A load that reports nothing loaded, with every stamp right, drops nothing.
    let (g, pages) = b.begin_load(ns, 0, 0, &hs, LoadWait::BestEffort, 2).unwrap();
    assert_eq!(pages.len(), 4);
    b.finish_load(g, 0).unwrap();
    assert_eq!(host(&b, ns, &hs), 4);
    // A late copy's stamp lands in page 1 after the grant (the library's check sees it and
    // reports 1 page loaded): the daemon drops page 1 only.
    let (g, pages) = b.begin_load(ns, 0, 0, &hs, LoadWait::BestEffort, 2).unwrap();
    assert_eq!(pages.len(), 4);
    engine.stamp(slots[1][1], 1);
    b.finish_load(g, 1).unwrap();
    assert_eq!(host(&b, ns, &hs), 1);
    assert_eq!(host(&b, ns, &hs[2..]), 2, "pages 2 and 3 stay");
}

#[test]
fn a_fence_file_whose_slot_count_overflows_marks_nothing() {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("arena.fence");
    // A 64-byte header saying 2^61 slots of 8 bytes: the product wraps to 0, which once
    // passed the length check, and the first mark read past the end.
    let mut header = vec![0u8; super::HEADER];
    header[..8].copy_from_slice(super::MAGIC);
    header[8..16].copy_from_slice(&4096u64.to_le_bytes());
    header[16..24].copy_from_slice(&(1u64 << 61).to_le_bytes());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .unwrap();
    std::io::Write::write_all(&mut f, &header).unwrap();
    let m = super::Fence::read_marked(&path);
    assert!(m.slots.is_empty());
    // The same header with one slot and its mark reads that mark.
    header[16..24].copy_from_slice(&1u64.to_le_bytes());
    header.extend(7u64.to_le_bytes());
    std::fs::write(&path, &header).unwrap();
    assert_eq!(super::Fence::read_marked(&path).slots, vec![(0, 7)]);
}
