//! Plain values at the boundary → the client's typed values, shared by the C ABI and the
//! cxx bridge so both validate the same way and number enums the same way.

use std::time::Duration;

use super::{ERR_INVALID, FfiError, reason_code};
use crate::client::ClientConfig;
use crate::hints::{Hint, HintOutcome, HintTarget};
use crate::layout::{AttentionKind, ByteOrder, Dtype, KvOrder, LayoutSpec};
use crate::page::{Namespace, PageHash};
use crate::protocol::{Identity, LoadWait, SessionPhase};
use crate::tier::TierKind;

/// Longest call timeout accepted at the boundary: 10 minutes.
const MAX_TIMEOUT_MS: u64 = 600_000;

fn invalid(msg: impl Into<String>) -> FfiError {
    FfiError::new(ERR_INVALID, msg)
}

/// The plain fields of a connect call.
pub(crate) struct ConnectFields<'a> {
    pub socket: &'a str,
    pub instance: &'a str,
    pub model: &'a str,
    pub lora: &'a str,
    pub salt: &'a str,
    pub ranks: [u16; 5],
    pub geometry: [u32; 5],
    pub parallel: [u16; 2],
    pub attention: u32,
    pub byte_order: u32,
    pub timeout_ms: u64,
    /// `KVTIER_DTYPE_*` (0: unspecified, the byte width alone).
    pub dtype: u32,
    /// `KVTIER_KV_ORDER_*` (0: NHD).
    pub kv_order: u32,
    /// The uid the daemon must run as; `None`: this process's.
    pub daemon_uid: Option<u32>,
}

impl ConnectFields<'_> {
    /// Validates the plain fields into a client configuration.
    pub(crate) fn config(&self) -> Result<ClientConfig, FfiError> {
        if self.socket.is_empty() {
            return Err(invalid("the socket path is empty"));
        }
        let attention = match self.attention {
            0 => AttentionKind::Mha,
            1 => AttentionKind::Mla,
            a => return Err(invalid(format!("attention {a} is neither 0 (MHA) nor 1 (MLA)"))),
        };
        let byte_order = match self.byte_order {
            0 => ByteOrder::LayerFirst,
            1 => ByteOrder::PageFirst,
            b => {
                return Err(invalid(format!(
                    "byte order {b} is neither 0 (layer-first) nor 1 (page-first)"
                )));
            }
        };
        let dtype = Dtype::from_code(self.dtype).ok_or_else(|| {
            invalid(format!(
                "dtype {} is not one of 0 to {} (KVTIER_DTYPE_*)",
                self.dtype,
                Dtype::ALL.len() - 1
            ))
        })?;
        let kv_order = KvOrder::from_code(self.kv_order).ok_or_else(|| {
            invalid(format!(
                "kv order {} is not one of 0 to {} (KVTIER_KV_ORDER_*)",
                self.kv_order,
                KvOrder::ALL.len() - 1
            ))
        })?;
        let [layers, kv_heads, head_dim, dtype_bytes, page_tokens] = self.geometry;
        let layout = LayoutSpec {
            attention,
            byte_order,
            dtype,
            kv_order,
            ..LayoutSpec::mha(layers, kv_heads, head_dim, dtype_bytes, page_tokens)
        }
        .with_parallel(self.parallel[0], self.parallel[1]);
        let [tp_rank, tp_size, pp_rank, pp_size, dp_rank] = self.ranks;
        let identity = Identity {
            instance: self.instance.into(),
            namespace: Namespace {
                model: self.model.into(),
                lora: self.lora.into(),
                salt: self.salt.into(),
            },
            tp_rank,
            tp_size,
            pp_rank,
            pp_size,
            dp_rank,
        };
        let mut cfg = ClientConfig::new(self.socket, identity, layout);
        if self.timeout_ms > MAX_TIMEOUT_MS {
            return Err(invalid(format!(
                "a timeout of {} ms is over the maximum {MAX_TIMEOUT_MS}",
                self.timeout_ms
            )));
        }
        if self.timeout_ms > 0 {
            cfg = cfg.with_timeout(Duration::from_millis(self.timeout_ms));
        }
        if let Some(uid) = self.daemon_uid {
            cfg = cfg.with_daemon_uid(uid);
        }
        Ok(cfg)
    }
}

pub(crate) fn load_wait(mode: u32, timeout_ms: u32) -> Result<LoadWait, FfiError> {
    match mode {
        0 => Ok(LoadWait::BestEffort),
        1 => Ok(LoadWait::WaitComplete),
        2 => Ok(LoadWait::Timeout(timeout_ms)),
        m => Err(invalid(format!("load wait {m} is not 0, 1 or 2"))),
    }
}

pub(crate) fn phase(p: u32) -> Result<SessionPhase, FfiError> {
    match p {
        0 => Ok(SessionPhase::Reasoning),
        1 => Ok(SessionPhase::Acting),
        2 => Ok(SessionPhase::Paused),
        3 => Ok(SessionPhase::Ended),
        p => Err(invalid(format!("session phase {p} is not 0 to 3"))),
    }
}

fn tier(t: u32) -> Result<TierKind, FfiError> {
    TierKind::from_index(t as usize).ok_or_else(|| invalid(format!("tier {t} is not 0 (device), 1 (host) or 2 (pool)")))
}

/// A hint in plain numbers (see `kvtier_hint_t` in `include/kvtier.h`).
pub(crate) struct HintFields {
    pub kind: u32,
    pub target: u32,
    pub tier: u32,
    pub ttl_ms: u64,
    pub priority: i32,
    pub deadline_ms: u64,
}

impl HintFields {
    /// `hashes` for a page or prefix target, `session` for a session target.
    pub(crate) fn hint(&self, hashes: Vec<PageHash>, session: &str) -> Result<Hint, FfiError> {
        let target = match self.target {
            0 => HintTarget::Pages(hashes),
            1 => HintTarget::Prefix(hashes),
            2 if !session.is_empty() => HintTarget::Session(session.into()),
            2 => return Err(invalid("a session target needs a session id")),
            t => {
                return Err(invalid(format!(
                    "hint target {t} is not 0 (pages), 1 (prefix) or 2 (session)"
                )));
            }
        };
        let priority = i8::try_from(self.priority)
            .map_err(|_| invalid(format!("retain priority {} is outside -128..=127", self.priority)))?;
        Ok(match self.kind {
            1 => Hint::Share { target },
            2 => Hint::Prefetch {
                target,
                to: tier(self.tier)?,
                deadline_ms: (self.deadline_ms > 0).then_some(self.deadline_ms),
            },
            3 => Hint::Demote {
                target,
                to: tier(self.tier)?,
            },
            4 => Hint::Pin {
                target,
                tier: tier(self.tier)?,
                ttl_ms: self.ttl_ms,
            },
            5 => Hint::Retain {
                target,
                priority,
                ttl_ms: self.ttl_ms,
            },
            k => return Err(invalid(format!("hint kind {k} is not 1 to 5"))),
        })
    }
}

/// An outcome as `[outcome, applied, requested, reason]`: outcome 0 accepted, 1 clipped,
/// 2 deferred, 3 ignored; reason 0 when there is none.
pub(crate) fn outcome(o: &HintOutcome) -> (u32, u64, u64, u32) {
    match *o {
        HintOutcome::Accepted { pages } => (0, pages as u64, pages as u64, 0),
        HintOutcome::Clipped {
            applied,
            requested,
            reason,
        } => (1, applied as u64, requested as u64, reason_code(reason)),
        HintOutcome::Deferred { pages, reason } => (2, pages as u64, pages as u64, reason_code(reason)),
        HintOutcome::Ignored { reason } => (3, 0, 0, reason_code(reason)),
    }
}
