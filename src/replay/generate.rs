//! The built-in agentic workload generator (`--generate agentic`).
//!
//! Each agent session starts from one of a few long shared system prompts, then runs turns:
//! the model answers, calls a tool, waits for it, and sends its whole history again with
//! the tool result appended. Some turns fork subagents that start from the parent's prefix,
//! run their own turns concurrently while the parent waits on them, and end; the parent then
//! continues with their summaries appended. At most `concurrency` top-level sessions run at
//! once; a new one starts when one ends. Everything comes from a seeded RNG, so the same
//! settings give the same workload.
//!
//! Arrival times assume a nominal decode speed; the replay keeps them fixed (open loop).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::workload::{Request, SessionSpec, Workload};
use crate::page::PageHash;

/// Tool names the generated sessions call (a subagent fork calls `task`).
const TOOLS: [&str; 5] = ["bash", "read_file", "edit_file", "search", "run_tests"];

/// Generator settings.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AgenticSpec {
    /// Top-level sessions in total. Default: 64 (all of them run at once, each with its
    /// subagents).
    pub sessions: usize,
    /// Top-level sessions running at once. Default: 64.
    pub concurrency: usize,
    /// Distinct shared system prompts. Default: 4.
    pub system_prompts: usize,
    /// System prompt length range, tokens. Default: 6000..16000.
    pub system_tokens: (u64, u64),
    /// Turns per session. Default: 6..24.
    pub turns: (u32, u32),
    /// Output tokens per turn. Default: 100..600.
    pub output_tokens: (u64, u64),
    /// Tool result tokens appended per turn. Default: 500..5000.
    pub tool_tokens: (u64, u64),
    /// Tool wait, ms (log-uniform). Default: 1000..60000.
    pub tool_wait_ms: (u64, u64),
    /// Chance that a turn forks subagents. Default: 0.15.
    pub subagent_chance: f64,
    /// Subagents per fork. Default: 1..3.
    pub subagents: (u32, u32),
    /// Nominal decode speed used for arrival times. Default: 20 ms a token.
    pub decode_ms_per_token: f64,
    pub block_tokens: u32,
    pub seed: u64,
}

impl Default for AgenticSpec {
    fn default() -> Self {
        Self {
            sessions: 64,
            concurrency: 64,
            system_prompts: 4,
            system_tokens: (6000, 16000),
            turns: (6, 24),
            output_tokens: (100, 600),
            tool_tokens: (500, 5000),
            tool_wait_ms: (1000, 60_000),
            subagent_chance: 0.15,
            subagents: (1, 3),
            decode_ms_per_token: 20.0,
            block_tokens: 512,
            seed: 7,
        }
    }
}

/// A growing context: full blocks chained by hash, plus a partial tail.
#[derive(Clone, Debug)]
struct Context {
    blocks: Vec<PageHash>,
    tail_tokens: u64,
    seed: u64,
}

struct Gen {
    spec: AgenticSpec,
    rng: SmallRng,
    next_content: u64,
    work: Workload,
}

impl Gen {
    fn range(&mut self, (lo, hi): (u64, u64)) -> u64 {
        if hi <= lo { lo } else { self.rng.gen_range(lo..=hi) }
    }

    fn log_range(&mut self, (lo, hi): (u64, u64)) -> u64 {
        let (l, h) = ((lo.max(1) as f64).ln(), (hi.max(lo).max(1) as f64).ln());
        self.rng.gen_range(l..=h).exp() as u64
    }

    fn append(&mut self, ctx: &mut Context, tokens: u64) {
        let bt = u64::from(self.spec.block_tokens);
        let total = ctx.tail_tokens + tokens;
        for _ in 0..total / bt {
            self.next_content += 1;
            let prev = ctx.blocks.last().map_or(ctx.seed, PageHash::prefix_u64);
            ctx.blocks.push(PageHash::from_u64(xxh3_64_with_seed(
                &self.next_content.to_le_bytes(),
                prev,
            )));
        }
        ctx.tail_tokens = total % bt;
    }

    fn request(&mut self, session: usize, at: u64, ctx: &Context, output: u64) -> usize {
        let bt = u64::from(self.spec.block_tokens);
        let mut blocks = ctx.blocks.clone();
        if ctx.tail_tokens > 0 {
            // The partial last block is never reused: the next turn fills it differently.
            self.next_content += 1;
            blocks.push(PageHash::from_u64(xxh3_64_with_seed(
                &self.next_content.to_le_bytes(),
                1,
            )));
        }
        self.work.requests.push(Request {
            arrival_ms: at,
            session,
            input_tokens: ctx.blocks.len() as u64 * bt + ctx.tail_tokens,
            output_tokens: output,
            blocks,
            tool_end_ms: None,
            tool_names: Vec::new(),
        });
        self.work.requests.len() - 1
    }

    /// Runs one session from `start`; returns when its last request finishes.
    fn session(&mut self, id: String, parent: Option<usize>, mut ctx: Context, start: u64, depth: u32) -> u64 {
        self.work.sessions.push(SessionSpec {
            id,
            parent,
            ends_explicitly: true,
        });
        let me = self.work.sessions.len() - 1;
        let turns = self.range((u64::from(self.spec.turns.0), u64::from(self.spec.turns.1))) as u32;
        let turns = if depth > 0 { turns.div_ceil(3).max(2) } else { turns };
        let mut at = start;
        for turn in 0..turns {
            let output = self.range(self.spec.output_tokens);
            let r = self.request(me, at, &ctx, output);
            let done = at + (output as f64 * self.spec.decode_ms_per_token) as u64;
            self.append(&mut ctx, output);
            if turn + 1 == turns {
                return done;
            }
            let fork = depth == 0 && self.rng.gen_bool(self.spec.subagent_chance.clamp(0.0, 1.0));
            let next = if fork {
                let n = self.range((u64::from(self.spec.subagents.0), u64::from(self.spec.subagents.1)));
                let mut end = done;
                for k in 0..n {
                    let mut child = ctx.clone();
                    let task = self.range((200, 800));
                    self.append(&mut child, task);
                    let cid = format!("{}/sub{}-{}", self.work.sessions[me].id, turn, k);
                    end = end.max(self.session(cid, Some(me), child, done + 50 * k, depth + 1));
                }
                let summaries = n * self.range((200, 600));
                self.append(&mut ctx, summaries);
                self.work.requests[r].tool_names = vec!["task".into(); n as usize];
                end + 100
            } else {
                let tool = self.range(self.spec.tool_tokens);
                self.append(&mut ctx, tool);
                let name = TOOLS[self.rng.gen_range(0..TOOLS.len())];
                self.work.requests[r].tool_names = vec![name.into()];
                done + self.log_range(self.spec.tool_wait_ms)
            };
            self.work.requests[r].tool_end_ms = Some(next);
            at = next;
        }
        at
    }
}

/// Generates the agentic workload described by `spec`.
pub fn agentic(spec: &AgenticSpec) -> Workload {
    let mut g = Gen {
        spec: spec.clone(),
        rng: SmallRng::seed_from_u64(spec.seed),
        next_content: 0,
        work: Workload {
            name: "agentic".into(),
            block_tokens: spec.block_tokens.max(1),
            ..Workload::default()
        },
    };
    g.spec.block_tokens = g.work.block_tokens;
    let prompts: Vec<Context> = (0..spec.system_prompts.max(1))
        .map(|p| {
            let mut ctx = Context {
                blocks: Vec::new(),
                tail_tokens: 0,
                seed: 0x5157_0000 + p as u64,
            };
            let bt = u64::from(g.spec.block_tokens);
            // System prompts are whole blocks, so every session shares all of them.
            let tokens = g.range(spec.system_tokens) / bt * bt;
            g.append(&mut ctx, tokens);
            ctx
        })
        .collect();
    // Slots of the concurrency limit: each is free again when its session finishes.
    let mut free_at: Vec<u64> = (0..spec.concurrency.max(1) as u64).map(|i| i * 150).collect();
    for s in 0..spec.sessions {
        let slot = (0..free_at.len()).min_by_key(|&i| free_at[i]).unwrap_or(0);
        let p = g.rng.gen_range(0..prompts.len());
        let mut ctx = prompts[p].clone();
        let task = g.range((200, 2000));
        g.append(&mut ctx, task);
        let start = free_at[slot];
        free_at[slot] = g.session(format!("agent-{s}"), None, ctx, start, 0) + 500;
    }
    g.work.requests.sort_by_key(|r| r.arrival_ms);
    g.work
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_is_deterministic_and_agentic() {
        let spec = AgenticSpec {
            sessions: 20,
            concurrency: 8,
            subagent_chance: 0.3,
            ..AgenticSpec::default()
        };
        let a = agentic(&spec);
        let b = agentic(&spec);
        assert_eq!(a.requests, b.requests);
        assert!(a.requests.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        let subs = a.sessions.iter().filter(|s| s.parent.is_some()).count();
        assert!(subs > 0, "some subagents");
        // A subagent's first request starts with its parent's prefix.
        let (child, spec_c) = a.sessions.iter().enumerate().find(|(_, s)| s.parent.is_some()).unwrap();
        let parent = spec_c.parent.unwrap();
        let first_child = a.requests.iter().find(|r| r.session == child).unwrap();
        let first_parent = a.requests.iter().find(|r| r.session == parent).unwrap();
        let full = (first_parent.input_tokens / 512) as usize;
        assert_eq!(first_child.blocks[..full], first_parent.blocks[..full]);
        // Tool waits: later turns of a session extend its earlier chain.
        let turns: Vec<_> = a.requests.iter().filter(|r| r.session == 0).collect();
        assert!(turns.len() >= 2);
        let keep = (turns[0].input_tokens / 512) as usize;
        assert_eq!(turns[1].blocks[..keep], turns[0].blocks[..keep]);
        assert!(turns[0].tool_end_ms.is_some_and(|t| t <= turns[1].arrival_ms));
        assert_ne!(agentic(&AgenticSpec { seed: 8, ..spec }).requests, a.requests);
    }
}
