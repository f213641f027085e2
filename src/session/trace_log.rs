//! The daemon's request traces: one JSON line per finished request in the Mooncake trace
//! format (`timestamp` in ms, `input_length`, `output_length`, `hash_ids`), plus
//! `session_id` and `parent_session_id`, so `kvtier replay --trace` reads them back with
//! the sessions as the engines named them. No content: lengths, ids and hashes only.
//!
//! A hash is written as its first 8 bytes as an integer (what vLLM sends for a wide
//! hash), the way the Mooncake traces name blocks. The file is rotated by size: past
//! `max_bytes` it becomes `<path>.1` (the older ones shift up, the oldest past `files`
//! goes), so the traces never take more than `files × max_bytes` of disk.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::page::PageHash;
use crate::tier::private;

/// Why a trace could not be written.
#[derive(Debug, thiserror::Error)]
pub enum TraceLogError {
    #[error("request trace {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("request trace: encoding a line: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("request trace: {0}")]
    Unsafe(#[from] crate::tier::private::PrivateError),
}

/// One line, as written and as `kvtier replay --trace` reads it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceLine {
    /// Milliseconds on the daemon's clock when the request ended.
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
    pub session_id: String,
    #[serde(default)]
    pub parent_session_id: Option<String>,
}

impl TraceLine {
    pub fn hash_id(h: &PageHash) -> u64 {
        h.prefix_u64()
    }
}

/// Where and how much (config keys `request_trace_*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceLogConfig {
    pub path: PathBuf,
    /// Rotate past this many bytes. Default: 64 MiB.
    pub max_bytes: u64,
    /// Files kept, the current one included. Default: 4.
    pub files: usize,
}

/// An open, rotating trace file.
#[derive(Debug)]
pub struct TraceLog {
    cfg: TraceLogConfig,
    file: File,
    written: u64,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TraceLogError + '_ {
    move |source| TraceLogError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl TraceLog {
    /// Opens (appends to) the trace file, creating its directory `0700` when missing.
    /// The traces name sessions and page hashes, so the directory must be one nobody
    /// else can write ([`private::trusted_dir`]) and the file a private one of the
    /// daemon's, opened without following a symlink ([`private::open_append`]).
    pub fn open(cfg: TraceLogConfig) -> Result<Self, TraceLogError> {
        private::trusted_dir(private::parent_of(&cfg.path))?;
        let file = private::open_append(&cfg.path)?;
        let written = file.metadata().map_err(io(&cfg.path))?.len();
        Ok(Self { cfg, file, written })
    }

    /// Appends one line (one write, so a crash never leaves half a line behind another),
    /// rotating first when it would pass `max_bytes`.
    pub fn append(&mut self, line: &TraceLine) -> Result<(), TraceLogError> {
        let mut bytes = serde_json::to_vec(line)?;
        bytes.push(b'\n');
        if self.written > 0 && self.written + bytes.len() as u64 > self.cfg.max_bytes {
            self.rotate()?;
        }
        self.file.write_all(&bytes).map_err(io(&self.cfg.path))?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn rotated(&self, n: usize) -> PathBuf {
        let mut p = self.cfg.path.clone().into_os_string();
        p.push(format!(".{n}"));
        p.into()
    }

    fn rotate(&mut self) -> Result<(), TraceLogError> {
        let keep = self.cfg.files.max(1);
        if keep == 1 {
            self.file.set_len(0).map_err(io(&self.cfg.path))?;
            self.written = 0;
            return Ok(());
        }
        let _ = std::fs::remove_file(self.rotated(keep - 1));
        for n in (1..keep - 1).rev() {
            let _ = std::fs::rename(self.rotated(n), self.rotated(n + 1));
        }
        std::fs::rename(&self.cfg.path, self.rotated(1)).map_err(io(&self.cfg.path))?;
        self.file = private::open_append(&self.cfg.path)?;
        self.written = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(ts: u64) -> TraceLine {
        TraceLine {
            timestamp: ts,
            input_length: 1000,
            output_length: 20,
            hash_ids: vec![1, 2, 3],
            session_id: "s".into(),
            parent_session_id: None,
        }
    }

    #[test]
    fn lines_rotate_by_size_and_keep_a_bounded_number_of_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t/requests.jsonl");
        let one = serde_json::to_vec(&line(0)).unwrap().len() as u64 + 1;
        let mut log = TraceLog::open(TraceLogConfig {
            path: path.clone(),
            max_bytes: one * 2,
            files: 3,
        })
        .unwrap();
        for ts in 0..7 {
            log.append(&line(ts)).unwrap();
        }
        let read = |p: &Path| -> Vec<u64> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str::<TraceLine>(l).unwrap().timestamp)
                .collect()
        };
        assert_eq!(read(&path), vec![6]);
        assert_eq!(read(&log.rotated(1)), vec![4, 5]);
        assert_eq!(read(&log.rotated(2)), vec![2, 3]);
        assert!(!log.rotated(3).exists(), "the oldest file went");
        // The line is the Mooncake shape with the session fields, nothing else.
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut keys: Vec<&String> = v.as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "hash_ids",
                "input_length",
                "output_length",
                "parent_session_id",
                "session_id",
                "timestamp"
            ]
        );
    }

    fn cfg(path: PathBuf) -> TraceLogConfig {
        TraceLogConfig {
            path,
            max_bytes: 1 << 20,
            files: 1,
        }
    }

    #[test]
    fn traces_are_private_and_never_written_through_a_planted_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // A fresh file and the directory made for it are the daemon's alone.
        let path = dir.path().join("new/requests.jsonl");
        TraceLog::open(cfg(path.clone())).unwrap().append(&line(1)).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&path), mode(path.parent().unwrap())), (0o600, 0o700));
        // A link planted at the trace path is refused; what it points at is untouched.
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let planted = dir.path().join("new/planted.jsonl");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        let err = TraceLog::open(cfg(planted)).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        // So is a directory others may write, and a file others may read.
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(TraceLog::open(cfg(open.join("t.jsonl"))).is_err());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = TraceLog::open(cfg(path.clone())).unwrap_err();
        assert!(err.to_string().contains("mode 644"), "{err}");
    }
}
