//! CUDA device tier tests (feature `cuda`).
//!
//! They run three ways. On a machine with an NVIDIA driver and GPU they test the GPU. On
//! one without, each real-GPU test prints `SKIPPED: no CUDA driver` and checks only that
//! nothing panics. And `every_gpu_test_runs_on_the_emulated_driver` builds
//! `tests/fake_cuda/libcuda.c` (an emulated CUDA driver) into a temporary directory and
//! re-executes this test binary with it first on `LD_LIBRARY_PATH`, once per driver
//! configuration (batched copies, a driver too old for them, a driver refusing them, a
//! hung stream), so the CUDA code runs and is checked byte for byte in CI without a GPU.
//! Tests that need the emulated driver's counters or failure modes ask which driver
//! they are on.

#![cfg(feature = "cuda")]

mod common;
#[path = "fake_cuda/harness.rs"]
mod harness;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Daemon;
use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use harness::*;
use kvtier::layout::{ByteOrder, Layout, LayoutSpec, Part};
use kvtier::page::PageHash;
use kvtier::protocol::LoadWait;
use kvtier::tier::cuda::{CudaDevice, driver_present};
use kvtier::tier::device::{DeviceError, DeviceRegion, EmulatedDevice, ObjectCopy, pattern};
use kvtier::tier::tensors::KvTensors;

// ---- helpers ----------------------------------------------------------------------------

/// A directory for a daemon whose arena GPU clients pin: on tmpfs (`/dev/shm`), because
/// Linux lets no driver pin a shared mapping of a file on a disk file system (see
/// `an_arena_a_gpu_cannot_pin_is_refused_with_the_reason`).
fn pinnable_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kvtier-gpu-")
        .tempdir_in("/dev/shm")
        .expect("a temporary directory in /dev/shm (tmpfs)")
}

fn ok(r: CUresult, what: &str) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
}

/// What an engine's allocator does: device memory outside any kvtier region.
fn engine_alloc(dev: &CudaDevice, bytes: usize) -> CUdeviceptr {
    dev.context().bind_to_thread().unwrap();
    let mut p = 0;
    // SAFETY: allocates on the bound context; the test frees it.
    ok(unsafe { sys::cuMemAlloc_v2(&mut p, bytes) }, "cuMemAlloc");
    p
}

fn engine_write(dev: &CudaDevice, at: CUdeviceptr, data: &[u8]) {
    dev.context().bind_to_thread().unwrap();
    // SAFETY: `at..at+len` lies in an engine allocation; the copy is synchronous.
    ok(
        unsafe { sys::cuMemcpyHtoD_v2(at, data.as_ptr().cast(), data.len()) },
        "cuMemcpyHtoD",
    );
}

fn engine_read(dev: &CudaDevice, at: CUdeviceptr, len: usize) -> Vec<u8> {
    dev.context().bind_to_thread().unwrap();
    let mut out = vec![0u8; len];
    // SAFETY: as `engine_write`.
    ok(
        unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), at, len) },
        "cuMemcpyDtoH",
    );
    out
}

fn object_pair(emu: &EmulatedDevice, slot: u32) -> (Vec<u8>, Vec<u8>) {
    let mut k = vec![0u8; emu.object_bytes()];
    let mut v = vec![0u8; emu.object_bytes()];
    emu.copy_to_host(&mut [
        ObjectCopy::new(slot, Part::K, &mut k[..]),
        ObjectCopy::new(slot, Part::V, &mut v[..]),
    ])
    .unwrap();
    (k, v)
}

// ---- tests that run on any driver -------------------------------------------------------

#[test]
fn without_a_driver_construction_is_an_error_not_a_panic() {
    if driver_present() {
        return;
    }
    let layout = LayoutSpec::mha(2, 2, 16, 2, 4).build().unwrap();
    let e = CudaDevice::new(&layout, 0, 4, 0)
        .err()
        .expect("no region without a driver");
    assert!(e.to_string().contains("no CUDA driver"), "{e}");
    // Bad tensors are refused before the driver is asked.
    let t = KvTensors::new(vec![1 << 20; 3], 4096, 4);
    // SAFETY: refused before any address is used.
    let e = unsafe { CudaDevice::wrap(&layout, 0, &t, 0) }.err().unwrap();
    assert!(matches!(e, DeviceError::Tensors(_)), "{e}");
    gpu();
}

#[test]
fn objects_round_trip_through_gpu_memory_in_both_byte_orders() {
    if !gpu() {
        return;
    }
    for order in [ByteOrder::LayerFirst, ByteOrder::PageFirst] {
        let layout = LayoutSpec::mha(4, 4, 64, 2, 16).with_byte_order(order).build().unwrap();
        let dev = CudaDevice::new(&layout, 0, 8, 0).unwrap();
        // The emulated device defines the bytes an object must have.
        let emu = EmulatedDevice::new(&layout, 0, 8);
        emu.fill_page(3, 42).unwrap();
        let (k, v) = object_pair(&emu, 3);
        let mut pinned = vec![0u8; 4 * k.len()];
        dev.register_host(pinned.as_mut_ptr(), pinned.len()).unwrap();
        dev.copy_from_host(&[ObjectCopy::new(5, Part::K, &k[..]), ObjectCopy::new(5, Part::V, &v[..])])
            .unwrap();
        let (a, rest) = pinned.split_at_mut(k.len());
        let (b, _) = rest.split_at_mut(k.len());
        dev.copy_to_host(&mut [ObjectCopy::new(5, Part::K, a), ObjectCopy::new(5, Part::V, b)])
            .unwrap();
        assert_eq!(&pinned[..k.len()], &k[..], "{order:?} K");
        assert_eq!(&pinned[k.len()..2 * k.len()], &v[..], "{order:?} V");
        // The other pages were not touched.
        let mut other = vec![0u8; k.len()];
        dev.copy_to_host(&mut [ObjectCopy::new(4, Part::K, &mut other[..])])
            .unwrap();
        assert_ne!(other, k);
        assert!(matches!(
            dev.copy_from_host(&[ObjectCopy::new(8, Part::K, &k[..])]),
            Err(DeviceError::BadSlot { slot: 8, pages: 8 })
        ));
        assert!(matches!(
            dev.copy_from_host(&[ObjectCopy::new(0, Part::Latent, &k[..])]),
            Err(DeviceError::BadPart(Part::Latent))
        ));
        assert!(matches!(
            dev.copy_from_host(&[ObjectCopy::new(0, Part::K, &k[1..])]),
            Err(DeviceError::WrongSize { .. })
        ));
    }
}

#[test]
fn the_copy_path_follows_what_the_driver_offers() {
    let Some(scenario) = scenario() else {
        gpu();
        return;
    };
    gpu();
    // One layer, and pages 2 then 0: four one-run objects that step evenly along no line,
    // so nothing coalesces and the driver's copy path shows.
    let layout = LayoutSpec::mha(1, 2, 32, 2, 8).build().unwrap();
    let dev = CudaDevice::new(&layout, 0, 4, 0).unwrap();
    let emu = EmulatedDevice::new(&layout, 0, 4);
    emu.fill_page(1, 7).unwrap();
    emu.fill_page(3, 8).unwrap();
    let ((k, v), (k1, v1)) = (object_pair(&emu, 1), object_pair(&emu, 3));
    let before = stats();
    dev.copy_from_host(&[
        ObjectCopy::new(2, Part::K, &k[..]),
        ObjectCopy::new(2, Part::V, &v[..]),
        ObjectCopy::new(0, Part::K, &k1[..]),
        ObjectCopy::new(0, Part::V, &v1[..]),
    ])
    .unwrap();
    let mut back = vec![vec![0u8; k.len()]; 4];
    let mut batch: Vec<_> = back
        .iter_mut()
        .zip([(2, Part::K), (2, Part::V), (0, Part::K), (0, Part::V)])
        .map(|(h, (slot, part))| ObjectCopy::new(slot, part, &mut h[..]))
        .collect();
    dev.copy_to_host(&mut batch).unwrap();
    assert_eq!(back, [k, v, k1, v1]);
    let (batches, singles) = (delta(&before, ST_BATCHES), delta(&before, ST_COPIES));
    assert_eq!(delta(&before, ST_COPIES_2D), 0);
    match scenario.as_str() {
        // 4 one-run objects, one batch each way.
        "batched" => {
            assert!(dev.batched());
            assert_eq!((batches, singles), (2, 0));
        }
        // 12.4 has no batched copy: never tried.
        "old-driver" => {
            assert!(!dev.batched());
            assert_eq!((batches, singles), (0, 8));
        }
        // Tried once, refused, then copied singly from then on.
        "batch-refused" => {
            assert!(!dev.batched());
            assert_eq!((batches, singles), (0, 8));
        }
        other => panic!("unknown scenario {other:?}"),
    }
    // The copy stream waited on the compute stream each time.
    assert_eq!(delta(&before, ST_STREAM_WAITS), 2);
}

#[test]
fn consecutive_pages_move_in_one_copy_per_run() {
    // The emulated driver's counters say how the runs moved.
    if scenario().is_none() {
        gpu();
        return;
    }
    gpu();
    // 4 layers: each object is 4 runs of 1 KiB, one per layer.
    let layout = LayoutSpec::mha(4, 2, 32, 2, 8).build().unwrap();
    let dev = CudaDevice::new(&layout, 0, 8, 0).unwrap();
    let obj = dev.object_bytes();
    // Four pages' K and V objects side by side in one host buffer, as in arena slots.
    let src: Vec<u8> = (0..8).flat_map(|i| pattern(40 + i, obj)).collect();
    let objects = |slots: &[u32]| -> Vec<(u32, Part, usize)> {
        slots
            .iter()
            .enumerate()
            .flat_map(|(i, &s)| [(s, Part::K, 2 * i * obj), (s, Part::V, (2 * i + 1) * obj)])
            .collect()
    };
    for slots in [&[2u32, 3, 4, 5][..], &[7, 5, 2, 0][..]] {
        let before = stats();
        let batch: Vec<_> = objects(slots)
            .into_iter()
            .map(|(s, p, at)| ObjectCopy::new(s, p, &src[at..at + obj]))
            .collect();
        dev.copy_from_host(&batch).unwrap();
        let mut back = vec![0u8; src.len()];
        let mut out: Vec<_> = back
            .chunks_mut(obj)
            .zip(objects(slots))
            .map(|(h, (s, p, _))| ObjectCopy::new(s, p, h))
            .collect();
        dev.copy_to_host(&mut out).unwrap();
        assert!(back == src, "slots {slots:?}: bytes after a round trip");
        let (two_d, singles, batches) = (
            delta(&before, ST_COPIES_2D),
            delta(&before, ST_COPIES),
            delta(&before, ST_BATCHES),
        );
        // Consecutive slots: per (part, layer) one 2-D copy of the 4 pages, 2 x 4 each
        // way. Shuffled slots never step evenly across objects, but each object's layers
        // do (evenly spaced on the device, back to back on the host): one 2-D copy of 4
        // rows per object, 8 each way. Either way 16 2-D copies and nothing else.
        assert_eq!((two_d, singles, batches), (16, 0, 0), "slots {slots:?}");
    }
}

#[test]
fn copies_out_wait_for_the_engine_stream() {
    if !gpu() {
        return;
    }
    // The engine writes a page on its own stream and, without waiting, asks for it: the
    // copy out must follow the write (the copy stream waits on an event of that stream).
    let layout = LayoutSpec::mha(2, 2, 64, 2, 16).build().unwrap();
    let dev = CudaDevice::new(&layout, 0, 4, 0).unwrap();
    let engine = dev.context().new_stream().unwrap();
    let dev = dev.with_compute_stream(engine.clone());
    let obj = dev.object_bytes();
    let run = obj / 2;
    for round in 0..8u64 {
        let bytes: Vec<Vec<u8>> = (0..2).map(|l| pattern(round * 10 + l, run)).collect();
        dev.context().bind_to_thread().unwrap();
        for (l, b) in bytes.iter().enumerate() {
            // K of page 1, layer l, in an owned region: part 0, layer l, page 1; written
            // in pieces, as a kernel per head would, so the write takes a while.
            let at = dev.device_ptr() + ((l * 4 + 1) * run) as u64;
            for (i, piece) in b.chunks(run / 4).enumerate() {
                let to = at + (i * (run / 4)) as u64;
                // SAFETY: inside the region; `bytes` outlives the copy (synchronised below).
                let r =
                    unsafe { sys::cuMemcpyHtoDAsync_v2(to, piece.as_ptr().cast(), piece.len(), engine.cu_stream()) };
                ok(r, "engine write");
            }
        }
        let mut k = vec![0u8; obj];
        dev.copy_to_host(&mut [ObjectCopy::new(1, Part::K, &mut k[..])])
            .unwrap();
        engine.synchronize().unwrap();
        assert_eq!(&k[..run], &bytes[0][..], "round {round} layer 0");
        assert_eq!(&k[run..], &bytes[1][..], "round {round} layer 1");
    }
}

#[test]
fn pinned_registration_goes_in_chunks() {
    if !gpu() {
        return;
    }
    let layout = LayoutSpec::mha(2, 2, 16, 2, 4).build().unwrap();
    let emulated = driver() == Driver::Emulated;
    let mut host = vec![0u8; (1 << 20) + 123];
    let before = emulated.then(stats);
    {
        let dev = CudaDevice::new(&layout, 0, 4, 0)
            .unwrap()
            .with_pin_chunk_bytes(64 << 10);
        dev.register_host(host.as_mut_ptr(), host.len()).unwrap();
        // The same range again is a no-op.
        dev.register_host(host.as_mut_ptr(), host.len()).unwrap();
        if let Some(b) = &before {
            assert_eq!(delta(b, ST_REGISTERS), 17, "1 MiB + 123 B in 64 KiB chunks");
            assert_eq!(delta(b, ST_LIVE_REGISTRATIONS), 17);
        }
    }
    if let Some(b) = &before {
        assert_eq!(delta(b, ST_UNREGISTERS), 17, "dropping the region unregisters");
        assert_eq!(stats()[ST_LIVE_REGISTRATIONS], b[ST_LIVE_REGISTRATIONS]);
    }
    if emulated {
        // The emulated driver refuses single registrations above 4 MiB (as large ones
        // fail on real drivers): one 1 GiB chunk fails and leaves nothing registered,
        // 4 MiB chunks pass.
        let mut big = vec![0u8; 6 << 20];
        let b = stats();
        let dev = CudaDevice::new(&layout, 0, 4, 0).unwrap();
        let e = dev.register_host(big.as_mut_ptr(), big.len()).unwrap_err();
        assert!(e.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
        let dev = dev.with_pin_chunk_bytes(4 << 20);
        dev.register_host(big.as_mut_ptr(), big.len()).unwrap();
        assert_eq!(delta(&b, ST_REGISTERS), 2);
        // A second region over the same memory finds it registered, which is fine.
        let other = CudaDevice::new(&layout, 0, 4, 0).unwrap();
        other.register_host(big.as_mut_ptr(), 1 << 20).unwrap();
        assert_eq!(delta(&b, ST_REGISTERS), 2);
    }
}

/// The engine's KV tensors as one allocation holding `layers` vLLM-style tensors of
/// `blocks` pages, with K and V either split (`[2, blocks, ...]`) or interleaved
/// (`[blocks, 2, ...]`): offsets of each (part, layer) and the page stride.
fn vllm_offsets(layers: u64, blocks: u64, run: u64, interleaved: bool) -> (Vec<u64>, u64, u64) {
    let layer_bytes = 2 * blocks * run;
    let start = 256;
    let l = |i: u64| start + i * layer_bytes;
    let (v_off, stride) = if interleaved {
        (run, 2 * run)
    } else {
        (blocks * run, run)
    };
    let mut offs: Vec<u64> = (0..layers).map(l).collect();
    offs.extend((0..layers).map(|i| l(i) + v_off));
    (offs, stride, start + layers * layer_bytes)
}

#[test]
fn wrapped_engine_tensors_round_trip() {
    if !gpu() {
        return;
    }
    for order in [ByteOrder::LayerFirst, ByteOrder::PageFirst] {
        for interleaved in [false, true] {
            wrapped_case(order, interleaved);
        }
    }
}

fn wrapped_case(order: ByteOrder, interleaved: bool) {
    let what = format!("{order:?}, interleaved {interleaved}");
    let layout: Layout = LayoutSpec::mha(3, 2, 32, 2, 8).with_byte_order(order).build().unwrap();
    let blocks = 6u32;
    let run = (layout.page_tokens() as usize * layout.token_layer_bytes()) as u64;
    let (offs, stride, len) = vllm_offsets(3, blocks as u64, run, interleaved);
    // The reference: an emulated device addressed the same way.
    let t = KvTensors::new(offs.clone(), stride, blocks);
    let emu = EmulatedDevice::with_tensors(&layout, 0, &t, len as usize).unwrap();
    for s in 0..blocks {
        emu.fill_page(s, 1000 + s as u64).unwrap();
    }
    let probe = CudaDevice::new(&layout, 0, 1, 0).unwrap();
    let tensor = engine_alloc(&probe, len as usize);
    engine_write(&probe, tensor, &emu.read_raw(0, len as usize).unwrap());
    let t = KvTensors::new(offs.iter().map(|o| tensor + o).collect(), stride, blocks);
    let before = (driver() == Driver::Emulated).then(stats);
    {
        // SAFETY: `tensor` is device memory of this context, freed after the region.
        let dev = unsafe { CudaDevice::wrap(&layout, 0, &t, 0) }.unwrap();
        assert!(dev.is_wrapped());
        assert_eq!(dev.pages(), blocks);
        // Out: every page as the reference reads it.
        for s in 0..blocks {
            let want = object_pair(&emu, s);
            let (mut k, mut v) = (vec![0u8; want.0.len()], vec![0u8; want.1.len()]);
            dev.copy_to_host(&mut [
                ObjectCopy::new(s, Part::K, &mut k[..]),
                ObjectCopy::new(s, Part::V, &mut v[..]),
            ])
            .unwrap();
            assert!(k == want.0 && v == want.1, "{what}: page {s}");
        }
        // In: page 2's objects into page 4; only page 4's runs of the tensor change.
        let (k, v) = object_pair(&emu, 2);
        dev.copy_from_host(&[ObjectCopy::new(4, Part::K, &k[..]), ObjectCopy::new(4, Part::V, &v[..])])
            .unwrap();
        emu.copy_from_host(&[ObjectCopy::new(4, Part::K, &k[..]), ObjectCopy::new(4, Part::V, &v[..])])
            .unwrap();
        let got = engine_read(&dev, tensor, len as usize);
        assert!(
            got == emu.read_raw(0, len as usize).unwrap(),
            "{what}: tensor bytes after a load"
        );
        assert!(matches!(
            dev.copy_to_host(&mut [ObjectCopy::new(blocks, Part::K, &mut vec![0u8; k.len()][..])]),
            Err(DeviceError::BadSlot { .. })
        ));
    }
    if let Some(b) = &before {
        assert_eq!(
            delta(b, ST_FREES),
            0,
            "{what}: a wrapped region never frees the engine's memory"
        );
    }
    // Still the engine's: readable, then freed by its owner.
    assert_eq!(engine_read(&probe, tensor, 64), emu.read_raw(0, 64).unwrap());
    // SAFETY: allocated above; nothing uses it any more.
    ok(unsafe { sys::cuMemFree_v2(tensor) }, "cuMemFree");
}

#[test]
fn wrapped_tensors_outside_device_memory_fail_the_copy() {
    let Some(_) = scenario() else {
        return;
    };
    gpu();
    // The engine claims 4 interleaved [blocks, 2, ...] pages but allocated 3: page 3
    // lies past the allocation, and the driver refuses the copy instead of touching
    // other memory.
    let layout = LayoutSpec::mha(1, 1, 16, 2, 4).build().unwrap();
    let run = (layout.page_tokens() as usize * layout.token_layer_bytes()) as u64;
    let probe = CudaDevice::new(&layout, 0, 1, 0).unwrap();
    let tensor = engine_alloc(&probe, (3 * 2 * run) as usize);
    let t = KvTensors::new(vec![tensor, tensor + run], 2 * run, 4);
    // SAFETY: deliberately wrong, on the emulated driver only.
    let dev = unsafe { CudaDevice::wrap(&layout, 0, &t, 0) }.unwrap();
    let mut buf = vec![0u8; dev.object_bytes()];
    dev.copy_to_host(&mut [ObjectCopy::new(2, Part::V, &mut buf[..])])
        .unwrap();
    let e = dev
        .copy_to_host(&mut [ObjectCopy::new(3, Part::K, &mut buf[..])])
        .unwrap_err();
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
    drop(dev);
    // SAFETY: allocated above.
    ok(unsafe { sys::cuMemFree_v2(tensor) }, "cuMemFree");
}

#[test]
fn client_stores_and_loads_gpu_pages_through_the_daemon() {
    if !gpu() {
        return;
    }
    let tmp = pinnable_dir();
    // Slots for this layout's 32 KiB objects.
    let d = Daemon::start_with(tmp.path(), 64 << 20, &["slot_bytes=32768"]);
    let spec = LayoutSpec::mha(4, 4, 64, 2, 16);
    let layout = spec.clone().build().unwrap();
    let c = d.client(common::identity("gpu", 0, 0, 1, 1), spec);
    let dev = Arc::new(
        CudaDevice::new(&layout, 0, 16, 0)
            .unwrap()
            .with_pin_chunk_bytes(4 << 20),
    );
    let before = (driver() == Driver::Emulated).then(stats);
    c.register_device(dev.clone()).unwrap();
    if let Some(b) = &before {
        assert!(delta(b, ST_REGISTERS) >= 2, "the arena is pinned in 4 MiB chunks");
    }
    let obj = dev.object_bytes();
    let src: Vec<Vec<u8>> = (0..8u64).map(|i| pattern(i, obj)).collect();
    for p in 0..4u32 {
        dev.copy_from_host(&[
            ObjectCopy::new(p, Part::K, &src[2 * p as usize][..]),
            ObjectCopy::new(p, Part::V, &src[2 * p as usize + 1][..]),
        ])
        .unwrap();
    }
    let before = (driver() == Driver::Emulated).then(stats);
    let hashes: Vec<PageHash> = (0..4).map(|i| PageHash::from_u64(0x6000 + i)).collect();
    let r = c.store(&hashes, &[0, 1, 2, 3], "gpu").unwrap();
    assert_eq!(r.complete, 4);
    c.removed(&hashes).unwrap();
    assert_eq!(c.load(&hashes, &[8, 9, 10, 11], LoadWait::WaitComplete).unwrap(), 4);
    if let Some(b) = &before {
        assert_eq!(delta(b, ST_PAGEABLE), 0, "store and load copy only pinned arena memory");
        assert!(delta(b, ST_BATCHES) + delta(b, ST_COPIES) + delta(b, ST_COPIES_2D) > 0);
        // Each copy batch waits once for the engine's stream: one batch for the 4-page
        // store and one for the 4-page load, not one per page.
        assert_eq!(delta(b, ST_STREAM_WAITS), 2, "one device batch per request");
    }
    for p in 0..4u32 {
        let mut k = vec![0u8; obj];
        let mut v = vec![0u8; obj];
        dev.copy_to_host(&mut [
            ObjectCopy::new(8 + p, Part::K, &mut k[..]),
            ObjectCopy::new(8 + p, Part::V, &mut v[..]),
        ])
        .unwrap();
        assert_eq!(k, src[2 * p as usize], "page {p} K");
        assert_eq!(v, src[2 * p as usize + 1], "page {p} V");
    }
}

#[test]
fn an_arena_a_gpu_cannot_pin_is_refused_with_the_reason() {
    if !gpu() {
        return;
    }
    // An arena file on a disk file system: the driver's pin of it fails (Linux 6.5 on
    // refuses long-term writable pins of such file pages), and the client's error says
    // why and what to do, instead of the driver's bare CUDA_ERROR_INVALID_VALUE.
    // The build's scratch directory, or (a prebuilt test binary on another machine) the
    // working directory or /var/tmp: the first on a file system a GPU cannot pin.
    let on_disk = [env!("CARGO_TARGET_TMPDIR"), ".", "/var/tmp"]
        .into_iter()
        .find_map(|d| {
            let tmp = tempfile::tempdir_in(d).ok()?;
            let file = std::fs::File::open(tmp.path()).ok()?;
            kvtier::tier::mapping::gpu_pin_refusal(&file).map(|_| tmp)
        });
    let Some(tmp) = on_disk else {
        say("SKIPPED: no directory on a file system a GPU cannot pin (all tmpfs or hugetlbfs)");
        return;
    };
    let admin = format!("admin.socket={}", tmp.path().join("admin.sock").display());
    let d = Daemon::start_with(tmp.path(), 4 << 20, &["slot_bytes=32768", &admin]);
    let spec = LayoutSpec::mha(4, 4, 64, 2, 16);
    let layout = spec.clone().build().unwrap();
    let c = d.client(common::identity("gpu-unpinnable", 0, 0, 1, 1), spec);
    let dev = Arc::new(CudaDevice::new(&layout, 0, 4, 0).unwrap());
    let err = c.register_device(dev).unwrap_err().to_string();
    assert!(
        err.contains("cuMemHostRegister") && err.contains("tmpfs") && err.contains(d.arena.to_str().unwrap()),
        "{err}"
    );
    let (code, status) = common::admin_json(&d.wait_admin().admin, "GET", "/v1/status", None);
    assert_eq!(code, 200, "{status}");
    let why = &status["host_arena"]["mapping"]["gpu_pin_refusal"];
    assert!(why.as_str().is_some_and(|w| w.contains("tmpfs")), "status: {status}");
}

#[test]
fn the_c_abi_registers_engine_tensors_and_moves_pages_through_them() {
    use kvtier::ffi::{self, capi::*};
    use std::ffi::CString;
    if !gpu() {
        return;
    }
    // What an engine does through the C ABI: its vLLM-shaped [2, blocks, ...] tensors per
    // layer, registered as they are, then a store and a load between pages of them.
    let tmp = pinnable_dir();
    let d = Daemon::start(tmp.path(), 2 << 20);
    let (layers, blocks, run) = (2u64, 8u64, 256u64); // run: 4 tokens x 2 heads x 16 dims x 2 B
    let layout = LayoutSpec::mha(2, 2, 16, 2, 4).build().unwrap();
    let probe = CudaDevice::new(&layout, 0, 1, 0).unwrap();
    let (offs, stride, len) = vllm_offsets(layers, blocks, run, false);
    let tensor = engine_alloc(&probe, len as usize);
    let initial = pattern(77, len as usize);
    engine_write(&probe, tensor, &initial);
    let ptrs: Vec<u64> = offs.iter().map(|o| tensor + o).collect();

    let socket = CString::new(d.socket.to_str().unwrap()).unwrap();
    let (inst, model, session) = (
        CString::new("capi-gpu").unwrap(),
        CString::new("test-model").unwrap(),
        CString::new("s").unwrap(),
    );
    let opts = ConnectOptions {
        struct_size: std::mem::size_of::<ConnectOptions>(),
        socket: socket.as_ptr(),
        instance: inst.as_ptr(),
        model: model.as_ptr(),
        lora: std::ptr::null(),
        salt: std::ptr::null(),
        ranks: [0, 1, 0, 1, 0],
        geometry: [2, 2, 16, 2, 4],
        attention: 0,
        byte_order: 0,
        timeout_ms: 5000,
        dtype: 0,
        kv_order: 0,
        has_daemon_uid: 0,
        daemon_uid: 0,
    };
    let hashes: Vec<u8> = (0x7000u64..0x7003).flat_map(|v| v.to_be_bytes()).collect();
    let (from, to) = ([0u32, 1, 2], [5u32, 6, 7]);
    let mut receipt = StoreReceiptC {
        ticket: 0,
        written: 0,
        complete: 0,
    };
    let mut loaded = 0usize;
    // SAFETY: valid options, pointers and lengths; `ptrs` are live device memory.
    unsafe {
        let mut h = std::ptr::null_mut();
        assert_eq!(kvtier_connect(&opts, &mut h), ffi::OK);
        let rc = kvtier_register_cuda_tensors(h, 0, ptrs.as_ptr(), ptrs.len(), stride, blocks as u32, 0);
        assert_eq!(rc, ffi::OK, "{:?}", std::ffi::CStr::from_ptr(kvtier_last_error()));
        let rc = kvtier_store(
            h,
            hashes.as_ptr(),
            8,
            3,
            from.as_ptr(),
            3,
            session.as_ptr(),
            &mut receipt,
        );
        assert_eq!(rc, ffi::OK);
        assert_eq!(receipt.complete, 3);
        assert_eq!(kvtier_removed(h, hashes.as_ptr(), 8, 3), ffi::OK);
        let rc = kvtier_load(h, hashes.as_ptr(), 8, 3, to.as_ptr(), 3, 1, 0, &mut loaded);
        assert_eq!((rc, loaded), (ffi::OK, 3));
        assert_eq!(kvtier_close(h), ffi::OK);
    }
    // Pages 5..8 of every (part, layer) now hold pages 0..3; nothing else changed.
    let mut want = initial.clone();
    for &o in &offs {
        for (&f, &t) in from.iter().zip(&to) {
            let (f, t) = ((o + f as u64 * stride) as usize, (o + t as u64 * stride) as usize);
            want.copy_within(f..f + run as usize, t);
        }
    }
    assert!(
        engine_read(&probe, tensor, len as usize) == want,
        "tensor bytes after store and load"
    );
    // SAFETY: allocated above; the client is closed.
    ok(unsafe { sys::cuMemFree_v2(tensor) }, "cuMemFree");
}

#[test]
fn copy_batches_wait_on_an_event_never_inside_the_driver() {
    if !gpu() {
        return;
    }
    let layout = LayoutSpec::mha(2, 2, 16, 2, 4).build().unwrap();
    let dev = CudaDevice::new(&layout, 0, 8, 0).unwrap();
    let obj = dev.object_bytes();
    let src: Vec<Vec<u8>> = (0..8u64).map(|i| pattern(100 + i, obj)).collect();
    let before = (driver() == Driver::Emulated).then(stats);
    for p in 0..4usize {
        dev.copy_from_host(&[
            ObjectCopy::new(p as u32, Part::K, &src[2 * p][..]),
            ObjectCopy::new(p as u32, Part::V, &src[2 * p + 1][..]),
        ])
        .unwrap();
    }
    let mut back = vec![vec![0u8; obj]; 8];
    let mut batch: Vec<_> = back
        .iter_mut()
        .enumerate()
        .map(|(i, h)| ObjectCopy::new(i as u32 / 2, [Part::K, Part::V][i % 2], &mut h[..]))
        .collect();
    dev.copy_to_host(&mut batch).unwrap();
    // Each batch returned only once its copies had landed (the emulated driver runs them
    // late, on the stream's own thread).
    assert!(back == src, "bytes read back after the batches");
    if let Some(b) = &before {
        // Completion is an event queried with a deadline: no blocking call into the
        // driver (which could never be abandoned) and no host function (whose callback
        // thread's wake-up cost a batch up to 300 us on an H200).
        assert!(
            delta(b, ST_EVENT_QUERIES) >= 5,
            "each of the 5 batches queries its event"
        );
        assert_eq!(delta(b, ST_EVENT_SYNCS) + delta(b, ST_STREAM_SYNCS), 0);
        assert_eq!(delta(b, ST_HOST_FUNCS), 0);
    }
}

#[test]
fn hung_copies_time_out_and_break_the_region() {
    if scenario().as_deref() != Some("hung") {
        return;
    }
    gpu();
    let layout = LayoutSpec::mha(2, 2, 16, 2, 4).build().unwrap();
    let dev = CudaDevice::new(&layout, 0, 4, 0)
        .unwrap()
        .with_copy_timeout(Duration::from_millis(200));
    let obj = vec![1u8; dev.object_bytes()];
    let before = stats();
    let t = Instant::now();
    let e = dev
        .copy_from_host(&[ObjectCopy::new(0, Part::K, &obj[..])])
        .unwrap_err();
    assert!(e.to_string().contains("did not finish"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(dev.is_broken());
    // The watchdog fired with the copy still queued, having asked the driver only
    // questions that return at once.
    assert_eq!(delta(&before, ST_COPIES_RUN), 0);
    assert!(delta(&before, ST_EVENT_QUERIES) > 0);
    assert_eq!(delta(&before, ST_EVENT_SYNCS) + delta(&before, ST_STREAM_SYNCS), 0);
    let (queries, records) = (delta(&before, ST_EVENT_QUERIES), delta(&before, ST_EVENT_RECORDS));
    let e = dev
        .copy_from_host(&[ObjectCopy::new(1, Part::K, &obj[..])])
        .unwrap_err();
    assert!(e.to_string().contains("unusable"), "{e}");
    assert_eq!(
        (delta(&before, ST_EVENT_QUERIES), delta(&before, ST_EVENT_RECORDS)),
        (queries, records),
        "a refused batch queues and waits for nothing"
    );
    // Dropping does not wait for the stream that never finishes.
    let t = Instant::now();
    drop(dev);
    assert!(t.elapsed() < Duration::from_secs(1));
    // The stream comes back long after the timeout (slow, not dead): the copy runs, and
    // the event behind it completes, with the region and its waiter long gone; the
    // driver holds its own reference to the event.
    release_hang();
    let deadline = Instant::now() + Duration::from_secs(30);
    while delta(&before, ST_COPIES_RUN) == 0 {
        assert!(Instant::now() < deadline, "the late copy never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The copy no longer reads `obj`, so it may go.
    drop(obj);
}

#[test]
fn bench_transfer_runs_on_the_emulated_driver() {
    if scenario().as_deref() != Some("batched") {
        return;
    }
    gpu();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "bench",
            "transfer",
            "--device",
            "cuda",
            "--sizes-kib",
            "16",
            "--mib",
            "1",
        ])
        .args(["--runs", "1", "--batch", "8"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("device->host") && stdout.contains("host->device"),
        "{stdout}"
    );
    assert!(stderr.contains("emulated CUDA device"), "{stderr}");
    say("bench transfer --device cuda ran on the emulated driver (a smoke test: its figures are meaningless)");
}

// ---- the launcher ----------------------------------------------------------------------

#[test]
fn every_gpu_test_runs_on_the_emulated_driver() {
    if std::env::var_os(SCENARIO).is_some() {
        return; // this is a re-executed process
    }
    let tmp = tempfile::tempdir().unwrap();
    build_fake_driver(tmp.path());
    let me = "every_gpu_test_runs_on_the_emulated_driver";
    let skip: &[&str] = &["--skip", me];
    let scenarios: [Scenario; 4] = [
        ("batched", &[], skip),
        ("old-driver", &[("KVTIER_FAKE_CUDA_VERSION", "12040")], skip),
        ("batch-refused", &[("KVTIER_FAKE_CUDA_NO_BATCH", "1")], skip),
        (
            "hung",
            &[("KVTIER_FAKE_CUDA_HANG", "1")],
            &["--exact", "hung_copies_time_out_and_break_the_region"],
        ),
    ];
    for (name, env, filter) in scenarios {
        let out = run_scenario(tmp.path(), name, env, filter);
        assert!(!out.contains("SKIPPED"), "scenario {name} skipped a test:\n{out}");
        assert!(
            out.contains("running on the emulated CUDA driver (no GPU)"),
            "scenario {name} did not use the emulated driver:\n{out}"
        );
        let n = passed(&out);
        let want = if name == "hung" { 1 } else { 14 };
        assert_eq!(n, want, "scenario {name}: {n} tests passed, expected {want}:\n{out}");
        say(&format!(
            "emulated CUDA driver (no GPU), scenario {name}: {n} GPU tests passed"
        ));
    }
}
