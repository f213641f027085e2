//! The `mac` row of `kvtier bench pool --backend mooncake` with integrity on: the pool
//! objects' MAC ([`Integrity::tag`], what a sealed put computes per object) over the same
//! objects the put and get rows move, on one core, beside a memcpy of the same bytes on
//! the same core. Rounds alternate which goes first; figures are medians.

use super::{PageAligned, Row, Shape, timed};
use crate::pool::mooncake::integrity::Integrity;

/// The row for objects `src` (each `shape.object_bytes` long).
pub(super) fn row(shape: &Shape, src: &[&[u8]]) -> anyhow::Result<Row> {
    let mut key = [0u8; 32];
    std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut key)?;
    let mac = Integrity::new(&key);
    let keys: Vec<String> = (0..src.len()).map(|i| format!("kvb-mac-{i}")).collect();
    let mut dst = PageAligned::new(src.len() * shape.object_bytes, 0);
    let (mut m, mut c) = (Vec::new(), Vec::new());
    let mut sink = 0u8;
    for round in 0..=shape.rounds {
        let mut hash = || {
            timed(|| {
                for (k, s) in keys.iter().zip(src) {
                    sink ^= mac.tag(k, s)[31];
                }
            })
        };
        let mut copy = || {
            timed(|| {
                for (d, s) in dst.chunks_mut(shape.object_bytes).zip(src) {
                    d.copy_from_slice(s);
                }
            })
        };
        let (tm, tc) = if round % 2 == 0 {
            let tc = copy();
            (hash(), tc)
        } else {
            (hash(), copy())
        };
        // Round 0 warms both up (first touch of the destination) and is not counted.
        if round > 0 {
            m.push(tm);
            c.push(tc);
        }
    }
    std::hint::black_box((sink, &dst[..1]));
    let mut r = shape.row("mac", m, c);
    r.reference = match mac.engine() {
        "vpclmulqdq" => "memcpy, one core (POLYVAL on VPCLMULQDQ)",
        "vpclmulqdq-avx2" => "memcpy, one core (POLYVAL on 256-bit VPCLMULQDQ)",
        "pclmulqdq" => "memcpy, one core (POLYVAL on PCLMULQDQ)",
        _ => "memcpy, one core (POLYVAL portable)",
    };
    Ok(r)
}
