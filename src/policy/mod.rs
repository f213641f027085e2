//! Capacity policy shared by the manager and `kvtier replay`: watermarks with hysteresis,
//! write policies between tiers, the eviction order, and [`session`], the session-aware
//! tiering policy both of them drive.
//!
//! Eviction order within a tier: pinned and in-flight pages are never candidates (the
//! directory filters them); then pages of paused or acting sessions go first, then low
//! retain priority, then least recently used.

pub mod session;

pub use session::{
    Advice, Decisions, Move, Phase, PolicyStats, RequestEnd, SessionPolicy, SessionPolicyConfig, SessionPolicyError,
    SessionView, Signals, Usage,
};

use serde::{Deserialize, Serialize};

use crate::directory::{PageId, PageInfo};

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

/// Picks up to `n` victims from `candidates`, in eviction order. `idle_session` says
/// whether a session index belongs to a paused or acting session (evicted first).
pub fn select_victims(
    mut candidates: Vec<(PageId, PageInfo)>,
    n: usize,
    idle_session: impl Fn(u32) -> bool,
) -> Vec<PageId> {
    if n == 0 || candidates.is_empty() {
        return Vec::new();
    }
    let key = |info: &PageInfo| {
        let busy = !(info.session != 0 && idle_session(info.session));
        (busy, info.retain, info.last_access)
    };
    if n < candidates.len() {
        candidates.select_nth_unstable_by_key(n, |(_, i)| key(i));
        candidates.truncate(n);
    }
    candidates.sort_unstable_by_key(|(_, i)| key(i));
    candidates.into_iter().map(|(id, _)| id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::{NamespaceId, PageHash};

    fn info(session: u32, retain: i8, last_access: u64) -> PageInfo {
        PageInfo {
            hash: PageHash::from_u64(last_access),
            ns: NamespaceId(0),
            retain,
            hits: 0,
            session,
            last_access,
        }
    }

    #[test]
    fn idle_sessions_then_low_retain_then_lru() {
        let c = vec![
            (PageId(0), info(0, 0, 1)),
            (PageId(1), info(7, 0, 50)), // idle session
            (PageId(2), info(0, -1, 90)),
            (PageId(3), info(0, 5, 0)),
            (PageId(4), info(3, 0, 2)), // busy session
        ];
        let v = select_victims(c.clone(), 5, |s| s == 7);
        assert_eq!(v, vec![PageId(1), PageId(2), PageId(0), PageId(4), PageId(3)]);
        assert_eq!(select_victims(c, 2, |s| s == 7), vec![PageId(1), PageId(2)]);
    }

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
