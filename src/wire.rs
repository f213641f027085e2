//! Values that cross the control socket and that the core also produces or bounds: the
//! answer of a prefix lookup and the bound on session advice per answer. They live here,
//! below `directory`, `manager`, `protocol` and `client`, so that the protocol and the
//! client never import the directory and the manager never imports the protocol.

use serde::Serialize;

use crate::tier::TierKind;

/// Most session entries (Pause, Resume) one advice answer carries; more wait for the
/// next ask (`more`). Bounds the answer's size: session ids are up to 1,024 bytes.
pub const MAX_SESSION_ADVICE: usize = 64;

/// Per-tier credit of a contiguous-prefix lookup, in pages. Each page is credited to the
/// nearest tier that holds it complete, and only while every earlier page is a hit too:
/// `device + host + pool` is the length of the reusable prefix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefixHit {
    pub device: usize,
    pub host: usize,
    pub pool: usize,
}

/// Lookups an engine answered itself from the daemon's lookup file, summed: reported to
/// the daemon so that its lookup and hit counters include them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LookupTally {
    pub lookups: u64,
    /// Pages asked about.
    pub pages: u64,
    /// Pages credited per tier.
    pub device: u64,
    pub host: u64,
    pub pool: u64,
}

impl LookupTally {
    /// Adds one lookup of `pages` pages that `hit` answered.
    pub fn add(&mut self, pages: usize, hit: &PrefixHit) {
        self.lookups += 1;
        self.pages += pages as u64;
        self.device += hit.device as u64;
        self.host += hit.host as u64;
        self.pool += hit.pool as u64;
    }

    /// Adds `other`, saturating (a report comes from an engine: any numbers).
    pub fn merge(&mut self, other: &LookupTally) {
        self.lookups = self.lookups.saturating_add(other.lookups);
        self.pages = self.pages.saturating_add(other.pages);
        self.device = self.device.saturating_add(other.device);
        self.host = self.host.saturating_add(other.host);
        self.pool = self.pool.saturating_add(other.pool);
    }
}

impl PrefixHit {
    pub fn total(&self) -> usize {
        self.device + self.host + self.pool
    }

    pub fn get(&self, tier: TierKind) -> usize {
        match tier {
            TierKind::Device => self.device,
            TierKind::Host => self.host,
            TierKind::Pool => self.pool,
        }
    }
}
