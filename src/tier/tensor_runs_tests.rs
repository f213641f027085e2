//! Pages cut into runs: vLLM's `LHBNC` and `BHLNC` layouts, where one block of one layer
//! is one run per head. Where each byte lands is computed here from vLLM's strides, not
//! from [`PageMap`], and the runs of a page read in order are the bytes the same block
//! has in `LBHNC` (heads inside blocks).

use super::*;
use crate::layout::LayoutSpec;
use crate::tier::device::{DeviceRegion, EmulatedDevice, ObjectCopy, pattern};

// 2 layers, 4 heads, head_dim 8, 2 bytes, 4 tokens: a packed block of one layer is 4 head
// runs of 4 tokens x (K 8 + V 8 dims) x 2 bytes = 128 bytes; an object layer (the "K" or
// "V" half, `run`) is 2 of them.
const L: u64 = 2;
const H: u64 = 4;
const B: u64 = 6;
const HEAD: u64 = 128;
const OFF: u64 = 64;

/// Where (layer, head, block)'s run starts in the buffer, by vLLM's strides.
type At = Box<dyn Fn(u64, u64, u64) -> u64>;

fn layout() -> Layout {
    LayoutSpec::mha(L as u32, H as u32, 8, 2, 4).build().unwrap()
}

/// `LHBNC`: per layer `[heads, blocks, tokens, K+V]`; the halves are heads 0..2 and 2..4.
fn lhbnc() -> (KvTensors, At) {
    let layer = |l: u64| OFF + l * H * B * HEAD;
    let k = (0..L).map(layer);
    let v = (0..L).map(|l| layer(l) + H / 2 * B * HEAD);
    let t = KvTensors::new(k.chain(v).collect(), HEAD, B as u32).with_runs(2, B * HEAD);
    (t, Box::new(move |l, h, b| layer(l) + h * B * HEAD + b * HEAD))
}

/// `BHLNC` (cross-layer): `[blocks, heads, layers, tokens, K+V]`.
fn bhlnc() -> (KvTensors, At) {
    let at = |l: u64, h: u64, b: u64| OFF + b * H * L * HEAD + h * L * HEAD + l * HEAD;
    let k = (0..L).map(|l| at(l, 0, 0));
    let v = (0..L).map(|l| at(l, H / 2, 0));
    let t = KvTensors::new(k.chain(v).collect(), H * L * HEAD, B as u32).with_runs(2, L * HEAD);
    (t, Box::new(at))
}

fn objects(seed: u64) -> [Vec<u8>; 2] {
    [
        pattern(seed, (L * 2 * HEAD) as usize),
        pattern(seed + 1, (L * 2 * HEAD) as usize),
    ]
}

#[test]
fn head_runs_land_at_vllm_strides_and_read_back_as_packed_blocks() {
    let len = (OFF + L * H * B * HEAD) as usize;
    // LBHNC, heads inside blocks: per layer [blocks, heads, tokens, K+V], one run a block.
    let lb = |l: u64, b: u64| OFF + l * B * H * HEAD + b * H * HEAD;
    let lbhnc = KvTensors::new(
        (0..L)
            .map(|l| lb(l, 0))
            .chain((0..L).map(|l| lb(l, 0) + H / 2 * HEAD))
            .collect(),
        H * HEAD,
        B as u32,
    );
    let packed = EmulatedDevice::with_tensors(&layout(), 0, &lbhnc, len).unwrap();
    let [k, v] = objects(7);
    let load = [ObjectCopy::new(3, Part::K, &k[..]), ObjectCopy::new(3, Part::V, &v[..])];
    packed.copy_from_host(&load).unwrap();
    for (name, (t, at)) in [("LHBNC", lhbnc()), ("BHLNC", bhlnc())] {
        let t: KvTensors = t;
        let map = PageMap::wrap(&layout(), 0, &t).unwrap();
        assert_eq!((map.runs(), map.piece()), (2, HEAD as usize), "{name}");
        assert_eq!(
            map.end(),
            len as u64,
            "{name}: the last head run of the last block ends the buffer"
        );
        let dev = EmulatedDevice::with_tensors(&layout(), 0, &t, len).unwrap();
        assert!(
            matches!(
                EmulatedDevice::with_tensors(&layout(), 0, &t, len - 1),
                Err(crate::tier::device::DeviceError::Tensors(
                    TensorError::OutOfBuffer { .. }
                ))
            ),
            "{name}"
        );
        dev.copy_from_host(&load).unwrap();
        let mut written = 0;
        for l in 0..L {
            // Block 3 of layer l, head by head, is the LBHNC block's bytes in order.
            let mut block = Vec::new();
            for h in 0..H {
                let run = dev.read_raw(at(l, h, 3) as usize, HEAD as usize).unwrap();
                let (obj, i) = if h < H / 2 { (&k, h) } else { (&v, h - H / 2) };
                let want = &obj[(l * 2 * HEAD + i * HEAD) as usize..][..HEAD as usize];
                assert_eq!(run, want, "{name}: layer {l} head {h}");
                block.extend(run);
                written += HEAD;
            }
            let lb_block = packed.read_raw(lb(l, 3) as usize, (H * HEAD) as usize).unwrap();
            assert_eq!(
                block, lb_block,
                "{name}: layer {l}: head runs in order = the LBHNC block"
            );
        }
        // Nothing else was written.
        let all = dev.read_raw(0, len).unwrap();
        assert_eq!(
            all.iter().filter(|&&b| b != 0).count(),
            pattern_nonzero(&k, &v),
            "{name}"
        );
        assert_eq!(written, 2 * L * 2 * HEAD);
        // And the page reads back whole, and layer by layer as the kernel stand-in sees it.
        let (mut k2, mut v2) = (vec![0u8; k.len()], vec![0u8; v.len()]);
        dev.copy_to_host(&mut [
            ObjectCopy::new(3, Part::K, &mut k2[..]),
            ObjectCopy::new(3, Part::V, &mut v2[..]),
        ])
        .unwrap();
        assert_eq!((k2, v2), (k.clone(), v.clone()), "{name}");
        assert_eq!(
            dev.read_layer(3, Part::V, 1).unwrap(),
            &v[(2 * HEAD) as usize..],
            "{name}"
        );
    }
}

fn pattern_nonzero(k: &[u8], v: &[u8]) -> usize {
    k.iter().chain(v).filter(|&&b| b != 0).count()
}

#[test]
fn bad_runs_are_typed_errors() {
    let (t, _) = lhbnc();
    let wrap = |t: &KvTensors| PageMap::wrap(&layout(), 0, t);
    // 256 bytes a layer do not cut into 3 equal runs; 0 runs is no page at all.
    assert_eq!(
        wrap(&t.clone().with_runs(3, B * HEAD)).unwrap_err(),
        TensorError::Runs { runs: 3, run: 256 }
    );
    assert_eq!(
        wrap(&t.clone().with_runs(0, 0)).unwrap_err(),
        TensorError::Runs { runs: 0, run: 256 }
    );
    assert_eq!(
        wrap(&t.clone().with_runs(MAX_RUNS * 2, 1)).unwrap_err(),
        TensorError::Runs {
            runs: MAX_RUNS * 2,
            run: 256
        }
    );
    // A run stride shorter than a run; a page stride shorter than a run.
    assert_eq!(
        wrap(&t.clone().with_runs(2, HEAD - 1)).unwrap_err(),
        TensorError::RunStride {
            stride: HEAD - 1,
            run: HEAD
        }
    );
    let short = KvTensors {
        page_stride: HEAD - 1,
        ..t.clone()
    };
    assert_eq!(
        wrap(&short).unwrap_err(),
        TensorError::Stride {
            stride: HEAD - 1,
            run: HEAD
        }
    );
    // Head 1's run starting inside head 0's last block.
    assert_eq!(
        wrap(&t.clone().with_runs(2, (B - 1) * HEAD)).unwrap_err(),
        TensorError::RunsOverlap {
            page_stride: HEAD,
            run_stride: (B - 1) * HEAD
        }
    );
    // V's first head is K's second head (layer 0's tensors 0 and 2).
    let mut same = t.clone();
    same.bases[2] = same.bases[0] + B * HEAD;
    assert_eq!(wrap(&same).unwrap_err(), TensorError::Overlap { a: 0, b: 2 });
    // ... or a few bytes into K's second head's last block.
    same.bases[2] = same.bases[0] + B * HEAD + (B - 1) * HEAD + 100;
    assert_eq!(wrap(&same).unwrap_err(), TensorError::Overlap { a: 0, b: 2 });
    // Exactly after K's last run it fits (what LHBNC is).
    same.bases[2] = same.bases[0] + 2 * B * HEAD;
    wrap(&same).unwrap();
    // Past the end of the address space.
    let mut far = t.clone();
    far.bases[3] = u64::MAX - B * HEAD;
    assert_eq!(wrap(&far).unwrap_err(), TensorError::Overflow { index: 3 });
    // A page-first layout's pages interleave layers per token: no runs.
    let pf = LayoutSpec::mha(L as u32, H as u32, 8, 2, 4)
        .with_byte_order(ByteOrder::PageFirst)
        .build()
        .unwrap();
    assert_eq!(PageMap::wrap(&pf, 0, &t).unwrap_err(), TensorError::RunsPageFirst);
    // One run ignores the run stride: the old addressing.
    let one = KvTensors::new(t.bases.clone(), 2 * HEAD, 3).with_runs(1, 0);
    assert_eq!(wrap(&one).unwrap().runs(), 1);
}
