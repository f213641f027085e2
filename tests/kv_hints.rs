//! Dynamo KvHint envelopes delivered to `kvtier serve`: from an engine through the client
//! library, from an operator through the admin socket and `kvtier hint
//! --envelope`. Pages that live only in the pool are prefetched back to host by
//! `kv.fetch@1.0`; `kv.fetch@2.0` and unknown actions are ignored with their reasons; bad
//! input (a malformed envelope, 10^6 hashes) gets a clear error while the daemon keeps
//! serving; every delivery shows up in `GET /v1/kv-hints`.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{admin_json, complete_prefix, hashes, identity, kvtier_bin, small_spec, squeeze_host};
use kvtier::client::ClientError;
use kvtier::hints::{HintOutcome, Reason};
use kvtier::page::PageHash;
use kvtier::protocol::ErrorCode;
use kvtier::tier::device::EmulatedDevice;
use serde_json::{Value, json};

/// An envelope as Dynamo's router writes it (`kv_hints.rs`'s shape): one `kv.fetch`.
fn envelope(message_id: &str, version: &str, pages: &[PageHash]) -> Value {
    let hashes: Vec<u64> = pages.iter().map(|h| h.prefix_u64()).collect();
    json!({
        "protocol_version": "0.1",
        "message_id": message_id,
        "actions": [{
            "action_id": format!("{message_id}-fetch"),
            "action_type": "kv.fetch",
            "action_version": version,
            "payload": {"source_control_endpoint": "tcp://10.1.2.3:25000", "block_hashes": hashes, "mode": "copy"}
        }]
    })
}

/// `kvtier serve` with its admin socket in `dir` and no TCP publishers (tests run side
/// by side).
struct Serve {
    child: std::process::Child,
    socket: std::path::PathBuf,
    admin: std::path::PathBuf,
}

impl Serve {
    fn start(dir: &Path) -> Self {
        let socket = dir.join("kvtier.sock");
        let admin = dir.join("admin.sock");
        let mut cmd = std::process::Command::new(kvtier_bin());
        cmd.args(["serve", "--socket"])
            .arg(&socket)
            .arg("--arena-path")
            .arg(dir.join("arena"))
            .args(["--arena-bytes", "4194304"]);
        let admin_set = format!("admin_socket={}", admin.display());
        for s in [
            "lock_arena=false",
            "prefault=false",
            "slot_bytes=128",
            "pool_bytes=8388608",
            "events_endpoint=",
            "pool_events_endpoint=",
            admin_set.as_str(),
        ] {
            cmd.args(["--set", s]);
        }
        let log = std::fs::File::create(dir.join("daemon.log")).unwrap();
        let child = cmd.stdout(std::process::Stdio::null()).stderr(log).spawn().unwrap();
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() || !admin.exists() {
            assert!(t.elapsed() < Duration::from_secs(10), "daemon did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        Self { child, socket, admin }
    }

    fn client(&self) -> kvtier::client::Client {
        let cfg = kvtier::client::ClientConfig::new(&self.socket, identity("hints", 0, 0, 1, 1), small_spec())
            .with_timeout(Duration::from_secs(10));
        kvtier::client::Client::connect(cfg).unwrap()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Leading pages of `pages` complete on host, as the admin socket reports them.
fn host_prefix(sock: &Path, pages: &[PageHash]) -> u64 {
    complete_prefix(sock, pages, "host")
}

/// Stores pages, copies them to the pool, then squeezes host so they leave it: afterwards
/// they are complete in the pool only.
fn pages_in_pool_only(admin_sock: &Path, c: &kvtier::client::Client, pages: &[PageHash], first_slot: u32) {
    let slots: Vec<u32> = (first_slot..first_slot + pages.len() as u32).collect();
    assert_eq!(c.store(pages, &slots, "").unwrap().complete as usize, pages.len());
    let demote = kvtier::hints::Hint::Demote {
        target: kvtier::hints::HintTarget::Pages(pages.to_vec()),
        to: kvtier::TierKind::Pool,
    };
    c.hint(demote).unwrap();
    squeeze_host(admin_sock, pages, Duration::from_secs(20));
}

#[test]
fn kv_fetch_envelopes_prefetch_to_host_through_client_and_admin() {
    let dir = tempfile::tempdir().unwrap();
    let d = Serve::start(dir.path());
    let admin_sock = d.admin.clone();
    let c = d.client();
    let layout = small_spec().build().unwrap();
    c.register_device(std::sync::Arc::new(EmulatedDevice::new(&layout, 0, 64)))
        .unwrap();

    // Through the client library: kv.fetch@1.0 brings pool-only pages back to host.
    let a = hashes(0x1000, 4);
    pages_in_pool_only(&admin_sock, &c, &a, 0);
    let report = c.kv_hints(&envelope("m-client", "1.0", &a).to_string()).unwrap();
    assert_eq!(report.message_id, "m-client");
    let act = &report.actions[0];
    assert_eq!(act.action_id, "m-client-fetch");
    assert_eq!(act.source_control_endpoint.as_deref(), Some("tcp://10.1.2.3:25000"));
    assert_eq!(act.pages, 4);
    assert_eq!(act.outcome, Some(HintOutcome::Accepted { pages: 4 }));
    assert_eq!(host_prefix(&admin_sock, &a), 4, "prefetched to host");

    // Through the admin socket, with a second action at a version kvtier does not know and
    // one it does not implement: each gets its own outcome.
    let b = hashes(0x2000, 3);
    pages_in_pool_only(&admin_sock, &c, &b, 8);
    let mut env = envelope("m-admin", "1.0", &b);
    let actions = env["actions"].as_array_mut().unwrap();
    let mut v2 = actions[0].clone();
    v2["action_id"] = json!("m-admin-v2");
    v2["action_version"] = json!("2.0");
    actions.push(v2);
    actions
        .push(json!({"action_id": "m-admin-x", "action_type": "kv.migrate", "action_version": "1.0", "payload": {}}));
    let (s, v) = admin_json(&admin_sock, "POST", "/v1/kv-hints", Some(env.to_string().as_bytes()));
    assert_eq!(s, 200, "{v}");
    let outcomes: Vec<(&str, Value)> = v["actions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["action_id"].as_str().unwrap(), a["outcome"].clone()))
        .collect();
    assert_eq!(
        outcomes,
        vec![
            ("m-admin-fetch", json!({"outcome": "accepted", "pages": 3})),
            (
                "m-admin-v2",
                json!({"outcome": "ignored", "reason": "unsupported_version"})
            ),
            ("m-admin-x", json!({"outcome": "ignored", "reason": "unknown_action"})),
        ]
    );
    assert_eq!(v["actions"][0]["source_control_endpoint"], "tcp://10.1.2.3:25000");
    assert_eq!(host_prefix(&admin_sock, &b), 3);

    // Pages kvtier does not hold: a soft outcome, not an error.
    let unknown = c
        .kv_hints(&envelope("m-unknown", "1.0", &hashes(0x9000, 2)).to_string())
        .unwrap();
    assert_eq!(
        unknown.actions[0].outcome,
        Some(HintOutcome::Ignored {
            reason: Reason::UnknownPages
        })
    );

    // Bad input: a clear error each, and the daemon keeps serving.
    let bad = c.kv_hints(r#"{"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch"}]}"#);
    assert!(
        matches!(&bad, Err(ClientError::Remote(e)) if e.code == ErrorCode::BadHint && e.message.contains("action_id")),
        "{bad:?}"
    );
    let huge: Vec<u64> = (0..1_000_000).collect();
    let huge = json!({"protocol_version": "0.1", "message_id": "huge", "actions": [{"action_id": "h",
        "action_type": "kv.fetch", "action_version": "1.0", "payload": {"block_hashes": huge}}]})
    .to_string();
    let e = c.kv_hints(&huge).unwrap_err();
    assert!(
        matches!(&e, ClientError::BadInput(m) if m.contains("more than")),
        "{e:?}"
    );
    let (s, v) = admin_json(&admin_sock, "POST", "/v1/kv-hints", Some(huge.as_bytes()));
    assert_eq!((s, v["code"].as_str()), (413, Some("body_too_large")), "{v}");
    let (s, v) = admin_json(&admin_sock, "POST", "/v1/kv-hints", Some(b"{not json"));
    assert_eq!((s, v["code"].as_str()), (400, Some("malformed_envelope")), "{v}");
    // The daemon still serves: the pages the rank holds on device, and on host behind them.
    let hit = c.lookup(&b).unwrap();
    assert_eq!(hit.device + hit.host, 3, "{hit:?}");
    assert_eq!(host_prefix(&admin_sock, &b), 3);

    // The log: every delivered envelope, numbered, with who sent it.
    let (s, v) = admin_json(&admin_sock, "GET", "/v1/kv-hints?since=0", None);
    assert_eq!(s, 200, "{v}");
    let recs = v["records"].as_array().unwrap();
    let got: Vec<(u64, &str, &str)> = recs
        .iter()
        .map(|r| {
            (
                r["seq"].as_u64().unwrap(),
                r["via"].as_str().unwrap(),
                r["message_id"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (1, "client", "m-client"),
            (2, "admin", "m-admin"),
            (3, "client", "m-unknown")
        ]
    );
    let (_, v) = admin_json(&admin_sock, "GET", "/v1/kv-hints?since=2", None);
    assert_eq!(v["records"].as_array().unwrap().len(), 1);

    // The CLI sends an envelope file and prints one line per action.
    let file = dir.path().join("envelope.json");
    std::fs::write(&file, envelope("m-cli", "2.0", &a).to_string()).unwrap();
    let out = std::process::Command::new(common::kvtier_bin())
        .args(["hint", "--envelope"])
        .arg(&file)
        .arg("--socket")
        .arg(&admin_sock)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("m-cli-fetch kv.fetch@2.0: ignored  reason=unsupported_version  source=tcp://10.1.2.3:25000"),
        "{text}"
    );
}
