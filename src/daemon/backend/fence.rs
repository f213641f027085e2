//! Restart fencing: host slots that an open store grant held when the daemon died are not
//! handed out again until the fence timeout has passed.
//!
//! An engine copies into its granted slots through its own mapping of the arena file. A
//! daemon that dies and reopens the same file (recovery) would otherwise grant those slots
//! to other pages while the engine's copy is still landing: the late bytes would become
//! another page's. So every slot of an open store grant is marked in `arena.fence` beside
//! the arena (one byte per slot, updated in place in a shared mapping, so a SIGKILL keeps
//! the marks), and cleared when the grant is committed or aborted. A restarted daemon that
//! reopened the arena takes the marked slots that no recovered page holds out of the free
//! list (quarantine): a late copy lands there, harming nothing. When `fence_timeout` has
//! passed they are freed. A daemon that starts a fresh arena fences nothing: the old file
//! is unlinked and a late copy lands in the old inode.
//!
//! File: `KVTFENC1`, `u64` slot size, `u64` slot count (64-byte header), then one byte per
//! slot (1: held by a store grant).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

use crate::tier::host::{HostArena, SlotId};

const MAGIC: &[u8; 8] = b"KVTFENC1";
const HEADER: usize = 64;

/// What an earlier life left marked, read before the arena is reopened.
#[derive(Debug, Default)]
pub(super) struct Marked {
    slot_bytes: u64,
    slots: Vec<u32>,
}

/// The fence of a live arena.
#[derive(Debug)]
pub(super) struct Fence {
    path: PathBuf,
    map: Option<MmapRaw>,
    slots: u32,
    /// Slots quarantined from the earlier life, and when they go free.
    quarantined: Vec<SlotId>,
    until: Option<Instant>,
}

// SAFETY: the mapping is written only through `&mut self` (the backend's fence mutex).
unsafe impl Send for Fence {}

impl Fence {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            map: None,
            slots: 0,
            quarantined: Vec::new(),
            until: None,
        }
    }

    /// The slots the fence file at `path` has marked (an earlier life's open grants), if
    /// it is the daemon's own file and a fence file at all.
    pub fn read_marked(path: &Path) -> Marked {
        let Ok(Some(mut f)) = crate::tier::private::open_existing(path, false) else {
            return Marked::default();
        };
        let mut bytes = Vec::new();
        if std::io::Read::read_to_end(&mut f, &mut bytes).is_err() || bytes.len() < HEADER || &bytes[..8] != MAGIC {
            return Marked::default();
        }
        let slot_bytes = u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default());
        let slots = u64::from_le_bytes(bytes[16..24].try_into().unwrap_or_default());
        if bytes.len() as u64 != HEADER as u64 + slots {
            return Marked::default();
        }
        Marked {
            slot_bytes,
            slots: (0..slots as u32).filter(|&s| bytes[HEADER + s as usize] != 0).collect(),
        }
    }

    /// Starts the fence of `arena` with a fresh file. With `earlier` (the arena was
    /// reopened, of the same slot size), its marked slots that are still free are taken
    /// out of the free list until `timeout` from now, and stay marked in the new file.
    pub fn attach(&mut self, arena: &HostArena, earlier: Option<Marked>, timeout: Duration) -> std::io::Result<()> {
        let slots = arena.slots();
        let len = HEADER as u64 + slots as u64;
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
            self.quarantined = m.slots.into_iter().map(SlotId).filter(|&s| arena.claim(s)).collect();
            for s in self.quarantined.clone() {
                self.set(s, true);
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

    fn set(&mut self, slot: SlotId, held: bool) {
        let Some(map) = &self.map else { return };
        if slot.0 >= self.slots {
            return;
        }
        // SAFETY: inside the mapping (checked above); only `&mut self` writes it.
        unsafe { *map.as_mut_ptr().add(HEADER + slot.0 as usize) = held as u8 };
    }

    /// Marks the slots of a store grant before the engine learns them.
    pub fn hold(&mut self, slots: impl IntoIterator<Item = SlotId>) {
        slots.into_iter().for_each(|s| self.set(s, true));
    }

    /// Clears the marks of a grant committed or aborted.
    pub fn release(&mut self, slots: impl IntoIterator<Item = SlotId>) {
        slots.into_iter().for_each(|s| self.set(s, false));
    }

    /// Slots in quarantine now.
    pub fn quarantined(&self) -> usize {
        self.quarantined.len()
    }

    /// Frees the quarantined slots once the fence timeout has passed.
    pub fn expire(&mut self, arena: &HostArena) {
        if self.until.is_some_and(|t| Instant::now() >= t) {
            let slots = std::mem::take(&mut self.quarantined);
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
