//! Readable tables for the admin commands' answers.

use std::fmt::Write;

use serde_json::Value;

/// Left-aligned columns, two spaces apart.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: Vec<&str>| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<0$}", w[i]))
            .collect();
        let _ = writeln!(out, "{}", s.join("  ").trim_end());
    };
    line(&mut out, header.to_vec());
    for r in rows {
        line(&mut out, r.iter().map(String::as_str).collect());
    }
    out
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// A page size as people write it: `4 KiB`, `2 MiB`, `1 GiB`.
fn page_size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b % 1024 == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

pub fn status(v: &Value) -> String {
    let mut out = format!(
        "kvtier {}  up {:.1} s  {} pages  event seq {}  open grants {}\n\n",
        s(&v["version"]),
        v["uptime_s"].as_f64().unwrap_or(0.0),
        s(&v["pages"]),
        s(&v["event_seq"]),
        s(&v["open_grants"]),
    );
    out.push_str(&tiers(&v["tiers"]));
    if let Some(l) = lookups(&v["lookups"]) {
        let _ = writeln!(out, "\n{l}");
    }
    let arena = &v["host_arena"];
    if arena.is_object() {
        let _ = write!(
            out,
            "\nhost arena  {} slots of {} bytes, {} used  {} pages stored, {} arena bytes per page",
            s(&arena["slots"]),
            s(&arena["slot_bytes"]),
            s(&arena["used_slots"]),
            s(&arena["stored_pages"]),
            arena["bytes_per_stored_page"]
                .as_f64()
                .map_or("-".into(), |b| format!("{b:.0}")),
        );
        if let (Some(o), Some(p)) = (arena["overhead"].as_f64(), arena["page_bytes"].as_u64()) {
            let _ = write!(out, " ({o:.3}x the page's own {p})");
        }
        for m in arena["models"].as_array().into_iter().flatten() {
            let _ = write!(
                out,
                "\n            model {}: {} arena bytes per page, {:.3}x its own {}",
                // JSON-quoted: an engine's model name reaches the terminal escaped.
                m["model"],
                s(&m["arena_bytes_per_page"]),
                m["overhead"].as_f64().unwrap_or(0.0),
                s(&m["page_bytes"]),
            );
        }
        let mapping = &arena["mapping"];
        if let Some(p) = mapping["page_bytes"].as_u64() {
            let _ = write!(out, "\n            mapped with {} pages", page_size(p));
            if let Some(why) = mapping["small_pages_why"].as_str() {
                let _ = write!(out, " (no huge pages: {why})");
            }
            if let Some(why) = mapping["gpu_pin_refusal"].as_str() {
                let _ = write!(out, "\n            GPU engines cannot pin it: {why}");
            }
        }
        out.push('\n');
    }
    let keep = &v["host_keep"];
    if keep.is_object() {
        let _ = writeln!(
            out,
            "\nhost keep  manifest {} bytes, {} live records, {} compactions, {} resyncs  {} fenced slots",
            s(&keep["manifest_bytes"]),
            s(&keep["manifest_live_records"]),
            s(&keep["manifest_compactions"]),
            s(&keep["manifest_resyncs"]),
            s(&keep["fenced_slots"]),
        );
    }
    let pool = &v["pool"];
    if pool.is_object() {
        let health = match (&pool["health"]["state"], pool["started"].as_bool()) {
            (_, Some(false)) => "not started (starts with the first engine)".to_string(),
            (Value::String(st), _) if st == "ok" => "ok".to_string(),
            (_, _) => format!("DEGRADED: {}", s(&pool["health"]["reason"])),
        };
        let _ = write!(
            out,
            "
pool {}  {}",
            s(&pool["backend"]),
            health
        );
        if let Some(r) = pool["remote"].as_object() {
            let g = |k: &str| r.get(k).and_then(Value::as_u64).unwrap_or(0);
            let _ = write!(
                out,
                "  shared: {} existence queries, {} pages found, {} remote hits, {} not found on get",
                g("exists_queries"),
                g("found_pages"),
                g("remote_hit_pages"),
                g("get_not_found")
            );
        }
        if let Some(via) = pool["exists_via"].as_str() {
            let _ = write!(out, "  (existence via {via})");
        }
        if let Some(v) = pool["master_version"].as_str() {
            let _ = write!(out, "  master version {v}");
        }
        if let Some(p) = pool["mapping_page_bytes"].as_u64() {
            let _ = write!(out, "  mapped with {} pages", page_size(p));
        }
        if let Some(ix) = pool["index"].as_object() {
            let g = |k: &str| ix.get(k).and_then(Value::as_u64).unwrap_or(0);
            let mode = match ix.get("mode").and_then(Value::as_str) {
                Some("in_sync") => "in sync: lookups answered here".to_string(),
                _ => format!(
                    "SYNCING ({}): lookups ask the master",
                    ix.get("last_loss").and_then(Value::as_str).unwrap_or("")
                ),
            };
            let _ = write!(
                out,
                "\npool index {mode}; {} keys, {} events, {} resyncs, {} index lookups, {} pages engines credit themselves",
                g("keys"),
                g("events"),
                g("resyncs"),
                g("index_lookups"),
                g("engine_pages")
            );
        }
        out.push('\n');
    }
    let engines = v["engines"].as_array().cloned().unwrap_or_default();
    if engines.is_empty() {
        out.push_str("\nno engines connected\n");
    } else {
        let rows: Vec<Vec<String>> = engines
            .iter()
            .map(|e| {
                vec![
                    s(&e["instance"]),
                    s(&e["namespace"]),
                    format!("{}/{}", s(&e["tp_rank"]), s(&e["tp_size"])),
                    format!("{}/{}", s(&e["pp_rank"]), s(&e["pp_size"])),
                    s(&e["dp_rank"]),
                    s(&e["pid"]),
                ]
            })
            .collect();
        out.push('\n');
        out.push_str(&table(&["INSTANCE", "NAMESPACE", "TP", "PP", "DP", "PID"], &rows));
    }
    out
}

fn tiers(v: &Value) -> String {
    let rows: Vec<Vec<String>> = v
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| {
                    [
                        "tier",
                        "unit",
                        "capacity",
                        "used",
                        "complete_pages",
                        "pinned_pages",
                        "inflight_pages",
                        "evictions",
                    ]
                    .iter()
                    .map(|k| s(&t[*k]))
                    .collect()
                })
                .collect()
        })
        .unwrap_or_default();
    table(
        &[
            "TIER",
            "UNIT",
            "CAPACITY",
            "USED",
            "COMPLETE",
            "PINNED",
            "IN-FLIGHT",
            "EVICTIONS",
        ],
        &rows,
    )
}

pub fn sessions(v: &Value) -> String {
    let list = v["sessions"].as_array().cloned().unwrap_or_default();
    if list.is_empty() {
        return "no sessions\n".into();
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|x| {
            ["session_id", "parent_session_id", "phase", "idle", "pages"]
                .iter()
                .map(|k| s(&x[*k]))
                .collect()
        })
        .collect();
    let mut out = table(&["SESSION", "PARENT", "PHASE", "IDLE", "PAGES"], &rows);
    if v["truncated"] == Value::Bool(true) {
        // The daemon answers one page of sessions; say that the list goes on.
        out.push_str(&format!(
            "first {} of {} sessions (more from /v1/sessions?offset={})\n",
            list.len(),
            s(&v["total"]),
            s(&v["next_offset"])
        ));
    }
    out
}

pub fn pages(v: &Value) -> String {
    let per_page = v["objects_per_page"].as_u64().unwrap_or(0);
    let rows: Vec<Vec<String>> = v["pages"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|p| {
                    let mut row = vec![s(&p["hash"])];
                    if p["known"] != Value::Bool(true) {
                        row.extend(["unknown".to_string(), String::new(), String::new()]);
                        return row;
                    }
                    for t in p["tiers"].as_array().into_iter().flatten() {
                        let missing = t["missing"].as_array().map_or(0, |m| m.len());
                        let mut cell = if t["complete"] == Value::Bool(true) {
                            "complete".to_string()
                        } else if missing as u64 == per_page {
                            "-".to_string()
                        } else {
                            format!("missing {missing}/{per_page}")
                        };
                        if t["pinned"] == Value::Bool(true) {
                            cell.push_str(" pinned");
                        }
                        row.push(cell);
                    }
                    row
                })
                .collect()
        })
        .unwrap_or_default();
    // Where each pool page came from: written here, or found in a shared pool.
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .zip(v["pages"].as_array().into_iter().flatten())
        .map(|(mut row, p)| {
            row.push(match p["pool_origin"].as_str() {
                Some("found_in_pool") => "found in pool".to_string(),
                Some("written_here") => "written here".to_string(),
                _ => String::new(),
            });
            row
        })
        .collect();
    let mut out = table(&["HASH", "DEVICE", "HOST", "POOL", "POOL ORIGIN"], &rows);
    if let Some(p) = v.get("complete_prefix") {
        let _ = writeln!(
            out,
            "\ncomplete prefix: device {}  host {}  pool {}",
            s(&p["device"]),
            s(&p["host"]),
            s(&p["pool"])
        );
    }
    out
}

pub fn outcome(v: &Value) -> String {
    let mut out = format!("{}: {}", s(&v["kind"]), s(&v["outcome"]));
    for k in ["pages", "applied", "requested", "reason"] {
        if let Some(x) = v.get(k) {
            let _ = write!(out, "  {k}={}", s(x));
        }
    }
    out.push('\n');
    out
}

/// A KvHint envelope's report: one line per action, with its outcome or error and the
/// source it named.
pub fn kv_hints(v: &Value) -> String {
    let mut out = format!(
        "envelope {} (protocol {})\n",
        s(&v["message_id"]),
        s(&v["protocol_version"])
    );
    for a in v["actions"].as_array().into_iter().flatten() {
        let _ = write!(
            out,
            "  {} {}@{}: ",
            s(&a["action_id"]),
            s(&a["action_type"]),
            s(&a["action_version"])
        );
        match a.get("outcome") {
            Some(o) => {
                out.push_str(&s(&o["outcome"]));
                for k in ["pages", "applied", "requested", "reason"] {
                    if let Some(x) = o.get(k) {
                        let _ = write!(out, "  {k}={}", s(x));
                    }
                }
            }
            None => {
                let _ = write!(out, "error: {}", s(&a["error"]));
            }
        }
        if let Some(src) = a.get("source_control_endpoint") {
            let _ = write!(out, "  source={}", s(src));
        }
        out.push('\n');
    }
    out
}

/// One JSON event line as `seq kind tier ns hash`.
pub fn event_line(line: &str) -> String {
    match serde_json::from_str::<Value>(line) {
        Ok(v) if v.get("lost").is_some() => format!("(lost {} events)", s(&v["lost"])),
        // A session event (`kvtier events --sessions`): pause or resume, and why.
        Ok(v) if v.get("session_id").is_some() => format!(
            "{:>8}  {:<7}  {:<13}  util {:.3}  paused {} ms  {}",
            s(&v["seq"]),
            s(&v["kind"]),
            s(&v["reason"]),
            v["utilisation"].as_f64().unwrap_or(0.0),
            s(&v["paused_ms"]),
            s(&v["session_id"])
        ),
        Ok(v) => format!(
            "{:>8}  {:<7}  {:<6}  ns {}  {}",
            s(&v["seq"]),
            s(&v["kind"]),
            s(&v["tier"]),
            s(&v["ns"]),
            s(&v["hash"])
        ),
        Err(_) => line.to_string(),
    }
}

/// The daemon's lookup latency in a line: lookups timed, their mean, and the bucket
/// bounds (`bounds_s`, one fewer than the buckets) the median and the 99th percentile
/// fall under (`None` before the first).
fn lookups(v: &Value) -> Option<String> {
    let l = &v["latency"];
    let bounds: Vec<f64> = v["bounds_s"].as_array()?.iter().filter_map(Value::as_f64).collect();
    let count = l["count"].as_u64().filter(|&c| c > 0)?;
    let buckets: Vec<u64> = l["buckets"].as_array()?.iter().filter_map(Value::as_u64).collect();
    let mean_us = l["sum_ns"].as_u64().unwrap_or(0) as f64 / count as f64 / 1e3;
    let under = |q: f64| -> String {
        let want = (q * count as f64).ceil() as u64;
        let mut cum = 0;
        for (i, n) in buckets.iter().enumerate() {
            cum += n;
            if cum >= want {
                return bounds.get(i).map_or_else(
                    || format!("> {}", bounds.last().map_or("-".into(), |b| duration(*b))),
                    |b| format!("<= {}", duration(*b)),
                );
            }
        }
        "-".into()
    };
    Some(format!(
        "lookups  {count} answered, mean {mean_us:.1} µs, p50 {}, p99 {}",
        under(0.5),
        under(0.99)
    ))
}

/// Seconds as people read a latency bound: `5 µs`, `500 µs`, `20 ms`, `1 s`.
fn duration(s: f64) -> String {
    match s {
        s if s >= 1.0 => format!("{s} s"),
        s if s >= 1e-3 => format!("{} ms", (s * 1e3).round()),
        s => format!("{} µs", (s * 1e6).round()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_session_event_line_says_what_and_why() {
        let line = r#"{"seq":4,"at_ms":9,"kind":"resume","session_id":"s-1","reason":"cap_expired","host_used_pages":97,"host_capacity_pages":100,"utilisation":0.97,"paused_ms":1800}"#;
        assert_eq!(
            event_line(line),
            "       4  resume   cap_expired    util 0.970  paused 1800 ms  s-1"
        );
    }

    #[test]
    fn the_lookup_line_names_the_buckets_its_percentiles_fall_under() {
        // 100 lookups: 60 under 20 µs, 39 under 50 µs, one past 1 s.
        let bounds = [5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2, 1e-1, 1.0];
        let mut buckets = vec![0u64; bounds.len() + 1];
        (buckets[2], buckets[3], buckets[12]) = (60, 39, 1);
        let l = |count: u64, sum_ns: u64, buckets: &[u64]| json!({"latency": {"count": count, "sum_ns": sum_ns, "buckets": buckets}, "bounds_s": bounds});
        assert_eq!(
            lookups(&l(100, 3_500_000, &buckets)).as_deref(),
            Some("lookups  100 answered, mean 35.0 µs, p50 <= 20 µs, p99 <= 50 µs")
        );
        buckets[12] = 2;
        let line = lookups(&l(101, 0, &buckets)).unwrap();
        assert!(line.ends_with("p99 > 1 s"), "{line}");
        assert_eq!(lookups(&l(0, 0, &[])), None);
        assert_eq!(duration(0.02), "20 ms");
        assert_eq!(duration(1.0), "1 s");
    }

    #[test]
    fn a_truncated_session_list_says_where_it_goes_on() {
        let one = json!({"session_id": "a", "parent_session_id": null, "phase": null, "idle": false, "pages": null});
        let whole = sessions(&json!({ "sessions": [one] }));
        assert_eq!(whole.lines().count(), 2, "{whole}");
        let cut = sessions(&json!({ "sessions": [one], "truncated": true, "next_offset": 1, "total": 5 }));
        assert_eq!(
            cut.lines().last(),
            Some("first 1 of 5 sessions (more from /v1/sessions?offset=1)")
        );
    }
}
