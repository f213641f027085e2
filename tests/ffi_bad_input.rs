//! Bad input through the C ABI functions themselves (the symbols `ctypes` calls): null
//! handles and pointers, zero-length batches, mismatched lengths, wrong struct sizes and a
//! daemon that went away. Each returns its code with a message; the process survives.

mod common;

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};

use common::Daemon;
use kvtier::ffi::capi::*;
use kvtier::ffi::{self, Handle};

fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated thread-local string.
    unsafe { CStr::from_ptr(kvtier_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn options(socket: &CString, instance: &CString, model: &CString) -> ConnectOptions {
    ConnectOptions {
        struct_size: std::mem::size_of::<ConnectOptions>(),
        socket: socket.as_ptr(),
        instance: instance.as_ptr(),
        model: model.as_ptr(),
        lora: null(),
        salt: null(),
        ranks: [0, 1, 0, 1, 0],
        geometry: [4, 4, 16, 2, 4],
        attention: 0,
        byte_order: 0,
        timeout_ms: 2000,
        dtype: 2,
        kv_order: 0,
        has_daemon_uid: 0,
        daemon_uid: 0,
    }
}

fn connect(d: &Daemon) -> *mut Handle {
    let socket = CString::new(d.socket.to_str().unwrap()).unwrap();
    let (inst, model) = (CString::new("capi").unwrap(), CString::new("capi-model").unwrap());
    let mut h = null_mut();
    // SAFETY: valid options and output pointer.
    let rc = unsafe { kvtier_connect(&options(&socket, &inst, &model), &mut h) };
    assert_eq!(rc, ffi::OK, "{}", last_error());
    assert!(!h.is_null());
    h
}

#[test]
fn null_and_size_errors_have_codes() {
    let mut hit = PrefixHitC {
        device: 9,
        host: 9,
        pool: 9,
    };
    let one = 1u64.to_be_bytes();
    // SAFETY: every call below is given nulls or valid pointers; that is the point.
    unsafe {
        assert_eq!(kvtier_lookup(null_mut(), one.as_ptr(), 8, 1, &mut hit), ffi::ERR_NULL);
        assert!(last_error().contains("client handle"), "{}", last_error());
        assert_eq!(kvtier_connect(null(), null_mut()), ffi::ERR_NULL);
        let mut h = null_mut();
        assert_eq!(kvtier_connect(null(), &mut h), ffi::ERR_NULL);
        let (s, i, m) = (
            CString::new("/nonexistent/kvtier.sock").unwrap(),
            CString::new("x").unwrap(),
            CString::new("m").unwrap(),
        );
        let mut o = options(&s, &i, &m);
        o.struct_size -= 4;
        assert_eq!(kvtier_connect(&o, &mut h), ffi::ERR_INVALID);
        assert!(h.is_null());
        // The first and second versions of the struct (no dtype and kv_order; no daemon
        // uid) are still taken: they get as far as the missing daemon.
        o.struct_size = CONNECT_OPTIONS_V1_SIZE;
        assert_eq!(kvtier_connect(&o, &mut h), ffi::ERR_UNAVAILABLE, "{}", last_error());
        o.struct_size = CONNECT_OPTIONS_V2_SIZE;
        assert_eq!(kvtier_connect(&o, &mut h), ffi::ERR_UNAVAILABLE, "{}", last_error());
        o.struct_size = std::mem::size_of::<ConnectOptions>();
        o.dtype = 99;
        assert_eq!(kvtier_connect(&o, &mut h), ffi::ERR_INVALID);
        assert!(last_error().contains("dtype 99"), "{}", last_error());
        o.dtype = 2;
        o.socket = null();
        assert_eq!(kvtier_connect(&o, &mut h), ffi::ERR_NULL);
        assert_eq!(kvtier_close(null_mut()), ffi::OK);
        assert_eq!(kvtier_register_emulated(null_mut(), 4), ffi::ERR_NULL);
        let ptrs = [1u64 << 20; 8];
        assert_eq!(
            kvtier_register_cuda_tensors(null_mut(), 0, ptrs.as_ptr(), 8, 4096, 4, 0),
            ffi::ERR_NULL
        );
        assert_eq!(kvtier_removed(null_mut(), one.as_ptr(), 8, 1), ffi::ERR_NULL);
        assert_eq!(kvtier_session(null_mut(), null(), null(), 0), ffi::ERR_NULL);
    }
    assert_eq!(hit.host, 9, "an output is left alone on error");
}

#[test]
fn batches_and_a_closed_daemon() {
    let tmp = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(tmp.path(), 8 << 20);
    let h = connect(&d);
    let hashes: Vec<u8> = (1u64..=3).flat_map(|v| v.to_be_bytes()).collect();
    let slots = [0u32, 1, 2];
    let mut hit = PrefixHitC {
        device: 0,
        host: 0,
        pool: 0,
    };
    let mut receipt = StoreReceiptC {
        ticket: 0,
        written: 0,
        complete: 0,
    };
    let mut loaded = 0usize;
    let session = CString::new("s").unwrap();
    // SAFETY: live handle; pointers valid for the lengths given (or null on purpose).
    unsafe {
        assert_eq!(kvtier_register_emulated(h, 0), ffi::ERR_INVALID);
        assert_eq!(kvtier_register_emulated(h, 8), ffi::OK);
        assert_eq!(kvtier_lookup(h, hashes.as_ptr(), 8, 0, &mut hit), ffi::ERR_EMPTY_BATCH);
        assert_eq!(kvtier_lookup(h, null(), 8, 0, &mut hit), ffi::ERR_EMPTY_BATCH);
        assert_eq!(kvtier_lookup(h, null(), 8, 3, &mut hit), ffi::ERR_NULL);
        assert_eq!(kvtier_lookup(h, hashes.as_ptr(), 7, 3, &mut hit), ffi::ERR_INVALID);
        assert_eq!(
            kvtier_lookup(h, hashes.as_ptr(), 8, usize::MAX, &mut hit),
            ffi::ERR_INVALID
        );
        let rc = kvtier_store(
            h,
            hashes.as_ptr(),
            8,
            3,
            slots.as_ptr(),
            2,
            session.as_ptr(),
            &mut receipt,
        );
        assert_eq!(rc, ffi::ERR_LENGTH_MISMATCH, "{}", last_error());
        let rc = kvtier_load(h, hashes.as_ptr(), 8, 3, slots.as_ptr(), 4, 0, 0, &mut loaded);
        assert_eq!(rc, ffi::ERR_LENGTH_MISMATCH);
        assert_eq!(
            kvtier_load(h, hashes.as_ptr(), 8, 3, slots.as_ptr(), 3, 7, 0, &mut loaded),
            ffi::ERR_INVALID
        );
        assert_eq!(kvtier_session(h, session.as_ptr(), null(), 9), ffi::ERR_INVALID);
        register_tensors_checks_its_arguments(h);
        register_tensor_runs_checks_its_arguments(h);
        let mut m = 0i32;
        assert_eq!(kvtier_device_page_matches(h, 8, 1, &mut m), ffi::ERR_DEVICE);
        assert_eq!(
            kvtier_device_write_object(h, 0, 5, [0u8; 4].as_ptr(), 4),
            ffi::ERR_INVALID
        );
        assert_eq!(kvtier_device_read_object(h, 0, 0, null_mut(), 4), ffi::ERR_NULL);

        // A real store and lookup still work on the same handle.
        for (i, &s) in slots.iter().enumerate() {
            assert_eq!(kvtier_device_fill_page(h, s, 100 + i as u64), ffi::OK);
        }
        let rc = kvtier_store(
            h,
            hashes.as_ptr(),
            8,
            3,
            slots.as_ptr(),
            3,
            session.as_ptr(),
            &mut receipt,
        );
        assert_eq!(rc, ffi::OK, "{}", last_error());
        assert_eq!(receipt.complete, 3);
        assert_eq!(kvtier_lookup(h, hashes.as_ptr(), 8, 3, &mut hit), ffi::OK);
        assert_eq!(hit.host + hit.device, 3);
        let back = [5u32, 6, 7];
        assert_eq!(
            kvtier_load(h, hashes.as_ptr(), 8, 3, back.as_ptr(), 3, 0, 0, &mut loaded),
            ffi::OK
        );
        assert_eq!(loaded, 3);
        for (i, &s) in back.iter().enumerate() {
            assert_eq!(kvtier_device_page_matches(h, s, 100 + i as u64, &mut m), ffi::OK);
            assert_eq!(m, 1, "page {i} came back different");
        }

        // The daemon goes away: a typed "unavailable", and the handle stays usable.
        d.signal(libc::SIGKILL);
        d.wait();
        assert_eq!(kvtier_lookup(h, hashes.as_ptr(), 8, 3, &mut hit), ffi::ERR_UNAVAILABLE);
        assert!(last_error().contains("unavailable"), "{}", last_error());
        assert_eq!(kvtier_removed(h, hashes.as_ptr(), 8, 3), ffi::ERR_UNAVAILABLE);
        assert_eq!(kvtier_close(h), ffi::OK);
    }
}

/// `kvtier_register_cuda_tensors` on a handle whose layout has 4 layers, K and V, and a
/// page run of 4 tokens x 4 heads x 16 dims x 2 bytes = 512 bytes: 8 addresses.
///
/// # Safety
/// `h` is a live handle.
unsafe fn register_tensors_checks_its_arguments(h: *mut Handle) {
    let run = 512u64;
    // K of layer l at (1 + l) MiB, V right after all of K's 16 pages.
    let good: Vec<u64> = (0..8u64).map(|i| ((1 + i % 4) << 20) + (i / 4) * 16 * run).collect();
    let reg = |ptrs: *const u64, n: usize, stride: u64, pages: u32| {
        // SAFETY: `ptrs` is null or points at `good`-sized arrays below.
        unsafe { kvtier_register_cuda_tensors(h, 0, ptrs, n, stride, pages, 0) }
    };
    assert_eq!(reg(null(), 8, run, 16), ffi::ERR_NULL);
    assert!(last_error().contains("null"), "{}", last_error());
    assert_eq!(reg(good.as_ptr(), 7, run, 16), ffi::ERR_LENGTH_MISMATCH);
    assert!(last_error().contains("x 4 layers = 8"), "{}", last_error());
    assert_eq!(reg(good.as_ptr(), 0, run, 16), ffi::ERR_LENGTH_MISMATCH);
    assert_eq!(reg(good.as_ptr(), 8, 0, 16), ffi::ERR_INVALID);
    assert!(last_error().contains("stride 0"), "{}", last_error());
    assert_eq!(reg(good.as_ptr(), 8, run - 1, 16), ffi::ERR_INVALID);
    assert_eq!(reg(good.as_ptr(), 8, run, 0), ffi::ERR_INVALID);
    let mut bad = good.clone();
    bad[5] = 0;
    assert_eq!(reg(bad.as_ptr(), 8, run, 16), ffi::ERR_INVALID);
    assert!(last_error().contains("tensor 5 (part V, layer 1)"), "{}", last_error());
    let mut bad = good.clone();
    bad[4] = bad[0] + 15 * run; // V of layer 0 starts in K's last page
    assert_eq!(reg(bad.as_ptr(), 8, run, 16), ffi::ERR_INVALID);
    assert!(last_error().contains("overlap"), "{}", last_error());
    // Well-formed: what happens next depends on the build.
    let rc = reg(good.as_ptr(), 8, run, 16);
    if cfg!(feature = "cuda") {
        if !kvtier_driver_present() {
            assert_eq!(rc, ffi::ERR_DEVICE, "{}", last_error());
        }
    } else {
        assert_eq!(rc, ffi::ERR_UNSUPPORTED, "{}", last_error());
        assert!(last_error().contains("without the `cuda` feature"), "{}", last_error());
        // SAFETY: live handle.
        assert_eq!(unsafe { kvtier_register_cuda(h, 0, 4) }, ffi::ERR_UNSUPPORTED);
    }
}

/// `kvtier_register_{host,cuda}_tensor_runs` on the same handle: pages of 512 bytes cut
/// into 2 runs of 256, vLLM's `LHBNC` shape (per layer `[heads, 16 blocks, ...]`, K the
/// first two head runs, V the last two).
///
/// # Safety
/// `h` is a live handle.
unsafe fn register_tensor_runs_checks_its_arguments(h: *mut Handle) {
    let (piece, blocks) = (256u64, 16u64);
    let layer = |l: u64| (1 + l) << 20;
    let good: Vec<u64> = (0..8u64).map(|i| layer(i % 4) + (i / 4) * 2 * blocks * piece).collect();
    let host = |ptrs: *const u64, n: usize, runs: u32, run_stride: u64| {
        // SAFETY: `ptrs` is null or points at `good`-sized arrays below; every call here is
        // refused before an address is touched.
        unsafe { kvtier_register_host_tensor_runs(h, ptrs, n, piece, blocks as u32, runs, run_stride) }
    };
    assert_eq!(host(null(), 8, 2, blocks * piece), ffi::ERR_NULL);
    assert_eq!(host(good.as_ptr(), 7, 2, blocks * piece), ffi::ERR_LENGTH_MISMATCH);
    assert_eq!(host(good.as_ptr(), 8, 0, blocks * piece), ffi::ERR_INVALID);
    assert!(last_error().contains("0 equal runs"), "{}", last_error());
    assert_eq!(host(good.as_ptr(), 8, 3, blocks * piece), ffi::ERR_INVALID);
    assert!(
        last_error().contains("512 bytes does not cut into 3"),
        "{}",
        last_error()
    );
    assert_eq!(host(good.as_ptr(), 8, u32::MAX, 1), ffi::ERR_INVALID);
    assert_eq!(host(good.as_ptr(), 8, 2, piece - 1), ffi::ERR_INVALID);
    assert!(last_error().contains("run stride 255"), "{}", last_error());
    // The second head run of a page inside the first one's last block.
    assert_eq!(host(good.as_ptr(), 8, 2, (blocks - 1) * piece), ffi::ERR_INVALID);
    assert!(last_error().contains("overlap"), "{}", last_error());
    // V's first run is K's second (V based one head run early).
    let mut bad = good.clone();
    bad[4] = bad[0] + blocks * piece;
    assert_eq!(host(bad.as_ptr(), 8, 2, blocks * piece), ffi::ERR_INVALID);
    assert!(last_error().contains("tensors 0 and 4 overlap"), "{}", last_error());
    let mut bad = good.clone();
    bad[7] = u64::MAX - piece;
    assert_eq!(host(bad.as_ptr(), 8, 2, blocks * piece), ffi::ERR_INVALID);
    assert!(last_error().contains("address space"), "{}", last_error());
    // SAFETY: null handle, refused first.
    let rc = unsafe { kvtier_register_host_tensor_runs(null_mut(), good.as_ptr(), 8, piece, 16, 2, blocks * piece) };
    assert_ne!(rc, ffi::OK);
    // The CUDA entry checks the same way, then needs the feature.
    let cuda = |ptrs: *const u64, runs: u32, run_stride: u64| {
        // SAFETY: as for `host`; no address is touched without a driver.
        unsafe { kvtier_register_cuda_tensor_runs(h, 0, ptrs, 8, piece, blocks as u32, runs, run_stride, 0) }
    };
    assert_eq!(cuda(null(), 2, blocks * piece), ffi::ERR_NULL);
    assert_eq!(cuda(good.as_ptr(), 3, blocks * piece), ffi::ERR_INVALID);
    assert_eq!(cuda(good.as_ptr(), 2, (blocks - 1) * piece), ffi::ERR_INVALID);
    let rc = cuda(good.as_ptr(), 2, blocks * piece);
    if cfg!(feature = "cuda") {
        if !kvtier_driver_present() {
            assert_eq!(rc, ffi::ERR_DEVICE, "{}", last_error());
        }
    } else {
        assert_eq!(rc, ffi::ERR_UNSUPPORTED, "{}", last_error());
    }
}

fn kvtier_driver_present() -> bool {
    #[cfg(feature = "cuda")]
    return kvtier::tier::cuda::driver_present();
    #[cfg(not(feature = "cuda"))]
    false
}

#[test]
fn error_names_are_stable() {
    let name = |c| {
        // SAFETY: kvtier_error_name returns a static NUL-terminated string for any code.
        unsafe { CStr::from_ptr(kvtier_error_name(c)) }
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(name(ffi::OK), "ok");
    assert_eq!(name(ffi::ERR_UNAVAILABLE), "unavailable");
    assert_eq!(name(ffi::ERR_UNSUPPORTED), "unsupported");
    assert_eq!(name(ffi::ERR_UNTRUSTED), "untrusted");
    assert_eq!(name(ffi::ERR_REMOTE_BASE - 9), "remote");
    assert_eq!(name(12345), "unknown");
}

#[test]
fn first_version_options_connect_and_a_daemon_of_another_uid_is_untrusted() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 8 << 20);
    let socket = CString::new(d.socket.to_str().unwrap()).unwrap();
    let (inst, model) = (CString::new("capi").unwrap(), CString::new("capi-model").unwrap());
    let me = kvtier::tier::private::euid();
    let mut h = null_mut();
    // A caller built against the first version: the struct ended at `timeout_ms`.
    let mut o = options(&socket, &inst, &model);
    o.struct_size = CONNECT_OPTIONS_V1_SIZE;
    // The first version has no dtype (unspecified): every connect below gives the same
    // layout, since the model name binds one.
    o.dtype = 0;
    o.has_daemon_uid = 1;
    o.daemon_uid = me + 1; // past the first version's end: never read
    // SAFETY: valid options (the first CONNECT_OPTIONS_V1_SIZE bytes are read) and output pointer.
    unsafe {
        assert_eq!(kvtier_connect(&o, &mut h), ffi::OK, "{}", last_error());
        assert_eq!(kvtier_close(h), ffi::OK);
    }
    // The second version (dtype and kv_order, no daemon uid): the uid is not read either.
    o.struct_size = CONNECT_OPTIONS_V2_SIZE;
    h = null_mut();
    // SAFETY: valid options (the first CONNECT_OPTIONS_V2_SIZE bytes are read) and output pointer.
    unsafe {
        assert_eq!(kvtier_connect(&o, &mut h), ffi::OK, "{}", last_error());
        assert_eq!(kvtier_close(h), ffi::OK);
    }
    // The current version, expecting the daemon to be another uid than it is.
    o.struct_size = std::mem::size_of::<ConnectOptions>();
    h = null_mut();
    // SAFETY: as above.
    let rc = unsafe { kvtier_connect(&o, &mut h) };
    assert_eq!(rc, ffi::ERR_UNTRUSTED, "{}", last_error());
    assert!(h.is_null());
    let e = last_error();
    assert!(
        e.contains(&format!("uid {me}")) && e.contains(&format!("uid {}", me + 1)),
        "both uids are named: {e}"
    );
    o.daemon_uid = me;
    // SAFETY: as above.
    unsafe {
        assert_eq!(kvtier_connect(&o, &mut h), ffi::OK, "{}", last_error());
        assert_eq!(kvtier_close(h), ffi::OK);
    }
    // The default socket the library reports is the daemon's.
    let mut len = 0usize;
    // SAFETY: a null buffer asks for the length.
    let rc = unsafe { kvtier_default_socket(null_mut(), &mut len) };
    assert_eq!(rc, ffi::ERR_BUFFER_TOO_SMALL);
    let mut buf = vec![0 as std::ffi::c_char; len];
    // SAFETY: `buf` holds `len` bytes.
    assert_eq!(unsafe { kvtier_default_socket(buf.as_mut_ptr(), &mut len) }, ffi::OK);
    // SAFETY: NUL-terminated by the call.
    let got = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap().to_owned();
    assert_eq!(std::path::PathBuf::from(got), kvtier::client::default_socket());
}

#[test]
fn closed_handles_are_refused_and_never_freed_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start(tmp.path(), 8 << 20);
    let (h, other) = (connect(&d), connect(&d));
    assert_ne!(h, other);
    let one = 1u64.to_be_bytes();
    let mut hit = PrefixHitC {
        device: 9,
        host: 9,
        pool: 9,
    };
    // SAFETY: handles are ids the library checks; pointers valid for the lengths given.
    unsafe {
        assert_eq!(kvtier_register_emulated(h, 4), ffi::OK);
        assert_eq!(kvtier_close(h), ffi::OK);
        // Closed twice, used after close, a value that never was a handle: codes, no crash.
        assert_eq!(kvtier_close(h), ffi::ERR_CLOSED);
        assert!(last_error().contains("closed"), "{}", last_error());
        assert_eq!(kvtier_lookup(h, one.as_ptr(), 8, 1, &mut hit), ffi::ERR_CLOSED);
        assert_eq!(hit.host, 9, "an output is left alone on error");
        assert_eq!(kvtier_device_fill_page(h, 0, 1), ffi::ERR_CLOSED);
        let bogus = 0xdead_beef_usize as *mut Handle;
        assert_eq!(kvtier_close(bogus), ffi::ERR_CLOSED);
        assert_eq!(kvtier_register_emulated(bogus, 4), ffi::ERR_CLOSED);
        // A new handle never reuses a closed one's id, so the stale one stays dead.
        let fresh = connect(&d);
        assert_ne!(fresh, h);
        assert_eq!(kvtier_lookup(h, one.as_ptr(), 8, 1, &mut hit), ffi::ERR_CLOSED);
        // The other handles are untouched by all of it.
        for live in [other, fresh] {
            assert_eq!(kvtier_lookup(live, one.as_ptr(), 8, 1, &mut hit), ffi::OK);
            assert_eq!((hit.device, hit.host, hit.pool), (0, 0, 0));
            assert_eq!(kvtier_close(live), ffi::OK);
        }
        assert_eq!(
            CStr::from_ptr(kvtier_error_name(ffi::ERR_CLOSED)).to_str(),
            Ok("closed")
        );
    }
}
