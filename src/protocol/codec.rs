//! The primitive byte codec every message is built from.
//!
//! Little-endian integers, booleans as one byte, strings and byte strings prefixed with a
//! `u16` or `u32` length, arrays prefixed with a `u32` count. Every variable-length field
//! has a cap that the decoder checks *before* it allocates, so a hostile length can never
//! make the daemon reserve memory it was not going to use. A C encoder only needs these
//! eight rules to speak the protocol.

use crate::page::{MAX_HASH_BYTES, MIN_HASH_BYTES, PageHash};

/// Why a frame body could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("body ends at byte {at}; {need} more bytes were expected")]
    Truncated { at: usize, need: usize },
    #[error("{what} has length {len}, more than the maximum {max}")]
    TooLong { what: &'static str, len: usize, max: usize },
    #[error("{what} is not valid UTF-8")]
    BadUtf8 { what: &'static str },
    #[error("{what} has unknown tag {tag}")]
    BadTag { what: &'static str, tag: u8 },
    #[error("{0} bytes left over after the message")]
    Trailing(usize),
    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },
}

/// Appends encoded fields to a buffer.
pub struct Writer<'a> {
    buf: &'a mut Vec<u8>,
}

impl<'a> Writer<'a> {
    pub fn new(buf: &'a mut Vec<u8>) -> Self {
        Self { buf }
    }

    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }

    pub fn i8(&mut self, v: i8) {
        self.buf.push(v as u8);
    }

    pub fn bool(&mut self, v: bool) {
        self.buf.push(u8::from(v));
    }

    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// A `u32` count; callers keep collections within the decoder's caps.
    pub fn count(&mut self, n: usize) {
        self.u32(n.min(u32::MAX as usize) as u32);
    }

    /// A string with a `u16` byte length (truncated at a char boundary beyond 65535 bytes).
    pub fn str(&mut self, s: &str) {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.buf.extend_from_slice(&s.as_bytes()[..end]);
    }

    /// Bytes with a `u32` length.
    pub fn bytes(&mut self, b: &[u8]) {
        self.count(b.len());
        self.buf.extend_from_slice(b);
    }

    /// A page hash: one length byte (8..=32), then the bytes.
    pub fn hash(&mut self, h: &PageHash) {
        self.u8(h.len() as u8);
        self.buf.extend_from_slice(h.as_bytes());
    }

    pub fn hashes(&mut self, hs: &[PageHash]) {
        self.count(hs.len());
        for h in hs {
            self.hash(h);
        }
    }
}

/// Reads fields from a body, checking bounds and caps.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(DecodeError::Truncated {
                at: self.pos,
                need: n - left,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    pub fn i8(&mut self) -> Result<i8, DecodeError> {
        Ok(self.u8()? as i8)
    }

    pub fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            tag => Err(DecodeError::BadTag { what: "bool", tag }),
        }
    }

    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A `u32` count, refused above `max` before anything is allocated. Each element takes
    /// at least `min_elem` bytes, so a count the body cannot hold is refused too.
    pub fn count(&mut self, what: &'static str, max: usize, min_elem: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(DecodeError::TooLong { what, len: n, max });
        }
        let left = self.buf.len() - self.pos;
        if n.saturating_mul(min_elem) > left {
            return Err(DecodeError::Truncated {
                at: self.pos,
                need: n * min_elem - left,
            });
        }
        Ok(n)
    }

    pub fn str(&mut self, what: &'static str, max: usize) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(DecodeError::TooLong { what, len: n, max });
        }
        let b = self.take(n)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| DecodeError::BadUtf8 { what })
    }

    pub fn bytes(&mut self, what: &'static str, max: usize) -> Result<&'a [u8], DecodeError> {
        let n = self.count(what, max, 1)?;
        self.take(n)
    }

    pub fn hash(&mut self) -> Result<PageHash, DecodeError> {
        let n = self.u8()? as usize;
        if !(MIN_HASH_BYTES..=MAX_HASH_BYTES).contains(&n) {
            return Err(DecodeError::Invalid {
                what: "page hash",
                why: format!("{n} bytes; must be {MIN_HASH_BYTES} to {MAX_HASH_BYTES}"),
            });
        }
        PageHash::new(self.take(n)?).map_err(|e| DecodeError::Invalid {
            what: "page hash",
            why: e.to_string(),
        })
    }

    pub fn hashes(&mut self, max: usize) -> Result<Vec<PageHash>, DecodeError> {
        let n = self.count("hashes", max, 1 + MIN_HASH_BYTES)?;
        (0..n).map(|_| self.hash()).collect()
    }

    /// Ends decoding: every byte of the body must have been used.
    pub fn finish(self) -> Result<(), DecodeError> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primitives_round_trip_and_caps_hold() {
        let mut buf = Vec::new();
        let mut w = Writer::new(&mut buf);
        w.u8(7);
        w.i8(-3);
        w.bool(true);
        w.u16(0xbeef);
        w.u32(0xdead_beef);
        w.u64(u64::MAX - 1);
        w.str("héllo");
        w.bytes(b"abc");
        w.hashes(&[PageHash::from_u64(9)]);
        let mut r = Reader::new(&buf);
        assert_eq!(r.u8().unwrap(), 7);
        assert_eq!(r.i8().unwrap(), -3);
        assert!(r.bool().unwrap());
        assert_eq!(r.u16().unwrap(), 0xbeef);
        assert_eq!(r.u32().unwrap(), 0xdead_beef);
        assert_eq!(r.u64().unwrap(), u64::MAX - 1);
        assert_eq!(r.str("s", 16).unwrap(), "héllo");
        assert_eq!(r.bytes("b", 16).unwrap(), b"abc");
        assert_eq!(r.hashes(4).unwrap(), vec![PageHash::from_u64(9)]);
        r.finish().unwrap();

        // A count far beyond what the body holds is refused without allocating.
        let huge = 1_000_000u32.to_le_bytes();
        assert!(matches!(
            Reader::new(&huge).hashes(10),
            Err(DecodeError::TooLong { len: 1_000_000, .. })
        ));
        assert!(matches!(
            Reader::new(&huge).hashes(usize::MAX),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(Reader::new(&[2]).bool(), Err(DecodeError::BadTag { .. })));
        assert!(matches!(Reader::new(&[7, 0]).hash(), Err(DecodeError::Invalid { .. })));
        assert_eq!(Reader::new(&[1]).finish(), Err(DecodeError::Trailing(1)));
    }
}
