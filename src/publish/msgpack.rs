//! A minimal MessagePack writer and reader for the event formats' hot paths. The writer
//! appends to a `Vec<u8>`, always picks the smallest encoding and cannot fail; the reader
//! borrows from the input and never allocates. Only the types the event formats use.

/// Appends MessagePack values to a byte buffer.
pub struct Writer<'a>(pub &'a mut Vec<u8>);

impl Writer<'_> {
    pub fn array(&mut self, len: usize) {
        self.len_header(len, 0x90, 0xdc, 0xdd);
    }

    pub fn map(&mut self, len: usize) {
        self.len_header(len, 0x80, 0xde, 0xdf);
    }

    fn len_header(&mut self, len: usize, fix: u8, m16: u8, m32: u8) {
        if len < 16 {
            self.0.push(fix | len as u8);
        } else if len <= u16::MAX as usize {
            self.0.push(m16);
            self.0.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.0.push(m32);
            self.0.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }

    pub fn nil(&mut self) {
        self.0.push(0xc0);
    }

    pub fn uint(&mut self, v: u64) {
        if v < 128 {
            self.0.push(v as u8);
        } else if v <= u8::MAX as u64 {
            self.0.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u16::MAX as u64 {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u32::MAX as u64 {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    pub fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    pub fn str(&mut self, s: &str) {
        let n = s.len();
        if n < 32 {
            self.0.push(0xa0 | n as u8);
        } else if n <= u8::MAX as usize {
            self.0.extend_from_slice(&[0xd9, n as u8]);
        } else if n <= u16::MAX as usize {
            self.0.push(0xda);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(0xdb);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    pub fn bin(&mut self, b: &[u8]) {
        let n = b.len();
        if n <= u8::MAX as usize {
            self.0.extend_from_slice(&[0xc4, n as u8]);
        } else if n <= u16::MAX as usize {
            self.0.push(0xc5);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(0xc6);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self.0.extend_from_slice(b);
    }
}

/// Why a MessagePack value could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReadError {
    #[error("the input ends inside a value")]
    Truncated,
    #[error("expected {want}, found marker 0x{found:02x}")]
    Type { want: &'static str, found: u8 },
    #[error("a string is not UTF-8")]
    Utf8,
}

/// Reads MessagePack values from a byte slice, borrowing strings and bytes.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Whether every byte was read.
    pub fn at_end(&self) -> bool {
        self.pos == self.buf.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ReadError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(ReadError::Truncated)?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, ReadError> {
        Ok(self.take(n)?.iter().fold(0u64, |a, &b| a << 8 | b as u64))
    }

    /// The next marker byte, not consumed.
    pub fn peek(&self) -> Result<u8, ReadError> {
        self.buf.get(self.pos).copied().ok_or(ReadError::Truncated)
    }

    fn marker(&mut self) -> Result<u8, ReadError> {
        let m = self.peek()?;
        self.pos += 1;
        Ok(m)
    }

    fn len_header(&mut self, want: &'static str, fix: u8, m16: u8, m32: u8) -> Result<usize, ReadError> {
        let m = self.marker()?;
        match m {
            _ if m & 0xf0 == fix => Ok((m & 0x0f) as usize),
            _ if m == m16 => Ok(self.be(2)? as usize),
            _ if m == m32 => Ok(self.be(4)? as usize),
            _ => Err(ReadError::Type { want, found: m }),
        }
    }

    pub fn array(&mut self) -> Result<usize, ReadError> {
        self.len_header("an array", 0x90, 0xdc, 0xdd)
    }

    pub fn map(&mut self) -> Result<usize, ReadError> {
        self.len_header("a map", 0x80, 0xde, 0xdf)
    }

    /// Consumes a nil if one is next; returns whether it did.
    pub fn nil(&mut self) -> Result<bool, ReadError> {
        let is = self.peek()? == 0xc0;
        self.pos += usize::from(is);
        Ok(is)
    }

    pub fn is_uint(&self) -> Result<bool, ReadError> {
        Ok(matches!(self.peek()?, 0x00..=0x7f | 0xcc..=0xcf))
    }

    pub fn uint(&mut self) -> Result<u64, ReadError> {
        let m = self.marker()?;
        match m {
            0x00..=0x7f => Ok(m as u64),
            0xcc => self.be(1),
            0xcd => self.be(2),
            0xce => self.be(4),
            0xcf => self.be(8),
            _ => Err(ReadError::Type {
                want: "an unsigned integer",
                found: m,
            }),
        }
    }

    pub fn f64(&mut self) -> Result<f64, ReadError> {
        let m = self.marker()?;
        match m {
            0xcb => Ok(f64::from_bits(self.be(8)?)),
            0xca => Ok(f32::from_bits(self.be(4)? as u32) as f64),
            _ => Err(ReadError::Type {
                want: "a float",
                found: m,
            }),
        }
    }

    pub fn str(&mut self) -> Result<&'a str, ReadError> {
        let m = self.marker()?;
        let n = match m {
            0xa0..=0xbf => (m & 0x1f) as usize,
            0xd9 => self.be(1)? as usize,
            0xda => self.be(2)? as usize,
            0xdb => self.be(4)? as usize,
            _ => {
                return Err(ReadError::Type {
                    want: "a string",
                    found: m,
                });
            }
        };
        std::str::from_utf8(self.take(n)?).map_err(|_| ReadError::Utf8)
    }

    pub fn bin(&mut self) -> Result<&'a [u8], ReadError> {
        let m = self.marker()?;
        let n = match m {
            0xc4 => self.be(1)? as usize,
            0xc5 => self.be(2)? as usize,
            0xc6 => self.be(4)? as usize,
            _ => {
                return Err(ReadError::Type {
                    want: "bytes",
                    found: m,
                });
            }
        };
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_a_reference_decoder() {
        let mut buf = Vec::new();
        let mut w = Writer(&mut buf);
        w.array(6);
        w.uint(u64::MAX);
        w.uint(300);
        w.str(&"x".repeat(40));
        w.bin(&[1, 2, 3]);
        w.f64(1.5);
        w.map(1);
        w.str("k");
        w.nil();
        let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
        let a = v.as_array().unwrap();
        assert_eq!(a[0].as_u64(), Some(u64::MAX));
        assert_eq!(a[1].as_u64(), Some(300));
        assert_eq!(a[2].as_str().unwrap().len(), 40);
        assert_eq!(a[3].as_slice(), Some(&[1u8, 2, 3][..]));
        assert_eq!(a[4].as_f64(), Some(1.5));
        assert!(a[5].as_map().unwrap()[0].1.is_nil());

        let mut r = Reader::new(&buf);
        assert_eq!(r.array(), Ok(6));
        assert_eq!(r.uint(), Ok(u64::MAX));
        assert_eq!(r.uint(), Ok(300));
        assert_eq!(r.str().map(str::len), Ok(40));
        assert_eq!(r.bin(), Ok(&[1u8, 2, 3][..]));
        assert_eq!(r.f64(), Ok(1.5));
        assert_eq!(r.map(), Ok(1));
        assert_eq!(r.str(), Ok("k"));
        assert_eq!(r.nil(), Ok(true));
        assert!(r.at_end());
        assert_eq!(Reader::new(&[0xcd, 1]).uint(), Err(ReadError::Truncated));
    }
}
