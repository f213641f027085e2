//! `kvtier bench control`: control-socket round trips against a raw Unix-socket echo.
//!
//! An in-process daemon (host backend on a scratch arena) and an echo server that
//! returns each frame as it came, both thread-per-connection and both reading through
//! the same frame reader, are measured in alternating rounds: lookup and hint requests
//! to the daemon, the same request frames to the echo. Batched throughput pipelines
//! `depth` lookups per write on one connection and counts requests per second.

use std::io::BufReader;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;

use crate::client::{Client, ClientConfig};
use crate::clock::SystemClock;
use crate::daemon::{DaemonConfig, ManagedTiers, Shared, Shutdown, server};
use crate::hints::{Hint, HintTarget};
use crate::layout::LayoutSpec;
use crate::page::{Namespace, PageHash};
use crate::protocol::{Identity, Request, frame, read_frame};
use crate::tier::device::EmulatedDevice;

#[derive(Args, Debug, Clone)]
pub struct ControlArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Round trips per measured kind (split into alternating rounds).
    #[arg(long, default_value_t = 20_000)]
    pub iters: usize,
    /// Requests in flight per write in the batched run.
    #[arg(long, default_value_t = 64)]
    pub depth: usize,
    /// Batches in the batched run.
    #[arg(long, default_value_t = 4_000)]
    pub batches: usize,
    /// Page hashes per lookup request.
    #[arg(long, default_value_t = 16)]
    pub pages: usize,
}

/// One frame per call over a raw socket, as the echo and the batched run need.
struct Raw {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    body: Vec<u8>,
}

impl Raw {
    fn connect(path: &PathBuf) -> anyhow::Result<Self> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let reader = BufReader::with_capacity(64 << 10, stream.try_clone()?);
        Ok(Self {
            stream,
            reader,
            body: Vec::new(),
        })
    }

    fn round_trip(&mut self, frame_bytes: &[u8], n: usize) -> anyhow::Result<u8> {
        frame::write_all(&mut self.stream, frame_bytes)?;
        let mut kind = 0;
        for _ in 0..n {
            kind = read_frame(&mut self.reader, 1 << 20, &mut self.body)?.kind;
        }
        Ok(kind)
    }
}

fn echo_server(listener: UnixListener) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { return };
        std::thread::spawn(move || {
            let Ok(read_half) = stream.try_clone() else { return };
            let mut reader = BufReader::with_capacity(64 << 10, read_half);
            let mut writer = &stream;
            let (mut body, mut out) = (Vec::new(), Vec::with_capacity(64 << 10));
            while let Ok(h) = read_frame(&mut reader, 1 << 20, &mut body) {
                out.extend_from_slice(&h.encode());
                out.extend_from_slice(&body);
                if reader.buffer().is_empty() {
                    if frame::write_all(&mut writer, &out).is_err() {
                        return;
                    }
                    out.clear();
                }
            }
        });
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn time_us(f: &mut impl FnMut() -> anyhow::Result<()>, n: usize, out: &mut Vec<f64>) -> anyhow::Result<()> {
    for _ in 0..n {
        let t = Instant::now();
        f()?;
        out.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    Ok(())
}

pub fn run(args: ControlArgs) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("kvtier-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = measure(&args, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    let r = result?;
    let ratio = r.0[2] / r.0[0];
    let pass = ratio <= 2.0 && r.1 >= 200_000.0;
    let json = serde_json::json!({
        "echo_p50_us": r.0[0], "echo_p99_us": r.0[1],
        "p50_us": r.0[2], "p99_us": r.0[3],
        "lookup_p50_us": r.0[4], "lookup_p99_us": r.0[5],
        "hint_p50_us": r.0[6], "hint_p99_us": r.0[7],
        "ratio_p50": ratio,
        "batched_ops_per_sec": r.1,
        "batch_depth": args.depth, "pages_per_lookup": args.pages, "iters": args.iters,
        "cpus": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "goal_ratio_p50": 2.0, "goal_batched_ops_per_sec": 200_000, "pass": pass,
    });
    if args.json {
        println!("{json}");
    } else {
        println!(
            "echo p50 {:.1} us | lookup+hint p50 {:.1} us p99 {:.1} us | ratio {:.2} | batched {:.0} ops/s | {}",
            r.0[0],
            r.0[2],
            r.0[3],
            ratio,
            r.1,
            if pass { "goals met" } else { "goals NOT met" }
        );
    }
    Ok(())
}

/// Returns `[echo p50, echo p99, mixed p50, mixed p99, lookup p50, p99, hint p50, p99]`
/// and batched ops/s.
fn measure(args: &ControlArgs, dir: &std::path::Path) -> anyhow::Result<([f64; 8], f64)> {
    let cfg = DaemonConfig {
        socket: dir.join("kvtier.sock"),
        arena_path: dir.join("arena"),
        arena_bytes: 64 << 20,
        pool_bytes: 0,
        recover: false,
        lock_arena: false,
        ..DaemonConfig::default()
    };
    let backend = Arc::new(ManagedTiers::open(cfg.tiers(), SystemClock::new())?);
    let shared = Arc::new(Shared::new(backend, cfg.limits()));
    let shutdown = Shutdown::new();
    let listener = UnixListener::bind(&cfg.socket)?;
    let (sd, sock) = (shutdown.clone(), cfg.socket.clone());
    let daemon = std::thread::spawn(move || server::run_blocking(listener, sd, shared, Duration::from_millis(100)));
    let echo_path = dir.join("echo.sock");
    let echo_listener = UnixListener::bind(&echo_path)?;
    std::thread::spawn(move || echo_server(echo_listener));

    let spec = LayoutSpec::mha(4, 2, 64, 2, 16);
    let identity = Identity {
        instance: "bench".into(),
        namespace: Namespace::model("bench"),
        tp_size: 1,
        pp_size: 1,
        ..Identity::default()
    };
    let client = Client::connect(ClientConfig::new(&sock, identity.clone(), spec.clone()))?;
    let layout = spec.clone().build()?;
    let dev = Arc::new(EmulatedDevice::new(&layout, 0, 64));
    client.register_device(dev.clone())?;
    let hashes: Vec<PageHash> = (0..args.pages as u64)
        .map(|i| PageHash::from_u64(0xbe7c_0000 + i))
        .collect();
    for chunk in hashes.chunks(64) {
        let slots: Vec<u32> = (0..chunk.len() as u32).collect();
        client.store(chunk, &slots, "")?;
    }
    if client.lookup(&hashes)?.total() != hashes.len() {
        bail!("bench pages did not become host hits");
    }
    let hint = Hint::Retain {
        target: HintTarget::Pages(hashes.clone()),
        priority: 1,
        ttl_ms: 60_000,
    };
    let mut lookup_frame = Vec::new();
    Request::Lookup { hashes: hashes.clone() }.encode(1, &mut lookup_frame);
    let mut hint_frame = Vec::new();
    Request::Hint(hint.clone()).encode(1, &mut hint_frame);

    let mut echo = Raw::connect(&echo_path)?;
    let (mut e, mut l, mut h) = (Vec::new(), Vec::new(), Vec::new());
    let rounds = 10;
    let per = (args.iters / rounds).max(1);
    for _ in 0..rounds {
        time_us(&mut || echo.round_trip(&lookup_frame, 1).map(drop), per / 2, &mut e)?;
        time_us(&mut || echo.round_trip(&hint_frame, 1).map(drop), per / 2, &mut e)?;
        time_us(
            &mut || client.lookup(&hashes).map(drop).map_err(Into::into),
            per / 2,
            &mut l,
        )?;
        time_us(
            &mut || client.hint(hint.clone()).map(drop).map_err(Into::into),
            per / 2,
            &mut h,
        )?;
    }
    let mut mixed: Vec<f64> = l.iter().chain(&h).copied().collect();
    for v in [&mut e, &mut l, &mut h, &mut mixed] {
        v.sort_by(f64::total_cmp);
    }

    // Batched: a raw connected session pipelining `depth` lookups per write.
    let mut raw = Raw::connect(&sock)?;
    let mut hello = Vec::new();
    Request::Connect { identity, layout: spec }.encode(1, &mut hello);
    raw.round_trip(&hello, 1).context("batched session connect")?;
    let mut batch = Vec::new();
    for i in 0..args.depth {
        Request::Lookup { hashes: hashes.clone() }.encode(i as u64 + 1, &mut batch);
    }
    let t = Instant::now();
    for _ in 0..args.batches {
        let kind = raw.round_trip(&batch, args.depth)?;
        if kind != crate::protocol::kind::R_LOOKUP {
            bail!("batched lookup answered with kind {kind:#x}");
        }
    }
    let ops = (args.batches * args.depth) as f64 / t.elapsed().as_secs_f64();
    drop((raw, client, echo));
    shutdown.cancel();
    daemon.join().map_err(|_| anyhow::anyhow!("daemon thread panicked"))??;
    Ok((
        [
            percentile(&e, 0.5),
            percentile(&e, 0.99),
            percentile(&mixed, 0.5),
            percentile(&mixed, 0.99),
            percentile(&l, 0.5),
            percentile(&l, 0.99),
            percentile(&h, 0.5),
            percentile(&h, 0.99),
        ],
        ops,
    ))
}
