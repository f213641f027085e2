//! The session policy's pool moves, off the caller's thread and in order.
//!
//! A phase change, a request end or the policy's tick may demote a session's pages to the
//! pool or stage them back: pool I/O that takes as long as the pool does (a 1,000-page
//! session on a slow store is seconds). The policy decides under its lock and returns at
//! once; the moves of each call, with the advice that must follow them (`ReadyToLoad`
//! after staging, a resume after its pages are back), go into [`PolicyMoves`], a bounded
//! queue that one transfer worker at a time drains, oldest first. One drainer keeps a
//! session's demote and its later stage in the order the policy decided them.
//!
//! A session that resumes wants its pages in host before its engine looks again: the
//! phase change that staged them waits, up to [`STAGE_WAIT`], for its own batch (on the
//! blocking thread its command runs on, so other connections are not held up). The
//! policy's tick (on the upkeep task's blocking thread) waits for its moves too, so the
//! watermark eviction that follows it sees the room a demotion made. A phase change that
//! demotes, a request's end and a load's hit never wait.
//!
//! Back-pressure: with [`MOVE_QUEUE`] calls waiting, a caller that may block waits up to
//! [`ROOM_WAIT`] for room (counted as `waited`); one that may not (a transfer worker, a
//! runtime thread), or one still without room, drops its moves (counted as `dropped`,
//! logged). A dropped demote leaves the pages in host, a dropped stage leaves them in the
//! pool, where a load still finds them: nothing is lost, the policy's placement is only
//! late. When the transfer queue is full the drainer runs on the caller's thread (counted
//! as `inline`). Every count is on `/metrics` (`kvtier_policy_moves_total`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::Serialize;

use super::Manager;
use super::policy::{SessionPolicyPart, apply_pool_move};
use super::session_events::AdviceCause;
use crate::policy::{Advice, Move, Usage};

/// Policy calls whose moves may wait for the drainer.
pub const MOVE_QUEUE: usize = 64;
/// Longest a caller waits for room in a full queue before it drops its moves.
pub const ROOM_WAIT: Duration = Duration::from_secs(2);
/// Longest a resuming session's phase change waits for its pages to be staged.
pub const STAGE_WAIT: Duration = Duration::from_secs(5);

/// The pool moves of one policy call and what follows them.
pub(crate) struct MoveBatch {
    pub moves: Vec<Move>,
    pub advice: Vec<Advice>,
    /// Numbered as session events after the moves (a pause or resume the call decided).
    pub events: Option<(AdviceCause, Usage)>,
}

/// What the queue did since the manager started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MoveCounts {
    /// Calls whose moves were queued.
    pub queued: u64,
    /// Calls whose moves have been carried out.
    pub done: u64,
    /// Calls that found the queue full and waited for room (back-pressure).
    pub waited: u64,
    /// Calls whose moves were dropped: the queue stayed full (back-pressure).
    pub dropped: u64,
    /// Drains run on the caller's thread because the transfer queue was full.
    pub inline: u64,
    /// Calls waiting now (a gauge).
    pub depth: u64,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<MoveBatch>,
    /// A drainer is running or submitted: new batches only join the queue.
    draining: bool,
    /// Batches queued and batches finished since the start: batch `n` (1-based) is done
    /// once `finished >= n`, as one drainer finishes them in order.
    pushed: u64,
    finished: u64,
}

/// The bounded, ordered queue of policy moves. See the module docs.
#[derive(Default)]
pub(crate) struct PolicyMoves {
    q: Mutex<Queue>,
    room: Condvar,
    /// Woken when a batch finishes (see [`PolicyMoves::wait_finished`]).
    finished: Condvar,
    queued: AtomicU64,
    done: AtomicU64,
    waited: AtomicU64,
    dropped: AtomicU64,
    inline: AtomicU64,
}

/// What [`PolicyMoves::push`] did with a batch.
enum Pushed {
    /// Queued behind a running drainer, as batch `n`.
    Queued(u64),
    /// Queued as batch `n`, and the caller must start a drainer.
    Start(u64),
    /// Not queued: the queue stayed full.
    Dropped(MoveBatch),
}

impl PolicyMoves {
    fn push(&self, batch: MoveBatch, may_wait: bool) -> Pushed {
        let mut q = self.q.lock();
        if q.waiting.len() >= MOVE_QUEUE {
            if !may_wait {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                return Pushed::Dropped(batch);
            }
            self.waited.fetch_add(1, Ordering::Relaxed);
            let deadline = Instant::now() + ROOM_WAIT;
            while q.waiting.len() >= MOVE_QUEUE {
                if self.room.wait_until(&mut q, deadline).timed_out() && q.waiting.len() >= MOVE_QUEUE {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    return Pushed::Dropped(batch);
                }
            }
        }
        q.waiting.push_back(batch);
        q.pushed += 1;
        self.queued.fetch_add(1, Ordering::Relaxed);
        if q.draining {
            Pushed::Queued(q.pushed)
        } else {
            q.draining = true;
            Pushed::Start(q.pushed)
        }
    }

    /// Counts the oldest popped batch as finished.
    fn finish(&self) {
        self.q.lock().finished += 1;
        self.done.fetch_add(1, Ordering::Relaxed);
        self.finished.notify_all();
    }

    /// Waits until batch `n` is finished or `deadline`; returns whether it finished.
    fn wait_finished(&self, n: u64, deadline: Instant) -> bool {
        let mut q = self.q.lock();
        while q.finished < n {
            if self.finished.wait_until(&mut q, deadline).timed_out() {
                return q.finished >= n;
            }
        }
        true
    }

    /// The oldest batch; `None` ends the drainer (atomically with the check, so a batch
    /// pushed after it sees no drainer and starts one).
    fn pop(&self) -> Option<MoveBatch> {
        let mut q = self.q.lock();
        let b = q.waiting.pop_front();
        if b.is_none() {
            q.draining = false;
        }
        self.room.notify_one();
        b
    }

    fn counts(&self) -> MoveCounts {
        let depth = self.q.lock().waiting.len() as u64;
        MoveCounts {
            queued: self.queued.load(Ordering::Relaxed),
            done: self.done.load(Ordering::Relaxed),
            waited: self.waited.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            inline: self.inline.load(Ordering::Relaxed),
            depth,
        }
    }
}

impl SessionPolicyPart {
    /// Hands one policy call's pool moves to the drainer (see the module docs), which
    /// carries them out on `m`'s tiers. Returns at once unless the queue is full, or,
    /// with `wait_done` (a resume's staging, the tick), once the moves are done or
    /// [`STAGE_WAIT`] has passed.
    pub(super) fn queue_moves(&self, m: &Manager, batch: MoveBatch, wait_done: bool) {
        let moves = &self.moves;
        let may_wait = !crate::transfer::on_worker() && crate::pool::io_guard::may_block();
        let n = match moves.push(batch, may_wait) {
            Pushed::Queued(n) => n,
            Pushed::Start(n) => {
                let owned = m.clone();
                let drain = move || owned.session_policy().drain_moves(&owned);
                if self.xfer.try_submit(Box::new(drain)).is_err() {
                    moves.inline.fetch_add(1, Ordering::Relaxed);
                    self.drain_moves(m);
                }
                n
            }
            Pushed::Dropped(b) => {
                tracing::warn!(
                    moves = b.moves.len(),
                    queue = MOVE_QUEUE,
                    "the policy's move queue is full; moves dropped (pages stay where they are)"
                );
                // The advice still goes out: routers and engines hear of pauses and
                // resumes even when the pages did not move.
                self.finish_moves(m, b.advice, b.events);
                return;
            }
        };
        if wait_done && may_wait && !moves.wait_finished(n, Instant::now() + STAGE_WAIT) {
            tracing::info!(
                wait = ?STAGE_WAIT,
                "the policy's moves are still running; the caller goes on"
            );
        }
    }

    /// Carries out queued batches, oldest first, until the queue is empty.
    fn drain_moves(&self, m: &Manager) {
        while let Some(b) = self.moves.pop() {
            for mv in b.moves {
                apply_pool_move(m, mv);
            }
            self.finish_moves(m, b.advice, b.events);
            self.moves.finish();
        }
    }

    /// The policy's move counters.
    pub fn move_counts(&self) -> MoveCounts {
        self.moves.counts()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::NamespaceId;

    fn batch() -> MoveBatch {
        MoveBatch {
            moves: vec![Move::Demote {
                ns: NamespaceId(0),
                hashes: Vec::new(),
            }],
            advice: Vec::new(),
            events: None,
        }
    }

    #[test]
    fn one_drainer_at_a_time_and_a_full_queue_drops_for_callers_that_may_not_wait() {
        let q = PolicyMoves::default();
        assert!(matches!(q.push(batch(), false), Pushed::Start(1)));
        for i in 1..MOVE_QUEUE {
            assert!(matches!(q.push(batch(), false), Pushed::Queued(n) if n == i as u64 + 1));
        }
        assert!(matches!(q.push(batch(), false), Pushed::Dropped(_)));
        assert_eq!(q.counts().dropped, 1);
        assert_eq!(q.counts().depth, MOVE_QUEUE as u64);
        let mut n = 0;
        let soon = || Instant::now() + Duration::from_millis(1);
        while q.pop().is_some() {
            n += 1;
            assert!(!q.wait_finished(n, soon()), "popped is not finished");
            q.finish();
            assert!(q.wait_finished(n, soon()));
        }
        assert_eq!(n, MOVE_QUEUE as u64);
        // The drainer ended with the empty queue: the next push starts another.
        assert!(matches!(q.push(batch(), false), Pushed::Start(_)));
    }

    #[test]
    fn a_caller_that_may_wait_gets_room_when_the_drainer_takes_a_batch() {
        let q = std::sync::Arc::new(PolicyMoves::default());
        for _ in 0..MOVE_QUEUE {
            let _ = q.push(batch(), false);
        }
        let q2 = q.clone();
        let waiter = std::thread::spawn(move || matches!(q2.push(batch(), true), Pushed::Queued(_)));
        // The waiter counts itself before it sleeps; pop only after that, so the test
        // exercises the wait whatever the scheduling.
        let deadline = Instant::now() + Duration::from_secs(10);
        while q.counts().waited == 0 {
            assert!(Instant::now() < deadline, "the caller never waited");
            std::thread::yield_now();
        }
        assert!(q.pop().is_some());
        assert!(waiter.join().unwrap(), "queued behind the running drainer");
        assert_eq!(q.counts().dropped, 0);
        assert_eq!(q.counts().depth, MOVE_QUEUE as u64);
    }
}
