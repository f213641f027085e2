//! Frame codec: a control request encoded into one frame, then the frame read back
//! (header checks and body) and the request decoded. Two sides, as a round trip has them:
//! the client's blocking path (`Request::encode`, `read_frame`) and the daemon's
//! tokio-util `FrameCodec` over `BytesMut`. Two requests: a lookup of 16 page hashes (the
//! common one) and a hint.
//!
//! Each iteration checks that the decoded request equals the one encoded.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier::PageHash;
use kvtier::hints::{Hint, HintTarget};
use kvtier::protocol::frame::DEFAULT_MAX_BODY;
use kvtier::protocol::{FrameCodec, Outgoing, Request, read_frame};
use tokio_util::bytes::BytesMut;
use tokio_util::codec::{Decoder, Encoder};

fn bench(c: &mut Criterion) {
    let hashes: Vec<PageHash> = (0..16u64).map(|i| PageHash::from_u64(0xbe7c_0000 + i)).collect();
    let requests = [
        ("lookup_16_hashes", Request::Lookup { hashes: hashes.clone() }),
        (
            "retain_hint_16_pages",
            Request::Hint(Hint::Retain {
                target: HintTarget::Pages(hashes),
                priority: 1,
                ttl_ms: 60_000,
            }),
        ),
    ];
    let mut g = c.benchmark_group("frame_codec");
    g.throughput(Throughput::Elements(1));
    for (name, req) in requests {
        let (mut out, mut body) = (Vec::with_capacity(4096), Vec::with_capacity(4096));
        g.bench_function(format!("client/{name}"), |b| {
            b.iter(|| {
                out.clear();
                black_box(&req).encode(7, &mut out);
                let mut r: &[u8] = &out;
                let h = read_frame(&mut r, DEFAULT_MAX_BODY, &mut body).expect("a whole frame");
                assert_eq!(h.request_id, 7);
                let back = Request::decode(h.kind, &body).expect("decodes");
                assert!(back == req, "round trip changed the request");
                back
            })
        });
        let mut codec = FrameCodec::new(DEFAULT_MAX_BODY);
        let mut buf = BytesMut::with_capacity(4096);
        g.bench_function(format!("daemon_codec/{name}"), |b| {
            b.iter(|| {
                codec
                    .encode(Outgoing::Request(7, black_box(&req)), &mut buf)
                    .expect("encodes");
                let f = codec.decode(&mut buf).expect("a valid frame").expect("a whole frame");
                assert_eq!(f.header.request_id, 7);
                let back = Request::decode(f.header.kind, &f.body).expect("decodes");
                assert!(back == req, "round trip changed the request");
                back
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
