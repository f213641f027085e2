//! The library's side of restart fencing and slot generations, so that no engine has to
//! do anything for either.
//!
//! Fencing: the library draws a random token once and sends it after every `Connect`
//! (`Request::Fence`); the daemon marks the slots of this library's store grants with it.
//! A daemon that died and came back quarantines the slots of grants that were open; the
//! library, reconnecting, says `done` once no [`StorePlan`](super::StorePlan) of an
//! earlier connection is alive (each was committed, aborted or dropped, so no copy into
//! those slots can still be running), and the daemon frees them at once instead of at
//! the fence timeout. While one is alive, `done` waits for the first call after it.
//!
//! Generations: a store's copy marks each slot in copy before its bytes and stamps the
//! generation its grant carried after them, and reports a page not written when another
//! copy ran into one of its slots meanwhile; a load checks the stamps after its copy and
//! counts only the leading pages whose stamps hold (see `crate::tier::slot_gen`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::protocol::{GrantPage, ObjectSlot, Request, Response};
use crate::tier::slot_gen::{self, SlotStamps};

use super::conn::Conn;
use super::{Client, ClientError};

/// A random token, never 0 nor `u64::MAX` (the daemon's "no token" marks).
pub(super) fn new_token() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `b` is 8 writable bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    let mut t = u64::from_le_bytes(b);
    if n != 8 {
        // No entropy source: unique enough among this node's processes.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        use std::hash::BuildHasher;
        t = std::collections::hash_map::RandomState::new().hash_one((now, std::process::id()));
    }
    t.clamp(1, u64::MAX - 1)
}

/// A store plan alive: counted on its connection until dropped.
#[derive(Debug)]
pub(super) struct Live(Arc<AtomicUsize>);

impl Live {
    pub fn new(plans: &Arc<AtomicUsize>) -> Self {
        plans.fetch_add(1, Ordering::AcqRel);
        Self(plans.clone())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Client {
    /// Whether no plan of an earlier connection is alive (forgets the finished ones).
    fn earlier_done(&self) -> bool {
        let mut stale = self.stale.lock();
        stale.retain(|p| p.load(Ordering::Acquire) > 0);
        stale.is_empty()
    }

    /// A connection was dropped: its live plans are earlier ones from now on.
    pub(super) fn retire(&self, conn: Option<Conn>) {
        if let Some(c) = conn
            && c.plans.load(Ordering::Acquire) > 0
        {
            self.stale.lock().push(c.plans);
        }
    }

    /// Whether a `done` is owed and may be said now.
    pub(super) fn may_say_done(&self) -> bool {
        self.owes_done.load(Ordering::Acquire) && self.earlier_done()
    }

    /// Sends this library's token on `conn`, with `done` when no earlier plan is alive.
    /// Only a transport failure is an error (a daemon that knows no fencing refuses the
    /// request, and that is all).
    pub(super) fn announce(&self, conn: &mut Conn) -> Result<(), ClientError> {
        let done = self.earlier_done();
        let req = Request::Fence {
            token: self.token,
            done,
        };
        match conn.call(&req, self.cfg.max_frame_bytes)? {
            Response::Ok => self.owes_done.store(!done, Ordering::Release),
            r => tracing::debug!(answer = ?r, "the daemon took no fence token"),
        }
        Ok(())
    }
}

/// Phase one of a store's copy (`crate::tier::slot_gen`): marks every granted slot of
/// `pages` in copy, then fences, before any byte. Returns what each stamp held, in order.
pub(super) fn begin_copy(stamps: Option<&SlotStamps>, pages: &[GrantPage]) -> Vec<u64> {
    let Some(st) = stamps else { return Vec::new() };
    let before = slots(pages)
        .map(|s| {
            if s.generation == 0 {
                0
            } else {
                st.begin_copy(s.slot, s.generation)
            }
        })
        .collect();
    slot_gen::copy_fence();
    before
}

/// Phase two, after the bytes (whether or not the copy succeeded, so no marker outlives
/// it): stamps each slot's generation. Returns, per page, whether every slot vouches for
/// this copy's bytes (no other copy ran into it meanwhile).
pub(super) fn end_copy(stamps: Option<&SlotStamps>, pages: &[GrantPage], before: &[u64]) -> Vec<bool> {
    let Some(st) = stamps else {
        return vec![true; pages.len()];
    };
    slot_gen::copy_fence();
    let mut at = before.iter();
    pages
        .iter()
        .map(|p| {
            p.slots.iter().fold(true, |ok, s| {
                let b = at.next().copied().unwrap_or_default();
                // Every slot is ended, whatever the others found.
                (s.generation == 0 || st.end_copy(s.slot, s.generation, b)) && ok
            })
        })
        .collect()
}

fn slots(pages: &[GrantPage]) -> impl Iterator<Item = &ObjectSlot> {
    pages.iter().flat_map(|p| p.slots.iter())
}

/// How many leading pages hold the generations their load grant carried (after the copy
/// out of them: fences first). A generation without stamps to check it against holds
/// nothing.
pub(super) fn held(stamps: Option<&SlotStamps>, pages: &[Vec<ObjectSlot>]) -> usize {
    slot_gen::copy_fence();
    pages
        .iter()
        .take_while(|p| match stamps {
            Some(st) => st.hold(p.iter().map(|s| (s.slot, s.generation))),
            None => p.iter().all(|s| s.generation == 0),
        })
        .count()
}
