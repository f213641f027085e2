//! One live connection to the daemon: the socket, the mapped arena, request framing.
//!
//! Any transport failure drops the connection; the next call reconnects, replays the
//! handshake (`Connect`, then `RegisterDevice` when a device is registered) and remaps
//! the arena. Connecting to a socket nobody serves fails at once (`ECONNREFUSED` or
//! `ENOENT`), so a dead daemon is reported in well under 100 ms.

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use crate::protocol::{ArenaInfo, FrameError, Request, Response, frame, read_frame};
use crate::tier::host::{ArenaOptions, HostArena};

use super::ClientError;

pub(super) struct Conn {
    raw: RawConn,
    pub arena: Arc<HostArena>,
    pub arena_info: ArenaInfo,
    pub objects: Vec<u16>,
    pub connection: u64,
}

fn unavailable(e: impl std::fmt::Display) -> ClientError {
    ClientError::Unavailable(e.to_string())
}

impl Conn {
    /// Opens the socket and performs the handshake.
    pub fn open(
        socket: &std::path::Path,
        timeout: Duration,
        max_frame: usize,
        hello: Request,
        device: Option<Request>,
    ) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(socket).map_err(unavailable)?;
        stream.set_read_timeout(Some(timeout)).map_err(unavailable)?;
        stream.set_write_timeout(Some(timeout)).map_err(unavailable)?;
        let reader = BufReader::with_capacity(64 << 10, stream.try_clone().map_err(unavailable)?);
        let mut raw = RawConn {
            stream,
            reader,
            out: Vec::with_capacity(4096),
            body: Vec::new(),
            next_id: 1,
        };
        let (connection, arena_info, objects) = match raw.call(&hello, max_frame)? {
            Response::Connected {
                connection,
                arena,
                objects,
            } => (connection, arena, objects),
            Response::Error(e) => return Err(ClientError::Remote(e)),
            other => {
                return Err(ClientError::Protocol(format!(
                    "unexpected answer to Connect: {other:?}"
                )));
            }
        };
        if let Some(dev) = device {
            match raw.call(&dev, max_frame)? {
                Response::Ok => {}
                Response::Error(e) => return Err(ClientError::Remote(e)),
                other => return Err(ClientError::Protocol(format!("unexpected answer: {other:?}"))),
            }
        }
        let opts = ArenaOptions {
            lock: false,
            prefault: false,
            touch_threads: 1,
            group: None,
        };
        let arena = HostArena::open(std::path::Path::new(&arena_info.path), arena_info.slot_bytes, &opts)?;
        Ok(Self {
            raw,
            arena: Arc::new(arena),
            arena_info,
            objects,
            connection,
        })
    }

    /// One request, one response. Any error here leaves the connection unusable.
    pub fn call(&mut self, req: &Request, max_frame: usize) -> Result<Response, ClientError> {
        self.raw.call(req, max_frame)
    }
}

struct RawConn {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    out: Vec<u8>,
    body: Vec<u8>,
    next_id: u64,
}

impl RawConn {
    fn call(&mut self, req: &Request, max_frame: usize) -> Result<Response, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        self.out.clear();
        req.encode(id, &mut self.out);
        frame::write_all(&mut self.stream, &self.out).map_err(map_frame)?;
        loop {
            let h = read_frame(&mut self.reader, max_frame, &mut self.body).map_err(map_frame)?;
            let resp = Response::decode(h.kind, &self.body)
                .map_err(|e| ClientError::Protocol(format!("bad response: {e}")))?;
            // Id 0 is an unsolicited notice (e.g. shutting down); anything else must match.
            if h.request_id == id {
                return Ok(resp);
            }
            if h.request_id == 0
                && let Response::Error(e) = resp
            {
                return Err(ClientError::Unavailable(e.to_string()));
            }
        }
    }
}

fn map_frame(e: FrameError) -> ClientError {
    match e {
        FrameError::Timeout => ClientError::Timeout,
        FrameError::TooLarge { .. } | FrameError::BadMagic(_) | FrameError::Version(_) => {
            ClientError::Protocol(e.to_string())
        }
        other => ClientError::Unavailable(other.to_string()),
    }
}
