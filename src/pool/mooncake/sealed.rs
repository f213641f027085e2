//! Puts and gets with the integrity MAC ([`super::integrity`]).
//!
//! An object is `page bytes ‖ MAC(32)`. Where the caller's bytes start a host arena slot
//! (a slot holds one object, from its start) with at least 32 free bytes after them (the daemon fits its slots to
//! the objects plus these 32 bytes by default), the object moves straight between that slot and the
//! store: a put writes the MAC into the slot's tail and sends `len + 32` bytes from the
//! slot; a get lands `len + 32` bytes in the slot and checks them there, before the call
//! returns, so no caller ever sees a slot whose MAC failed as loaded. Other objects go
//! through the staging region, copied and hashed there. A batch is cut into parts of
//! [`PART_BYTES`], each one request to the helper from the calling thread, pipelined with
//! the MAC on one scoped thread ([`overlapped`]): a put hashes part `n + 1` while part `n`
//! moves, a get checks part `n` while part `n + 1` moves. A batch of one part hashes on
//! several threads ([`par_each`]) while its existence query waits on the master.
//!
//! An object that fails its MAC is a miss (`NotFound`), is counted, and is removed from
//! the store, so neither this daemon's lookups nor a peer's credit it again. A put first
//! asks which of its keys are taken (while it hashes) and checks the objects there; one that fails its MAC
//! (a pre-put by someone without the cluster key) is removed and the page put again, so
//! the owner's page stays loadable.

use std::ops::Range;

use super::codes;
use super::integrity::{Integrity, MAC_LEN};
use super::pool::MooncakePool;
use super::wire::Op;
use crate::pool::{PoolBackend, PoolError};

/// Fewest bytes in a batch worth hashing on more than one thread.
const PAR_MIN_BYTES: usize = 1 << 20;

/// Most threads one batch's MACs use.
const PAR_MAX_THREADS: usize = 8;

/// Bytes of one part of a sealed batch, each one request to the helper.
/// Each request costs the wheel a round of master calls, so parts are large: 4 MiB parts
/// made a 64 MiB batch of 64 KiB objects 16 requests where the raw client
/// makes one (the wheel's own client, given 64-object batches, took about twice as long
/// as with 1024-object ones).
const PART_BYTES: usize = 16 << 20;

/// `lens` cut into contiguous parts of about [`PART_BYTES`] (at least one object each).
fn parts(lens: &[usize]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut acc) = (0, 0);
    for (i, &l) in lens.iter().enumerate() {
        acc += l;
        if acc >= PART_BYTES {
            out.push(start..i + 1);
            (start, acc) = (i + 1, 0);
        }
    }
    if start < lens.len() || out.is_empty() {
        out.push(start..lens.len());
    }
    out
}

/// Runs `f` on every job, on up to [`PAR_MAX_THREADS`] threads when the batch holds at
/// least [`PAR_MIN_BYTES`] (`bytes` says how many a job hashes); jobs are split in
/// contiguous runs of about equal bytes.
pub(super) fn par_each<T: Send>(jobs: &mut [T], bytes: impl Fn(&T) -> usize, f: impl Fn(&mut T) + Sync) {
    let total: usize = jobs.iter().map(&bytes).sum();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(PAR_MAX_THREADS)
        .min(jobs.len());
    if threads < 2 || total < PAR_MIN_BYTES {
        jobs.iter_mut().for_each(f);
        return;
    }
    let share = total.div_ceil(threads);
    std::thread::scope(|s| {
        let f = &f;
        let mut rest = jobs;
        while !rest.is_empty() {
            let (mut n, mut acc) = (0, 0);
            while n < rest.len() && (n == 0 || acc < share) {
                acc += bytes(&rest[n]);
                n += 1;
            }
            let (run, tail) = rest.split_at_mut(n);
            rest = tail;
            if rest.is_empty() {
                // The last run on this thread: one spawn fewer.
                run.iter_mut().for_each(f);
            } else {
                s.spawn(move || run.iter_mut().for_each(f));
            }
        }
    });
}

/// Runs `side` (when there is one) on a scoped thread while `here` runs on the calling
/// thread; `side`'s result is `None` where it panicked, `here`'s where it did.
///
/// Only `here` may wait on the master or the helper: `side` hashes, and ends in bounded
/// time, so a trickling master holds no thread beyond the caller's place in the daemon's
/// bounded blocking pool (tests/mooncake_trickle.rs counts them; parts in flight on
/// threads of their own, up to 4, once held 76 threads against its bound of 74). One
/// such thread at a time, per call.
fn overlapped<A: Send, B>(
    side: Option<impl FnOnce() -> A + Send>,
    here: impl FnOnce() -> B,
) -> (Option<Option<A>>, Option<B>) {
    std::thread::scope(|s| {
        let t = side.map(|f| s.spawn(f));
        let b = std::panic::catch_unwind(std::panic::AssertUnwindSafe(here)).ok();
        (t.map(|t| t.join().ok()), b)
    })
}

/// The error of every object of a part whose thread failed.
fn part_failed() -> PoolError {
    PoolError::Backend {
        code: codes::INTERNAL_ERROR,
        message: "a sealed transfer's worker thread failed".into(),
    }
}

/// An object of a sealed put that moves from its slot: key, page bytes, slot tail.
type Seal<'a> = (&'a str, &'a [u8], Tail);

/// Writes each object's MAC into its slot tail, on several threads when `par`.
fn seal_tails(mac: &Integrity, jobs: &mut [Seal], par: bool) {
    let one = |(k, d, tail): &mut Seal| {
        let tag = mac.tag(k, d);
        // SAFETY: `sealed_room` put the tail in the caller's slot, after its bytes; this
        // job alone writes it.
        unsafe { tail.bytes() }.copy_from_slice(&tag);
    };
    if par {
        par_each(jobs, |j| j.1.len(), one);
    } else {
        jobs.iter_mut().for_each(one);
    }
}

/// One part of a sealed get: its objects' buffers and, for those that land in their
/// slots, the slot tails.
struct GetPart<'a> {
    range: Range<usize>,
    bufs: Vec<Option<&'a mut [u8]>>,
    tails: Vec<Option<Tail>>,
}

/// The 32 bytes after an object in its arena slot.
struct Tail(*mut u8);

// SAFETY: a tail is written or read by one job only, while its slot is the caller's.
unsafe impl Send for Tail {}

impl Tail {
    /// # Safety
    /// The 32 bytes at the pointer lie in the caller's slot, after the bytes it handed
    /// in, and nothing else reads or writes them now.
    unsafe fn bytes(&mut self) -> &mut [u8; MAC_LEN] {
        // SAFETY: the caller's contract.
        unsafe { &mut *(self.0 as *mut [u8; MAC_LEN]) }
    }
}

/// One object of a sealed get whose MAC is checked in place.
struct Check<'a> {
    idx: usize,
    key: &'a str,
    buf: &'a mut [u8],
    tail: Tail,
    /// The object's length as the store answered it (page bytes plus MAC).
    len: usize,
    ok: bool,
}

impl Check<'_> {
    /// Whether the object in `buf` (and the slot tail after it) carries its MAC.
    fn run(&mut self, mac: &Integrity) {
        let Some(page) = self.len.checked_sub(MAC_LEN).filter(|&p| p <= self.buf.len()) else {
            mac.reject();
            return;
        };
        // The MAC's bytes: those inside the caller's buffer, then those in the slot tail.
        let mut tag = [0u8; MAC_LEN];
        let inside = self.buf.len().saturating_sub(page).min(MAC_LEN);
        tag[..inside].copy_from_slice(&self.buf[page..page + inside]);
        if inside < MAC_LEN {
            // SAFETY: `sealed_room` checked the tail lies in the caller's slot; this job
            // alone reads it.
            let t = unsafe { self.tail.bytes() };
            tag[inside..].copy_from_slice(&t[..MAC_LEN - inside]);
        }
        self.ok = mac.verify(self.key, &self.buf[..page], &tag);
        if self.ok {
            self.len = page;
        } else {
            // Never leave a forged object's bytes where a caller could take them as a page.
            self.buf[..page].fill(0);
        }
    }
}

impl MooncakePool {
    /// The arena offset of `bytes` when they start a host slot (a slot holds one object,
    /// from its start) and the [`MAC_LEN`] bytes after them lie in the same slot, so the
    /// sealed object can move straight from or into the slot.
    fn sealed_room(&self, bytes: &[u8]) -> Option<u64> {
        let a = self.arena.as_ref()?;
        let off = a.offset_of(bytes)?;
        let slot = a.slot_bytes() as u64;
        (off % slot == 0 && (bytes.len() + MAC_LEN) as u64 <= slot).then_some(off)
    }

    /// Per item, [`Self::sealed_room`]; an offset that two items of the batch share is
    /// staged instead, so no two items write one slot's tail.
    fn sealed_rooms<'b>(&self, items: impl Iterator<Item = &'b [u8]>) -> Vec<Option<u64>> {
        let mut at: Vec<Option<u64>> = items.map(|b| self.sealed_room(b)).collect();
        let mut seen = std::collections::HashSet::with_capacity(at.len());
        let shared: std::collections::HashSet<u64> =
            at.iter().flatten().filter(|&&o| !seen.insert(o)).copied().collect();
        if !shared.is_empty() {
            at.iter_mut()
                .filter(|a| a.is_some_and(|o| shared.contains(&o)))
                .for_each(|a| *a = None);
        }
        at
    }

    /// The tail pointer of an object at arena offset `off`, `len` bytes long.
    fn tail(&self, off: u64, len: usize) -> Option<Tail> {
        let a = self.arena.as_ref()?;
        // SAFETY: `sealed_room` checked `off + len + MAC_LEN` lies within one slot.
        Some(Tail(unsafe { a.base_ptr().add(off as usize + len) }))
    }

    /// Puts a sealed batch, in parts ([`parts`]) sent one after another from this thread;
    /// each part is hashed on a scoped thread while the part before it moves and this
    /// thread then asks which of its keys are taken ([`overlapped`]). Keys the store
    /// already holds are checked before the put:
    /// an object that carries its MAC is a peer's copy of the same page and is kept (not
    /// sent again); one that fails (a pre-put by someone without the cluster key) is
    /// counted, removed and put again. The store's own put takes a taken key as success,
    /// so the check comes before the put; a pre-put that lands between the two is caught
    /// when a load fails its MAC and removes it.
    pub(super) fn sealed_put(&self, mac: &Integrity, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        let at = self.sealed_rooms(items.iter().map(|(_, d)| *d));
        let lens: Vec<usize> = items.iter().map(|(_, d)| d.len() + MAC_LEN).collect();
        let ranges = parts(&lens);
        let par = ranges.len() == 1;
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let mut seals = ranges.iter().map(|r| {
            r.clone()
                .filter_map(|i| Some((items[i].0, items[i].1, self.tail(at[i]?, items[i].1.len())?)))
                .collect::<Vec<Seal>>()
        });
        let mut out = Vec::with_capacity(items.len());
        // Step `i` hashes part `i` on the side while this thread puts part `i - 1` and then
        // asks which keys of part `i` are taken. `ready`: the previous part's answers,
        // `None` where its hashing failed (no object of it is put unsealed).
        let mut ready: Option<Vec<Result<bool, PoolError>>> = None;
        for i in 0..=ranges.len() {
            let side = seals.next().map(|mut s| move || seal_tails(mac, &mut s, par));
            let (sealed, here) = overlapped(side, || {
                let put = i.checked_sub(1).map(|p| {
                    let r = ranges[p].clone();
                    let done = ready.take().and_then(|asked| {
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            self.put_part(mac, &items[r.clone()], &at[r.clone()], asked)
                        }))
                        .ok()
                    });
                    done.unwrap_or_else(|| r.map(|_| Err(part_failed())).collect())
                });
                let asked = ranges.get(i).map(|r| self.batch_exists(&keys[r.clone()]));
                (put, asked)
            });
            let (put, asked) = here.unwrap_or((None, None));
            if let Some(p) = i.checked_sub(1) {
                out.extend(put.unwrap_or_else(|| ranges[p].clone().map(|_| Err(part_failed())).collect()));
            }
            ready = match sealed {
                Some(Some(())) => asked,
                _ => None,
            };
        }
        out
    }

    /// One part of [`Self::sealed_put`], its slot objects sealed already; `asked`: which
    /// of its keys the store holds (an answer that is an error puts the object: the put
    /// reports the outage).
    fn put_part(
        &self,
        mac: &Integrity,
        items: &[(&str, &[u8])],
        at: &[Option<u64>],
        asked: Vec<Result<bool, PoolError>>,
    ) -> Vec<Result<(), PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let taken: Vec<usize> = asked
            .into_iter()
            .enumerate()
            .filter_map(|(i, e)| matches!(e, Ok(true)).then_some(i))
            .collect();
        if taken.is_empty() {
            let all: Vec<usize> = (0..items.len()).collect();
            return self.put_subset(mac, items, at, &all);
        }
        let mut out: Vec<Result<(), PoolError>> = vec![Ok(()); items.len()];
        let mut send = vec![true; items.len()];
        let tkeys: Vec<&str> = taken.iter().map(|&i| keys[i]).collect();
        let tlens: Vec<usize> = taken.iter().map(|&i| items[i].1.len() + MAC_LEN).collect();
        let forged = self.forged(mac, &tkeys, &tlens);
        let mut redo: Vec<&str> = Vec::new();
        for (&i, f) in taken.iter().zip(&forged) {
            send[i] = *f;
            if *f {
                redo.push(keys[i]);
            }
        }
        if !redo.is_empty() {
            tracing::warn!(
                objects = redo.len(),
                "pool objects under this daemon's keys failed their MAC (put by someone without the cluster key); replacing them"
            );
            for ((&i, _), rm) in taken
                .iter()
                .zip(&forged)
                .filter(|(_, f)| **f)
                .zip(self.remove_batch(&redo, true))
            {
                if let Err(e) = rm {
                    send[i] = false;
                    out[i] = Err(e);
                }
            }
        }
        let idx: Vec<usize> = (0..items.len()).filter(|&i| send[i]).collect();
        for (&i, r) in idx.iter().zip(self.put_subset(mac, items, at, &idx)) {
            out[i] = r;
        }
        out
    }

    /// Puts `items[idx]`: those with room in their slot (`at`) are sealed already; the
    /// others are copied into staging and sealed there.
    fn put_subset(
        &self,
        mac: &Integrity,
        items: &[(&str, &[u8])],
        at: &[Option<u64>],
        idx: &[usize],
    ) -> Vec<Result<(), PoolError>> {
        let keys: Vec<&str> = idx.iter().map(|&i| items[i].0).collect();
        let lens: Vec<usize> = idx.iter().map(|&i| items[i].1.len() + MAC_LEN).collect();
        let at: Vec<Option<u64>> = idx.iter().map(|&i| at[i]).collect();
        let stage_in = |j: usize, dst: &mut [u8]| {
            let (key, data) = items[idx[j]];
            let obj = &mut dst[..data.len() + MAC_LEN];
            obj[..data.len()].copy_from_slice(data);
            mac.seal(key, obj);
        };
        self.put_retrying(&keys, &lens, &at, &stage_in)
    }

    /// Per key: whether the object the store holds fails its MAC (or is not the length
    /// `len` says). An object that cannot be read now (gone, still being written, the
    /// store down) is not called forged.
    fn forged(&self, mac: &Integrity, keys: &[&str], lens: &[usize]) -> Vec<bool> {
        let at: Vec<Option<u64>> = vec![None; keys.len()];
        let mut bad = vec![false; keys.len()];
        let mut stage_out = |i: usize, src: &[u8], code: i64| {
            let n = usize::try_from(code).unwrap_or(usize::MAX);
            bad[i] = match src.get(..n) {
                Some(obj) if n == lens[i] => mac.open(keys[i], obj).is_none(),
                _ => {
                    mac.reject();
                    true
                }
            };
        };
        let res = self.transfer(Op::Get, keys, lens, &at, &|_, _| {}, &mut stage_out);
        for (b, r) in bad.iter_mut().zip(res) {
            // Larger than this page's object: not ours either.
            if matches!(r, Ok(codes::INVALID_PARAMS)) {
                mac.reject();
                *b = true;
            }
        }
        bad
    }

    /// Gets a sealed batch, in parts sent one after another from this thread; the objects
    /// that landed in their slots are checked on a scoped thread while the next part moves
    /// ([`overlapped`]), the last part's here. Every object is checked before this call
    /// returns; one that fails its MAC reads as absent and is removed from the store.
    pub(super) fn sealed_get(&self, mac: &Integrity, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<usize> = items.iter().map(|(_, b)| b.len() + MAC_LEN).collect();
        let at = self.sealed_rooms(items.iter().map(|(_, b)| &**b));
        let tails: Vec<Option<Tail>> = items
            .iter()
            .zip(&at)
            .map(|((_, b), off)| self.tail((*off)?, b.len()))
            .collect();
        let ranges = parts(&lens);
        let par = ranges.len() == 1;
        let mut bufs = items.iter_mut().map(|(_, b)| Some(&mut **b));
        let mut tails = tails.into_iter();
        let mut work = ranges.iter().map(|r| GetPart {
            range: r.clone(),
            bufs: bufs.by_ref().take(r.len()).collect(),
            tails: tails.by_ref().take(r.len()).collect(),
        });
        // Per part, in order: its codes and opened lengths, `None` where it failed.
        let mut done: Vec<Option<Opened>> = Vec::with_capacity(ranges.len());
        // Step `i` checks part `i - 1` (`pending`) while part `i` lands.
        let mut pending: Option<Landed> = None;
        let check = |mut l: Landed, par: bool| {
            l.check(mac, par);
            l.finish()
        };
        for _ in 0..=ranges.len() {
            let (checked, landed) = match work.next() {
                Some(p) => {
                    let side = pending.take().map(|l| move || check(l, false));
                    let (c, l) = overlapped(side, || {
                        let r = p.range.clone();
                        self.land_part(mac, &keys[r.clone()], &lens[r.clone()], &at[r], p)
                    });
                    (c, Some(l))
                }
                // Nothing left to overlap with: the last part is checked here.
                None => (
                    pending
                        .take()
                        .map(|l| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(l, par))).ok()),
                    None,
                ),
            };
            done.extend(checked);
            match landed {
                Some(Some(l)) => pending = Some(l),
                Some(None) => done.push(None),
                None => {}
            }
        }
        let mut res: Vec<(Result<i64, PoolError>, Option<usize>)> = Vec::with_capacity(keys.len());
        for (r, d) in ranges.iter().zip(done) {
            match d {
                Some(part) => res.extend(part),
                // Never checked: not loaded, and not called forged either.
                None => res.extend(r.clone().map(|_| (Err(part_failed()), None))),
            }
        }
        let mut forged: Vec<&str> = Vec::new();
        let out = res
            .into_iter()
            .zip(lens)
            .zip(&keys)
            .map(|(((r, opened), len), key)| {
                let code = r?;
                if code < 0 {
                    return codes::get_result(code, len - MAC_LEN);
                }
                // An object that failed its MAC is as good as absent: fewer pages, never
                // its bytes.
                opened.ok_or_else(|| {
                    forged.push(key);
                    PoolError::NotFound
                })
            })
            .collect();
        if !forged.is_empty() {
            tracing::warn!(
                objects = forged.len(),
                "pool objects failed their MAC on load; removing them from the store"
            );
            self.remove_batch(&forged, true);
        }
        out
    }

    /// Moves one part of [`Self::sealed_get`]. Staged objects are checked in staging and
    /// copied out only when their MAC holds; those that landed in their slot are left for
    /// [`Landed::check`].
    fn land_part<'a>(
        &self,
        mac: &Integrity,
        keys: &[&'a str],
        lens: &[usize],
        at: &[Option<u64>],
        part: GetPart<'a>,
    ) -> Landed<'a> {
        let GetPart {
            mut bufs, mut tails, ..
        } = part;
        let mut opened: Vec<Option<usize>> = vec![None; keys.len()];
        let res = {
            let mut stage_out = |j: usize, src: &[u8], code: i64| {
                let n = usize::try_from(code).unwrap_or(0).min(src.len());
                let Some(buf) = bufs[j].as_deref_mut() else { return };
                match mac.open(keys[j], &src[..n]) {
                    Some(page) if page.len() <= buf.len() => {
                        buf[..page.len()].copy_from_slice(page);
                        opened[j] = Some(page.len());
                    }
                    Some(_) => mac.reject(),
                    None => {}
                }
            };
            self.transfer(Op::Get, keys, lens, at, &|_, _| {}, &mut stage_out)
        };
        let mut checks: Vec<Check> = Vec::new();
        for (j, c) in res.iter().enumerate() {
            if let (Ok(code @ 0..), Some(tail)) = (c, tails[j].take())
                && let Some(buf) = bufs[j].take()
            {
                checks.push(Check {
                    idx: j,
                    key: keys[j],
                    buf,
                    tail,
                    len: *code as usize,
                    ok: false,
                });
            }
        }
        Landed { res, opened, checks }
    }
}

/// Per object of a part of a sealed get: the store's code, and the page length when its
/// MAC held.
type Opened = Vec<(Result<i64, PoolError>, Option<usize>)>;

/// A part of a sealed get that has moved: the store's code per object, the page length of
/// each object whose MAC held, and the checks still to run on objects in their slots.
struct Landed<'a> {
    res: Vec<Result<i64, PoolError>>,
    opened: Vec<Option<usize>>,
    checks: Vec<Check<'a>>,
}

impl Landed<'_> {
    /// Runs the checks (on several threads when `par`).
    fn check(&mut self, mac: &Integrity, par: bool) {
        if par {
            par_each(&mut self.checks, |c| c.len, |c| c.run(mac));
        } else {
            self.checks.iter_mut().for_each(|c| c.run(mac));
        }
        for c in &self.checks {
            self.opened[c.idx] = c.ok.then_some(c.len);
        }
    }

    fn finish(self) -> Opened {
        self.res.into_iter().zip(self.opened).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_object_once_in_order() {
        assert_eq!(parts(&[]), vec![0..0]);
        assert_eq!(parts(&[10; 3]), vec![0..3]);
        let big = PART_BYTES / 2;
        assert_eq!(parts(&[big; 5]), vec![0..2, 2..4, 4..5]);
        assert_eq!(parts(&[PART_BYTES * 2, 1]), vec![0..1, 1..2]);
    }

    #[test]
    fn overlapped_runs_both_sides_at_once_and_answers_none_for_a_side_that_panicked() {
        use std::sync::mpsc;
        use std::time::Duration;
        // The side waits for a word that `here` sends only after it has heard from the
        // side: run one after the other, each would time out.
        let (to_here, from_side) = mpsc::channel();
        let (to_side, from_here) = mpsc::channel();
        let (side, here) = overlapped(
            Some(move || {
                to_here.send(1u32).unwrap();
                from_here.recv_timeout(Duration::from_secs(10)).map(|v: u32| v + 1)
            }),
            || {
                let v = from_side.recv_timeout(Duration::from_secs(10));
                to_side.send(41).unwrap();
                v
            },
        );
        assert_eq!(side, Some(Some(Ok(42))));
        assert_eq!(here, Some(Ok(1)));
        let (side, here) = overlapped(Some(|| -> u8 { panic!("the side fails") }), || 7);
        assert_eq!((side, here), (Some(None), Some(7)));
        let (side, here) = overlapped(Some(|| 3), || -> u8 { panic!("here fails") });
        assert_eq!((side, here), (Some(Some(3)), None));
        let none: Option<fn() -> u8> = None;
        assert_eq!(overlapped(none, || 5), (None, Some(5)));
    }

    #[test]
    fn par_each_runs_every_job_once_in_small_and_large_batches() {
        for (n, each) in [(3usize, 16usize), (64, 64 << 10), (7, 1 << 20)] {
            let mut jobs: Vec<(usize, usize)> = (0..n).map(|i| (i, 0)).collect();
            par_each(&mut jobs, |_| each, |j| j.1 += j.0 + 1);
            assert!(jobs.iter().all(|&(i, v)| v == i + 1), "{n} jobs of {each} bytes");
        }
    }
}
