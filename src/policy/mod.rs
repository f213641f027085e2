//! Capacity policy shared by the manager and `kvtier replay`: watermarks with hysteresis,
//! write policies between tiers, the eviction order, and [`session`], the session-aware
//! tiering policy both of them drive.
//!
//! Eviction order within a tier is the directory's (`Directory::victims`, kept as
//! per-class lists for host and pool): pinned, in-flight and protected pages are never
//! candidates; then the idle class (pages of sessions the policy put there: idle ones not
//! expected back soon or with a pool below, and ended ones), then low retain priority,
//! then least recently used. The daemon and `kvtier replay` both evict in that order.

pub mod session;

pub use session::{
    Advice, ClassChange, Decisions, Move, Phase, PolicyStats, RequestEnd, SessionClass, SessionPolicy,
    SessionPolicyConfig, SessionPolicyError, SessionView, Signals, Usage,
};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PolicyError {
    #[error(
        "watermarks must satisfy 0 < target <= resume <= high <= 1, got target={target} resume={resume} high={high}"
    )]
    Watermarks { target: f64, resume: f64, high: f64 },
}

/// Per-tier watermarks, as fractions of capacity.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Watermarks {
    /// Act (evict, pause) at or above this utilisation. Default: 0.95.
    pub high: f64,
    /// Reclaim down to this utilisation. Default: 0.80.
    pub target: f64,
    /// Let paused sessions back only at or below this utilisation. Default: 0.85.
    pub resume: f64,
}

impl Default for Watermarks {
    fn default() -> Self {
        Self {
            high: 0.95,
            target: 0.80,
            resume: 0.85,
        }
    }
}

impl Watermarks {
    pub fn validate(&self) -> Result<(), PolicyError> {
        let ok = self.target > 0.0 && self.target <= self.resume && self.resume <= self.high && self.high <= 1.0;
        if ok {
            Ok(())
        } else {
            Err(PolicyError::Watermarks {
                target: self.target,
                resume: self.resume,
                high: self.high,
            })
        }
    }

    /// Units to free so that `used` of `capacity` gets down to the target, or 0 when
    /// utilisation is below the high watermark (hysteresis: nothing happens in between).
    pub fn reclaim(&self, used: usize, capacity: usize) -> usize {
        if capacity == 0 || (used as f64) < self.high * capacity as f64 {
            return 0;
        }
        used.saturating_sub((self.target * capacity as f64).floor() as usize)
    }

    /// Whether a paused session may come back at this utilisation.
    pub fn may_resume(&self, used: usize, capacity: usize) -> bool {
        capacity > 0 && (used as f64) <= self.resume * capacity as f64
    }

    /// Whether utilisation is in the early band (target..high) where priority is lowered.
    pub fn in_early_band(&self, used: usize, capacity: usize) -> bool {
        let u = used as f64 / capacity.max(1) as f64;
        u > self.target && u < self.high
    }
}

/// When a page written to a warmer tier is also written to the next colder one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "kebab-case")]
pub enum WritePolicy {
    /// Every store is copied on right away.
    #[default]
    WriteThrough,
    /// Copied on once the page has been hit `hits` times.
    WriteThroughSelective { hits: u8 },
    /// Copied on only when the page is evicted.
    WriteBack,
}

impl WritePolicy {
    /// Whether a page with `hits` hits should be copied on now (not at eviction).
    pub fn copy_now(&self, hits: u8) -> bool {
        match *self {
            WritePolicy::WriteThrough => true,
            WritePolicy::WriteThroughSelective { hits: n } => hits >= n,
            WritePolicy::WriteBack => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermarks_have_hysteresis() {
        let w = Watermarks::default();
        assert_eq!(w.reclaim(94, 100), 0);
        assert_eq!(w.reclaim(95, 100), 15);
        assert!(w.may_resume(85, 100) && !w.may_resume(86, 100));
        assert!(w.in_early_band(90, 100) && !w.in_early_band(80, 100));
        assert!(
            Watermarks {
                high: 0.7,
                ..Watermarks::default()
            }
            .validate()
            .is_err()
        );
        assert!(WritePolicy::WriteThroughSelective { hits: 2 }.copy_now(2));
        assert!(!WritePolicy::WriteBack.copy_now(200));
    }
}
