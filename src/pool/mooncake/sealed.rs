//! Puts and gets with the integrity MAC ([`super::integrity`]).
//!
//! An object is `page bytes ‖ MAC(32)`. Where the caller's bytes start a host arena slot
//! (a slot holds one object, from its start) with at least 32 free bytes after them (the daemon fits its slots to
//! the objects plus these 32 bytes by default), the object moves straight between that slot and the
//! store: a put writes the MAC into the slot's tail and sends `len + 32` bytes from the
//! slot; a get lands `len + 32` bytes in the slot and checks them there, before the call
//! returns, so no caller ever sees a slot whose MAC failed as loaded. Other objects go
//! through the staging region, copied and hashed there. A batch is cut into parts of
//! [`PART_BYTES`], each one request to the helper from the calling thread. One scoped
//! thread per call hashes (a put: part after part, running ahead of the transfers, while
//! the calling thread first asks the master which keys are taken) or checks (a get: each
//! part as it lands, while the next one moves; the last part is checked by the calling
//! thread); each part hashes on several threads ([`par_each`]).
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
/// Each request costs the wheel a round of master calls and the helper a wake-up or two,
/// so parts are large: 4 MiB parts made a 64 MiB batch of 64 KiB objects 16 requests
/// where the raw client makes one (the wheel's own client, given 64-object batches, took
/// about twice as long as with 1024-object ones). 16 MiB parts, four per 64 MiB batch with
/// the MAC of one part on one thread overlapping the next part's transfer, still lost to
/// a batch sent whole after hashing on all cores (`kvtier bench pool`, 2 cores, where the
/// transfer itself keeps a core busy and the MAC thread only took from it): the MAC costs
/// the same CPU either way, and every extra request waits on the helper again.
const PART_BYTES: usize = 64 << 20;

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

/// The error of every object of a part whose thread failed.
fn part_failed() -> PoolError {
    PoolError::Backend {
        code: codes::INTERNAL_ERROR,
        message: "a sealed transfer's worker thread failed".into(),
    }
}

/// An object of a sealed put that moves from its slot: key, page bytes, slot tail.
type Seal<'a> = (&'a str, &'a [u8], Tail);

/// Writes each object's MAC into its slot tail ([`par_each`]).
fn seal_tails(mac: &Integrity, jobs: &mut [Seal]) {
    let one = |(k, d, tail): &mut Seal| {
        let tag = mac.tag(k, d);
        // SAFETY: `sealed_room` put the tail in the caller's slot, after its bytes; this
        // job alone writes it.
        unsafe { tail.bytes() }.copy_from_slice(&tag);
    };
    par_each(jobs, |j| j.1.len(), one);
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

    /// Puts a sealed batch, in parts ([`parts`]) sent one after another from this thread,
    /// each once a scoped thread has hashed it; that thread hashes part after part while
    /// this one first asks which keys of the batch are taken, then puts. Keys the store
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
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let seals: Vec<Vec<Seal>> = ranges
            .iter()
            .map(|r| {
                r.clone()
                    .filter_map(|i| Some((items[i].0, items[i].1, self.tail(at[i]?, items[i].1.len())?)))
                    .collect()
            })
            .collect();
        let mut out = Vec::with_capacity(items.len());
        std::thread::scope(|s| {
            // The hasher seals part after part, as fast as it can, and says which ones it
            // sealed; it never waits on the master or the helper.
            let (tx, sealed) = std::sync::mpsc::channel::<bool>();
            s.spawn(move || {
                for mut part in seals {
                    let ok =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| seal_tails(mac, &mut part))).is_ok();
                    if tx.send(ok).is_err() {
                        return;
                    }
                }
            });
            // One query for the whole batch, while the first parts hash. `None` where it
            // failed: no part is put without its answers.
            let asked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.batch_exists(&keys)))
                .ok()
                .filter(|a: &Vec<_>| a.len() == keys.len());
            let mut asked = asked.map(Vec::into_iter);
            for r in &ranges {
                let answers: Option<Vec<_>> = asked.as_mut().map(|a| a.by_ref().take(r.len()).collect());
                // A part whose hashing failed (or whose hasher is gone) is not put: no
                // object goes out unsealed. One word per part, in order, whatever the answers.
                let hashed = sealed.recv().unwrap_or(false);
                let done = answers.filter(|_| hashed).and_then(|answers| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.put_part(mac, &items[r.clone()], &at[r.clone()], answers)
                    }))
                    .ok()
                });
                out.extend(done.unwrap_or_else(|| r.clone().map(|_| Err(part_failed())).collect()));
            }
        });
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
    /// that landed in their slots are checked on a scoped thread while the next part moves,
    /// the last part's here. Every object is checked before this call
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
        let mut bufs = items.iter_mut().map(|(_, b)| Some(&mut **b));
        let mut tails = tails.into_iter();
        let work = ranges.iter().map(|r| GetPart {
            range: r.clone(),
            bufs: bufs.by_ref().take(r.len()).collect(),
            tails: tails.by_ref().take(r.len()).collect(),
        });
        // Per part, in order: its codes and opened lengths, `None` where it failed.
        let mut done: Vec<Option<Opened>> = (0..ranges.len()).map(|_| None).collect();
        let check = |mut l: Landed| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                l.check(mac);
                l.finish()
            }))
            .ok()
        };
        let last = ranges.len() - 1;
        std::thread::scope(|s| {
            // The checker takes each part as it lands, while the next one moves; it never
            // waits on the master or the helper. The last part is checked here.
            let (tx, landed) = std::sync::mpsc::channel::<(usize, Landed)>();
            let checker =
                (last > 0).then(|| s.spawn(move || landed.into_iter().map(|(i, l)| (i, check(l))).collect::<Vec<_>>()));
            for (i, p) in work.enumerate() {
                let r = p.range.clone();
                let l = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.land_part(mac, &keys[r.clone()], &lens[r.clone()], &at[r], p)
                }));
                match l {
                    Ok(l) if i == last => done[i] = check(l),
                    Ok(l) => {
                        if let Err(std::sync::mpsc::SendError((i, l))) = tx.send((i, l)) {
                            done[i] = check(l);
                        }
                    }
                    // Never checked: its objects read as failed, never as loaded.
                    Err(_) => {}
                }
            }
            drop(tx);
            if let Some(Ok(checked)) = checker.map(|c| c.join()) {
                for (i, c) in checked {
                    done[i] = c;
                }
            }
        });
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
    /// Runs the checks ([`par_each`]).
    fn check(&mut self, mac: &Integrity) {
        par_each(&mut self.checks, |c| c.len, |c| c.run(mac));
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
    fn par_each_runs_every_job_once_in_small_and_large_batches() {
        for (n, each) in [(3usize, 16usize), (64, 64 << 10), (7, 1 << 20)] {
            let mut jobs: Vec<(usize, usize)> = (0..n).map(|i| (i, 0)).collect();
            par_each(&mut jobs, |_| each, |j| j.1 += j.0 + 1);
            assert!(jobs.iter().all(|&(i, v)| v == i + 1), "{n} jobs of {each} bytes");
        }
    }
}
