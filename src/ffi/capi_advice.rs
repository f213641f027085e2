//! The advice stream through the C ABI (`kvtier_take_advice`) and the cxx bridge: what
//! the daemon advises this rank's engine to do, as JSON, so one shape serves C, C++ and
//! the Python package. Page advice (evict first, offload, ready to load) names page
//! hashes in hex; session advice (the pressure controller's pause and resume) names a
//! session. Kinds are the `KVTIER_ADVICE_*` codes of `include/kvtier.h`.

use std::ffi::c_char;

use serde::Serialize;

use super::capi::{copy_c_text, null, on_handle, out};
use super::{ERR_BUFFER_TOO_SMALL, FfiError, Handle};
use crate::protocol::{AdviceBatch, AdviceKind};

#[derive(Serialize)]
struct Entry<'a> {
    kind: u32,
    name: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    session_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    hashes: Vec<String>,
}

#[derive(Serialize)]
struct Batch<'a> {
    more: bool,
    advice: Vec<Entry<'a>>,
}

fn name(kind: AdviceKind) -> &'static str {
    match kind {
        AdviceKind::EvictFirst => "evict_first",
        AdviceKind::Offload => "offload",
        AdviceKind::ReadyToLoad => "ready_to_load",
        AdviceKind::Pause => "pause",
        AdviceKind::Resume => "resume",
    }
}

/// `{"more": bool, "advice": [{"kind": 3, "name": "pause", "session_id": "…"},
/// {"kind": 2, "name": "ready_to_load", "hashes": ["00ab…", …]}, …]}`, oldest first.
pub(crate) fn advice_json(b: &AdviceBatch) -> String {
    let batch = Batch {
        more: b.more,
        advice: b
            .advice
            .iter()
            .map(|a| Entry {
                kind: a.kind as u32,
                name: name(a.kind),
                session_id: a.session_id.as_deref(),
                hashes: a.hashes.iter().map(|h| h.to_hex()).collect(),
            })
            .collect(),
    };
    // Strings and numbers only: serializing cannot fail.
    serde_json::to_string(&batch).unwrap_or_else(|_| String::from(r#"{"more":false,"advice":[]}"#))
}

/// Takes the advice waiting for this rank's namespace, at most `max_pages` page hashes,
/// and writes it as NUL-terminated JSON into `buf` (`cap` bytes); `*len` is its length
/// without the NUL. When it does not fit, the advice is kept for the next call and
/// `KVTIER_ERR_BUFFER_TOO_SMALL` says how much it needs in `*len`.
///
/// # Safety
/// Pointers null or valid as documented in `include/kvtier.h`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvtier_take_advice(
    client: *mut Handle,
    max_pages: u32,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> i32 {
    // SAFETY: caller contract for every pointer.
    unsafe {
        on_handle(client, |h| {
            let len = out(len, "the advice length")?;
            if buf.is_null() {
                return Err(null("the advice buffer"));
            }
            let json = h.take_advice_json(max_pages as usize)?;
            *len = json.len();
            // SAFETY: buf is non-null (checked above) and valid for cap bytes (caller contract).
            if let Err(need) = copy_c_text(&json, buf, cap) {
                h.keep_advice(json);
                return Err(FfiError::new(
                    ERR_BUFFER_TOO_SMALL,
                    format!(
                        "the advice needs {need} bytes with its NUL; the buffer has {cap} (kept for the next call)"
                    ),
                ));
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::PageHash;
    use crate::protocol::EngineAdvice;

    #[test]
    fn session_and_page_advice_render_in_order() {
        let b = AdviceBatch {
            advice: vec![
                EngineAdvice::session(AdviceKind::Pause, "s\"1"),
                EngineAdvice::pages(AdviceKind::ReadyToLoad, vec![PageHash::from_u64(1)]),
            ],
            more: true,
        };
        assert_eq!(
            advice_json(&b),
            format!(
                r#"{{"more":true,"advice":[{{"kind":3,"name":"pause","session_id":"s\"1"}},{{"kind":2,"name":"ready_to_load","hashes":["{}"]}}]}}"#,
                PageHash::from_u64(1).to_hex()
            )
        );
    }
}
