//! Hints in the envelope Dynamo's router already sends with a request
//! (`kv_transfer_params.router_hint`): `{protocol_version, message_id, actions: [{action_id,
//! action_type, action_version, payload}]}`.
//!
//! Its one action today, `kv.fetch` (payload: `source_control_endpoint` and
//! `block_hashes`, the 64-bit event hashes), becomes a Prefetch to host of those pages.
//! An unknown action is answered `ignored: unknown_action` with its `action_id`, never an
//! error. Only a malformed envelope is an error.

use serde::Serialize;
use serde_json::Value;

use crate::hints::{Hint, HintTarget, Reason};
use crate::page::PageHash;
use crate::tier::TierKind;

pub const PROTOCOL_VERSION: &str = "0.1";
pub const KV_FETCH: &str = "kv.fetch";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouterHintError {
    #[error("invalid router hint: {0}")]
    Invalid(&'static str),
    #[error("router hint has {got} actions, more than {max}")]
    TooManyActions { got: usize, max: usize },
}

/// What an envelope asks of kvtier.
#[derive(Debug, PartialEq, Eq, Serialize)]
pub struct RouterPlan {
    pub message_id: String,
    /// Actions kvtier executes, as hints, with their action ids.
    pub hints: Vec<(String, Hint)>,
    /// Actions kvtier does not execute, with their action ids and why.
    pub ignored: Vec<(String, Reason)>,
}

/// Parses an envelope. At most `max_actions` actions and `max_pages` hashes per action.
pub fn parse(v: &Value, max_actions: usize, max_pages: usize) -> Result<RouterPlan, RouterHintError> {
    let obj = v
        .as_object()
        .ok_or(RouterHintError::Invalid("envelope is not an object"))?;
    obj.get("protocol_version")
        .and_then(Value::as_str)
        .ok_or(RouterHintError::Invalid("protocol_version missing"))?;
    let message_id = obj
        .get("message_id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let actions = obj
        .get("actions")
        .and_then(Value::as_array)
        .ok_or(RouterHintError::Invalid("actions is not a list"))?;
    if actions.len() > max_actions {
        return Err(RouterHintError::TooManyActions {
            got: actions.len(),
            max: max_actions,
        });
    }
    let mut plan = RouterPlan {
        message_id,
        hints: Vec::new(),
        ignored: Vec::new(),
    };
    for a in actions {
        let a = a
            .as_object()
            .ok_or(RouterHintError::Invalid("action is not an object"))?;
        let id = a
            .get("action_id")
            .and_then(Value::as_str)
            .ok_or(RouterHintError::Invalid("action_id missing"))?
            .to_owned();
        let kind = a
            .get("action_type")
            .and_then(Value::as_str)
            .ok_or(RouterHintError::Invalid("action_type missing"))?;
        if kind != KV_FETCH {
            plan.ignored.push((id, Reason::UnknownAction));
            continue;
        }
        let payload = a
            .get("payload")
            .and_then(Value::as_object)
            .ok_or(RouterHintError::Invalid("kv.fetch payload is not an object"))?;
        let hashes = payload
            .get("block_hashes")
            .and_then(Value::as_array)
            .ok_or(RouterHintError::Invalid("block_hashes is not a list"))?;
        if hashes.is_empty() || hashes.len() > max_pages {
            return Err(RouterHintError::Invalid("block_hashes is empty or too long"));
        }
        let pages = hashes
            .iter()
            .map(|h| {
                // Event hashes travel as signed or unsigned 64-bit integers.
                h.as_u64()
                    .or_else(|| h.as_i64().map(|i| i as u64))
                    .map(PageHash::from_u64)
                    .ok_or(RouterHintError::Invalid("a block hash is not a 64-bit integer"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        plan.hints.push((
            id,
            Hint::Prefetch {
                target: HintTarget::Pages(pages),
                to: TierKind::Host,
                deadline_ms: None,
            },
        ));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn kv_fetch_becomes_prefetch_and_unknown_actions_are_ignored() {
        let v = json!({"protocol_version": "0.1", "message_id": "m1", "actions": [
            {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
             "payload": {"source_control_endpoint": "tcp://peer:1", "block_hashes": [1, -1]}},
            {"action_id": "a2", "action_type": "kv.future", "action_version": "1.0", "payload": {}}
        ]});
        let plan = parse(&v, 8, 64).unwrap();
        assert_eq!(plan.message_id, "m1");
        assert_eq!(plan.ignored, vec![("a2".to_string(), Reason::UnknownAction)]);
        let (id, hint) = &plan.hints[0];
        assert_eq!(id, "a1");
        assert_eq!(
            *hint,
            Hint::Prefetch {
                target: HintTarget::Pages(vec![PageHash::from_u64(1), PageHash::from_u64(u64::MAX)]),
                to: TierKind::Host,
                deadline_ms: None
            }
        );
    }

    #[test]
    fn malformed_envelopes_are_errors() {
        for bad in [
            json!(null),
            json!({"actions": []}),
            json!({"protocol_version": "0.1", "actions": "x"}),
            json!({"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch"}]}),
            json!({"protocol_version": "0.1", "actions": [{"action_id": "a", "action_type": "kv.fetch", "payload": "x"}]}),
            json!({"protocol_version": "0.1", "actions": [{"action_id": "a", "action_type": "kv.fetch",
                   "payload": {"block_hashes": [true]}}]}),
            json!({"protocol_version": "0.1", "actions": [{"action_id": "a", "action_type": "kv.fetch",
                   "payload": {"block_hashes": []}}]}),
        ] {
            assert!(parse(&bad, 8, 64).is_err(), "{bad}");
        }
        let many = json!({"protocol_version": "0.1", "actions": vec![json!({}); 9]});
        assert_eq!(
            parse(&many, 8, 64),
            Err(RouterHintError::TooManyActions { got: 9, max: 8 })
        );
    }
}
