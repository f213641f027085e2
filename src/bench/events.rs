//! `kvtier bench events`: page events per second published in vLLM's KV event format
//! while a real subscriber on loopback (its own thread and ZMQ SUB socket) receives and
//! msgpack-decodes every batch.
//!
//! The events are written straight into the manager's event log (the publisher's only
//! input), so the figure is the publisher path: log → encode → ZMQ → decode. The
//! producer keeps at most half the ring ahead of the publisher, so the publisher never
//! loses events to the ring; `lost` counts events the subscriber never received. The
//! reference is the same subscriber receiving the same number of pre-encoded batches from
//! a bare PUB socket, without decoding.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;

use crate::clock::SystemClock;
use crate::events::{PageEvent, PageEventKind};
use crate::layout::LayoutSpec;
use crate::manager::{Manager, ManagerConfig};
use crate::page::{Namespace, PageHash};
use crate::publish::vllm::{self, Encoding, VllmConfig};
use crate::shutdown::Shutdown;
use crate::tier::TierKind;

#[derive(Debug, Args)]
pub struct EventsBenchArgs {
    /// Page events to publish.
    #[arg(long, default_value_t = 2_000_000)]
    pub events: u64,
    /// Most events per batch.
    #[arg(long, default_value_t = 1024)]
    pub batch: usize,
    /// Event encoding: `tagged` (vLLM 0.24+, the default) or `positional` (vLLM ≤ 0.23).
    #[arg(long, value_enum, default_value_t = BenchEncoding::Tagged)]
    pub encoding: BenchEncoding,
    /// Give up waiting for the subscriber after this many seconds.
    #[arg(long, default_value_t = 60)]
    pub timeout_s: u64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// The encodings the bench measures (the publisher's [`Encoding`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchEncoding {
    Tagged,
    Positional,
}

impl BenchEncoding {
    fn encoding(self) -> Encoding {
        match self {
            BenchEncoding::Tagged => Encoding::Tagged,
            BenchEncoding::Positional => Encoding::Positional,
        }
    }

    fn name(self) -> &'static str {
        match self {
            BenchEncoding::Tagged => "tagged",
            BenchEncoding::Positional => "positional",
        }
    }
}

#[derive(Debug, Serialize)]
pub struct EventsReport {
    pub events: u64,
    pub received: u64,
    pub lost: u64,
    pub events_per_sec: f64,
    pub batches: u64,
    pub seq_gaps: u64,
    pub elapsed_s: f64,
    pub encoding: &'static str,
    pub max_batch_events: usize,
    /// The same number of pre-encoded batches through a bare PUB/SUB pair, received but
    /// not decoded, as events per second.
    pub reference_events_per_sec: f64,
    pub ratio_to_reference: f64,
}

/// What the subscriber thread saw.
struct Received {
    events: u64,
    batches: u64,
    gaps: u64,
    last_at: Option<Instant>,
}

/// Receives batches until `want` events arrived or nothing came for `idle`; decodes every
/// batch, or (the reference) counts `raw_per_batch` events per message without decoding.
fn subscribe(
    endpoint: &str,
    want: u64,
    raw_per_batch: Option<u64>,
    idle: Duration,
    ready: mpsc::Sender<()>,
) -> anyhow::Result<Received> {
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_rcvhwm(1_000_000)?;
    sub.set_rcvtimeo(idle.as_millis() as i32)?;
    sub.connect(endpoint)?;
    sub.set_subscribe(b"")?;
    let _ = ready.send(());
    let mut r = Received {
        events: 0,
        batches: 0,
        gaps: 0,
        last_at: None,
    };
    let mut expect: Option<u64> = None;
    while r.events < want {
        let frames = match sub.recv_multipart(0) {
            Ok(f) => f,
            Err(zmq::Error::EAGAIN) => break,
            Err(e) => return Err(e.into()),
        };
        let [_, seq, payload] = frames.as_slice() else {
            bail!("a message of {} frames", frames.len());
        };
        let seq = u64::from_be_bytes(seq.as_slice().try_into().context("seq frame is not 8 bytes")?);
        if let Some(e) = expect.filter(|&e| e != seq) {
            r.gaps += seq.saturating_sub(e);
        }
        expect = Some(seq + 1);
        r.batches += 1;
        r.events += match raw_per_batch {
            Some(n) => n,
            None => decode_batch(payload)?,
        };
        r.last_at = Some(Instant::now());
    }
    Ok(r)
}

/// Decodes a batch fully (every field of every event, with kvtier's own consumer-side
/// decoder) and returns its event count.
fn decode_batch(payload: &[u8]) -> anyhow::Result<u64> {
    let b = vllm::decode_batch(payload)?;
    if b.events
        .iter()
        .any(|e| e.kind != PageEventKind::Cleared && (e.hashes.len() != 1 || e.medium.is_none()))
    {
        bail!("an event without its hash or medium");
    }
    Ok(b.events.len() as u64)
}

/// Runs the measurement.
pub fn measure(args: &EventsBenchArgs) -> anyhow::Result<EventsReport> {
    let dir = tempfile::tempdir()?;
    let mut cfg = ManagerConfig::in_dir(dir.path(), 1 << 20, None);
    cfg.arena.lock = false;
    let ring = cfg.event_ring as u64;
    let m = Manager::new(cfg, SystemClock::new())?;
    m.register_namespace(Namespace::model("bench"), LayoutSpec::mha(2, 1, 8, 2, 16).build()?)?;
    let vcfg = VllmConfig {
        endpoint: "tcp://127.0.0.1:*".into(),
        replay_endpoint: None,
        encoding: args.encoding.encoding(),
        max_batch_events: args.batch.max(1),
        ..VllmConfig::default()
    };
    let shutdown = Shutdown::new();
    let publ = vllm::spawn(vcfg.clone(), m.clone(), shutdown.clone())?;
    let endpoint = publ.endpoint().to_owned();
    let idle = Duration::from_secs(args.timeout_s.max(1));
    let want = args.events;
    let (tx, rx) = mpsc::channel();
    let sub = std::thread::spawn(move || subscribe(&endpoint, want, None, idle, tx));
    rx.recv_timeout(Duration::from_secs(10))
        .context("the subscriber did not start")?;
    // ZMQ subscriptions propagate asynchronously; give the SUB time to join.
    std::thread::sleep(Duration::from_millis(300));

    let log = m.pages().events();
    let first = log.last_seq() + 1;
    let t0 = Instant::now();
    let deadline = t0 + idle;
    let mut chunk = Vec::with_capacity(4096);
    let mut seq = first;
    while seq < first + want {
        while seq - publ.counts().next_event > ring / 2 {
            if Instant::now() > deadline {
                bail!("the publisher stopped consuming events");
            }
            // Sleep rather than spin: the publisher and subscriber need the cores.
            std::thread::sleep(Duration::from_micros(200));
        }
        chunk.clear();
        for _ in 0..4096u64.min(first + want - seq) {
            chunk.push(synthetic(seq));
            seq += 1;
        }
        log.append(&chunk);
    }
    let got = sub.join().map_err(|_| anyhow::anyhow!("the subscriber panicked"))??;
    let elapsed = got.last_at.map_or(idle, |t| t - t0).as_secs_f64().max(1e-9);
    let counts = publ.counts();
    publ.stop();

    let reference = reference_rate(&vcfg, want)?;
    let rate = got.events as f64 / elapsed;
    Ok(EventsReport {
        events: want,
        received: got.events,
        lost: want.saturating_sub(got.events) + counts.lost,
        events_per_sec: rate,
        batches: got.batches,
        seq_gaps: got.gaps,
        elapsed_s: elapsed,
        encoding: args.encoding.name(),
        max_batch_events: vcfg.max_batch_events,
        reference_events_per_sec: reference,
        ratio_to_reference: rate / reference.max(1e-9),
    })
}

/// A page event of the synthetic stream: stores and removals over all three tiers.
fn synthetic(seq: u64) -> PageEvent {
    PageEvent {
        seq,
        kind: if seq % 4 == 3 {
            PageEventKind::Removed
        } else {
            PageEventKind::Stored
        },
        tier: TierKind::ALL[(seq % 3) as usize],
        ns: crate::page::NamespaceId(0),
        hash: PageHash::from_u64(seq.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        at_ms: 0,
    }
}

/// The same batches, encoded once ahead, through a bare PUB socket to the same kind of
/// subscriber that only counts them.
fn reference_rate(vcfg: &VllmConfig, events: u64) -> anyhow::Result<f64> {
    let per = vcfg.max_batch_events as u64;
    let evs: Vec<PageEvent> = (1..=per).map(synthetic).collect();
    let mut payload = Vec::new();
    vllm::encode_batch(&mut payload, vcfg, 0.0, &evs, |_| 16);
    let ctx = zmq::Context::new();
    let publ = ctx.socket(zmq::PUB)?;
    publ.set_sndhwm(vcfg.hwm)?;
    publ.bind("tcp://127.0.0.1:*")?;
    let endpoint = publ
        .get_last_endpoint()?
        .map_err(|_| anyhow::anyhow!("endpoint is not UTF-8"))?;
    let batches = events.div_ceil(per);
    let (tx, rx) = mpsc::channel();
    let sub = std::thread::spawn(move || subscribe(&endpoint, batches * per, Some(per), Duration::from_secs(10), tx));
    rx.recv_timeout(Duration::from_secs(10))
        .context("the reference subscriber did not start")?;
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    for seq in 0..batches {
        crate::publish::send_batch(&publ, b"", seq, &payload)?;
    }
    let got = sub
        .join()
        .map_err(|_| anyhow::anyhow!("the reference subscriber panicked"))??;
    let elapsed = got
        .last_at
        .map_or(Duration::from_secs(10), |t| t - t0)
        .as_secs_f64()
        .max(1e-9);
    Ok(got.events as f64 / elapsed)
}

/// `kvtier bench events`.
pub fn run(args: EventsBenchArgs) -> anyhow::Result<()> {
    let r = measure(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{} events ({}) in {:.3} s: {:.0} events/s delivered and decoded, {} lost, {} batches, {} seq gaps",
            r.events, r.encoding, r.elapsed_s, r.events_per_sec, r.lost, r.batches, r.seq_gaps
        );
        println!(
            "reference (bare PUB/SUB, same batches, no encode/decode): {:.0} events/s, ratio {:.2}",
            r.reference_events_per_sec, r.ratio_to_reference
        );
    }
    Ok(())
}
