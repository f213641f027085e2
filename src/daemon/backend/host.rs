//! The host-tier backend: directory + shared-memory arena + grants, behind one lock.
//!
//! Engine ranks copy bytes themselves; this backend only hands out arena slots and keeps
//! the books. A store grant marks the rank's objects in flight; its commit marks them
//! present, and the directory declares the page complete only once every rank's objects
//! are there. A load grant holds its pages against eviction until it is finished. The
//! lock is never held across a copy or a checksum of page bytes.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use xxhash_rust::xxh3::xxh3_64;

use crate::clock::Clock;
use crate::directory::{Directory, PrefixHit};
use crate::events::EventLog;
use crate::hints::{Hint, HintError, HintOutcome};
use crate::layout::{AttentionKind, Layout, LayoutSpec};
use crate::page::{Namespace, NamespaceId, PageHash};
use crate::protocol::{ArenaInfo, DaemonStats, GrantPage, LoadWait, ObjectSlot, SessionPhase, TicketStatus};
use crate::tier::TierKind;
use crate::tier::host::{ArenaOptions, HostArena, SlotId};

use super::manifest::{Manifest, ObjectRecord};
use super::{Backend, BackendError, Registered};

const HOST: TierKind = TierKind::Host;
pub(super) const NO_SLOT: u32 = u32::MAX;

/// Configuration of the host backend.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The arena file. The manifest lives beside it (`.manifest`).
    pub arena_path: PathBuf,
    /// Arena size in bytes.
    pub arena_bytes: u64,
    /// Fixed slot size; 0 means the first layout's largest object, rounded up to 64.
    pub slot_bytes: u64,
    /// Most pages the directory tracks.
    pub max_pages: usize,
    /// Longest a load or ticket wait may last, whatever the client asks.
    pub max_wait: Duration,
    /// Most open grants across all clients.
    pub max_grants: usize,
    /// Recover the arena from its manifest at start.
    pub recover: bool,
    /// Longest pin or retain TTL; longer ones are clipped.
    pub max_pin_ttl_ms: u64,
    /// Share of arena slots that pins may hold.
    pub pin_budget: f64,
    pub arena: ArenaOptions,
}

pub(super) struct HostPage {
    pub slots: Box<[u32]>,
    /// xxh3 of each object's bytes as committed (what the manifest records).
    pub sums: Box<[u64]>,
    pub readers: u32,
}

pub(super) enum Grant {
    Store {
        ns: NamespaceId,
        hashes: Vec<PageHash>,
        pages: Vec<(PageHash, Vec<ObjectSlot>)>,
    },
    Load {
        ns: NamespaceId,
        hashes: Vec<PageHash>,
    },
}

pub(super) struct State {
    pub dir: Directory,
    pub arena: Option<Arc<HostArena>>,
    pub pages: HashMap<(NamespaceId, PageHash), HostPage>,
    pub grants: HashMap<u64, Grant>,
    pub tickets: HashMap<u64, (NamespaceId, Vec<PageHash>)>,
    pub ticket_order: VecDeque<u64>,
    pub manifest: Option<Manifest>,
    /// (deadline ms, ns, hash, is_pin): pins and retains to undo when their TTL ends.
    pub ttls: Vec<(u64, NamespaceId, PageHash, bool)>,
    pub pinned: usize,
    pub sessions: HashMap<String, SessionPhase>,
    pub recovered: u64,
    pub discarded: u64,
}

/// The host-tier backend. See the module docs.
pub struct HostBackend {
    pub(super) cfg: HostConfig,
    pub(super) st: Mutex<State>,
    pub(super) changed: Condvar,
    pub(super) events: EventLog,
    pub(super) clock: Arc<dyn Clock>,
    next_id: AtomicU64,
}

const MAX_TICKETS: usize = 65_536;
const MAX_SESSIONS: usize = 65_536;

impl HostBackend {
    /// A backend; with `cfg.recover` it re-adopts the complete, intact pages an earlier
    /// daemon left in the arena (see `host_recover`).
    pub fn open(cfg: HostConfig, clock: Arc<dyn Clock>) -> Result<Self, BackendError> {
        let b = Self {
            st: Mutex::new(State {
                dir: Directory::new(cfg.max_pages),
                arena: None,
                pages: HashMap::new(),
                grants: HashMap::new(),
                tickets: HashMap::new(),
                ticket_order: VecDeque::new(),
                manifest: None,
                ttls: Vec::new(),
                pinned: 0,
                sessions: HashMap::new(),
                recovered: 0,
                discarded: 0,
            }),
            cfg,
            changed: Condvar::new(),
            events: EventLog::new(1 << 16),
            clock,
            // Grant ids are unique across restarts so a stale id is never mistaken.
            next_id: AtomicU64::new(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_micros() as u64)
                    << 8,
            ),
        };
        if b.cfg.recover {
            b.recover()?;
        }
        Ok(b)
    }

    /// The page events (host completeness changes) for publishers.
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    pub fn manifest_path(&self) -> PathBuf {
        self.cfg.arena_path.with_extension("manifest")
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn publish(&self, st: &mut State) {
        st.dir.set_now(self.clock.now_ms());
        let evs = st.dir.drain_events();
        self.events.append(&evs);
    }

    fn arena_info(arena: &HostArena) -> ArenaInfo {
        ArenaInfo {
            path: arena.path().display().to_string(),
            slot_bytes: arena.slot_bytes() as u64,
            slots: arena.slots(),
        }
    }

    /// Creates the arena and a fresh manifest for slots of `slot_bytes`.
    pub(super) fn create_arena(&self, st: &mut State, slot_bytes: u64) -> Result<(), BackendError> {
        let arena = HostArena::create(&self.cfg.arena_path, self.cfg.arena_bytes, slot_bytes, &self.cfg.arena)?;
        let spaces: Vec<_> = st
            .dir
            .namespaces()
            .map(|(id, n, l)| (id.0, n.clone(), l.spec().clone()))
            .collect();
        st.manifest = Some(Manifest::create(&self.manifest_path(), slot_bytes, &spaces, &[])?);
        st.arena = Some(Arc::new(arena));
        Ok(())
    }

    /// Frees every slot of a complete host page and forgets it there.
    pub(super) fn drop_page(st: &mut State, ns: NamespaceId, hash: PageHash) {
        let Some(page) = st.pages.remove(&(ns, hash)) else {
            return;
        };
        if let Some(arena) = &st.arena {
            for &s in page.slots.iter().filter(|&&s| s != NO_SLOT) {
                arena.free(SlotId(s));
                if let Some(m) = st.manifest.as_mut() {
                    m.release(s);
                }
            }
        }
        if let Some(id) = st.dir.find(ns, &hash) {
            st.dir.set_page(id, HOST, false);
        }
    }

    /// Evicts least valuable unpinned, unread, complete host pages until `need` slots are free.
    fn evict(&self, st: &mut State, need: usize) -> bool {
        let Some(arena) = st.arena.clone() else { return false };
        if arena.free_slots() as usize >= need {
            return true;
        }
        let mut cands: Vec<_> = st
            .dir
            .eviction_candidates(HOST)
            .into_iter()
            .filter(|(_, i)| st.pages.get(&(i.ns, i.hash)).is_none_or(|p| p.readers == 0))
            .map(|(_, i)| (i.retain, i.last_access, i.ns, i.hash))
            .collect();
        cands.sort_unstable_by_key(|c| (c.0, c.1));
        // Free a little more than needed so eviction does not run on every store.
        let target = need + arena.slots() as usize / 64;
        for (_, _, ns, hash) in cands {
            if arena.free_slots() as usize >= target {
                break;
            }
            Self::drop_page(st, ns, hash);
        }
        self.publish(st);
        if let Some(m) = st.manifest.as_mut() {
            let _ = m.flush();
        }
        arena.free_slots() as usize >= need
    }

    /// The objects a rank reads on load: its own K/V, or the stage latent for MLA.
    fn load_objects(layout: &Layout, tp: u16, pp: u16) -> Result<Vec<usize>, BackendError> {
        let own = layout.rank_objects(tp, pp)?;
        Ok(match layout.attention() {
            AttentionKind::Mla => vec![pp as usize],
            AttentionKind::Mha => own,
        })
    }

    fn leading_complete(st: &State, ns: NamespaceId, hashes: &[PageHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| st.dir.find(ns, h).is_some_and(|id| st.dir.is_complete(id, HOST)))
            .count()
    }

    fn checksums(arena: &HostArena, layout_bytes: &[u64], pages: &[(PageHash, Vec<ObjectSlot>)]) -> Vec<Vec<u64>> {
        pages
            .iter()
            .map(|(_, slots)| {
                slots
                    .iter()
                    .map(|s| {
                        let len = layout_bytes.get(s.object as usize).copied().unwrap_or(0) as usize;
                        // SAFETY: the grant owns these slots until it is committed or aborted.
                        unsafe { arena.slot(SlotId(s.slot), len) }.map_or(0, xxh3_64)
                    })
                    .collect()
            })
            .collect()
    }

    fn finish_store(&self, grant: u64, written: Option<&[bool]>) -> Result<(u64, u32), BackendError> {
        let (ns, hashes, pages, arena, bytes) = {
            let mut st = self.st.lock();
            let Some(Grant::Store { ns, .. }) = st.grants.get(&grant) else {
                return Err(BackendError::UnknownGrant(grant));
            };
            let ns = *ns;
            if let (Some(Grant::Store { pages, .. }), Some(w)) = (st.grants.get(&grant), written)
                && pages.len() != w.len()
            {
                return Err(BackendError::FlagCount {
                    grant,
                    pages: pages.len(),
                    flags: w.len(),
                });
            }
            let Some(Grant::Store { hashes, pages, .. }) = st.grants.remove(&grant) else {
                return Err(BackendError::UnknownGrant(grant));
            };
            let layout = st.dir.layout(ns)?;
            let bytes: Vec<u64> = (0..layout.object_count()).map(|i| layout.object_bytes(i)).collect();
            (ns, hashes, pages, st.arena.clone(), bytes)
        };
        let sums = match (written, &arena) {
            (Some(_), Some(a)) => Self::checksums(a, &bytes, &pages),
            _ => Vec::new(),
        };
        let mut st = self.st.lock();
        let st = &mut *st;
        let count = bytes.len();
        for (i, (hash, slots)) in pages.iter().enumerate() {
            let ok = written.is_some_and(|w| w[i]);
            let Some(id) = st.dir.find(ns, hash) else { continue };
            for (j, s) in slots.iter().enumerate() {
                let o = s.object as usize;
                st.dir.set_inflight(id, HOST, o, false)?;
                if ok {
                    let page = st.pages.entry((ns, *hash)).or_insert_with(|| HostPage {
                        slots: vec![NO_SLOT; count].into_boxed_slice(),
                        sums: vec![0; count].into_boxed_slice(),
                        readers: 0,
                    });
                    page.slots[o] = s.slot;
                    page.sums[o] = sums[i][j];
                    st.dir.set_object(id, HOST, o, true)?;
                    if let Some(m) = st.manifest.as_mut() {
                        m.object(&ObjectRecord {
                            ns: ns.0,
                            hash: *hash,
                            object: s.object,
                            slot: s.slot,
                            len: bytes[o],
                            checksum: sums[i][j],
                        });
                    }
                } else if let Some(a) = &st.arena {
                    a.free(SlotId(s.slot));
                }
            }
            if ok {
                st.dir.touch(id, false);
            } else {
                st.dir.release_if_empty(id);
            }
        }
        if let Some(m) = st.manifest.as_mut()
            && let Err(e) = m.flush()
        {
            tracing::warn!(error = %e, "manifest append failed; recovery may miss these pages");
        }
        let complete = hashes
            .iter()
            .filter(|h| st.dir.find(ns, h).is_some_and(|id| st.dir.is_complete(id, HOST)))
            .count() as u32;
        if written.is_some() {
            st.tickets.insert(grant, (ns, hashes));
            st.ticket_order.push_back(grant);
            while st.ticket_order.len() > MAX_TICKETS {
                if let Some(old) = st.ticket_order.pop_front() {
                    st.tickets.remove(&old);
                }
            }
        }
        self.publish(st);
        self.changed.notify_all();
        Ok((grant, complete))
    }

    fn ticket_status(st: &State, ns: NamespaceId, hashes: &[PageHash]) -> TicketStatus {
        let mut t = TicketStatus {
            total: hashes.len() as u32,
            ..TicketStatus::default()
        };
        for h in hashes {
            match st.dir.find(ns, h) {
                Some(id) if st.dir.is_complete(id, HOST) => t.complete += 1,
                Some(id) if st.dir.has_any(id, HOST) || st.dir.is_inflight(id, HOST) => {}
                _ => t.failed += 1,
            }
        }
        t
    }
}

impl Backend for HostBackend {
    fn register(&self, ns: &Namespace, spec: &LayoutSpec) -> Result<Registered, BackendError> {
        let layout = spec.clone().build()?;
        let mut st = self.st.lock();
        let st = &mut *st;
        let known = st.dir.namespaces().any(|(_, n, _)| n == ns);
        let id = st.dir.register(ns.clone(), layout.clone())?;
        let need = layout.max_object_bytes().div_ceil(64) * 64;
        if st.arena.is_none() {
            let slot = if self.cfg.slot_bytes > 0 {
                self.cfg.slot_bytes
            } else {
                need
            };
            self.create_arena(st, slot)?;
        } else if !known && let Some(m) = st.manifest.as_mut() {
            m.namespace(id.0, ns, spec);
            m.flush()?;
        }
        let arena = st.arena.as_ref().map(|a| Self::arena_info(a)).unwrap_or_default();
        if need > arena.slot_bytes {
            return Err(BackendError::ObjectTooLarge {
                bytes: need,
                slot_bytes: arena.slot_bytes,
            });
        }
        Ok(Registered { ns: id, layout, arena })
    }

    fn lookup(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<PrefixHit, BackendError> {
        let st = self.st.lock();
        st.dir.layout(ns)?;
        Ok(st.dir.lookup_prefix(ns, hashes))
    }

    fn begin_store(
        &self,
        ns: NamespaceId,
        tp: u16,
        pp: u16,
        hashes: &[PageHash],
        session: &str,
    ) -> Result<(u64, Vec<GrantPage>), BackendError> {
        let _ = session;
        let mut guard = self.st.lock();
        let st = &mut *guard;
        let objects = st.dir.layout(ns)?.rank_objects(tp, pp)?;
        if st.grants.len() >= self.cfg.max_grants {
            return Err(BackendError::TooManyGrants(self.cfg.max_grants));
        }
        let arena = st.arena.clone().ok_or(BackendError::NoSpace)?;
        let mut out = Vec::new();
        let mut held = Vec::new();
        for (i, hash) in hashes.iter().enumerate() {
            let id = st.dir.find_or_insert(ns, hash)?;
            let inflight = st.dir.inflight_objects(id, HOST);
            let todo: Vec<usize> = objects
                .iter()
                .copied()
                .filter(|&o| !st.dir.has_object(id, HOST, o) && !inflight.contains(&o))
                .collect();
            if todo.is_empty() {
                st.dir.release_if_empty(id);
                continue;
            }
            if (arena.free_slots() as usize) < todo.len() && !self.evict(st, todo.len()) {
                st.dir.release_if_empty(id);
                break;
            }
            let Some(slots) = arena.alloc_n(todo.len()) else { break };
            let mut page = Vec::with_capacity(todo.len());
            for (&o, s) in todo.iter().zip(slots) {
                st.dir.set_inflight(id, HOST, o, true)?;
                page.push(ObjectSlot {
                    object: o as u16,
                    slot: s.0,
                });
            }
            out.push(GrantPage {
                index: i as u32,
                slots: page.clone(),
            });
            held.push((*hash, page));
        }
        if out.is_empty() && hashes.iter().any(|h| st.dir.find(ns, h).is_none()) {
            return Err(BackendError::NoSpace);
        }
        let grant = self.id();
        st.grants.insert(
            grant,
            Grant::Store {
                ns,
                hashes: hashes.to_vec(),
                pages: held,
            },
        );
        Ok((grant, out))
    }

    fn commit_store(&self, grant: u64, written: &[bool]) -> Result<(u64, u32), BackendError> {
        self.finish_store(grant, Some(written))
    }

    fn abort_store(&self, grant: u64) -> Result<(), BackendError> {
        self.finish_store(grant, None).map(|_| ())
    }

    fn begin_load(
        &self,
        ns: NamespaceId,
        tp: u16,
        pp: u16,
        hashes: &[PageHash],
        wait: LoadWait,
    ) -> Result<(u64, Vec<Vec<ObjectSlot>>), BackendError> {
        let start = Instant::now();
        let deadline = start
            + match wait {
                LoadWait::BestEffort => Duration::ZERO,
                LoadWait::WaitComplete => self.cfg.max_wait,
                LoadWait::Timeout(ms) => Duration::from_millis(ms as u64).min(self.cfg.max_wait),
            };
        let mut st = self.st.lock();
        let objects = Self::load_objects(st.dir.layout(ns)?, tp, pp)?;
        if st.grants.len() >= self.cfg.max_grants {
            return Err(BackendError::TooManyGrants(self.cfg.max_grants));
        }
        let n = loop {
            let n = Self::leading_complete(&st, ns, hashes);
            // Waiting only makes sense while the next page is on its way (some rank holds
            // part of it, or is writing it).
            let pending = hashes
                .get(n)
                .and_then(|h| st.dir.find(ns, h))
                .is_some_and(|id| st.dir.has_any(id, HOST) || st.dir.is_inflight(id, HOST));
            if n == hashes.len() || !pending || self.changed.wait_until(&mut st, deadline).timed_out() {
                break Self::leading_complete(&st, ns, hashes);
            }
        };
        let st = &mut *st;
        let mut out = Vec::with_capacity(n);
        for h in &hashes[..n] {
            if let Some(id) = st.dir.find(ns, h) {
                st.dir.touch(id, true);
            }
            // Complete host pages always have their slots; stop short rather than fail.
            let Some(page) = st.pages.get_mut(&(ns, *h)) else { break };
            page.readers += 1;
            out.push(
                objects
                    .iter()
                    .map(|&o| ObjectSlot {
                        object: o as u16,
                        slot: page.slots[o],
                    })
                    .collect(),
            );
        }
        let grant = self.id();
        st.grants.insert(
            grant,
            Grant::Load {
                ns,
                hashes: hashes[..out.len()].to_vec(),
            },
        );
        Ok((grant, out))
    }

    fn finish_load(&self, grant: u64) -> Result<(), BackendError> {
        let mut st = self.st.lock();
        let st = &mut *st;
        match st.grants.remove(&grant) {
            Some(Grant::Load { ns, hashes }) => {
                for h in hashes {
                    if let Some(p) = st.pages.get_mut(&(ns, h)) {
                        p.readers = p.readers.saturating_sub(1);
                    }
                }
                Ok(())
            }
            Some(other) => {
                st.grants.insert(grant, other);
                Err(BackendError::UnknownGrant(grant))
            }
            None => Err(BackendError::UnknownGrant(grant)),
        }
    }

    fn ticket(&self, ticket: u64, timeout: Duration) -> Result<TicketStatus, BackendError> {
        let deadline = Instant::now() + timeout.min(self.cfg.max_wait);
        let mut st = self.st.lock();
        loop {
            let (ns, hashes) = st.tickets.get(&ticket).ok_or(BackendError::UnknownGrant(ticket))?;
            let t = Self::ticket_status(&st, *ns, hashes);
            if t.done() || self.changed.wait_until(&mut st, deadline).timed_out() {
                let (ns, hashes) = st.tickets.get(&ticket).ok_or(BackendError::UnknownGrant(ticket))?;
                return Ok(Self::ticket_status(&st, *ns, hashes));
            }
        }
    }

    fn removed(&self, ns: NamespaceId, hashes: &[PageHash]) -> Result<usize, BackendError> {
        // Device residency is the engine's; kvtier only counts what it knew of the pages.
        let st = self.st.lock();
        st.dir.layout(ns)?;
        Ok(hashes.iter().filter(|h| st.dir.find(ns, h).is_some()).count())
    }

    fn session(&self, id: &str, parent: Option<&str>, phase: SessionPhase) {
        let mut st = self.st.lock();
        tracing::debug!(session = id, parent, ?phase, "session phase");
        if phase == SessionPhase::Ended {
            st.sessions.remove(id);
        } else if st.sessions.len() < MAX_SESSIONS || st.sessions.contains_key(id) {
            st.sessions.insert(id.to_owned(), phase);
        }
    }

    fn hint(&self, ns: NamespaceId, hint: &Hint) -> Result<HintOutcome, HintError> {
        self.apply_hint(ns, hint)
    }

    fn stats(&self) -> DaemonStats {
        let st = self.st.lock();
        DaemonStats {
            arena_slots: st.arena.as_ref().map_or(0, |a| a.slots() as u64),
            arena_used: st.arena.as_ref().map_or(0, |a| a.used() as u64),
            host_complete_pages: st.dir.complete_count(HOST) as u64,
            open_grants: st.grants.len() as u64,
            connections: 0,
            recovered_pages: st.recovered,
            discarded_pages: st.discarded,
        }
    }

    fn tick(&self) {
        self.expire_ttls();
    }

    fn shutdown(&self) -> Result<(), BackendError> {
        self.compact()
    }
}
