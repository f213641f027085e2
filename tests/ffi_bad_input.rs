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
        o.struct_size -= 8;
        assert_eq!(kvtier_connect(&o, &mut h), ffi::ERR_INVALID);
        assert!(h.is_null());
        o.struct_size += 8;
        o.socket = null();
        assert_eq!(kvtier_connect(&o, &mut h), ffi::ERR_NULL);
        assert_eq!(kvtier_close(null_mut()), ffi::OK);
        assert_eq!(kvtier_register_emulated(null_mut(), 4), ffi::ERR_NULL);
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

#[test]
fn error_names_are_stable() {
    let name = |c| {
        unsafe { CStr::from_ptr(kvtier_error_name(c)) }
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(name(ffi::OK), "ok");
    assert_eq!(name(ffi::ERR_UNAVAILABLE), "unavailable");
    assert_eq!(name(ffi::ERR_REMOTE_BASE - 9), "remote");
    assert_eq!(name(12345), "unknown");
}
