//! The control frame as a `tokio-util` codec over `bytes`, for the daemon's async side.
//!
//! [`FrameCodec`] decodes the same 16-byte header as the blocking [`read_frame`] (both go
//! through [`Header::decode`], so magic, version and the body cap are checked by one
//! piece of code) and yields the body as a [`BytesMut`] split off the read buffer, without
//! a copy. An oversized body is refused from its header alone: nothing is reserved for
//! it. The client library inside engines stays on blocking std I/O and keeps using
//! [`read_frame`] and [`encode_frame`](super::frame::encode_frame).
//!
//! The codec also notes when the frame it is waiting for began to arrive
//! ([`FrameCodec::partial_since`]), so a server can give a frame body its own deadline,
//! independent of how long the connection idles between frames.
//!
//! [`read_frame`]: super::frame::read_frame

use std::time::Instant;

use bytes::{Buf, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use super::frame::{FrameError, HEADER_BYTES, Header};
use super::message::{Request, Response};

/// One decoded frame: its header and its body.
#[derive(Debug, PartialEq, Eq)]
pub struct Frame {
    pub header: Header,
    pub body: BytesMut,
}

/// A message to encode and the request id it answers (0: an unsolicited notice).
pub enum Outgoing<'a> {
    Request(u64, &'a Request),
    Response(u64, &'a Response),
}

/// Length-prefixed control frames with a body cap.
#[derive(Debug)]
pub struct FrameCodec {
    max_body: usize,
    /// The message encoders write into a `Vec`; reused so encoding allocates nothing
    /// once it has grown to the largest message.
    scratch: Vec<u8>,
    /// When the bytes of the frame not yet whole were first seen; `None` at a frame
    /// boundary with nothing buffered.
    partial: Option<Instant>,
}

impl FrameCodec {
    /// A codec refusing bodies over `max_body` bytes.
    pub fn new(max_body: usize) -> Self {
        Self {
            max_body,
            scratch: Vec::new(),
            partial: None,
        }
    }

    /// Since when part of a frame has been buffered without the rest, as seen by the
    /// last `decode`: the start of a frame body (or header) that is still arriving.
    /// `None` while the connection sits at a frame boundary.
    pub fn partial_since(&self) -> Option<Instant> {
        self.partial
    }

    /// Notes that `decode` is waiting for more bytes of a frame in `src`.
    fn waiting(&mut self, src: &BytesMut) {
        if src.is_empty() {
            self.partial = None;
        } else if self.partial.is_none() {
            self.partial = Some(Instant::now());
        }
    }

    /// Whether `buf` starts with a whole frame (or with a header that will not decode,
    /// which `decode` answers at once). A server answers the requests it has before it
    /// waits for more bytes, so that a pipelining client gets its answers in one write.
    pub fn frame_ready(&self, buf: &[u8]) -> bool {
        let Some(h) = buf.first_chunk::<HEADER_BYTES>() else {
            return false;
        };
        match Header::decode(h, self.max_body) {
            Ok(h) => buf.len() >= HEADER_BYTES + h.body_len as usize,
            Err(_) => true,
        }
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let Some(h) = src.first_chunk::<HEADER_BYTES>() else {
            src.reserve(HEADER_BYTES);
            self.waiting(src);
            return Ok(None);
        };
        let header = Header::decode(h, self.max_body)?;
        let total = HEADER_BYTES + header.body_len as usize;
        if src.len() < total {
            // Within the cap (checked above), so this reservation is bounded.
            src.reserve(total - src.len());
            self.waiting(src);
            return Ok(None);
        }
        src.advance(HEADER_BYTES);
        let body = src.split_to(header.body_len as usize);
        // The next frame, if some of it is buffered already, is timed from the next call.
        self.partial = None;
        Ok(Some(Frame { header, body }))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        match self.decode(src)? {
            Some(f) => Ok(Some(f)),
            None if src.is_empty() => Ok(None),
            // The peer left in the middle of a frame.
            None => Err(FrameError::Truncated),
        }
    }
}

impl Encoder<Outgoing<'_>> for FrameCodec {
    type Error = FrameError;

    fn encode(&mut self, item: Outgoing<'_>, dst: &mut BytesMut) -> Result<(), FrameError> {
        self.scratch.clear();
        match item {
            Outgoing::Request(id, r) => r.encode(id, &mut self.scratch),
            Outgoing::Response(id, r) => r.encode(id, &mut self.scratch),
        }
        dst.extend_from_slice(&self.scratch);
        Ok(())
    }
}

impl From<std::io::Error> for FrameError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => FrameError::Timeout,
            _ => FrameError::Io(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::frame::{DEFAULT_MAX_BODY, read_frame};
    use crate::protocol::kind;

    fn ping(id: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        Request::Ping {
            payload: payload.to_vec(),
        }
        .encode(id, &mut out);
        out
    }

    #[test]
    fn frames_split_anywhere_decode_to_the_same_bytes_as_the_blocking_reader() {
        let mut wire = ping(7, b"first");
        wire.extend_from_slice(&ping(8, &[0xab; 300]));
        for cut in 0..wire.len() {
            let mut codec = FrameCodec::new(1024);
            let mut buf = BytesMut::from(&wire[..cut]);
            let mut got = Vec::new();
            while let Some(f) = codec.decode(&mut buf).unwrap() {
                got.push(f);
            }
            buf.extend_from_slice(&wire[cut..]);
            assert!(codec.frame_ready(&buf) || buf.is_empty());
            while let Some(f) = codec.decode(&mut buf).unwrap() {
                got.push(f);
            }
            assert!(buf.is_empty() && !codec.frame_ready(&buf));
            assert_eq!(got.len(), 2, "cut at {cut}");
            let mut r: &[u8] = &wire;
            let mut body = Vec::new();
            for f in &got {
                let h = read_frame(&mut r, 1024, &mut body).unwrap();
                assert_eq!((f.header, &f.body[..]), (h, &body[..]));
                assert_eq!(f.header.kind, kind::PING);
            }
            assert_eq!(got[1].header.request_id, 8);
            assert_eq!(
                Request::decode(got[1].header.kind, &got[1].body).unwrap(),
                Request::Ping {
                    payload: vec![0xab; 300]
                }
            );
        }
    }

    #[test]
    fn malformed_and_oversized_headers_are_typed_errors_without_allocation() {
        let mut codec = FrameCodec::new(64);
        let mut big = BytesMut::from(&ping(1, &[0u8; 65])[..HEADER_BYTES]);
        let cap = big.capacity();
        assert!(codec.frame_ready(&big), "a refused header is answered at once");
        assert!(matches!(
            codec.decode(&mut big),
            Err(FrameError::TooLarge { len, max: 64 }) if len > 64
        ));
        assert_eq!(big.capacity(), cap, "nothing reserved for a refused body");
        let mut bad = BytesMut::from(&ping(1, b"x")[..]);
        bad[0] ^= 0xff;
        assert!(matches!(codec.decode(&mut bad), Err(FrameError::BadMagic(_))));
        let mut v = BytesMut::from(&ping(1, b"x")[..]);
        v[2] = 9;
        assert!(matches!(codec.decode(&mut v), Err(FrameError::Version(9))));
        let mut half = BytesMut::from(&ping(1, b"xyz")[..18]);
        assert!(matches!(codec.decode_eof(&mut half), Err(FrameError::Truncated)));
        assert!(matches!(codec.decode_eof(&mut BytesMut::new()), Ok(None)));
    }

    #[test]
    fn a_partial_frame_is_timed_from_its_first_bytes_and_cleared_at_a_boundary() {
        let wire = ping(5, &[7u8; 40]);
        let mut codec = FrameCodec::new(1024);
        let mut buf = BytesMut::new();
        assert!(codec.decode(&mut buf).unwrap().is_none());
        assert_eq!(codec.partial_since(), None, "nothing buffered: at a boundary");
        buf.extend_from_slice(&wire[..10]);
        assert!(codec.decode(&mut buf).unwrap().is_none());
        let first = codec.partial_since().expect("a header in progress is timed");
        buf.extend_from_slice(&wire[10..30]);
        assert!(codec.decode(&mut buf).unwrap().is_none());
        assert_eq!(
            codec.partial_since(),
            Some(first),
            "more bytes do not restart the clock"
        );
        buf.extend_from_slice(&wire[30..]);
        buf.extend_from_slice(&wire[..3]);
        assert_eq!(codec.decode(&mut buf).unwrap().unwrap().header.request_id, 5);
        assert_eq!(codec.partial_since(), None, "a whole frame ends the wait");
        assert!(codec.decode(&mut buf).unwrap().is_none());
        assert!(
            codec.partial_since().is_some(),
            "the next frame's first bytes start a new clock"
        );
    }

    #[test]
    fn encoding_writes_the_bytes_the_blocking_encoder_writes() {
        let mut codec = FrameCodec::new(DEFAULT_MAX_BODY);
        let resp = Response::Pong { payload: vec![1, 2, 3] };
        let mut dst = BytesMut::new();
        codec.encode(Outgoing::Response(42, &resp), &mut dst).unwrap();
        let req = Request::Ping { payload: vec![9] };
        codec.encode(Outgoing::Request(43, &req), &mut dst).unwrap();
        let mut want = Vec::new();
        resp.encode(42, &mut want);
        req.encode(43, &mut want);
        assert_eq!(&dst[..], &want[..]);
        let f = codec.decode(&mut dst).unwrap().unwrap();
        assert_eq!(Response::decode(f.header.kind, &f.body).unwrap(), resp);
        let f = codec.decode(&mut dst).unwrap().unwrap();
        assert_eq!(
            (f.header.request_id, Request::decode(f.header.kind, &f.body).unwrap()),
            (43, req)
        );
    }
}
