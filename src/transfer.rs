//! The transfer engine: page moves on worker threads, behind a bounded queue.
//!
//! A job is one batch of page moves, built by the manager with everything it needs (slot
//! reservations, buffers) and committed by itself when done; the engine only runs jobs.
//! The queue is bounded: when it is full, [`TransferEngine::try_submit`] hands the job
//! back, and the caller defers the work (a hint becomes `deferred`), never drops it.
//! [`Tickets`] lets callers wait, with a timeout, for a job's result.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError, bounded};
use parking_lot::{Condvar, Mutex};

mod scoped;

/// A unit of work for a transfer worker.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

thread_local! {
    static ON_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a transfer worker. Work that would wait for other jobs
/// must not do so from a worker: with every worker waiting, the jobs would never run.
pub fn on_worker() -> bool {
    ON_WORKER.with(|w| w.get())
}

/// A fixed pool of transfer workers fed by a bounded queue.
pub struct TransferEngine {
    tx: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    capacity: usize,
    queued: Receiver<Job>,
    /// Jobs submitted and not yet finished (queued or running).
    pending: Arc<PendingCount>,
}

/// Jobs submitted and not yet finished, and a condvar that wakes idle waiters when the
/// count reaches zero (so waiting for quiet is not a sleep loop).
#[derive(Default)]
struct PendingCount {
    n: AtomicUsize,
    lock: Mutex<()>,
    idle: Condvar,
}

/// Counts a job as pending from submission until it has run or been dropped unrun.
struct Pending(Arc<PendingCount>);

impl Drop for Pending {
    fn drop(&mut self) {
        if self.0.n.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Taking the lock orders this wake-up after a waiter's check of the count.
            let _g = self.0.lock.lock();
            self.0.idle.notify_all();
        }
    }
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("workers", &self.workers.len())
            .field("capacity", &self.capacity)
            .field("queued", &self.queued.len())
            .finish()
    }
}

impl TransferEngine {
    /// `threads` workers and a queue of `capacity` jobs.
    pub fn new(threads: usize, capacity: usize) -> Self {
        Self::configured(threads, capacity, 0, &[])
    }

    /// [`TransferEngine::new`], with workers that lower their CPU priority by `nice`
    /// steps when they start ([`crate::priority`]): copies and pool I/O then yield the
    /// core to the daemon's control thread. With `cores`, worker `i` pins itself to
    /// `cores[i % cores.len()]` ([`crate::affinity`]): workers woken together then never
    /// wait in one core's queue while another core idles.
    pub fn configured(threads: usize, capacity: usize, nice: u8, cores: &[usize]) -> Self {
        let (tx, rx) = bounded::<Job>(capacity.max(1));
        let workers = (0..threads.max(1))
            .map(|i| {
                let rx = rx.clone();
                let core = crate::affinity::nth_core(cores, i);
                std::thread::Builder::new()
                    .name(format!("kvtier-xfer-{i}"))
                    .spawn(move || {
                        ON_WORKER.with(|w| w.set(true));
                        if let Some(core) = core
                            && let Err(e) = crate::affinity::pin(0, &[core])
                        {
                            // Still a worker, placed by the scheduler.
                            tracing::warn!(error = %e, core, "a transfer worker could not pin itself to its core");
                        }
                        if let Err(e) = crate::priority::lower_this_thread(nice) {
                            // Still a worker, at the control thread's priority.
                            tracing::warn!(error = %e, nice, "a transfer worker could not lower its priority");
                        }
                        while let Ok(job) = rx.recv() {
                            // A panicking job must not take the worker down with it; the job's
                            // own guard (see the manager) fails its ticket.
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        }
                    })
                    .expect("spawning a transfer worker")
            })
            .collect();
        Self {
            tx: Some(tx),
            workers,
            capacity,
            queued: rx,
            pending: Arc::new(PendingCount::default()),
        }
    }

    fn counted(&self, job: Job) -> Job {
        self.pending.n.fetch_add(1, Ordering::SeqCst);
        let p = Pending(self.pending.clone());
        Box::new(move || {
            let _p = p;
            job();
        })
    }

    /// Whether every submitted job has finished.
    pub fn idle(&self) -> bool {
        self.pending.n.load(Ordering::SeqCst) == 0
    }

    /// Waits up to `timeout` until every submitted job has finished; returns whether they
    /// did. Woken by the last job to finish, not by polling.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut g = self.pending.lock.lock();
        while !self.idle() {
            if self.pending.idle.wait_until(&mut g, deadline).timed_out() {
                return self.idle();
            }
        }
        true
    }

    /// Queues a job, or gives it back when the queue is full.
    pub fn try_submit(&self, job: Job) -> Result<(), Job> {
        let job = self.counted(job);
        match self.tx.as_ref() {
            Some(tx) => tx.try_send(job).map_err(|e| match e {
                TrySendError::Full(j) | TrySendError::Disconnected(j) => j,
            }),
            None => Err(job),
        }
    }

    /// Queues a job, waiting up to `timeout` for room.
    pub fn submit_timeout(&self, job: Job, timeout: Duration) -> Result<(), Job> {
        let job = self.counted(job);
        match self.tx.as_ref() {
            Some(tx) => tx.send_timeout(job, timeout).map_err(|e| e.into_inner()),
            None => Err(job),
        }
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// How many workers should share one batch of `bytes`: every worker, as long as each
    /// gets at least [`MIN_SHARE_BYTES`]. A batch copied on one worker leaves the others
    /// idle, and the batches a caller submits one after another start one caller's
    /// call apart; sharing each batch lets every worker start on the first one.
    pub fn runners(&self, bytes: u64) -> usize {
        runners(self.threads(), bytes)
    }

    /// Queues a batch of `n` items that up to `runners` workers share: one job that owns
    /// the batch (waiting up to `timeout` for queue room) and `runners - 1` helpers, each
    /// queued only if there is room right away. Every worker that runs one of them takes
    /// the next item not yet taken, so the batch needs no even split and a helper that
    /// starts late (or is refused) only means the others take more. `item(i)` runs once
    /// per item and says whether it succeeded; `finish` runs once, on the worker that
    /// ends the last item, with every item's result in order.
    ///
    /// When the owning job cannot be queued it is handed back; dropping it (with no helper
    /// queued, none is) drops `finish` unrun, so a guard it holds settles the work. The
    /// same happens when an item panics: the batch never ends, and `finish` is dropped
    /// with the last job that holds the batch.
    pub fn submit_shared(
        &self,
        n: usize,
        runners: usize,
        item: impl Fn(usize) -> bool + Send + Sync + 'static,
        finish: impl FnOnce(Vec<bool>) + Send + 'static,
        timeout: Duration,
    ) -> Result<(), Job> {
        let batch = Arc::new(SharedBatch {
            next: AtomicUsize::new(0),
            left: AtomicUsize::new(n),
            ok: (0..n).map(|_| AtomicBool::new(false)).collect(),
            item: Box::new(item),
            finish: Mutex::new(Some(Box::new(finish))),
        });
        // Helpers hold the batch weakly: the owning job alone keeps it alive until it
        // runs, so a batch whose owner is dropped unrun is dropped with it.
        let helpers: Vec<_> = (1..runners.min(n)).map(|_| Arc::downgrade(&batch)).collect();
        self.submit_timeout(Box::new(move || batch.run()), timeout)?;
        for weak in helpers {
            let helper: Job = Box::new(move || {
                if let Some(batch) = weak.upgrade() {
                    batch.run();
                }
            });
            if self.try_submit(helper).is_err() {
                break;
            }
        }
        Ok(())
    }

    /// Jobs waiting for a worker.
    pub fn queued(&self) -> usize {
        self.queued.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        // Closing the queue lets workers finish what is queued and exit.
        self.tx.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// What ends a shared batch, given every item's result.
type Finish = Box<dyn FnOnce(Vec<bool>) + Send>;

/// A batch that several workers share item by item (see [`TransferEngine::submit_shared`]).
struct SharedBatch {
    /// The next item not yet taken.
    next: AtomicUsize,
    /// Items not yet ended; whoever ends the last runs `finish`.
    left: AtomicUsize,
    ok: Vec<AtomicBool>,
    item: Box<dyn Fn(usize) -> bool + Send + Sync>,
    finish: Mutex<Option<Finish>>,
}

impl SharedBatch {
    fn run(&self) {
        if self.ok.is_empty() {
            self.finish();
            return;
        }
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(ok) = self.ok.get(i) else { return };
            ok.store((self.item)(i), Ordering::Relaxed);
            // Release publishes this item's result (and its copy) to whoever ends the
            // batch; that one's acquire sees every item's.
            if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
                self.finish();
                return;
            }
        }
    }

    fn finish(&self) {
        let finish = self.finish.lock().take();
        if let Some(f) = finish {
            f(self.ok.iter().map(|b| b.load(Ordering::Relaxed)).collect());
        }
    }
}

/// Least bytes worth waking another worker for: below this, the wake-up of a parked
/// thread (tens of microseconds on a busy or virtual machine) costs more than the share
/// of the copy it would take.
pub const MIN_SHARE_BYTES: u64 = 1 << 20;

/// Workers that share a batch of `bytes` on an engine of `threads` workers (at least one).
pub fn runners(threads: usize, bytes: u64) -> usize {
    let most = usize::try_from(bytes / MIN_SHARE_BYTES).unwrap_or(usize::MAX);
    threads.min(most).max(1)
}

/// Identifies one asynchronous operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Ticket(pub u64);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TicketError {
    #[error("unknown ticket {0}")]
    Unknown(u64),
    #[error("timed out waiting for ticket {0}")]
    Timeout(u64),
    #[error("too many operations in flight ({0}); collect completions first")]
    TooMany(usize),
}

/// Results of asynchronous operations, waited for by ticket. Bounded: at most `max`
/// operations may be outstanding (issued and not yet collected).
///
/// A completion wakes waiters only when someone waits for that ticket: a caller that
/// queued several operations and waits for the last is not woken by each of the others
/// (on a machine with as many busy workers as cores, every wake-up takes a core from a
/// copy).
#[derive(Debug)]
pub struct Tickets<T> {
    inner: Mutex<TicketState<T>>,
    cond: Condvar,
    max: usize,
}

#[derive(Debug)]
struct TicketState<T> {
    next: u64,
    pending: HashMap<u64, Slot<T>>,
}

#[derive(Debug)]
struct Slot<T> {
    result: Option<T>,
    /// A caller sleeps until this ticket completes.
    waited: bool,
}

impl<T: Clone> Tickets<T> {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(TicketState {
                next: 1,
                pending: HashMap::new(),
            }),
            cond: Condvar::new(),
            max,
        })
    }

    /// Issues a ticket for an operation that will be completed later.
    pub fn issue(&self) -> Result<Ticket, TicketError> {
        let mut s = self.inner.lock();
        if s.pending.len() >= self.max {
            return Err(TicketError::TooMany(self.max));
        }
        let t = s.next;
        s.next += 1;
        s.pending.insert(
            t,
            Slot {
                result: None,
                waited: false,
            },
        );
        Ok(Ticket(t))
    }

    /// Records the result of an operation.
    pub fn complete(&self, t: Ticket, result: T) {
        let mut s = self.inner.lock();
        let wake = match s.pending.get_mut(&t.0) {
            Some(slot) => {
                slot.result = Some(result);
                slot.waited
            }
            None => false,
        };
        drop(s);
        if wake {
            self.cond.notify_all();
        }
    }

    /// Waits up to `timeout` for the result and collects it.
    pub fn wait(&self, t: Ticket, timeout: Duration) -> Result<T, TicketError> {
        let deadline = Instant::now() + timeout;
        let mut s = self.inner.lock();
        loop {
            let Some(slot) = s.pending.get_mut(&t.0) else {
                return Err(TicketError::Unknown(t.0));
            };
            if let Some(r) = slot.result.take() {
                s.pending.remove(&t.0);
                return Ok(r);
            }
            slot.waited = true;
            if self.cond.wait_until(&mut s, deadline).timed_out() {
                // Another waiter of the same ticket may still sleep on it: leave the mark.
                return Err(TicketError::Timeout(t.0));
            }
        }
    }

    /// Collects every finished result without waiting.
    pub fn poll(&self) -> Vec<(Ticket, T)> {
        let mut done = Vec::new();
        self.inner.lock().pending.retain(|&k, slot| match slot.result.take() {
            Some(r) => {
                done.push((Ticket(k), r));
                false
            }
            None => true,
        });
        done
    }

    pub fn outstanding(&self) -> usize {
        self.inner.lock().pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A gate that holds the jobs waiting on it until it is opened. It records
    /// that a job reached it, so a test knows a worker is taken without
    /// sleeping, and its `Opener` opens it on drop, so a failed assertion never
    /// leaves a worker blocked while the engine's drop joins it.
    #[derive(Clone, Default)]
    struct Gate(Arc<(Mutex<GateState>, Condvar)>);

    #[derive(Default)]
    struct GateState {
        reached: usize,
        open: bool,
    }

    struct Opener(Gate);

    impl Drop for Opener {
        fn drop(&mut self) {
            self.0.open();
        }
    }

    impl Gate {
        fn wait(&self) {
            let mut st = self.0.0.lock();
            st.reached += 1;
            self.0.1.notify_all();
            while !st.open {
                self.0.1.wait(&mut st);
            }
        }

        fn open(&self) {
            self.0.0.lock().open = true;
            self.0.1.notify_all();
        }

        fn opener(&self) -> Opener {
            Opener(self.clone())
        }

        /// Waits until `n` jobs are held at the gate; a loaded machine may
        /// take a while to start a worker, so the deadline is generous.
        fn await_reached(&self, n: usize) {
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            let mut st = self.0.0.lock();
            while st.reached < n {
                assert!(
                    !self.0.1.wait_until(&mut st, deadline).timed_out() || st.reached >= n,
                    "{} of {n} jobs reached the gate within 60 s",
                    st.reached
                );
            }
        }
    }

    #[test]
    fn full_queue_hands_the_job_back_and_all_queued_jobs_run() {
        let engine = TransferEngine::new(1, 2);
        let gate = Gate::default();
        let _opener = gate.opener();
        let ran = Arc::new(AtomicUsize::new(0));
        let g = gate.clone();
        // Block the only worker.
        assert!(engine.try_submit(Box::new(move || g.wait())).is_ok());
        gate.await_reached(1);
        for _ in 0..2 {
            let r = ran.clone();
            assert!(
                engine
                    .try_submit(Box::new(move || {
                        r.fetch_add(1, Ordering::SeqCst);
                    }))
                    .is_ok()
            );
        }
        let r = ran.clone();
        let back = engine.try_submit(Box::new(move || {
            r.fetch_add(100, Ordering::SeqCst);
        }));
        assert!(back.is_err(), "a full queue must hand the job back");
        gate.open();
        drop(engine);
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn wait_idle_returns_when_the_last_job_ends_and_times_out_while_one_runs() {
        let engine = TransferEngine::new(2, 8);
        let gate = Gate::default();
        let _opener = gate.opener();
        let ran = Arc::new(AtomicUsize::new(0));
        for _ in 0..3 {
            let (g, r) = (gate.clone(), ran.clone());
            assert!(
                engine
                    .try_submit(Box::new(move || {
                        g.wait();
                        r.fetch_add(1, Ordering::SeqCst);
                    }))
                    .is_ok()
            );
        }
        assert!(!engine.wait_idle(Duration::from_millis(20)), "jobs are still blocked");
        assert_eq!(ran.load(Ordering::SeqCst), 0);
        gate.open();
        assert!(engine.wait_idle(Duration::from_secs(10)));
        assert_eq!(ran.load(Ordering::SeqCst), 3, "idle only after every job ran");
        assert!(engine.idle());
    }

    /// Sets its flag when dropped: shows that a `finish` closure was dropped unrun.
    struct Dropped(Arc<AtomicUsize>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Waits for `finish`'s report: the results it was given.
    fn shared_run(
        engine: &TransferEngine,
        n: usize,
        runners: usize,
        item: impl Fn(usize) -> bool + Send + Sync + 'static,
    ) -> Vec<bool> {
        let (tx, rx) = bounded(1);
        let finish = move |ok: Vec<bool>| tx.send(ok).unwrap();
        assert!(
            engine
                .submit_shared(n, runners, item, finish, Duration::from_secs(5))
                .is_ok()
        );
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    }

    #[test]
    fn a_shared_batch_runs_every_item_once_on_several_workers_and_finishes_once() {
        let engine = TransferEngine::new(3, 16);
        for (n, runners) in [(1, 3), (2, 3), (97, 3), (97, 1), (5, 8)] {
            let runs: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
            let threads = Arc::new(Mutex::new(std::collections::HashSet::new()));
            let (r, th) = (runs.clone(), threads.clone());
            // With 97 items every runner must get a share: an item waits (with
            // a deadline) until every runner has started, so a loaded machine
            // that is slow to wake a worker cannot let one runner take them all.
            let need = if n == 97 { runners.min(3) } else { 0 };
            let ok = shared_run(&engine, n, runners, move |i| {
                r[i].fetch_add(1, Ordering::SeqCst);
                th.lock().insert(std::thread::current().id());
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                while th.lock().len() < need && std::time::Instant::now() < deadline {
                    std::thread::yield_now();
                }
                i % 7 != 3
            });
            let want: Vec<bool> = (0..n).map(|i| i % 7 != 3).collect();
            assert_eq!(ok, want, "n {n}: results in item order");
            assert!(
                runs.iter().all(|c| c.load(Ordering::SeqCst) == 1),
                "n {n}: each item once"
            );
            let used = threads.lock().len();
            assert!(
                used <= runners.min(n).min(3),
                "n {n}: {used} threads for {runners} runners"
            );
            if n == 97 {
                assert_eq!(used, runners, "n {n}: {runners} runners");
            }
        }
        assert!(engine.wait_idle(Duration::from_secs(10)));
    }

    #[test]
    fn an_empty_shared_batch_still_finishes() {
        let engine = TransferEngine::new(2, 4);
        assert_eq!(shared_run(&engine, 0, 2, |_| unreachable!()), Vec::<bool>::new());
    }

    #[test]
    fn a_shared_batch_that_cannot_be_queued_drops_its_finish_unrun() {
        let engine = TransferEngine::new(1, 1);
        let gate = Gate::default();
        let _opener = gate.opener();
        let g = gate.clone();
        // The only worker is busy and the one queue slot taken.
        assert!(engine.try_submit(Box::new(move || g.wait())).is_ok());
        gate.await_reached(1);
        assert!(engine.try_submit(Box::new(|| {})).is_ok());
        let (ran, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (r, d) = (ran.clone(), Dropped(dropped.clone()));
        let back = engine.submit_shared(
            4,
            2,
            move |_| {
                r.fetch_add(1, Ordering::SeqCst);
                true
            },
            move |_| drop(d),
            Duration::from_millis(10),
        );
        let job = back.expect_err("a full queue hands the owning job back");
        assert_eq!(dropped.load(Ordering::SeqCst), 0, "held by the handed-back job");
        drop(job);
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "dropped with the job, unrun");
        gate.open();
        assert!(engine.wait_idle(Duration::from_secs(10)));
        assert_eq!(ran.load(Ordering::SeqCst), 0, "no item ran");
    }

    #[test]
    fn a_panicking_item_drops_finish_unrun_once_every_runner_is_done() {
        let engine = TransferEngine::new(2, 8);
        let (finished, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (f, d) = (finished.clone(), Dropped(dropped.clone()));
        let submitted = engine.submit_shared(
            6,
            2,
            |i| {
                assert_ne!(i, 2, "item 2 fails hard");
                true
            },
            move |_| {
                let _d = d;
                f.fetch_add(1, Ordering::SeqCst);
            },
            Duration::from_secs(5),
        );
        assert!(submitted.is_ok());
        assert!(engine.wait_idle(Duration::from_secs(10)));
        assert_eq!(finished.load(Ordering::SeqCst), 0, "the batch never ended");
        assert_eq!(dropped.load(Ordering::SeqCst), 1, "its finish was dropped");
    }

    #[test]
    fn tickets_wait_time_out_and_are_bounded() {
        let t: Arc<Tickets<u32>> = Tickets::new(2);
        let a = t.issue().unwrap();
        let b = t.issue().unwrap();
        assert_eq!(t.issue(), Err(TicketError::TooMany(2)));
        assert_eq!(t.wait(a, Duration::from_millis(5)), Err(TicketError::Timeout(a.0)));
        let t2 = t.clone();
        let h = std::thread::spawn(move || t2.complete(a, 7));
        assert_eq!(t.wait(a, Duration::from_secs(5)), Ok(7));
        h.join().unwrap();
        assert_eq!(t.wait(a, Duration::ZERO), Err(TicketError::Unknown(a.0)));
        t.complete(b, 9);
        assert_eq!(t.poll(), vec![(b, 9)]);
        assert_eq!(t.outstanding(), 0);
    }

    /// A caller asleep on the last of three tickets is woken by that one's completion
    /// (the others, which nobody waits for, only record their results), and collects the
    /// others afterwards without waiting.
    #[test]
    fn a_waiter_of_one_ticket_gets_it_and_the_others_stay_collectable() {
        let t: Arc<Tickets<u32>> = Tickets::new(8);
        let [a, b, c] = [(); 3].map(|_| t.issue().unwrap());
        let t2 = t.clone();
        let h = std::thread::spawn(move || {
            // Completes only once the caller sleeps on `c`, so the wake-up is needed.
            let deadline = Instant::now() + Duration::from_secs(30);
            while !t2.inner.lock().pending.get(&c.0).is_some_and(|s| s.waited) {
                assert!(Instant::now() < deadline, "the caller never waited on c");
                std::thread::yield_now();
            }
            for (tk, v) in [(a, 1), (b, 2)] {
                assert!(!t2.inner.lock().pending[&tk.0].waited, "nobody waits on {tk:?}");
                t2.complete(tk, v);
            }
            t2.complete(c, 3);
        });
        assert_eq!(t.wait(c, Duration::from_secs(30)), Ok(3));
        h.join().unwrap();
        assert_eq!(t.wait(a, Duration::ZERO), Ok(1));
        assert_eq!(t.wait(b, Duration::ZERO), Ok(2));
        assert_eq!(t.outstanding(), 0);
    }
}
