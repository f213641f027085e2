//! One call's copy shared with idle transfer workers, on data the call borrows.
//!
//! [`TransferEngine::submit_shared`] shares a batch that owns everything it needs. A move
//! that already runs in one call (a `Share` hint's copy to the pool, one job for all the
//! pages it names) has its items borrowed from its own frame instead: arena slots, keys
//! rendered into one buffer. [`TransferEngine::map_pieces`] cuts such a call's items into
//! pieces, queues helper jobs for idle workers, and runs pieces on the calling thread as
//! well, each piece taken by whoever comes first. The caller returns only once every
//! piece is done, so the borrowed data outlives every use.
//!
//! It never waits for a worker to start: the caller takes every piece no helper has
//! taken, so a helper that starts late, or never (every worker busy, the queue full, the
//! caller itself a worker), costs nothing but its queue slot, and when it does run it
//! finds nothing left and returns. The only wait is for pieces another thread is
//! copying at that moment.

use std::any::Any;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};

use super::TransferEngine;

/// Pieces per runner a call is cut into, so a helper that starts late takes fewer of
/// them rather than leaving the others idle at the end.
pub const PIECES_PER_RUNNER: usize = 4;

/// The caller's piece function, with its lifetime erased (see [`Scope::f`]).
type PieceFn = dyn Fn(usize) + Sync + 'static;

/// One call's pieces, shared between its caller and its helper jobs.
struct Scope {
    /// Pieces in all.
    n: usize,
    /// The next piece nobody has taken.
    next: AtomicUsize,
    /// Pieces finished (a panicking one included).
    done: AtomicUsize,
    /// The caller's function. Its real lifetime is the caller's frame: it is called only
    /// by a runner that has just taken a piece below `n`, and the caller does not return
    /// before `done` reaches `n`, which counts that piece; a helper that takes nothing
    /// never touches it.
    f: *const PieceFn,
    /// The first panic of a piece, resumed on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    lock: Mutex<()>,
    all_done: Condvar,
}

// SAFETY: `f` points to a `Sync` function, so calling it from several threads at once is
// what its type allows; the rest is atomics and locks. See `Scope::f` for why it is alive
// whenever it is called.
unsafe impl Send for Scope {}
// SAFETY: as above.
unsafe impl Sync for Scope {}

impl Scope {
    /// Runs pieces nobody has taken until none is left.
    fn run(&self) {
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            if k >= self.n {
                return;
            }
            // SAFETY: piece `k` is ours and not yet counted done, so the caller is still
            // waiting and its function alive (see `Scope::f`).
            let f = unsafe { &*self.f };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(k))) {
                self.panic.lock().get_or_insert(p);
            }
            // Release publishes the piece's writes to the caller, whose acquire load of
            // `done` sees them. Taking the lock orders the wake-up after the caller's check.
            if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
                let _g = self.lock.lock();
                self.all_done.notify_all();
            }
        }
    }
}

/// The contiguous index ranges that cut `n` items into at most `pieces` pieces of near
/// equal size, in order.
pub fn cut(n: usize, pieces: usize) -> Vec<Range<usize>> {
    let pieces = pieces.clamp(1, n.max(1));
    (0..pieces)
        .map(|k| k * n / pieces..(k + 1) * n / pieces)
        .filter(|r| !r.is_empty())
        .collect()
}

impl TransferEngine {
    /// Runs `f(k)` once for every `k < n`, on the calling thread and on up to
    /// `runners - 1` idle workers, and returns when all have run (see the module docs).
    /// A panic of any piece is resumed here, after every piece has ended.
    pub fn run_scoped(&self, n: usize, runners: usize, f: &(dyn Fn(usize) + Sync)) {
        if runners <= 1 || n <= 1 {
            (0..n).for_each(f);
            return;
        }
        // SAFETY: only the lifetime changes; `Scope::f` says why the function is alive
        // whenever it is called through this pointer.
        let f = unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const PieceFn>(f) };
        let scope = Arc::new(Scope {
            n,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            f,
            panic: Mutex::new(None),
            lock: Mutex::new(()),
            all_done: Condvar::new(),
        });
        for _ in 1..runners.min(n) {
            let s = scope.clone();
            // A full queue refuses the helper: the caller takes its share.
            if self.try_submit(Box::new(move || s.run())).is_err() {
                break;
            }
        }
        scope.run();
        // Only pieces that another thread is running now are left: no wait for a worker
        // to start, and each piece is bounded by its own copy.
        let mut g = scope.lock.lock();
        while scope.done.load(Ordering::Acquire) < n {
            scope.all_done.wait(&mut g);
        }
        drop(g);
        if let Some(p) = scope.panic.lock().take() {
            resume_unwind(p);
        }
    }

    /// Cuts `n` items into pieces ([`PIECES_PER_RUNNER`] per runner), runs `piece` on each
    /// range as [`run_scoped`](Self::run_scoped) does, and returns the pieces' results
    /// joined in item order (each piece returns one result per item of its range).
    pub fn map_pieces<T: Send + Sync>(
        &self,
        n: usize,
        runners: usize,
        piece: impl Fn(Range<usize>) -> Vec<T> + Sync,
    ) -> Vec<T> {
        if runners <= 1 {
            return piece(0..n);
        }
        let pieces = cut(n, runners * PIECES_PER_RUNNER);
        let out: Vec<OnceLock<Vec<T>>> = pieces.iter().map(|_| OnceLock::new()).collect();
        self.run_scoped(pieces.len(), runners, &|k| {
            let _ = out[k].set(piece(pieces[k].clone()));
        });
        // Every piece ran (a panic would have been resumed above).
        out.into_iter()
            .flat_map(|o| o.into_inner().unwrap_or_default())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    #[test]
    fn cut_covers_every_item_once_in_order() {
        for (n, pieces) in [(0, 4), (1, 8), (7, 3), (64, 8), (256, 8), (5, 0)] {
            let r = cut(n, pieces);
            let flat: Vec<usize> = r.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>(), "n {n} pieces {pieces}");
            assert!(r.len() <= pieces.max(1), "n {n}: {} pieces", r.len());
        }
    }

    /// Every item of borrowed data is handled once, results come back in item order, and
    /// the pieces ran on more than one thread when a worker was idle.
    #[test]
    fn pieces_of_borrowed_data_run_once_each_in_order_on_several_threads() {
        let engine = TransferEngine::new(2, 16);
        let data: Vec<u64> = (0..1000).collect();
        let runs: Vec<AtomicUsize> = (0..data.len()).map(|_| AtomicUsize::new(0)).collect();
        let threads = Mutex::new(std::collections::HashSet::new());
        let mut several = false;
        // A worker may be slow to wake on a loaded machine: a few tries, each of which must
        // still be exact; one of them must have had help.
        for _ in 0..50 {
            runs.iter().for_each(|r| r.store(0, Ordering::SeqCst));
            threads.lock().clear();
            let out = engine.map_pieces(data.len(), 3, |r: Range<usize>| {
                threads.lock().insert(std::thread::current().id());
                // Long enough per piece that an idle worker takes some.
                std::thread::sleep(Duration::from_millis(1));
                r.map(|i| {
                    runs[i].fetch_add(1, Ordering::SeqCst);
                    data[i] * 2
                })
                .collect()
            });
            assert_eq!(out, data.iter().map(|d| d * 2).collect::<Vec<_>>());
            assert!(runs.iter().all(|r| r.load(Ordering::SeqCst) == 1), "each item once");
            if threads.lock().len() > 1 {
                several = true;
                break;
            }
        }
        assert!(several, "no worker ever took a piece");
        assert!(engine.wait_idle(Duration::from_secs(10)));
    }

    /// With every worker busy the caller does all the pieces itself, without waiting.
    #[test]
    fn a_busy_engine_leaves_every_piece_to_the_caller() {
        let engine = TransferEngine::new(1, 4);
        let (tx, rx) = crossbeam_channel::bounded::<()>(1);
        let (started_tx, started) = crossbeam_channel::bounded::<()>(1);
        assert!(
            engine
                .try_submit(Box::new(move || {
                    let _ = started_tx.send(());
                    let _ = rx.recv_timeout(Duration::from_secs(60));
                }))
                .is_ok()
        );
        started.recv_timeout(Duration::from_secs(60)).unwrap();
        let me = std::thread::current().id();
        let out = engine.map_pieces(40, 2, |r: Range<usize>| {
            assert_eq!(std::thread::current().id(), me);
            r.collect()
        });
        assert_eq!(out, (0..40).collect::<Vec<_>>());
        drop(tx);
        assert!(engine.wait_idle(Duration::from_secs(10)));
    }

    /// A panicking piece is resumed on the caller, after every other piece has ended.
    #[test]
    fn a_panicking_piece_is_resumed_on_the_caller_after_the_others_end() {
        let engine = TransferEngine::new(2, 8);
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            engine.run_scoped(16, 3, &|k| {
                ran.fetch_add(1, Ordering::SeqCst);
                assert_ne!(k, 5, "piece 5 fails");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(Ordering::SeqCst), 16, "every piece ran once");
        assert!(engine.wait_idle(Duration::from_secs(10)));
    }
}
