//! Frames: a fixed 16-byte header and a body of at most a configured size.
//!
//! ```text
//! offset  size  field
//! 0       2     magic 0x4B54 ("KT", little-endian)
//! 2       1     protocol version (1)
//! 3       1     message kind (see `message::Kind`)
//! 4       4     body length in bytes
//! 8       8     request id (the response echoes it)
//! 16      n     body
//! ```
//!
//! The body length is checked against the maximum *before* the body is read, so an
//! oversized frame costs 16 bytes of reading and a typed error, never an allocation.

use std::io::{self, Read, Write};

pub const MAGIC: u16 = 0x4B54;
pub const VERSION: u8 = 1;
pub const HEADER_BYTES: usize = 16;
/// Default and hard ceiling of a frame body: 4 MiB.
pub const DEFAULT_MAX_BODY: usize = 4 << 20;

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: u8,
    pub body_len: u32,
    pub request_id: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0..2].copy_from_slice(&MAGIC.to_le_bytes());
        h[2] = VERSION;
        h[3] = self.kind;
        h[4..8].copy_from_slice(&self.body_len.to_le_bytes());
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h
    }

    /// Parses a header and checks magic, version and the body cap.
    pub fn decode(h: &[u8; HEADER_BYTES], max_body: usize) -> Result<Self, FrameError> {
        let magic = u16::from_le_bytes([h[0], h[1]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if h[2] != VERSION {
            return Err(FrameError::Version(h[2]));
        }
        let body_len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        if body_len as usize > max_body {
            return Err(FrameError::TooLarge {
                len: body_len as usize,
                max: max_body,
            });
        }
        Ok(Self {
            kind: h[3],
            body_len,
            request_id: u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]),
        })
    }
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("the peer closed the connection")]
    Closed,
    #[error("the peer closed the connection in the middle of a frame")]
    Truncated,
    #[error("bad frame magic {0:#06x}")]
    BadMagic(u16),
    #[error("unsupported protocol version {0} (this side speaks {VERSION})")]
    Version(u8),
    #[error("frame body of {len} bytes exceeds the maximum {max}")]
    TooLarge { len: usize, max: usize },
    #[error("timed out")]
    Timeout,
    #[error(transparent)]
    Io(io::Error),
}

impl FrameError {
    /// Whether the stream can no longer be trusted to be at a frame boundary.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, FrameError::Timeout)
    }
}

fn io_err(e: io::Error) -> FrameError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => FrameError::Timeout,
        io::ErrorKind::UnexpectedEof => FrameError::Truncated,
        _ => FrameError::Io(e),
    }
}

/// Reads one frame into `body` (reused between calls). A clean end of stream before the
/// first header byte is [`FrameError::Closed`].
pub fn read_frame(r: &mut impl Read, max_body: usize, body: &mut Vec<u8>) -> Result<Header, FrameError> {
    let mut h = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Truncated),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // A timeout with half a header read leaves the stream mid-frame: fatal.
            Err(e) if got > 0 => return Err(FrameError::Io(e)),
            Err(e) => return Err(io_err(e)),
        }
    }
    let header = Header::decode(&h, max_body)?;
    body.clear();
    body.resize(header.body_len as usize, 0);
    r.read_exact(body).map_err(|e| match io_err(e) {
        FrameError::Timeout => FrameError::Truncated,
        other => other,
    })?;
    Ok(header)
}

/// Appends a whole frame (header and body) to `out`, so it can go out in one write.
pub fn encode_frame(out: &mut Vec<u8>, kind: u8, request_id: u64, body: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_BYTES]);
    body(out);
    let body_len = (out.len() - start - HEADER_BYTES) as u32;
    let h = Header {
        kind,
        body_len,
        request_id,
    }
    .encode();
    out[start..start + HEADER_BYTES].copy_from_slice(&h);
}

/// Writes bytes already framed by [`encode_frame`].
pub fn write_all(w: &mut impl Write, bytes: &[u8]) -> Result<(), FrameError> {
    w.write_all(bytes).map_err(io_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_body_is_refused_from_the_header_alone() {
        let h = Header {
            kind: 1,
            body_len: 1 << 30,
            request_id: 5,
        }
        .encode();
        // Only the header is available: the reader must not try to read the body.
        let mut r: &[u8] = &h;
        let mut body = Vec::new();
        assert!(matches!(
            read_frame(&mut r, DEFAULT_MAX_BODY, &mut body),
            Err(FrameError::TooLarge { len, .. }) if len == 1 << 30
        ));
        assert!(body.capacity() < 1024);
    }

    #[test]
    fn frames_round_trip_and_bad_headers_are_typed() {
        let mut out = Vec::new();
        encode_frame(&mut out, 9, 77, |b| b.extend_from_slice(b"xyz"));
        let mut r: &[u8] = &out;
        let mut body = Vec::new();
        let h = read_frame(&mut r, 16, &mut body).unwrap();
        assert_eq!((h.kind, h.request_id, body.as_slice()), (9, 77, &b"xyz"[..]));
        assert!(matches!(read_frame(&mut r, 16, &mut body), Err(FrameError::Closed)));
        let mut half: &[u8] = &out[..10];
        assert!(matches!(
            read_frame(&mut half, 16, &mut body),
            Err(FrameError::Truncated)
        ));
        let mut short_body: &[u8] = &out[..17];
        assert!(matches!(
            read_frame(&mut short_body, 16, &mut body),
            Err(FrameError::Truncated)
        ));
        let mut bad = out.clone();
        bad[0] = 0;
        assert!(matches!(
            read_frame(&mut &bad[..], 16, &mut body),
            Err(FrameError::BadMagic(_))
        ));
        bad = out.clone();
        bad[2] = 9;
        assert!(matches!(
            read_frame(&mut &bad[..], 16, &mut body),
            Err(FrameError::Version(9))
        ));
    }
}
