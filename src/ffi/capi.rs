//! The plain C ABI (`include/kvtier.h`): opaque handles, integer codes, a thread-local
//! message. Every entry point runs inside [`guard`], so a panic becomes
//! `KVTIER_ERR_INTERNAL` instead of unwinding into C; every pointer is checked for null
//! and every length against its partner before a slice is formed.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::sync::Arc;

use super::convert::{self, ConnectFields};
use super::{ERR_EMPTY_BATCH, ERR_INVALID, ERR_LENGTH_MISMATCH, ERR_NULL, FfiError, Handle, OK, guard, hashes_from};
use crate::page::{MAX_HASH_BYTES, PageHash};
use crate::protocol::MAX_PAGES;

pub use super::capi_device::*;
pub use super::capi_hint::*;
pub use super::capi_host::*;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last(msg: &str) {
    // A message with an interior NUL is cut there rather than lost.
    let cut = msg.split('\0').next().unwrap_or_default();
    let c = CString::new(cut).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs an entry point: `OK`, or the error's code with its message kept for the thread.
pub(super) fn run(f: impl FnOnce() -> Result<(), FfiError>) -> i32 {
    match guard(f) {
        Ok(()) => {
            set_last("");
            OK
        }
        Err(e) => {
            set_last(&e.message);
            e.code
        }
    }
}

pub(super) fn null(what: &str) -> FfiError {
    FfiError::new(ERR_NULL, format!("{what} is a null pointer"))
}

/// The live handle behind `p`: `ERR_NULL` for null, `ERR_CLOSED` for a handle closed
/// already or a pointer that never came from `kvtier_connect`. `p` is an id from the
/// handle registry and is never dereferenced, so no value of it is unsafe; the function
/// stays `unsafe` so entry points keep one shape.
///
/// # Safety
/// None beyond the type's: any value of `p` is handled.
pub(super) unsafe fn handle(p: *const Handle) -> Result<Arc<Handle>, FfiError> {
    if p.is_null() {
        return Err(null("the client handle"));
    }
    super::handle::lookup(p as usize as u64)
}

/// Runs an entry point on a live client handle: `ERR_NULL` when `client` is null,
/// `ERR_CLOSED` when it is closed.
///
/// # Safety
/// As [`handle`].
pub(super) unsafe fn on_handle(client: *const Handle, f: impl FnOnce(&Handle) -> Result<(), FfiError>) -> i32 {
    // SAFETY: caller contract.
    run(|| f(&*unsafe { handle(client) }?))
}

/// Runs an entry point that answers through one output pointer: the handle is checked,
/// then the output, and what `f` returns is written only when it succeeds.
///
/// # Safety
/// `client` as in [`on_handle`]; `output` is null or writable.
pub(super) unsafe fn to_output<T>(
    client: *const Handle,
    output: *mut T,
    f: impl FnOnce(&Handle) -> Result<T, FfiError>,
) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let (h, o) = unsafe { (handle(client)?, out(output, "the output")?) };
        *o = f(&h)?;
        Ok(())
    })
}

/// # Safety
/// `p` is null or points to writable memory for a `T`.
pub(super) unsafe fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, FfiError> {
    // SAFETY: caller contract.
    unsafe { p.as_mut() }.ok_or_else(|| null(what))
}

/// Copies `text` and a NUL into `buf`, which holds `cap` bytes. When they don't fit,
/// writes nothing and returns the bytes needed (NUL included).
///
/// # Safety
/// `buf` is non-null and valid for writes of `cap` bytes.
pub(super) unsafe fn copy_c_text(text: &str, buf: *mut c_char, cap: usize) -> Result<(), usize> {
    let need = text.len() + 1;
    if need > cap {
        return Err(need);
    }
    // SAFETY: the caller's contract covers `cap` bytes at `buf`; `need <= cap`.
    let dst = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), need) };
    dst[..text.len()].copy_from_slice(text.as_bytes());
    dst[text.len()] = 0;
    Ok(())
}

/// # Safety
/// `p` is null or a NUL-terminated string.
pub(super) unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, FfiError> {
    if p.is_null() {
        return Err(null(what));
    }
    // SAFETY: caller contract: NUL-terminated.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| FfiError::new(ERR_INVALID, format!("{what} is not UTF-8")))
}

/// Like [`text`], but null reads as the empty string.
pub(super) unsafe fn text_or_empty<'a>(p: *const c_char, what: &str) -> Result<&'a str, FfiError> {
    // SAFETY: caller contract.
    if p.is_null() { Ok("") } else { unsafe { text(p, what) } }
}

/// # Safety
/// `ptr` is null or valid for `hash_len * count` bytes.
pub(super) unsafe fn hash_batch(ptr: *const u8, hash_len: usize, count: usize) -> Result<Vec<PageHash>, FfiError> {
    if count == 0 {
        return Err(FfiError::new(ERR_EMPTY_BATCH, "the batch names no pages"));
    }
    if ptr.is_null() {
        return Err(null("the hash array"));
    }
    if !(8..=MAX_HASH_BYTES).contains(&hash_len) || count > MAX_PAGES {
        // Validated (with the precise message) before any slice is formed.
        return hashes_from(&[], hash_len, count);
    }
    // SAFETY: bounded above (at most 2 MiB) and the caller's contract covers the bytes.
    let bytes = unsafe { std::slice::from_raw_parts(ptr, hash_len * count) };
    hashes_from(bytes, hash_len, count)
}

/// # Safety
/// `ptr` is null or valid for `n` u32s.
pub(super) unsafe fn slot_batch<'a>(ptr: *const u32, n: usize, pages: usize) -> Result<&'a [u32], FfiError> {
    if n != pages {
        return Err(FfiError::new(
            ERR_LENGTH_MISMATCH,
            format!("{n} device slots for {pages} page hashes"),
        ));
    }
    if ptr.is_null() {
        return Err(null("the slot array"));
    }
    // SAFETY: `n` equals a page count already bounded by MAX_PAGES; caller contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// See `include/kvtier.h`.
#[unsafe(no_mangle)]
pub extern "C" fn kvtier_last_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// See `include/kvtier.h`.
#[unsafe(no_mangle)]
pub extern "C" fn kvtier_error_name(code: i32) -> *const c_char {
    let name: &'static CStr = match code {
        0 => c"ok",
        -1 => c"null",
        -2 => c"invalid",
        -3 => c"empty_batch",
        -4 => c"length_mismatch",
        -5 => c"unavailable",
        -6 => c"timeout",
        -7 => c"protocol",
        -8 => c"arena",
        -9 => c"device",
        -10 => c"layout",
        -11 => c"internal",
        -12 => c"buffer_too_small",
        -13 => c"unsupported",
        -14 => c"closed",
        -15 => c"untrusted",
        c if c <= super::ERR_REMOTE_BASE => c"remote",
        _ => c"unknown",
    };
    name.as_ptr()
}

/// The connect options struct of `include/kvtier.h`. Its size is its version: a caller
/// built against the first version (up to `timeout_ms`, [`CONNECT_OPTIONS_V1_SIZE`] bytes)
/// or the second (dtype and kv_order added, [`CONNECT_OPTIONS_V2_SIZE`] bytes) gets the
/// defaults of the fields added since.
#[repr(C)]
pub struct ConnectOptions {
    pub struct_size: usize,
    pub socket: *const c_char,
    pub instance: *const c_char,
    pub model: *const c_char,
    pub lora: *const c_char,
    pub salt: *const c_char,
    pub ranks: [u16; 5],
    pub geometry: [u32; 5],
    pub attention: u32,
    pub byte_order: u32,
    pub timeout_ms: u32,
    /// Since the second version of the struct: `KVTIER_DTYPE_*`.
    pub dtype: u32,
    /// Since the second version of the struct: `KVTIER_KV_ORDER_*`.
    pub kv_order: u32,
    /// Since the third version. Non-zero: `daemon_uid` is the uid the daemon runs as.
    /// Zero: this process's uid.
    pub has_daemon_uid: u32,
    pub daemon_uid: u32,
}

/// Where the first version of [`ConnectOptions`] ends: after `timeout_ms`.
const CONNECT_OPTIONS_V1_END: usize = std::mem::offset_of!(ConnectOptions, timeout_ms) + 4;
/// Where the second version ends: after `kv_order`.
const CONNECT_OPTIONS_V2_END: usize = std::mem::offset_of!(ConnectOptions, kv_order) + 4;
/// `sizeof` the first version of [`ConnectOptions`] (its end, padded to the struct's
/// alignment): a caller built against it connects with dtype unspecified, NHD order and
/// the daemon expected to run as this process's uid.
pub const CONNECT_OPTIONS_V1_SIZE: usize =
    CONNECT_OPTIONS_V1_END.next_multiple_of(std::mem::align_of::<ConnectOptions>());
/// `sizeof` the second version (dtype and kv_order, no daemon uid).
pub const CONNECT_OPTIONS_V2_SIZE: usize =
    CONNECT_OPTIONS_V2_END.next_multiple_of(std::mem::align_of::<ConnectOptions>());

/// `opts` as the current version: an older version's fields are copied into zeroed ones
/// (only its own fields are read, not its tail padding).
///
/// # Safety
/// `opts` points to at least `struct_size` readable bytes, as its caller said.
unsafe fn versioned(opts: *const ConnectOptions) -> Result<ConnectOptions, FfiError> {
    // SAFETY: every version starts with `struct_size`.
    let size = unsafe { std::ptr::read_unaligned(opts.cast::<usize>()) };
    let full = std::mem::size_of::<ConnectOptions>();
    let take = match size {
        s if s == full => full,
        s if s == CONNECT_OPTIONS_V2_SIZE => CONNECT_OPTIONS_V2_END,
        s if s == CONNECT_OPTIONS_V1_SIZE => CONNECT_OPTIONS_V1_END,
        _ => {
            return Err(FfiError::new(
                ERR_INVALID,
                format!(
                    "connect options of {size} bytes; this library expects {full} (or {CONNECT_OPTIONS_V2_SIZE} \
                     without daemon_uid, or {CONNECT_OPTIONS_V1_SIZE} without dtype and kv_order either)"
                ),
            ));
        }
    };
    let mut out = std::mem::MaybeUninit::<ConnectOptions>::zeroed();
    // SAFETY: `take <= size` bytes are readable (caller contract) and fit in `out`; all-zero
    // is a valid value of every field (integers and nullable pointers).
    unsafe {
        std::ptr::copy_nonoverlapping(opts.cast::<u8>(), out.as_mut_ptr().cast::<u8>(), take);
        Ok(out.assume_init())
    }
}

/// See `include/kvtier.h`.
///
/// # Safety
/// `len` is null or valid; `buf` is null or holds `*len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_default_socket(buf: *mut c_char, len: *mut usize) -> i32 {
    run(|| {
        // SAFETY: caller contract: `len` is null or valid.
        let cap = unsafe { len.as_mut() }.ok_or_else(|| null("the length pointer"))?;
        let path = crate::client::default_socket();
        let bytes = path.as_os_str().as_encoded_bytes();
        let need = bytes.len() + 1;
        if buf.is_null() || *cap < need {
            *cap = need;
            return Err(FfiError::new(
                super::ERR_BUFFER_TOO_SMALL,
                format!("the default socket path needs {need} bytes"),
            ));
        }
        // SAFETY: `buf` holds `*cap >= need` bytes (caller contract).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
            *buf.add(bytes.len()) = 0;
        }
        *cap = need;
        Ok(())
    })
}

/// # Safety
/// `opts` is null or a valid `kvtier_connect_options_t`; `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_connect(opts: *const ConnectOptions, out_client: *mut *mut Handle) -> i32 {
    run(|| {
        // SAFETY: caller contract.
        let slot = unsafe { out(out_client, "the output handle pointer") }?;
        *slot = std::ptr::null_mut();
        if opts.is_null() {
            return Err(null("the connect options"));
        }
        // SAFETY: caller contract: `struct_size` readable bytes.
        let o = &unsafe { versioned(opts) }?;
        // SAFETY: caller contract: NUL-terminated strings or null.
        let fields = unsafe {
            ConnectFields {
                socket: text(o.socket, "socket")?,
                instance: text(o.instance, "instance")?,
                model: text(o.model, "model")?,
                lora: text_or_empty(o.lora, "lora")?,
                salt: text_or_empty(o.salt, "salt")?,
                ranks: o.ranks,
                geometry: o.geometry,
                parallel: [o.ranks[1], o.ranks[3]],
                attention: o.attention,
                byte_order: o.byte_order,
                timeout_ms: o.timeout_ms as u64,
                dtype: o.dtype,
                kv_order: o.kv_order,
                daemon_uid: (o.has_daemon_uid != 0).then_some(o.daemon_uid),
            }
        };
        let id = super::handle::register(Handle::connect(fields.config()?)?)?;
        // The id, not an address: see `handle`.
        *slot = id as usize as *mut Handle;
        Ok(())
    })
}

/// Closes a handle. Null is a no-op; a second close of the same handle, or a pointer that
/// never came from `kvtier_connect`, is `ERR_CLOSED` (nothing is freed twice).
///
/// # Safety
/// None: any value of `client` is handled (it is an id, never dereferenced).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_close(client: *mut Handle) -> i32 {
    run(|| {
        if client.is_null() {
            return Ok(());
        }
        super::handle::unregister(client as usize as u64)
    })
}

/// The prefix hit struct of `include/kvtier.h`.
#[repr(C)]
pub struct PrefixHitC {
    pub device: u64,
    pub host: u64,
    pub pool: u64,
}

/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_lookup(
    client: *mut Handle,
    hashes: *const u8,
    hash_len: usize,
    count: usize,
    out_hit: *mut PrefixHitC,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        to_output(client, out_hit, |h| {
            let hit = h.client().lookup(&hash_batch(hashes, hash_len, count)?)?;
            Ok(PrefixHitC {
                device: hit.device as u64,
                host: hit.host as u64,
                pool: hit.pool as u64,
            })
        })
    }
}

/// The store receipt struct of `include/kvtier.h`.
#[repr(C)]
pub struct StoreReceiptC {
    pub ticket: u64,
    pub written: u64,
    pub complete: u32,
}

/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_store(
    client: *mut Handle,
    hashes: *const u8,
    hash_len: usize,
    count: usize,
    slots: *const u32,
    slot_count: usize,
    session: *const c_char,
    out_receipt: *mut StoreReceiptC,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        to_output(client, out_receipt, |h| {
            let hashes = hash_batch(hashes, hash_len, count)?;
            let slots = slot_batch(slots, slot_count, hashes.len())?;
            let session = text_or_empty(session, "session")?;
            let r = h.client().store(&hashes, slots, session)?;
            Ok(StoreReceiptC {
                ticket: r.ticket,
                written: r.written as u64,
                complete: r.complete,
            })
        })
    }
}

/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_load(
    client: *mut Handle,
    hashes: *const u8,
    hash_len: usize,
    count: usize,
    slots: *const u32,
    slot_count: usize,
    wait_mode: u32,
    wait_ms: u32,
    loaded: *mut usize,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        to_output(client, loaded, |h| {
            let hashes = hash_batch(hashes, hash_len, count)?;
            let slots = slot_batch(slots, slot_count, hashes.len())?;
            let wait = convert::load_wait(wait_mode, wait_ms)?;
            Ok(h.client().load(&hashes, slots, wait)?)
        })
    }
}

/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_removed(client: *mut Handle, hashes: *const u8, hash_len: usize, count: usize) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        on_handle(client, |h| {
            Ok(h.client().removed(&hash_batch(hashes, hash_len, count)?)?)
        })
    }
}
