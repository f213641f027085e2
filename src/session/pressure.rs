//! The pressure controller: pauses sessions at tool boundaries when utilisation reaches
//! the high watermark, and lets them back smallest first once there is room.
//!
//! Utilisation is what the caller measures: [`PressureController::step_at`] takes it with
//! a size per session (the daemon's session policy passes its host tier in pages and each
//! session's chain); [`PressureController::step`] uses the live, unpaused sessions'
//! context tokens over a device capacity. At or above the high watermark, acting sessions
//! (waiting on a tool) are paused, largest first, until what they hold covers the excess
//! over the target; the session policy (`crate::policy::session`) turns a pause into the
//! demotion of the session's private pages. Decode is never preempted: when no acting
//! session can be paused, the smallest reasoning session is marked to pause at its next
//! tool boundary. At or below the resume watermark, paused sessions come back smallest
//! first, each with a buffer, and get a short priority boost; a forced-resume cap ends any
//! pause that lasted too long, whatever the utilisation. Between the watermarks the
//! controller changes nothing (hysteresis); the session policy uses that early band
//! ([`Watermarks::in_early_band`]) to demote acting sessions and mark reasoning ones.

use serde::{Deserialize, Serialize};

use super::{Activity, SessionError, SessionTable};
use crate::watermarks::{PolicyError, Watermarks};

/// Pressure controller settings.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PressureConfig {
    /// Device watermarks on the live sessions' demand. Default: high 0.95, target 0.80,
    /// resume 0.85.
    pub watermarks: Watermarks,
    /// Room kept free per resumed session on top of its context, in tokens. Default: 2048.
    pub resume_buffer_tokens: u64,
    /// How long a resumed session is preferred (never paused again). Default: 1000 ms.
    pub boost_ms: u64,
    /// A pause never lasts longer than this. Default: 30 minutes.
    pub forced_resume_ms: u64,
    /// Most sessions paused or resumed in one step (bounded work). Default: 256.
    pub max_changes_per_step: usize,
}

impl Default for PressureConfig {
    fn default() -> Self {
        Self {
            watermarks: Watermarks::default(),
            resume_buffer_tokens: 2048,
            boost_ms: 1000,
            forced_resume_ms: 30 * 60 * 1000,
            max_changes_per_step: 256,
        }
    }
}

impl PressureConfig {
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.watermarks.validate()
    }
}

/// What the controller decided; the caller moves the pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Paused now: demote its device pages to host and its host pages to the pool.
    Pause { session: u32 },
    /// A reasoning session that will pause at its next tool boundary.
    MarkPause { session: u32 },
    /// Back: prefetch its pages to the device before its next turn.
    Resume { session: u32, forced: bool, paused_ms: u64 },
}

/// Decides pauses and resumptions from the session table (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct PressureController {
    config: PressureConfig,
}

impl PressureController {
    pub fn new(config: PressureConfig) -> Result<Self, PolicyError> {
        config.validate()?;
        Ok(Self { config })
    }

    pub fn config(&self) -> &PressureConfig {
        &self.config
    }

    /// Device demand of the live, unpaused sessions, in tokens.
    pub fn demand(&self, sessions: &SessionTable) -> u64 {
        sessions
            .iter()
            .filter(|(_, s)| !s.paused)
            .map(|(_, s)| s.context_tokens)
            .sum()
    }

    /// One control step against a device of `capacity_tokens`, on the live sessions'
    /// device demand (their context tokens).
    pub fn step(&self, sessions: &mut SessionTable, capacity_tokens: u64) -> Result<Vec<Action>, SessionError> {
        let used = self.demand(sessions);
        self.step_at(sessions, used, capacity_tokens, |s| s.context_tokens)
    }

    /// One control step on a utilisation the caller measured (`used` of `capacity`, in
    /// the unit `size` gives each session): the daemon passes its host tier's pages and
    /// each session's pages, so pausing a session is credited with what it frees there.
    pub fn step_at(
        &self,
        sessions: &mut SessionTable,
        used: u64,
        capacity_tokens: u64,
        size: impl Fn(&super::Session) -> u64,
    ) -> Result<Vec<Action>, SessionError> {
        let now = sessions.now_ms();
        let cap = capacity_tokens as usize;
        let wm = &self.config.watermarks;
        let mut actions = Vec::new();
        let overdue: Vec<u32> = sessions
            .iter()
            .filter(|(_, s)| {
                s.paused && now.saturating_sub(s.paused_since_ms.unwrap_or(now)) >= self.config.forced_resume_ms
            })
            .map(|(i, _)| i)
            .take(self.config.max_changes_per_step)
            .collect();
        for session in overdue {
            if let Some(paused_ms) = sessions.resume(session, self.config.boost_ms)? {
                actions.push(Action::Resume {
                    session,
                    forced: true,
                    paused_ms,
                });
            }
        }
        let used = used as usize;
        let reclaim = wm.reclaim(used, cap) as u64;
        if reclaim > 0 {
            let mut acting: Vec<(u64, u32)> = sessions
                .iter()
                .filter(|(i, s)| !s.paused && s.activity == Activity::Acting && s.boost_until_ms <= now && *i > 0)
                .map(|(i, s)| (size(s), i))
                .collect();
            acting.sort_unstable_by(|a, b| b.cmp(a));
            let mut freed = 0u64;
            for (tokens, session) in acting.into_iter().take(self.config.max_changes_per_step) {
                if freed >= reclaim {
                    break;
                }
                sessions.pause(session)?;
                actions.push(Action::Pause { session });
                freed += tokens;
            }
            if freed < reclaim {
                let smallest = sessions
                    .iter()
                    .filter(|(_, s)| !s.paused && !s.pause_pending && s.activity == Activity::Reasoning)
                    .min_by_key(|(i, s)| (size(s), *i))
                    .map(|(i, _)| i);
                if let Some(session) = smallest {
                    sessions.mark_pause(session)?;
                    actions.push(Action::MarkPause { session });
                }
            }
        } else if wm.may_resume(used, cap) {
            let mut budget = ((wm.resume * capacity_tokens as f64) as u64).saturating_sub(used as u64);
            let mut paused: Vec<(u64, u64, u32)> = sessions
                .iter()
                .filter(|(_, s)| s.paused)
                .map(|(i, s)| (size(s), s.paused_since_ms.unwrap_or(now), i))
                .collect();
            paused.sort_unstable();
            for (tokens, _, session) in paused.into_iter().take(self.config.max_changes_per_step) {
                let cost = tokens.saturating_add(self.config.resume_buffer_tokens);
                if cost > budget {
                    break;
                }
                budget -= cost;
                if let Some(paused_ms) = sessions.resume(session, self.config.boost_ms)? {
                    actions.push(Action::Resume {
                        session,
                        forced: false,
                        paused_ms,
                    });
                }
            }
        }
        Ok(actions)
    }
}

#[cfg(test)]
mod tests;
