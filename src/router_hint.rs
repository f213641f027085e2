//! Dynamo's KvHint envelope: what a router attaches to a request (Dynamo 1.6 hands it to
//! vLLM as `Request.kv_hints` and to SGLang as `kv_hints`), passed on by the engine
//! (client API, C ABI, cxx), or sent by an operator (admin `POST /v1/kv-hints`,
//! `kvtier hint --envelope FILE`):
//! `{protocol_version, message_id, actions: [{action_id, action_type, action_version, payload}]}`.
//!
//! Its one action today, `kv.fetch` at major version 1 (payload: `source_control_endpoint`
//! and `block_hashes`), becomes a Prefetch to host of those pages. A block hash is an
//! integer (a u64 event hash, signed or unsigned, so an 8-byte page hash) or a hex
//! string of 8 to 32 bytes (a full chain hash, e.g. SHA-256). An unknown action, an
//! action major version other than 1 or a protocol major version other than 0 is
//! answered `ignored` with its reason and `action_id`, never an error. Only a malformed
//! envelope is an error ([`RouterHintError`]).
//!
//! Every delivery yields an [`EnvelopeReport`] (each action's outcome, with the
//! `source_control_endpoint` it named), which the daemon keeps in a [`KvHintLog`] that
//! the admin socket shows (`GET /v1/kv-hints`) as a stream of numbered records.

use std::collections::VecDeque;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::hints::{Hint, HintOutcome, HintTarget, Reason};
use crate::page::PageHash;
use crate::tier::TierKind;

pub const PROTOCOL_VERSION: &str = "0.1";
pub const KV_FETCH: &str = "kv.fetch";
/// The `kv.fetch` major version kvtier implements.
pub const KV_FETCH_MAJOR: u64 = 1;
/// Most actions in one envelope.
pub const MAX_ACTIONS: usize = 64;
/// Longest id or endpoint string kept.
const MAX_ID: usize = 512;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouterHintError {
    #[error("invalid KvHint envelope: {0}")]
    Invalid(&'static str),
    #[error("invalid KvHint envelope: not JSON: {0}")]
    Json(String),
    #[error("KvHint envelope has {got} actions, more than {max}")]
    TooManyActions { got: usize, max: usize },
    #[error("KvHint action {action_id:?} names {got} block hashes, more than {max}")]
    TooManyHashes { action_id: String, got: usize, max: usize },
}

/// One action of an envelope, as parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedAction {
    pub action_id: String,
    pub action_type: String,
    pub action_version: String,
    pub source_control_endpoint: Option<String>,
    /// The hint to run, or why the action is ignored.
    pub step: Result<Hint, Reason>,
}

/// What an envelope asks of kvtier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterPlan {
    pub protocol_version: String,
    pub message_id: String,
    pub actions: Vec<PlannedAction>,
}

/// What came of one action: an outcome, or the error its hint met.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionReport {
    pub action_id: String,
    pub action_type: String,
    pub action_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_control_endpoint: Option<String>,
    /// Pages the action named.
    pub pages: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<HintOutcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What came of one envelope.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvelopeReport {
    pub protocol_version: String,
    pub message_id: String,
    pub actions: Vec<ActionReport>,
}

fn short(s: &str) -> String {
    s.chars().take(MAX_ID).collect()
}

/// The major version of `"1.0"`-style versions; `None` when it does not parse.
fn major(v: &str) -> Option<u64> {
    v.split('.').next()?.trim().parse().ok()
}

fn hash_of(h: &Value) -> Option<PageHash> {
    if let Some(u) = h.as_u64() {
        return Some(PageHash::from_u64(u));
    }
    if let Some(i) = h.as_i64() {
        // Event hashes may travel as signed 64-bit integers.
        return Some(PageHash::from_u64(i as u64));
    }
    let s = h.as_str()?;
    PageHash::from_hex(s.strip_prefix("0x").unwrap_or(s)).ok()
}

/// Parses envelope text.
pub fn parse_str(text: &str, max_pages: usize) -> Result<RouterPlan, RouterHintError> {
    let v: Value = serde_json::from_str(text).map_err(|e| RouterHintError::Json(e.to_string()))?;
    parse(&v, max_pages)
}

/// Parses an envelope. At most [`MAX_ACTIONS`] actions and `max_pages` hashes per action.
pub fn parse(v: &Value, max_pages: usize) -> Result<RouterPlan, RouterHintError> {
    let obj = v
        .as_object()
        .ok_or(RouterHintError::Invalid("envelope is not an object"))?;
    let protocol_version = obj
        .get("protocol_version")
        .and_then(Value::as_str)
        .ok_or(RouterHintError::Invalid("protocol_version missing"))?;
    let message_id = obj.get("message_id").and_then(Value::as_str).unwrap_or_default();
    let actions = obj
        .get("actions")
        .and_then(Value::as_array)
        .ok_or(RouterHintError::Invalid("actions is not a list"))?;
    if actions.len() > MAX_ACTIONS {
        return Err(RouterHintError::TooManyActions {
            got: actions.len(),
            max: MAX_ACTIONS,
        });
    }
    let known_protocol = major(protocol_version) == Some(0);
    let mut plan = RouterPlan {
        protocol_version: short(protocol_version),
        message_id: short(message_id),
        actions: Vec::with_capacity(actions.len()),
    };
    for a in actions {
        let a = a
            .as_object()
            .ok_or(RouterHintError::Invalid("action is not an object"))?;
        let text = |k: &str, missing: &'static str| {
            a.get(k)
                .and_then(Value::as_str)
                .map(short)
                .ok_or(RouterHintError::Invalid(missing))
        };
        let action_id = text("action_id", "action_id missing")?;
        let action_type = text("action_type", "action_type missing")?;
        let action_version = text("action_version", "action_version missing")?;
        // Recorded for every action that names one, executed or not, so an operator sees
        // where a router wanted pages from.
        let source_control_endpoint = a
            .get("payload")
            .and_then(|p| p.get("source_control_endpoint"))
            .and_then(Value::as_str)
            .map(short);
        let mut planned = PlannedAction {
            action_id,
            action_type,
            action_version,
            source_control_endpoint,
            step: Err(Reason::UnknownAction),
        };
        if planned.action_type != KV_FETCH {
            plan.actions.push(planned);
            continue;
        }
        if !known_protocol || major(&planned.action_version) != Some(KV_FETCH_MAJOR) {
            planned.step = Err(Reason::UnsupportedVersion);
            plan.actions.push(planned);
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
        if hashes.len() > max_pages {
            return Err(RouterHintError::TooManyHashes {
                action_id: planned.action_id,
                got: hashes.len(),
                max: max_pages,
            });
        }
        if hashes.is_empty() {
            return Err(RouterHintError::Invalid("block_hashes is empty"));
        }
        let pages = hashes
            .iter()
            .map(|h| {
                hash_of(h).ok_or(RouterHintError::Invalid(
                    "a block hash is neither a 64-bit integer nor hex of 8 to 32 bytes",
                ))
            })
            .collect::<Result<Vec<_>, _>>()?;
        planned.step = Ok(Hint::Prefetch {
            target: HintTarget::Pages(pages),
            to: TierKind::Host,
            deadline_ms: None,
        });
        plan.actions.push(planned);
    }
    Ok(plan)
}

/// Runs a plan's hints through `run` and reports every action's outcome, in order.
pub fn apply<E: std::fmt::Display>(
    plan: RouterPlan,
    mut run: impl FnMut(&Hint) -> Result<HintOutcome, E>,
) -> EnvelopeReport {
    let actions = plan
        .actions
        .into_iter()
        .map(|a| {
            let pages = match &a.step {
                Ok(h) => match h.target() {
                    HintTarget::Pages(p) | HintTarget::Prefix(p) => p.len(),
                    HintTarget::Session(_) => 0,
                },
                Err(_) => 0,
            };
            let (outcome, error) = match &a.step {
                Ok(h) => match run(h) {
                    Ok(o) => (Some(o), None),
                    Err(e) => (None, Some(e.to_string())),
                },
                Err(reason) => (Some(HintOutcome::Ignored { reason: *reason }), None),
            };
            ActionReport {
                action_id: a.action_id,
                action_type: a.action_type,
                action_version: a.action_version,
                source_control_endpoint: a.source_control_endpoint,
                pages,
                outcome,
                error,
            }
        })
        .collect();
    EnvelopeReport {
        protocol_version: plan.protocol_version,
        message_id: plan.message_id,
        actions,
    }
}

/// One delivered envelope, as the log keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHintRecord {
    /// Numbered from 1 in delivery order.
    pub seq: u64,
    /// Who delivered it: `client` (an engine) or `admin`.
    pub via: String,
    /// The namespace the hashes were resolved in.
    pub ns: u16,
    #[serde(flatten)]
    pub report: EnvelopeReport,
}

/// Records kept by a [`KvHintLog`].
pub const KV_HINT_LOG: usize = 1024;

/// The most recent delivered envelopes, bounded ([`KV_HINT_LOG`]), oldest out first.
#[derive(Debug, Default)]
pub struct KvHintLog {
    inner: Mutex<(u64, VecDeque<KvHintRecord>)>,
}

impl KvHintLog {
    /// Appends a report; returns its sequence number.
    pub fn push(&self, via: &str, ns: u16, report: EnvelopeReport) -> u64 {
        let mut g = self.inner.lock();
        g.0 += 1;
        let seq = g.0;
        if g.1.len() >= KV_HINT_LOG {
            g.1.pop_front();
        }
        g.1.push_back(KvHintRecord {
            seq,
            via: via.into(),
            ns,
            report,
        });
        seq
    }

    /// Records with a sequence above `after`, at most `limit`, oldest first.
    pub fn since(&self, after: u64, limit: usize) -> Vec<KvHintRecord> {
        let g = self.inner.lock();
        g.1.iter().filter(|r| r.seq > after).take(limit).cloned().collect()
    }
}

#[cfg(test)]
mod tests;
