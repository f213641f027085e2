//! Object events for a shared-pool indexer, in the Mooncake store event shape.
//!
//! A page becoming complete in the pool tier yields one `stored` event per pool object
//! key of the page (the keys [`KeyScheme::page_keys`](crate::page::KeyScheme::page_keys)
//! gives, so they match what is in the store); a page that stops being complete there
//! yields one `removed` per key; a pool clear yields one `cleared` with an empty key.
//! Events of other tiers are not published here.
//!
//! Wire format: ZMQ PUB `[topic, seq (8 bytes big-endian, from 1 as Mooncake's own
//! publisher counts, no gaps), payload]`; `payload` is msgpack
//! `[timestamp_ms, [event, …], dp_rank]` and each event a map with the fields of Mooncake's
//! store publisher (`kv_event_publisher.cpp`, legacy-compat fields on), in its order, then
//! kvtier's two:
//!
//! - Mooncake's: `event_id` (per object event, from 1), `timestamp` (ms), `event_type`
//!   (`stored` / `removed` / `cleared`), `type` (`BlockStored` / `BlockRemoved` /
//!   `AllBlocksCleared`), `model_name`, `block_size` (page tokens), `additional_salt`,
//!   `lora_name` (the namespace's, nil when empty or unknown; Mooncake's master sends nil),
//!   `tenant_id` (`default` unless configured), `backend_id` (`kvtier`), `group_id` (nil
//!   when empty), `medium` ([`MEDIUM`]), `dp_rank`, `object_key`, `seq_hashes` and
//!   `block_hashes` (the page hash's low 64 bits, as vLLM renders a wide hash; `[]` for a
//!   clear), `base_block_idx` (0 on stored, nil otherwise) and, on stored only,
//!   `parent_hash`, `token_ids` and `parent_block_hash` (nil: an object is not a position
//!   in a token chain);
//! - kvtier's: `page_hash` (the full hash, hex) and `seq` (the page event's sequence).
//!
//! Other nodes' pool indexes read these ([`crate::pool::index`]), as they read a master's.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{
    AtomicBool,
    Ordering::{Relaxed, Release},
};

use super::wire::Writer;
use super::{POLL, PublishError, PublisherHandle, PublisherStats, send_batch, start_bound, wall_clock};
use crate::events::{PageEvent, PageEventKind};
use crate::manager::Manager;
use crate::page::{Namespace, NamespaceId};
use crate::tier::TierKind;
use tokio_util::sync::CancellationToken;

/// Settings of the Mooncake-style object event publisher.
#[derive(Clone, Debug)]
pub struct MooncakeConfig {
    /// PUB endpoint to bind. Default: `tcp://127.0.0.1:5572`.
    pub endpoint: String,
    /// Topic frame. Default: empty.
    pub topic: String,
    /// `tenant_id` of every event. Default: `default` (Mooncake's).
    pub tenant_id: String,
    /// `backend_id` of every event. Default: `kvtier`.
    pub backend_id: String,
    /// `group_id` of every event. Default: empty.
    pub group_id: String,
    /// `dp_rank` of every batch. Default: 0.
    pub dp_rank: u32,
    /// Most object events in one batch. Default: 4096.
    pub max_batch_objects: usize,
    /// ZMQ send high-water mark (messages). Default: 100 000.
    pub hwm: i32,
}

impl Default for MooncakeConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:5572".into(),
            topic: String::new(),
            tenant_id: "default".into(),
            backend_id: "kvtier".into(),
            group_id: String::new(),
            dp_rank: 0,
            max_batch_objects: 4096,
            hwm: 100_000,
        }
    }
}

/// One object event before encoding.
pub(super) struct ObjectEvent<'a> {
    pub(super) key: String,
    pub(super) ev: &'a PageEvent,
    /// The page's namespace and page tokens, when known.
    pub(super) ns: Option<(&'a Namespace, u32)>,
}

impl ObjectEvent<'_> {
    /// An upper bound of the event's encoded size: the fixed fields and their names
    /// (under 512 bytes), the key, and the namespace's strings.
    fn approx_bytes(&self, cfg: &MooncakeConfig) -> usize {
        let names = self.ns.map_or(0, |(n, _)| n.model.len() + n.salt.len() + n.lora.len());
        let ids = cfg.tenant_id.len() + cfg.backend_id.len() + cfg.group_id.len();
        512 + self.key.len() + names + ids
    }
}

/// The `medium` of every event: the store's objects live in its memory segments, which
/// Mooncake's master names `cpu`.
pub const MEDIUM: &str = "cpu";

/// Encodes a batch; event ids continue from `*event_id` (the next one to give).
pub(super) fn encode(
    buf: &mut Vec<u8>,
    cfg: &MooncakeConfig,
    ts_ms: u64,
    objs: &[ObjectEvent<'_>],
    event_id: &mut u64,
) {
    let mut w = Writer::new(buf);
    w.array(3);
    w.uint(ts_ms);
    w.array(objs.len());
    let opt_str = |w: &mut Writer, s: Option<&str>| match s.filter(|s| !s.is_empty()) {
        Some(s) => w.str(s),
        None => w.nil(),
    };
    for o in objs {
        let (rfc, legacy) = match o.ev.kind {
            PageEventKind::Stored => ("stored", "BlockStored"),
            PageEventKind::Removed => ("removed", "BlockRemoved"),
            PageEventKind::Cleared => ("cleared", "AllBlocksCleared"),
        };
        let stored = o.ev.kind == PageEventKind::Stored;
        // Mooncake's 16 fields with the legacy ones on, then by kind: stored adds
        // base_block_idx, parent_hash, token_ids, parent_block_hash; others add
        // base_block_idx. kvtier adds page_hash and seq.
        w.map(if stored { 22 } else { 19 });
        w.str("event_id");
        w.uint(*event_id);
        *event_id += 1;
        w.str("timestamp");
        w.uint(ts_ms);
        w.str("event_type");
        w.str(rfc);
        w.str("type");
        w.str(legacy);
        w.str("model_name");
        opt_str(&mut w, o.ns.map(|(n, _)| n.model.as_str()));
        w.str("block_size");
        match o.ns {
            Some((_, tokens)) => w.uint(tokens.into()),
            None => w.nil(),
        }
        w.str("additional_salt");
        opt_str(&mut w, o.ns.map(|(n, _)| n.salt.as_str()));
        w.str("lora_name");
        opt_str(&mut w, o.ns.map(|(n, _)| n.lora.as_str()));
        w.str("tenant_id");
        w.str(&cfg.tenant_id);
        w.str("backend_id");
        w.str(&cfg.backend_id);
        w.str("group_id");
        opt_str(&mut w, Some(cfg.group_id.as_str()));
        w.str("medium");
        w.str(MEDIUM);
        w.str("dp_rank");
        w.uint(cfg.dp_rank as u64);
        w.str("object_key");
        w.str(&o.key);
        let cleared = o.ev.kind == PageEventKind::Cleared;
        for name in ["seq_hashes", "block_hashes"] {
            w.str(name);
            if cleared {
                w.array(0);
            } else {
                w.array(1);
                w.uint(super::vllm::low_u64(&o.ev.hash));
            }
        }
        w.str("base_block_idx");
        if stored {
            // A pool object is a standalone block: depth 0, as Mooncake's master sends.
            w.uint(0);
            for name in ["parent_hash", "token_ids", "parent_block_hash"] {
                w.str(name);
                w.nil();
            }
        } else {
            w.nil();
        }
        w.str("page_hash");
        w.hex_str(o.ev.hash.as_bytes());
        w.str("seq");
        w.uint(o.ev.seq);
    }
    w.uint(cfg.dp_rank as u64);
}

/// Starts the publisher: binds its socket, then publishes the object events of every pool
/// page event from the log's next sequence on, until stopped or `shutdown`.
pub fn spawn(
    cfg: MooncakeConfig,
    manager: Manager,
    shutdown: CancellationToken,
) -> Result<PublisherHandle, PublishError> {
    if cfg.max_batch_objects == 0 {
        return Err(PublishError::Config("max_batch_objects must be positive".into()));
    }
    let first = manager.pages().events().last_seq() + 1;
    let endpoint = cfg.endpoint.clone();
    start_bound(
        "kvtier-pub-mooncake",
        "Mooncake object event",
        &endpoint,
        cfg.hwm,
        first,
        move |publ, stop, stats| run(cfg, manager, publ, stop, shutdown, stats),
    )
}

fn run(
    cfg: MooncakeConfig,
    manager: Manager,
    publ: zmq::Socket,
    stop: Arc<AtomicBool>,
    shutdown: CancellationToken,
    stats: Arc<PublisherStats>,
) {
    let topic = cfg.topic.as_bytes().to_vec();
    let mut next = stats.next_event.load(Relaxed);
    // Mooncake's publisher numbers batches and events from 1.
    let mut seq = 1u64;
    let mut event_id = 1u64;
    let mut schemes = HashMap::new();
    let mut names: HashMap<NamespaceId, Namespace> = HashMap::new();
    let max_events = cfg.max_batch_objects.clamp(1, 1024);
    while !stop.load(Relaxed) && !shutdown.is_cancelled() {
        let batch = manager.pages().events().read_from(next, max_events, POLL);
        if batch.lost > 0 {
            stats.lost.fetch_add(batch.lost, Relaxed);
            tracing::warn!(lost = batch.lost, "Mooncake publisher fell behind the event ring");
        }
        next = batch.next;
        let pool = || batch.events.iter().filter(|e| e.tier == TierKind::Pool);
        if pool().any(|e| e.kind != PageEventKind::Cleared && !names.contains_key(&e.ns)) {
            names.extend(manager.pages().namespaces().into_iter().map(|(id, n, _)| (id, n)));
        }
        let mut objs = Vec::new();
        for ev in pool() {
            if ev.kind == PageEventKind::Cleared {
                objs.push(ObjectEvent {
                    key: String::new(),
                    ev,
                    ns: None,
                });
                continue;
            }
            let Some((scheme, layout)) = scheme_of(&manager, &mut schemes, ev.ns) else {
                continue;
            };
            let ns = names.get(&ev.ns).map(|n| (n, layout.page_tokens()));
            for key in scheme.page_keys(layout, &ev.hash) {
                objs.push(ObjectEvent { key, ev, ns });
            }
        }
        for chunk in batches(&objs, &cfg) {
            let mut payload = Vec::with_capacity(160 * chunk.len() + 16);
            encode(
                &mut payload,
                &cfg,
                wall_clock().as_millis() as u64,
                chunk,
                &mut event_id,
            );
            if let Err(e) = send_batch(&publ, &topic, seq, &payload) {
                tracing::warn!(error = %e, seq, "Mooncake publisher: send failed");
            }
            stats.batches.fetch_add(1, Relaxed);
            stats.events.fetch_add(chunk.len() as u64, Relaxed);
            seq += 1;
        }
        // After the batches are sent and counted: whoever sees the log read this far sees
        // their counts too.
        stats.next_event.store(next, Release);
    }
}

/// The most payload bytes a message is cut to hold (as estimated by
/// [`ObjectEvent::approx_bytes`]): a quarter of what a subscriber takes
/// ([`crate::pool::index::sync::MAX_MESSAGE_BYTES`]), whatever the names in the keys.
pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;

/// `objs` cut into messages of at most `max_objects` events and about
/// [`MAX_PAYLOAD_BYTES`] (a single larger event still goes, alone).
fn batches<'a, 'b>(objs: &'b [ObjectEvent<'a>], cfg: &MooncakeConfig) -> Vec<&'b [ObjectEvent<'a>]> {
    let max_objects = cfg.max_batch_objects.max(1);
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, o) in objs.iter().enumerate() {
        let b = o.approx_bytes(cfg);
        if i > start && (i - start >= max_objects || bytes + b > MAX_PAYLOAD_BYTES) {
            out.push(&objs[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += b;
    }
    if start < objs.len() {
        out.push(&objs[start..]);
    }
    out
}

type Schemes = HashMap<NamespaceId, Option<(crate::page::KeyScheme, crate::layout::Layout)>>;

fn scheme_of<'a>(
    m: &Manager,
    cache: &'a mut Schemes,
    ns: NamespaceId,
) -> Option<&'a (crate::page::KeyScheme, crate::layout::Layout)> {
    cache
        .entry(ns)
        .or_insert_with(|| match (m.pages().key_scheme(ns), m.pages().layout(ns)) {
            (Ok(k), Ok(l)) => Some((k, l)),
            _ => {
                tracing::warn!(ns = ns.0, "Mooncake publisher: events of an unknown namespace skipped");
                None
            }
        })
        .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::PageHash;

    #[test]
    fn messages_stay_within_what_a_subscriber_takes_whatever_the_names() {
        use crate::pool::index::events::{ObjectEvent as Read, decode_payload};
        let evs: Vec<PageEvent> = (0..600u64)
            .map(|i| PageEvent {
                seq: i,
                kind: PageEventKind::Stored,
                tier: TierKind::Pool,
                ns: NamespaceId(0),
                hash: PageHash::from_u64(i),
                at_ms: 0,
            })
            .collect();
        // Names at the protocol's bound of 4 KiB each, keys that long too.
        let name = Namespace {
            model: "m".repeat(4096),
            lora: "l".repeat(4096),
            salt: "s".repeat(4096),
        };
        let cfg = MooncakeConfig::default();
        let objs: Vec<ObjectEvent> = evs
            .iter()
            .map(|ev| ObjectEvent {
                key: format!("{}_{}_0_k", "k".repeat(4096), ev.hash.to_hex()),
                ev,
                ns: Some((&name, 16)),
            })
            .collect();
        let cut = batches(&objs, &cfg);
        assert!(cut.len() > 1, "600 events of ~16 KiB do not fit one message");
        let mut read = Vec::new();
        for chunk in &cut {
            let mut buf = Vec::new();
            encode(&mut buf, &cfg, 1, chunk, &mut 1);
            assert!(buf.len() <= MAX_PAYLOAD_BYTES, "{} bytes", buf.len());
            assert!(buf.len() as i64 <= crate::pool::index::sync::MAX_MESSAGE_BYTES);
            read.extend(decode_payload(&buf).unwrap().0);
        }
        let want: Vec<Read> = objs.iter().map(|o| Read::Stored(o.key.clone())).collect();
        assert_eq!(read, want, "every event, once, in order");
        // Small events are cut by count only.
        let small = MooncakeConfig {
            max_batch_objects: 256,
            ..MooncakeConfig::default()
        };
        let plain: Vec<ObjectEvent> = evs
            .iter()
            .map(|ev| ObjectEvent {
                key: "k".into(),
                ev,
                ns: None,
            })
            .collect();
        let sizes: Vec<usize> = batches(&plain, &small).iter().map(|c| c.len()).collect();
        assert_eq!(sizes, [256, 256, 88]);
    }

    #[test]
    fn shape_is_timestamp_events_rank() {
        let ev = PageEvent {
            seq: 9,
            kind: PageEventKind::Stored,
            tier: TierKind::Pool,
            ns: NamespaceId(0),
            hash: PageHash::from_u64(1),
            at_ms: 0,
        };
        let cfg = MooncakeConfig {
            tenant_id: "t".into(),
            group_id: "g".into(),
            dp_rank: 2,
            ..MooncakeConfig::default()
        };
        let name = Namespace {
            model: "m".into(),
            lora: String::new(),
            salt: "s".into(),
        };
        let objs = [ObjectEvent {
            key: "k_0_k".into(),
            ev: &ev,
            ns: Some((&name, 16)),
        }];
        let mut buf = Vec::new();
        let mut event_id = 1;
        encode(&mut buf, &cfg, 1234, &objs, &mut event_id);
        assert_eq!(event_id, 2);
        let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
        let a = v.as_array().unwrap();
        assert_eq!((a[0].as_u64(), a[2].as_u64()), (Some(1234), Some(2)));
        let m = a[1].as_array().unwrap()[0].as_map().unwrap();
        let pairs: Vec<(String, String)> = m
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().into(), v.to_string()))
            .collect();
        let field = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
        let want = [
            ("event_id", "1"),
            ("timestamp", "1234"),
            ("event_type", "\"stored\""),
            ("type", "\"BlockStored\""),
            ("model_name", "\"m\""),
            ("block_size", "16"),
            ("additional_salt", "\"s\""),
            ("lora_name", "nil"),
            ("tenant_id", "\"t\""),
            ("backend_id", "\"kvtier\""),
            ("group_id", "\"g\""),
            ("medium", "\"cpu\""),
            ("dp_rank", "2"),
            ("object_key", "\"k_0_k\""),
            ("seq_hashes", "[1]"),
            ("block_hashes", "[1]"),
            ("base_block_idx", "0"),
            ("parent_hash", "nil"),
            ("token_ids", "nil"),
            ("parent_block_hash", "nil"),
            ("page_hash", "\"0000000000000001\""),
            ("seq", "9"),
        ];
        let names: Vec<&str> = pairs.iter().map(|(n, _)| n.as_str()).collect();
        let order: Vec<&str> = want.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, order, "Mooncake's field order, then kvtier's");
        for (k, v) in want {
            assert_eq!(field(k), v, "{k}");
        }
        // A removal: base_block_idx nil and no chain fields; an empty group_id is nil.
        let gone = PageEvent {
            kind: PageEventKind::Removed,
            ..ev
        };
        let objs = [ObjectEvent {
            key: "k_0_k".into(),
            ev: &gone,
            ns: None,
        }];
        let mut buf = Vec::new();
        let plain = MooncakeConfig::default();
        encode(&mut buf, &plain, 1, &objs, &mut event_id);
        let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
        let m = v.as_array().unwrap()[1].as_array().unwrap()[0]
            .as_map()
            .unwrap()
            .clone();
        let get = |k: &str| {
            m.iter()
                .find(|(n, _)| n.as_str() == Some(k))
                .map(|(_, v)| v.to_string())
        };
        assert_eq!(m.len(), 19);
        assert_eq!(get("type").as_deref(), Some("\"BlockRemoved\""));
        assert_eq!(get("base_block_idx").as_deref(), Some("nil"));
        assert_eq!(get("group_id").as_deref(), Some("nil"));
        assert_eq!(get("parent_block_hash"), None);
        assert_eq!(MooncakeConfig::default().tenant_id, "default");
    }
}
