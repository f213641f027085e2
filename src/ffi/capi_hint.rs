//! The C ABI's session and hint entry points (see `include/kvtier.h`): tool-boundary
//! phases of a session, and KV hints with their outcomes.

use std::ffi::c_char;

use super::capi::{hash_batch, null, on_handle, text, text_or_empty, to_output};
use super::convert::{self, HintFields};
use super::{ERR_INVALID, FfiError, Handle};

/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_session(
    client: *mut Handle,
    id: *const c_char,
    parent: *const c_char,
    phase: u32,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        on_handle(client, |h| {
            let id = text(id, "session id")?;
            let parent = text_or_empty(parent, "parent session id")?;
            let phase = convert::phase(phase)?;
            Ok(h.client().session(id, (!parent.is_empty()).then_some(parent), phase)?)
        })
    }
}

/// A request of session `id` ended: its prompt's `count` page hashes and token counts
/// (no content), for the daemon's session lineage and request traces.
///
/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvtier_request_end(
    client: *mut Handle,
    id: *const c_char,
    parent: *const c_char,
    input_length: u64,
    output_length: u64,
    hashes: *const u8,
    hash_len: usize,
    count: usize,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        on_handle(client, |h| {
            let id = text(id, "session id")?;
            let parent = text_or_empty(parent, "parent session id")?;
            let hashes = hash_batch(hashes, hash_len, count)?;
            Ok(h.client().request_end(
                id,
                (!parent.is_empty()).then_some(parent),
                input_length,
                output_length,
                &hashes,
            )?)
        })
    }
}

/// The hint struct of `include/kvtier.h`.
#[repr(C)]
pub struct HintC {
    pub struct_size: usize,
    pub kind: u32,
    pub target: u32,
    pub hashes: *const u8,
    pub hash_len: usize,
    pub count: usize,
    pub session: *const c_char,
    pub tier: u32,
    pub priority: i32,
    pub ttl_ms: u64,
    pub deadline_ms: u64,
}

/// The hint outcome struct of `include/kvtier.h`.
#[repr(C)]
pub struct HintOutcomeC {
    pub outcome: u32,
    pub reason: u32,
    pub applied: u64,
    pub requested: u64,
}

/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_hint(client: *mut Handle, hint: *const HintC, out_outcome: *mut HintOutcomeC) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        to_output(client, out_outcome, |h| {
            let hc = hint.as_ref().ok_or_else(|| null("the hint"))?;
            if hc.struct_size != std::mem::size_of::<HintC>() {
                return Err(FfiError::new(
                    ERR_INVALID,
                    format!(
                        "a hint of {} bytes; this library expects {}",
                        hc.struct_size,
                        std::mem::size_of::<HintC>()
                    ),
                ));
            }
            let fields = HintFields {
                kind: hc.kind,
                target: hc.target,
                tier: hc.tier,
                ttl_ms: hc.ttl_ms,
                priority: hc.priority,
                deadline_ms: hc.deadline_ms,
            };
            let (hashes, session) = if hc.target == 2 {
                (Vec::new(), text(hc.session, "the hint's session")?)
            } else {
                (hash_batch(hc.hashes, hc.hash_len, hc.count)?, "")
            };
            let outcome = h.client().hint(fields.hint(hashes, session)?)?;
            let (outcome, applied, requested, reason) = convert::outcome(&outcome);
            Ok(HintOutcomeC {
                outcome,
                reason,
                applied,
                requested,
            })
        })
    }
}
