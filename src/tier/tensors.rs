//! Where each page of a rank's device region lives: one base address per (part, layer) of
//! the rank's PP stage and one page stride, which is the shape engines' own KV tensors
//! have.
//!
//! vLLM keeps per layer a `[2, blocks, block_size, heads, head_dim]` tensor (K at `t[0]`,
//! V at `t[1]`, stride one block) or `[blocks, 2, block_size, heads, head_dim]` (K and V
//! interleaved, stride two blocks); SGLang keeps `k_buffer[layer]` and `v_buffer[layer]`
//! (or one MLA `kv_buffer[layer]`) of `[tokens, heads, head_dim]`, a page being
//! `page_size` consecutive tokens. In each of them one page of one (part, layer) is a
//! contiguous run of `page_tokens * token_bytes` bytes at `base + slot * page_stride`.
//! [`PageMap`] turns a (slot, part) into those runs for both an owned region (one
//! allocation cut `[part][layer][page]`) and wrapped engine tensors ([`KvTensors`]).
//!
//! SGLang's `page_first` host pool is the other shape: `kv_buffer[part]` is
//! `[tokens, layers, heads, head_dim]`, so one page of one part is a whole page-first
//! object, contiguous. A page-first layout registers it with one base per part instead of
//! one per (part, layer) ([`PageMap::whole_objects`]), and each object copies as one run.
//!
//! vLLM's layouts with heads outside blocks (`LHBNC`, `BHLNC`) keep one block of one
//! layer as one run per head, the runs a head stride apart. Such tensors register with
//! [`KvTensors::with_runs`]: each page of one (part, layer) is `runs` runs of equal bytes,
//! `run_stride` apart, whose bytes in run order are the page's bytes.

use crate::layout::{ByteOrder, Layout, Part};

use super::device::DeviceError;

/// Engine-owned KV tensors to wrap, as addresses: the caller keeps them alive and frees
/// them; a region built on them never does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvTensors {
    /// Address of page 0 of each (part, layer) of the rank's stage, parts outer, in
    /// [`Layout::rank_parts`] order: `bases[p * layers + l]` (for MHA all K layers, then
    /// all V layers). For a [`ByteOrder::PageFirst`] layout, one address per part instead
    /// says each page of a part is one whole page-first object (SGLang's `page_first`
    /// host pool).
    pub bases: Vec<u64>,
    /// Bytes from one page to the next inside one (part, layer) tensor.
    pub page_stride: u64,
    /// Pages each tensor holds.
    pub pages: u32,
    /// Equal runs each page of one (part, layer) is cut into, in the object's byte order
    /// (1: the page is one contiguous run). Layer-first layouts only.
    pub runs: u32,
    /// Bytes from one run of a page to the next; unused with one run.
    pub run_stride: u64,
}

impl KvTensors {
    /// Tensors whose pages are each one contiguous run.
    pub fn new(bases: Vec<u64>, page_stride: u64, pages: u32) -> Self {
        Self {
            bases,
            page_stride,
            pages,
            runs: 1,
            run_stride: 0,
        }
    }

    /// Each page of one (part, layer) is `runs` runs of equal bytes, `run_stride` apart
    /// (vLLM's `LHBNC`/`BHLNC`: one run per head, at the head stride). Default: 1 run.
    pub fn with_runs(self, runs: u32, run_stride: u64) -> Self {
        Self {
            runs,
            run_stride,
            ..self
        }
    }
}

/// Most runs one page of one tensor may be cut into (the overlap check walks them).
pub const MAX_RUNS: u32 = 1024;

/// Why a set of tensors cannot be wrapped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TensorError {
    #[error(
        "{got} tensor addresses given; the rank's stage has {parts} part(s) x {layers} layers = {want} (or, \
         for a page-first layout, one per part)"
    )]
    Count {
        got: usize,
        want: usize,
        parts: usize,
        layers: u32,
    },
    #[error("tensor {index} (part {part:?}, layer {layer}) has a null address")]
    Null { index: usize, part: Part, layer: u32 },
    #[error("page stride {stride} is smaller than one page's run of {run} bytes")]
    Stride { stride: u64, run: u64 },
    #[error("a region holds at least one page")]
    NoPages,
    #[error("tensor {index} runs past the end of the address space")]
    Overflow { index: usize },
    #[error("the pages of tensors {a} and {b} overlap")]
    Overlap { a: usize, b: usize },
    #[error("tensor {index} runs past the region's {len} bytes")]
    OutOfBuffer { index: usize, len: u64 },
    #[error("a page's run of {run} bytes does not cut into {runs} equal runs (1 to {MAX_RUNS})")]
    Runs { runs: u32, run: u64 },
    #[error("pages cut into runs need a layer-first layout (a page-first object interleaves the layers)")]
    RunsPageFirst,
    #[error("run stride {stride} is smaller than one run of {run} bytes")]
    RunStride { stride: u64, run: u64 },
    #[error("the runs of tensor pages overlap each other (page stride {page_stride}, run stride {run_stride})")]
    RunsOverlap { page_stride: u64, run_stride: u64 },
}

/// One contiguous device run of a page in one (part, layer), and where its bytes go in
/// the object. A page-first object scatters the run: `rows = Some((rows, host_pitch))`
/// moves `rows` pieces of `width` bytes, consecutive on the device and `host_pitch`
/// apart in the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub dev: u64,
    pub host_off: usize,
    pub width: usize,
    pub rows: Option<(usize, usize)>,
}

/// Validated addressing of one rank's region.
#[derive(Clone, Debug)]
pub struct PageMap {
    parts: &'static [Part],
    layers: u32,
    pages: u32,
    page_tokens: usize,
    token_bytes: usize,
    order: ByteOrder,
    bases: Vec<u64>,
    stride: u64,
    /// One base per part, each page a whole page-first object ([`PageMap::whole_objects`]).
    whole: bool,
    /// Runs each page of one (part, layer) is cut into, `run_stride` apart.
    runs: u32,
    run_stride: u64,
}

impl PageMap {
    fn shape(layout: &Layout, pp_rank: u16, pages: u32, bases: Vec<u64>, stride: u64) -> Self {
        Self {
            parts: layout.rank_parts(),
            layers: layout.stage_layers(pp_rank),
            pages,
            page_tokens: layout.page_tokens() as usize,
            token_bytes: layout.token_layer_bytes(),
            order: layout.byte_order(),
            bases,
            stride,
            whole: false,
            runs: 1,
            run_stride: 0,
        }
    }

    /// Bytes of an owned region of `pages` pages for rank `pp_rank`.
    pub fn contiguous_bytes(layout: &Layout, pp_rank: u16, pages: u32) -> usize {
        let run = layout.page_tokens() as usize * layout.token_layer_bytes();
        layout.rank_parts().len() * layout.stage_layers(pp_rank) as usize * pages as usize * run
    }

    /// An owned region at `base`, cut `[part][layer][page][token bytes]`.
    pub fn contiguous(layout: &Layout, pp_rank: u16, pages: u32, base: u64) -> Self {
        let run = (layout.page_tokens() as usize * layout.token_layer_bytes()) as u64;
        let n = layout.rank_parts().len() * layout.stage_layers(pp_rank) as usize;
        let bases = (0..n as u64).map(|i| base + i * pages as u64 * run).collect();
        Self::shape(layout, pp_rank, pages, bases, run)
    }

    /// Engine-owned tensors, checked: one non-null address per (part, layer), a stride of
    /// at least one page's run, pages cut into equal runs that fit their strides, no byte
    /// of one page in another page (of the same tensor or another one), and no address
    /// wrapping around.
    /// With a page-first layout, one address per part wraps memory whose pages are whole
    /// page-first objects (see [`PageMap::whole_objects`]).
    pub fn wrap(layout: &Layout, pp_rank: u16, t: &KvTensors) -> Result<Self, TensorError> {
        let mut map = Self::shape(layout, pp_rank, t.pages, t.bases.clone(), t.page_stride);
        let want = map.parts.len() * map.layers as usize;
        map.whole = map.order == ByteOrder::PageFirst && map.layers > 1 && t.bases.len() == map.parts.len();
        if t.bases.len() != want && !map.whole {
            return Err(TensorError::Count {
                got: t.bases.len(),
                want,
                parts: map.parts.len(),
                layers: map.layers,
            });
        }
        if let Some(index) = t.bases.iter().position(|&b| b == 0) {
            let layers = if map.whole { 1 } else { map.layers as usize };
            return Err(TensorError::Null {
                index,
                part: map.parts[index / layers],
                layer: (index % layers) as u32,
            });
        }
        let run = map.span() as u64;
        if t.runs == 0 || t.runs > MAX_RUNS || run == 0 || !run.is_multiple_of(t.runs as u64) {
            return Err(TensorError::Runs { runs: t.runs, run });
        }
        if t.runs > 1 && map.order == ByteOrder::PageFirst {
            return Err(TensorError::RunsPageFirst);
        }
        map.runs = t.runs;
        map.run_stride = if t.runs > 1 { t.run_stride } else { 0 };
        let piece = map.piece() as u64;
        if t.page_stride < piece || (t.runs == 1 && t.page_stride < run) {
            return Err(TensorError::Stride {
                stride: t.page_stride,
                run: if t.runs == 1 { run } else { piece },
            });
        }
        if t.runs > 1 && t.run_stride < piece {
            return Err(TensorError::RunStride {
                stride: t.run_stride,
                run: piece,
            });
        }
        if t.pages == 0 {
            return Err(TensorError::NoPages);
        }
        let last = map.last_bytes();
        for (index, &b) in t.bases.iter().enumerate() {
            if last.and_then(|s| b.checked_add(s)).is_none() {
                return Err(TensorError::Overflow { index });
            }
        }
        let lattice = Lattice {
            piece: piece as i128,
            page_stride: t.page_stride as i128,
            pages: t.pages as i128,
            run_stride: map.run_stride as i128,
            runs: t.runs as i128,
        };
        if t.runs > 1 && lattice.meets(0, true) {
            return Err(TensorError::RunsOverlap {
                page_stride: t.page_stride,
                run_stride: t.run_stride,
            });
        }
        for a in 0..t.bases.len() {
            for b in a + 1..t.bases.len() {
                if lattice.meets(t.bases[b] as i128 - t.bases[a] as i128, false) {
                    return Err(TensorError::Overlap { a, b });
                }
            }
        }
        Ok(map)
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    pub fn layers(&self) -> u32 {
        self.layers
    }

    pub fn parts(&self) -> &'static [Part] {
        self.parts
    }

    /// Bytes of one page of one (part, layer).
    pub fn run(&self) -> usize {
        self.page_tokens * self.token_bytes
    }

    /// Whether each page of a part is one whole page-first object at one base per part
    /// (SGLang's `page_first` host pool), rather than one run per (part, layer).
    pub fn whole_objects(&self) -> bool {
        self.whole
    }

    /// Bytes one page occupies in one wrapped tensor: a layer's run, or a whole object.
    fn span(&self) -> usize {
        if self.whole { self.object_bytes() } else { self.run() }
    }

    /// Bytes of one object (one part of one page across the stage's layers).
    pub fn object_bytes(&self) -> usize {
        self.layers as usize * self.run()
    }

    /// Bytes of one run of a page of one (part, layer): the layer's run cut in `runs`.
    pub fn piece(&self) -> usize {
        self.span() / self.runs as usize
    }

    /// Runs each page of one (part, layer) is cut into (1: one contiguous run).
    pub fn runs(&self) -> u32 {
        self.runs
    }

    /// Bytes from a tensor's base to one past the last byte of its last page, if that fits.
    fn last_bytes(&self) -> Option<u64> {
        (self.pages.max(1) as u64 - 1)
            .checked_mul(self.stride)?
            .checked_add((self.runs as u64 - 1).checked_mul(self.run_stride)?)?
            .checked_add(self.piece() as u64)
    }

    /// One past the highest address any page reaches.
    pub fn end(&self) -> u64 {
        let last = self.last_bytes().unwrap_or(u64::MAX);
        self.bases.iter().map(|b| b.saturating_add(last)).max().unwrap_or(0)
    }

    /// The first tensor whose pages reach past `len`, if any.
    pub fn beyond(&self, len: u64) -> Option<usize> {
        let last = self.last_bytes().unwrap_or(u64::MAX);
        self.bases.iter().position(|b| b.saturating_add(last) > len)
    }

    pub fn part_index(&self, part: Part) -> Result<usize, DeviceError> {
        self.parts
            .iter()
            .position(|&p| p == part)
            .ok_or(DeviceError::BadPart(part))
    }

    /// Address of page `slot` of (part index, layer): where that layer's run starts (in
    /// whole-object memory, its first token). Callers check the bounds.
    pub fn chunk(&self, part: usize, layer: u32, slot: u32) -> u64 {
        if self.whole {
            return self.bases[part] + slot as u64 * self.stride + (layer as usize * self.token_bytes) as u64;
        }
        self.bases[part * self.layers as usize + layer as usize] + slot as u64 * self.stride
    }

    /// The runs of page `slot` of (part index, layer): each run's address and its offset
    /// in the layer's bytes, [`PageMap::piece`] bytes each. Callers check the bounds.
    pub fn layer_runs(&self, part: usize, layer: u32, slot: u32) -> impl Iterator<Item = (u64, usize)> + '_ {
        let (at, piece, stride) = (self.chunk(part, layer, slot), self.piece(), self.run_stride);
        (0..self.runs as u64).map(move |r| (at + r * stride, r as usize * piece))
    }

    /// Checks one object copy; returns the part's index.
    pub fn check(&self, slot: u32, part: Part, len: usize) -> Result<usize, DeviceError> {
        if slot >= self.pages {
            return Err(DeviceError::BadSlot {
                slot,
                pages: self.pages,
            });
        }
        let p = self.part_index(part)?;
        if len != self.object_bytes() {
            return Err(DeviceError::WrongSize {
                got: len,
                want: self.object_bytes(),
            });
        }
        Ok(p)
    }

    /// Checks one layer access (what an attention kernel reads or writes).
    pub fn check_layer(&self, slot: u32, layer: u32, len: usize) -> Result<(), DeviceError> {
        if slot >= self.pages {
            return Err(DeviceError::BadSlot {
                slot,
                pages: self.pages,
            });
        }
        if layer >= self.layers {
            return Err(DeviceError::BadLayer {
                layer,
                layers: self.layers,
            });
        }
        if self.whole {
            // A layer's tokens are `layers` token rows apart here, not one run.
            return Err(DeviceError::Copy(
                "whole page-first objects have no contiguous per-layer run".into(),
            ));
        }
        if len != self.run() {
            return Err(DeviceError::WrongSize {
                got: len,
                want: self.run(),
            });
        }
        Ok(())
    }

    /// The runs of one object, one per layer, in the layout's byte order: layer-first is
    /// one contiguous run per layer; page-first interleaves the layers per token. A whole
    /// page-first object is one run.
    pub fn plan(&self, slot: u32, part: Part, len: usize, mut f: impl FnMut(Run)) -> Result<(), DeviceError> {
        let p = self.check(slot, part, len)?;
        if self.whole {
            f(Run {
                dev: self.bases[p] + slot as u64 * self.stride,
                host_off: 0,
                width: self.object_bytes(),
                rows: None,
            });
            return Ok(());
        }
        let run = self.run();
        for layer in 0..self.layers {
            if self.runs > 1 {
                // Heads outside blocks: the layer's bytes are `runs` runs in object order.
                for (dev, off) in self.layer_runs(p, layer, slot) {
                    f(Run {
                        dev,
                        host_off: layer as usize * run + off,
                        width: self.piece(),
                        rows: None,
                    });
                }
                continue;
            }
            let (host_off, width, rows) = match self.order {
                ByteOrder::LayerFirst => (layer as usize * run, run, None),
                ByteOrder::PageFirst => (
                    layer as usize * self.token_bytes,
                    self.token_bytes,
                    Some((self.page_tokens, self.layers as usize * self.token_bytes)),
                ),
            };
            f(Run {
                dev: self.chunk(p, layer, slot),
                host_off,
                width,
                rows,
            });
        }
        Ok(())
    }
}

/// The pieces one tensor's pages occupy, relative to its base: `piece` bytes at
/// `s * page_stride + r * run_stride` for `s < pages`, `r < runs`.
struct Lattice {
    piece: i128,
    page_stride: i128,
    pages: i128,
    run_stride: i128,
    runs: i128,
}

impl Lattice {
    /// Whether a piece of a lattice at offset `d` from this one shares a byte with a piece
    /// of this one (`same`: the lattice itself, a piece never meeting itself). Per run
    /// difference, only the page differences nearest to cancelling the offset can bring
    /// two pieces within `piece` bytes of each other, so it checks those.
    fn meets(&self, d: i128, same: bool) -> bool {
        let last = self.pages - 1;
        for dr in -(self.runs - 1)..=self.runs - 1 {
            let x = d + dr * self.run_stride;
            let q = (-x).div_euclid(self.page_stride);
            let near: &[i128] = if same && dr == 0 {
                if last == 0 { &[] } else { &[1] }
            } else {
                &[q.clamp(-last, last), (q + 1).clamp(-last, last)]
            };
            if near.iter().any(|&ds| (x + ds * self.page_stride).abs() < self.piece) {
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutSpec;

    fn layout() -> Layout {
        // 2 layers, run = 4 tokens x 2 heads x 8 dims x 2 bytes = 128 bytes.
        LayoutSpec::mha(2, 2, 8, 2, 4).build().unwrap()
    }

    fn wrap(bases: Vec<u64>, page_stride: u64, pages: u32) -> Result<PageMap, TensorError> {
        PageMap::wrap(&layout(), 0, &KvTensors::new(bases, page_stride, pages))
    }

    #[test]
    fn owned_regions_are_one_tensor_per_part_and_layer() {
        let m = PageMap::contiguous(&layout(), 0, 4, 1000);
        assert_eq!(m.run(), 128);
        assert_eq!(m.chunk(0, 0, 0), 1000);
        assert_eq!(m.chunk(0, 1, 0), 1000 + 4 * 128);
        assert_eq!(m.chunk(1, 1, 3), 1000 + (3 * 4 + 3) * 128);
        assert_eq!(m.end(), 1000 + PageMap::contiguous_bytes(&layout(), 0, 4) as u64);
    }

    #[test]
    fn vllm_and_sglang_shapes_wrap() {
        // vLLM [2, blocks, ...] per layer: V follows all K blocks.
        let (blocks, run) = (8u64, 128u64);
        let l0 = 1 << 20;
        let l1 = l0 + 2 * blocks * run;
        let m = wrap(vec![l0, l1, l0 + blocks * run, l1 + blocks * run], run, 8).unwrap();
        assert_eq!(m.chunk(1, 0, 2), l0 + (8 + 2) * run);
        // [blocks, 2, ...]: K and V interleave page by page.
        let m = wrap(vec![l0, l1, l0 + run, l1 + run], 2 * run, 8).unwrap();
        assert_eq!(m.chunk(1, 1, 3), l1 + run + 3 * 2 * run);
        assert_eq!(m.end(), l1 + run + 7 * 2 * run + run);
    }

    #[test]
    fn page_first_memory_wraps_one_base_per_part() {
        // SGLang's page_first host pool: kv[part] is [tokens, layers, heads, dim], so a page
        // of a part is one whole page-first object of 2 layers x 128 bytes.
        let l = LayoutSpec::mha(2, 2, 8, 2, 4)
            .with_byte_order(ByteOrder::PageFirst)
            .build()
            .unwrap();
        let (k, v, obj) = (1u64 << 20, 2u64 << 20, 256u64);
        let t = KvTensors::new(vec![k, v], obj, 8);
        let m = PageMap::wrap(&l, 0, &t).unwrap();
        assert!(m.whole_objects());
        assert_eq!(m.end(), v + 8 * obj);
        let mut runs = Vec::new();
        m.plan(3, Part::V, obj as usize, |r| runs.push(r)).unwrap();
        assert_eq!(
            runs,
            vec![Run {
                dev: v + 3 * obj,
                host_off: 0,
                width: obj as usize,
                rows: None
            }]
        );
        // Layer 1's first token sits one token row into the page.
        assert_eq!(m.chunk(0, 1, 2), k + 2 * obj + 32);
        // A stride shorter than a whole object overlaps the next page.
        let short = KvTensors {
            page_stride: 128,
            ..t.clone()
        };
        assert_eq!(
            PageMap::wrap(&l, 0, &short).unwrap_err(),
            TensorError::Stride { stride: 128, run: 256 }
        );
        // A layer-first layout takes no per-part bases.
        assert!(matches!(
            PageMap::wrap(&layout(), 0, &t),
            Err(TensorError::Count { got: 2, want: 4, .. })
        ));
        // Per-(part, layer) bases keep their meaning under a page-first layout.
        let per_layer = KvTensors::new(vec![k, k + 8 * 128, v, v + 8 * 128], 128, 8);
        assert!(!PageMap::wrap(&l, 0, &per_layer).unwrap().whole_objects());
    }

    #[test]
    fn bad_tensors_are_typed_errors() {
        assert!(matches!(
            wrap(vec![1 << 20; 3], 128, 4),
            Err(TensorError::Count { got: 3, want: 4, .. })
        ));
        assert_eq!(
            wrap(vec![1 << 20, 2 << 20, 0, 4 << 20], 128, 4).unwrap_err(),
            TensorError::Null {
                index: 2,
                part: Part::V,
                layer: 0
            }
        );
        assert_eq!(
            wrap(vec![1 << 20, 2 << 20, 3 << 20, 4 << 20], 0, 4).unwrap_err(),
            TensorError::Stride { stride: 0, run: 128 }
        );
        assert_eq!(
            wrap(vec![1 << 20, 2 << 20, 3 << 20, 4 << 20], 128, 0).unwrap_err(),
            TensorError::NoPages
        );
        assert_eq!(
            wrap(vec![1 << 20, 2 << 20, 3 << 20, u64::MAX - 100], 128, 1).unwrap_err(),
            TensorError::Overflow { index: 3 }
        );
        // The same pointer for K and V, V starting inside K's last page, and an
        // interleave off by a few bytes all overlap; exactly adjacent tensors do not.
        let base = 1 << 20;
        assert_eq!(
            wrap(vec![base, 2 << 20, base, 4 << 20], 128, 4).unwrap_err(),
            TensorError::Overlap { a: 0, b: 2 }
        );
        assert!(matches!(
            wrap(vec![base, 2 << 20, base + 3 * 128 + 64, 4 << 20], 128, 4),
            Err(TensorError::Overlap { a: 0, b: 2 })
        ));
        assert!(matches!(
            wrap(vec![base, 2 << 20, base + 100, 4 << 20], 256, 4),
            Err(TensorError::Overlap { a: 0, b: 2 })
        ));
        wrap(vec![base, 2 << 20, base + 4 * 128, 4 << 20], 128, 4).unwrap();
        wrap(vec![base, 2 << 20, base + 128, 4 << 20], 256, 4).unwrap();
    }
}

#[cfg(test)]
#[path = "tensor_runs_tests.rs"]
mod runs_tests;
