//! Object events for a shared-pool indexer, in the Mooncake store event shape.
//!
//! A page becoming complete in the pool tier yields one `stored` event per pool object
//! key of the page (the keys [`KeyScheme::page_keys`](crate::page::KeyScheme::page_keys)
//! gives, so they match what is in the store); a page that stops being complete there
//! yields one `removed` per key; a pool clear yields one `cleared` with an empty key.
//! Events of other tiers are not published here.
//!
//! Wire format: ZMQ PUB `[topic, seq (8 bytes big-endian, from 0, no gaps), payload]`;
//! `payload` is msgpack `[timestamp_ms, [event, …], dp_rank]` and each event a map
//! `{event_type, object_key, tenant_id, group_id, page_hash, medium, seq}` (`seq`: the page
//! event's own sequence number; `medium`: `SHARED`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use super::wire::Writer;
use super::{POLL, PublishError, PublisherHandle, PublisherStats, pub_socket, send_batch, start, wall_clock};
use crate::events::{PageEvent, PageEventKind};
use crate::manager::Manager;
use crate::page::NamespaceId;
use crate::tier::TierKind;
use tokio_util::sync::CancellationToken;

/// Settings of the Mooncake-style object event publisher.
#[derive(Clone, Debug)]
pub struct MooncakeConfig {
    /// PUB endpoint to bind. Default: `tcp://127.0.0.1:5572`.
    pub endpoint: String,
    /// Topic frame. Default: empty.
    pub topic: String,
    /// `tenant_id` of every event. Default: empty.
    pub tenant_id: String,
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
            tenant_id: String::new(),
            group_id: String::new(),
            dp_rank: 0,
            max_batch_objects: 4096,
            hwm: 100_000,
        }
    }
}

/// One object event before encoding.
pub(super) struct ObjectEvent<'a> {
    pub(super) event_type: &'static str,
    pub(super) key: String,
    pub(super) ev: &'a PageEvent,
}

pub(super) fn encode(buf: &mut Vec<u8>, cfg: &MooncakeConfig, ts_ms: u64, objs: &[ObjectEvent<'_>]) {
    let mut w = Writer::new(buf);
    w.array(3);
    w.uint(ts_ms);
    w.array(objs.len());
    for o in objs {
        w.map(7);
        w.str("event_type");
        w.str(o.event_type);
        w.str("object_key");
        w.str(&o.key);
        w.str("tenant_id");
        w.str(&cfg.tenant_id);
        w.str("group_id");
        w.str(&cfg.group_id);
        w.str("page_hash");
        w.hex_str(o.ev.hash.as_bytes());
        w.str("medium");
        w.str(TierKind::Pool.medium());
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
    let ctx = zmq::Context::new();
    let (publ, endpoint) = pub_socket(&ctx, &cfg.endpoint, cfg.hwm)?;
    let first = manager.events().last_seq() + 1;
    let handle = start("kvtier-pub-mooncake", first, endpoint, None, move |stop, stats| {
        let _ctx = ctx;
        run(cfg, manager, publ, stop, shutdown, stats)
    })?;
    tracing::info!(endpoint = %handle.endpoint, "Mooncake object event publisher started");
    Ok(handle)
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
    let mut seq = 0u64;
    let mut schemes = HashMap::new();
    let max_events = cfg.max_batch_objects.clamp(1, 1024);
    while !stop.load(Relaxed) && !shutdown.is_cancelled() {
        let batch = manager.events().read_from(next, max_events, POLL);
        if batch.lost > 0 {
            stats.lost.fetch_add(batch.lost, Relaxed);
            tracing::warn!(lost = batch.lost, "Mooncake publisher fell behind the event ring");
        }
        next = batch.next;
        stats.next_event.store(next, Relaxed);
        let mut objs = Vec::new();
        for ev in batch.events.iter().filter(|e| e.tier == TierKind::Pool) {
            let event_type = match ev.kind {
                PageEventKind::Stored => "stored",
                PageEventKind::Removed => "removed",
                PageEventKind::Cleared => {
                    objs.push(ObjectEvent {
                        event_type: "cleared",
                        key: String::new(),
                        ev,
                    });
                    continue;
                }
            };
            let Some((scheme, layout)) = scheme_of(&manager, &mut schemes, ev.ns) else {
                continue;
            };
            for key in scheme.page_keys(layout, &ev.hash) {
                objs.push(ObjectEvent { event_type, key, ev });
            }
        }
        for chunk in objs.chunks(cfg.max_batch_objects) {
            let mut payload = Vec::with_capacity(160 * chunk.len() + 16);
            encode(&mut payload, &cfg, wall_clock().as_millis() as u64, chunk);
            if let Err(e) = send_batch(&publ, &topic, seq, &payload) {
                tracing::warn!(error = %e, seq, "Mooncake publisher: send failed");
            }
            stats.batches.fetch_add(1, Relaxed);
            stats.events.fetch_add(chunk.len() as u64, Relaxed);
            seq += 1;
        }
    }
}

type Schemes = HashMap<NamespaceId, Option<(crate::page::KeyScheme, crate::layout::Layout)>>;

fn scheme_of<'a>(
    m: &Manager,
    cache: &'a mut Schemes,
    ns: NamespaceId,
) -> Option<&'a (crate::page::KeyScheme, crate::layout::Layout)> {
    cache
        .entry(ns)
        .or_insert_with(|| match (m.key_scheme(ns), m.layout(ns)) {
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
        let objs = [ObjectEvent {
            event_type: "stored",
            key: "k_0_k".into(),
            ev: &ev,
        }];
        let mut buf = Vec::new();
        encode(&mut buf, &cfg, 1234, &objs);
        let v = rmpv::decode::read_value(&mut buf.as_slice()).unwrap();
        let a = v.as_array().unwrap();
        assert_eq!((a[0].as_u64(), a[2].as_u64()), (Some(1234), Some(2)));
        let m = a[1].as_array().unwrap()[0].as_map().unwrap();
        let pairs: Vec<(String, String)> = m
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().into(), v.to_string()))
            .collect();
        assert_eq!(pairs[0], ("event_type".into(), "\"stored\"".into()));
        assert_eq!(pairs[1], ("object_key".into(), "\"k_0_k\"".into()));
        assert_eq!(pairs[2], ("tenant_id".into(), "\"t\"".into()));
        assert_eq!(pairs[3], ("group_id".into(), "\"g\"".into()));
        assert_eq!(pairs[6], ("seq".into(), "9".into()));
    }
}
