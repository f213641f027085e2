//! The C ABI's entry points for what an engine passes on for routers (see
//! `include/kvtier.h`): a store with each page's token ids, and a Dynamo KvHint envelope.

use std::ffi::c_char;

use super::capi::{
    StoreReceiptC, copy_c_text, hash_batch, null, on_handle, out, slot_batch, text, text_or_empty, to_output,
};
use super::{ERR_BUFFER_TOO_SMALL, ERR_INVALID, ERR_LENGTH_MISMATCH, FfiError, Handle};
use crate::client::MAX_PAGE_TOKENS;
use crate::page::PageHash;

/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_store_tokens(
    client: *mut Handle,
    hashes: *const u8,
    hash_len: usize,
    count: usize,
    slots: *const u32,
    slot_count: usize,
    session: *const c_char,
    parent: *const u8,
    tokens: *const u32,
    tokens_per_page: usize,
    out_receipt: *mut StoreReceiptC,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        to_output(client, out_receipt, |h| {
            let hashes = hash_batch(hashes, hash_len, count)?;
            let slots = slot_batch(slots, slot_count, hashes.len())?;
            let session = text_or_empty(session, "session")?;
            let parent = if parent.is_null() {
                None
            } else {
                // SAFETY: hash_batch checked hash_len; the caller's contract covers the bytes.
                let p = std::slice::from_raw_parts(parent, hash_len);
                Some(PageHash::new(p).map_err(|e| FfiError::new(ERR_INVALID, e.to_string()))?)
            };
            let lists = if tokens.is_null() {
                None
            } else {
                if tokens_per_page == 0 || tokens_per_page > MAX_PAGE_TOKENS {
                    return Err(FfiError::new(
                        ERR_LENGTH_MISMATCH,
                        format!("tokens_per_page is {tokens_per_page}; it must be 1 to {MAX_PAGE_TOKENS}"),
                    ));
                }
                // SAFETY: count <= MAX_PAGES and tokens_per_page <= MAX_PAGE_TOKENS
                // bound the length; the caller's contract covers the ids.
                let all = std::slice::from_raw_parts(tokens, hashes.len() * tokens_per_page);
                Some(all.chunks(tokens_per_page).map(<[u32]>::to_vec).collect::<Vec<_>>())
            };
            let r = h
                .client()
                .store_with_tokens(&hashes, slots, session, parent, lists.as_deref())?;
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
pub unsafe extern "C" fn kvtier_kv_hints(
    client: *mut Handle,
    envelope: *const c_char,
    report: *mut c_char,
    report_cap: usize,
    report_len: *mut usize,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        on_handle(client, |h| {
            let envelope = text(envelope, "the envelope")?;
            let len = out(report_len, "the report length")?;
            let r = h.client().kv_hints(envelope)?;
            let json = serde_json::to_string(&r).map_err(|e| FfiError::new(ERR_INVALID, e.to_string()))?;
            *len = json.len();
            if report.is_null() {
                return if report_cap == 0 {
                    Ok(())
                } else {
                    Err(null("the report buffer"))
                };
            }
            // SAFETY: report is non-null here and valid for report_cap bytes (caller contract).
            copy_c_text(&json, report, report_cap).map_err(|need| {
                FfiError::new(
                    ERR_BUFFER_TOO_SMALL,
                    format!("the report needs {need} bytes with its NUL; the buffer has {report_cap} (the envelope was applied)"),
                )
            })?;
            Ok(())
        })
    }
}
