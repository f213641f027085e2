//! The `kvtier` commands that talk to a running daemon over its admin socket: `status`,
//! `pages`, `sessions`, `hint` and `events`. They print readable tables by default and
//! the daemon's JSON with `--json`.
//!
//! Exit codes: 0 ok; 1 a local error (bad input, a malformed answer); 2 the daemon is
//! unreachable (no socket, nobody listening); 3 the daemon refused the request (any
//! error answer, e.g. a peer not on the allowlist, a malformed hint). Usage errors exit 64.

pub mod client;
mod render;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{Value, json};

use client::{ClientError, Response};

pub const EXIT_OK: i32 = 0;
pub const EXIT_UNREACHABLE: i32 = 2;
pub const EXIT_REFUSED: i32 = 3;
pub const EXIT_USAGE: i32 = 64;

/// Options every admin command takes.
#[derive(Debug, Clone, Args)]
pub struct Common {
    /// The daemon's admin socket. Default: `$XDG_RUNTIME_DIR/kvtier/admin.sock`, else
    /// `./.kvtier/admin.sock`.
    #[arg(long, env = "KVTIER_ADMIN_SOCKET", default_value_os_t = crate::admin::default_socket_path())]
    pub socket: PathBuf,
    /// Print the daemon's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The admin commands (beside `serve` and `bench` in the `kvtier` binary).
#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Version, uptime, tiers, connected engines and ranks.
    Status(#[command(flatten)] Common),
    /// Per-tier completeness of pages, and which objects are missing.
    Pages(PagesArgs),
    /// Sessions the daemon tracks.
    Sessions(#[command(flatten)] Common),
    /// Send a KV hint and print its outcome.
    Hint(HintArgs),
    /// Follow page events (or, with `--sessions`, session pauses and resumes) as they happen.
    Events(EventsArgs),
}

#[derive(Debug, Args)]
pub struct PagesArgs {
    /// One page hash (hex).
    #[arg(required_unless_present = "prefix", conflicts_with = "prefix")]
    pub hash: Option<String>,
    /// A chain of page hashes (hex, comma-separated): also prints the complete prefix per tier.
    #[arg(long, value_delimiter = ',')]
    pub prefix: Vec<String>,
    /// Namespace id.
    #[arg(long, default_value_t = 0)]
    pub ns: u16,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum HintKindArg {
    Share,
    Prefetch,
    Demote,
    Pin,
    Retain,
}

#[derive(Debug, Args)]
pub struct HintArgs {
    /// The hint kind (not with `--envelope`).
    #[arg(required_unless_present = "envelope")]
    pub kind: Option<HintKindArg>,
    /// Send a Dynamo KvHint envelope (a JSON file, `-` for stdin) instead of one hint;
    /// prints each action's outcome.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["kind", "hashes", "session"])]
    pub envelope: Option<std::path::PathBuf>,
    /// Page hashes (hex) the hint names.
    pub hashes: Vec<String>,
    /// Treat the hashes as a chain: the hint applies to its leading pages kvtier holds.
    #[arg(long)]
    pub prefix: bool,
    /// Target a session instead of pages.
    #[arg(long, conflicts_with = "hashes")]
    pub session: Option<String>,
    /// Tier for `pin` (device, host, pool). Default: host.
    #[arg(long, default_value = "host")]
    pub tier: String,
    /// Destination for `prefetch` (host, device; default host) and `demote` (host, pool; default pool).
    #[arg(long)]
    pub to: Option<String>,
    /// TTL for `pin` and `retain`, in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    pub ttl_ms: u64,
    /// Priority for `retain`.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
    pub priority: i8,
    /// Deadline for `prefetch`, in milliseconds.
    #[arg(long)]
    pub deadline_ms: Option<u64>,
    #[arg(long, default_value_t = 0)]
    pub ns: u16,
    #[command(flatten)]
    pub common: Common,
}

#[derive(Debug, Args)]
pub struct EventsArgs {
    /// First event sequence to print (default: only new events).
    #[arg(long)]
    pub from: Option<u64>,
    /// Stop after this many events.
    #[arg(long)]
    pub limit: Option<u64>,
    /// Follow session events instead (the pressure controller's pauses and resumes, with
    /// the reason and utilisation); reading them takes no advice from engines or routers.
    #[arg(long)]
    pub sessions: bool,
    #[command(flatten)]
    pub common: Common,
}

/// Runs one admin command; returns the process exit code.
pub fn run(cmd: AdminCommand) -> anyhow::Result<i32> {
    let r = match cmd {
        AdminCommand::Status(c) => get(&c, "/v1/status", render::status),
        AdminCommand::Sessions(c) => get(&c, "/v1/sessions", render::sessions),
        AdminCommand::Pages(a) => {
            let target = match &a.hash {
                Some(h) => format!("/v1/pages?ns={}&hash={h}", a.ns),
                None => format!("/v1/pages?ns={}&prefix={}", a.ns, a.prefix.join("%2C")),
            };
            get(&a.common, &target, render::pages)
        }
        AdminCommand::Hint(a) => hint(&a),
        AdminCommand::Events(a) => events(&a),
    };
    match r {
        Ok(code) => Ok(code),
        Err(e) => match e.downcast_ref::<ClientError>() {
            Some(ClientError::Unreachable { .. } | ClientError::Untrusted { .. }) => {
                eprintln!("kvtier: {e}");
                Ok(EXIT_UNREACHABLE)
            }
            _ => Err(e),
        },
    }
}

/// Prints an error answer and gives the "refused" exit code.
fn refused(status: u16, body: &[u8]) -> i32 {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let code = v["code"].as_str().unwrap_or("unknown");
    let msg = v["message"].as_str().unwrap_or("");
    eprintln!("kvtier: the daemon refused the request ({status} {code}): {msg}");
    EXIT_REFUSED
}

fn call(
    c: &Common,
    method: &str,
    target: &str,
    body: Option<&[u8]>,
    render: fn(&Value) -> String,
) -> anyhow::Result<i32> {
    let resp = client::request(&c.socket, method, target, body, Some(Duration::from_secs(30)))?;
    let status = resp.status;
    let body = resp.body()?;
    if status >= 400 {
        return Ok(refused(status, &body));
    }
    let v: Value = serde_json::from_slice(&body).context("the daemon's answer is not JSON")?;
    if c.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", render(&v));
    }
    Ok(EXIT_OK)
}

fn get(c: &Common, target: &str, render: fn(&Value) -> String) -> anyhow::Result<i32> {
    call(c, "GET", target, None, render)
}

fn hint(a: &HintArgs) -> anyhow::Result<i32> {
    if let Some(path) = &a.envelope {
        let body = if path.as_os_str() == "-" {
            let mut b = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin().lock(), &mut b)?;
            b
        } else {
            std::fs::read(path).with_context(|| format!("reading {}", path.display()))?
        };
        return call(
            &a.common,
            "POST",
            &format!("/v1/kv-hints?ns={}", a.ns),
            Some(&body),
            render::kv_hints,
        );
    }
    let Some(kind) = a.kind else {
        anyhow::bail!("a hint kind or --envelope is needed");
    };
    let target = match (&a.session, a.prefix) {
        (Some(s), _) => json!({ "session": s }),
        (None, true) => json!({ "prefix": a.hashes }),
        (None, false) => json!({ "pages": a.hashes }),
    };
    let h = match kind {
        HintKindArg::Share => json!({ "kind": "share", "target": target }),
        HintKindArg::Prefetch => json!({
            "kind": "prefetch", "target": target, "to": a.to.as_deref().unwrap_or("host"),
            "deadline_ms": a.deadline_ms,
        }),
        HintKindArg::Demote => json!({ "kind": "demote", "target": target, "to": a.to.as_deref().unwrap_or("pool") }),
        HintKindArg::Pin => json!({ "kind": "pin", "target": target, "tier": a.tier, "ttl_ms": a.ttl_ms }),
        HintKindArg::Retain => {
            json!({ "kind": "retain", "target": target, "priority": a.priority, "ttl_ms": a.ttl_ms })
        }
    };
    let body = serde_json::to_vec(&h)?;
    call(
        &a.common,
        "POST",
        &format!("/v1/hints?ns={}", a.ns),
        Some(&body),
        render::outcome,
    )
}

fn events(a: &EventsArgs) -> anyhow::Result<i32> {
    let mut target = String::from(if a.sessions {
        "/v1/sessions/events?"
    } else {
        "/v1/events?"
    });
    if let Some(f) = a.from {
        target.push_str(&format!("from={f}&"));
    }
    if let Some(l) = a.limit {
        target.push_str(&format!("limit={l}"));
    }
    let mut resp: Response = client::request(&a.common.socket, "GET", &target, None, None)?;
    if resp.status >= 400 {
        let status = resp.status;
        return Ok(refused(status, &resp.body()?));
    }
    let mut pending = Vec::new();
    while let Some(chunk) = resp.next_chunk()? {
        pending.extend_from_slice(&chunk);
        while let Some(i) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=i).collect();
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            if a.common.json {
                println!("{text}");
            } else {
                println!("{}", render::event_line(&text));
            }
        }
    }
    Ok(EXIT_OK)
}
