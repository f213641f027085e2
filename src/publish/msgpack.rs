//! A minimal MessagePack writer for the publishers' hot path: appends to a `Vec<u8>`,
//! always picks the smallest encoding, cannot fail. Only the types the event formats use.

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
    }
}
