//! Event encoding: the vLLM publisher's MessagePack encoding of one batch of 1,024 page
//! events (three `BlockStored` to one `BlockRemoved`, 8-byte hashes sent as integers and
//! 32-byte hashes sent as bytes), in the positional (vLLM ≤ 0.23) and named (≥ 0.24) shapes.
//!
//! Before timing, each shape is decoded once with the project's own vLLM decoder and the
//! event count and kinds are checked, so the bench measures an encoding that is right.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier::events::{PageEvent, PageEventKind};
use kvtier::publish::vllm::{Encoding, VllmConfig, decode_batch, encode_batch};
use kvtier::{NamespaceId, PageHash, TierKind};

const EVENTS: usize = 1024;

fn events(hash_bytes: usize) -> Vec<PageEvent> {
    (0..EVENTS as u64)
        .map(|i| {
            let mut b = [0u8; 32];
            b[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
            PageEvent {
                seq: i + 1,
                kind: if i % 4 == 3 {
                    PageEventKind::Removed
                } else {
                    PageEventKind::Stored
                },
                tier: [TierKind::Device, TierKind::Host, TierKind::Pool][(i % 3) as usize],
                ns: NamespaceId(0),
                hash: PageHash::new(&b[..hash_bytes]).expect("8 or 32 bytes"),
                at_ms: 1_700_000_000_000 + i,
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("event_encoding");
    g.throughput(Throughput::Elements(EVENTS as u64));
    for (name, encoding, hash_bytes) in [
        ("positional_u64_hashes", Encoding::Positional, 8),
        ("tagged_u64_hashes", Encoding::Tagged, 8),
        ("positional_32b_hashes", Encoding::Positional, 32),
    ] {
        let cfg = VllmConfig {
            encoding,
            ..VllmConfig::default()
        };
        let evs = events(hash_bytes);
        let mut buf = Vec::with_capacity(64 << 10);
        encode_batch(&mut buf, &cfg, 1.5, &evs, |_| 16);
        let batch = decode_batch(&buf).expect("the encoder's own output decodes");
        assert_eq!(batch.events.len(), EVENTS);
        let removed = batch.events.iter().filter(|e| e.kind == PageEventKind::Removed).count();
        assert_eq!(removed, EVENTS / 4);
        g.bench_function(name, |b| {
            b.iter(|| {
                buf.clear();
                encode_batch(&mut buf, &cfg, 1.5, black_box(&evs), |_| 16);
                buf.len()
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
