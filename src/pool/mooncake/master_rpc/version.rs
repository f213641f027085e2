//! The master's version, asked on every new connection before any query goes out on it.
//!
//! The wheel's own client opens each connection to the master with `ServiceReady`, whose
//! answer is the master's store version (`GetMooncakeStoreVersion()`, the `MooncakeStore`
//! CMake project version, not the wheel's), and refuses a master whose version is not its
//! own. This client does the same, against the versions whose `BatchExistKey` it was
//! written and tested for ([`KNOWN_VERSIONS`]): a master of any other version is refused
//! with [`RpcError::Version`], which names it, and the pool asks the helper (the wheel's
//! own client) instead.
//!
//! ```text
//! request  = magic 0x15 | 0 | 0 | 0 | seq u32 | function 0x7b81bb56 u32 | len 0 | attach 0
//! response = header | struct_pack(expected<string, ErrorCode>)
//!          = type hash 0x1cb3cc35 | meta 0x04 | "\x87\x80\x0c\x01\0" | has_value u8
//!            | (len u8 | version bytes) or (ErrorCode i32)
//! ```

use super::{MAGIC, META_TYPE_INFO, REQ_HEAD, Reader, RpcError};

/// `coro_rpc`'s id of `WrappedMasterService::ServiceReady`.
pub(super) const FN_SERVICE_READY: u32 = 0x7b81_bb56;
/// `struct_pack` type hash of `expected<string, ErrorCode>`, with the meta flag set.
pub(super) const VERSION_HASH: u32 = 0x1cb3_cc35;
pub(super) const VERSION_TYPE: &[u8] = b"\x87\x80\x0c\x01\x00";
/// Master versions this client speaks: `2.0.0` is the store version of the pinned wheel
/// (mooncake-transfer-engine 0.3.13.post1) and of upstream's sources since.
pub const KNOWN_VERSIONS: &[&str] = &["2.0.0"];
/// The longest version string read from a master.
const MAX_VERSION: usize = 64;

/// The `ServiceReady` request frame.
pub(super) fn encode_request(seq: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(REQ_HEAD);
    out.extend_from_slice(&[MAGIC, 0, 0, 0]);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&FN_SERVICE_READY.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out
}

/// The version in a `ServiceReady` reply body: `Ok(Ok(version))`, `Ok(Err(code))` where
/// the master answered with an `ErrorCode`, `Err` for a body in another form.
pub(super) fn decode_reply(body: &[u8]) -> Result<Result<String, i32>, String> {
    let mut r = Reader { buf: body, at: 0 };
    let hash = u32::from_le_bytes(r.take(4)?.try_into().expect("4 bytes"));
    if hash | 1 != VERSION_HASH {
        return Err(format!(
            "ServiceReady reply type hash {hash:#010x}, not {VERSION_HASH:#010x}"
        ));
    }
    let width = if hash & 1 == 1 {
        let meta = r.take(1)?[0];
        if meta & 0x03 != 0 || meta & 0xe0 != 0 {
            return Err(format!("ServiceReady reply meta {meta:#04x}"));
        }
        if meta & META_TYPE_INFO != 0 && r.take(VERSION_TYPE.len())? != VERSION_TYPE {
            return Err("ServiceReady reply type string differs".into());
        }
        [1, 2, 4, 8][((meta >> 3) & 0x03) as usize]
    } else {
        1
    };
    let out = match r.take(1)?[0] {
        0 => Err(i32::from_le_bytes(r.take(4)?.try_into().expect("4 bytes"))),
        _ => {
            let n = r.uint(width)? as usize;
            if n > MAX_VERSION {
                return Err(format!("a {n}-byte version string"));
            }
            let v = r.take(n)?;
            Ok(String::from_utf8_lossy(v).into_owned())
        }
    };
    if r.at != body.len() {
        return Err(format!("{} bytes after the version", body.len() - r.at));
    }
    Ok(out)
}

/// `Ok` when this client speaks `version`'s `BatchExistKey`; otherwise the typed refusal.
pub(super) fn check(addr: &str, version: &str) -> Result<(), RpcError> {
    if KNOWN_VERSIONS.contains(&version) {
        return Ok(());
    }
    Err(RpcError::Version {
        addr: addr.to_owned(),
        version: version.to_owned(),
    })
}
