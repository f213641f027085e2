//! Lookups through the lock-free [`DirView`] racing a writer that inserts, completes,
//! evicts and reuses records, with the index kept near its 3/4 load so deletions shift
//! long runs. Checked: no lookup credits a page that was not complete, and pages that
//! never change are never missed (a deletion that shifts one past a probe is retried).

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

use super::*;
use crate::layout::LayoutSpec;

/// Distinct page hashes.
const PAGES: usize = 4096;
/// Directory room: 767 records fill the 1,024-slot index to its 3/4 bound.
const ROOM: usize = 767;
/// Pages stored complete at the start and never changed.
const STABLE: usize = 64;
/// Writer steps per run.
const STEPS: usize = 2_000_000;

/// Hashes of three shapes, so cells are reused across lengths: 8-byte ones, 32-byte ones,
/// and 32-byte ones whose first word equals an 8-byte one's (told apart only by the
/// length and the later words).
fn hash(k: usize) -> PageHash {
    let k = k % PAGES;
    let base = (k % (PAGES / 2)) as u64;
    if k < PAGES / 4 {
        return PageHash::from_u64(base);
    }
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&base.to_be_bytes());
    b[8..16].copy_from_slice(&(k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    b[31] = k as u8 | 1;
    PageHash::new(&b).unwrap()
}

/// Ground truth per page: a version bumped on every change, shifted left, and the
/// complete-on-host bit. The writer marks a page complete here before the directory
/// does and absent after, so "complete in the directory" implies "complete here".
struct Truth(Vec<AtomicU64>);

impl Truth {
    fn set(&self, k: usize, complete: bool) {
        let v = self.0[k].load(SeqCst) >> 1;
        self.0[k].store(((v + 1) << 1) | u64::from(complete), SeqCst);
    }

    fn get(&self, k: usize) -> u64 {
        self.0[k % PAGES].load(SeqCst)
    }
}

fn xorshift(r: &mut u64) -> usize {
    *r ^= *r << 13;
    *r ^= *r >> 7;
    *r ^= *r << 17;
    *r as usize
}

/// One writer step on a page that may change: store one or both objects, complete a
/// partial page, drop a partial object, or evict a complete page (freeing its record).
fn step(d: &mut Directory, ns: NamespaceId, truth: &Truth, k: usize, r: usize) {
    let h = hash(k);
    match d.find(ns, &h) {
        None if d.len() < ROOM => {
            let id = d.find_or_insert(ns, &h).unwrap();
            if r.is_multiple_of(3) {
                d.set_object(id, TierKind::Host, r % 2, true).unwrap();
            } else {
                truth.set(k, true);
                d.set_page(id, TierKind::Host, true);
            }
        }
        None => {}
        Some(id) if d.is_complete(id, TierKind::Host) => {
            d.set_page(id, TierKind::Host, false);
            truth.set(k, false);
        }
        Some(id) => {
            if r.is_multiple_of(2) {
                truth.set(k, true);
                d.set_objects(id, TierKind::Host, &[0, 1], true).unwrap();
            } else {
                let have = d.objects().missing_objects(id, TierKind::Host);
                let obj = usize::from(have == vec![0]);
                d.set_object(id, TierKind::Host, obj, false).unwrap();
            }
        }
    }
}

#[test]
fn lookups_racing_inserts_evictions_and_reuse_never_credit_an_incomplete_page() {
    let mut d = Directory::new(ROOM);
    let layout = LayoutSpec::mha(32, 8, 128, 2, 16).build().unwrap();
    assert_eq!(layout.object_count(), 2);
    let ns = d.register(Namespace::model("m"), layout).unwrap();
    let truth = Arc::new(Truth((0..PAGES).map(|_| AtomicU64::new(0)).collect()));
    for k in 0..STABLE {
        let id = d.find_or_insert(ns, &hash(k)).unwrap();
        truth.set(k, true);
        d.set_page(id, TierKind::Host, true);
    }
    let view = d.view();
    let done = Arc::new(AtomicBool::new(false));
    let (claims, conclusive, stable_hits) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let readers: Vec<_> = (0..2u64)
        .map(|seed| {
            let (view, truth, done) = (view.clone(), truth.clone(), done.clone());
            let (claims, conclusive, stable_hits) = (claims.clone(), conclusive.clone(), stable_hits.clone());
            std::thread::spawn(move || {
                let mut rng = 0x2545_f491_4f6c_dd1d ^ (seed + 1);
                let mut chain = Vec::with_capacity(4);
                while !done.load(SeqCst) {
                    let k = xorshift(&mut rng) % PAGES;
                    chain.clear();
                    chain.extend((k..k + 4).map(hash));
                    let before: Vec<u64> = (k..k + 4).map(|j| truth.get(j)).collect();
                    let hit = view.lookup_prefix(ns, &chain);
                    let after: Vec<u64> = (k..k + 4).map(|j| truth.get(j)).collect();
                    assert_eq!((hit.device, hit.pool), (0, 0), "only host holds pages");
                    for j in 0..hit.total() {
                        claims.fetch_add(1, SeqCst);
                        if before[j] == after[j] {
                            // The page did not change during the lookup: it must be complete.
                            assert_eq!(before[j] & 1, 1, "page {} credited while not complete", (k + j) % PAGES);
                            conclusive.fetch_add(1, SeqCst);
                        }
                    }
                    let s = xorshift(&mut rng) % STABLE;
                    assert_eq!(view.lookup_prefix(ns, &[hash(s)]).host, 1, "stable page {s} missed");
                    stable_hits.fetch_add(1, SeqCst);
                }
            })
        })
        .collect();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..STEPS {
        let k = STABLE + xorshift(&mut rng) % (PAGES - STABLE);
        let r = xorshift(&mut rng);
        step(&mut d, ns, &truth, k, r);
        if i % 1024 == 0 {
            d.drain_events();
        }
    }
    done.store(true, SeqCst);
    for r in readers {
        r.join().expect("a reader's check failed");
    }
    // The run exercised what it claims to: many credited pages checked, records reused.
    assert!(
        conclusive.load(SeqCst) > 1_000,
        "{} conclusive of {}",
        conclusive.load(SeqCst),
        claims.load(SeqCst)
    );
    assert!(stable_hits.load(SeqCst) > 1_000);
    assert!(
        d.order().record_slots() <= ROOM,
        "records are reused, never more than the room"
    );
    // Quiescent: the view answers exactly what the directory holds, page by page.
    for k in 0..PAGES {
        let complete = d.find(ns, &hash(k)).is_some_and(|id| d.is_complete(id, TierKind::Host));
        assert_eq!(truth.get(k) & 1 == 1, complete, "page {k}");
        assert_eq!(
            view.lookup_prefix(ns, &[hash(k)]).host,
            usize::from(complete),
            "page {k}"
        );
    }
}

#[test]
fn the_view_sees_namespaces_and_states_the_directory_writes() {
    let mut d = Directory::new(64);
    let view = d.view();
    let ns = NamespaceId(0);
    assert!(!view.knows(ns));
    let layout = LayoutSpec::mha(32, 8, 128, 2, 16).build().unwrap();
    assert_eq!(d.register(Namespace::model("m"), layout).unwrap(), ns);
    assert!(view.knows(ns) && !view.knows(NamespaceId(1)));
    let hs: Vec<PageHash> = (0..4).map(hash).collect();
    for (i, h) in hs.iter().enumerate() {
        let id = d.find_or_insert(ns, h).unwrap();
        d.set_page(
            id,
            [TierKind::Device, TierKind::Host, TierKind::Pool, TierKind::Host][i],
            true,
        );
    }
    assert_eq!(
        view.lookup_prefix(ns, &hs),
        PrefixHit {
            device: 1,
            host: 1,
            pool: 2
        }
    );
    // The 8-byte page 0 and the 32-byte page PAGES/2 share their first word.
    assert_eq!(view.lookup_prefix(ns, &[hash(PAGES / 2)]).total(), 0);
    let id = d.find(ns, &hs[0]).unwrap();
    d.set_page(id, TierKind::Device, false);
    assert_eq!(
        view.lookup_prefix(ns, &hs).total(),
        0,
        "page 0 left: the prefix is empty"
    );
    // The freed record is reused for another hash; the old one stays gone.
    let id2 = d.find_or_insert(ns, &hash(PAGES / 2)).unwrap();
    assert_eq!(id2, id, "the free record is reused");
    d.set_page(id2, TierKind::Host, true);
    assert_eq!(view.lookup_prefix(ns, &[hash(PAGES / 2)]).host, 1);
    assert_eq!(view.lookup_prefix(ns, &hs[..1]).total(), 0);
    assert_eq!(d.info(id2).hash, hash(PAGES / 2), "the hash is read back from the cell");
}

#[test]
fn an_impossible_reservation_is_a_typed_error() {
    // 2^32 - 2 records need about 160 GiB of cells and 64 GiB of index.
    match Directory::try_new(usize::MAX) {
        Ok(d) => assert_eq!(d.max_pages, u32::MAX as usize - 1, "clipped when the machine allows it"),
        Err(e) => assert!(matches!(e, DirectoryError::Alloc(_)), "{e}"),
    }
}

/// A view made resident (what `kvtier serve` asks for) has every page of its index in
/// memory, where a fresh one of the same size has next to none: its lookups take no page
/// fault on the index.
#[test]
fn a_resident_index_has_every_page_in_memory() {
    // 8 Mi slots: a 64 MiB index, 16,384 pages, above the largest threshold past which
    // the allocator maps fresh memory (32 MiB for glibc), so none of it was used before.
    let fresh = view::DirView::new(1 << 22).unwrap();
    let (before, pages) = fresh.index_residency();
    assert!(pages >= 16_383, "{pages}");
    assert!(
        before < pages / 4,
        "a fresh index is not resident: {before} of {pages} pages"
    );
    fresh.make_index_resident();
    let (after, _) = fresh.index_residency();
    assert_eq!(after, pages, "pages of the index in memory after make_index_resident");
}
