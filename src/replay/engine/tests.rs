use super::*;
use crate::page::PageHash;
use crate::replay::workload::{Request, SessionSpec};

fn req(at: u64, session: usize, blocks: &[u64]) -> Request {
    Request {
        arrival_ms: at,
        session,
        input_tokens: blocks.len() as u64 * 10,
        output_tokens: 1,
        blocks: blocks.iter().map(|&b| PageHash::from_u64(b)).collect(),
        tool_end_ms: None,
        tool_names: Vec::new(),
    }
}

fn workload(requests: Vec<Request>, sessions: usize) -> Workload {
    Workload {
        name: "hand".into(),
        block_tokens: 10,
        sessions: (0..sessions)
            .map(|i| SessionSpec {
                id: format!("s{i}"),
                parent: None,
                ends_explicitly: false,
            })
            .collect(),
        requests,
    }
}

fn config(device: usize, host: usize, pool: usize) -> EngineConfig {
    EngineConfig {
        capacity: Capacity {
            device_pages: device,
            host_pages: host,
            pool_pages: pool,
        },
        page_bytes: 100,
        page_layout: "test".into(),
        cost: CostModel::default(),
        pressure: PressureConfig::default(),
        idle_timeout_ms: 60_000,
        tool_end_lead_ms: 0,
    }
}

fn hits(w: &Workload, cfg: &EngineConfig, p: PolicyKind) -> (Vec<usize>, PolicyRun) {
    let run = run_policy(w, cfg, p, &mut || {}).unwrap();
    (run.requests.iter().map(|o| o.hit_pages.iter().sum()).collect(), run)
}

#[test]
fn session_aware_demotes_what_the_device_evicts_and_the_others_lose_it() {
    // Session 0 returns after session 1 pushed it off a 2-page device.
    let w = workload(
        vec![req(0, 0, &[1, 2]), req(1000, 1, &[3, 4]), req(2000, 0, &[1, 2, 5])],
        2,
    );
    let cfg = config(2, 2, 0);
    let (lru, lru_run) = hits(&w, &cfg, PolicyKind::DeviceLru);
    assert_eq!(lru, vec![0, 0, 0]);
    assert_eq!(lru_run.bytes, BytesMoved::default());
    // Write-through's host holds the same two pages as the device: 1 and 2 are gone too.
    let (wt, wt_run) = hits(&w, &cfg, PolicyKind::WriteThrough);
    assert_eq!(wt, vec![0, 0, 0]);
    assert_eq!(wt_run.bytes.device_host, 7 * 100, "every computed page written through");
    let (sa, sa_run) = hits(&w, &cfg, PolicyKind::SessionAware);
    assert_eq!(sa, vec![0, 0, 2]);
    assert!(sa_run.bytes.device_host >= 2 * 100);
    assert_eq!(sa_run.bytes.host_device, 2 * 100, "1 and 2 came back from host");
}

#[test]
fn the_pool_catches_what_host_drops() {
    let w = workload(
        vec![
            req(0, 0, &[1, 2]),
            req(1000, 1, &[3, 4]),
            req(2000, 2, &[5, 6]),
            req(3000, 0, &[1, 2]),
        ],
        3,
    );
    let (none, _) = hits(&w, &config(2, 2, 0), PolicyKind::SessionAware);
    assert_eq!(none[3], 0);
    let (pool, run) = hits(&w, &config(2, 2, 6), PolicyKind::SessionAware);
    assert_eq!(pool[3], 2);
    // Host was full, so the pressure controller paused the acting session 0 and its pages
    // went to the pool; its next turn resumed it and staged them back to host first.
    assert_eq!(run.requests[3].hit_pages[1] + run.requests[3].hit_pages[2], 2);
    assert!(!run.pauses_ms.is_empty(), "session 0 was paused and resumed");
    assert!(run.bytes.host_pool >= 2 * 100 && run.bytes.pool_host >= 2 * 100);
}

#[test]
fn ended_sessions_go_before_live_ones() {
    // Session 0 ends explicitly after its request; session 1 waits on a tool. When the
    // device and host fill, session 0's pages go first and session 1 still hits.
    let mut w = workload(
        vec![
            req(0, 1, &[10, 11]),
            req(10, 0, &[1, 2]),
            req(1000, 2, &[20, 21]),
            req(1100, 2, &[20, 21, 22]),
            req(3000, 1, &[10, 11, 12]),
        ],
        3,
    );
    w.sessions[0].ends_explicitly = true;
    let (sa, _) = hits(&w, &config(2, 4, 0), PolicyKind::SessionAware);
    assert_eq!(sa[4], 2, "the live session kept its prefix");
}

#[test]
fn costs_follow_the_model() {
    let c = CostModel::default();
    // 20 000 tokens recomputed at 20 000/s, 25 MB over 25 GB/s, 10 tokens at 20 ms.
    let ms = c.latency_ms(20_000, 25_000_000, 0, 10);
    assert!((ms - (1000.0 + 1.0 + 200.0)).abs() < 1e-6, "{ms}");
    assert_eq!(
        PolicyKind::ALL.map(PolicyKind::name),
        [
            "device-lru",
            "write-through",
            "exclusive-lru",
            "session-aware",
            "session-aware-no-lineage",
            "session-aware-no-phases",
            "session-aware-no-pressure",
            "session-aware-no-ended"
        ]
    );
    assert!(c.validate().is_ok());
    let bad = CostModel {
        prefill_tokens_per_s: 0.0,
        ..c
    };
    assert!(matches!(bad.validate(), Err(ReplayError::Config(_))));
}

#[test]
fn acting_sessions_pages_go_first_only_where_a_pool_takes_them() {
    // Sessions 0 and 1 wait on tools when session 2's pages overflow device (2) and host
    // (6). Without a pool nothing says whose pages to drop but recency: session-aware
    // evicts as exclusive-lru does. With a pool, the acting sessions' pages go first, to
    // the pool, and come back when their next turns arrive.
    let w = workload(
        vec![
            req(0, 1, &[10, 11]),
            req(100, 1, &[10, 11, 12]),
            req(200, 0, &[1, 2]),
            req(300, 2, &[20, 21, 22, 23, 24]),
            req(400, 1, &[10, 11, 12, 13]),
            req(500, 0, &[1, 2]),
        ],
        3,
    );
    let (sa, _) = hits(&w, &config(2, 6, 0), PolicyKind::SessionAware);
    let (ex, _) = hits(&w, &config(2, 6, 0), PolicyKind::ExclusiveLru);
    assert_eq!(sa, ex);
    assert!(sa[4] < 3, "{sa:?}");
    let (pooled, run) = hits(&w, &config(2, 6, 16), PolicyKind::SessionAware);
    assert_eq!((pooled[4], pooled[5]), (3, 2), "{pooled:?}");
    assert!(run.bytes.host_pool > 0);
}
