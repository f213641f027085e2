use std::time::Instant;

use super::*;
use crate::layout::LayoutSpec;
use crate::page::{KeyScheme, PageHash};
use crate::pool::KeyBatch;

fn batch(scheme: &KeyScheme, layout: &crate::layout::Layout, pages: &[PageHash]) -> KeyBatch {
    let mut b = KeyBatch::with_capacity(pages.len() * layout.object_count(), scheme.key_capacity());
    for h in pages {
        b.push_page(scheme, layout, h);
    }
    b
}

fn tp2() -> crate::layout::Layout {
    LayoutSpec {
        tp_size: 2,
        ..LayoutSpec::mha(2, 2, 8, 2, 16)
    }
    .build()
    .unwrap()
}

#[test]
fn credits_a_page_only_with_every_object_and_only_in_sync() {
    let layout = tp2();
    let scheme = KeyScheme::with_prefix("kvtier", "m");
    let pages: Vec<PageHash> = (1..=3).map(PageHash::from_u64).collect();
    let idx = PoolIndex::new(1000);
    let q = batch(&scheme, &layout, &pages);
    assert_eq!(idx.pages_present(&q, layout.object_count()), None, "starts syncing");
    assert!(idx.take_resync_wanted());
    idx.begin_resync();
    // Page 1 complete in the listing; page 2's rank-1 V arrives during the resync.
    let mut listing = scheme.page_keys(&layout, &pages[0]);
    let p2 = scheme.page_keys(&layout, &pages[1]);
    listing.extend(p2[..3].iter().cloned());
    idx.apply(true, &p2[3]);
    assert!(idx.finish_resync(listing, Instant::now()));
    assert_eq!(idx.mode(), IndexMode::InSync);
    assert_eq!(idx.pages_present(&q, 4), Some(vec![true, true, false]));
    // Page 3 with one rank's objects only: never credited.
    for k in &scheme.page_keys(&layout, &pages[2])[..2] {
        idx.apply(true, k);
    }
    assert_eq!(idx.pages_present(&q, 4), Some(vec![true, true, false]));
    // A remove of one object drops the page and stops the run there.
    idx.apply(false, &scheme.page_keys(&layout, &pages[0])[1]);
    assert_eq!(idx.pages_present(&q, 4), Some(vec![false, false, false]));
    idx.lose_sync("test");
    assert_eq!(idx.pages_present(&q, 4), None);
    let s = idx.snapshot();
    assert_eq!(
        (s.mode, s.sync_losses, s.resyncs, s.last_resync_keys),
        (Some(IndexMode::Syncing), 1, 1, 8)
    );
}

/// Object keys of pages: `k(i)` is one object of page `i` (rank 0's K, prefix `t_m_`).
fn k(i: u64) -> String {
    format!("t_m_{}_0_k", PageHash::from_u64(i).to_hex())
}

#[test]
fn journal_replays_removes_and_loss_during_resync_fails_it() {
    let idx = PoolIndex::new(1000);
    idx.begin_resync();
    idx.apply(false, &k(1));
    assert!(idx.finish_resync([k(1), k(2)], Instant::now()));
    let s = idx.snapshot();
    assert_eq!((s.keys, s.pages), (1, 1));
    assert!(idx.contains_all(&[k(2)]) && !idx.contains_all(&[k(1)]));
    idx.begin_resync();
    idx.lose_sync("gap");
    assert!(!idx.finish_resync(Vec::<String>::new(), Instant::now()));
    assert_eq!(idx.mode(), IndexMode::Syncing);
    assert!(idx.take_resync_wanted());
}

#[test]
fn a_resync_journal_is_bounded_in_bytes_and_skips_what_no_page_holds() {
    let idx = PoolIndex::new(1 << 20);
    idx.begin_resync();
    // Keys that are no page's object are not journalled: no number of them ends the resync.
    let junk = "x".repeat(60 << 10);
    for _ in 0..2000 {
        idx.apply(true, &junk);
    }
    assert!(idx.finish_resync([k(1)], Instant::now()), "junk never counted");
    // Page keys of 60 KiB: past 64 MiB of them the resync is abandoned, not grown.
    idx.begin_resync();
    let long = |i: u64| format!("{}_{}_0_k", "p".repeat(60 << 10), PageHash::from_u64(i).to_hex());
    for i in 0..1200 {
        idx.apply(true, &long(i));
    }
    assert!(!idx.finish_resync([k(1)], Instant::now()));
    assert_eq!(idx.mode(), IndexMode::Syncing);
    assert!(idx.take_resync_wanted());
}

#[test]
fn bounded_and_forget_learns() {
    let idx = PoolIndex::new(2);
    idx.begin_resync();
    assert!(!idx.finish_resync([k(1), k(2), k(3)], Instant::now()));
    idx.begin_resync();
    assert!(idx.finish_resync([k(1), k(2)], Instant::now()));
    idx.apply(true, &k(3));
    assert_eq!(
        idx.mode(),
        IndexMode::Syncing,
        "past max_keys the index stops answering"
    );
    idx.begin_resync();
    assert!(idx.finish_resync([k(1), k(2)], Instant::now()));
    idx.forget(&[k(1)]);
    let s = idx.snapshot();
    assert_eq!((s.keys, s.forgotten_pages), (1, 1));
    // Events past the journal's bound during a resync: it cannot finish on a partial replay.
    idx.begin_resync();
    for i in 10..13 {
        idx.apply(true, &k(i));
    }
    assert!(!idx.finish_resync([k(1)], Instant::now()));
    assert_eq!(idx.mode(), IndexMode::Syncing);
}

/// A key that is no page's object (no page hash field) is not held, and a lookup's probe
/// answers per page exactly as probing each rendered key would.
#[test]
fn probe_matches_the_rendered_keys() {
    let layout = tp2();
    let scheme = KeyScheme::with_prefix("kvtier", "m");
    let other = KeyScheme::with_prefix("kvtier", "n");
    let pages: Vec<PageHash> = (1..=4).map(PageHash::from_u64).collect();
    let idx = PoolIndex::new(1000);
    idx.begin_resync();
    let mut listing = vec!["not-a-page".to_string()];
    for h in &pages[..3] {
        listing.extend(scheme.page_keys(&layout, h));
    }
    // Page 4 is complete only under another namespace's prefix.
    listing.extend(other.page_keys(&layout, &pages[3]));
    assert!(idx.finish_resync(listing, Instant::now()));
    assert_eq!(idx.snapshot().keys, 16);
    idx.apply(false, &scheme.page_keys(&layout, &pages[1])[3]);
    let q = batch(&scheme, &layout, &pages);
    let by_keys = idx.pages_present(&q, 4).unwrap();
    let mut probe = idx.probe().unwrap();
    let mut p = probe.pages(&scheme, &layout);
    let by_page: Vec<bool> = pages.iter().map(|h| p.present(h)).collect();
    assert_eq!(by_page, vec![true, false, true, false]);
    assert_eq!(by_keys, vec![true, false, false, false], "stops at the first gap");
    let mut p = probe.pages(&other, &layout);
    assert!(p.present(&pages[3]) && !p.present(&pages[0]));
}

/// A namespace's remembered resolution answers as the rendered keys do, and a resync,
/// which interns prefixes and suffixes afresh (here in another order), forgets it: an
/// answer kept across it would name another namespace's prefix id.
#[test]
fn a_remembered_resolution_answers_as_the_keys_do_and_a_resync_forgets_it() {
    let layout = tp2();
    let (a, b) = (
        KeyScheme::with_prefix("kvtier", "a"),
        KeyScheme::with_prefix("kvtier", "b"),
    );
    let pa: Vec<PageHash> = (1..=2).map(PageHash::from_u64).collect();
    let pb: Vec<PageHash> = (11..=12).map(PageHash::from_u64).collect();
    let idx = PoolIndex::new(1000);
    let present = |idx: &PoolIndex, name: u32, scheme: &KeyScheme, pages: &[PageHash]| -> Vec<bool> {
        let mut probe = idx.probe().expect("in sync");
        let mut p = probe.pages_named(name, scheme, &layout);
        pages.iter().map(|h| p.present(h)).collect()
    };
    idx.begin_resync();
    let mut listing: Vec<String> = pa.iter().flat_map(|h| a.page_keys(&layout, h)).collect();
    listing.extend(b.page_keys(&layout, &pb[0]));
    assert!(idx.finish_resync(listing, Instant::now()));
    assert_eq!(present(&idx, 1, &a, &pa), vec![true, true]);
    assert_eq!(present(&idx, 2, &b, &pb), vec![true, false]);
    // Remembered now; a store after it is seen through the remembered resolution.
    for k in b.page_keys(&layout, &pb[1]) {
        idx.apply(true, &k);
    }
    assert_eq!(present(&idx, 2, &b, &pb), vec![true, true]);
    // A resync that lists `b` first gives `b` the prefix id `a` had, and `b` holds pages
    // with `a`'s hashes: through a resolution kept across it, `a` would see them.
    idx.begin_resync();
    let listing: Vec<String> = pb.iter().chain(&pa).flat_map(|h| b.page_keys(&layout, h)).collect();
    assert!(idx.finish_resync(listing, Instant::now()));
    assert_eq!(present(&idx, 1, &a, &pa), vec![false, false], "a's pages are gone");
    assert_eq!(present(&idx, 2, &b, &pb), vec![true, true]);
    // And a name whose prefix is not interned yet is not remembered as absent.
    for k in a.page_keys(&layout, &pa[0]) {
        idx.apply(true, &k);
    }
    assert_eq!(present(&idx, 1, &a, &pa), vec![true, false]);
}

/// The lookup file's pool page table always says what the index's key set says, for every
/// namespace published and every page, through stores, removes, forgotten pages, lost
/// sync and resyncs (with events journalled meanwhile); an engine's mapping of the file
/// reads the same, and trusts the table exactly while the index is in sync.
#[test]
fn the_pool_page_table_follows_the_key_set_through_events_and_resyncs() {
    use std::collections::HashSet;

    use crate::directory::shared::{LookupFile, lookup_path};
    use crate::page::NamespaceId;

    let dir = tempfile::tempdir().unwrap();
    let path = lookup_path(&dir.path().join("arena"));
    let (file, _dir_view, pool_view) = LookupFile::create(&path, None, 16, 64).unwrap();
    let (engine, _, pool_r) = LookupFile::open(&path).unwrap().unwrap();
    let tp1 = LayoutSpec::mha(2, 2, 8, 2, 16).build().unwrap();
    let a = KeyScheme::with_prefix("kvtier", "m");
    let b = KeyScheme::with_prefix("kvtier", "other");
    // Two namespaces share a prefix with different layouts; a third has its own prefix.
    let spaces = [(0u16, a.clone(), tp2()), (1, a.clone(), tp1), (2, b, tp2())];
    let pages: Vec<PageHash> = (1..=6).map(PageHash::from_u64).collect();
    let all: Vec<String> = spaces
        .iter()
        .flat_map(|(_, s, l)| pages.iter().flat_map(|p| s.page_keys(l, p)))
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();

    let idx = PoolIndex::new(10_000);
    // Namespace 0 before the table exists, the others after: both ways get published.
    idx.publish_namespace(0, &spaces[0].1, &spaces[0].2);
    idx.publish_to(table::PoolTable::new(std::sync::Arc::new(file), pool_view, 64));
    idx.publish_namespace(0, &spaces[0].1, &spaces[0].2);
    for (ns, s, l) in &spaces[1..] {
        idx.publish_namespace(*ns, s, l);
    }
    idx.begin_resync();
    assert!(idx.finish_resync(Vec::new(), Instant::now()));

    let mut model: HashSet<String> = HashSet::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: usize| {
        rng = rng
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((rng >> 33) as usize) % n
    };
    let mut resyncing = false;
    let mut checked = 0;
    for step in 0..4000 {
        match next(100) {
            0..55 => {
                let k = &all[next(all.len())];
                idx.apply(true, k);
                model.insert(k.clone());
            }
            55..90 => {
                let k = &all[next(all.len())];
                idx.apply(false, k);
                model.remove(k);
            }
            90..94 if !resyncing => {
                let (_, s, l) = &spaces[next(spaces.len())];
                let keys = s.page_keys(l, &pages[next(pages.len())]);
                idx.forget(&keys);
                for k in &keys {
                    model.remove(k);
                }
            }
            94..97 if !resyncing => {
                idx.lose_sync("test");
                idx.begin_resync();
                resyncing = true;
            }
            97..100 if resyncing => {
                // The listing is the store as it is now; events since were journalled.
                assert!(idx.finish_resync(model.iter().cloned(), Instant::now()));
                resyncing = false;
            }
            _ => {}
        }
        assert_eq!(
            engine.pool_indexed(),
            !resyncing,
            "step {step}: trusted exactly while in sync"
        );
        if resyncing {
            continue;
        }
        for (ns, s, l) in &spaces {
            for p in &pages {
                let want = s.page_keys(l, p).iter().all(|k| model.contains(k));
                let id = NamespaceId(*ns);
                let got = pool_r.find(id, p, p.table_hash(id)).is_some();
                assert_eq!(got, want, "step {step}: namespace {ns}, page {p:?}");
                checked += usize::from(want);
            }
        }
    }
    assert!(checked > 1000, "complete pages were seen often enough: {checked}");
    assert!(idx.snapshot().engine_pages <= (pages.len() * spaces.len()) as u64);
}
