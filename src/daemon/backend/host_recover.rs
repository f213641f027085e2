//! Restart recovery and manifest compaction for [`HostBackend`].
//!
//! A restarted daemon reopens the arena file without truncating it, replays the manifest,
//! verifies every committed object's xxh3 checksum against the bytes in its slot, and
//! re-adopts each page whose objects are all present and intact. A page with a missing or
//! corrupt object is discarded and reported (count and hashes) in the log.

use std::collections::HashMap;
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64;

use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::tier::host::{HostArena, SlotId};

use super::BackendError;
use super::host::{HostBackend, HostPage, NO_SLOT};
use super::manifest::{Manifest, ObjectRecord};

/// Most discarded hashes named in the log; the count is always complete.
const LOG_HASHES: usize = 32;

impl HostBackend {
    pub(super) fn recover(&self) -> Result<(), BackendError> {
        let path = self.manifest_path();
        let Some(replay) = Manifest::replay(&path)? else {
            return Ok(());
        };
        if !self.cfg.arena_path.exists() || replay.slot_bytes == 0 || !replay.slot_bytes.is_multiple_of(64) {
            return Ok(());
        }
        let arena = match HostArena::open(&self.cfg.arena_path, replay.slot_bytes, &self.cfg.arena) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "arena cannot be reopened; starting empty");
                return Ok(());
            }
        };
        if replay.torn_tail {
            tracing::warn!(manifest = %path.display(), "manifest ends in a torn record; later records ignored");
        }
        let mut st = self.st.lock();
        let st = &mut *st;
        let mut ids: HashMap<u16, NamespaceId> = HashMap::new();
        for (old, ns, spec) in &replay.namespaces {
            match spec
                .clone()
                .build()
                .map_err(BackendError::from)
                .and_then(|l| st.dir.register(ns.clone(), l).map_err(BackendError::from))
            {
                Ok(id) => {
                    ids.insert(*old, id);
                }
                Err(e) => tracing::warn!(error = %e, model = %ns.model, "manifest namespace refused"),
            }
        }
        // Group live objects by page.
        let mut pages: HashMap<(NamespaceId, PageHash), Vec<ObjectRecord>> = HashMap::new();
        for o in replay.objects.values() {
            if let Some(&ns) = ids.get(&o.ns) {
                pages.entry((ns, o.hash)).or_default().push(*o);
            }
        }
        let mut used = Vec::new();
        let mut keep = Vec::new();
        let (mut corrupt, mut incomplete) = (Vec::new(), 0usize);
        for ((ns, hash), objs) in pages {
            let Ok(layout) = st.dir.layout(ns) else { continue };
            let count = layout.object_count();
            let mut slots = vec![NO_SLOT; count];
            let mut sums = vec![0u64; count];
            let mut bad = false;
            for o in &objs {
                let idx = o.object as usize;
                let intact = idx < count
                    && o.len == layout.object_bytes(idx)
                    // SAFETY: no client is connected yet; the daemon is the only user.
                    && unsafe { arena.slot(SlotId(o.slot), o.len as usize) }.is_ok_and(|b| xxh3_64(b) == o.checksum);
                if !intact {
                    bad = true;
                } else {
                    slots[idx] = o.slot;
                    sums[idx] = o.checksum;
                }
            }
            if bad {
                corrupt.push(hash);
                continue;
            }
            if slots.contains(&NO_SLOT) {
                incomplete += 1;
                continue;
            }
            let id = st.dir.find_or_insert(ns, &hash)?;
            st.dir.set_page(id, TierKind::Host, true);
            used.extend(slots.iter().map(|&s| SlotId(s)));
            keep.extend(objs.iter().copied());
            st.pages.insert(
                (ns, hash),
                HostPage {
                    slots: slots.into_boxed_slice(),
                    sums: sums.into_boxed_slice(),
                    readers: 0,
                },
            );
        }
        arena.reset_free(&used);
        st.recovered = st.pages.len() as u64;
        st.discarded = (corrupt.len() + incomplete) as u64;
        let named: Vec<String> = corrupt.iter().take(LOG_HASHES).map(|h| h.to_hex()).collect();
        tracing::info!(
            recovered = st.recovered,
            corrupt = corrupt.len(),
            incomplete,
            "host arena recovered from manifest"
        );
        if !corrupt.is_empty() {
            tracing::warn!(
                count = corrupt.len(),
                hashes = %named.join(","),
                "discarded pages whose objects failed their checksum"
            );
        }
        let spaces: Vec<_> = st
            .dir
            .namespaces()
            .map(|(id, n, l)| (id.0, n.clone(), l.spec().clone()))
            .collect();
        let keep: Vec<_> = keep
            .into_iter()
            .filter_map(|o| ids.get(&o.ns).map(|id| ObjectRecord { ns: id.0, ..o }))
            .collect();
        st.manifest = Some(Manifest::create(&path, replay.slot_bytes, &spaces, &keep)?);
        st.arena = Some(Arc::new(arena));
        self.publish(st);
        Ok(())
    }

    /// Rewrites the manifest with only the live objects (clean shutdown).
    pub(super) fn compact(&self) -> Result<(), BackendError> {
        let mut st = self.st.lock();
        let st = &mut *st;
        let Some(arena) = st.arena.clone() else { return Ok(()) };
        let Some(old) = st.manifest.take() else { return Ok(()) };
        // Checksums are the ones taken at commit: compaction must not bless bytes that
        // changed in the arena since.
        let mut objs = Vec::new();
        for ((ns, hash), page) in &st.pages {
            let Ok(layout) = st.dir.layout(*ns) else { continue };
            for (o, &slot) in page.slots.iter().enumerate().filter(|(_, s)| **s != NO_SLOT) {
                objs.push(ObjectRecord {
                    ns: ns.0,
                    hash: *hash,
                    object: o as u16,
                    slot,
                    len: layout.object_bytes(o),
                    checksum: page.sums[o],
                });
            }
        }
        let spaces: Vec<_> = st
            .dir
            .namespaces()
            .map(|(id, n, l)| (id.0, n.clone(), l.spec().clone()))
            .collect();
        st.manifest = Some(Manifest::create(old.path(), arena.slot_bytes() as u64, &spaces, &objs)?);
        tracing::info!(objects = objs.len(), "manifest compacted");
        Ok(())
    }
}
