//! The rmp-backed writer against rmpv (a reference decoder), and the reader on
//! well-formed and malformed input.

use super::*;

/// Unsigned integers at each MessagePack width boundary (the golden batches use them too).
pub(crate) const UINTS: [u64; 10] = [
    0,
    127,
    128,
    255,
    256,
    65_535,
    65_536,
    u32::MAX as u64,
    u32::MAX as u64 + 1,
    u64::MAX,
];

fn ty<T>(want: &'static str, found: u8) -> Result<T, ReadError> {
    Err(ReadError::Type { want, found })
}

fn over<T>(what: &'static str, len: u64, left: usize) -> Result<T, ReadError> {
    Err(ReadError::Oversized { what, len, left })
}

fn sample() -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = Writer::new(&mut buf);
    w.array(7);
    w.uint(u64::MAX);
    w.uint(300);
    w.str(&"x".repeat(40));
    w.bin(&[1, 2, 3]);
    w.f64(1.5);
    w.map(1);
    w.str("k");
    w.nil();
    w.array(0);
    drop(w);
    buf
}

#[test]
fn round_trips_through_a_reference_decoder() {
    let buf = sample();
    let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
    let a = v.as_array().unwrap();
    assert_eq!(a[0].as_u64(), Some(u64::MAX));
    assert_eq!(a[1].as_u64(), Some(300));
    assert_eq!(a[2].as_str().unwrap().len(), 40);
    assert_eq!(a[3].as_slice(), Some(&[1u8, 2, 3][..]));
    assert_eq!(a[4].as_f64(), Some(1.5));
    assert!(a[5].as_map().unwrap()[0].1.is_nil());
    assert!(a[6].as_array().unwrap().is_empty());

    let mut r = Reader::new(&buf);
    assert_eq!(r.array(), Ok(7));
    assert_eq!(r.uint(), Ok(u64::MAX));
    assert_eq!(r.uint(), Ok(300));
    assert_eq!(r.str().map(str::len), Ok(40));
    assert_eq!(r.bin(), Ok(&[1u8, 2, 3][..]));
    assert_eq!(r.f64(), Ok(1.5));
    assert_eq!(r.map(), Ok(1));
    assert_eq!(r.str(), Ok("k"));
    assert_eq!(r.nil(), Ok(true));
    assert_eq!(r.array(), Ok(0));
    assert!(r.at_end());
}

#[test]
fn integers_and_lengths_take_the_smallest_encoding() {
    let mut buf = Vec::new();
    for v in UINTS {
        buf.clear();
        Writer::new(&mut buf).uint(v);
        let want = match v {
            0..=127 => 1,
            128..=255 => 2,
            256..=65_535 => 3,
            65_536..=0xffff_ffff => 5,
            _ => 9,
        };
        assert_eq!(buf.len(), want, "{v}");
        assert_eq!(Reader::new(&buf).uint(), Ok(v));
        assert_eq!(rmpv::decode::read_value(&mut buf.as_slice()).unwrap().as_u64(), Some(v));
    }
    // fixstr below 32 bytes, str8 up to 255, str16 above; bin8 from 0 bytes.
    for (n, header) in [(31usize, 1usize), (32, 2), (255, 2), (256, 3), (65_536, 5)] {
        buf.clear();
        Writer::new(&mut buf).str(&"s".repeat(n));
        assert_eq!(buf.len(), n + header, "str of {n}");
        assert_eq!(Reader::new(&buf).str().map(str::len), Ok(n));
        buf.clear();
        Writer::new(&mut buf).bin(&vec![7u8; n]);
        let bin_header = if n < 256 {
            2
        } else if n < 65_536 {
            3
        } else {
            5
        };
        assert_eq!(buf.len(), n + bin_header, "bin of {n}");
    }
    for (n, header) in [(15usize, 1usize), (16, 3), (65_535, 3), (65_536, 5)] {
        buf.clear();
        Writer::new(&mut buf).array(n);
        assert_eq!(buf.len(), header, "array of {n}");
        buf.clear();
        Writer::new(&mut buf).map(n);
        assert_eq!(buf.len(), header, "map of {n}");
    }
}

#[test]
fn hex_strings_match_page_hash_hex() {
    let h = crate::page::PageHash::new(&(0..32u8).map(|i| i.wrapping_mul(37)).collect::<Vec<_>>()).unwrap();
    let mut buf = Vec::new();
    Writer::new(&mut buf).hex_str(h.as_bytes());
    assert_eq!(Reader::new(&buf).str(), Ok(h.to_hex().as_str()));
    assert_eq!(&buf[..2], &[0xd9, 64], "a 64-character str8");
}

#[test]
fn the_writer_appends_into_the_callers_allocation() {
    let mut buf = Vec::with_capacity(4096);
    buf.extend_from_slice(b"hdr");
    let at = buf.as_ptr();
    for _ in 0..100 {
        let mut w = Writer::new(&mut buf);
        w.array(2);
        w.uint(1 << 40);
        w.str("CPU_PINNED");
    }
    assert_eq!(buf.as_ptr(), at, "no reallocation below the capacity");
    assert_eq!(&buf[..3], b"hdr");
    assert_eq!(buf.len(), 3 + 100 * (1 + 9 + 11));
}

#[test]
fn every_cut_of_the_input_is_an_error_not_a_panic() {
    let buf = sample();
    let read_all = |b: &[u8]| -> Result<(), ReadError> {
        let mut r = Reader::new(b);
        r.array()?;
        r.uint()?;
        r.uint()?;
        r.str()?;
        r.bin()?;
        r.f64()?;
        r.map()?;
        r.str()?;
        assert!(r.nil()?, "nil");
        r.array()?;
        Ok(())
    };
    assert_eq!(read_all(&buf), Ok(()));
    for cut in 0..buf.len() {
        let e = read_all(&buf[..cut]).unwrap_err();
        assert!(
            matches!(e, ReadError::Truncated | ReadError::Oversized { .. }),
            "cut at {cut}: {e}"
        );
    }
    // Cut inside a fixed-width value or a header: the input ends inside it.
    assert_eq!(Reader::new(&[0xcd, 1]).uint(), Err(ReadError::Truncated));
    assert_eq!(Reader::new(&[0xcb, 0, 0]).f64(), Err(ReadError::Truncated));
    assert_eq!(Reader::new(&[0xda, 0]).str(), Err(ReadError::Truncated));
    assert_eq!(Reader::new(&[]).array(), Err(ReadError::Truncated));
    assert_eq!(Reader::new(&[]).nil(), Err(ReadError::Truncated));
}

#[test]
fn a_value_of_the_wrong_type_names_what_was_wanted() {
    assert_eq!(Reader::new(&[0xa1, b'x']).uint(), ty("an unsigned integer", 0xa1));
    // Negative integers are not unsigned ones, whatever their width.
    assert_eq!(Reader::new(&[0xff]).uint(), ty("an unsigned integer", 0xff));
    assert_eq!(Reader::new(&[0xd0, 1]).uint(), ty("an unsigned integer", 0xd0));
    assert_eq!(Reader::new(&[0x81, 0xc0, 0xc0]).array(), ty("an array", 0x81));
    assert_eq!(Reader::new(&[0x91, 0xc0]).map(), ty("a map", 0x91));
    assert_eq!(Reader::new(&[0xc4, 1, b'x']).str(), ty("a string", 0xc4));
    assert_eq!(Reader::new(&[0xa1, b'x']).bin(), ty("bytes", 0xa1));
    assert_eq!(Reader::new(&[0x05]).f64(), ty("a float", 0x05));
    assert_eq!(Reader::new(&[0xa2, 0xff, 0xfe]).str(), Err(ReadError::Utf8));
    // A float32 is a float too.
    let mut f32_buf = vec![0xca];
    f32_buf.extend_from_slice(&2.5f32.to_be_bytes());
    assert_eq!(Reader::new(&f32_buf).f64(), Ok(2.5));
    // `nil` and `is_uint` look without consuming.
    let mut r = Reader::new(&[0x07]);
    assert_eq!((r.nil(), r.is_uint()), (Ok(false), Ok(true)));
    assert_eq!(r.uint(), Ok(7));
}

#[test]
fn lengths_longer_than_the_input_are_refused_before_use() {
    // 2^32 - 1 array elements claimed, none there: refused at the header, so a caller
    // never loops over or reserves for them.
    assert_eq!(
        Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).array(),
        over("an array", u32::MAX as u64, 0)
    );
    // Three map entries need at least six bytes; five are left.
    assert_eq!(Reader::new(&[0x83, 1, 1, 2, 2, 3]).map(), over("a map", 3, 5));
    assert_eq!(
        Reader::new(&[0xdb, 0x7f, 0xff, 0xff, 0xff, b'a']).str(),
        over("a string", 0x7fff_ffff, 1)
    );
    assert_eq!(Reader::new(&[0xc6, 0, 1, 0, 0, 1, 2]).bin(), over("bytes", 65_536, 2));
    // Exactly enough is fine.
    assert_eq!(Reader::new(&[0x82, 1, 1, 2, 2]).map(), Ok(2));
    assert_eq!(Reader::new(&[0xc4, 2, 9, 8]).bin(), Ok(&[9u8, 8][..]));
}
