//! KV hints: what a router or engine asks kvtier to do, and what came of it.
//!
//! Hints are soft. Every well-formed hint gets a [`HintOutcome`]: accepted, clipped (partly
//! applied, with how much), deferred (will apply later, with why) or ignored (with why).
//! Only a malformed hint is an error ([`HintError`]). Workloads that send no hints keep
//! plain behaviour.

use serde::{Deserialize, Serialize};

use crate::page::PageHash;
use crate::tier::TierKind;

/// What a hint applies to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HintTarget {
    /// These pages, each on its own.
    Pages(Vec<PageHash>),
    /// The leading pages of this hash chain, up to the first page kvtier does not hold.
    Prefix(Vec<PageHash>),
    /// Every page the session has touched.
    Session(String),
}

/// A KV hint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Hint {
    /// Make page-complete copies in the pool and advertise them.
    Share { target: HintTarget },
    /// Move toward a warmer tier (host, or device through host) ahead of need.
    Prefetch {
        target: HintTarget,
        to: TierKind,
        #[serde(default)]
        deadline_ms: Option<u64>,
    },
    /// Make sure a colder complete copy exists, then make the warmer copy an eviction
    /// candidate (for device: advice to the engine).
    Demote { target: HintTarget, to: TierKind },
    /// No eviction from `tier` until the TTL ends; bounded by the pin budget and max TTL.
    Pin {
        target: HintTarget,
        tier: TierKind,
        ttl_ms: u64,
    },
    /// Retention preference: an eviction-order weight, never a guarantee.
    Retain {
        target: HintTarget,
        priority: i8,
        ttl_ms: u64,
    },
}

impl Hint {
    pub fn kind(&self) -> HintKind {
        match self {
            Hint::Share { .. } => HintKind::Share,
            Hint::Prefetch { .. } => HintKind::Prefetch,
            Hint::Demote { .. } => HintKind::Demote,
            Hint::Pin { .. } => HintKind::Pin,
            Hint::Retain { .. } => HintKind::Retain,
        }
    }

    pub fn target(&self) -> &HintTarget {
        match self {
            Hint::Share { target }
            | Hint::Prefetch { target, .. }
            | Hint::Demote { target, .. }
            | Hint::Pin { target, .. }
            | Hint::Retain { target, .. } => target,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HintKind {
    Share,
    Prefetch,
    Demote,
    Pin,
    Retain,
}

impl HintKind {
    pub const ALL: [HintKind; 5] = [
        HintKind::Share,
        HintKind::Prefetch,
        HintKind::Demote,
        HintKind::Pin,
        HintKind::Retain,
    ];

    pub fn name(self) -> &'static str {
        match self {
            HintKind::Share => "share",
            HintKind::Prefetch => "prefetch",
            HintKind::Demote => "demote",
            HintKind::Pin => "pin",
            HintKind::Retain => "retain",
        }
    }
}

/// Why a hint was clipped, deferred or ignored. Stable codes for clients and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Some named pages are not known to kvtier.
    UnknownPages,
    /// The pin budget of the tier is used up.
    PinBudget,
    /// The TTL asked for is longer than the configured maximum.
    MaxTtl,
    /// The transfer queue is full; the moves will run when it drains.
    QueueFull,
    /// The pool is unavailable (degraded backend).
    PoolDegraded,
    /// The target tier has no room, even after eviction.
    NoSpace,
    /// The pages are already where the hint wants them.
    AlreadyThere,
    /// No complete copy exists that could be moved.
    NotComplete,
    /// The session has no pages, or is unknown.
    UnknownSession,
    /// The tier named cannot be used for this hint (e.g. demote to device).
    WrongTier,
    /// The pages are in flight; the hint applies once they land.
    InFlight,
    /// The node has no pool configured.
    NoPool,
    /// A router action kvtier does not implement.
    UnknownAction,
    /// A router action (or envelope) at a major version kvtier does not implement.
    UnsupportedVersion,
}

/// What came of a well-formed hint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum HintOutcome {
    Accepted {
        pages: usize,
    },
    Clipped {
        applied: usize,
        requested: usize,
        reason: Reason,
    },
    Deferred {
        pages: usize,
        reason: Reason,
    },
    Ignored {
        reason: Reason,
    },
}

impl HintOutcome {
    pub fn name(&self) -> &'static str {
        match self {
            HintOutcome::Accepted { .. } => "accepted",
            HintOutcome::Clipped { .. } => "clipped",
            HintOutcome::Deferred { .. } => "deferred",
            HintOutcome::Ignored { .. } => "ignored",
        }
    }
}

/// A malformed hint.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HintError {
    #[error("the hint names no pages")]
    Empty,
    #[error("none of the {0} pages the hint names is known")]
    UnknownPages(usize),
    #[error("the hint names {got} pages, more than the maximum batch of {max}")]
    TooMany { got: usize, max: usize },
    #[error("{kind} cannot target the {tier} tier")]
    BadTier { kind: &'static str, tier: TierKind },
    #[error("a TTL of zero")]
    ZeroTtl,
}
