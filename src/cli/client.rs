//! A minimal HTTP/1.1 client over the admin Unix socket, for the CLI.
//!
//! It sends one request with `Connection: close` and reads the answer: a body with a
//! `Content-Length`, a chunked stream (the events endpoint), or everything to the end.
//! Connection failures are kept apart from answers so the CLI can exit with the
//! "daemon unreachable" code.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The largest chunk the client accepts (the server sends far smaller ones).
const MAX_CHUNK: usize = 64 << 20;

/// What went wrong talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the daemon is unreachable at {path}: {source}")]
    Unreachable {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The socket is served by a process of another uid than the daemon's: not ours to
    /// talk to (it would see every command and could answer anything).
    #[error(
        "the process serving {path} runs as uid {found}, not the daemon's uid {expected} \
         (set KVTIER_DAEMON_UID when the daemon runs as another user)"
    )]
    Untrusted { path: String, expected: u32, found: u32 },
    #[error("talking to the daemon: {0}")]
    Io(#[from] std::io::Error),
    #[error("the daemon's answer is malformed: {0}")]
    Protocol(String),
}

/// An answer's status and the reader positioned at its body.
pub struct Response {
    pub status: u16,
    chunked: bool,
    length: Option<usize>,
    reader: BufReader<UnixStream>,
}

/// The uid the daemon must run as: `KVTIER_DAEMON_UID` where set (as engines are told),
/// else this process's effective uid.
fn daemon_uid() -> Result<u32, ClientError> {
    match std::env::var("KVTIER_DAEMON_UID") {
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| ClientError::Protocol(format!("KVTIER_DAEMON_UID={v:?} is not a uid"))),
        Err(_) => Ok(crate::tier::private::euid()),
    }
}

/// Sends a request and reads the status line and headers of the answer, after checking
/// that the socket's peer runs as the daemon's uid ([`daemon_uid`]).
pub fn request(
    socket: &Path,
    method: &str,
    target: &str,
    body: Option<&[u8]>,
    timeout: Option<Duration>,
) -> Result<Response, ClientError> {
    let unreachable = |source| ClientError::Unreachable {
        path: socket.display().to_string(),
        source,
    };
    let mut s = UnixStream::connect(socket).map_err(unreachable)?;
    let expected = daemon_uid()?;
    let found = crate::paths::peer_uid(&s).map_err(unreachable)?;
    if found != expected {
        return Err(ClientError::Untrusted {
            path: socket.display().to_string(),
            expected,
            found,
        });
    }
    s.set_read_timeout(timeout)?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {target} HTTP/1.1\r\nHost: kvtier\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| ClientError::Protocol(format!("status line {:?}", line.trim_end())))?;
    let (mut chunked, mut length) = (false, None);
    for _ in 0..100 {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            let v = v.trim();
            if k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked") {
                chunked = true;
            } else if k.eq_ignore_ascii_case("content-length") {
                length = v.parse().ok();
            }
        }
    }
    Ok(Response {
        status,
        chunked,
        length,
        reader,
    })
}

impl Response {
    /// Reads the whole body.
    pub fn body(mut self) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        if self.chunked {
            while let Some(c) = self.next_chunk()? {
                out.extend_from_slice(&c);
            }
        } else if let Some(n) = self.length {
            out.resize(n, 0);
            self.reader.read_exact(&mut out)?;
        } else {
            self.reader.read_to_end(&mut out)?;
        }
        Ok(out)
    }

    /// The next chunk of a chunked body, `None` at its end.
    pub fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, ClientError> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        let size = usize::from_str_radix(line.trim(), 16)
            .map_err(|_| ClientError::Protocol(format!("chunk size {:?}", line.trim())))?;
        if size == 0 {
            return Ok(None);
        }
        if size > MAX_CHUNK {
            return Err(ClientError::Protocol(format!("a chunk of {size} bytes")));
        }
        let mut buf = vec![0; size + 2];
        self.reader.read_exact(&mut buf)?;
        buf.truncate(size);
        Ok(Some(buf))
    }
}
