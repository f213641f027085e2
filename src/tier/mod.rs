//! The three tiers a page can live in, and the storage behind each.
//!
//! [`TierKind`] names a tier; code matches on it rather than downcasting. `device` holds
//! the trait for one rank's GPU KV region and its emulated stand-in, `host` the shared
//! memory arena the daemon owns. The pool tier's backends live in `crate::pool`.

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cuda_batch;
pub mod device;
pub mod host;
pub mod mapping;
pub mod private;
pub mod slot_gen;
pub(crate) mod stream;
pub mod tensors;

use serde::{Deserialize, Serialize};

/// Where a page lives. Ordered from nearest (device) to farthest (pool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TierKind {
    /// G1: GPU memory owned by the engine, one region per rank.
    Device,
    /// G2: the pinned host arena the daemon owns (shared memory).
    Host,
    /// G3: the shared pool (node-local shared memory, or Mooncake Store).
    Pool,
}

impl TierKind {
    pub const ALL: [TierKind; 3] = [TierKind::Device, TierKind::Host, TierKind::Pool];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn from_index(i: usize) -> Option<Self> {
        Self::ALL.get(i).copied()
    }

    /// The `medium` string vLLM-style KV events use for this tier.
    pub fn medium(self) -> &'static str {
        match self {
            TierKind::Device => "GPU",
            TierKind::Host => "CPU_PINNED",
            TierKind::Pool => "SHARED",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TierKind::Device => "device",
            TierKind::Host => "host",
            TierKind::Pool => "pool",
        }
    }

    /// The next colder tier, if any.
    pub fn colder(self) -> Option<Self> {
        Self::from_index(self.index() + 1)
    }
}

impl std::str::FromStr for TierKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "device" | "gpu" | "g1" => Ok(TierKind::Device),
            "host" | "cpu" | "cpu_pinned" | "g2" => Ok(TierKind::Host),
            "pool" | "shared" | "g3" => Ok(TierKind::Pool),
            other => Err(format!("unknown tier {other:?} (device, host or pool)")),
        }
    }
}

impl std::fmt::Display for TierKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
