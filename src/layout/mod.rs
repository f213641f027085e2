//! The model's KV geometry and the object set it implies.
//!
//! A [`Layout`] says how one page of KV cache is cut into physical *objects*: one per
//! `(pp_rank, tp_rank, part)`. Layers are split over pipeline stages (evenly, or by an
//! explicit per-stage list), KV heads over tensor-parallel ranks (a TP size above the
//! head count replicates heads), and MLA keeps one latent object per PP stage that all
//! TP ranks share. Everything that needs object sizes or counts asks the layout.

use serde::{Deserialize, Serialize};

/// Largest number of objects one page may have. Keeps per-page bitmaps bounded.
pub const MAX_OBJECTS_PER_PAGE: usize = 4096;
/// Largest single object kvtier accepts (1 GiB); anything larger is a configuration error.
pub const MAX_OBJECT_BYTES: u64 = 1 << 30;

/// Attention kind: decides whether a page has K and V objects per rank or one latent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// Multi-head or grouped-query attention: separate K and V per TP rank.
    Mha,
    /// Multi-head latent attention: one latent object per PP stage, shared by all TP ranks.
    Mla,
}

/// Byte order of one object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ByteOrder {
    /// `[layer][token][head][dim]`: one contiguous run per layer, as engines keep GPU KV.
    LayerFirst,
    /// `[token][layer][head][dim]`: HiCache's `page_first` host layout, used on Mooncake.
    PageFirst,
}

/// The element type of the KV values. Part of a page's identity: pages written in one
/// dtype are never offered to an engine of another, even when the sizes agree (bf16 and
/// fp16). `Unspecified` is for callers that give only a byte width; it is an identity of
/// its own, distinct from every named dtype.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    #[default]
    Unspecified,
    F16,
    Bf16,
    F32,
    Fp8E4m3,
    Fp8E5m2,
    U8,
}

impl Dtype {
    /// Every dtype, by its wire and C ABI number (`KVTIER_DTYPE_*`).
    pub const ALL: [Dtype; 7] = [
        Dtype::Unspecified,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::Fp8E4m3,
        Dtype::Fp8E5m2,
        Dtype::U8,
    ];

    pub fn code(self) -> u8 {
        Self::ALL.iter().position(|&d| d == self).unwrap_or(0) as u8
    }

    pub fn from_code(code: u32) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }

    /// Bytes of one element; `None` for `Unspecified`.
    pub fn bytes(self) -> Option<u32> {
        match self {
            Dtype::Unspecified => None,
            Dtype::F16 | Dtype::Bf16 => Some(2),
            Dtype::F32 => Some(4),
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 | Dtype::U8 => Some(1),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Unspecified => "unspecified",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
            Dtype::U8 => "u8",
        }
    }
}

/// The order of the bytes inside one page of one (part, layer): how the engine's
/// attention kernels lay out a block. The run is contiguous in every order, so kvtier
/// copies it as it is; the order is part of the page's identity, so engines whose
/// kernels read blocks differently never share pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvOrder {
    /// `[token][head][dim]`, K and V in separate tensors (SGLang; vLLM's older 5-D
    /// layouts).
    #[default]
    Nhd,
    /// `[head][token][dim]`, K and V in separate tensors.
    Hnd,
    /// `[token][head][K dims, V dims]`: vLLM's packed K|V blocks in its `LBNHC` layout.
    /// The page's run of one layer is split in two equal halves, stored as the K and V
    /// objects; they are halves of the packed bytes, not K and V.
    PackedNhd,
    /// `[head][token][K dims, V dims]`: vLLM's packed K|V blocks in its `LBHNC` layout
    /// (the CPU backend's and the default), split in halves like `PackedNhd`.
    PackedHnd,
}

impl KvOrder {
    /// Every order, by its wire and C ABI number (`KVTIER_KV_ORDER_*`).
    pub const ALL: [KvOrder; 4] = [KvOrder::Nhd, KvOrder::Hnd, KvOrder::PackedNhd, KvOrder::PackedHnd];

    pub fn code(self) -> u8 {
        Self::ALL.iter().position(|&o| o == self).unwrap_or(0) as u8
    }

    pub fn from_code(code: u32) -> Option<Self> {
        Self::ALL.get(code as usize).copied()
    }

    pub fn name(self) -> &'static str {
        match self {
            KvOrder::Nhd => "nhd",
            KvOrder::Hnd => "hnd",
            KvOrder::PackedNhd => "packed-nhd",
            KvOrder::PackedHnd => "packed-hnd",
        }
    }
}

/// Which tensor of a page an object holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    K,
    V,
    Latent,
}

impl Part {
    /// Key suffix in HiCache's Mooncake scheme (MLA latents are stored under `_k`).
    pub fn key_suffix(self) -> &'static str {
        match self {
            Part::K | Part::Latent => "k",
            Part::V => "v",
        }
    }
}

/// One physical piece of a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ObjectId {
    pub pp_rank: u16,
    pub tp_rank: u16,
    pub part: Part,
}

/// Why a layout was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("{field} must be at least 1")]
    Zero { field: &'static str },
    #[error("{field} = {value} is beyond the supported maximum {max}")]
    TooLarge { field: &'static str, value: u64, max: u64 },
    #[error("{layers} layers do not split evenly over {pp_size} PP stages; give pp_layers explicitly")]
    UnevenPipeline { layers: u32, pp_size: u16 },
    #[error("pp_layers has {got} stages, pp_size is {pp_size}")]
    PipelineStages { got: usize, pp_size: u16 },
    #[error("pp_layers sums to {sum}, the model has {layers} layers")]
    PipelineSum { sum: u64, layers: u32 },
    #[error("a PP stage has no layers")]
    EmptyStage,
    #[error("{kv_heads} KV heads cannot be split over TP size {tp_size}")]
    HeadSplit { kv_heads: u32, tp_size: u16 },
    #[error("MLA keeps one latent head; got kv_heads = {0}")]
    MlaHeads(u32),
    #[error("a page would have {0} objects, more than {MAX_OBJECTS_PER_PAGE}")]
    TooManyObjects(usize),
    #[error("dtype {dtype} has {want} bytes an element; the layout says dtype_bytes = {got}")]
    DtypeBytes { dtype: &'static str, want: u32, got: u32 },
    #[error("MLA keeps one latent; its bytes have no K|V packing (kv_order {0})")]
    MlaPacked(&'static str),
    #[error("rank tp={tp_rank} pp={pp_rank} is outside tp_size={tp_size} pp_size={pp_size}")]
    RankOutOfRange {
        tp_rank: u16,
        pp_rank: u16,
        tp_size: u16,
        pp_size: u16,
    },
}

/// The geometry a page follows, as given by the engine. Validate with [`LayoutSpec::build`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutSpec {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype_bytes: u32,
    pub page_tokens: u32,
    pub tp_size: u16,
    pub pp_size: u16,
    pub attention: AttentionKind,
    pub byte_order: ByteOrder,
    /// Layers per PP stage, when the split is uneven. Empty means an even split.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pp_layers: Vec<u32>,
    /// The element type: part of the page's identity (see [`Dtype`]).
    #[serde(default)]
    pub dtype: Dtype,
    /// The byte order inside a page of one (part, layer) (see [`KvOrder`]).
    #[serde(default)]
    pub kv_order: KvOrder,
}

impl LayoutSpec {
    /// A plain MHA/GQA spec, TP=1, PP=1, layer-first.
    pub fn mha(layers: u32, kv_heads: u32, head_dim: u32, dtype_bytes: u32, page_tokens: u32) -> Self {
        Self {
            layers,
            kv_heads,
            head_dim,
            dtype_bytes,
            page_tokens,
            tp_size: 1,
            pp_size: 1,
            attention: AttentionKind::Mha,
            byte_order: ByteOrder::LayerFirst,
            pp_layers: Vec::new(),
            dtype: Dtype::Unspecified,
            kv_order: KvOrder::Nhd,
        }
    }

    /// An MLA spec: `latent_dim` is the compressed KV width (kv_lora_rank + rope dim).
    pub fn mla(layers: u32, latent_dim: u32, dtype_bytes: u32, page_tokens: u32) -> Self {
        Self {
            attention: AttentionKind::Mla,
            ..Self::mha(layers, 1, latent_dim, dtype_bytes, page_tokens)
        }
    }

    pub fn with_parallel(mut self, tp_size: u16, pp_size: u16) -> Self {
        self.tp_size = tp_size;
        self.pp_size = pp_size;
        self
    }

    pub fn with_byte_order(mut self, order: ByteOrder) -> Self {
        self.byte_order = order;
        self
    }

    /// The element type (checked against `dtype_bytes` by [`LayoutSpec::build`]).
    pub fn with_dtype(mut self, dtype: Dtype) -> Self {
        self.dtype = dtype;
        self
    }

    pub fn with_kv_order(mut self, order: KvOrder) -> Self {
        self.kv_order = order;
        self
    }

    /// One line naming the geometry and identity, for errors that compare two layouts.
    pub fn describe(&self) -> String {
        format!(
            "{} {} layers, {} KV heads, head dim {}, {} ({} bytes), {} tokens a page, {}, {:?}, tp {} pp {}",
            match self.attention {
                AttentionKind::Mha => "MHA",
                AttentionKind::Mla => "MLA",
            },
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype.name(),
            self.dtype_bytes,
            self.page_tokens,
            self.kv_order.name(),
            self.byte_order,
            self.tp_size,
            self.pp_size
        )
    }

    /// Explicit layers per stage, for an uneven pipeline split. Default: even split.
    pub fn with_pp_layers(mut self, pp_layers: Vec<u32>) -> Self {
        self.pp_layers = pp_layers;
        self
    }

    /// Validates the spec and derives the object set.
    pub fn build(self) -> Result<Layout, LayoutError> {
        Layout::new(self)
    }
}

/// A validated layout with its derived object set. Cheap to clone. Serializable so that
/// the pool's key fingerprint (`pool::keys::layout_fingerprint`) covers every field,
/// including any added later.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    spec: LayoutSpec,
    stage_layers: Vec<u32>,
    heads_per_rank: u32,
    objects: Vec<ObjectId>,
    object_bytes: Vec<u64>,
}

impl Layout {
    fn new(spec: LayoutSpec) -> Result<Self, LayoutError> {
        for (field, v) in [
            ("layers", spec.layers as u64),
            ("kv_heads", spec.kv_heads as u64),
            ("head_dim", spec.head_dim as u64),
            ("dtype_bytes", spec.dtype_bytes as u64),
            ("page_tokens", spec.page_tokens as u64),
            ("tp_size", spec.tp_size as u64),
            ("pp_size", spec.pp_size as u64),
        ] {
            if v == 0 {
                return Err(LayoutError::Zero { field });
            }
        }
        for (field, v, max) in [
            ("layers", spec.layers as u64, 4096),
            ("kv_heads", spec.kv_heads as u64, 4096),
            ("head_dim", spec.head_dim as u64, 65536),
            ("dtype_bytes", spec.dtype_bytes as u64, 8),
            ("page_tokens", spec.page_tokens as u64, 1 << 20),
            ("tp_size", spec.tp_size as u64, 1024),
            ("pp_size", spec.pp_size as u64, 256),
        ] {
            if v > max {
                return Err(LayoutError::TooLarge { field, value: v, max });
            }
        }
        if let Some(want) = spec.dtype.bytes()
            && want != spec.dtype_bytes
        {
            return Err(LayoutError::DtypeBytes {
                dtype: spec.dtype.name(),
                want,
                got: spec.dtype_bytes,
            });
        }
        if spec.attention == AttentionKind::Mla && matches!(spec.kv_order, KvOrder::PackedNhd | KvOrder::PackedHnd) {
            return Err(LayoutError::MlaPacked(spec.kv_order.name()));
        }
        let pp = spec.pp_size as usize;
        let stage_layers = if spec.pp_layers.is_empty() {
            if !spec.layers.is_multiple_of(spec.pp_size as u32) {
                return Err(LayoutError::UnevenPipeline {
                    layers: spec.layers,
                    pp_size: spec.pp_size,
                });
            }
            vec![spec.layers / spec.pp_size as u32; pp]
        } else {
            if spec.pp_layers.len() != pp {
                return Err(LayoutError::PipelineStages {
                    got: spec.pp_layers.len(),
                    pp_size: spec.pp_size,
                });
            }
            if spec.pp_layers.contains(&0) {
                return Err(LayoutError::EmptyStage);
            }
            let sum: u64 = spec.pp_layers.iter().map(|&l| l as u64).sum();
            if sum != spec.layers as u64 {
                return Err(LayoutError::PipelineSum {
                    sum,
                    layers: spec.layers,
                });
            }
            spec.pp_layers.clone()
        };
        let tp = spec.tp_size as u32;
        let heads_per_rank = match spec.attention {
            AttentionKind::Mla => {
                if spec.kv_heads != 1 {
                    return Err(LayoutError::MlaHeads(spec.kv_heads));
                }
                1
            }
            AttentionKind::Mha if tp <= spec.kv_heads => {
                if !spec.kv_heads.is_multiple_of(tp) {
                    return Err(LayoutError::HeadSplit {
                        kv_heads: spec.kv_heads,
                        tp_size: spec.tp_size,
                    });
                }
                spec.kv_heads / tp
            }
            // More ranks than heads: each head is replicated on tp / kv_heads ranks.
            AttentionKind::Mha => {
                if !tp.is_multiple_of(spec.kv_heads) {
                    return Err(LayoutError::HeadSplit {
                        kv_heads: spec.kv_heads,
                        tp_size: spec.tp_size,
                    });
                }
                1
            }
        };
        let count = match spec.attention {
            AttentionKind::Mha => pp * spec.tp_size as usize * 2,
            AttentionKind::Mla => pp,
        };
        if count > MAX_OBJECTS_PER_PAGE {
            return Err(LayoutError::TooManyObjects(count));
        }
        let mut objects = Vec::with_capacity(count);
        let mut object_bytes = Vec::with_capacity(count);
        for (pp_rank, &layers) in stage_layers.iter().enumerate() {
            let bytes = layers as u64
                * spec.page_tokens as u64
                * heads_per_rank as u64
                * spec.head_dim as u64
                * spec.dtype_bytes as u64;
            if bytes > MAX_OBJECT_BYTES {
                return Err(LayoutError::TooLarge {
                    field: "object_bytes",
                    value: bytes,
                    max: MAX_OBJECT_BYTES,
                });
            }
            let pp_rank = pp_rank as u16;
            match spec.attention {
                AttentionKind::Mha => {
                    for tp_rank in 0..spec.tp_size {
                        for part in [Part::K, Part::V] {
                            objects.push(ObjectId { pp_rank, tp_rank, part });
                            object_bytes.push(bytes);
                        }
                    }
                }
                AttentionKind::Mla => {
                    objects.push(ObjectId {
                        pp_rank,
                        tp_rank: 0,
                        part: Part::Latent,
                    });
                    object_bytes.push(bytes);
                }
            }
        }
        Ok(Self {
            spec,
            stage_layers,
            heads_per_rank,
            objects,
            object_bytes,
        })
    }

    pub fn spec(&self) -> &LayoutSpec {
        &self.spec
    }

    pub fn attention(&self) -> AttentionKind {
        self.spec.attention
    }

    pub fn byte_order(&self) -> ByteOrder {
        self.spec.byte_order
    }

    pub fn dtype(&self) -> Dtype {
        self.spec.dtype
    }

    pub fn kv_order(&self) -> KvOrder {
        self.spec.kv_order
    }

    pub fn tp_size(&self) -> u16 {
        self.spec.tp_size
    }

    pub fn pp_size(&self) -> u16 {
        self.spec.pp_size
    }

    pub fn page_tokens(&self) -> u32 {
        self.spec.page_tokens
    }

    /// Layers held by PP stage `pp_rank`.
    pub fn stage_layers(&self, pp_rank: u16) -> u32 {
        self.stage_layers[pp_rank as usize]
    }

    /// KV heads each TP rank holds (1 when heads are replicated, and for MLA).
    pub fn heads_per_rank(&self) -> u32 {
        self.heads_per_rank
    }

    /// Bytes of one token of one layer of one object: `heads_per_rank * head_dim * dtype`.
    pub fn token_layer_bytes(&self) -> usize {
        (self.heads_per_rank * self.spec.head_dim * self.spec.dtype_bytes) as usize
    }

    /// Every object of a page, in canonical order (pp, tp, K before V).
    pub fn objects(&self) -> &[ObjectId] {
        &self.objects
    }

    pub fn object_count(&self) -> usize {
        self.objects.len()
    }

    /// Size in bytes of object number `index` (canonical order).
    pub fn object_bytes(&self, index: usize) -> u64 {
        self.object_bytes[index]
    }

    /// The largest object: what a fixed-size slot must hold.
    pub fn max_object_bytes(&self) -> u64 {
        self.object_bytes.iter().copied().max().unwrap_or(0)
    }

    /// Sum of all object sizes: the bytes of one page across every rank.
    pub fn page_bytes(&self) -> u64 {
        self.object_bytes.iter().sum()
    }

    /// Canonical index of an object, or `None` when it is not part of this layout.
    pub fn object_index(&self, id: ObjectId) -> Option<usize> {
        if id.pp_rank >= self.spec.pp_size {
            return None;
        }
        match (self.spec.attention, id.part) {
            (AttentionKind::Mha, Part::K | Part::V) if id.tp_rank < self.spec.tp_size => {
                let base = (id.pp_rank as usize * self.spec.tp_size as usize + id.tp_rank as usize) * 2;
                Some(base + usize::from(id.part == Part::V))
            }
            (AttentionKind::Mla, Part::Latent) if id.tp_rank == 0 => Some(id.pp_rank as usize),
            _ => None,
        }
    }

    /// The objects one engine rank writes: K and V of its own (pp, tp), or the stage
    /// latent for MLA (only TP rank 0 writes it; the other ranks hold the same bytes).
    pub fn rank_objects(&self, tp_rank: u16, pp_rank: u16) -> Result<Vec<usize>, LayoutError> {
        if tp_rank >= self.spec.tp_size || pp_rank >= self.spec.pp_size {
            return Err(LayoutError::RankOutOfRange {
                tp_rank,
                pp_rank,
                tp_size: self.spec.tp_size,
                pp_size: self.spec.pp_size,
            });
        }
        Ok(match self.spec.attention {
            AttentionKind::Mha => [Part::K, Part::V]
                .iter()
                .filter_map(|&part| self.object_index(ObjectId { pp_rank, tp_rank, part }))
                .collect(),
            AttentionKind::Mla if tp_rank == 0 => vec![pp_rank as usize],
            AttentionKind::Mla => Vec::new(),
        })
    }

    /// The objects one engine rank loads: what it writes, and for MLA the stage latent on
    /// every TP rank. MLA latents are the same on every rank (SGLang and vLLM keep one copy
    /// per stage), so a TP rank other than 0 reads the copy rank 0 wrote instead of loading
    /// nothing. A load by such a rank records nothing on the device tier: completeness
    /// there follows rank 0, the rank that writes the object.
    pub fn rank_load_objects(&self, tp_rank: u16, pp_rank: u16) -> Result<Vec<usize>, LayoutError> {
        let own = self.rank_objects(tp_rank, pp_rank)?;
        Ok(match self.spec.attention {
            AttentionKind::Mla if own.is_empty() => vec![pp_rank as usize],
            _ => own,
        })
    }

    /// The parts one rank's device region holds (MLA ranks all hold the latent).
    pub fn rank_parts(&self) -> &'static [Part] {
        match self.spec.attention {
            AttentionKind::Mha => &[Part::K, Part::V],
            AttentionKind::Mla => &[Part::Latent],
        }
    }
}

#[cfg(test)]
mod tests;
