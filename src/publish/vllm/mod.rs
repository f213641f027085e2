//! vLLM-compatible KV events.
//!
//! Wire format (vLLM `kv_events`): a ZMQ PUB message `[topic, seq, payload]` where `seq`
//! is the batch number as 8 bytes big-endian (0, 1, 2, … with no gaps) and `payload` a
//! msgpack `EventBatch` `[ts, [events], dp_rank]` (msgspec `array_like`). Two encodings
//! of the events inside, chosen in [`VllmConfig::encoding`]:
//!
//! - [`Encoding::Tagged`] (vLLM 0.24 and later, the default): each event is a map tagged
//!   by `type`, `{"type": "BlockStored", "block_hashes", "parent_block_hash",
//!   "token_ids", "block_size", "lora_id", "medium", "lora_name"}`,
//!   `{"type": "BlockRemoved", "block_hashes", "medium"}`, `{"type": "AllBlocksCleared"}`;
//! - [`Encoding::Positional`] (vLLM 0.23 and earlier): each event an array,
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`.
//!
//! One page event becomes one vLLM event with one block hash. `token_ids` and
//! `parent_block_hash` are what the engine sent with the store ([`TokenTable`]), else
//! `[]` and nil. `lora_id` and `lora_name` are nil; `block_size` is the namespace's page
//! tokens, and `medium` the tier (`GPU`, `CPU_PINNED`; the pool `SHARED` for a Mooncake
//! Store, `STORAGE` with `locality: "LOCAL"` for the node-local pool, see [`PoolMedium`]).
//! `AllBlocksCleared` carries no medium in vLLM's format, so a clear of any tier is sent
//! as one.
//!
//! Block hashes ([`HashFormat`]): by default every page hash is sent as an integer, its
//! low 64 bits (the last 8 bytes, big-endian), as vLLM does with
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` and as Dynamo's indexer requires; an 8-byte hash
//! is its own value. The full hash stays in kvtier's own JSON events (admin
//! `/v1/events`). `bytes` sends msgpack `bin` of the whole hash instead.
//!
//! Replay ([`replay`]): a ROUTER socket; a request `[start_seq (8 bytes big-endian)]` is
//! answered with every batch from that sequence the replay buffer still holds, then an
//! end marker, in vLLM's 0.26+ form (`[topic, seq, payload]` … `[b"", −1, b""]`) or its
//! earlier one (`[seq, payload]` … `[−1, b""]`), per [`VllmConfig::replay`].

mod decode;

pub mod replay;

pub use decode::{BlockHash, DecodeError, VllmBatch, VllmEvent, decode_batch};
pub use replay::{ReplayLimits, ReplayProtocol};

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{
    AtomicBool,
    Ordering::{Relaxed, Release},
};

use super::tokens::{PageTokens, TokenTable};
use super::wire::Writer;
use super::{
    POLL, PublishError, PublisherHandle, PublisherStats, bind, pub_socket, send_batch, start, wall_clock, zmq_err,
};
use crate::events::{PageEvent, PageEventKind};
use crate::manager::Manager;
use crate::page::{NamespaceId, PageHash};
use tokio_util::sync::CancellationToken;

/// The replay end marker: −1 as 8 bytes big-endian.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// How the events inside a batch are encoded (the batch is an array either way).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Encoding {
    /// Maps tagged by `type`: what vLLM 0.24 and later send and decode.
    #[default]
    Tagged,
    /// Arrays, tag first: what vLLM 0.23 and earlier send and decode.
    Positional,
}

/// How page hashes are rendered as vLLM block hashes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HashFormat {
    /// Always an integer: the low 64 bits (last 8 bytes, big-endian), as vLLM renders
    /// a wide hash; lossy for hashes longer than 8 bytes.
    #[default]
    Int,
    /// 8-byte hashes as integers, longer ones as bytes.
    Auto,
    /// Always bytes.
    Bytes,
}

/// What the pool tier is, for the `medium` (and `locality`) of pool pages' events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PoolMedium {
    /// A store shared by the nodes of a cluster (Mooncake): `medium: "SHARED"`, no
    /// `locality`.
    #[default]
    Shared,
    /// The node-local shared-memory pool: vLLM 0.33's own pair for a secondary tier on
    /// this node, `medium: "STORAGE"` and `locality: "LOCAL"` (the positional encoding of
    /// vLLM 0.23 and earlier has no `locality` field; there the medium alone says it).
    Local,
}

impl PoolMedium {
    /// The `medium` string of a pool page's events.
    pub fn medium(self) -> &'static str {
        match self {
            PoolMedium::Shared => "SHARED",
            PoolMedium::Local => "STORAGE",
        }
    }

    /// The `locality` of a pool page's events, where one is sent.
    pub fn locality(self) -> Option<&'static str> {
        match self {
            PoolMedium::Shared => None,
            PoolMedium::Local => Some("LOCAL"),
        }
    }
}

/// Settings of the vLLM publisher.
#[derive(Clone, Debug)]
pub struct VllmConfig {
    /// PUB endpoint to bind. Default: `tcp://127.0.0.1:5570` (beside vLLM's own 5557).
    pub endpoint: String,
    /// ROUTER replay endpoint to bind, if any. Default: `tcp://127.0.0.1:5571`.
    pub replay_endpoint: Option<String>,
    /// Topic frame. Default: empty (vLLM's default).
    pub topic: String,
    /// Default: [`Encoding::Tagged`].
    pub encoding: Encoding,
    /// Default: [`HashFormat::Int`].
    pub hashes: HashFormat,
    /// Replay answer form. Default: [`ReplayProtocol::Auto`] (follows the encoding).
    pub replay: ReplayProtocol,
    /// Per-peer replay request limits. Default: [`ReplayLimits::default`].
    pub replay_limits: ReplayLimits,
    /// Token ids and parents engines sent with stores. Default: none (`token_ids: []`).
    pub tokens: Option<Arc<TokenTable>>,
    /// `data_parallel_rank` of every batch. Default: 0.
    pub dp_rank: u32,
    /// Most page events in one batch. Default: 1024.
    pub max_batch_events: usize,
    /// Batches kept for replay. Default: 10 000.
    pub replay_batches: usize,
    /// Bytes of batches kept for replay. Default: 64 MiB.
    pub replay_bytes: usize,
    /// ZMQ send high-water mark (messages). Default: 100 000.
    pub hwm: i32,
    /// What the pool tier is (the daemon sets it from `pool`). Default:
    /// [`PoolMedium::Shared`].
    pub pool_medium: PoolMedium,
}

impl Default for VllmConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:5570".into(),
            replay_endpoint: Some("tcp://127.0.0.1:5571".into()),
            topic: String::new(),
            encoding: Encoding::Tagged,
            hashes: HashFormat::Int,
            replay: ReplayProtocol::Auto,
            replay_limits: ReplayLimits::default(),
            tokens: None,
            dp_rank: 0,
            max_batch_events: 1024,
            replay_batches: 10_000,
            replay_bytes: 64 << 20,
            hwm: 100_000,
            pool_medium: PoolMedium::Shared,
        }
    }
}

/// Encodes page events as one vLLM `EventBatch`. `block_size` gives a namespace's page
/// tokens, `tokens` what the engine sent with a page (if anything).
pub fn encode_batch(
    buf: &mut Vec<u8>,
    cfg: &VllmConfig,
    ts: f64,
    events: &[PageEvent],
    mut block_size: impl FnMut(NamespaceId) -> u32,
) {
    encode_batch_with(buf, cfg, ts, events, &mut block_size, &mut |_| None)
}

/// [`encode_batch`] with a lookup of the tokens and parent of each stored page.
pub fn encode_batch_with(
    buf: &mut Vec<u8>,
    cfg: &VllmConfig,
    ts: f64,
    events: &[PageEvent],
    block_size: &mut dyn FnMut(NamespaceId) -> u32,
    tokens: &mut dyn FnMut(&PageEvent) -> Option<PageTokens>,
) {
    let tagged = cfg.encoding == Encoding::Tagged;
    let mut w = Writer::new(buf);
    w.array(3);
    w.f64(ts);
    w.array(events.len());
    for ev in events {
        let field = |w: &mut Writer, name: &str| {
            if tagged {
                w.str(name);
            }
        };
        let (medium, locality) = match ev.tier {
            crate::tier::TierKind::Pool => (cfg.pool_medium.medium(), cfg.pool_medium.locality()),
            tier => (tier.medium(), None),
        };
        // `locality` is a trailing map key (vLLM 0.33 `BlockStored`/`BlockRemoved`); the
        // positional encoding has no place for it.
        let locality = locality.filter(|_| tagged);
        let fields = match ev.kind {
            PageEventKind::Stored => 8,
            PageEventKind::Removed => 3,
            PageEventKind::Cleared => 1,
        } + usize::from(locality.is_some() && ev.kind != PageEventKind::Cleared);
        if tagged {
            w.map(fields);
            w.str("type");
        } else {
            w.array(fields);
        }
        match ev.kind {
            PageEventKind::Stored => {
                let t = tokens(ev);
                w.str("BlockStored");
                field(&mut w, "block_hashes");
                w.array(1);
                hash(&mut w, cfg.hashes, &ev.hash);
                field(&mut w, "parent_block_hash");
                match t.as_ref().and_then(|t| t.parent) {
                    Some(p) => hash(&mut w, cfg.hashes, &p),
                    None => w.nil(),
                }
                field(&mut w, "token_ids");
                let ids: &[u32] = t.as_ref().map_or(&[], |t| &t.tokens);
                w.array(ids.len());
                for &id in ids {
                    w.uint(id.into());
                }
                field(&mut w, "block_size");
                w.uint(block_size(ev.ns) as u64);
                field(&mut w, "lora_id");
                w.nil();
                field(&mut w, "medium");
                w.str(medium);
                field(&mut w, "lora_name");
                w.nil();
                if let Some(l) = locality {
                    field(&mut w, "locality");
                    w.str(l);
                }
            }
            PageEventKind::Removed => {
                w.str("BlockRemoved");
                field(&mut w, "block_hashes");
                w.array(1);
                hash(&mut w, cfg.hashes, &ev.hash);
                field(&mut w, "medium");
                w.str(medium);
                if let Some(l) = locality {
                    field(&mut w, "locality");
                    w.str(l);
                }
            }
            PageEventKind::Cleared => w.str("AllBlocksCleared"),
        }
    }
    w.uint(cfg.dp_rank as u64);
}

/// The low 64 bits of a hash: its last 8 bytes, big-endian (vLLM's
/// `int.from_bytes(hash, "big") & (2**64 - 1)`).
pub fn low_u64(h: &PageHash) -> u64 {
    let b = h.as_bytes();
    let tail = &b[b.len().saturating_sub(8)..];
    let mut last = [0u8; 8];
    last[8 - tail.len()..].copy_from_slice(tail);
    u64::from_be_bytes(last)
}

fn hash(w: &mut Writer, fmt: HashFormat, h: &PageHash) {
    match fmt {
        HashFormat::Auto if h.len() == 8 => w.uint(low_u64(h)),
        HashFormat::Int => w.uint(low_u64(h)),
        HashFormat::Auto | HashFormat::Bytes => w.bin(h.as_bytes()),
    }
}

/// Starts the publisher: binds its sockets, then publishes every page event from the
/// log's next sequence on, until stopped or `shutdown`.
pub fn spawn(cfg: VllmConfig, manager: Manager, shutdown: CancellationToken) -> Result<PublisherHandle, PublishError> {
    if cfg.max_batch_events == 0 || cfg.replay_batches == 0 {
        return Err(PublishError::Config(
            "max_batch_events and replay_batches must be positive".into(),
        ));
    }
    let ctx = zmq::Context::new();
    let (publ, endpoint) = pub_socket(&ctx, &cfg.endpoint, cfg.hwm)?;
    let replay = match &cfg.replay_endpoint {
        Some(e) => {
            let r = ctx.socket(zmq::ROUTER).map_err(zmq_err("ROUTER socket"))?;
            r.set_linger(500).map_err(zmq_err("ROUTER linger"))?;
            r.set_sndtimeo(1000).map_err(zmq_err("ROUTER send timeout"))?;
            // A full replay plus its end marker fits in the queue of a slow subscriber.
            let hwm = i32::try_from(2 * (cfg.replay_batches + 1)).unwrap_or(i32::MAX);
            r.set_sndhwm(hwm).map_err(zmq_err("ROUTER hwm"))?;
            let bound = bind(&r, e)?;
            Some((r, bound))
        }
        None => None,
    };
    let replay_endpoint = replay.as_ref().map(|(_, e)| e.clone());
    let first = manager.pages().events().last_seq() + 1;
    let handle = start(
        "kvtier-pub-vllm",
        first,
        endpoint,
        replay_endpoint,
        move |stop, stats| {
            let _ctx = ctx;
            let form = match (cfg.replay, cfg.encoding) {
                (ReplayProtocol::Auto, Encoding::Tagged) => ReplayProtocol::Topic,
                (ReplayProtocol::Auto, Encoding::Positional) => ReplayProtocol::Legacy,
                (f, _) => f,
            };
            let topic = cfg.topic.as_bytes().to_vec();
            let replay = replay.map(|(r, _)| replay::Replayer::new(r, form, topic, cfg.replay_limits));
            run(cfg, manager, publ, replay, stop, shutdown, stats)
        },
    )?;
    tracing::info!(endpoint = %handle.endpoint, replay = ?handle.replay_endpoint, "vLLM KV event publisher started");
    Ok(handle)
}

fn run(
    cfg: VllmConfig,
    manager: Manager,
    publ: zmq::Socket,
    mut replay: Option<replay::Replayer>,
    stop: Arc<AtomicBool>,
    shutdown: CancellationToken,
    stats: Arc<PublisherStats>,
) {
    let topic = cfg.topic.as_bytes().to_vec();
    let mut next = stats.next_event.load(Relaxed);
    let mut seq = 0u64;
    let mut buffer: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    let mut buffered_bytes = 0usize;
    let mut sizes: HashMap<NamespaceId, u32> = HashMap::new();
    while !stop.load(Relaxed) && !shutdown.is_cancelled() {
        if let Some(r) = &mut replay {
            r.serve(&buffer, &stats);
        }
        let batch = manager.pages().events().read_from(next, cfg.max_batch_events, POLL);
        if batch.lost > 0 {
            stats.lost.fetch_add(batch.lost, Relaxed);
            tracing::warn!(lost = batch.lost, "vLLM publisher fell behind the event ring");
        }
        next = batch.next;
        if batch.events.is_empty() {
            stats.next_event.store(next, Release);
            continue;
        }
        let mut payload = Vec::with_capacity(48 * batch.events.len() + 32);
        let ts = wall_clock().as_secs_f64();
        let table = cfg.tokens.as_deref();
        encode_batch_with(
            &mut payload,
            &cfg,
            ts,
            &batch.events,
            &mut |ns| {
                *sizes
                    .entry(ns)
                    .or_insert_with(|| manager.pages().layout(ns).map_or(0, |l| l.page_tokens()))
            },
            &mut |ev| table.and_then(|t| t.get(ev.ns, &ev.hash)),
        );
        if let Err(e) = send_batch(&publ, &topic, seq, &payload) {
            tracing::warn!(error = %e, seq, "vLLM publisher: send failed");
        }
        stats.batches.fetch_add(1, Relaxed);
        stats.events.fetch_add(batch.events.len() as u64, Relaxed);
        buffered_bytes += payload.len();
        buffer.push_back((seq, payload));
        while buffer.len() > cfg.replay_batches || (buffered_bytes > cfg.replay_bytes && buffer.len() > 1) {
            if let Some((_, p)) = buffer.pop_front() {
                buffered_bytes -= p.len();
            }
        }
        seq += 1;
        // After the batch is sent and counted: whoever sees the log read this far sees
        // its counts too.
        stats.next_event.store(next, Release);
    }
}

#[cfg(test)]
mod tests;
