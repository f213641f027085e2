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

pub use crate::watermarks::{PolicyError, Watermarks};

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
