//! vLLM-compatible KV events.
//!
//! Wire format (vLLM `kv_events`): a ZMQ PUB message `[topic, seq, payload]` where `seq`
//! is the batch number as 8 bytes big-endian (0, 1, 2, … with no gaps) and `payload` a
//! msgpack `EventBatch`. Two encodings, chosen in [`VllmConfig::encoding`]:
//!
//! - positional (msgspec `array_like`): batch `[ts, [events], dp_rank]`;
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium, lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
//! - named (msgspec maps, tag field `type`): `{"ts", "events", "data_parallel_rank"}` and
//!   `{"type": "BlockStored", "block_hashes", …}` with the same fields.
//!
//! One page event becomes one vLLM event with one block hash: kvtier pages are not a
//! chain, so `parent_block_hash` is nil. kvtier never sees tokens: `token_ids` is `[]`,
//! `lora_id` and `lora_name` are nil. `block_size` is the namespace's page tokens, and
//! `medium` the tier (`GPU`, `CPU_PINNED`, `SHARED`). `AllBlocksCleared` carries no
//! medium in vLLM's format, so a clear of any tier is sent as one.
//!
//! Block hashes ([`HashFormat`]): by default an 8-byte page hash (vLLM's u64 block hash)
//! is sent as its big-endian integer and a longer one (a SHA-256 chain hash) as msgpack
//! `bin` of its bytes, the two shapes of vLLM's `ExternalBlockHash = bytes | int`.
//!
//! Replay: a ROUTER socket; a request `[start_seq (8 bytes big-endian)]` is answered with
//! every batch from that sequence the replay buffer still holds, `[seq, payload]` each,
//! then the end marker `[0xff × 8, b""]` (−1), as vLLM's publisher does.

mod decode;

pub use decode::{BlockHash, DecodeError, VllmBatch, VllmEvent, decode_batch};

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

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

/// Positional (array) or named (map) msgpack encoding of batches and events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    #[default]
    Positional,
    Named,
}

/// How page hashes are rendered as vLLM block hashes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HashFormat {
    /// 8-byte hashes as integers, longer ones as bytes.
    #[default]
    Auto,
    /// Always an integer: the first 8 bytes, big-endian (lossy for longer hashes).
    Int,
    /// Always bytes.
    Bytes,
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
    /// Default: [`Encoding::Positional`].
    pub encoding: Encoding,
    /// Default: [`HashFormat::Auto`].
    pub hashes: HashFormat,
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
}

impl Default for VllmConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:5570".into(),
            replay_endpoint: Some("tcp://127.0.0.1:5571".into()),
            topic: String::new(),
            encoding: Encoding::Positional,
            hashes: HashFormat::Auto,
            dp_rank: 0,
            max_batch_events: 1024,
            replay_batches: 10_000,
            replay_bytes: 64 << 20,
            hwm: 100_000,
        }
    }
}

/// Encodes page events as one vLLM `EventBatch`. `block_size` gives a namespace's page
/// tokens.
pub fn encode_batch(
    buf: &mut Vec<u8>,
    cfg: &VllmConfig,
    ts: f64,
    events: &[PageEvent],
    mut block_size: impl FnMut(NamespaceId) -> u32,
) {
    let named = cfg.encoding == Encoding::Named;
    let mut w = Writer::new(buf);
    if named {
        w.map(3);
        w.str("ts");
    } else {
        w.array(3);
    }
    w.f64(ts);
    if named {
        w.str("events");
    }
    w.array(events.len());
    for ev in events {
        let field = |w: &mut Writer, name: &str| {
            if named {
                w.str(name);
            }
        };
        let fields = match ev.kind {
            PageEventKind::Stored => 8,
            PageEventKind::Removed => 3,
            PageEventKind::Cleared => 1,
        };
        if named {
            w.map(fields);
            w.str("type");
        } else {
            w.array(fields);
        }
        match ev.kind {
            PageEventKind::Stored => {
                w.str("BlockStored");
                field(&mut w, "block_hashes");
                w.array(1);
                hash(&mut w, cfg.hashes, &ev.hash);
                field(&mut w, "parent_block_hash");
                w.nil();
                field(&mut w, "token_ids");
                w.array(0);
                field(&mut w, "block_size");
                w.uint(block_size(ev.ns) as u64);
                field(&mut w, "lora_id");
                w.nil();
                field(&mut w, "medium");
                w.str(ev.tier.medium());
                field(&mut w, "lora_name");
                w.nil();
            }
            PageEventKind::Removed => {
                w.str("BlockRemoved");
                field(&mut w, "block_hashes");
                w.array(1);
                hash(&mut w, cfg.hashes, &ev.hash);
                field(&mut w, "medium");
                w.str(ev.tier.medium());
            }
            PageEventKind::Cleared => w.str("AllBlocksCleared"),
        }
    }
    if named {
        w.str("data_parallel_rank");
    }
    w.uint(cfg.dp_rank as u64);
}

fn hash(w: &mut Writer, fmt: HashFormat, h: &PageHash) {
    match fmt {
        HashFormat::Auto if h.len() == 8 => w.uint(h.prefix_u64()),
        HashFormat::Int => w.uint(h.prefix_u64()),
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
            let bound = bind(&r, e)?;
            Some((r, bound))
        }
        None => None,
    };
    let replay_endpoint = replay.as_ref().map(|(_, e)| e.clone());
    let first = manager.events().last_seq() + 1;
    let handle = start(
        "kvtier-pub-vllm",
        first,
        endpoint,
        replay_endpoint,
        move |stop, stats| {
            let _ctx = ctx;
            run(cfg, manager, publ, replay.map(|(r, _)| r), stop, shutdown, stats)
        },
    )?;
    tracing::info!(endpoint = %handle.endpoint, replay = ?handle.replay_endpoint, "vLLM KV event publisher started");
    Ok(handle)
}

fn run(
    cfg: VllmConfig,
    manager: Manager,
    publ: zmq::Socket,
    replay: Option<zmq::Socket>,
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
        if let Some(r) = &replay {
            serve_replays(r, &buffer, &stats);
        }
        let batch = manager.events().read_from(next, cfg.max_batch_events, POLL);
        if batch.lost > 0 {
            stats.lost.fetch_add(batch.lost, Relaxed);
            tracing::warn!(lost = batch.lost, "vLLM publisher fell behind the event ring");
        }
        next = batch.next;
        stats.next_event.store(next, Relaxed);
        if batch.events.is_empty() {
            continue;
        }
        let mut payload = Vec::with_capacity(48 * batch.events.len() + 32);
        let ts = wall_clock().as_secs_f64();
        encode_batch(&mut payload, &cfg, ts, &batch.events, |ns| {
            *sizes
                .entry(ns)
                .or_insert_with(|| manager.layout(ns).map_or(0, |l| l.page_tokens()))
        });
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
    }
}

/// Answers the replay requests waiting on the ROUTER socket (a bounded number per call).
fn serve_replays(r: &zmq::Socket, buffer: &VecDeque<(u64, Vec<u8>)>, stats: &PublisherStats) {
    for _ in 0..16 {
        let frames = match r.recv_multipart(zmq::DONTWAIT) {
            Ok(f) => f,
            Err(_) => return,
        };
        // [identity, (empty delimiter,) start_seq]
        let (id, start) = match frames.as_slice() {
            [id, empty, start] if empty.is_empty() => (id, start),
            [id, start] => (id, start),
            _ => {
                tracing::warn!(frames = frames.len(), "vLLM replay: malformed request ignored");
                continue;
            }
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
            tracing::warn!(len = start.len(), "vLLM replay: start sequence is not 8 bytes");
            continue;
        };
        stats.replays.fetch_add(1, Relaxed);
        let send = |a: &[u8], b: &[u8]| r.send_multipart([id.as_slice(), b"", a, b], 0);
        for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
            if send(&seq.to_be_bytes(), payload).is_err() {
                break;
            }
        }
        let _ = send(&END_SEQ, b"");
    }
}

#[cfg(test)]
mod tests;
