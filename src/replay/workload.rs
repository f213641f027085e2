//! Workloads the replay runs: requests with a session, token counts and a block-hash chain.
//!
//! Three sources produce the same [`Workload`]: the Mooncake trace format (sessions are
//! inferred from chain extension, see [`Workload::from_mooncake`]), kvtier's own request
//! traces (sessions as recorded), and the built-in agentic generator (`generate`).

use std::collections::{HashMap, HashSet};
use std::io::BufRead;

use serde::Deserialize;

use super::ReplayError;
use crate::page::PageHash;
use crate::session::lineage::Lineage;
use crate::session::trace::{RequestTrace, read_traces};

/// Most requests a workload may hold.
pub const MAX_REQUESTS: usize = 10_000_000;
/// Most blocks one request may have.
pub const MAX_BLOCKS_PER_REQUEST: usize = 1 << 20;
/// Longest Mooncake line accepted, in bytes.
const MAX_LINE_BYTES: u64 = 64 << 20;

/// One request as the engine sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub arrival_ms: u64,
    /// Index into [`Workload::sessions`].
    pub session: usize,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// The prompt's block hashes (the last block may be partial).
    pub blocks: Vec<PageHash>,
    /// When the session's tool call (or user) finished, if the source knows it: the engine
    /// hears of it through a phase change, a little before the next request arrives.
    pub tool_end_ms: Option<u64>,
    /// Names of the tools the response called (names only, never arguments or results).
    pub tool_names: Vec<String>,
}

/// One session of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionSpec {
    pub id: String,
    pub parent: Option<usize>,
    /// The session is ended explicitly when its last request finishes (otherwise it ends
    /// by idle timeout).
    pub ends_explicitly: bool,
}

/// Requests in arrival order, with their sessions.
#[derive(Clone, Debug, Default)]
pub struct Workload {
    pub name: String,
    pub block_tokens: u32,
    pub sessions: Vec<SessionSpec>,
    pub requests: Vec<Request>,
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: u64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    /// kvtier's own request traces name the session (`session::trace_log`); the
    /// Mooncake traces do not, and sessions are inferred.
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    parent_session_id: Option<String>,
}

impl Workload {
    /// Distinct blocks over all requests.
    pub fn distinct_blocks(&self) -> usize {
        let set: HashSet<&PageHash> = self.requests.iter().flat_map(|r| &r.blocks).collect();
        set.len()
    }

    pub fn input_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.input_tokens).sum()
    }

    /// Reads the Mooncake trace format: one JSON object per line with `timestamp` (ms),
    /// `input_length`, `output_length` and `hash_ids` (`block_tokens` tokens a block), at
    /// most `max_requests` lines.
    ///
    /// Sessions are inferred: a request whose `hash_ids` start with the whole chain of a
    /// live session's latest request continues that session (the most recent such session
    /// with the longest chain); any other request opens a new session, whose parent is the
    /// session that last used the longest prefix it shares with earlier requests, if any.
    pub fn from_mooncake(input: impl BufRead, block_tokens: u32, max_requests: usize) -> Result<Self, ReplayError> {
        let mut lines = Vec::new();
        let mut input = input;
        let mut buf = Vec::new();
        let mut line = 0usize;
        loop {
            buf.clear();
            line += 1;
            let n = std::io::Read::take(&mut input, MAX_LINE_BYTES + 1).read_until(b'\n', &mut buf)?;
            if n == 0 || lines.len() >= max_requests.min(MAX_REQUESTS) {
                break;
            }
            if buf.len() as u64 > MAX_LINE_BYTES {
                return Err(ReplayError::Input {
                    line,
                    what: "line too long".into(),
                });
            }
            if buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let l: MooncakeLine = serde_json::from_slice(&buf).map_err(|e| ReplayError::Input {
                line,
                what: e.to_string(),
            })?;
            if l.hash_ids.len() > MAX_BLOCKS_PER_REQUEST {
                return Err(ReplayError::Input {
                    line,
                    what: format!("more than {MAX_BLOCKS_PER_REQUEST} hash_ids"),
                });
            }
            lines.push(l);
        }
        lines.sort_by_key(|l| l.timestamp);
        let mut w = Workload {
            name: "mooncake".into(),
            block_tokens,
            ..Workload::default()
        };
        let mut lineage = Lineage::new(MAX_REQUESTS);
        let mut named: HashMap<String, usize> = HashMap::new();
        for l in lines {
            let blocks: Vec<PageHash> = l.hash_ids.iter().map(|&h| PageHash::from_u64(h)).collect();
            let m = lineage.match_prefix(&blocks);
            let session = match (l.session_id, m.extends) {
                (Some(id), _) => {
                    let parent = l.parent_session_id.as_ref().and_then(|p| named.get(p).copied());
                    let n = w.sessions.len();
                    *named.entry(id.clone()).or_insert_with(|| {
                        w.sessions.push(SessionSpec {
                            id,
                            parent,
                            ends_explicitly: false,
                        });
                        n
                    })
                }
                (None, extends) => match extends {
                    Some((s, _)) => s as usize - 1,
                    None => {
                        let parent = m.deepest_sharer.map(|s| s as usize - 1);
                        w.sessions.push(SessionSpec {
                            id: format!("mooncake-{}", w.sessions.len()),
                            parent,
                            ends_explicitly: false,
                        });
                        w.sessions.len() - 1
                    }
                },
            };
            lineage.insert(session as u32 + 1, &blocks);
            w.requests.push(Request {
                arrival_ms: l.timestamp,
                session,
                input_tokens: l.input_length,
                output_tokens: l.output_length,
                blocks,
                tool_end_ms: None,
                tool_names: Vec::new(),
            });
        }
        Ok(w)
    }

    /// Reads kvtier request traces (JSON lines) as a workload. Every record must use the
    /// same `block_tokens`.
    pub fn from_request_traces(input: impl BufRead, max_requests: usize) -> Result<Self, ReplayError> {
        let mut records = read_traces(input, max_requests.min(MAX_REQUESTS))?;
        records.sort_by_key(|r| r.arrival_ms);
        Self::from_records(&records)
    }

    /// Builds a workload from trace records already in arrival order.
    pub fn from_records(records: &[RequestTrace]) -> Result<Self, ReplayError> {
        let block_tokens = records.first().map_or(512, |r| r.block_tokens);
        let mut w = Workload {
            name: "request-traces".into(),
            block_tokens,
            ..Workload::default()
        };
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut last_of: HashMap<usize, usize> = HashMap::new();
        for (i, r) in records.iter().enumerate() {
            if r.block_tokens != block_tokens {
                return Err(ReplayError::Input {
                    line: i + 1,
                    what: format!("block_tokens {} differs from {block_tokens}", r.block_tokens),
                });
            }
            let session = match index.get(r.session_id.as_str()) {
                Some(&s) => s,
                None => {
                    let parent = r.parent_session_id.as_deref().and_then(|p| index.get(p).copied());
                    w.sessions.push(SessionSpec {
                        id: r.session_id.clone(),
                        parent,
                        ends_explicitly: false,
                    });
                    index.insert(&r.session_id, w.sessions.len() - 1);
                    w.sessions.len() - 1
                }
            };
            if r.session_end {
                w.sessions[session].ends_explicitly = true;
            }
            // The tool wait between two requests of a session ends when the next arrives.
            if let Some(&prev) = last_of.get(&session) {
                let p: &mut Request = &mut w.requests[prev];
                p.tool_end_ms = Some(r.arrival_ms);
            }
            last_of.insert(session, w.requests.len());
            w.requests.push(Request {
                arrival_ms: r.arrival_ms,
                session,
                input_tokens: r.input_tokens,
                output_tokens: r.output_tokens,
                blocks: r.block_hashes.clone(),
                tool_end_ms: None,
                tool_names: r.tool_names.clone(),
            });
        }
        Ok(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_sessions_follow_chain_extension() {
        let text = r#"{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}
{"timestamp": 5, "input_length": 900, "output_length": 5, "hash_ids": [1, 3]}

{"timestamp": 9, "input_length": 2000, "output_length": 5, "hash_ids": [1, 2, 4, 5]}
{"timestamp": 12, "input_length": 100, "output_length": 5, "hash_ids": [9]}
"#;
        let w = Workload::from_mooncake(text.as_bytes(), 512, 100).unwrap();
        let sessions: Vec<usize> = w.requests.iter().map(|r| r.session).collect();
        assert_eq!(sessions, vec![0, 1, 0, 2]);
        assert_eq!(w.sessions[1].parent, Some(0));
        assert_eq!(w.sessions[2].parent, None);
        assert_eq!(w.distinct_blocks(), 6);
        assert_eq!(w.input_tokens(), 4000);
        let bad = "{\"timestamp\": 0}\n";
        assert!(matches!(
            Workload::from_mooncake(bad.as_bytes(), 512, 10),
            Err(ReplayError::Input { line: 1, .. })
        ));
        let w = Workload::from_mooncake(text.as_bytes(), 512, 2).unwrap();
        assert_eq!(w.requests.len(), 2);
    }
}
