//! Page identity: opaque page hashes, the namespace that scopes them, and object keys.
//!
//! A page hash is what the engine says it is (a u64 block hash, a SHA-256 chain hash, …):
//! 8 to 32 bytes, compared byte for byte, rendered as lowercase hex. Pages of different
//! models, LoRA adapters or salts never meet because every hash lives in a [`Namespace`].
//! Object keys follow SGLang HiCache's Mooncake scheme so pages interoperate on a pool.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::layout::{AttentionKind, Layout, ObjectId, Part};

pub const MIN_HASH_BYTES: usize = 8;
pub const MAX_HASH_BYTES: usize = 32;

/// Why a hash or key was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PageError {
    #[error("a page hash has {0} bytes; it must have {MIN_HASH_BYTES} to {MAX_HASH_BYTES}")]
    HashLength(usize),
    #[error("a page hash in hex must be an even number of hex digits (0-9, a-f); {0:?} {1}")]
    BadHex(String, &'static str),
    #[error("object key {0:?} does not follow the HiCache scheme for this layout")]
    BadKey(String),
}

/// An opaque page hash of 8 to 32 bytes, stored inline.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageHash {
    len: u8,
    bytes: [u8; MAX_HASH_BYTES],
}

impl PageHash {
    pub fn new(bytes: &[u8]) -> Result<Self, PageError> {
        if !(MIN_HASH_BYTES..=MAX_HASH_BYTES).contains(&bytes.len()) {
            return Err(PageError::HashLength(bytes.len()));
        }
        let mut out = [0u8; MAX_HASH_BYTES];
        out[..bytes.len()].copy_from_slice(bytes);
        Ok(Self {
            len: bytes.len() as u8,
            bytes: out,
        })
    }

    /// An 8-byte hash from a u64 block id (big-endian), as the Mooncake traces use.
    pub fn from_u64(v: u64) -> Self {
        let mut bytes = [0u8; MAX_HASH_BYTES];
        bytes[..8].copy_from_slice(&v.to_be_bytes());
        Self { len: 8, bytes }
    }

    pub fn from_hex(s: &str) -> Result<Self, PageError> {
        let shown = || s.chars().take(80).collect();
        if let Some(c) = s.chars().find(|c| !c.is_ascii_hexdigit()) {
            let why = if c.is_ascii_graphic() {
                "has a character that is not a hex digit"
            } else {
                "has a space, control or non-ASCII character"
            };
            return Err(PageError::BadHex(shown(), why));
        }
        if !s.len().is_multiple_of(2) {
            return Err(PageError::BadHex(shown(), "has an odd number of digits"));
        }
        // Every character is a hex digit and the length is even: every pair converts.
        let buf: Vec<u8> = s
            .as_bytes()
            .chunks(2)
            .filter_map(|p| Some(hex_val(p[0])? << 4 | hex_val(*p.get(1)?)?))
            .collect();
        Self::new(&buf)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lowercase hex, as used in object keys and events.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(self.len() * 2);
        self.write_hex(&mut s);
        s
    }

    /// Appends the lowercase hex to `out` (no allocation when `out` has room).
    pub fn write_hex(&self, out: &mut String) {
        for b in self.as_bytes() {
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 15) as usize] as char);
        }
    }

    /// The first 8 bytes as a u64 (big-endian): the integer block hash vLLM events carry.
    pub fn prefix_u64(&self) -> u64 {
        u64::from_be_bytes(self.bytes[..8].try_into().expect("8 bytes"))
    }

    /// A well-mixed 64-bit hash of the page hash within a namespace, for hash tables.
    pub fn table_hash(&self, ns: NamespaceId) -> u64 {
        xxhash_rust::xxh3::xxh3_64_with_seed(self.as_bytes(), ns.0 as u64)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl fmt::Debug for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageHash({})", self.to_hex())
    }
}

impl fmt::Display for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for PageHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for PageHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PageHash::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

/// What scopes page hashes: the same hash under two namespaces is two different pages.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Namespace {
    pub model: String,
    #[serde(default)]
    pub lora: String,
    #[serde(default)]
    pub salt: String,
}

impl Namespace {
    pub fn model(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            ..Self::default()
        }
    }
}

/// A namespace interned by the directory: a small integer stored per page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NamespaceId(pub u16);

/// Renders object keys in SGLang HiCache's Mooncake scheme:
/// `[{tag}_{model}_]{hash_hex}_{tp}[_{pp}]_{k|v}` for MHA, and
/// `[{tag}_{model}_]{hash_hex}_[{pp}]_k` for MLA (one latent per PP stage; with PP=1 the
/// stage suffix is empty, which leaves HiCache's double underscore).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyScheme {
    /// Optional `{tag}_{model}_` prefix shared by every key.
    pub prefix: String,
}

impl KeyScheme {
    pub fn with_prefix(tag: &str, model: &str) -> Self {
        Self {
            prefix: format!("{tag}_{model}_"),
        }
    }

    pub fn object_key(&self, layout: &Layout, hash: &PageHash, id: ObjectId) -> String {
        let mut key = String::with_capacity(self.prefix.len() + hash.len() * 2 + 12);
        self.write_object_key(&mut key, layout, hash, id);
        key
    }

    /// Bytes to reserve per key when rendering many into one buffer: the prefix, the
    /// longest hash in hex, and room for the ranks and the part.
    pub fn key_capacity(&self) -> usize {
        self.prefix.len() + MAX_HASH_BYTES * 2 + 16
    }

    /// Appends [`Self::object_key`] to `out`: the move paths render a batch's keys into one
    /// buffer rather than allocate a `String` per object.
    pub fn write_object_key(&self, out: &mut String, layout: &Layout, hash: &PageHash, id: ObjectId) {
        out.push_str(&self.prefix);
        hash.write_hex(out);
        Self::push_suffix(out, layout, id);
    }

    /// Appends one object's key, the page hash already in hex. Pushes instead of
    /// `format!`: a lookup that asks a shared store about 64 TP=2 pages renders 256 keys,
    /// and formatting them (with the hex redone per key) cost a tenth of the query.
    fn push_key(&self, key: &mut String, layout: &Layout, hex: &str, id: ObjectId) {
        key.push_str(&self.prefix);
        key.push_str(hex);
        Self::push_suffix(key, layout, id);
    }

    /// What follows the page hash in an object's key: ranks and the K/V part.
    fn push_suffix(key: &mut String, layout: &Layout, id: ObjectId) {
        let num = |key: &mut String, n: u16| {
            let mut buf = [0u8; 5];
            let mut i = buf.len();
            let mut n = n;
            loop {
                i -= 1;
                buf[i] = b'0' + (n % 10) as u8;
                n /= 10;
                if n == 0 {
                    break;
                }
            }
            // Digits only: always ASCII.
            key.extend(buf[i..].iter().map(|&b| b as char));
        };
        key.push('_');
        match layout.attention() {
            AttentionKind::Mha => {
                num(key, id.tp_rank);
                key.push('_');
                if layout.pp_size() > 1 {
                    num(key, id.pp_rank);
                    key.push('_');
                }
                key.push_str(id.part.key_suffix());
            }
            AttentionKind::Mla => {
                if layout.pp_size() > 1 {
                    num(key, id.pp_rank);
                }
                key.push_str("_k");
            }
        }
    }

    /// Every object key of a page, in the layout's canonical object order.
    pub fn page_keys(&self, layout: &Layout, hash: &PageHash) -> Vec<String> {
        let hex = hash.to_hex();
        layout
            .objects()
            .iter()
            .map(|&id| {
                let mut key = String::with_capacity(self.prefix.len() + hex.len() + 12);
                self.push_key(&mut key, layout, &hex, id);
                key
            })
            .collect()
    }

    /// Every object key of a page appended to `buf`, one after another, each one's end
    /// offset pushed on `ends`: many pages' keys in one allocation, for a batched query.
    pub fn push_page_keys(&self, layout: &Layout, hash: &PageHash, buf: &mut String, ends: &mut Vec<usize>) {
        let hex = hash.to_hex();
        for &id in layout.objects() {
            self.push_key(buf, layout, &hex, id);
            ends.push(buf.len());
        }
    }

    /// Parses a key written in this scheme back into its page hash and object index.
    pub fn parse(&self, layout: &Layout, key: &str) -> Result<(PageHash, usize), PageError> {
        let bad = || PageError::BadKey(key.chars().take(120).collect());
        let rest = key.strip_prefix(self.prefix.as_str()).ok_or_else(bad)?;
        let mut fields = rest.split('_');
        let hex = fields.next().ok_or_else(bad)?;
        let hash = PageHash::from_hex(hex).map_err(|_| bad())?;
        let tail: Vec<&str> = fields.collect();
        let num = |s: &str| s.parse::<u16>().map_err(|_| bad());
        let id = match (layout.attention(), layout.pp_size() > 1, tail.as_slice()) {
            (AttentionKind::Mha, false, [tp, part]) => ObjectId {
                tp_rank: num(tp)?,
                pp_rank: 0,
                part: parse_part(part).ok_or_else(bad)?,
            },
            (AttentionKind::Mha, true, [tp, pp, part]) => ObjectId {
                tp_rank: num(tp)?,
                pp_rank: num(pp)?,
                part: parse_part(part).ok_or_else(bad)?,
            },
            (AttentionKind::Mla, false, ["", "k"]) => ObjectId {
                tp_rank: 0,
                pp_rank: 0,
                part: Part::Latent,
            },
            (AttentionKind::Mla, true, [pp, "k"]) => ObjectId {
                tp_rank: 0,
                pp_rank: num(pp)?,
                part: Part::Latent,
            },
            _ => return Err(bad()),
        };
        let index = layout.object_index(id).ok_or_else(bad)?;
        Ok((hash, index))
    }
}

fn parse_part(s: &str) -> Option<Part> {
    match s {
        "k" => Some(Part::K),
        "v" => Some(Part::V),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutSpec;

    #[test]
    fn hash_length_bounds_are_typed_errors() {
        assert_eq!(PageHash::new(&[1; 7]), Err(PageError::HashLength(7)));
        assert_eq!(PageHash::new(&[1; 33]), Err(PageError::HashLength(33)));
        assert_eq!(PageHash::new(&[0xab; 8]).unwrap().to_hex(), "abababababababab");
        assert_eq!(PageHash::new(&[7; 32]).unwrap().len(), 32);
        let why = |s: &str| match PageHash::from_hex(s) {
            Err(PageError::BadHex(shown, why)) => {
                assert_eq!(shown, s);
                why
            }
            other => panic!("{s:?}: {other:?}"),
        };
        assert_eq!(why("abc"), "has an odd number of digits");
        // Not "odd": an even count of characters that are not all hex digits says so.
        assert_eq!(why("zz00000000000000"), "has a character that is not a hex digit");
        assert_eq!(why("00112233 4455667"), "has a space, control or non-ASCII character");
        assert_eq!(why("0011223344556é"), "has a space, control or non-ASCII character");
        assert!(
            PageError::BadHex("zz".into(), "has a character that is not a hex digit")
                .to_string()
                .ends_with("\"zz\" has a character that is not a hex digit")
        );
        assert_eq!(
            PageHash::from_hex("00112233445566FF").unwrap(),
            PageHash::from_hex("00112233445566ff").unwrap()
        );
        let h = PageHash::from_hex("00112233445566778899").unwrap();
        assert_eq!(h.as_bytes(), &[0, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99]);
        assert_eq!(PageHash::from_u64(0x0102030405060708).prefix_u64(), 0x0102030405060708);
    }

    #[test]
    fn hicache_keys_round_trip() {
        let h = PageHash::from_u64(0xdead_beef);
        let s = KeyScheme::default();
        let tp2 = LayoutSpec::mha(4, 4, 64, 2, 16).with_parallel(2, 1).build().unwrap();
        assert_eq!(
            s.page_keys(&tp2, &h),
            vec![
                "00000000deadbeef_0_k",
                "00000000deadbeef_0_v",
                "00000000deadbeef_1_k",
                "00000000deadbeef_1_v"
            ]
        );
        let pp2 = LayoutSpec::mha(4, 4, 64, 2, 16).with_parallel(2, 2).build().unwrap();
        assert_eq!(s.page_keys(&pp2, &h)[7], "00000000deadbeef_1_1_v");
        let tp16 = LayoutSpec::mha(4, 16, 64, 2, 16).with_parallel(16, 1).build().unwrap();
        let keys = s.page_keys(&tp16, &h);
        assert_eq!(
            (keys[0].as_str(), keys[25].as_str()),
            ("00000000deadbeef_0_k", "00000000deadbeef_12_v")
        );
        assert_eq!(s.object_key(&tp16, &h, tp16.objects()[25]), keys[25]);
        let mla = LayoutSpec::mla(4, 512, 2, 16).with_parallel(4, 1).build().unwrap();
        assert_eq!(s.page_keys(&mla, &h), vec!["00000000deadbeef__k"]);
        let mla2 = LayoutSpec::mla(4, 512, 2, 16).with_parallel(4, 2).build().unwrap();
        assert_eq!(
            s.page_keys(&mla2, &h),
            vec!["00000000deadbeef_0_k", "00000000deadbeef_1_k"]
        );
        let tagged = KeyScheme::with_prefix("kv", "qwen");
        for layout in [&tp2, &pp2, &mla, &mla2] {
            for scheme in [&s, &tagged] {
                for (i, key) in scheme.page_keys(layout, &h).iter().enumerate() {
                    assert_eq!(scheme.parse(layout, key).unwrap(), (h, i), "{key}");
                }
            }
        }
        assert!(s.parse(&tp2, "00000000deadbeef_2_k").is_err());
        assert!(s.parse(&tp2, "00000000deadbeef_0_x").is_err());
        assert!(tagged.parse(&tp2, "00000000deadbeef_0_k").is_err());
    }
}
