//! `kvtier bench transfer`: page-move throughput between tiers through the manager, at
//! several object sizes, beside single-thread `memcpy` of the same bytes in the same run.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use super::{gbps, median_time};
use crate::clock::SystemClock;
use crate::hints::{Hint, HintTarget};
use crate::layout::LayoutSpec;
use crate::manager::{LoadWait, Manager, ManagerConfig};
use crate::page::{Namespace, PageHash};
use crate::tier::TierKind;
use crate::tier::device::EmulatedDevice;

/// Which device region the bench moves pages from and to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// A host buffer standing in for GPU memory; moves go through the manager and tiers.
    Emulated,
    /// GPU 0 through cudarc (feature `cuda`); page moves are compared with raw
    /// `cudaMemcpyAsync` of the same bytes.
    Cuda,
}

#[derive(Debug, Args)]
pub struct TransferArgs {
    /// The device region. Default: emulated.
    #[arg(long, value_enum, default_value_t = DeviceKind::Emulated)]
    pub device: DeviceKind,
    /// Object sizes in KiB.
    #[arg(long, value_delimiter = ',', default_values_t = [16u64, 64, 256, 2048])]
    pub sizes_kib: Vec<u64>,
    /// Bytes moved per measurement, in MiB.
    #[arg(long, default_value_t = 128)]
    pub mib: u64,
    /// Pages per store/load request.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Measurements per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Directory for the arena and pool files. Default: a temporary directory in /dev/shm.
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct Row {
    pub path: String,
    pub object_bytes: u64,
    pub pages: usize,
    pub bytes: u64,
    pub gbps: f64,
    pub memcpy_gbps: f64,
    pub ratio: f64,
}

/// Single-thread memcpy of `total` bytes in `chunk`-sized copies between two buffers
/// too large for the caches.
fn memcpy_gbps(total: usize, chunk: usize, runs: usize) -> f64 {
    let src = crate::tier::device::pattern(1, total);
    let mut dst = vec![0u8; total];
    let d = median_time(runs, || {
        for (s, o) in src.chunks(chunk).zip(dst.chunks_mut(chunk)) {
            o.copy_from_slice(s);
        }
        std::hint::black_box(&mut dst);
    });
    gbps(total as u64, d)
}

fn rows_for(object_kib: u64, args: &TransferArgs, dir: &std::path::Path) -> anyhow::Result<Vec<Row>> {
    // Objects of `object_kib`: 4 layers x 16 tokens x token bytes.
    let token_bytes = (object_kib * 1024 / 64) as u32;
    let layout = LayoutSpec::mha(4, 1, token_bytes / 2, 2, 16).build()?;
    let obj = layout.object_bytes(0);
    let page = layout.page_bytes();
    let pages = ((args.mib << 20) / page).max(args.batch as u64) as usize;
    let mut cfg = ManagerConfig::in_dir(dir, (pages as u64 + 8) * page, Some((pages as u64 + 8) * page));
    cfg.max_batch = args.batch.max(pages);
    cfg.transfer_queue = pages.div_ceil(args.batch) + 8;
    let m = Manager::new(cfg, SystemClock::new())?;
    let ns = m.register_namespace(Namespace::model(format!("bench-{object_kib}k")), layout.clone())?;
    let dev = Arc::new(EmulatedDevice::new(&layout, 0, pages as u32));
    m.attach_device(ns, 0, 0, dev.clone())?;
    for s in 0..pages as u32 {
        dev.fill_page(s, s as u64)?;
    }
    let slots: Vec<u32> = (0..pages as u32).collect();
    let bytes = pages as u64 * page;
    let wait = Duration::from_secs(120);
    let mut hashes = Vec::new();
    let mut t_d2h = Vec::new();
    let mut t_h2d = Vec::new();
    let mut t_h2p = Vec::new();
    let mut t_p2h = Vec::new();
    for round in 1..=args.runs.max(1) as u64 {
        hashes = (0..pages as u64).map(|i| PageHash::from_u64(round << 40 | i)).collect();
        // Device → host.
        let t = std::time::Instant::now();
        let tickets: Vec<_> = hashes
            .chunks(args.batch)
            .zip(slots.chunks(args.batch))
            .map(|(h, s)| m.store(ns, 0, 0, h, s, 0))
            .collect::<Result<_, _>>()?;
        for tk in tickets {
            let r = m.wait(tk, wait)?;
            anyhow::ensure!(r.failed == 0 && r.error.is_none(), "store failed: {r:?}");
        }
        t_d2h.push(t.elapsed());
        // Host → device.
        let t = std::time::Instant::now();
        let tickets: Vec<_> = hashes
            .chunks(args.batch)
            .zip(slots.chunks(args.batch))
            .map(|(h, s)| m.load(ns, 0, 0, h, s, LoadWait::BestEffort))
            .collect::<Result<_, _>>()?;
        for tk in tickets {
            let r = m.wait(tk, wait)?;
            anyhow::ensure!(r.failed == 0, "load failed: {r:?}");
        }
        t_h2d.push(t.elapsed());
        // Host → pool.
        let t = std::time::Instant::now();
        for h in hashes.chunks(args.batch) {
            m.hint(
                ns,
                Hint::Share {
                    target: HintTarget::Pages(h.to_vec()),
                },
            )?;
        }
        anyhow::ensure!(m.quiesce(wait), "share did not finish");
        t_h2p.push(t.elapsed());
        // Pool → host: drop host copies (outside the timing), then prefetch them back.
        m.removed(ns, 0, 0, &hashes)?;
        m.make_host_room(usize::MAX);
        anyhow::ensure!(m.lookup(ns, &hashes)?.pool == pages, "pages not in pool after share");
        let t = std::time::Instant::now();
        for h in hashes.chunks(args.batch) {
            m.hint(
                ns,
                Hint::Prefetch {
                    target: HintTarget::Pages(h.to_vec()),
                    to: TierKind::Host,
                    deadline_ms: None,
                },
            )?;
        }
        t_p2h.push(t.elapsed());
        anyhow::ensure!(
            m.lookup(ns, &hashes)?.host == pages,
            "prefetch did not bring every page"
        );
        // Clean slate for the next round.
        m.make_host_room(usize::MAX);
    }
    // Content check: the last round's pages read back equal what the device holds.
    let t = m.load(ns, 0, 0, &hashes[..1], &[0], LoadWait::WaitComplete)?;
    m.wait(t, wait)?;
    anyhow::ensure!(dev.page_matches(0, 0)?, "bytes changed on the way");
    let memcpy = memcpy_gbps(bytes as usize, obj as usize, args.runs);
    let med = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    Ok([
        ("device->host", t_d2h),
        ("host->device", t_h2d),
        ("host->pool", t_h2p),
        ("pool->host", t_p2h),
    ]
    .into_iter()
    .map(|(path, times)| {
        let g = gbps(bytes, med(times));
        Row {
            path: path.into(),
            object_bytes: obj,
            pages,
            bytes,
            gbps: g,
            memcpy_gbps: memcpy,
            ratio: g / memcpy,
        }
    })
    .collect())
}

pub fn run(args: TransferArgs) -> anyhow::Result<()> {
    let tmp;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => {
            let base = if std::path::Path::new("/dev/shm").is_dir() {
                "/dev/shm"
            } else {
                "."
            };
            tmp = tempfile::Builder::new()
                .prefix("kvtier-bench-")
                .tempdir_in(base)
                .context("temporary directory")?;
            tmp.path().to_owned()
        }
    };
    let mut rows = Vec::new();
    for &kib in &args.sizes_kib {
        anyhow::ensure!(
            (1..=64 * 1024).contains(&kib),
            "object size {kib} KiB is out of range (1 KiB to 64 MiB)"
        );
        match args.device {
            DeviceKind::Emulated => rows.extend(rows_for(kib, &args, &dir)?),
            #[cfg(feature = "cuda")]
            DeviceKind::Cuda => rows.extend(super::transfer_cuda::rows_for(kib, &args)?),
            #[cfg(not(feature = "cuda"))]
            DeviceKind::Cuda => anyhow::bail!("this kvtier was built without the `cuda` feature"),
        }
    }
    let reference = match args.device {
        DeviceKind::Emulated => "memcpy GB/s",
        DeviceKind::Cuda => "raw cuMemcpy",
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<14} {:>10} {:>10} {:>12} {:>7}",
            "path", "object", "GB/s", reference, "ratio"
        );
        for r in &rows {
            println!(
                "{:<14} {:>9}K {:>10.2} {:>12.2} {:>7.2}",
                r.path,
                r.object_bytes / 1024,
                r.gbps,
                r.memcpy_gbps,
                r.ratio
            );
        }
    }
    Ok(())
}
