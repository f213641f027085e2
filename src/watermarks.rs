//! Per-tier watermarks with hysteresis: the capacity thresholds that eviction (the
//! manager, `kvtier replay`) and the session pressure controller all read. A leaf below
//! `policy` and `session`, so that both can use it without importing each other.

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
