//! The daemon's journal of committed host objects, and recovery from it.
//!
//! Every commit appends one manifest record per object (slot, length, xxh3 of the bytes
//! the rank wrote). A page that becomes complete on host without a commit (staged back
//! from the pool by a load or a prefetch) is recorded when the journal reads its `stored`
//! event, from the bytes in its slots. Pages that leave host (the manager's
//! `removed`/`cleared` events) append release records. Before a commit the journal
//! catches up with the event stream, so a slot freed by eviction and granted again is
//! released before it is recorded anew. A restart replays the manifest, verifies each
//! object against the arena and hands intact complete pages back to the manager.
//!
//! The manifest stays bounded: after each flush, a manifest larger than
//! [`COMPACT_FACTOR`] times its live records plus [`COMPACT_SLACK`] is rewritten with the
//! live records only. Each rewrite costs O(live records) and comes after at least a
//! quarter of that in appended bytes, so the cost per store or release stays constant.
//! When the event ring dropped events the journal had not read, the records are rebuilt
//! from the directory's host pages (a full resync) instead of trusting a partial stream.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use xxhash_rust::xxh3::xxh3_64;

use crate::events::PageEventKind;
use crate::manager::Manager;
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::tier::host::{HostArena, SlotId};

use super::BackendError;
use super::manifest::{Manifest, ObjectRecord};

/// Most discarded hashes named in the log; the count is always complete.
const LOG_HASHES: usize = 32;

/// The manifest is compacted when it passes this many times the bytes of its live
/// records, plus [`COMPACT_SLACK`].
pub(super) const COMPACT_FACTOR: u64 = 2;
/// Bytes a manifest may hold beyond [`COMPACT_FACTOR`] times its live records.
pub(super) const COMPACT_SLACK: u64 = 64 << 10;

#[derive(Default)]
pub(super) struct Journal {
    pub path: PathBuf,
    pub manifest: Option<Manifest>,
    /// Committed objects per page, as recorded.
    pub live: HashMap<(NamespaceId, PageHash), Vec<ObjectRecord>>,
    /// Next event sequence number to read.
    pub next_seq: u64,
    /// Object records in `live`.
    objects: u64,
    /// Compactions since start, and full resyncs after the event ring lost events.
    pub compactions: u64,
    pub resyncs: u64,
}

/// What a recovery found.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Recovered {
    pub pages: u64,
    pub corrupt: u64,
    pub incomplete: u64,
    /// Pages in slots the configured arena no longer has, or whose file was too short,
    /// or every page of an arena whose slot size changed.
    pub outside: u64,
    /// Manifest records skipped as unreadable.
    pub bad_records: u64,
    /// The manifest was not a manifest at all.
    pub garbage: bool,
    /// Pages found again in the local pool.
    pub pool_pages: u64,
}

impl Recovered {
    pub fn discarded(&self) -> u64 {
        self.corrupt + self.incomplete + self.outside
    }
}

impl Journal {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            next_seq: 1,
            ..Self::default()
        }
    }

    fn spaces(mgr: &Manager) -> Vec<(u16, crate::page::Namespace, crate::layout::LayoutSpec)> {
        mgr.pages()
            .namespaces()
            .into_iter()
            .map(|(id, n, l)| (id.0, n, l.spec().clone()))
            .collect()
    }

    /// Starts a fresh manifest for an arena of `slot_bytes` slots.
    pub fn start(&mut self, mgr: &Manager, slot_bytes: u64) -> Result<(), BackendError> {
        let recs: Vec<ObjectRecord> = self.live.values().flatten().copied().collect();
        self.objects = recs.len() as u64;
        self.manifest = Some(Manifest::create(&self.path, slot_bytes, &Self::spaces(mgr), &recs)?);
        Ok(())
    }

    /// Object records the journal holds for pages on host.
    pub fn live_objects(&self) -> u64 {
        self.objects
    }

    /// Applies the manager's host changes since the last call: removals release their
    /// records, pages that became complete without a commit are recorded. When the ring
    /// dropped events this journal had not read, the records are rebuilt from the
    /// directory instead ([`Self::resync`]).
    pub fn sync(&mut self, mgr: &Manager) {
        loop {
            let batch = mgr.pages().events().read_from(self.next_seq, 4096, Duration::ZERO);
            if batch.lost > 0 {
                tracing::warn!(
                    lost = batch.lost,
                    "the event ring dropped events the journal had not read; rebuilding the manifest from the directory"
                );
                self.resync(mgr);
                return;
            }
            if batch.events.is_empty() {
                self.next_seq = batch.next.max(self.next_seq);
                return;
            }
            self.next_seq = batch.next;
            for ev in batch.events.iter().filter(|e| e.tier == TierKind::Host) {
                match ev.kind {
                    PageEventKind::Removed => self.release(ev.ns, ev.hash),
                    PageEventKind::Cleared => {
                        let keys: Vec<_> = self.live.keys().copied().collect();
                        keys.into_iter().for_each(|(ns, h)| self.release(ns, h));
                    }
                    PageEventKind::Stored => self.record_host_page(mgr, ev.ns, ev.hash),
                }
            }
        }
    }

    /// Rebuilds the records from the pages complete on host now, reading each object's
    /// checksum from its slot (a record of the same object in the same slot is kept as
    /// it is), and rewrites the manifest. Events from before this call are skipped: the
    /// directory already shows them; any after it are applied as usual (a removal of a
    /// page not recorded, or a store of one recorded, changes nothing).
    pub fn resync(&mut self, mgr: &Manager) {
        self.resyncs += 1;
        self.next_seq = mgr.pages().events().last_seq() + 1;
        let old = std::mem::take(&mut self.live);
        for (ns, hash) in crate::manager::host_complete_pages(mgr) {
            let known = old.get(&(ns, hash));
            let recs = mgr.mover().read_host_page(ns, &hash, |objects| {
                objects
                    .iter()
                    .enumerate()
                    .map(|(o, &(slot, bytes))| {
                        known
                            .and_then(|k| k.iter().find(|r| r.object as usize == o && r.slot == slot.0))
                            .copied()
                            .unwrap_or_else(|| ObjectRecord {
                                ns: ns.0,
                                hash,
                                object: o as u16,
                                slot: slot.0,
                                len: bytes.len() as u64,
                                checksum: xxh3_64(bytes),
                            })
                    })
                    .collect::<Vec<_>>()
            });
            if let Some(recs) = recs {
                self.live.insert((ns, hash), recs);
            }
        }
        if let Some(arena) = mgr.stores().arena()
            && let Err(e) = self.start(mgr, arena.slot_bytes() as u64)
        {
            tracing::warn!(error = %e, "manifest rewrite after a resync failed; recovery may miss pages");
        }
    }

    pub fn release(&mut self, ns: NamespaceId, hash: PageHash) {
        if let Some(recs) = self.live.remove(&(ns, hash)) {
            self.objects -= recs.len() as u64;
            if let Some(m) = self.manifest.as_mut() {
                recs.iter().for_each(|r| m.release(r.slot, &hash));
            }
        }
    }

    /// Records the objects a page holds on host that the journal has no record of (the
    /// page was staged back from the pool): its slots and the checksums of their bytes
    /// as they are now. Objects already recorded in the same slot (committed) are kept.
    fn record_host_page(&mut self, mgr: &Manager, ns: NamespaceId, hash: PageHash) {
        let known = self.live.get(&(ns, hash));
        let recorded = |o: usize, slot: SlotId| {
            known.is_some_and(|k| k.iter().any(|r| r.object as usize == o && r.slot == slot.0))
        };
        let recs = mgr.mover().read_host_page(ns, &hash, |objects| {
            objects
                .iter()
                .enumerate()
                .filter(|&(o, &(slot, _))| !recorded(o, slot))
                .map(|(o, &(slot, bytes))| ObjectRecord {
                    ns: ns.0,
                    hash,
                    object: o as u16,
                    slot: slot.0,
                    len: bytes.len() as u64,
                    checksum: xxh3_64(bytes),
                })
                .collect::<Vec<_>>()
        });
        if let Some(recs) = recs.filter(|r| !r.is_empty()) {
            tracing::debug!(page = %hash.to_hex(), objects = recs.len(), "journalled a page staged into host");
            self.record(recs);
        }
    }

    /// Appends object records; a record replaces the page's earlier one for the same
    /// object, whose slot is released when it differs.
    pub fn record(&mut self, recs: Vec<ObjectRecord>) {
        for r in recs {
            let page = self.live.entry((NamespaceId(r.ns), r.hash)).or_default();
            let old: Vec<ObjectRecord> = page.iter().filter(|o| o.object == r.object).copied().collect();
            page.retain(|o| o.object != r.object);
            page.push(r);
            self.objects = self.objects + 1 - old.len() as u64;
            if let Some(m) = self.manifest.as_mut() {
                for o in old.iter().filter(|o| o.slot != r.slot) {
                    m.release(o.slot, &o.hash);
                }
                m.object(&r);
            }
        }
    }

    /// Writes the buffered records, then compacts the manifest when it passed its bound
    /// ([`COMPACT_FACTOR`] times the live records plus [`COMPACT_SLACK`]).
    pub fn flush(&mut self, mgr: &Manager) {
        let Some(m) = self.manifest.as_mut() else { return };
        if let Err(e) = m.flush() {
            tracing::warn!(error = %e, "manifest append failed; recovery may miss recent pages");
        }
        let live = self.objects * m.object_record_bytes().max(1);
        if m.bytes() > COMPACT_FACTOR * live + COMPACT_SLACK
            && let Some(arena) = mgr.stores().arena()
        {
            let before = m.bytes();
            match self.start(mgr, arena.slot_bytes() as u64) {
                Ok(()) => {
                    self.compactions += 1;
                    tracing::debug!(before, after = self.manifest_bytes(), "manifest compacted");
                }
                Err(e) => tracing::warn!(error = %e, "manifest compaction failed; it keeps growing"),
            }
        }
    }

    /// The manifest's size in bytes (0 before it exists).
    pub fn manifest_bytes(&self) -> u64 {
        self.manifest.as_ref().map_or(0, Manifest::bytes)
    }

    /// Rewrites the manifest with the live records only (clean shutdown).
    pub fn compact(&mut self, mgr: &Manager) -> Result<(), BackendError> {
        self.sync(mgr);
        let Some(arena) = mgr.stores().arena() else {
            return Ok(());
        };
        self.start(mgr, arena.slot_bytes() as u64)?;
        tracing::info!(pages = self.live.len(), "manifest compacted");
        Ok(())
    }

    /// Replays the manifest at `self.path` into `mgr`: reopens the arena fitted to the
    /// configured size, re-registers namespaces, verifies and adopts pages, and starts a
    /// compacted manifest. With `slot_bytes` configured (non-zero) and different from the
    /// manifest's, nothing is adopted: every recorded page is discarded and counted, and
    /// the caller creates a fresh arena.
    pub fn recover(&mut self, mgr: &Manager, arena_path: &Path, slot_bytes: u64) -> Result<Recovered, BackendError> {
        let mut found = Recovered::default();
        let Some(replay) = Manifest::replay(&self.path)? else {
            return Ok(found);
        };
        found.bad_records = replay.bad_records;
        if replay.garbage {
            found.garbage = true;
            tracing::warn!(manifest = %self.path.display(), "the manifest is not a kvtier manifest; nothing recovered");
            return Ok(found);
        }
        if replay.bad_records > 0 {
            tracing::warn!(
                manifest = %self.path.display(),
                records = replay.bad_records,
                bytes = replay.skipped_bytes,
                "manifest records failed their checks and were skipped; the others were read"
            );
        }
        let recorded_pages = || {
            let pages: std::collections::HashSet<_> = replay.objects.values().map(|o| (o.ns, o.hash)).collect();
            pages.len() as u64
        };
        if !arena_path.exists() || replay.slot_bytes == 0 || !replay.slot_bytes.is_multiple_of(64) {
            return Ok(found);
        }
        if slot_bytes != 0 && slot_bytes.div_ceil(64) * 64 != replay.slot_bytes {
            found.outside = recorded_pages();
            tracing::warn!(
                configured = slot_bytes,
                manifest = replay.slot_bytes,
                discarded = found.outside,
                "the configured slot size differs from the arena's; starting a fresh arena"
            );
            return Ok(found);
        }
        let (arena, found_bytes) = match mgr.stores().open_existing_arena(replay.slot_bytes) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "the arena cannot be reopened; starting empty");
                found.outside = recorded_pages();
                return Ok(found);
            }
        };
        // Slots at or past this index were cut off or read as zeros (a short file).
        let kept = (found_bytes / replay.slot_bytes).min(arena.slots() as u64);
        if found_bytes != arena.len_bytes() {
            tracing::warn!(
                file_bytes = found_bytes,
                arena_bytes = arena.len_bytes(),
                "the arena file did not have the configured size; it was fitted, and pages in slots past its old end are discarded"
            );
        }
        let mut ids = HashMap::new();
        for (old, ns, spec) in &replay.namespaces {
            let registered = spec
                .clone()
                .build()
                .map_err(|e| e.to_string())
                .and_then(|l| mgr.register_namespace(ns.clone(), l).map_err(|e| e.to_string()));
            match registered {
                Ok(id) => {
                    ids.insert(*old, id);
                }
                Err(e) => tracing::warn!(error = %e, model = %ns.model, "manifest namespace refused"),
            }
        }
        // The local pool reopened at the first registration above; its objects are booked
        // now that their namespaces are known.
        found.pool_pages = crate::manager::adopt_recovered_pool(mgr).pages;
        let mut pages: HashMap<(NamespaceId, PageHash), Vec<ObjectRecord>> = HashMap::new();
        for o in replay.objects.values() {
            if let Some(&ns) = ids.get(&o.ns) {
                pages
                    .entry((ns, o.hash))
                    .or_default()
                    .push(ObjectRecord { ns: ns.0, ..*o });
            }
        }
        let mut corrupt = Vec::new();
        for ((ns, hash), recs) in pages {
            if recs.iter().any(|r| r.slot as u64 >= kept) {
                found.outside += 1;
                continue;
            }
            match Self::verify(mgr, &arena, ns, &recs) {
                Some(slots) if mgr.mover().adopt_host_page(ns, &hash, &slots).is_ok() => {
                    self.live.insert((ns, hash), recs);
                    found.pages += 1;
                }
                Some(_) => found.incomplete += 1,
                None if recs.iter().all(|r| Self::intact(&arena, r)) => found.incomplete += 1,
                None => corrupt.push(hash),
            }
        }
        found.corrupt = corrupt.len() as u64;
        self.next_seq = mgr.pages().events().last_seq() + 1;
        self.start(mgr, replay.slot_bytes)?;
        tracing::info!(
            recovered = found.pages,
            pool_pages = found.pool_pages,
            corrupt = found.corrupt,
            incomplete = found.incomplete,
            outside = found.outside,
            bad_records = found.bad_records,
            "host arena recovered from manifest"
        );
        if !corrupt.is_empty() {
            let named: Vec<String> = corrupt.iter().take(LOG_HASHES).map(PageHash::to_hex).collect();
            tracing::warn!(
                count = corrupt.len(),
                hashes = %named.join(","),
                "discarded pages whose objects failed their checksum"
            );
        }
        Ok(found)
    }

    fn intact(arena: &HostArena, r: &ObjectRecord) -> bool {
        // SAFETY: no client is connected during recovery; the daemon is the only user.
        unsafe { arena.slot(SlotId(r.slot), r.len as usize) }.is_ok_and(|b| xxh3_64(b) == r.checksum)
    }

    /// The page's slots in canonical order when every object is present and intact.
    fn verify(mgr: &Manager, arena: &HostArena, ns: NamespaceId, recs: &[ObjectRecord]) -> Option<Vec<SlotId>> {
        let layout = mgr.pages().layout(ns).ok()?;
        let mut slots = vec![None; layout.object_count()];
        for r in recs {
            let i = r.object as usize;
            if i >= slots.len() || r.len != layout.object_bytes(i) || !Self::intact(arena, r) {
                return None;
            }
            slots[i] = Some(SlotId(r.slot));
        }
        // A page some rank never committed is not corrupt, only incomplete.
        Some(slots.into_iter().map(|s| s.unwrap_or(SlotId(u32::MAX))).collect())
    }
}
