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
