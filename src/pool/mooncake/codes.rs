//! Mooncake Store's error codes and their typed meaning.
//!
//! The store answers every object operation with an integer: zero or a length on success,
//! a negative `ErrorCode` (upstream `mooncake-store/include/types.h`) otherwise. Both the
//! helper path and the C ABI path see the same integers, so both map them here.

use crate::pool::PoolError;

pub const INTERNAL_ERROR: i64 = -1;
pub const BUFFER_OVERFLOW: i64 = -10;
pub const SEGMENT_NOT_FOUND: i64 = -101;
pub const NO_AVAILABLE_HANDLE: i64 = -200;
pub const INVALID_KEY: i64 = -400;
pub const WRITE_FAIL: i64 = -500;
pub const INVALID_PARAMS: i64 = -600;
pub const ILLEGAL_CLIENT: i64 = -601;
pub const INVALID_READ: i64 = -701;
pub const REPLICA_IS_NOT_READY: i64 = -703;
pub const OBJECT_NOT_FOUND: i64 = -704;
pub const OBJECT_ALREADY_EXISTS: i64 = -705;
pub const OBJECT_HAS_LEASE: i64 = -706;
pub const LEASE_EXPIRED: i64 = -707;
pub const OBJECT_HAS_REPLICATION_TASK: i64 = -708;
pub const TRANSFER_FAIL: i64 = -800;
pub const RPC_FAIL: i64 = -900;
pub const UNAVAILABLE_IN_CURRENT_STATUS: i64 = -1010;

/// Upstream's name for a code, for messages (never object bytes).
pub fn name(code: i64) -> &'static str {
    match code {
        INTERNAL_ERROR => "INTERNAL_ERROR",
        BUFFER_OVERFLOW => "BUFFER_OVERFLOW",
        SEGMENT_NOT_FOUND => "SEGMENT_NOT_FOUND",
        NO_AVAILABLE_HANDLE => "NO_AVAILABLE_HANDLE",
        INVALID_KEY => "INVALID_KEY",
        WRITE_FAIL => "WRITE_FAIL",
        INVALID_PARAMS => "INVALID_PARAMS",
        ILLEGAL_CLIENT => "ILLEGAL_CLIENT",
        INVALID_READ => "INVALID_READ",
        REPLICA_IS_NOT_READY => "REPLICA_IS_NOT_READY",
        OBJECT_NOT_FOUND => "OBJECT_NOT_FOUND",
        OBJECT_ALREADY_EXISTS => "OBJECT_ALREADY_EXISTS",
        OBJECT_HAS_LEASE => "OBJECT_HAS_LEASE",
        LEASE_EXPIRED => "LEASE_EXPIRED",
        OBJECT_HAS_REPLICATION_TASK => "OBJECT_HAS_REPLICATION_TASK",
        TRANSFER_FAIL => "TRANSFER_FAIL",
        RPC_FAIL => "RPC_FAIL",
        UNAVAILABLE_IN_CURRENT_STATUS => "UNAVAILABLE_IN_CURRENT_STATUS",
        _ => "UNKNOWN",
    }
}

/// Maps a negative code to a typed error. `need` is the object length the caller asked
/// for, and `got` the buffer it offered, for `BufferTooSmall`.
pub fn to_error(code: i64, got: usize) -> PoolError {
    match code {
        OBJECT_NOT_FOUND => PoolError::NotFound,
        OBJECT_HAS_LEASE => PoolError::HasLease,
        // get_into answers INVALID_PARAMS when the object does not fit the buffer; the
        // store does not say how large the object is.
        INVALID_PARAMS => PoolError::BufferTooSmall { got, need: got + 1 },
        NO_AVAILABLE_HANDLE => PoolError::NoSpace,
        OBJECT_ALREADY_EXISTS => PoolError::Exists,
        // The master is gone or restarting: the caller should treat the pool as down.
        RPC_FAIL | UNAVAILABLE_IN_CURRENT_STATUS | SEGMENT_NOT_FOUND => {
            PoolError::Unavailable(format!("Mooncake {} ({code})", name(code)))
        }
        _ => PoolError::Backend {
            code,
            message: name(code).to_owned(),
        },
    }
}

/// Whether a code means the store as a whole (not one object) is out of service.
pub fn is_outage(code: i64) -> bool {
    matches!(code, RPC_FAIL | UNAVAILABLE_IN_CURRENT_STATUS)
}

/// A put result: zero is success; an object that already exists is success too, since
/// keys name immutable content.
pub fn put_result(code: i64) -> Result<(), PoolError> {
    match code {
        0 | OBJECT_ALREADY_EXISTS => Ok(()),
        c => Err(to_error(c, 0)),
    }
}

/// A get result: a non-negative value is the object's length.
pub fn get_result(code: i64, buf_len: usize) -> Result<usize, PoolError> {
    if code >= 0 {
        usize::try_from(code).map_err(|_| PoolError::Backend {
            code,
            message: "length out of range".into(),
        })
    } else {
        Err(to_error(code, buf_len))
    }
}

/// An exists result: 1 present, 0 absent, negative an error.
pub fn exists_result(code: i64) -> Result<bool, PoolError> {
    match code {
        1 => Ok(true),
        0 | OBJECT_NOT_FOUND => Ok(false),
        c => Err(to_error(c, 0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_typed_errors() {
        assert_eq!(to_error(-706, 0), PoolError::HasLease);
        assert_eq!(to_error(-704, 0), PoolError::NotFound);
        assert!(matches!(to_error(-600, 10), PoolError::BufferTooSmall { got: 10, .. }));
        assert_eq!(to_error(-200, 0), PoolError::NoSpace);
        assert!(matches!(to_error(-900, 0), PoolError::Unavailable(_)));
        assert_eq!(
            to_error(-800, 0),
            PoolError::Backend {
                code: -800,
                message: "TRANSFER_FAIL".into()
            }
        );
        assert_eq!(put_result(-705), Ok(()));
        assert_eq!(get_result(4096, 4096), Ok(4096));
        assert_eq!(exists_result(0), Ok(false));
        assert_eq!(exists_result(1), Ok(true));
        assert!(exists_result(-1).is_err());
        assert!(is_outage(-900) && !is_outage(-704));
    }
}
