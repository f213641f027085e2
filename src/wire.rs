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

    /// Why this cannot be a sum of lookups of at most `max_pages` pages each, if it
    /// cannot: more pages credited than asked about, or more pages than the lookups
    /// could ask.
    pub fn check(&self, max_pages: u64) -> Result<(), String> {
        let hit = self.device.saturating_add(self.host).saturating_add(self.pool);
        if hit > self.pages {
            return Err(format!("lookup tally credits {hit} pages of {} asked", self.pages));
        }
        if self.pages > self.lookups.saturating_mul(max_pages) {
            return Err(format!(
                "lookup tally of {} lookups asks about {} pages, more than {max_pages} each",
                self.lookups, self.pages
            ));
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A report an engine sends is a sum of real lookups or refused: no more pages
    /// credited than asked, no more asked than its lookups could; sums saturate.
    #[test]
    fn a_lookup_tally_adds_up_or_is_refused() {
        let mut t = LookupTally::default();
        t.add(
            64,
            &PrefixHit {
                device: 10,
                host: 5,
                pool: 40,
            },
        );
        t.add(8, &PrefixHit::default());
        assert_eq!((t.lookups, t.pages, t.device, t.host, t.pool), (2, 72, 10, 5, 40));
        assert_eq!(t.check(4096), Ok(()));
        assert!(t.check(35).is_err(), "72 pages in 2 lookups of at most 35");
        let over = LookupTally { pool: 58, ..t };
        assert!(over.check(4096).unwrap_err().contains("credits 73 pages of 72"));
        let huge = LookupTally {
            lookups: u64::MAX,
            pages: u64::MAX - 1,
            device: u64::MAX,
            host: 1,
            pool: 0,
        };
        assert!(huge.check(4096).is_err(), "the credit saturates, past the pages");
        let mut sum = huge;
        sum.merge(&huge);
        assert_eq!(sum.lookups, u64::MAX);
    }
}
