//! Restart fencing: host slots that an open store grant held when the daemon died are not
//! handed out again until that grant's engine has reconnected and said it is done, or the
//! fence timeout has passed.
//!
//! An engine copies into its granted slots through its own mapping of the arena file. A
//! daemon that dies and reopens the same file (recovery) would otherwise grant those slots
//! to other pages while the engine's copy is still landing: the late bytes would become
//! another page's. So every slot of an open store grant is marked in `arena.fence` beside
//! the arena (the fence token of the client library that holds it, updated in place in a
//! shared mapping, so a SIGKILL keeps the marks), and cleared when the grant is committed
//! or aborted. A restarted daemon that reopened the arena takes the marked slots that no
//! recovered page holds out of the free list (quarantine): a late copy lands there,
//! harming nothing. A library that reconnects sends its token with `done` once no copy of
//! an earlier connection's grant is still running: its slots are freed then. When
//! `fence_timeout` has passed the rest are freed. A daemon that starts a fresh arena
//! fences nothing: the old file is unlinked and a late copy lands in the old inode.
//!
//! The fence also starts the arena's slot generations (`crate::tier::slot_gen`), which
//! guard against what a quarantine leaves, and holds the daemon's side of their checks: a
//! commit keeps only pages whose stamps hold; a load grant stops before the first page
//! whose stamps do not; and a page a load did not load because its stamps did not hold
//! is dropped from host (its slots freed: the next allocation keeps a running copy's
//! marker, so a slot still being written is never vouched for; see `slot_gen`), so that
//! no lookup credits it again and it can be stored anew.
//!
//! File: `KVTFENC2`, `u64` slot size, `u64` slot count (64-byte header), then one `u64`
//! per slot: 0 free, else the token of the library whose store grant holds it
//! ([`UNKNOWN`] when its connection sent none). `KVTFENC1` files (one byte per slot, no
//! owner) are read as marks of unknown owners.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

use crate::manager::{self, GrantedPage, Manager};
use crate::protocol::ObjectSlot;
use crate::tier::host::{HostArena, SlotId};

use crate::tier::slot_gen::{Generations, SlotStamps, stamps_path};

const MAGIC: &[u8; 8] = b"KVTFENC2";
const MAGIC_V1: &[u8; 8] = b"KVTFENC1";
const HEADER: usize = 64;
/// The mark of a slot whose grant's connection sent no fence token: only the timeout
/// frees it.
pub(super) const UNKNOWN: u64 = u64::MAX;

/// What an earlier life left marked, read before the arena is reopened.
#[derive(Debug, Default)]
pub(super) struct Marked {
    slot_bytes: u64,
    /// (slot, token of its grant's library).
    slots: Vec<(u32, u64)>,
}

/// The fence of a live arena.
#[derive(Debug)]
pub(super) struct Fence {
    path: PathBuf,
    /// The arena's group, for the stamps file.
    group: Option<u32>,
    map: Option<MmapRaw>,
    slots: u32,
    /// Slots quarantined from the earlier life (with their library's token), and when
    /// they go free.
    quarantined: Vec<(SlotId, u64)>,
    until: Option<Instant>,
    /// The fence token each live connection sent.
    tokens: HashMap<u64, u64>,
}

// SAFETY: the mapping is written only through `&mut self` (the backend's fence mutex).
unsafe impl Send for Fence {}

impl Fence {
    pub fn new(path: PathBuf, group: Option<u32>) -> Self {
        Self {
            path,
            group,
            map: None,
            slots: 0,
            quarantined: Vec::new(),
            until: None,
            tokens: HashMap::new(),
        }
    }

    /// The fence file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The slots the fence file at `path` has marked (an earlier life's open grants), if
    /// it is the daemon's own file and a fence file at all.
    pub fn read_marked(path: &Path) -> Marked {
        let Ok(Some(mut f)) = crate::tier::private::open_existing(path, false) else {
            return Marked::default();
        };
        let mut bytes = Vec::new();
        if std::io::Read::read_to_end(&mut f, &mut bytes).is_err() || bytes.len() < HEADER {
            return Marked::default();
        }
        let width = match &bytes[..8] {
            m if m == MAGIC => 8,
            m if m == MAGIC_V1 => 1,
            _ => return Marked::default(),
        };
        let slot_bytes = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default());
        let slots = u64::from_le_bytes(bytes[16..24].try_into().unwrap_or_default());
        // A slot count no file of ours could hold (its product overflowing, say) is no
        // fence file of ours either.
        let len = slots
            .checked_mul(width as u64)
            .and_then(|b| b.checked_add(HEADER as u64));
        if len != Some(bytes.len() as u64) {
            return Marked::default();
        }
        let mark = |s: usize| {
            let at = HEADER + s * width;
            match width {
                8 => u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or_default()),
                _ => (bytes[at] != 0) as u64 * UNKNOWN,
            }
        };
        Marked {
            slot_bytes,
            slots: (0..slots as usize)
                .filter_map(|s| Some((s as u32, mark(s))).filter(|&(_, t)| t != 0))
                .collect(),
        }
    }

    /// Starts the fence of `arena` with a fresh file, and the arena's slot generations.
    /// With `earlier` (the arena was reopened, of the same slot size), its marked slots
    /// that are still free are taken out of the free list until `timeout` from now, and
    /// stay marked in the new file.
    pub fn attach(&mut self, arena: &HostArena, earlier: Option<Marked>, timeout: Duration) -> std::io::Result<()> {
        let slots = arena.slots();
        let (stamps, kept) = SlotStamps::create(&stamps_path(arena.path()), slots, self.group, earlier.is_some())
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        arena.attach_generations(Arc::new(Generations::new(stamps, kept, timeout)));
        let len = HEADER as u64 + 8 * slots as u64;
        let file = crate::tier::private::replace(&self.path).map_err(|e| std::io::Error::other(e.to_string()))?;
        file.set_len(len)?;
        let map = MmapOptions::new().len(len as usize).map_raw(&file)?;
        // SAFETY: a fresh mapping of `len` bytes that only this value writes.
        let head = unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr(), HEADER) };
        head[..8].copy_from_slice(MAGIC);
        head[8..16].copy_from_slice(&(arena.slot_bytes() as u64).to_le_bytes());
        head[16..24].copy_from_slice(&(slots as u64).to_le_bytes());
        self.map = Some(map);
        self.slots = slots;
        if let Some(m) = earlier.filter(|m| m.slot_bytes == arena.slot_bytes() as u64) {
            self.quarantined = m
                .slots
                .into_iter()
                .map(|(s, t)| (SlotId(s), t))
                .filter(|&(s, _)| arena.claim(s))
                .collect();
            for (s, t) in self.quarantined.clone() {
                self.set(s, t);
            }
            if !self.quarantined.is_empty() {
                self.until = Some(Instant::now() + timeout);
                tracing::warn!(
                    slots = self.quarantined.len(),
                    timeout_ms = timeout.as_millis() as u64,
                    "host slots of store grants open when the daemon stopped are quarantined until the fence timeout"
                );
            }
        }
        Ok(())
    }

    fn set(&mut self, slot: SlotId, token: u64) {
        let Some(map) = &self.map else { return };
        if slot.0 >= self.slots {
            return;
        }
        let at = HEADER + 8 * slot.0 as usize;
        // SAFETY: inside the mapping (checked above); only `&mut self` writes it.
        unsafe { std::ptr::copy_nonoverlapping(token.to_le_bytes().as_ptr(), map.as_mut_ptr().add(at), 8) };
    }

    /// Connection `conn`'s library sent its fence `token`; with `done`, frees the slots
    /// quarantined for that token (no copy of its earlier grants is still running).
    /// Returns how many were freed.
    pub fn engine(&mut self, arena: Option<&HostArena>, conn: u64, token: u64, done: bool) -> usize {
        if token == 0 || token == UNKNOWN {
            return 0;
        }
        self.tokens.insert(conn, token);
        let Some(arena) = arena.filter(|_| done) else { return 0 };
        let (freed, kept): (Vec<_>, Vec<_>) = self.quarantined.iter().partition(|&&(_, t)| t == token);
        self.quarantined = kept;
        for &(s, _) in &freed {
            self.set(s, 0);
        }
        arena.free_all(freed.iter().map(|&(s, _)| s));
        if self.quarantined.is_empty() {
            self.until = None;
        }
        if !freed.is_empty() {
            tracing::info!(
                slots = freed.len(),
                "an engine reconnected with no copy of its earlier grants running; its quarantined host slots are free again"
            );
        }
        freed.len()
    }

    /// Connection `conn` closed.
    pub fn forget(&mut self, conn: u64) {
        self.tokens.remove(&conn);
    }

    /// Marks the slots of a store grant of connection `conn` before the engine learns them.
    pub fn hold(&mut self, conn: u64, slots: impl IntoIterator<Item = SlotId>) {
        let token = self.tokens.get(&conn).copied().unwrap_or(UNKNOWN);
        slots.into_iter().for_each(|s| self.set(s, token));
    }

    /// Clears the marks of a grant committed or aborted.
    pub fn release(&mut self, slots: impl IntoIterator<Item = SlotId>) {
        slots.into_iter().for_each(|s| self.set(s, 0));
    }

    /// Slots in quarantine now.
    pub fn quarantined(&self) -> usize {
        self.quarantined.len()
    }

    /// Frees the quarantined slots once the fence timeout has passed.
    pub fn expire(&mut self, arena: &HostArena) {
        if self.until.is_some_and(|t| Instant::now() >= t) {
            let slots: Vec<SlotId> = std::mem::take(&mut self.quarantined)
                .into_iter()
                .map(|(s, _)| s)
                .collect();
            tracing::info!(
                slots = slots.len(),
                "fence timeout passed; quarantined host slots are free again"
            );
            self.release(slots.iter().copied());
            arena.free_all(slots);
            self.until = None;
        }
    }
}

/// The protocol's slot of `object` in `slot`, with the generation it was allocated at.
pub(super) fn object_slot(arena: Option<&HostArena>, object: usize, slot: SlotId) -> crate::protocol::ObjectSlot {
    crate::protocol::ObjectSlot {
        object: object as u16,
        slot: slot.0,
        generation: arena.and_then(HostArena::generations).map_or(0, |g| g.expected(slot)),
    }
}

/// Whether every slot of a page a store grant wrote still holds the generation it was
/// granted at (a late copy of an earlier grant stamped its own after its bytes).
pub(super) fn stamped(arena: &HostArena, objects: &[(usize, SlotId)]) -> bool {
    let Some(g) = arena.generations() else { return true };
    let held = objects.iter().all(|&(_, s)| g.holds(s));
    if !held {
        tracing::warn!("a stored page's slot was stamped by another grant's copy; the page is not kept");
    }
    held
}

/// How many leading pages of a load grant hold the generations their slots were allocated
/// at (the daemon's check at grant: the grant names only those).
pub(super) fn granted_prefix(arena: Option<&HostArena>, pages: &[Vec<ObjectSlot>]) -> usize {
    let Some(g) = arena.and_then(HostArena::generations) else {
        return pages.len();
    };
    let n = pages
        .iter()
        .take_while(|p| p.iter().all(|s| g.holds(SlotId(s.slot))))
        .count();
    if n < pages.len() {
        tracing::warn!(
            granted = n,
            "a load grant stops at a page whose slot was stamped by another grant's copy"
        );
    }
    n
}

/// Before load grant `grant` finishes with `loaded` pages loaded: its pages from there on
/// whose slots no longer hold their generations (a late copy hit them).
pub(super) fn hit_pages(mgr: &Manager, grant: u64, loaded: usize) -> Vec<GrantedPage> {
    let arena = mgr.stores().arena();
    let Some(g) = arena.as_deref().and_then(HostArena::generations) else {
        return Vec::new();
    };
    let mut pages = manager::load_grant_pages(mgr, grant, loaded);
    pages.retain(|(_, _, objects)| !holds(g, objects));
    pages
}

fn holds(g: &Generations, objects: &[(usize, SlotId)]) -> bool {
    objects.iter().all(|&(_, s)| g.holds(s))
}

/// Once the grant has finished (its leases gone): drops `pages` from host, so no lookup
/// credits them and they can be stored again. A page another grant still leases stays
/// (that grant's own finish drops it).
pub(super) fn drop_hit(mgr: &Manager, pages: &[GrantedPage]) {
    if pages.is_empty() {
        return;
    }
    let arena = mgr.stores().arena();
    let Some(g) = arena.as_deref().and_then(HostArena::generations) else {
        return;
    };
    // Asked again under the directory lock: the slots may hold another page by now.
    let n = pages
        .iter()
        .filter(|p| manager::drop_host_copy(mgr, p, |objects| !holds(g, objects)))
        .count();
    if n > 0 {
        tracing::warn!(
            pages = n,
            "pages whose slots were stamped by another grant's copy are dropped from host"
        );
    }
}

#[cfg(test)]
#[path = "fence_tests.rs"]
mod tests;
