//! `kvtier bench transfer --device cuda`: page moves through the CUDA device region
//! (what a client does for a store or a load) beside raw `cudaMemcpyAsync` of the same
//! bytes, on the same stream in the same run, interleaved round by round.
//!
//! The reference is the least an engine could do for the same request: one contiguous
//! copy per object (the region's layer-first objects are one run per layer, so this is
//! fewer, larger copies than kvtier may issue), then one wait for the request's
//! `--batch` pages, as a store or a load must know its pages landed before it answers.
//! Timing the raw copies with a single wait at the very end would compare a request-
//! by-request path against one that never waits.

use std::time::Instant;

use anyhow::Context;
use cudarc::driver::sys;

use super::gbps;
use super::transfer::{Row, TransferArgs};
use crate::layout::{LayoutSpec, Part};
use crate::tier::cuda::CudaDevice;
use crate::tier::device::{DeviceRegion, ObjectCopy, pattern};

fn median(mut v: Vec<std::time::Duration>) -> std::time::Duration {
    v.sort();
    v[v.len() / 2]
}

/// Raw copies of the objects of `obj` bytes between the region and `host`, one contiguous
/// copy each, synchronised after every `per` objects (one request's).
fn raw(dev: &CudaDevice, host: &mut [u8], obj: usize, per: usize, to_host: bool) -> anyhow::Result<()> {
    let stream = dev.copy_stream().cu_stream();
    for (i, chunk) in host.chunks_mut(obj).enumerate() {
        if i > 0 && i % per == 0 {
            dev.copy_stream().synchronize().context("synchronize")?;
        }
        let d = dev.device_ptr() + (i * obj) as u64;
        // SAFETY: the region holds at least `host.len()` bytes; `host` is pinned and live.
        let r = unsafe {
            if to_host {
                sys::cuMemcpyDtoHAsync_v2(chunk.as_mut_ptr().cast(), d, chunk.len(), stream)
            } else {
                sys::cuMemcpyHtoDAsync_v2(d, chunk.as_ptr().cast(), chunk.len(), stream)
            }
        };
        anyhow::ensure!(r == sys::CUresult::CUDA_SUCCESS, "raw copy: {r:?}");
    }
    dev.copy_stream().synchronize().context("synchronize")?;
    Ok(())
}

/// Rows for one object size: device->host and host->device, against raw copies; with
/// `--scatter`, the same again with the pages in a shuffled order.
pub fn rows_for(object_kib: u64, args: &TransferArgs) -> anyhow::Result<Vec<Row>> {
    let mut rows = rows_in_order(object_kib, args, false)?;
    if args.scatter {
        rows.extend(rows_in_order(object_kib, args, true)?);
    }
    Ok(rows)
}

/// A fixed shuffle of `0..n` (Fisher-Yates over a 64-bit LCG): the same in every run.
fn shuffled(n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..n).rev() {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        v.swap(i, (x >> 33) as usize % (i + 1));
    }
    v
}

fn rows_in_order(object_kib: u64, args: &TransferArgs, scatter: bool) -> anyhow::Result<Vec<Row>> {
    let token_bytes = (object_kib * 1024 / 64) as u32;
    let layout = LayoutSpec::mha(4, 1, token_bytes / 2, 2, 16).build()?;
    let obj = layout.object_bytes(0) as usize;
    let pages = (((args.mib << 20) as usize) / (2 * obj)).max(args.batch);
    let dev = CudaDevice::new(&layout, 0, pages as u32, 0)?;
    // The device's name says when it is not a real GPU (the emulated driver CI uses).
    eprintln!(
        "cuda device 0: {}",
        dev.context().name().unwrap_or_else(|e| e.to_string())
    );
    let mut host = vec![0u8; pages * 2 * obj];
    dev.register_host(host.as_mut_ptr(), host.len())?;
    // Known bytes in: each object gets its own pattern.
    let src: Vec<Vec<u8>> = (0..pages * 2).map(|i| pattern(i as u64, obj)).collect();
    for (p, pair) in src.chunks(2).enumerate() {
        dev.copy_from_host(&[
            ObjectCopy::new(p as u32, Part::K, &pair[0][..]),
            ObjectCopy::new(p as u32, Part::V, &pair[1][..]),
        ])?;
    }
    let bytes = host.len() as u64;
    // The device page behind host position `i` of the run.
    let order: Vec<u32> = if scatter {
        shuffled(pages)
    } else {
        (0..pages as u32).collect()
    };
    let (mut d2h, mut h2d, mut raw_d2h, mut raw_h2d) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.runs.max(1) {
        let t = Instant::now();
        for (b, chunk) in host.chunks_mut(2 * obj * args.batch).enumerate() {
            let mut batch: Vec<_> = chunk
                .chunks_mut(obj)
                .enumerate()
                .map(|(i, h)| {
                    let page = order[b * args.batch + i / 2];
                    ObjectCopy::new(page, if i % 2 == 0 { Part::K } else { Part::V }, h)
                })
                .collect();
            dev.copy_to_host(&mut batch)?;
        }
        d2h.push(t.elapsed());
        let t = Instant::now();
        for (b, chunk) in host.chunks(2 * obj * args.batch).enumerate() {
            let batch: Vec<_> = chunk
                .chunks(obj)
                .enumerate()
                .map(|(i, h)| {
                    let page = order[b * args.batch + i / 2];
                    ObjectCopy::new(page, if i % 2 == 0 { Part::K } else { Part::V }, h)
                })
                .collect();
            dev.copy_from_host(&batch)?;
        }
        h2d.push(t.elapsed());
        for (i, h) in host.chunks(obj).enumerate() {
            let s = &src[2 * order[i / 2] as usize + i % 2];
            anyhow::ensure!(h == &s[..], "object {i} changed on the way");
        }
        let t = Instant::now();
        raw(&dev, &mut host, obj, 2 * args.batch, true)?;
        raw_d2h.push(t.elapsed());
        let t = Instant::now();
        raw(&dev, &mut host, obj, 2 * args.batch, false)?;
        raw_h2d.push(t.elapsed());
        // The raw copies moved whole objects in region order; restore the pages' bytes.
        for (p, pair) in src.chunks(2).enumerate() {
            dev.copy_from_host(&[
                ObjectCopy::new(p as u32, Part::K, &pair[0][..]),
                ObjectCopy::new(p as u32, Part::V, &pair[1][..]),
            ])?;
        }
    }
    tracing::info!(batched = dev.batched(), "cuda transfer bench");
    let suffix = if scatter { " scattered" } else { "" };
    let row = |path: &str, ours, reference| {
        let (g, r) = (gbps(bytes, median(ours)), gbps(bytes, median(reference)));
        Row {
            path: format!("{path}{suffix}"),
            object_bytes: obj as u64,
            pages,
            bytes,
            gbps: g,
            memcpy_gbps: r,
            ratio: g / r,
        }
    };
    Ok(vec![
        row("device->host", d2h, raw_d2h),
        row("host->device", h2d, raw_h2d),
    ])
}
