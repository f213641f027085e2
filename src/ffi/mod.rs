//! Foreign interfaces of the engine client: the cxx bridge for C++ ([`cxx`]) and a plain C
//! ABI for Python `ctypes` and anything else that can call C ([`capi`]).
//!
//! Both are thin: they translate arguments, call [`crate::client::Client`], and turn every
//! failure, panics included, into a stable integer code and a message. The codes are
//! shared by both interfaces and documented in `include/kvtier.h`; never renumber them,
//! only append.

pub mod capi;
mod capi_advice;
mod capi_device;
mod capi_hint;
mod capi_host;
mod capi_routing;
mod convert;
mod handle;
mod host_tensors;

pub use handle::Handle;
pub mod cxx;

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::client::ClientError;
use crate::hints::Reason;
use crate::page::{MAX_HASH_BYTES, PageHash};
use crate::tier::device::DeviceError;
use crate::tier::tensors::TensorError;

/// Success.
pub const OK: i32 = 0;
/// A required pointer argument was null.
pub const ERR_NULL: i32 = -1;
/// An argument is invalid (a wrong struct size, a bad hash length, a bad enum value).
pub const ERR_INVALID: i32 = -2;
/// A batch has no entries.
pub const ERR_EMPTY_BATCH: i32 = -3;
/// Two arrays that must be parallel have different lengths.
pub const ERR_LENGTH_MISMATCH: i32 = -4;
/// The daemon is not reachable (not running, restarting, or the connection broke).
pub const ERR_UNAVAILABLE: i32 = -5;
/// The daemon did not answer in time.
pub const ERR_TIMEOUT: i32 = -6;
/// The daemon answered something this client does not understand.
pub const ERR_PROTOCOL: i32 = -7;
/// The host arena could not be mapped or a slot is out of range.
pub const ERR_ARENA: i32 = -8;
/// A device copy failed or named a slot or part the region does not have.
pub const ERR_DEVICE: i32 = -9;
/// The layout or identity is invalid.
pub const ERR_LAYOUT: i32 = -10;
/// A bug inside kvtier (a caught panic); the handle should be closed.
pub const ERR_INTERNAL: i32 = -11;
/// The output buffer is too small.
pub const ERR_BUFFER_TOO_SMALL: i32 = -12;
/// This kvtier was built without a feature the call needs (`cuda`).
pub const ERR_UNSUPPORTED: i32 = -13;
/// The client handle was closed already, or never came from `kvtier_connect`.
pub const ERR_CLOSED: i32 = -14;
/// The socket's peer or the arena file belongs to another uid than the expected daemon's.
pub const ERR_UNTRUSTED: i32 = -15;
/// The daemon refused the request: the code is `ERR_REMOTE_BASE - <daemon error code>`
/// (the daemon's codes are `crate::protocol::ErrorCode`).
pub const ERR_REMOTE_BASE: i32 = -100;

/// A failure at the boundary: an integer code and a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FfiError {
    pub code: i32,
    pub message: String,
}

impl FfiError {
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// The message cxx carries into a C++ exception: `"[code N] message"`, which the C++
    /// helper `kvtier::error_code` parses back.
    pub fn tagged(&self) -> String {
        format!("[code {}] {}", self.code, self.message)
    }
}

impl std::fmt::Display for FfiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.tagged())
    }
}

impl From<ClientError> for FfiError {
    fn from(e: ClientError) -> Self {
        let code = match &e {
            ClientError::Unavailable(_) => ERR_UNAVAILABLE,
            ClientError::Timeout => ERR_TIMEOUT,
            ClientError::Remote(r) => ERR_REMOTE_BASE - r.code.code() as i32,
            ClientError::Recovering(_) => ERR_REMOTE_BASE - crate::protocol::ErrorCode::Recovering.code() as i32,
            ClientError::Protocol(_) => ERR_PROTOCOL,
            ClientError::Arena(_) => ERR_ARENA,
            ClientError::Device(_) => ERR_DEVICE,
            ClientError::Layout(_) => ERR_LAYOUT,
            ClientError::BadInput(_) => ERR_INVALID,
            ClientError::Untrusted { .. } => ERR_UNTRUSTED,
        };
        Self::new(code, e.to_string())
    }
}

impl From<DeviceError> for FfiError {
    fn from(e: DeviceError) -> Self {
        let code = match &e {
            DeviceError::Tensors(TensorError::Count { .. }) => ERR_LENGTH_MISMATCH,
            DeviceError::Tensors(_) => ERR_INVALID,
            DeviceError::NoCuda => ERR_UNSUPPORTED,
            _ => ERR_DEVICE,
        };
        Self::new(code, e.to_string())
    }
}

/// Runs `f`, turning a panic into `ERR_INTERNAL`, so no unwind crosses the boundary.
pub(crate) fn guard<T>(f: impl FnOnce() -> Result<T, FfiError>) -> Result<T, FfiError> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(FfiError::new(ERR_INTERNAL, format!("internal error (panic): {what}")))
        }
    }
}

/// Splits `bytes` into `count` page hashes of `hash_len` bytes each.
pub(crate) fn hashes_from(bytes: &[u8], hash_len: usize, count: usize) -> Result<Vec<PageHash>, FfiError> {
    if !(8..=MAX_HASH_BYTES).contains(&hash_len) {
        return Err(FfiError::new(
            ERR_INVALID,
            format!("a page hash has 8 to {MAX_HASH_BYTES} bytes, not {hash_len}"),
        ));
    }
    if count == 0 {
        return Err(FfiError::new(ERR_EMPTY_BATCH, "the batch names no pages"));
    }
    if count > crate::protocol::MAX_PAGES {
        return Err(FfiError::new(
            ERR_INVALID,
            format!(
                "{count} pages is more than the maximum batch of {}",
                crate::protocol::MAX_PAGES
            ),
        ));
    }
    if hash_len.checked_mul(count) != Some(bytes.len()) {
        return Err(FfiError::new(
            ERR_LENGTH_MISMATCH,
            format!("{} hash bytes are not {count} hashes of {hash_len} bytes", bytes.len()),
        ));
    }
    bytes
        .chunks_exact(hash_len)
        .map(|c| PageHash::new(c).map_err(|e| FfiError::new(ERR_INVALID, e.to_string())))
        .collect()
}

/// Stable numbers of hint reasons at the boundary (documented in `include/kvtier.h`).
pub(crate) fn reason_code(r: Reason) -> u32 {
    match r {
        Reason::UnknownPages => 1,
        Reason::PinBudget => 2,
        Reason::MaxTtl => 3,
        Reason::QueueFull => 4,
        Reason::PoolDegraded => 5,
        Reason::NoSpace => 6,
        Reason::AlreadyThere => 7,
        Reason::NotComplete => 8,
        Reason::UnknownSession => 9,
        Reason::WrongTier => 10,
        Reason::InFlight => 11,
        Reason::NoPool => 12,
        Reason::UnknownAction => 13,
        Reason::UnsupportedVersion => 14,
    }
}
