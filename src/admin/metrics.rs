//! `/metrics`: the manager's counters in the Prometheus text exposition format (0.0.4).
//!
//! Families: tier capacity/usage (bytes for host and pool, pages for device), complete,
//! pinned and in-flight pages, hit and miss pages, bytes moved and copy latency per tier
//! pair, hint outcomes by kind, evictions, the event sequence, uptime and engines.

use std::fmt::Write;
use std::time::Duration;

use crate::manager::{COPY_BUCKETS_S, LOOKUP_BUCKETS_S, StatsSnapshot};
use crate::tier::TierKind;

/// Renders the whole exposition.
pub fn render(s: &StatsSnapshot, uptime: Duration, engines: usize) -> String {
    let mut o = String::with_capacity(8 << 10);
    let bytes_tiers: Vec<_> = s.tiers.iter().filter(|t| t.unit == "bytes").collect();
    family(
        &mut o,
        "kvtier_tier_capacity_bytes",
        "gauge",
        "Capacity of a byte-counted tier.",
    );
    for t in &bytes_tiers {
        sample(
            &mut o,
            "kvtier_tier_capacity_bytes",
            &[("tier", t.tier.name())],
            t.capacity as f64,
        );
    }
    family(
        &mut o,
        "kvtier_tier_used_bytes",
        "gauge",
        "Bytes in use in a byte-counted tier.",
    );
    for t in &bytes_tiers {
        sample(
            &mut o,
            "kvtier_tier_used_bytes",
            &[("tier", t.tier.name())],
            t.used as f64,
        );
    }
    let d = s.tier(TierKind::Device);
    family(
        &mut o,
        "kvtier_device_capacity_pages",
        "gauge",
        "Device pages attached (one rank's region per namespace).",
    );
    sample(&mut o, "kvtier_device_capacity_pages", &[], d.capacity as f64);
    for (name, help, get) in [
        (
            "kvtier_tier_complete_pages",
            "Pages complete in a tier.",
            (|t| t.complete_pages) as fn(&crate::manager::TierStats) -> u64,
        ),
        ("kvtier_tier_pinned_pages", "Pages pinned in a tier.", |t| {
            t.pinned_pages
        }),
        (
            "kvtier_tier_inflight_pages",
            "Pages with objects being written into a tier.",
            |t| t.inflight_pages,
        ),
    ] {
        family(&mut o, name, "gauge", help);
        for t in &s.tiers {
            sample(&mut o, name, &[("tier", t.tier.name())], get(t) as f64);
        }
    }
    family(
        &mut o,
        "kvtier_evictions_total",
        "counter",
        "Pages evicted from a tier.",
    );
    for t in &s.tiers {
        sample(
            &mut o,
            "kvtier_evictions_total",
            &[("tier", t.tier.name())],
            t.evictions as f64,
        );
    }
    family(&mut o, "kvtier_lookups_total", "counter", "Prefix lookups.");
    sample(&mut o, "kvtier_lookups_total", &[], s.lookups as f64);
    family(
        &mut o,
        "kvtier_hit_pages_total",
        "counter",
        "Looked-up pages credited to a tier.",
    );
    for t in TierKind::ALL {
        sample(
            &mut o,
            "kvtier_hit_pages_total",
            &[("tier", t.name())],
            s.hit_pages[t.index()] as f64,
        );
    }
    family(
        &mut o,
        "kvtier_miss_pages_total",
        "counter",
        "Looked-up pages found in no tier.",
    );
    sample(&mut o, "kvtier_miss_pages_total", &[], s.miss_pages as f64);
    family(
        &mut o,
        "kvtier_moved_bytes_total",
        "counter",
        "Bytes moved between tiers.",
    );
    for m in &s.moved {
        sample(
            &mut o,
            "kvtier_moved_bytes_total",
            &[("from", m.from.name()), ("to", m.to.name())],
            m.bytes as f64,
        );
    }
    let h = "kvtier_copy_duration_seconds";
    family(
        &mut o,
        h,
        "histogram",
        "Latency of one copy between tiers (a page, or a batch of pool objects).",
    );
    for c in &s.copy_latency {
        let labels = [("from", c.from.name()), ("to", c.to.name())];
        histogram(&mut o, h, &labels, &COPY_BUCKETS_S, &c.buckets, c.sum_s, c.count);
    }
    let h = "kvtier_lookup_duration_seconds";
    family(
        &mut o,
        h,
        "histogram",
        "How long the daemon took to answer a lookup, from reading the request to its answer.",
    );
    let l = &s.lookup_latency;
    histogram(
        &mut o,
        h,
        &[],
        &LOOKUP_BUCKETS_S,
        &l.buckets,
        l.sum_ns as f64 / 1e9,
        l.count,
    );
    family(&mut o, "kvtier_hints_total", "counter", "Hint outcomes by hint kind.");
    for c in &s.hints {
        sample(
            &mut o,
            "kvtier_hints_total",
            &[("kind", c.kind.name()), ("outcome", c.outcome)],
            c.count as f64,
        );
    }
    for (name, help, v) in [
        (
            "kvtier_event_seq",
            "Sequence number of the newest page event.",
            s.event_seq,
        ),
        ("kvtier_pages", "Pages the directory tracks.", s.pages),
        (
            "kvtier_open_grants",
            "Store and load grants in progress.",
            s.open_grants,
        ),
        ("kvtier_deferred_hints", "Hints waiting to apply.", s.deferred_hints),
        (
            "kvtier_connected_engines",
            "Engine ranks connected to the daemon.",
            engines as u64,
        ),
    ] {
        family(&mut o, name, "gauge", help);
        sample(&mut o, name, &[], v as f64);
    }
    family(
        &mut o,
        "kvtier_upkeep_ticks_total",
        "counter",
        "Upkeep runs finished (pin expiry, the session policy's step, eviction by watermark).",
    );
    sample(&mut o, "kvtier_upkeep_ticks_total", &[], s.upkeep_ticks as f64);
    family(
        &mut o,
        "kvtier_recovery_total",
        "counter",
        "What start-up recovery found: pages recovered, pages discarded by reason, manifest records skipped, unreadable manifests.",
    );
    for (reason, n) in crate::manager::RECOVERY_REASONS.iter().zip(s.recovery) {
        sample(&mut o, "kvtier_recovery_total", &[("reason", reason)], n as f64);
    }
    family(
        &mut o,
        "kvtier_uptime_seconds",
        "gauge",
        "Seconds since the admin server started.",
    );
    sample(&mut o, "kvtier_uptime_seconds", &[], uptime.as_secs_f64());
    o
}

/// The pressure controller's pauses and resumes, per reason (the session events routers
/// subscribe to), and the newest event's sequence.
pub fn render_session_events(o: &mut String, log: &crate::manager::SessionEventLog) {
    family(
        o,
        "kvtier_session_events_total",
        "counter",
        "Sessions the pressure controller paused or resumed, by reason (each is one session event).",
    );
    for (kind, reason, n) in log.counts() {
        let kind = match kind {
            crate::manager::SessionEventKind::Pause => "pause",
            crate::manager::SessionEventKind::Resume => "resume",
        };
        sample(
            o,
            "kvtier_session_events_total",
            &[("type", kind), ("reason", reason.name())],
            n as f64,
        );
    }
    family(
        o,
        "kvtier_session_events_last_seq",
        "gauge",
        "Sequence of the newest session event.",
    );
    sample(o, "kvtier_session_events_last_seq", &[], log.last_seq() as f64);
}

/// The session policy's move queue: calls queued, done, that waited for room or were
/// dropped (back-pressure), drained on the caller's thread, and the queue's depth.
pub fn render_policy_moves(o: &mut String, c: &crate::manager::MoveCounts) {
    family(
        o,
        "kvtier_policy_moves_total",
        "counter",
        "Session-policy calls whose pool moves (demote, stage) were queued, done, waited for room, dropped on a full queue, or drained on the caller's thread.",
    );
    for (what, n) in [
        ("queued", c.queued),
        ("done", c.done),
        ("waited", c.waited),
        ("dropped", c.dropped),
        ("inline", c.inline),
    ] {
        sample(o, "kvtier_policy_moves_total", &[("outcome", what)], n as f64);
    }
    family(
        o,
        "kvtier_policy_move_queue",
        "gauge",
        "Session-policy calls whose pool moves wait for the drainer.",
    );
    sample(o, "kvtier_policy_move_queue", &[], c.depth as f64);
}

/// What a full session table of the policy did with new sessions: freed the session idle
/// longest, or refused the new one (every session was active).
pub fn render_session_table(o: &mut String, p: &crate::policy::PolicyStats) {
    family(
        o,
        "kvtier_session_table_full_total",
        "counter",
        "New sessions that found the policy's session table full: an idle session was freed for them, or they were refused (every session active).",
    );
    for (what, n) in [
        ("freed_idle", p.sessions_freed_full),
        ("refused", p.sessions_refused_full),
    ] {
        sample(o, "kvtier_session_table_full_total", &[("outcome", what)], n as f64);
    }
}

/// The pool's backend and health, and on a shared pool the discovery counters: existence
/// queries and their latency, the answer cache, pages found in the pool and credited from
/// it, pages that vanished, gets that found nothing.
pub fn render_pool(o: &mut String, p: &crate::manager::PoolReport) {
    family(
        o,
        "kvtier_pool_info",
        "gauge",
        "The pool backend in use (1), with whether it is started, healthy and shared.",
    );
    let healthy = matches!(p.health, Some(crate::pool::PoolHealth::Ok));
    let state = match (&p.health, p.started) {
        (_, false) => "not_started",
        (Some(crate::pool::PoolHealth::Ok), _) => "ok",
        _ => "degraded",
    };
    sample(
        o,
        "kvtier_pool_info",
        &[
            ("backend", p.backend),
            ("state", state),
            ("shared", if p.shared { "true" } else { "false" }),
        ],
        1.0,
    );
    family(o, "kvtier_pool_healthy", "gauge", "1 when the pool answers, else 0.");
    sample(o, "kvtier_pool_healthy", &[], f64::from(u8::from(healthy)));
    if let Some(via) = p.exists_via {
        family(
            o,
            "kvtier_pool_exists_via",
            "gauge",
            "Who answers existence queries (1): the store's master itself, or the helper.",
        );
        sample(o, "kvtier_pool_exists_via", &[("via", via)], 1.0);
    }
    if let Some(i) = &p.integrity {
        family(
            o,
            "kvtier_pool_integrity_enabled",
            "gauge",
            "1 when every pool object carries a keyed MAC checked on every get.",
        );
        sample(o, "kvtier_pool_integrity_enabled", &[], f64::from(u8::from(i.on)));
        family(
            o,
            "kvtier_pool_integrity_rejected_total",
            "counter",
            "Pool objects whose MAC failed (or too short for one): never loaded, read as not found.",
        );
        sample(o, "kvtier_pool_integrity_rejected_total", &[], i.rejected as f64);
    }
    if let Some(ix) = &p.index {
        pool_index(o, ix);
    }
    let Some(r) = &p.remote else { return };
    let counters: [(&str, &str, u64); 10] = [
        (
            "kvtier_pool_exists_queries_total",
            "Batched existence queries sent to the shared pool.",
            r.exists_queries,
        ),
        (
            "kvtier_pool_exists_keys_total",
            "Object keys named by existence queries.",
            r.exists_keys,
        ),
        (
            "kvtier_pool_exists_failed_total",
            "Existence queries that failed (no pool credit given).",
            r.exists_failed,
        ),
        (
            "kvtier_pool_exists_cache_hits_total",
            "Candidate pages answered from the existence cache.",
            r.cache_hits,
        ),
        (
            "kvtier_pool_exists_cache_misses_total",
            "Candidate pages that needed the pool.",
            r.cache_misses,
        ),
        (
            "kvtier_pool_found_pages_total",
            "Pages other nodes wrote, found in the pool and entered into the directory.",
            r.found_pages,
        ),
        (
            "kvtier_pool_remote_hit_pages_total",
            "Pages credited to the pool in lookups that another node wrote.",
            r.remote_hit_pages,
        ),
        (
            "kvtier_pool_vanished_pages_total",
            "Pool pages dropped because the store no longer had all their objects.",
            r.vanished_pages,
        ),
        (
            "kvtier_pool_get_not_found_total",
            "Pool gets that answered not found (the page is then a miss).",
            r.get_not_found,
        ),
        (
            "kvtier_pool_unhealthy_lookups_total",
            "Lookups whose pool credit was withheld because the pool was unhealthy.",
            r.unhealthy_lookups,
        ),
    ];
    for (name, help, v) in counters {
        family(o, name, "counter", help);
        sample(o, name, &[], v as f64);
    }
    family(
        o,
        "kvtier_pool_exists_seconds_total",
        "counter",
        "Time spent in existence queries; divide by the query count for the mean latency.",
    );
    sample(o, "kvtier_pool_exists_seconds_total", &[], r.exists_ns as f64 / 1e9);
}

/// The pool helper's request queue (Mooncake), as of the helper's last probe: waiting and
/// running requests, those whose deadline passed in the queue, those refused with the
/// queue full, and the helper's restarts.
pub fn render_helper_queue(o: &mut String, q: &crate::pool::HelperQueue) {
    let gauges = [
        (
            "kvtier_pool_helper_queued",
            "Requests waiting in the pool helper's queue.",
            q.queued,
        ),
        (
            "kvtier_pool_helper_in_flight",
            "Requests the pool helper's workers are running.",
            q.in_flight,
        ),
    ];
    for (name, help, v) in gauges {
        family(o, name, "gauge", help);
        sample(o, name, &[], v as f64);
    }
    let counters = [
        (
            "kvtier_pool_helper_timed_out_in_queue_total",
            "Requests whose deadline passed in the pool helper's queue (never run).",
            q.timed_out_in_queue_total,
        ),
        (
            "kvtier_pool_helper_refused_full_total",
            "Requests the pool helper refused because its queue was full.",
            q.refused_full_total,
        ),
        (
            "kvtier_pool_helper_done_total",
            "Requests the pool helper ran to completion.",
            q.done_total,
        ),
        (
            "kvtier_pool_helper_restarts_total",
            "Times the pool helper was replaced (each drops this node's store segment).",
            q.restarts_total,
        ),
    ];
    for (name, help, v) in counters {
        family(o, name, "counter", help);
        sample(o, name, &[], v as f64);
    }
}

/// The manifest's upkeep (bytes, live object records, compactions, resyncs) and the host
/// slots the restart fence quarantines.
pub fn render_host_keep(o: &mut String, k: &crate::admin::HostKeep) {
    for (name, kind, help, v) in [
        (
            "kvtier_manifest_bytes",
            "gauge",
            "Bytes of the host arena's manifest file.",
            k.manifest_bytes,
        ),
        (
            "kvtier_manifest_live_records",
            "gauge",
            "Object records of pages on host that the manifest holds.",
            k.manifest_live_records,
        ),
        (
            "kvtier_manifest_compactions_total",
            "counter",
            "Times the manifest was rewritten from its live records.",
            k.manifest_compactions,
        ),
        (
            "kvtier_manifest_resyncs_total",
            "counter",
            "Times the manifest was rebuilt from the directory after the event ring lost events.",
            k.manifest_resyncs,
        ),
        (
            "kvtier_host_fenced_slots",
            "gauge",
            "Host slots quarantined by the restart fence (store grants open when the daemon stopped).",
            k.fenced_slots,
        ),
    ] {
        family(o, name, kind, help);
        sample(o, name, &[], v as f64);
    }
}

/// The pool index: its mode (`in_sync`: lookups answered here; `syncing`: they ask the
/// master) and its counters.
fn pool_index(o: &mut String, ix: &crate::pool::index::IndexSnapshot) {
    use crate::pool::index::IndexMode;
    family(
        o,
        "kvtier_pool_index_mode",
        "gauge",
        "The pool index's mode (1): in_sync answers lookups itself, syncing falls back to the master.",
    );
    for (mode, name) in [(IndexMode::InSync, "in_sync"), (IndexMode::Syncing, "syncing")] {
        let v = f64::from(u8::from(ix.mode == Some(mode)));
        sample(o, "kvtier_pool_index_mode", &[("mode", name)], v);
    }
    family(
        o,
        "kvtier_pool_index_keys",
        "gauge",
        "Object keys the pool index holds.",
    );
    sample(o, "kvtier_pool_index_keys", &[], ix.keys as f64);
    let counters: [(&str, &str, u64); 7] = [
        (
            "kvtier_pool_index_events_total",
            "Store/Remove object events applied to the index.",
            ix.events,
        ),
        (
            "kvtier_pool_index_sync_losses_total",
            "Times the index lost sync (gap, restart, unreachable master).",
            ix.sync_losses,
        ),
        (
            "kvtier_pool_index_resyncs_total",
            "Resyncs of the index from the store's listing.",
            ix.resyncs,
        ),
        (
            "kvtier_pool_index_resync_failures_total",
            "Resyncs that failed (retried).",
            ix.resync_failures,
        ),
        (
            "kvtier_pool_index_lookups_total",
            "Lookups answered from the index, with no master query.",
            ix.index_lookups,
        ),
        (
            "kvtier_pool_index_pages_total",
            "Pages those lookups checked (up to the first one missing an object).",
            ix.index_pages,
        ),
        (
            "kvtier_pool_index_forgotten_pages_total",
            "Pages dropped from the index because a get found an object gone.",
            ix.forgotten_pages,
        ),
    ];
    for (name, help, v) in counters {
        family(o, name, "counter", help);
        sample(o, name, &[], v as f64);
    }
    family(
        o,
        "kvtier_pool_index_engine_pages",
        "gauge",
        "Pages of the lookup file's pool page table: pool pages engines credit in their own lookups.",
    );
    sample(o, "kvtier_pool_index_engine_pages", &[], ix.engine_pages as f64);
    family(
        o,
        "kvtier_pool_index_last_resync_seconds",
        "gauge",
        "How long the last resync took.",
    );
    sample(
        o,
        "kvtier_pool_index_last_resync_seconds",
        &[],
        ix.last_resync_us as f64 / 1e6,
    );
}

fn family(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One histogram's samples: cumulative `_bucket`s over `bounds` (non-cumulative `counts`,
/// one more than `bounds` for `+Inf`), then `_sum` and `_count`, each with `labels`.
fn histogram(o: &mut String, h: &str, labels: &[(&str, &str)], bounds: &[f64], counts: &[u64], sum_s: f64, count: u64) {
    let mut cum = 0u64;
    for (i, n) in counts.iter().enumerate() {
        cum += n;
        let le = bounds.get(i).map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
        let mut with_le = labels.to_vec();
        with_le.push(("le", &le));
        sample(o, &format!("{h}_bucket"), &with_le, cum as f64);
    }
    sample(o, &format!("{h}_sum"), labels, sum_s);
    sample(o, &format!("{h}_count"), labels, count as f64);
}

fn sample(o: &mut String, name: &str, labels: &[(&str, &str)], v: f64) {
    o.push_str(name);
    if !labels.is_empty() {
        o.push('{');
        for (i, (k, val)) in labels.iter().enumerate() {
            if i > 0 {
                o.push(',');
            }
            // Label values here are fixed identifiers; escape anyway to stay well-formed.
            let esc = val.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
            let _ = write!(o, "{k}=\"{esc}\"");
        }
        o.push('}');
    }
    let _ = writeln!(o, " {v}");
}
