//! The reservation phase of `begin_store`, in two steps so that a refused or failed
//! store leaves no trace in the directory.
//!
//! [`plan_store`] finds (or creates) each page's record and takes host slots for the
//! objects the rank still has to write, touching nothing else. [`unplan_store`] gives
//! all of that back (a retry, an error). Only once the plan stands does [`apply_store`]
//! mark objects in flight and record the rank's device copies, and only for pages that
//! got their slots or are already stored: a page refused for lack of room is never
//! marked on device (the engine does not remember refused pages, so nothing would ever
//! clear such a mark) and a record created for it is released. If a directory call in
//! the apply step fails (it cannot once the object indices are checked, which the plan
//! does first), everything done so far is undone before the error is returned.

use super::ManagerError;
use super::grants::GrantPage;
use super::state::DirState;
use crate::directory::{DirectoryError, PageId};
use crate::manager::{StorePage, StoreStatus};
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::tier::host::{HostArena, SlotId};

/// One request page's reservation.
#[derive(Debug)]
pub(super) struct Planned {
    pub id: PageId,
    /// The record was created by this plan (released again when unused).
    pub fresh: bool,
    /// Objects to write and their reserved slots; empty when already stored or refused.
    pub objects: Vec<(usize, SlotId)>,
    /// No host room for this page.
    pub no_space: bool,
}

/// Finds the pages and reserves slots for what the rank must write. On error, what was
/// reserved is given back before returning.
pub(super) fn plan_store(
    st: &mut DirState,
    arena: &HostArena,
    ns: NamespaceId,
    objs: &[usize],
    hashes: &[PageHash],
) -> Result<Vec<Planned>, ManagerError> {
    let count = st.dir.layout(ns)?.object_count();
    // Checked once here so that the apply step's directory calls cannot fail.
    if let Some(&index) = objs.iter().find(|&&o| o >= count) {
        return Err(DirectoryError::ObjectOutOfRange { index, count }.into());
    }
    let mut out: Vec<Planned> = Vec::with_capacity(hashes.len());
    for hash in hashes {
        let (id, fresh) = match st.dir.find_or_insert_fresh(ns, hash) {
            Ok(found) => found,
            Err(e) => {
                unplan_store(st, arena, &out);
                return Err(e.into());
            }
        };
        // A page named twice is reserved once: the second time it is "already stored"
        // (its objects are on their way, as the in-flight check would say after apply).
        // A record this plan created cannot have been planned before.
        let planned_before = !fresh && out.iter().any(|p| p.id == id && !p.objects.is_empty());
        // A page with nothing on host and nothing in flight there (every fresh page)
        // writes every object the rank has, with no side-table read per object.
        let todo: Vec<usize> = if st.dir.objects().untouched(id, TierKind::Host) {
            objs.to_vec()
        } else {
            let seen = st.dir.objects();
            objs.iter()
                .copied()
                .filter(|&o| !seen.has_object(id, TierKind::Host, o) && !seen.is_inflight_object(id, TierKind::Host, o))
                .collect()
        };
        let mut p = Planned {
            id,
            fresh,
            objects: Vec::new(),
            no_space: false,
        };
        if !todo.is_empty() && !planned_before {
            match arena.alloc_n(todo.len()) {
                Some(slots) => p.objects = todo.into_iter().zip(slots).collect(),
                None => p.no_space = true,
            }
        }
        out.push(p);
    }
    Ok(out)
}

/// Gives back a plan that was not applied: its slots, and the records it created.
pub(super) fn unplan_store(st: &mut DirState, arena: &HostArena, planned: &[Planned]) {
    for p in planned {
        arena.free_all(p.objects.iter().map(|&(_, s)| s));
    }
    for p in planned.iter().rev().filter(|p| p.fresh) {
        st.dir.release_if_empty(p.id);
    }
}

/// A directory change the apply step made (a page's objects, in one bulk call), to undo
/// on error: the objects are `undo[range]` of the batch's one undo buffer.
enum Done {
    Inflight(PageId, std::ops::Range<usize>),
    Device(PageId, std::ops::Range<usize>),
}

/// Marks the planned objects in flight and the rank's device copies of every page that
/// is stored or being stored; releases the records of refused pages. Returns the answer
/// pages (request order) and the grant's pages. On error the directory and the arena are
/// as they were before the plan.
pub(super) fn apply_store(
    st: &mut DirState,
    arena: &HostArena,
    objs: &[usize],
    hashes: &[PageHash],
    planned: &[Planned],
    session: u32,
) -> Result<(Vec<StorePage>, Vec<GrantPage>), ManagerError> {
    let mut done = Vec::new();
    let mut undo = Vec::new();
    match apply_marks(st, objs, planned, session, &mut done, &mut undo) {
        Ok(()) => {}
        Err(e) => {
            for d in done.into_iter().rev() {
                // Undoing a change that just succeeded on the same indices cannot fail;
                // if it did, the error being returned is the one the caller must see.
                let _ = match d {
                    Done::Inflight(id, r) => st.dir.set_inflight_objects(id, TierKind::Host, &undo[r], false),
                    Done::Device(id, r) => st.dir.set_objects(id, TierKind::Device, &undo[r], false).map(|_| ()),
                };
            }
            unplan_store(st, arena, planned);
            return Err(e.into());
        }
    }
    let mut pages = Vec::with_capacity(planned.len());
    let mut grant_pages = Vec::new();
    for (req_index, (p, hash)) in planned.iter().zip(hashes).enumerate() {
        let status = if p.no_space {
            // Never marked; a record made for it is dropped (a no-op if it has state).
            st.dir.release_if_empty(p.id);
            StoreStatus::NoSpace
        } else if p.objects.is_empty() {
            StoreStatus::AlreadyStored
        } else {
            grant_pages.push(GrantPage {
                req_index,
                page: p.id,
                objects: p.objects.clone(),
            });
            StoreStatus::Write
        };
        pages.push(StorePage {
            hash: *hash,
            status,
            objects: p.objects.clone(),
        });
    }
    Ok((pages, grant_pages))
}

fn apply_marks(
    st: &mut DirState,
    objs: &[usize],
    planned: &[Planned],
    session: u32,
    done: &mut Vec<Done>,
    undo: &mut Vec<usize>,
) -> Result<(), DirectoryError> {
    // One bulk call per page and tier (one side-table change, at most one event)
    // instead of one call per object; the object lists live in one buffer per batch.
    for p in planned.iter().filter(|p| !p.no_space) {
        if !p.objects.is_empty() {
            let start = undo.len();
            undo.extend(p.objects.iter().map(|&(o, _)| o));
            st.dir
                .set_inflight_objects(p.id, TierKind::Host, &undo[start..], true)?;
            done.push(Done::Inflight(p.id, start..undo.len()));
        }
        let start = undo.len();
        if st.dir.has_any(p.id, TierKind::Device) {
            undo.extend(
                objs.iter()
                    .copied()
                    .filter(|&o| !st.dir.objects().has_object(p.id, TierKind::Device, o)),
            );
        } else {
            undo.extend_from_slice(objs);
        }
        if undo.len() > start {
            st.dir.set_objects(p.id, TierKind::Device, &undo[start..], true)?;
            done.push(Done::Device(p.id, start..undo.len()));
        }
        st.dir.order_mut().touch(p.id, false);
        if session != 0 {
            st.dir.order_mut().set_session(p.id, session);
        }
    }
    Ok(())
}
