//! The engine emulator: drives the real directory, the eviction order and the daemon's
//! session-aware policy ([`SessionPolicy`](crate::policy::SessionPolicy)) with a
//! workload, at page granularity.
//!
//! Nothing is copied: a page moving between tiers is a directory change, and the bytes it
//! would move are counted as pages times the layout's page bytes. Time is simulated
//! ([`SimClock`](crate::clock::SimClock)): requests arrive at their trace times (open loop)
//! and finish after the cost model's latency. Each tier evicts when it is over capacity,
//! down to capacity minus a 1/256 slack, the same way for every policy.
//!
//! The policies differ only in what they do with a page:
//! - `device-lru`: one tier, least recently used first (prefix pages are touched last, so
//!   a chain is evicted from its tail, as a radix-tree prefix cache does).
//! - `write-through`: every computed page is also written to host (and to the pool when
//!   there is one); each tier evicts LRU on its own (HiCache's default).
//! - `exclusive-lru`: the same tiers held exclusively — a page reaches host when the
//!   device evicts it, and its host copy goes once it is loaded back — with LRU and no
//!   session signal. This is what the tiers alone give.
//! - `session-aware`: `exclusive-lru` plus the daemon's session policy, fed the calls an
//!   engine makes (store, hit, phase changes, request end, tick) at the moment they
//!   happen; the moves it returns are carried out here as the manager carries them out.
//!   A tool's end is signalled when the next turn arrives, never before.
//! - `session-aware-lookahead`: the same, told of each tool's end `tool_end_lead_ms`
//!   early (an oracle no engine has; off by default, for comparison only).
//! - `session-aware-no-<signal>`: the ablations, one signal of [`Signals`] turned off.

mod sim;

use serde::Serialize;

use super::ReplayError;
use super::workload::Workload;
use crate::policy::Signals;
use crate::session::pressure::PressureConfig;

/// The policies compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum PolicyKind {
    #[serde(rename = "device-lru")]
    DeviceLru,
    #[serde(rename = "write-through")]
    WriteThrough,
    #[serde(rename = "exclusive-lru")]
    ExclusiveLru,
    #[serde(rename = "session-aware")]
    SessionAware,
    #[serde(rename = "session-aware-lookahead")]
    SessionAwareLookahead,
    #[serde(rename = "session-aware-no-lineage")]
    NoLineage,
    #[serde(rename = "session-aware-no-phases")]
    NoPhases,
    #[serde(rename = "session-aware-no-pressure")]
    NoPressure,
    #[serde(rename = "session-aware-no-ended")]
    NoEnded,
}

impl PolicyKind {
    /// What `kvtier replay` runs by default: everything but the lookahead oracle.
    pub const ALL: [PolicyKind; 8] = [
        PolicyKind::DeviceLru,
        PolicyKind::WriteThrough,
        PolicyKind::ExclusiveLru,
        PolicyKind::SessionAware,
        PolicyKind::NoLineage,
        PolicyKind::NoPhases,
        PolicyKind::NoPressure,
        PolicyKind::NoEnded,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::DeviceLru => "device-lru",
            PolicyKind::WriteThrough => "write-through",
            PolicyKind::ExclusiveLru => "exclusive-lru",
            PolicyKind::SessionAware => "session-aware",
            PolicyKind::SessionAwareLookahead => "session-aware-lookahead",
            PolicyKind::NoLineage => "session-aware-no-lineage",
            PolicyKind::NoPhases => "session-aware-no-phases",
            PolicyKind::NoPressure => "session-aware-no-pressure",
            PolicyKind::NoEnded => "session-aware-no-ended",
        }
    }

    /// The session signals the policy acts on; `None` for the kinds without tiers held
    /// exclusively (they run no session policy at all).
    pub fn signals(self) -> Option<Signals> {
        let all = Signals::ALL;
        match self {
            PolicyKind::DeviceLru | PolicyKind::WriteThrough => None,
            PolicyKind::ExclusiveLru => Some(Signals::NONE),
            PolicyKind::SessionAware | PolicyKind::SessionAwareLookahead => Some(all),
            PolicyKind::NoLineage => Some(Signals { lineage: false, ..all }),
            PolicyKind::NoPhases => Some(Signals { phases: false, ..all }),
            PolicyKind::NoPressure => Some(Signals { pressure: false, ..all }),
            PolicyKind::NoEnded => Some(Signals { ended: false, ..all }),
        }
    }
}

/// Tier capacities, in pages. A pool of 0 pages means no pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Capacity {
    pub device_pages: usize,
    pub host_pages: usize,
    pub pool_pages: usize,
}

impl Capacity {
    /// What the bounds get: every page any tier can hold.
    pub fn total(&self) -> usize {
        self.device_pages + self.host_pages + self.pool_pages
    }
}

/// The cost model behind latencies and session completion times.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CostModel {
    /// Prefill speed for recomputed tokens. Default: 20000 tokens/s.
    pub prefill_tokens_per_s: f64,
    /// Decode time per output token. Default: 20 ms.
    pub decode_ms_per_token: f64,
    /// Host to device copy bandwidth. Default: 25 GB/s.
    pub host_device_gbps: f64,
    /// Pool to host copy bandwidth. Default: 10 GB/s.
    pub pool_host_gbps: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 20_000.0,
            decode_ms_per_token: 20.0,
            host_device_gbps: 25.0,
            pool_host_gbps: 10.0,
        }
    }
}

impl CostModel {
    /// Speeds and bandwidths must be positive and finite, decode time finite and not negative.
    pub fn validate(&self) -> Result<(), ReplayError> {
        let positive = [self.prefill_tokens_per_s, self.host_device_gbps, self.pool_host_gbps];
        if positive.iter().all(|v| v.is_finite() && *v > 0.0)
            && self.decode_ms_per_token.is_finite()
            && self.decode_ms_per_token >= 0.0
        {
            Ok(())
        } else {
            Err(ReplayError::Config(format!("invalid cost model {self:?}")))
        }
    }

    /// Latency of one request, ms: recompute, copies on the critical path, decode.
    pub fn latency_ms(&self, recomputed_tokens: u64, host_bytes: u64, pool_bytes: u64, output_tokens: u64) -> f64 {
        let prefill = recomputed_tokens as f64 / self.prefill_tokens_per_s.max(1e-9) * 1e3;
        let h2d = (host_bytes + pool_bytes) as f64 / (self.host_device_gbps.max(1e-9) * 1e6);
        let p2h = pool_bytes as f64 / (self.pool_host_gbps.max(1e-9) * 1e6);
        prefill + h2d + p2h + output_tokens as f64 * self.decode_ms_per_token
    }
}

/// Everything a policy run needs besides the workload.
#[derive(Clone, Debug, Serialize)]
pub struct EngineConfig {
    pub capacity: Capacity,
    /// Bytes of one page under the stated layout.
    pub page_bytes: u64,
    /// The model geometry behind `page_bytes`, in words.
    pub page_layout: String,
    pub cost: CostModel,
    pub pressure: PressureConfig,
    /// Sessions with no activity for this long end. Default: 300 s.
    pub idle_timeout_ms: u64,
    /// How long before a tool wait ends `session-aware-lookahead` hears of it (the other
    /// policies hear of it when it ends). Default: 500 ms.
    pub tool_end_lead_ms: u64,
}

/// Bytes moved between tier pairs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BytesMoved {
    #[serde(rename = "device->host")]
    pub device_host: u64,
    #[serde(rename = "host->device")]
    pub host_device: u64,
    #[serde(rename = "host->pool")]
    pub host_pool: u64,
    #[serde(rename = "pool->host")]
    pub pool_host: u64,
}

/// What one request got.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutcome {
    /// Hit pages per tier (device, host, pool); their sum is the reusable prefix.
    pub hit_pages: [usize; 3],
    pub latency_ms: f64,
    pub end_ms: u64,
    /// Pauses the session went through since its previous request.
    pub pause_ms: Vec<u64>,
}

/// The raw result of one policy on one workload.
#[derive(Clone, Debug, Default)]
pub struct PolicyRun {
    pub requests: Vec<RequestOutcome>,
    pub bytes: BytesMoved,
    /// Finished pause durations.
    pub pauses_ms: Vec<u64>,
    pub forced_resumes: u64,
    pub marked_pauses: u64,
    /// Pages moved between host and pool, in order, when asked for
    /// ([`run_policy_logged`]); empty otherwise.
    pub moves: Vec<TierMove>,
}

/// A page that moved between the tiers the daemon owns (host and pool), as the daemon's
/// events show it: its host copy went while the pool holds it (`host` to `pool`), or it
/// came back into host from the pool (`pool` to `host`). Device copies are the engine's
/// and not among them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TierMove {
    /// Simulated time of the move.
    pub at_ms: u64,
    /// The page's hash in hex, as the daemon's events and `/v1/pages` name it.
    pub page: String,
    pub from: crate::tier::TierKind,
    pub to: crate::tier::TierKind,
}

/// Runs `policy` over the workload; `progress` is told after every request.
pub fn run_policy(
    w: &Workload,
    cfg: &EngineConfig,
    policy: PolicyKind,
    progress: &mut dyn FnMut(),
) -> Result<PolicyRun, ReplayError> {
    sim::Sim::new(w, cfg, policy)?.run(progress)
}

/// [`run_policy`], also logging the first `max_moves` host and pool moves
/// ([`PolicyRun::moves`]): what `kvtier replay --write-moves` writes, to set beside the
/// moves a daemon made for the same requests.
pub fn run_policy_logged(
    w: &Workload,
    cfg: &EngineConfig,
    policy: PolicyKind,
    max_moves: usize,
    progress: &mut dyn FnMut(),
) -> Result<PolicyRun, ReplayError> {
    let mut sim = sim::Sim::new(w, cfg, policy)?;
    sim.log_moves(max_moves);
    sim.run(progress)
}

#[cfg(test)]
mod tests;
