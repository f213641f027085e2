//! Issuing the CUDA region's copies. A batch's moves are first coalesced
//! ([`coalesce`]): the same run of objects whose addresses step evenly on both sides
//! (consecutive pages into consecutive slots, say) becomes one 2-D copy, or one
//! contiguous copy where both sides are contiguous. On a real GPU a driver call costs
//! microseconds, more than a 16 KiB run takes to cross PCIe, so the number of calls, not
//! the bytes, bounds small objects. What is left contiguous goes in one
//! `cuMemcpyBatchAsync` (CUDA 12.8+), or one call per move (`cuMemcpy{DtoH,HtoD}Async`,
//! `cuMemcpy2DAsync`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};

use super::cuda::{CudaDevice, Move, Rows, check};
use super::device::DeviceError;

/// The largest pitch a 2-D copy is given: CUDA's `MAX_PITCH` is 2^31 - 1 bytes on every
/// GPU that reports it.
const MAX_PITCH: usize = i32::MAX as usize;

/// Where a move sits in its batch: the object's place in the batch, its part, and the
/// run's place in the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct RunKey {
    pub(super) object: u32,
    pub(super) part: u8,
    pub(super) run: u32,
}

/// The moves of a batch in as few copies as their addresses allow. Moves step evenly
/// along one of two lines:
///
/// - across objects: the same run (part, run) of the batch's objects, in batch order
///   (consecutive pages into consecutive slots);
/// - within an object: the runs of one object and part, in order (an owned region's
///   layers, evenly spaced on the device and back to back in the arena slot).
///
/// A group of moves of one width whose device and host addresses each step by one
/// constant pitch of at least the width becomes one 2-D move, or one contiguous move when
/// both pitches are the width. Both orders are tried (one line, then the other on what
/// stayed single) and the one with fewer copies is kept: a greedy pass along one line
/// can pair a few objects by chance and break up what the other line would have merged
/// whole. Moves that are already 2-D are kept as they are. The copies of a batch land
/// before any is reported, so their order does not matter.
pub(super) fn coalesce(keyed: Vec<(RunKey, Move)>) -> Vec<Move> {
    // A line's name and the place along it.
    let across = |k: &RunKey| ((k.part as u32, k.run), k.object);
    let within = |k: &RunKey| ((k.object, k.part as u32), k.run);
    let a = two_lines(keyed.clone(), across, within);
    let b = two_lines(keyed, within, across);
    if b.len() < a.len() { b } else { a }
}

/// A line of moves, by its name and the place along it.
type Line = ((u32, u32), u32);

/// Merges along the lines of `first`, then along those of `second` what stayed single.
fn two_lines(
    mut keyed: Vec<(RunKey, Move)>,
    first: impl Fn(&RunKey) -> Line,
    second: impl Fn(&RunKey) -> Line,
) -> Vec<Move> {
    let mut out: Vec<Move> = Vec::with_capacity(keyed.len());
    let mut single = Vec::new();
    // Stable sorts: what shares a place keeps the batch's order.
    keyed.sort_by_key(|(k, _)| first(k));
    merge(
        &keyed,
        |a, b| first(a).0 == first(b).0,
        |k, m, n| {
            if n > 1 { out.push(m) } else { single.push((k, m)) }
        },
    );
    single.sort_by_key(|(k, _)| second(k));
    merge(&single, |a, b| second(a).0 == second(b).0, |_, m, _| out.push(m));
    out
}

/// Greedy: each maximal stretch of `keyed` whose keys are `same` and whose flat moves of
/// one width step by one constant (device, host) pitch pair, given to `emit` as one move
/// with the number of moves it stands for.
fn merge(keyed: &[(RunKey, Move)], same: impl Fn(&RunKey, &RunKey) -> bool, mut emit: impl FnMut(RunKey, Move, usize)) {
    let step = |a: usize, b: usize, width: usize| b.checked_sub(a).filter(|&d| d >= width && d <= MAX_PITCH);
    let mut i = 0;
    while i < keyed.len() {
        let (key, first) = keyed[i];
        let mut pitches = None;
        let mut j = i + 1;
        while first.rows.is_none() && j < keyed.len() {
            let ((k, m), (_, prev)) = (keyed[j], keyed[j - 1]);
            if !same(&key, &k) || m.rows.is_some() || m.width != first.width {
                break;
            }
            let Some(d) = step(prev.dev as usize, m.dev as usize, m.width) else {
                break;
            };
            let Some(h) = step(prev.host as usize, m.host as usize, m.width) else {
                break;
            };
            if pitches.is_some_and(|p| p != (d, h)) {
                break;
            }
            pitches = Some((d, h));
            j += 1;
        }
        let n = j - i;
        emit(
            key,
            match pitches {
                None => first,
                Some((d, h)) if d == first.width && h == first.width => Move {
                    width: first.width * n,
                    ..first
                },
                Some((dev_pitch, host_pitch)) => Move {
                    rows: Some(Rows {
                        n,
                        dev_pitch,
                        host_pitch,
                    }),
                    ..first
                },
            },
            n,
        );
        i = j;
    }
}

impl CudaDevice {
    /// One `cuMemcpyBatchAsync` for all moves. Any failure (an old driver without the
    /// symbol included) turns batching off for this region and the caller copies singly.
    pub(super) fn issue_batch(&self, moves: &[Move], to_host: bool) -> Result<(), DeviceError> {
        let mut dsts: Vec<CUdeviceptr> = Vec::with_capacity(moves.len());
        let mut srcs: Vec<CUdeviceptr> = Vec::with_capacity(moves.len());
        let mut sizes: Vec<usize> = moves.iter().map(|m| m.width).collect();
        for m in moves {
            let host = m.host as CUdeviceptr;
            let (d, s) = if to_host { (host, m.dev) } else { (m.dev, host) };
            dsts.push(d);
            srcs.push(s);
        }
        let loc = |host: bool| sys::CUmemLocation {
            type_: if host {
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST
            } else {
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
            },
            id: if host { 0 } else { self.ctx.ordinal() as i32 },
        };
        let mut attr = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: loc(!to_host),
            dstLocHint: loc(to_host),
            flags: 0,
        };
        let mut attr_idx = 0usize;
        let mut fail_idx = usize::MAX;
        let stream = self.copy.cu_stream();
        let r = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: arrays of `moves.len()` entries; addresses checked by `plan`.
            unsafe {
                sys::cuMemcpyBatchAsync(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    moves.len(),
                    &mut attr,
                    &mut attr_idx,
                    1,
                    &mut fail_idx,
                    stream,
                )
            }
        }));
        match r {
            Ok(CUresult::CUDA_SUCCESS) => Ok(()),
            other => {
                self.batch.store(false, Ordering::Relaxed);
                tracing::warn!(result = ?other.ok(), "cuMemcpyBatchAsync unavailable; copying singly");
                Err(DeviceError::Copy("batched copy failed".into()))
            }
        }
    }

    /// One driver call for one move: a contiguous copy, or a 2-D one.
    pub(super) fn issue_one(&self, m: &Move, to_host: bool) -> Result<(), DeviceError> {
        let stream = self.copy.cu_stream();
        match (m.rows, to_host) {
            // SAFETY (all arms): addresses checked by `plan`; the host memory outlives the
            // call because `run` waits for the copies before returning.
            (None, true) => check(
                // SAFETY: as above.
                unsafe { sys::cuMemcpyDtoHAsync_v2(m.host.cast(), m.dev, m.width, stream) },
                "cuMemcpyDtoHAsync",
            ),
            (None, false) => check(
                // SAFETY: as above: addresses checked by `plan`, host memory outlives the copy.
                unsafe { sys::cuMemcpyHtoDAsync_v2(m.dev, m.host.cast_const().cast(), m.width, stream) },
                "cuMemcpyHtoDAsync",
            ),
            (
                Some(Rows {
                    n,
                    dev_pitch,
                    host_pitch,
                }),
                to_host,
            ) => {
                // Every field spelled out: the memory-type enum has no zero value, so a
                // zeroed struct is not a valid one.
                use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE as DEVICE, CU_MEMORYTYPE_HOST as HOST};
                let (src_type, dst_type, src_pitch, dst_pitch) = if to_host {
                    (DEVICE, HOST, dev_pitch, host_pitch)
                } else {
                    (HOST, DEVICE, host_pitch, dev_pitch)
                };
                let c = sys::CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: src_type,
                    srcHost: if to_host {
                        std::ptr::null()
                    } else {
                        m.host.cast_const().cast()
                    },
                    srcDevice: if to_host { m.dev } else { 0 },
                    srcArray: std::ptr::null_mut(),
                    srcPitch: src_pitch,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: dst_type,
                    dstHost: if to_host { m.host.cast() } else { std::ptr::null_mut() },
                    dstDevice: if to_host { 0 } else { m.dev },
                    dstArray: std::ptr::null_mut(),
                    dstPitch: dst_pitch,
                    WidthInBytes: m.width,
                    Height: n,
                };
                // SAFETY: `c` describes ranges `plan` checked; the host memory outlives the
                // copy because `run` waits for it before returning.
                check(unsafe { sys::cuMemcpy2DAsync_v2(&c, stream) }, "cuMemcpy2DAsync")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(object: u32, part: u8, run: u32) -> RunKey {
        RunKey { object, part, run }
    }

    fn mv(dev: u64, host: usize, width: usize) -> Move {
        Move {
            dev,
            host: host as *mut u8,
            width,
            rows: None,
        }
    }

    #[test]
    fn evenly_stepping_runs_become_one_copy_per_key() {
        let w = 16 << 10;
        // Four pages of two parts x two runs: device pages contiguous per (part, run),
        // host objects K, V of a page side by side (host pitch 4 runs).
        let mut keyed = Vec::new();
        for page in 0..4usize {
            for part in 0..2u8 {
                for run in 0..2u32 {
                    let dev = 0x10_0000 + ((part as usize * 2 + run as usize) * 4 + page) * w;
                    let host = 0x9000_0000 + (page * 4 + part as usize * 2 + run as usize) * w;
                    keyed.push((key(page as u32, part, run), mv(dev as u64, host, w)));
                }
            }
        }
        let out = coalesce(keyed);
        assert_eq!(out.len(), 4, "{out:?}");
        for m in &out {
            assert_eq!(m.width, w);
            assert_eq!(
                m.rows,
                Some(Rows {
                    n: 4,
                    dev_pitch: w,
                    host_pitch: 4 * w
                })
            );
        }
        // K run 0 of page 0 first: the order within a key is the batch's.
        assert_eq!((out[0].dev, out[0].host as usize), (0x10_0000, 0x9000_0000));
    }

    #[test]
    fn contiguous_runs_merge_and_uneven_ones_stay_apart() {
        let w = 4096;
        let contiguous: Vec<_> = (0..3)
            .map(|i| {
                (
                    key(i, 0, 0),
                    mv(0x1000 + i as u64 * w as u64, 0x8000 + i as usize * w, w),
                )
            })
            .collect();
        assert_eq!(coalesce(contiguous), vec![mv(0x1000, 0x8000, 3 * w)]);
        // The third host address breaks the step: two rows, then a single move.
        let uneven = vec![
            (key(0, 0, 0), mv(0x1000, 0x8000, w)),
            (key(1, 0, 0), mv(0x1000 + 2 * w as u64, 0x8000 + 2 * w, w)),
            (key(2, 0, 0), mv(0x1000 + 4 * w as u64, 0x8000 + 5 * w, w)),
        ];
        let out = coalesce(uneven);
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(
            out[0].rows.map(|r| (r.n, r.dev_pitch, r.host_pitch)),
            Some((2, 2 * w, 2 * w))
        );
        assert_eq!(out[1], mv(0x1000 + 4 * w as u64, 0x8000 + 5 * w, w));
        // Descending addresses, overlapping rows, other widths, other runs of other
        // objects and other parts of one object never merge.
        for pair in [
            [
                (key(0, 0, 0), mv(0x9000, 0x9000, w)),
                (key(1, 0, 0), mv(0x1000, 0x1000, w)),
            ],
            [
                (key(0, 0, 0), mv(0x1000, 0x1000, w)),
                (key(1, 0, 0), mv(0x1800, 0x1800, w)),
            ],
            [
                (key(0, 0, 0), mv(0x1000, 0x1000, w)),
                (key(1, 0, 0), mv(0x2000, 0x2000, 2 * w)),
            ],
            [
                (key(0, 0, 0), mv(0x1000, 0x1000, w)),
                (key(1, 0, 1), mv(0x2000, 0x2000, w)),
            ],
            [
                (key(0, 0, 0), mv(0x1000, 0x1000, w)),
                (key(0, 1, 0), mv(0x2000, 0x2000, w)),
            ],
        ] {
            assert_eq!(coalesce(pair.to_vec()).len(), 2, "{pair:?}");
        }
        // A pitch above CUDA's limit stays two copies.
        let far = vec![(key(0, 0, 0), mv(0, 0x1000, w)), (key(1, 0, 0), mv(1 << 31, 0x2000, w))];
        assert_eq!(coalesce(far).len(), 2);
    }

    #[test]
    fn scattered_objects_move_as_one_copy_each() {
        // Objects of 4 runs, evenly spaced on the device (an owned region's layers) and
        // back to back in their slot, in a shuffled page order: nothing steps across
        // objects, and each object's runs become one 2-D copy.
        let (w, pages) = (16usize << 10, 8usize);
        let order = [5usize, 2, 7, 0];
        let mut keyed = Vec::new();
        for (i, &page) in order.iter().enumerate() {
            for run in 0..4usize {
                let dev = 0x100_0000 + (run * pages + page) * w;
                let host = 0x9000_0000 + (i * 4 + run) * w;
                keyed.push((key(i as u32, 0, run as u32), mv(dev as u64, host, w)));
            }
        }
        let out = coalesce(keyed);
        assert_eq!(out.len(), 4, "{out:?}");
        for (m, &page) in out.iter().zip(&order) {
            assert_eq!(m.dev, (0x100_0000 + page * w) as u64);
            assert_eq!(
                m.rows,
                Some(Rows {
                    n: 4,
                    dev_pitch: pages * w,
                    host_pitch: w
                })
            );
        }
    }
}
