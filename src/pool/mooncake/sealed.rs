//! Puts and gets with the integrity MAC ([`super::integrity`]).
//!
//! An object is `page bytes ‖ MAC(32)`. Where the caller's bytes start a host arena slot
//! (a slot holds one object, from its start) with at least 32 free bytes after them (the daemon fits its slots to
//! the objects plus these 32 bytes by default), the object moves straight between that slot and the
//! store: a put writes the MAC into the slot's tail and sends `len + 32` bytes from the
//! slot; a get lands `len + 32` bytes in the slot and checks them there, before the call
//! returns, so no caller ever sees a slot whose MAC failed as loaded. Other objects go
//! through the staging region, copied and hashed there. A batch's MACs are computed on
//! several threads ([`par_each`]), so hashing keeps up with the wire.
//!
//! An object that fails its MAC is a miss (`NotFound`), is counted, and is removed from
//! the store, so neither this daemon's lookups nor a peer's credit it again. A put first
//! asks which of its keys are taken and checks the objects there; one that fails its MAC
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

/// Bytes of one part of a sealed batch: a part's MACs are computed (put) or checked (get)
/// while the next part (get) or the part before it (put) is on the wire.
const PART_BYTES: usize = 4 << 20;

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

    /// Puts a sealed batch. Keys the store already holds are checked first: an object that
    /// carries its MAC is a peer's copy of the same page and is kept (not sent again); one
    /// that fails (a pre-put by someone without the cluster key) is counted, removed and
    /// put again. The store's own put takes a taken key as success, so the check comes
    /// before the put; a pre-put that lands between the two is caught when a load fails
    /// its MAC and removes it.
    pub(super) fn sealed_put(&self, mac: &Integrity, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        // An existence answer that is an error puts the object: the put reports the outage.
        let taken: Vec<usize> = self
            .batch_exists(&keys)
            .into_iter()
            .enumerate()
            .filter_map(|(i, e)| matches!(e, Ok(true)).then_some(i))
            .collect();
        if taken.is_empty() {
            return self.put_sealed(mac, items);
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
        let sub: Vec<(&str, &[u8])> = idx.iter().map(|&i| items[i]).collect();
        for (&i, r) in idx.iter().zip(self.put_sealed(mac, &sub)) {
            out[i] = r;
        }
        out
    }

    fn put_sealed(&self, mac: &Integrity, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<usize> = items.iter().map(|(_, d)| d.len() + MAC_LEN).collect();
        let at = self.sealed_rooms(items.iter().map(|(_, d)| *d));
        let stage_in = |i: usize, dst: &mut [u8]| {
            let (key, data) = items[i];
            let obj = &mut dst[..data.len() + MAC_LEN];
            obj[..data.len()].copy_from_slice(data);
            mac.seal(key, obj);
        };
        // Objects that move from their slot: the MAC goes into the slot's tail, on
        // several threads, one part ahead of the part on the wire.
        let parts = parts(&lens);
        let mut seals: Vec<Vec<(&str, &[u8], Tail)>> = parts
            .iter()
            .map(|r| {
                r.clone()
                    .filter_map(|i| Some((keys[i], items[i].1, self.tail(at[i]?, items[i].1.len())?)))
                    .collect()
            })
            .collect();
        let seal = |jobs: &mut Vec<(&str, &[u8], Tail)>| {
            par_each(
                jobs,
                |j| j.1.len(),
                |(k, d, tail)| {
                    let tag = mac.tag(k, d);
                    // SAFETY: `sealed_room` put the tail in the caller's slot, after its
                    // bytes; this job alone writes it.
                    unsafe { tail.bytes() }.copy_from_slice(&tag);
                },
            )
        };
        let send = |r: &Range<usize>| {
            let stage = |j: usize, dst: &mut [u8]| stage_in(r.start + j, dst);
            self.put_codes(&keys[r.clone()], &lens[r.clone()], &at[r.clone()], &stage)
        };
        let mut codes: Vec<Result<i64, PoolError>> = Vec::with_capacity(keys.len());
        if parts.len() == 1 {
            seal(&mut seals[0]);
            codes.extend(send(&parts[0]));
        } else {
            std::thread::scope(|s| {
                let (tx, rx) = std::sync::mpsc::sync_channel::<()>(parts.len());
                s.spawn(move || {
                    for jobs in &mut seals {
                        seal(jobs);
                        if tx.send(()).is_err() {
                            return;
                        }
                    }
                });
                for r in &parts {
                    // Sealed before it is sent; a sealer that died sends nothing more,
                    // and the rest of the batch fails rather than go out unsealed.
                    match rx.recv() {
                        Ok(()) => codes.extend(send(r)),
                        Err(_) => codes.extend(r.clone().map(|_| {
                            Err(PoolError::Backend {
                                code: codes::INTERNAL_ERROR,
                                message: "sealing thread failed".into(),
                            })
                        })),
                    }
                }
            });
        }
        codes.into_iter().map(|r| r.and_then(codes::put_result)).collect()
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

    pub(super) fn sealed_get(&self, mac: &Integrity, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<usize> = items.iter().map(|(_, b)| b.len() + MAC_LEN).collect();
        let at = self.sealed_rooms(items.iter().map(|(_, b)| &**b));
        let mut tails: Vec<Option<Tail>> = items
            .iter()
            .zip(&at)
            .map(|((_, b), off)| self.tail((*off)?, b.len()))
            .collect();
        let mut bufs: Vec<Option<&mut [u8]>> = items.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
        let mut opened: Vec<Option<usize>> = vec![None; keys.len()];
        let mut res: Vec<Result<i64, PoolError>> = Vec::with_capacity(keys.len());
        // One part on the wire while the part before it is checked.
        let parts = parts(&lens);
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<Check>>(parts.len());
            let checker = (parts.len() > 1).then(|| {
                s.spawn(move || {
                    let mut done = Vec::new();
                    for mut checks in rx {
                        par_each(&mut checks, |c| c.len, |c| c.run(mac));
                        done.extend(checks.iter().map(|c| (c.idx, c.ok.then_some(c.len))));
                    }
                    done
                })
            });
            let mut inline = Vec::new();
            for r in &parts {
                // Staged objects: checked in staging, copied out only when their MAC holds.
                let mut stage_out = |j: usize, src: &[u8], code: i64| {
                    let i = r.start + j;
                    let n = usize::try_from(code).unwrap_or(0).min(src.len());
                    let Some(buf) = bufs[i].as_deref_mut() else { return };
                    match mac.open(keys[i], &src[..n]) {
                        Some(page) if page.len() <= buf.len() => {
                            buf[..page.len()].copy_from_slice(page);
                            opened[i] = Some(page.len());
                        }
                        Some(_) => mac.reject(),
                        None => {}
                    }
                };
                let part = self.transfer(
                    Op::Get,
                    &keys[r.clone()],
                    &lens[r.clone()],
                    &at[r.clone()],
                    &|_, _| {},
                    &mut stage_out,
                );
                // Objects that landed in their slot: checked there.
                let mut checks: Vec<Check> = Vec::new();
                for (i, c) in r.clone().zip(&part) {
                    if let (Ok(code @ 0..), Some(tail)) = (c, tails[i].take())
                        && let Some(buf) = bufs[i].take()
                    {
                        checks.push(Check {
                            idx: i,
                            key: keys[i],
                            buf,
                            tail,
                            len: *code as usize,
                            ok: false,
                        });
                    }
                }
                res.extend(part);
                if checker.is_some() {
                    // A checker that died drops its receiver: its objects read as failed.
                    let _ = tx.send(checks);
                } else {
                    inline = checks;
                }
            }
            drop(tx);
            par_each(&mut inline, |c| c.len, |c| c.run(mac));
            for c in &inline {
                opened[c.idx] = c.ok.then_some(c.len);
            }
            // A checker that panicked opened nothing: every object it held reads as failed.
            if let Some(Ok(done)) = checker.map(|h| h.join()) {
                for (i, o) in done {
                    opened[i] = o;
                }
            }
        });
        let mut forged: Vec<&str> = Vec::new();
        let out = res
            .into_iter()
            .zip(lens)
            .zip(opened)
            .zip(&keys)
            .map(|(((r, len), opened), key)| {
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
