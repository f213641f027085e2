//! MessagePack for the event formats, through `rmp`. [`Writer`] appends to a reused byte
//! buffer with `rmp::encode` (always the smallest encoding) and cannot fail: it writes
//! through rmp's `ByteBuf`, whose error type is `Infallible`, so no error path exists to
//! unwrap. [`Reader`] reads with `rmp::decode` from a borrowed slice, hands out strings
//! and bytes without copying, and turns malformed input into a typed [`ReadError`]: cut
//! short, a value of the wrong type, a length longer than the input left, bad UTF-8.

use std::convert::Infallible;

use rmp::Marker;
use rmp::decode::bytes::BytesReadError;
use rmp::decode::{self, Bytes, ValueReadError};
use rmp::encode::{self, ByteBuf, ValueWriteError};

/// The value of an rmp write into a `ByteBuf`, which cannot fail.
fn infallible<T>(r: Result<T, ValueWriteError<Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => match e {},
    }
}

/// MessagePack lengths are 32-bit. Event batches are bounded far below that
/// (`max_batch_events`, `max_batch_objects`) and strings are names and keys.
fn len32(n: usize) -> u32 {
    debug_assert!(u32::try_from(n).is_ok(), "a MessagePack length of {n}");
    n as u32
}

/// Appends MessagePack values to a byte buffer. The buffer moves into rmp's `ByteBuf`
/// while the writer lives and back when it is dropped, so its allocation is reused.
pub struct Writer<'a> {
    home: &'a mut Vec<u8>,
    buf: ByteBuf,
}

impl<'a> Writer<'a> {
    pub fn new(home: &'a mut Vec<u8>) -> Self {
        let buf = ByteBuf::from_vec(std::mem::take(home));
        Self { home, buf }
    }

    pub fn array(&mut self, len: usize) {
        infallible(encode::write_array_len(&mut self.buf, len32(len)));
    }

    pub fn map(&mut self, len: usize) {
        infallible(encode::write_map_len(&mut self.buf, len32(len)));
    }

    pub fn nil(&mut self) {
        match encode::write_nil(&mut self.buf) {
            Ok(()) => {}
            Err(e) => match e {},
        }
    }

    pub fn uint(&mut self, v: u64) {
        infallible(encode::write_uint(&mut self.buf, v));
    }

    pub fn f64(&mut self, v: f64) {
        infallible(encode::write_f64(&mut self.buf, v));
    }

    pub fn str(&mut self, s: &str) {
        infallible(encode::write_str(&mut self.buf, s));
    }

    pub fn bin(&mut self, b: &[u8]) {
        infallible(encode::write_bin(&mut self.buf, b));
    }

    /// A string of `bytes` in lowercase hex, written in place (no temporary `String`).
    pub fn hex_str(&mut self, bytes: &[u8]) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        infallible(encode::write_str_len(&mut self.buf, len32(2 * bytes.len())));
        let out = self.buf.as_mut_vec();
        out.reserve(2 * bytes.len());
        for b in bytes {
            out.push(DIGITS[(b >> 4) as usize]);
            out.push(DIGITS[(b & 15) as usize]);
        }
    }
}

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        *self.home = std::mem::take(self.buf.as_mut_vec());
    }
}

/// Why a MessagePack value could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReadError {
    #[error("the input ends inside a value")]
    Truncated,
    #[error("expected {want}, found marker 0x{found:02x}")]
    Type { want: &'static str, found: u8 },
    #[error("{what} of length {len} with only {left} bytes of input left")]
    Oversized { what: &'static str, len: u64, left: usize },
    #[error("a string is not UTF-8")]
    Utf8,
}

/// An rmp read error as a [`ReadError`]: every I/O error on a slice is running out of it.
fn read_err(want: &'static str) -> impl Fn(ValueReadError<BytesReadError>) -> ReadError {
    move |e| match e {
        ValueReadError::InvalidMarkerRead(_) | ValueReadError::InvalidDataRead(_) => ReadError::Truncated,
        ValueReadError::TypeMismatch(m) => ReadError::Type { want, found: m.to_u8() },
    }
}

/// Reads MessagePack values from a byte slice, borrowing strings and bytes.
pub struct Reader<'a> {
    rd: Bytes<'a>,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { rd: Bytes::new(buf) }
    }

    /// Whether every byte was read.
    pub fn at_end(&self) -> bool {
        self.rd.remaining_slice().is_empty()
    }

    /// The next value's marker, not consumed.
    pub fn peek(&self) -> Result<Marker, ReadError> {
        let first = self.rd.remaining_slice().first();
        first.map(|&b| Marker::from_u8(b)).ok_or(ReadError::Truncated)
    }

    /// The next `len` bytes of a value whose header said `len`; the header was read.
    fn take(&mut self, what: &'static str, len: u32) -> Result<&'a [u8], ReadError> {
        let rest = self.rd.remaining_slice();
        let n = len as usize;
        if n > rest.len() {
            return Err(ReadError::Oversized {
                what,
                len: len.into(),
                left: rest.len(),
            });
        }
        let (value, rest) = rest.split_at(n);
        self.rd = Bytes::new(rest);
        Ok(value)
    }

    /// Checks a container's element count against the input left: each element takes at
    /// least `min_bytes`, so a longer claim is malformed and is refused before a caller
    /// loops over (or reserves for) it.
    fn count(&self, what: &'static str, len: u32, min_bytes: usize) -> Result<usize, ReadError> {
        let left = self.rd.remaining_slice().len();
        let n = len as usize;
        if n.saturating_mul(min_bytes) > left {
            return Err(ReadError::Oversized {
                what,
                len: len.into(),
                left,
            });
        }
        Ok(n)
    }

    pub fn array(&mut self) -> Result<usize, ReadError> {
        let len = decode::read_array_len(&mut self.rd).map_err(read_err("an array"))?;
        self.count("an array", len, 1)
    }

    pub fn map(&mut self) -> Result<usize, ReadError> {
        let len = decode::read_map_len(&mut self.rd).map_err(read_err("a map"))?;
        self.count("a map", len, 2)
    }

    /// Consumes a nil if one is next; returns whether it did.
    pub fn nil(&mut self) -> Result<bool, ReadError> {
        if self.peek()? != Marker::Null {
            return Ok(false);
        }
        decode::read_nil(&mut self.rd).map_err(read_err("nil"))?;
        Ok(true)
    }

    /// Whether the next value is an unsigned integer.
    pub fn is_uint(&self) -> Result<bool, ReadError> {
        Ok(matches!(
            self.peek()?,
            Marker::FixPos(_) | Marker::U8 | Marker::U16 | Marker::U32 | Marker::U64
        ))
    }

    pub fn uint(&mut self) -> Result<u64, ReadError> {
        const WANT: &str = "an unsigned integer";
        let marker = self.peek()?;
        let (rd, e) = (&mut self.rd, read_err(WANT));
        match marker {
            Marker::FixPos(_) => decode::read_pfix(rd).map(u64::from).map_err(e),
            Marker::U8 => decode::read_u8(rd).map(u64::from).map_err(e),
            Marker::U16 => decode::read_u16(rd).map(u64::from).map_err(e),
            Marker::U32 => decode::read_u32(rd).map(u64::from).map_err(e),
            Marker::U64 => decode::read_u64(rd).map_err(e),
            m => Err(ReadError::Type {
                want: WANT,
                found: m.to_u8(),
            }),
        }
    }

    /// A float, 64- or 32-bit.
    pub fn f64(&mut self) -> Result<f64, ReadError> {
        const WANT: &str = "a float";
        match self.peek()? {
            Marker::F32 => decode::read_f32(&mut self.rd).map(f64::from).map_err(read_err(WANT)),
            _ => decode::read_f64(&mut self.rd).map_err(read_err(WANT)),
        }
    }

    pub fn str(&mut self) -> Result<&'a str, ReadError> {
        let len = decode::read_str_len(&mut self.rd).map_err(read_err("a string"))?;
        std::str::from_utf8(self.take("a string", len)?).map_err(|_| ReadError::Utf8)
    }

    pub fn bin(&mut self) -> Result<&'a [u8], ReadError> {
        let len = decode::read_bin_len(&mut self.rd).map_err(read_err("bytes"))?;
        self.take("bytes", len)
    }
}

#[cfg(test)]
pub(crate) mod tests;
