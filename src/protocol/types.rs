//! The structured fields requests and responses carry, and their wire encodings.

use crate::layout::{AttentionKind, ByteOrder, Dtype, KvOrder, LayoutSpec};
use crate::page::{Namespace, PageHash};

use super::codec::{DecodeError, Reader, Writer};

/// Longest string field (instance names, model ids, session ids, paths, messages).
pub const MAX_STR: usize = 4096;
/// Most pages one request may name.
pub const MAX_PAGES: usize = 65_536;
/// Most advice entries one answer carries (their page hashes together stay within
/// [`MAX_PAGES`]).
pub const MAX_ADVICE: usize = 4096;

/// Who is connecting: one engine rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    /// The engine instance (all its ranks share it).
    pub instance: String,
    pub namespace: Namespace,
    pub tp_rank: u16,
    pub tp_size: u16,
    pub pp_rank: u16,
    pub pp_size: u16,
    pub dp_rank: u16,
}

impl Identity {
    pub(crate) fn encode(&self, w: &mut Writer) {
        w.str(&self.instance);
        w.str(&self.namespace.model);
        w.str(&self.namespace.lora);
        w.str(&self.namespace.salt);
        for v in [self.tp_rank, self.tp_size, self.pp_rank, self.pp_size, self.dp_rank] {
            w.u16(v);
        }
    }

    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(Self {
            instance: r.str("instance", MAX_STR)?,
            namespace: Namespace {
                model: r.str("model", MAX_STR)?,
                lora: r.str("lora", MAX_STR)?,
                salt: r.str("salt", MAX_STR)?,
            },
            tp_rank: r.u16()?,
            tp_size: r.u16()?,
            pp_rank: r.u16()?,
            pp_size: r.u16()?,
            dp_rank: r.u16()?,
        })
    }
}

pub(crate) fn encode_layout(w: &mut Writer, s: &LayoutSpec) {
    for v in [s.layers, s.kv_heads, s.head_dim, s.dtype_bytes, s.page_tokens] {
        w.u32(v);
    }
    w.u16(s.tp_size);
    w.u16(s.pp_size);
    w.u8(match s.attention {
        AttentionKind::Mha => 0,
        AttentionKind::Mla => 1,
    });
    w.u8(match s.byte_order {
        ByteOrder::LayerFirst => 0,
        ByteOrder::PageFirst => 1,
    });
    w.count(s.pp_layers.len());
    for &l in &s.pp_layers {
        w.u32(l);
    }
    w.u8(s.dtype.code());
    w.u8(s.kv_order.code());
}

pub(crate) fn decode_layout(r: &mut Reader) -> Result<LayoutSpec, DecodeError> {
    let layers = r.u32()?;
    let kv_heads = r.u32()?;
    let head_dim = r.u32()?;
    let dtype_bytes = r.u32()?;
    let page_tokens = r.u32()?;
    let tp_size = r.u16()?;
    let pp_size = r.u16()?;
    let attention = match r.u8()? {
        0 => AttentionKind::Mha,
        1 => AttentionKind::Mla,
        tag => return Err(DecodeError::BadTag { what: "attention", tag }),
    };
    let byte_order = match r.u8()? {
        0 => ByteOrder::LayerFirst,
        1 => ByteOrder::PageFirst,
        tag => {
            return Err(DecodeError::BadTag {
                what: "byte order",
                tag,
            });
        }
    };
    let n = r.count("pp_layers", 256, 4)?;
    let pp_layers = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
    let tag = r.u8()?;
    let dtype = Dtype::from_code(tag as u32).ok_or(DecodeError::BadTag { what: "dtype", tag })?;
    let tag = r.u8()?;
    let kv_order = KvOrder::from_code(tag as u32).ok_or(DecodeError::BadTag { what: "kv order", tag })?;
    Ok(LayoutSpec {
        dtype,
        kv_order,
        layers,
        kv_heads,
        head_dim,
        dtype_bytes,
        page_tokens,
        tp_size,
        pp_size,
        attention,
        byte_order,
        pp_layers,
    })
}

/// A load's wait policy, after HiCache's prefetch policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadWait {
    /// Take the pages that are complete now.
    BestEffort,
    /// Wait for pages being stored to complete (bounded by the server's maximum wait).
    WaitComplete,
    /// Wait at most this many milliseconds, then take what is complete.
    Timeout(u32),
}

impl LoadWait {
    pub(crate) fn encode(&self, w: &mut Writer) {
        match *self {
            LoadWait::BestEffort => w.u8(0),
            LoadWait::WaitComplete => w.u8(1),
            LoadWait::Timeout(ms) => {
                w.u8(2);
                w.u32(ms);
            }
        }
    }

    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        match r.u8()? {
            0 => Ok(LoadWait::BestEffort),
            1 => Ok(LoadWait::WaitComplete),
            2 => Ok(LoadWait::Timeout(r.u32()?)),
            tag => Err(DecodeError::BadTag { what: "load wait", tag }),
        }
    }
}

/// One rank's device region, as the engine describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `"emulated"` or `"cuda"`.
    pub kind: String,
    pub pages: u32,
    pub object_bytes: u64,
}

/// Where one object of a page lives in the host arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectSlot {
    /// The object's canonical index in the layout.
    pub object: u16,
    /// The arena slot.
    pub slot: u32,
    /// The slot's generation when the daemon granted it (0: unchecked). A store's writer
    /// stamps it beside the slot after its copy; a load checks the stamp after its copy
    /// (see `crate::tier::slot_gen`).
    pub generation: u64,
}

pub(crate) fn encode_slots(w: &mut Writer, slots: &[ObjectSlot]) {
    w.count(slots.len());
    for s in slots {
        w.u16(s.object);
        w.u32(s.slot);
        w.u64(s.generation);
    }
}

pub(crate) fn decode_slots(r: &mut Reader) -> Result<Vec<ObjectSlot>, DecodeError> {
    let n = r.count("object slots", crate::layout::MAX_OBJECTS_PER_PAGE, 14)?;
    (0..n)
        .map(|_| {
            Ok(ObjectSlot {
                object: r.u16()?,
                slot: r.u32()?,
                generation: r.u64()?,
            })
        })
        .collect()
}

/// A page of a store grant: its position in the request, and the slots to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantPage {
    pub index: u32,
    pub slots: Vec<ObjectSlot>,
}

/// Where the daemon's host arena is, so a client can map it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaInfo {
    pub path: String,
    pub slot_bytes: u64,
    pub slots: u32,
}

/// A session's phase at a tool boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionPhase {
    Reasoning,
    Acting,
    Paused,
    Ended,
}

impl SessionPhase {
    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(tag: u8) -> Result<Self, DecodeError> {
        Ok(match tag {
            0 => SessionPhase::Reasoning,
            1 => SessionPhase::Acting,
            2 => SessionPhase::Paused,
            3 => SessionPhase::Ended,
            tag => {
                return Err(DecodeError::BadTag {
                    what: "session phase",
                    tag,
                });
            }
        })
    }
}

/// State of a ticket (a committed store): how many of its pages are complete across ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TicketStatus {
    pub complete: u32,
    pub total: u32,
    /// Pages that can no longer complete (evicted or discarded).
    pub failed: u32,
}

impl TicketStatus {
    pub fn done(&self) -> bool {
        self.complete + self.failed >= self.total
    }
}

/// Daemon counters, for health checks and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DaemonStats {
    pub arena_slots: u64,
    pub arena_used: u64,
    pub host_complete_pages: u64,
    pub open_grants: u64,
    pub connections: u64,
    pub recovered_pages: u64,
    pub discarded_pages: u64,
}

impl DaemonStats {
    pub(crate) fn fields(&self) -> [u64; 7] {
        [
            self.arena_slots,
            self.arena_used,
            self.host_complete_pages,
            self.open_grants,
            self.connections,
            self.recovered_pages,
            self.discarded_pages,
        ]
    }

    pub(crate) fn from_fields(f: [u64; 7]) -> Self {
        Self {
            arena_slots: f[0],
            arena_used: f[1],
            host_complete_pages: f[2],
            open_grants: f[3],
            connections: f[4],
            recovered_pages: f[5],
            discarded_pages: f[6],
        }
    }
}

/// What kvtier advises an engine to do with its device pages, which only the engine can
/// touch, or with a session's turns, which only the engine schedules. Codes are part of
/// the wire contract; never renumber, only append.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AdviceKind {
    /// Evict these device pages first: a complete colder copy exists.
    EvictFirst = 0,
    /// Store these device pages to host: a demote or share needs a colder copy first.
    Offload = 1,
    /// These pages are staged in host and ready to load (a prefetch to device).
    ReadyToLoad = 2,
    /// Stop admitting turns of this session: the pressure controller paused it (host
    /// at its high watermark). Names a session, no pages.
    Pause = 3,
    /// The session may run again (host back at its resume watermark, or the pause
    /// reached its cap). Names a session, no pages.
    Resume = 4,
}

impl AdviceKind {
    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    /// Whether the advice names a session (Pause, Resume) rather than pages.
    pub fn is_session(self) -> bool {
        matches!(self, AdviceKind::Pause | AdviceKind::Resume)
    }

    pub(crate) fn from_code(tag: u8) -> Result<Self, DecodeError> {
        Ok(match tag {
            0 => AdviceKind::EvictFirst,
            1 => AdviceKind::Offload,
            2 => AdviceKind::ReadyToLoad,
            3 => AdviceKind::Pause,
            4 => AdviceKind::Resume,
            tag => {
                return Err(DecodeError::BadTag {
                    what: "advice kind",
                    tag,
                });
            }
        })
    }
}

/// One piece of advice: about pages of the asking rank's namespace (`hashes`, at least
/// one), or about a session whose pages live there (`session_id`, no pages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineAdvice {
    pub kind: AdviceKind,
    /// Page kinds: at least one page. Session kinds: empty.
    pub hashes: Vec<PageHash>,
    /// Session kinds: the session; page kinds: `None`.
    pub session_id: Option<String>,
}

impl EngineAdvice {
    /// Advice about pages.
    pub fn pages(kind: AdviceKind, hashes: Vec<PageHash>) -> Self {
        Self {
            kind,
            hashes,
            session_id: None,
        }
    }

    /// Advice about a session (`Pause`, `Resume`).
    pub fn session(kind: AdviceKind, session_id: impl Into<String>) -> Self {
        Self {
            kind,
            hashes: Vec::new(),
            session_id: Some(session_id.into()),
        }
    }
}

/// The advice a `TakeAdvice` request took, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdviceBatch {
    pub advice: Vec<EngineAdvice>,
    /// More advice for the namespace is waiting (the page budget ran out): ask again.
    pub more: bool,
}

impl AdviceBatch {
    /// Page hashes in the batch, all entries together.
    pub fn pages(&self) -> usize {
        self.advice.iter().map(|a| a.hashes.len()).sum()
    }

    pub(crate) fn encode(&self, w: &mut Writer) {
        w.bool(self.more);
        w.count(self.advice.len());
        for a in &self.advice {
            w.u8(a.kind.code());
            if a.kind.is_session() {
                w.str(a.session_id.as_deref().unwrap_or(""));
            } else {
                w.hashes(&a.hashes);
            }
        }
    }

    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        let more = r.bool()?;
        // Each entry takes a kind byte and at least a session id of one byte (its kind,
        // a u16 length and a byte) or a count and one hash.
        let n = r.count("advice", MAX_ADVICE, 1 + 2 + 1)?;
        let mut advice = Vec::with_capacity(n);
        let mut pages = 0;
        for _ in 0..n {
            let kind = AdviceKind::from_code(r.u8()?)?;
            if kind.is_session() {
                let id = r.str("advised session", MAX_STR)?;
                if id.is_empty() {
                    return Err(DecodeError::Invalid {
                        what: "advice",
                        why: "a session entry names no session".into(),
                    });
                }
                advice.push(EngineAdvice::session(kind, id));
                continue;
            }
            let hashes = r.hashes(MAX_PAGES - pages)?;
            if hashes.is_empty() {
                return Err(DecodeError::Invalid {
                    what: "advice",
                    why: "an entry names no pages".into(),
                });
            }
            pages += hashes.len();
            advice.push(EngineAdvice::pages(kind, hashes));
        }
        Ok(Self { advice, more })
    }
}
