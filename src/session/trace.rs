//! Request traces: one JSON line per finished request, written when its response ends.
//!
//! A record carries the session fields, token counts, finish reason, per-tier hit tokens,
//! recomputed tokens, pause durations, tool names and the block-hash sequence: enough to
//! replay the prefix-sharing structure and the tool waits, and nothing of the content.
//! There is no field for prompt, response or tool-call content, and the reader refuses
//! unknown fields, so a content field can neither be written nor read back.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use crate::page::PageHash;

/// Most tool names kept per record.
pub const MAX_TOOL_NAMES: usize = 64;
/// Longest tool name kept, in bytes.
pub const MAX_TOOL_NAME_BYTES: usize = 128;
/// Most block hashes per record.
pub const MAX_BLOCKS: usize = 1 << 20;
/// Longest accepted line when reading, in bytes.
pub const MAX_LINE_BYTES: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading traces: {0}")]
    Io(#[from] std::io::Error),
    #[error("line {line}: {source}")]
    Parse { line: usize, source: serde_json::Error },
    #[error("line {line}: longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong { line: usize },
    #[error("line {line}: {what}")]
    Invalid { line: usize, what: String },
    #[error("more than {0} records")]
    TooMany(usize),
    #[error("writing a trace: {0}")]
    Encode(serde_json::Error),
}

/// How a response ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    Abort,
}

/// Tokens credited per tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierTokens {
    pub device: u64,
    pub host: u64,
    pub pool: u64,
}

impl TierTokens {
    pub fn total(&self) -> u64 {
        self.device + self.host + self.pool
    }
}

/// One finished request. Field names are the JSON keys; see the module docs for what is
/// deliberately absent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestTrace {
    pub session_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
    /// When the request arrived, in ms on the recorder's clock.
    pub arrival_ms: u64,
    /// When its response ended.
    pub end_ms: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub finish_reason: FinishReason,
    /// Whether the session ended with this request.
    #[serde(default)]
    pub session_end: bool,
    pub hit_tokens: TierTokens,
    pub recomputed_tokens: u64,
    /// Pauses the session went through since its previous request.
    #[serde(default)]
    pub pause_ms: Vec<u64>,
    /// Names of the tools the response called (names only).
    #[serde(default)]
    pub tool_names: Vec<String>,
    pub block_tokens: u32,
    /// The prompt's block hashes, in order.
    pub block_hashes: Vec<PageHash>,
}

impl RequestTrace {
    /// Clips the unbounded fields to their limits (tool names, block count).
    pub fn bounded(mut self) -> Self {
        self.tool_names.truncate(MAX_TOOL_NAMES);
        for name in &mut self.tool_names {
            if name.len() > MAX_TOOL_NAME_BYTES {
                let mut end = MAX_TOOL_NAME_BYTES;
                while !name.is_char_boundary(end) {
                    end -= 1;
                }
                name.truncate(end);
            }
        }
        self.block_hashes.truncate(MAX_BLOCKS);
        self
    }

    fn check(&self, line: usize) -> Result<(), TraceError> {
        let invalid = |what: &str| TraceError::Invalid {
            line,
            what: what.to_owned(),
        };
        if self.session_id.is_empty() || self.session_id.len() > super::MAX_SESSION_ID_BYTES {
            return Err(invalid("session_id must have 1 to 1024 bytes"));
        }
        if self.block_tokens == 0 {
            return Err(invalid("block_tokens must be positive"));
        }
        if self.block_hashes.len() > MAX_BLOCKS || self.tool_names.len() > MAX_TOOL_NAMES {
            return Err(invalid("too many block hashes or tool names"));
        }
        if self.end_ms < self.arrival_ms {
            return Err(invalid("end_ms is before arrival_ms"));
        }
        Ok(())
    }
}

/// Writes traces as JSON lines.
#[derive(Debug)]
pub struct TraceWriter<W: Write> {
    out: W,
}

impl<W: Write> TraceWriter<W> {
    pub fn new(out: W) -> Self {
        Self { out }
    }

    pub fn write(&mut self, record: &RequestTrace) -> Result<(), TraceError> {
        let line = serde_json::to_string(record).map_err(TraceError::Encode)?;
        self.out.write_all(line.as_bytes())?;
        self.out.write_all(b"\n")?;
        Ok(())
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

/// Reads at most `max_records` traces; blank lines are skipped.
pub fn read_traces(input: impl BufRead, max_records: usize) -> Result<Vec<RequestTrace>, TraceError> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut line = 0;
    let mut input = input;
    loop {
        buf.clear();
        line += 1;
        let n = std::io::Read::take(&mut input, MAX_LINE_BYTES as u64 + 1).read_until(b'\n', &mut buf)?;
        if n == 0 {
            return Ok(out);
        }
        if buf.len() > MAX_LINE_BYTES {
            return Err(TraceError::LineTooLong { line });
        }
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if out.len() >= max_records {
            return Err(TraceError::TooMany(max_records));
        }
        let rec: RequestTrace = serde_json::from_slice(&buf).map_err(|source| TraceError::Parse { line, source })?;
        rec.check(line)?;
        out.push(rec);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RequestTrace {
        RequestTrace {
            session_id: "s1".into(),
            parent_session_id: Some("s0".into()),
            arrival_ms: 10,
            end_ms: 250,
            input_tokens: 1100,
            output_tokens: 40,
            finish_reason: FinishReason::ToolCalls,
            session_end: false,
            hit_tokens: TierTokens {
                device: 512,
                host: 512,
                pool: 0,
            },
            recomputed_tokens: 76,
            pause_ms: vec![1200],
            tool_names: vec!["bash".into()],
            block_tokens: 512,
            block_hashes: vec![PageHash::from_u64(1), PageHash::from_u64(2)],
        }
    }

    #[test]
    fn serialized_traces_have_only_the_allowed_keys() {
        let allowed = [
            "session_id",
            "parent_session_id",
            "arrival_ms",
            "end_ms",
            "input_tokens",
            "output_tokens",
            "finish_reason",
            "session_end",
            "hit_tokens",
            "recomputed_tokens",
            "pause_ms",
            "tool_names",
            "block_tokens",
            "block_hashes",
        ];
        let v: serde_json::Value = serde_json::to_value(sample()).unwrap();
        let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), allowed.len());
        for k in keys {
            assert!(allowed.contains(&k.as_str()), "unexpected key {k}");
        }
        let hit: Vec<&String> = v["hit_tokens"].as_object().unwrap().keys().collect();
        assert_eq!(hit, ["device", "host", "pool"]);
    }

    #[test]
    fn traces_round_trip_and_content_fields_are_refused() {
        let mut w = TraceWriter::new(Vec::new());
        w.write(&sample()).unwrap();
        w.write(&sample()).unwrap();
        let bytes = w.into_inner();
        let back = read_traces(&bytes[..], 10).unwrap();
        assert_eq!(back, vec![sample(), sample()]);
        assert!(matches!(read_traces(&bytes[..], 1), Err(TraceError::TooMany(1))));
        let mut v = serde_json::to_value(sample()).unwrap();
        v["prompt"] = "secret".into();
        let line = serde_json::to_string(&v).unwrap();
        assert!(matches!(
            read_traces(line.as_bytes(), 10),
            Err(TraceError::Parse { line: 1, .. })
        ));
        let bad = serde_json::to_string(&RequestTrace { end_ms: 1, ..sample() }).unwrap();
        assert!(matches!(
            read_traces(bad.as_bytes(), 10),
            Err(TraceError::Invalid { .. })
        ));
    }

    #[test]
    fn bounded_clips_tool_names() {
        let t = RequestTrace {
            tool_names: vec!["é".repeat(100); 100],
            ..sample()
        }
        .bounded();
        assert_eq!(t.tool_names.len(), MAX_TOOL_NAMES);
        assert!(t.tool_names[0].len() <= MAX_TOOL_NAME_BYTES);
    }
}
