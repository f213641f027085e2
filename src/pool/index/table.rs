//! The pool index's page table in the lookup file ([`crate::directory::shared`]): one
//! entry per (namespace, page) whose every object the index holds for that namespace's
//! layout, so that engines credit pool pages other nodes wrote without asking the daemon.
//!
//! The table is a [`DirView`] keyed like the directory's (the namespace and the page
//! hash); an entry's state says "complete in the pool". The index keeps it as events
//! apply, under its own write lock (the one writer). While the index is not in sync, or
//! the table had no room for a page, the file's header says so and engines ask the daemon.

use std::collections::HashMap;
use std::sync::Arc;

use crate::directory::DirView;
use crate::directory::shared::LookupFile;
use crate::page::{NamespaceId, PageHash};

/// An entry's state: complete in the pool tier (the directory's encoding, pool bits).
const IN_POOL: u8 = crate::directory::COMPLETE << 4;

/// The writer of the pool page table.
pub struct PoolTable {
    file: Arc<LookupFile>,
    view: DirView,
    /// Each entry's cell.
    cells: HashMap<(u16, PageHash), u32, foldhash::quality::RandomState>,
    free: Vec<u32>,
    next: u32,
    cap: u32,
    /// A page found no room since the last [`Self::clear`].
    overflow: bool,
}

impl PoolTable {
    /// The table over `view` (of `records` cells) in `file`.
    pub fn new(file: Arc<LookupFile>, view: DirView, records: usize) -> Self {
        Self {
            file,
            view,
            cells: HashMap::default(),
            free: Vec::new(),
            next: 0,
            cap: records.min(u32::MAX as usize - 1) as u32,
            overflow: false,
        }
    }

    /// Records whether every object of page `hash` of namespace `ns` is in the pool.
    pub fn set(&mut self, ns: u16, hash: &PageHash, present: bool) {
        let key = (ns, *hash);
        let h = hash.table_hash(NamespaceId(ns));
        match (self.cells.get(&key).copied(), present) {
            (Some(_), true) | (None, false) => {}
            (Some(i), false) => {
                self.view.remove(h, i);
                self.cells.remove(&key);
                self.free.push(i);
            }
            (None, true) => {
                let i = match self.free.pop() {
                    Some(i) => i,
                    None if self.next < self.cap => {
                        self.next += 1;
                        self.next - 1
                    }
                    None => {
                        if !self.overflow {
                            tracing::warn!(
                                records = self.cap,
                                "the lookup file's pool table is full; engines ask the daemon until the next resync"
                            );
                        }
                        self.overflow = true;
                        self.file.set_pool_indexed(false);
                        return;
                    }
                };
                self.view.publish(i, NamespaceId(ns), hash);
                self.view.set_state(i, IN_POOL);
                self.view.insert(h, i);
                self.cells.insert(key, i);
            }
        }
    }

    /// Empties the table (a resync rebuilds it).
    pub fn clear(&mut self) {
        for ((ns, hash), i) in self.cells.drain() {
            self.view.remove(hash.table_hash(NamespaceId(ns)), i);
            self.view.set_state(i, 0);
            self.free.push(i);
        }
        self.overflow = false;
    }

    /// Says in the file whether engines may trust the table: the index is in sync and
    /// the table holds all of it.
    pub fn publish_mode(&self, in_sync: bool) {
        self.file.set_pool_indexed(in_sync && !self.overflow);
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.cells.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }
}
